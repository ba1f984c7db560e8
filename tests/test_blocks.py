"""Block modules against independent references."""

import math

import pytest
import torch
import torch.nn.functional as F

from archlab.block import BuildContext, MixerInput
from archlab.ops.attention import attend, band_mask, folded_attention, local_attend
from archlab.ops.common import decay_parameters
from archlab.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
from archlab.ops.retention import fused_recurrent_simple_gla
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
    into the query axis (on the CPU, for one query); folded or not, the same as the naive
    per-query softmax on the last n of 23 positions."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 23, 6, 8, dtype=torch.float64), torch.randn(2, 23, 2, 8, dtype=torch.float64), torch.randn(2, 23, 2, 8, dtype=torch.float64)
    positions = torch.arange(23)[None].expand(2, -1)
    mask = band_mask(positions[:, -n:], positions, window)
    for out in (attend(q[:, -n:], k, v, mask), folded_attention(q[:, -n:], k, v, mask)):
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


@pytest.mark.parametrize("spec, rope_theta", [(GatedDeltaNetSpec(type="gdn", n_heads=2, chunk_size=8), None),
                                              (RetentionSpec(type="retnet", n_heads=2, chunk_size=8), 10_000.0)],
                         ids=["gdn", "retnet"])
def test_the_head_norm_reads_autocast_heads_in_its_weights_dtype(spec, rope_theta):
    """Under the trainer's bfloat16 autocast the heads leave the ops in bfloat16; the head norm
    reads them in its float32 weight's dtype, as PyTorch's fused RMSNorm needs (it warned of the
    mismatch, once a process, and took its slower path)."""
    mixer, read = spec.build(BuildContext(32, rope_theta)), []
    mixer.head_norm.register_forward_pre_hook(lambda norm, inputs: read.append(inputs[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixer(torch.randn(2, 16, 32), MixerInput(torch.arange(16)[None]))
    assert read == [torch.float32]


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-model", "autocast"])
def test_moe_routes_bf16_tokens_as_float64_would(autocast):
    """The router multiplies out its scores in float32, in a bfloat16 model (to serve) as under
    autocast (to train). In bfloat16 their rounding sent a few tokens in a thousand to another
    set of experts than the same weights and tokens do in float64."""
    from archlab.ffn import MoEFFN
    from archlab.ffn import MoE

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
    from archlab.ffn import MoE

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


def test_moe_balance_loss_trains_the_router_through_its_mean_probabilities():
    """The balance loss reaches the router through P_e alone (the routed shares f_e count choices,
    with no gradient): its gradient is that of w * E * sum_e f_e P_e with f_e held constant, worked
    token by token from a copy of the router's weight. Without it the loss balances nothing."""
    from archlab.ffn import MoEFFN
    from archlab.ffn import MoE

    torch.manual_seed(0)
    moe = MoEFFN(16, MoE(type="moe", n_experts=8, top_k=2, expert_hidden=8, aux_loss_weight=0.01), 0.5).double()
    tokens = torch.randn(40, 16, dtype=torch.float64)
    aux = []
    moe(tokens, aux_losses=aux)
    aux[0].backward()
    weight = moe.router.weight.detach().clone().requires_grad_()
    probs = torch.stack([(weight @ token).softmax(-1) for token in tokens])
    shares = torch.zeros(8, dtype=torch.float64)
    for p in probs.detach():
        shares[p.topk(2).indices] += 1 / (len(tokens) * 2)
    (0.01 * 8 * (shares * probs.mean(0)).sum()).backward()
    assert weight.grad.abs().max() > 1e-4
    torch.testing.assert_close(moe.router.weight.grad, weight.grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_matches_a_token_by_token_reference_and_trains_its_router(top_k):
    """Each token's output is its chosen experts' SwiGLU outputs weighted as Switch (k = 1: the
    router probability) or Mixtral (k > 1: renormalised top-k) weight them, so the language-model
    loss alone reaches the router. Renormalising a single expert made its weight 1, and the
    router then learnt from the balance loss only."""
    from archlab.ffn import MoEFFN
    from archlab.ffn import MoE

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


def test_moe_adds_its_shared_experts_swiglu_to_every_token():
    """n_shared experts every token uses, one SwiGLU of n_shared times the expert width: its
    output added to the routed experts' (the first half of gate_up is the gate, through SiLU)."""
    from archlab.ffn import MoEFFN
    from archlab.ffn import MoE

    torch.manual_seed(0)
    spec = MoE(type="moe", n_experts=4, top_k=2, expert_hidden=8, n_shared=2, aux_loss_weight=0.0)
    moe = MoEFFN(16, spec, 0.5).double()
    tokens = torch.randn(2, 5, 16, dtype=torch.float64)
    out = moe(tokens, aux_losses=[])
    assert moe.shared.down.weight.shape == (16, 16)
    for token, got in zip(tokens.reshape(-1, 16), out.reshape(-1, 16)):
        top = (moe.router.weight @ token).softmax(-1).topk(2)
        expected = 0
        for weight, expert in zip(top.values / top.values.sum(), top.indices):
            gate, up = (token @ moe.gate_up[expert]).chunk(2)
            expected = expected + weight * ((F.silu(gate) * up) @ moe.down[expert])
        gate, up = (moe.shared.gate_up.weight @ token).chunk(2)
        expected = expected + moe.shared.down.weight @ (F.silu(gate) * up)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


# --- Whole block modules against the published layers (fla's, with its Triton pieces swapped for
# PyTorch ones: its kernels for archlab's recurrent ops, which tests/test_ops.py holds equal to fla's
# naive references, and which compute in float64 where those cast to float32): projections, short
# convs, gates, norms, head splits, decay, and the cached path (a prefill in two chunks, then
# decoding steps), weights copied across, in float64.


class _LayerCache:
    """What fla's layers read and write of a Cache: per-layer dicts and the tokens seen."""

    def __init__(self):
        self.layers, self.seen = [], 0

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def get_seq_length(self, layer_idx=0):
        return self.seen

    def update(self, layer_idx=0, offset=0, **states):
        if len(self.layers) <= layer_idx:
            self.layers.append({})
        self.layers[layer_idx].update(states)
        self.seen += offset
        return self.layers[layer_idx]


class _Call(torch.nn.Module):
    """A function where fla's layer holds a module (its Triton norm, rotary or conv)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _fla_short_conv(weight):
    """fla's ShortConvolution (depthwise causal conv, silu), its cache being the whole input history."""
    def conv(x, cache=None, output_final_state=False, cu_seqlens=None, **_):
        history = x.transpose(1, 2) if cache is None else torch.cat([cache, x.transpose(1, 2)], -1)
        y = F.conv1d(F.pad(history, (weight.shape[-1] - 1, 0)), weight, groups=weight.shape[0])[..., -x.shape[1]:]
        return F.silu(y).transpose(1, 2), history if output_final_state else None
    return _Call(conv)


def _fla_norm_gate(weight, eps):
    """fla's FusedRMSNormGated: RMSNorm(o) * weight * silu(g)."""
    def norm(o, g):
        o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + eps)
        return (o if weight is None else o * weight) * F.silu(g)
    return _Call(norm)


def _rows_for_interleaved_rope(heads, head_dim):
    """q/k projection rows that make fla's rotate-half RoPE rotate what archlab's interleaved one does."""
    half = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return (torch.arange(heads)[:, None] * head_dim + half).reshape(-1)


def _fla_rotary(head_dim, interleaved):
    from fla.modules.rotary.ops import rotary_embedding_ref

    def angles(offset, n):
        inverse = 10_000.0 ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        f = torch.outer(torch.arange(offset, offset + n, dtype=torch.float64), inverse)
        return f.cos(), f.sin()

    def rotate(x, offset):
        return rotary_embedding_ref(x, *angles(offset, x.shape[1]), interleaved=interleaved)

    if interleaved:  # YOCO's: one tensor a call
        return _Call(lambda x, seqlen_offset=0, **_: rotate(x, seqlen_offset))
    return _Call(lambda q, k, seqlen_offset=0, **_: (rotate(q, seqlen_offset), rotate(k, seqlen_offset)))


def _compare_with_fla_layer(ours, ref, d_model, state_of=None):
    """Whole sequence, and a prefill in two chunks then four decoding steps with each one's cache."""
    x = torch.randn(2, 33, d_model, dtype=torch.float64)
    with torch.no_grad():
        whole = ref(x)[0]
        torch.testing.assert_close(ours(x, MixerInput(torch.arange(33)[None])), whole, rtol=1e-10, atol=1e-12)
        state, cache, pieces, ref_pieces = ours.new_state(2, 33, torch.float64), _LayerCache(), [], []
        for a, b in ((0, 17), (17, 29), (29, 30), (30, 31), (31, 32), (32, 33)):
            pieces.append(ours(x[:, a:b], MixerInput(torch.arange(a, b)[None], state)))
            ref_pieces.append(ref(x[:, a:b], past_key_values=cache, use_cache=True)[0])
        torch.testing.assert_close(torch.cat(pieces, 1), torch.cat(ref_pieces, 1), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=1e-10, atol=1e-12)
        if state_of is not None:
            torch.testing.assert_close(state["S"], state_of(cache[0]["recurrent_state"]), rtol=1e-10, atol=1e-12)


def test_gated_deltanet_block_equals_flas_gated_deltanet_layer(monkeypatch):
    """fla.layers.GatedDeltaNet: l2-normalised q, k (fla's l2norm, x / sqrt(|x|^2 + 1e-6), taken
    exactly here with eps 0: archlab's F.normalize differs from it by ~1e-6/|q|^2, relative), sigmoid
    beta, decay -exp(A_log) softplus(a + dt_bias), per-head RMSNorm then silu gate; state [V, K] there."""
    layers = pytest.importorskip("fla.layers.gated_deltanet")

    def kernel(q, k, v, g, beta, initial_state=None, A_log=None, dt_bias=None, state_v_first=False, **options):
        assert options["use_qk_l2norm_in_kernel"] and options["use_beta_sigmoid_in_kernel"] and options["use_gate_in_kernel"]
        q, k = (t * torch.rsqrt(t.square().sum(-1, keepdim=True)) for t in (q, k))
        g = -A_log.exp() * F.softplus(g + dt_bias)
        state = None if initial_state is None else initial_state.transpose(-1, -2)
        o, state = fused_recurrent_gated_delta_rule(q, k, v, g, beta.sigmoid(), initial_state=state, output_final_state=True)
        return o, state.transpose(-1, -2)

    monkeypatch.setattr(layers, "chunk_gated_delta_rule", kernel)
    monkeypatch.setattr(layers, "fused_recurrent_gated_delta_rule", kernel)
    monkeypatch.setattr(layers.GatedDeltaNet, "_use_fused_qkv_conv", lambda self, **_: False)
    ours = GatedDeltaNetSpec(type="gdn", n_heads=4, head_dim=8, expand_v=2, chunk_size=8).build(BuildContext(32, None)).double()
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ref = layers.GatedDeltaNet(hidden_size=32, head_dim=8, num_heads=4, expand_v=2, norm_eps=1e-6, layer_idx=0).double().eval()
    with torch.no_grad():
        for mine, theirs in dict(q_proj="q_proj", k_proj="k_proj", v_proj="v_proj", a_proj="a_proj", b_proj="b_proj",
                                 gate_proj="g_proj", o_proj="o_proj").items():
            getattr(ref, theirs).weight.copy_(getattr(ours, mine).weight)
        ref.A_log.copy_(ours.A_log)
        ref.dt_bias.copy_(ours.dt_bias)
    for name in ("q", "k", "v"):
        setattr(ref, f"{name}_conv1d", _fla_short_conv(getattr(ours, f"{name}_conv").weight))
    ref.o_norm = _fla_norm_gate(ours.head_norm.weight, 1e-6)
    _compare_with_fla_layer(ours, ref, 32, state_of=lambda s: s.transpose(-1, -2))


def test_retnet_block_equals_flas_multiscale_retention_layer(monkeypatch):
    """fla.layers.MultiScaleRetention: gamma_h = 1 - 2^(-5-h), scale K^-0.5, per-head RMSNorm then
    silu gate. Its RoPE rotates halves, archlab's (as YOCO's) pairs: the same up to the order of
    the q/k projection rows within a head."""
    layers = pytest.importorskip("fla.layers.multiscale_retention")

    def retention(q, k, v, initial_state=None, **_):
        gamma = 1 - 2.0 ** (-5.0 - torch.arange(q.shape[2], dtype=torch.float64))
        state = q.new_zeros(*q.shape[::2], q.shape[-1], v.shape[-1]) if initial_state is None else initial_state
        o = []
        for t in range(q.shape[1]):
            state = gamma[:, None, None] * state + k[:, t, :, :, None] * v[:, t, :, None, :]
            o.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * q.shape[-1] ** -0.5, state))
        return torch.stack(o, 1), state

    q, k, v = torch.randn(2, 9, 3, 4, dtype=torch.float64), torch.randn(2, 9, 3, 4, dtype=torch.float64), torch.randn(2, 9, 3, 8, dtype=torch.float64)
    naive = pytest.importorskip("fla.ops.retention.naive").naive_retention  # computes in float32
    torch.testing.assert_close(retention(q, k, v)[0], naive(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2).double(), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(layers, "chunk_retention", retention)
    monkeypatch.setattr(layers, "fused_recurrent_retention", retention)
    ours = RetentionSpec(type="retnet", n_heads=4, chunk_size=8).build(BuildContext(32, 10_000.0)).double()
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ref = layers.MultiScaleRetention(hidden_size=32, num_heads=4, expand_k=1, expand_v=2, norm_eps=1e-6, layer_idx=0).double().eval()
    rows = _rows_for_interleaved_rope(4, 8)
    with torch.no_grad():
        ref.q_proj.weight.copy_(ours.q_proj.weight[rows])
        ref.k_proj.weight.copy_(ours.k_proj.weight[rows])
        for mine, theirs in dict(v_proj="v_proj", gate_proj="g_proj", o_proj="o_proj").items():
            getattr(ref, theirs).weight.copy_(getattr(ours, mine).weight)
    ref.rotary = _fla_rotary(8, interleaved=False)
    ref.g_norm_swish_gate = _fla_norm_gate(ours.head_norm.weight, 1e-6)
    half = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2)])
    _compare_with_fla_layer(ours, ref, 32, state_of=lambda s: s.index_select(2, torch.argsort(half)))


def test_gated_retention_block_equals_flas_yoco_gated_retention_layer(monkeypatch):
    """fla.layers.yoco.YOCOGatedRetention: decay logsigmoid(W x) / 16, interleaved RoPE, value
    heads as wide as key heads (archlab's default is twice: set here), a sub-norm without a scale
    (archlab's has one, at 1 here)."""
    layers = pytest.importorskip("fla.layers.yoco")

    def kernel(q, k, v, g, initial_state=None, state_v_first=False, **_):
        assert state_v_first
        state = None if initial_state is None else initial_state.transpose(-1, -2)
        o, state = fused_recurrent_simple_gla(q, k, v, g, initial_state=state, output_final_state=True)
        return o, state.transpose(-1, -2)

    monkeypatch.setattr(layers, "chunk_simple_gla", kernel)
    monkeypatch.setattr(layers, "fused_recurrent_simple_gla", kernel)
    ours = RetentionSpec(type="retnet", n_heads=4, value_dim=8, gated=True, chunk_size=8).build(BuildContext(32, 10_000.0)).double()
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.3)
    torch.nn.init.ones_(ours.head_norm.weight)
    ref = layers.YOCOGatedRetention(hidden_size=32, num_heads=4, norm_eps=1e-6, layer_idx=0).double().eval()
    with torch.no_grad():
        for mine, theirs in dict(q_proj="q_proj", k_proj="k_proj", v_proj="v_proj", gate_proj="g_proj", decay_proj="gk_proj",
                                 o_proj="o_proj").items():
            getattr(ref, theirs).weight.copy_(getattr(ours, mine).weight)
    ref.rotary = _fla_rotary(8, interleaved=True)
    ref.o_norm = _fla_norm_gate(None, 1e-6)
    _compare_with_fla_layer(ours, ref, 32, state_of=lambda s: s.transpose(-1, -2))


@pytest.mark.parametrize("groups", [1, 2])
def test_mamba2_block_equals_flas_mamba2_layer(groups):
    """fla.layers.Mamba2's PyTorch path (the transformers port of mamba-ssm's Mamba2): in_proj split
    z | x B C | dt, conv with bias then silu, A = -exp(A_log), softplus(dt + dt_bias), D skip, grouped
    RMSNorm(y * silu(z)) (eps 1e-5), out_proj. It computes in float32, so this compares in float32.
    Its decoding step, run here over the whole sequence from a zero cache, gives head h group
    h // (heads / groups), as mamba-ssm's kernels do; its sequence path tiles the groups instead
    (B.repeat: group h % groups), so it is compared with one group only."""
    layers = pytest.importorskip("fla.layers.mamba2")
    from blocks.mamba2 import Mamba2Spec

    ours = Mamba2Spec(type="mamba2", d_state=8, head_dim=8, expand=2, n_groups=groups, chunk_size=8).build(BuildContext(32, None))
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ref = layers.Mamba2(head_dim=8, hidden_size=32, state_size=8, expand=2, n_groups=groups, chunk_size=8, layer_idx=0,
                        backend="triton").eval()
    with torch.no_grad():
        for name in ("A_log", "dt_bias", "D"):
            getattr(ref, name).copy_(getattr(ours, name))
        ref.in_proj.weight.copy_(ours.in_proj.weight)
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.conv1d.weight.copy_(ours.conv.weight)
        ref.conv1d.bias.copy_(ours.conv.bias)
    ref.act = torch.nn.SiLU()

    def norm(y, z):
        y = (y * F.silu(z)).unflatten(-1, (groups, -1))
        return (y * torch.rsqrt(y.square().mean(-1, keepdim=True) + 1e-5)).flatten(-2) * ours.norm_weight

    ref.norm = _Call(norm)
    x = torch.randn(2, 33, 32)
    with torch.no_grad():
        cache = _LayerCache()
        cache.update(conv_state=torch.zeros(2, ours.conv_dim, 4), recurrent_state=torch.zeros(2, ours.heads, 8, 8))
        stepped = torch.cat([ref(x[:, t : t + 1], past_key_values=cache, use_cache=True)[0] for t in range(33)], 1)
        torch.testing.assert_close(ours(x, MixerInput(torch.arange(33)[None])), stepped, rtol=1e-5, atol=1e-5)
        state = ours.new_state(2, 33, torch.float32)
        pieces = [ours(x[:, a:b], MixerInput(torch.arange(a, b)[None], state)) for a, b in ((0, 17), (17, 29), *((t, t + 1) for t in range(29, 33)))]
        torch.testing.assert_close(torch.cat(pieces, 1), stepped, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state["ssm"], cache[0]["recurrent_state"], rtol=1e-5, atol=1e-5)
        if groups == 1:
            torch.testing.assert_close(ref(x)[0], stepped, rtol=1e-5, atol=1e-5)


def test_sliding_window_block_equals_flas_attention_layer_by_hand():
    """fla.layers.Attention with window_size (it needs flash-attn to build, so its forward is
    written out here): separate q/k/v projections (archlab's one qkv matmul, split), rotate-half
    RoPE with base 1e4 (archlab's interleaved, up to q/k row order), flash-attn window (W-1, 0)."""
    from fla.modules.rotary.ops import rotary_embedding_ref

    heads, kv_heads, head_dim, window = 4, 2, 8, 5
    ours = SlidingWindowSpec(type="swa", window=window, n_heads=heads, n_kv_heads=kv_heads).build(BuildContext(32, 10_000.0)).double()
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.3)
    wq, wk, wv = ours.qkv_proj.weight.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
    wq, wk = wq[_rows_for_interleaved_rope(heads, head_dim)], wk[_rows_for_interleaved_rope(kv_heads, head_dim)]
    x = torch.randn(2, 33, 32, dtype=torch.float64)
    q, k, v = (x @ wq.T).unflatten(-1, (heads, -1)), (x @ wk.T).unflatten(-1, (kv_heads, -1)), (x @ wv.T).unflatten(-1, (kv_heads, -1))
    angles = torch.outer(torch.arange(33, dtype=torch.float64), 10_000.0 ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    q, k = (rotary_embedding_ref(t, angles.cos(), angles.sin()) for t in (q, k))
    expected = naive_window_attention(q, k, v, window).flatten(2) @ ours.o_proj.weight.T
    with torch.no_grad():
        torch.testing.assert_close(ours(x, MixerInput(torch.arange(33)[None], causal=True)), expected, rtol=1e-10, atol=1e-12)
        state = ours.new_state(2, 33, torch.float64)
        pieces = [ours(x[:, a:b], MixerInput(torch.arange(a, b)[None], state)) for a, b in ((0, 17), (17, 29), *((t, t + 1) for t in range(29, 33)))]
        torch.testing.assert_close(torch.cat(pieces, 1), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("theta", [10000, 500])
def test_cross_decoder_rope_rotates_queries_and_global_keys_alike(theta):
    """No shipped spec puts RoPE in the cross-decoder, so leaving its queries unrotated (while the
    global K,V's keys are) went unseen. Rotated alike (at the spec's theta, for both), the scores
    depend on offsets alone: the same hidden states at positions shifted by 100 give the same
    output, and RoPE does change it."""
    import archlab
    from conftest import ROOT

    data = archlab.load_spec(ROOT / "specs/tiny/yoco.yaml").model_dump(mode="json")
    data["layout"]["cross_decoder"]["position"] = {"type": "rope", "theta": theta}
    model = archlab.build_model(archlab.validate_spec(data), dtype=torch.float64)
    cross = model.layers[model.spec.layout.self_decoder.n_layers].mixer
    x = torch.randn(1, 12, model.spec.d_model, dtype=torch.float64)

    def out(offset, causal):
        positions = torch.arange(12)[None] + offset
        return cross(x, MixerInput(positions, global_kv=model.global_kv(x, positions), causal=causal))

    rotated = out(0, False)
    torch.testing.assert_close(out(0, True), rotated, rtol=1e-10, atol=1e-12)  # the whole-sequence kernel, as training runs it
    torch.testing.assert_close(out(100, False), rotated, rtol=1e-10, atol=1e-12)
    cross.rotary = model.global_kv.rotary = None
    assert not torch.allclose(out(0, False), rotated)


def test_cross_decoder_rope_turns_each_query_by_its_own_position():
    """A query and the global key at its own position must be turned by the same angle: RoPE's
    scores then see the true offset between a token and each key it reads, as a reference YOCO
    does. A query turned one position too far (or not by its position at all) still gives outputs
    that do not change when every position shifts, so only a hand computation tells them apart:
    the queries rotated at their positions, causal softmax over the global K,V, the output projection."""
    import archlab
    from conftest import ROOT

    data = archlab.load_spec(ROOT / "specs/tiny/yoco.yaml").model_dump(mode="json")
    data["layout"]["cross_decoder"]["position"] = {"type": "rope", "theta": 10000}
    model = archlab.build_model(archlab.validate_spec(data), dtype=torch.float64)
    cross = model.layers[model.spec.layout.self_decoder.n_layers].mixer
    x, positions = torch.randn(1, 12, model.spec.d_model, dtype=torch.float64), torch.arange(12)[None]
    kv = model.global_kv(x, positions)
    with torch.no_grad():
        q = cross.rotary(cross.q_proj(x).view(1, 12, cross.heads, cross.head_dim), positions)
        group = cross.heads // kv.k.shape[2]
        k, v = (t.repeat_interleave(group, dim=2) for t in (kv.k, kv.v))  # query head h reads K,V head h // group
        scores = torch.einsum("bnhd,bmhd->bhnm", q, k) / cross.head_dim**0.5
        scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
        expected = cross.o_proj(torch.einsum("bhnm,bmhd->bnhd", scores.softmax(-1), v).reshape(1, 12, -1))
        for causal in (False, True):  # decoding's path over K,V rows, and training's whole-sequence kernel
            got = cross(x, MixerInput(positions, global_kv=kv, causal=causal))
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_decays_start_as_mamba2_draws_them():
    """Mamba2's (and Gated DeltaNet's) decays at init, as mamba-ssm draws them: A uniform in
    [1, 16], and the step size softplus(dt_bias) log-uniform in [1e-3, 1e-1], so dt_bias is stored
    as its inverse softplus (stored as dt itself, the first steps would run at softplus(1e-3) ~ 0.69)."""
    torch.manual_seed(0)
    A_log, dt_bias = decay_parameters(4096)
    A, log_dt = A_log.detach().exp(), F.softplus(dt_bias.detach().double()).log()
    assert 1 <= A.min() and A.max() <= 16 and abs(A.mean() - 8.5) < 0.3
    low, high = math.log(1e-3), math.log(1e-1)
    assert low - 1e-6 <= log_dt.min() and log_dt.max() <= high + 1e-6
    assert abs(log_dt.mean() - (low + high) / 2) < 0.1 and abs(log_dt.std() - (high - low) / 12**0.5) < 0.1
