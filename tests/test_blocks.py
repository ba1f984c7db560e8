"""Block modules against independent references."""

import pytest
import torch
import torch.nn.functional as F

from archlab.block import BuildContext, MixerInput
from archlab.ops.attention import attend, band_mask, local_attend
from blocks.attention import AttentionSpec
from blocks.gated_deltanet import GatedDeltaNetSpec
from blocks.retnet import RetentionSpec
from blocks.swa import SlidingWindowSpec


def naive_window_attention(q, k, v, window):
    """Per query, softmax over its allowed keys only (no mask tricks): [B, N, H, D] layout, GQA."""
    batch, n, heads, dim = q.shape
    k = k.repeat_interleave(heads // k.shape[2], dim=2)
    v = v.repeat_interleave(heads // v.shape[2], dim=2)
    out = torch.empty_like(q)
    for i in range(n):
        lo = 0 if window is None else max(0, i - window + 1)
        scores = torch.einsum("bhd,bjhd->bhj", q[:, i], k[:, lo : i + 1]) / dim**0.5
        out[:, i] = torch.einsum("bhj,bjhd->bhd", scores.softmax(-1), v[:, lo : i + 1])
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("n", [1, 9])
def test_masked_gqa_attention_folds_query_groups_exactly(window, n):
    """Masked attention with GQA (decoding, chunked prefill) folds each K,V head's query heads
    into the query axis; the same as the naive per-query softmax on the last n of 23 positions."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 23, 6, 8, dtype=torch.float64), torch.randn(2, 23, 2, 8, dtype=torch.float64), torch.randn(2, 23, 2, 8, dtype=torch.float64)
    positions = torch.arange(23)[None].expand(2, -1)
    out = attend(q[:, -n:], k, v, band_mask(positions[:, -n:], positions, window))
    torch.testing.assert_close(out, naive_window_attention(q, k, v, window)[:, -n:], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("block", [None, 1, 3, 5, 8, 64])
@pytest.mark.parametrize("n", [1, 13, 23])
def test_blockwise_window_attention_with_any_block_size_matches_naive(block, n):
    """Blocks smaller than, equal to and larger than the window W=5, over queries that follow
    earlier positions (chunked prefill: the last n of 23) or start at 0 (n=23)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 23, 6, 8, dtype=torch.float64), torch.randn(2, 23, 2, 8, dtype=torch.float64), torch.randn(2, 23, 2, 8, dtype=torch.float64)
    positions = torch.arange(23)[None]
    out = local_attend(q[:, -n:], k, v, positions[:, -n:], positions, 5, block=block)
    torch.testing.assert_close(out, naive_window_attention(q, k, v, 5)[:, -n:], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window", [23, 24, 10**6])
@pytest.mark.parametrize("n", [9, 23])
def test_a_window_past_the_keys_is_plain_causal_attention(window, n):
    """A window at least as long as the keys sees every one of them, and takes memory for them
    alone: a window of a million over 23 positions allocates no more than one of 23."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 23, 6, 8, dtype=torch.float64), torch.randn(2, 23, 2, 8, dtype=torch.float64), torch.randn(2, 23, 2, 8, dtype=torch.float64)
    positions = torch.arange(23)[None]
    out = local_attend(q[:, -n:], k, v, positions[:, -n:], positions, window)
    torch.testing.assert_close(out, naive_window_attention(q, k, v, None)[:, -n:], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window", [None, 1, 5, 16])
@pytest.mark.parametrize("n", [1, 9, 37])
def test_sliding_window_attention_matches_naive_and_fla(window, n):
    spec = SlidingWindowSpec(type="swa", window=window) if window else AttentionSpec(type="attention")
    spec = spec.model_copy(update={"n_heads": 4, "n_kv_heads": 2})
    module = spec.build(BuildContext(d_model=32, rope_theta=10_000.0)).double()
    x = torch.randn(2, n, 32, dtype=torch.float64)
    positions = torch.arange(n).expand(2, n)
    got = module(x, MixerInput(positions))

    q, k, v = module.project(x, positions)
    expected = naive_window_attention(q, k, v, window)
    torch.testing.assert_close(got, module.o_proj(expected.reshape(2, n, 32)), rtol=1e-10, atol=1e-12)

    fla_naive = pytest.importorskip("fla.ops.attn.naive")
    reference, _ = fla_naive.naive_parallel_attn(q, k, v, window_size=window)
    torch.testing.assert_close(expected, reference.to(expected.dtype), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("window", [None, 4])
def test_cached_attention_reads_each_rows_keys_given_positions_for_all_rows(window):
    """MixerInput's positions may be [1, N] for a batch of rows: the window's ring gathered its
    slots by them and handed every row the first row's keys (a prefill chunk after it raised)."""
    spec = SlidingWindowSpec(type="swa", window=window) if window else AttentionSpec(type="attention")
    module = spec.model_copy(update={"n_heads": 2, "head_dim": 4}).build(BuildContext(d_model=8, rope_theta=10_000.0)).double()
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    whole = module(x, MixerInput(torch.arange(12)[None], causal=True))
    state = module.new_state(2, 12, torch.float64)
    pieces = [module(x[:, a:b], MixerInput(torch.arange(a, b)[None], state)) for a, b in ((0, 6), (6, 10), (10, 11), (11, 12))]
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=1e-10, atol=1e-12)


def test_window_is_crossed_in_the_tiny_specs():
    """The tiny window must be shorter than the sequences the tests use, or nothing is tested."""
    from conftest import TINY

    import archlab

    windows = [b.window for p in TINY for _, h in archlab.load_spec(p).halves for b in h.blocks if b.type == "swa"]
    assert windows and max(windows) < 24


def test_rope_is_relative():
    """Scores after RoPE depend only on the offset between positions."""
    from archlab.rope import Rotary

    rope = Rotary(8, 10_000.0).double()
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
    score = lambda i, j: (rope(q, torch.tensor([i])) * rope(k, torch.tensor([j]))).sum()  # noqa: E731
    torch.testing.assert_close(score(7, 3), score(104, 100))
    assert not torch.isclose(score(7, 3), score(7, 4))


@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 2e-2), (torch.float64, 1e-12)])
def test_rope_keeps_its_angles_in_any_model_dtype(dtype, tolerance):
    """A model cast to bfloat16 (to serve) or float64 (a reference) rotates by the angles worked
    out from first principles in float64, to its dtype's precision. When the frequencies were a
    buffer, casting the model cast them: in bfloat16, angles at position 4,096 were off by radians."""
    import archlab
    from archlab.rope import Rotary
    from conftest import ROOT

    model = archlab.build_model(archlab.load_spec(ROOT / "specs" / "tiny" / "yoco-u.yaml"), dtype=dtype)
    rope = next(m for m in model.modules() if isinstance(m, Rotary))
    d = rope.head_dim
    x = torch.randn(1, 64, 2, d).to(dtype)
    positions = torch.arange(4096 - 64, 4096)[None]
    angle = positions[0, :, None].double() * rope.theta ** (-2 * torch.arange(d // 2, dtype=torch.float64) / d)
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
    even, odd = x.double()[..., 0::2], x.double()[..., 1::2]
    expected = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    assert (rope(x, positions).double() - expected).abs().max() / expected.abs().max() < tolerance


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-model", "autocast"])
def test_moe_routes_bf16_tokens_as_float64_would(autocast):
    """The router multiplies out its scores in float32, in a bfloat16 model (to serve) as under
    autocast (to train). In bfloat16 their rounding sent a few tokens in a thousand to another
    set of experts than the same weights and tokens do in float64."""
    from archlab.ffn import MoEFFN
    from archlab.spec import MoE

    torch.manual_seed(0)
    moe = MoEFFN(64, MoE(type="moe", n_experts=8, top_k=2, expert_hidden=16), init_std=0.02)
    moe = moe if autocast else moe.bfloat16()
    tokens = torch.randn(16384, 64).bfloat16()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        scores = moe.route(tokens)
    exact = tokens.double() @ moe.router.weight.double().T
    experts = lambda s: s.topk(moe.top_k).indices.sort(-1).values  # noqa: E731
    assert scores.dtype == torch.float32
    assert torch.equal(experts(scores), experts(exact))


@pytest.mark.parametrize("gated", [False, True])
def test_retention_block_chunk_sizes_agree(gated):
    """The block's output does not depend on the chunk size of its core op (chunks are exact)."""
    ctx = BuildContext(d_model=32, rope_theta=10_000.0)
    x = torch.randn(2, 45, 32, dtype=torch.float64)
    outs = []
    for chunk in (4, 16, 64):
        torch.manual_seed(1)
        module = RetentionSpec(type="retnet", n_heads=4, gated=gated, chunk_size=chunk).build(ctx).double()
        outs.append(module(x, MixerInput(torch.arange(45).expand(2, 45))))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(outs[0], outs[2], rtol=1e-10, atol=1e-12)


def test_gated_deltanet_block_matches_fla_recurrent_reference(monkeypatch):
    """Swap the block's chunked op for fla's naive recurrent reference: same output."""
    fla_naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")

    module = GatedDeltaNetSpec(type="gdn", n_heads=2, chunk_size=8).build(BuildContext(32, None)).double()
    x = torch.randn(2, 29, 32, dtype=torch.float64)
    got = module(x, MixerInput(torch.arange(29).expand(2, 29)))

    def reference_op(q, k, v, g, beta, chunk_size):
        out, _ = fla_naive.naive_recurrent_gated_delta_rule(q, k, v, beta, g)
        return out.to(q.dtype), None

    monkeypatch.setattr(module, "kernels", lambda device: {"chunk_gated_delta_rule": reference_op})
    torch.testing.assert_close(got, module(x, MixerInput(torch.arange(29).expand(2, 29))), rtol=1e-5, atol=1e-6)


def test_windowed_attention_with_parscale_prefix_matches_dense():
    """Blockwise local attention with per-stream prefix K,V equals one dense masked SDPA."""
    from archlab.ops.attention import attend, band_mask, with_prefix

    ctx = BuildContext(d_model=32, rope_theta=10_000.0, streams=2, prefix_len=3)
    module = SlidingWindowSpec(type="swa", window=5, n_heads=4, n_kv_heads=2).build(ctx).double()
    x = torch.randn(4, 70, 32, dtype=torch.float64)  # 2 sequences x 2 streams
    positions = torch.arange(70).expand(4, 70)
    got = module(x, MixerInput(positions))
    q, k, v = module.project(x, positions)
    prefix = (module.prefix_k.repeat(2, 1, 1, 1), module.prefix_v.repeat(2, 1, 1, 1))
    dense = attend(*with_prefix(q, k, v, band_mask(positions, positions, 5), prefix))
    torch.testing.assert_close(got, module.o_proj(dense.reshape(4, 70, 32)), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_balance_loss_is_the_share_of_routed_slots_times_the_mean_probability(top_k):
    """w * E * sum_e f_e P_e, counted token by token; a float64 model's shares were rounded to float32 (7e-9 off)."""
    from archlab.ffn import MoEFFN
    from archlab.spec import MoE

    torch.manual_seed(0)
    moe = MoEFFN(16, MoE(type="moe", n_experts=8, top_k=top_k, expert_hidden=8, aux_loss_weight=0.01), 0.5).double()
    tokens = torch.randn(40, 16, dtype=torch.float64)
    aux = []
    moe(tokens, aux_losses=aux)
    probs = [(moe.router.weight @ token).softmax(-1) for token in tokens]
    slots = [0] * 8
    for p in probs:
        for expert in p.topk(top_k).indices.tolist():
            slots[expert] += 1
    shares = torch.tensor(slots, dtype=torch.float64) / (len(tokens) * top_k)
    expected = 0.01 * 8 * (shares * torch.stack(probs).mean(0)).sum()
    torch.testing.assert_close(aux[0], expected, rtol=1e-14, atol=0)
    assert moe.last_load.dtype == torch.float64 and torch.equal(moe.last_load, shares)


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_matches_a_token_by_token_reference_and_trains_its_router(top_k):
    """Each token's output is its chosen experts' SwiGLU outputs weighted as Switch (k = 1: the
    router probability) or Mixtral (k > 1: renormalised top-k) weight them, so the language-model
    loss alone reaches the router. Renormalising a single expert made its weight 1, and the
    router then learnt from the balance loss only."""
    from archlab.ffn import MoEFFN
    from archlab.spec import MoE

    torch.manual_seed(0)
    moe = MoEFFN(16, MoE(type="moe", n_experts=4, top_k=top_k, expert_hidden=8, aux_loss_weight=0.0), 0.5).double()
    tokens = torch.randn(32, 16, dtype=torch.float64)
    out = moe(tokens, aux_losses=[])
    for token, got in zip(tokens, out):
        probs = (moe.router.weight @ token).softmax(-1)
        top = probs.topk(top_k)
        weights = top.values / top.values.sum() if top_k > 1 else top.values
        expected = 0
        for weight, expert in zip(weights, top.indices):
            gate, up = (token @ moe.gate_up[expert]).chunk(2)
            expected = expected + weight * ((F.silu(gate) * up) @ moe.down[expert])
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    assert moe.router.weight.grad.abs().max() > 1e-3
