"""Pure-PyTorch core ops: chunked == recurrent, equality with published references, gradients."""
import math

import pytest
import torch
import torch.nn.functional as F

from archlab.ops.conv import short_conv
from archlab.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from archlab.ops.retention import (
    chunk_retention,
    chunk_simple_gla,
    fused_recurrent_retention,
    fused_recurrent_simple_gla,
    retention_log_decay,
)
from archlab.ops.ssd import (
    chunk_scan_from_gla,
    mamba_chunk_scan_combined,
    selective_state_update,
    state_update_from_gla,
)

LENGTHS = [1, 7, 33, 64, 70]
F64 = dict(atol=1e-10, rtol=1e-10)  # same maths, different association order, in float64
F32 = dict(atol=1e-5, rtol=1e-5)  # against fla's references, which always compute in float32


def close(a, b, tol):
    torch.testing.assert_close(a, b.to(a.dtype), **tol)


# ----------------------------------------------------------------------------- linear attention


def linear_inputs(T, init, dtype=torch.float64, B=2, H=3, K=8, V=5, seed=0):
    """Realistic ranges: l2-normalised keys, log-decays logsigmoid(randn) < 0, beta = sigmoid(randn)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    q, k, v = r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V)
    g, beta = F.logsigmoid(r(B, T, H)), torch.sigmoid(r(B, T, H))
    return q, k, v, g, beta, (r(B, H, K, V) if init else None)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("T", LENGTHS)
def test_gated_delta_rule_chunk_matches_recurrent(T, init, chunk_size):
    q, k, v, g, beta, h0 = linear_inputs(T, init)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    o_ref, s_ref = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    close(o, o_ref, F64)
    close(s, s_ref, F64)


@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("T", LENGTHS)
def test_gated_delta_rule_matches_fla_naive(T, init):
    naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    q, k, v, g, beta, h0 = linear_inputs(T, init, torch.float32)
    scale = 0.3
    kw = dict(scale=scale, initial_state=h0, output_final_state=True)
    o_rec, s_rec = naive.naive_recurrent_gated_delta_rule(q, k, v, beta, g, **kw)  # note: beta before g
    o_chk, s_chk = naive.naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, **kw)
    for o, s in (chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, **kw),
                 fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)):
        for o_ref, s_ref in ((o_rec, s_rec), (o_chk, s_chk)):
            close(o, o_ref, F32)
            close(s, s_ref, F32)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("T", LENGTHS)
def test_simple_gla_chunk_matches_recurrent(T, init, chunk_size):
    q, k, v, g, _, h0 = linear_inputs(T, init)
    o, s = chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    o_ref, s_ref = fused_recurrent_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    close(o, o_ref, F64)
    close(s, s_ref, F64)


def test_simple_gla_and_retention_give_no_final_state_unless_asked_as_fla():
    """fla's ops return None for the state unless output_final_state: a caller that did not ask
    keeps nothing alive, and the output is the same either way."""
    q, k, v, g, _, h0 = linear_inputs(20, init=True)
    for op, gates in ((chunk_simple_gla, dict(g=g, chunk_size=8)), (fused_recurrent_simple_gla, dict(g=g)),
                      (chunk_retention, dict(chunk_size=8)), (fused_recurrent_retention, {})):
        o, state = op(q, k, v, initial_state=h0, **gates)
        asked, final = op(q, k, v, initial_state=h0, output_final_state=True, **gates)
        assert state is None and final.shape == (2, 3, 8, 5)
        torch.testing.assert_close(o, asked, rtol=0, atol=0)


@pytest.mark.parametrize("chunked, recurrent, with_beta", [
    (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, True),
    (chunk_simple_gla, fused_recurrent_simple_gla, False),
])
def test_a_decay_of_zero_forgets_in_chunks_as_in_steps(chunked, recurrent, with_beta):
    """g = -inf (decay 0) at some steps, two within one chunk: the chunked form forgets the state
    there, as the recurrence does, rather than computing -inf - -inf."""
    q, k, v, g, beta, h0 = linear_inputs(40, init=True)
    g[0, [3, 5, 21]] = -torch.inf
    g[1, 0, 1] = -torch.inf
    gates = dict(g=g, beta=beta) if with_beta else dict(g=g)
    kw = dict(initial_state=h0, output_final_state=True, **gates)
    o, s = chunked(q, k, v, chunk_size=16, **kw)
    o_ref, s_ref = recurrent(q, k, v, **kw)
    assert o_ref.isfinite().all()
    close(o, o_ref, F64)
    close(s, s_ref, F64)


@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("T", LENGTHS)
def test_simple_gla_matches_fla_naive(T, init):
    naive = pytest.importorskip("fla.ops.simple_gla.naive")
    q, k, v, g, _, h0 = linear_inputs(T, init, torch.float32)
    kw = dict(scale=0.3, initial_state=h0, output_final_state=True)
    o_rec, s_rec = naive.naive_recurrent_simple_gla(q, k, v, g, **kw)
    o_chk, s_chk = naive.naive_chunk_simple_gla(q, k, v, g, chunk_size=16, **kw)
    for o, s in (chunk_simple_gla(q, k, v, g, chunk_size=16, **kw), fused_recurrent_simple_gla(q, k, v, g, **kw)):
        for o_ref, s_ref in ((o_rec, s_rec), (o_chk, s_chk)):
            close(o, o_ref, F32)
            close(s, s_ref, F32)


def test_retention_log_decay():
    H = 4
    expected = torch.tensor([math.log(1 - 2.0 ** (-5 - h)) for h in range(H)], dtype=torch.float64)
    close(retention_log_decay(H), expected, dict(atol=1e-7, rtol=1e-6))
    close(retention_log_decay(H, dtype=torch.float64), expected, dict(atol=0, rtol=1e-15))


def test_retention_in_float64_rounds_no_decay_to_float32():
    """A float64 retention equals simple GLA given the decays worked out in float64, to float64's
    own arithmetic (decays rounded to float32 were off by a relative 1e-8)."""
    q, k, v, _, _, _ = linear_inputs(200, False)
    exact = torch.tensor([math.log(1 - 2.0 ** (-5 - h)) for h in range(q.shape[2])], dtype=torch.float64)
    g = exact.expand(*q.shape[:3])
    close(chunk_retention(q, k, v)[0], chunk_simple_gla(q, k, v, g)[0], F64)
    close(fused_recurrent_retention(q, k, v)[0], fused_recurrent_simple_gla(q, k, v, g)[0], F64)


@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("T", LENGTHS)
def test_retention_chunk_matches_recurrent(T, init):
    q, k, v, _, _, h0 = linear_inputs(T, init)
    o, s = chunk_retention(q, k, v, initial_state=h0, output_final_state=True)
    o_ref, s_ref = fused_recurrent_retention(q, k, v, initial_state=h0, output_final_state=True)
    close(o, o_ref, F64)
    close(s, s_ref, F64)


@pytest.mark.parametrize("T", LENGTHS)
def test_retention_matches_fla_naive(T):
    naive = pytest.importorskip("fla.ops.retention.naive")
    q, k, v, _, _, _ = linear_inputs(T, False, torch.float32, H=4)
    ref = naive.naive_retention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)  # head-first layout
    scale = q.shape[-1] ** -0.5  # naive_retention has no scale argument and uses this one
    close(chunk_retention(q, k, v, scale=scale)[0], ref, F32)
    close(fused_recurrent_retention(q, k, v, scale=scale)[0], ref, F32)


# ----------------------------------------------------------------------------- Mamba-2 SSD


def segsum(x):
    """Stable segment sum of the Mamba-2 listing: out[..., i, j] = x[j+1] + ... + x[i] (j <= i), else -inf."""
    T = x.size(-1)
    x = x[..., None].expand(*x.shape, T)
    x = x.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=-1), 0)
    x_segsum = torch.cumsum(x, dim=-2)
    return x_segsum.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=0), -torch.inf)


def ssd_minimal_discrete(X, A, B, C, block_len, initial_states=None):
    """The minimal SSD listing of the Mamba-2 paper (Dao & Gu, 2024), with einops spelled out.

    X [b, l, h, p], A [b, l, h], B, C [b, l, h, n], l a multiple of block_len,
    initial_states [b, 1, h, p, n]. Returns Y [b, l, h, p] and the final state [b, h, p, n].
    """
    b, l, h, p = X.shape
    X, A, B, C = (t.reshape(b, l // block_len, block_len, *t.shape[2:]) for t in (X, A, B, C))
    A = A.permute(0, 3, 1, 2)  # b h c l
    A_cumsum = torch.cumsum(A, dim=-1)
    # 1. outputs of the diagonal blocks (intra-chunk)
    L = torch.exp(segsum(A))
    Y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, L, X)
    # 2. state at the end of each chunk
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, X)
    # 3. inter-chunk recurrence on the chunk states
    if initial_states is None:
        initial_states = torch.zeros_like(states[:, :1])
    states = torch.cat([initial_states, states], dim=1)
    decay_chunk = torch.exp(segsum(F.pad(A_cumsum[:, :, :, -1], (1, 0))))
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]
    # 4. state -> output of each chunk (off-diagonal blocks)
    Y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, torch.exp(A_cumsum))
    return (Y_diag + Y_off).reshape(b, l, h, p), final_state


def ssd_inputs(T, ngroups, init, d_shape, b=2, h=4, p=3, n=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(x=r(b, T, h, p), dt=r(b, T, h) - 1, A=-torch.exp(r(h)), B=r(b, T, ngroups, n), C=r(b, T, ngroups, n),
                D=r(*d_shape), z=r(b, T, h, p), dt_bias=r(h) * 0.5,
                initial_states=r(b, h, p, n) if init else None)


def ssd_epilogue(y, x, D, z):
    return (y + x * D.reshape(D.shape[0], -1)) * F.silu(z)


def ssd_via_minimal(x, dt, A, B, C, D, z, initial_states, block_len=8):
    """Mamba convention -> listing: X = x dt, A = A dt, B/C expanded from groups to heads."""
    h, l = x.shape[2], x.shape[1]
    B, C = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (B, C))
    pad = -l % block_len
    X, Ad, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x * dt[..., None], A * dt, B, C))
    y, s = ssd_minimal_discrete(X, Ad, B, C, block_len, None if initial_states is None else initial_states[:, None])
    return ssd_epilogue(y[:, :l], x, D, z), s


def ssd_via_scan(x, dt, A, B, C, D, z, initial_states):
    b, l, h, p = x.shape
    B, C = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (B, C))
    s = x.new_zeros(b, h, p, B.shape[-1]) if initial_states is None else initial_states
    ys = []
    for t in range(l):
        s = torch.exp(dt[:, t, :, None, None] * A[:, None, None]) * s \
            + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append((s * C[:, t, :, None, :]).sum(-1))
    return ssd_epilogue(torch.stack(ys, 1), x, D, z), s


def ssd_via_steps(x, dt, A, B, C, D, z, dt_bias, initial_states):
    b, l, h, p = x.shape
    s = x.new_zeros(b, h, p, B.shape[-1]) if initial_states is None else initial_states
    ys = []
    for t in range(l):
        y, s = selective_state_update(s, x[:, t], dt[:, t], A, B[:, t], C[:, t], D=D, z=z[:, t], dt_bias=dt_bias,
                                      dt_softplus=True)
        ys.append(y)
    return torch.stack(ys, 1), s


@pytest.mark.parametrize("d_shape", [(4,), (4, 3)])
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("ngroups", [1, 2])
@pytest.mark.parametrize("T", LENGTHS)
def test_ssd_matches_references(T, ngroups, init, d_shape):
    i = ssd_inputs(T, ngroups, init, d_shape)
    out, s = mamba_chunk_scan_combined(**i, chunk_size=16, dt_softplus=True, return_final_states=True)
    dt = F.softplus(i["dt"] + i["dt_bias"])
    ref = {k: i[k] for k in ("x", "A", "B", "C", "D", "z", "initial_states")}
    for out_ref, s_ref in (ssd_via_minimal(dt=dt, **ref), ssd_via_scan(dt=dt, **ref), ssd_via_steps(**i)):
        close(out, out_ref, F64)
        close(s, s_ref, F64)


@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("ngroups", [1, 2])
def test_ssd_step_through_simple_gla_equals_selective_state_update(ngroups, init):
    """The mapping that lets fla's fused_recurrent_simple_gla kernel run Mamba2's decoding step
    (q=C, k=B, v=dt x, g=dt A), checked with our simple_gla op in float64, states included.
    (Our chunked SSD is this mapping over our chunk_simple_gla: test_ssd_matches_references.)"""
    i = ssd_inputs(37, ngroups, init, (4,))
    step = state_update_from_gla(fused_recurrent_simple_gla)
    state = i["initial_states"] if init else torch.zeros(2, 4, 3, 5, dtype=torch.float64)
    args = dict(D=i["D"], dt_bias=i["dt_bias"], dt_softplus=True)
    for t in range(3):
        x, dt, B, C, z = (i[k][:, t] for k in ("x", "dt", "B", "C", "z"))
        y, new = step(state, x, dt, i["A"], B, C, z=z, **args)
        ref_y, ref_new = selective_state_update(state, x, dt, i["A"], B, C, z=z, **args)
        close(y, ref_y, F64)
        close(new, ref_new, F64)
        state = new


def test_ssd_step_through_simple_gla_leaves_a_negative_dt_unclamped_as_mamba_step():
    """Without softplus or bias, a raw dt below zero reaches the step as it is (mamba_ssm's step
    clamps nothing, unlike the chunked scan's default dt_limit of 0 and up): the state and output
    as the recurrence written out give them."""
    i = ssd_inputs(1, 2, True, (4,))
    state, x, dt, A, B, C, D, z = i["initial_states"], i["x"][:, 0], i["dt"][:, 0] + 1, i["A"], i["B"][:, 0], i["C"][:, 0], i["D"], i["z"][:, 0]
    assert (dt < 0).any() and (dt > 0).any()
    Bh, Ch = (t.repeat_interleave(2, dim=1) for t in (B, C))  # 4 heads in 2 groups
    new_ref = state * (dt * A)[..., None, None].exp() + dt[..., None, None] * x[..., None] * Bh[:, :, None, :]
    y_ref = ((new_ref * Ch[:, :, None, :]).sum(-1) + x * D[:, None]) * F.silu(z)
    for step in (state_update_from_gla(fused_recurrent_simple_gla), selective_state_update):
        y, new = step(state, x, dt, A, B, C, D=D, z=z)
        close(new, new_ref, F64)
        close(y, y_ref, F64)


def test_ssd_through_simple_gla_passes_the_chunk_size():
    """The scan's chunk size reaches the simple_gla op, by keyword (as fla's takes it)."""
    seen = []

    def op(*args, chunk_size, **kwargs):
        seen.append(chunk_size)
        return chunk_simple_gla(*args, chunk_size=chunk_size, **kwargs)

    chunk_scan_from_gla(op)(**ssd_inputs(37, 1, False, (4,)), chunk_size=8)
    assert seen == [8]


def test_ssd_plain_dt_limit_and_state_flag():
    """No bias/softplus: dt is only clamped to dt_limit (mamba clamps unconditionally)."""
    i = ssd_inputs(37, 2, True, (4,))
    del i["dt_bias"]
    limit = (0.05, 0.5)
    out, s = mamba_chunk_scan_combined(**i, chunk_size=8, dt_limit=limit, return_final_states=True)
    ref = {k: i[k] for k in ("x", "A", "B", "C", "D", "z", "initial_states")}
    out_ref, s_ref = ssd_via_scan(dt=i["dt"].clamp(*limit), **ref)
    close(out, out_ref, F64)
    close(s, s_ref, F64)
    close(mamba_chunk_scan_combined(**i, chunk_size=8, dt_limit=limit), out_ref, F64)


def test_ssd_in_bfloat16_rounds_only_its_output():
    """From bfloat16 inputs, the chunked SSD computes as from their float32 values and rounds
    once, at the end: v = dt x is not rounded to bfloat16 first (only for fla's kernels, which take
    q, k, v in the model's dtype)."""
    i = ssd_inputs(37, 2, True, (4,))
    low = {k: t.bfloat16() for k, t in i.items()}
    kw = dict(chunk_size=8, dt_softplus=True, return_final_states=True)
    out, s = mamba_chunk_scan_combined(**low, **kw)
    out_f32, s_f32 = mamba_chunk_scan_combined(**{k: t.float() for k, t in low.items()}, **kw)
    assert torch.equal(out, out_f32.bfloat16()) and torch.equal(s, s_f32)


def test_selective_state_update_expanded_shapes():
    """mamba2's step passes dt [b,h,p], A [h,p,n], dt_bias, D [h,p] (head values broadcast); same result."""
    b, h, p, n, g = 2, 4, 3, 5, 2
    gen = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    state, x, z, B, C = r(b, h, p, n), r(b, h, p), r(b, h, p), r(b, g, n), r(b, g, n)
    dt, A, dt_bias, D = r(b, h), -torch.exp(r(h)), r(h), r(h)
    compact = selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    expanded = selective_state_update(state, x, dt[..., None].expand(b, h, p), A[:, None, None].expand(h, p, n), B, C,
                                      D=D[:, None].expand(h, p), z=z, dt_bias=dt_bias[:, None].expand(h, p),
                                      dt_softplus=True)
    for a, e in zip(compact, expanded):
        close(a, e, F64)


# ----------------------------------------------------------------------------- causal conv1d


def conv_inputs(T, W, B=2, D=6, seed=0):
    """x [B, T, D] (sequence-first, as the blocks), weight [D, W], bias [D], state [B, D, W-1]."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return r(B, T, D), r(D, W), r(D), r(B, D, W - 1)


def conv_by_taps(x, weight, bias, state):
    """The definition: out[t] = silu(bias + sum_w weight[:, w] * x[t - W + 1 + w]), the inputs
    before x from ``state``; with the last W-1 inputs, the next state."""
    W = weight.shape[1]
    inputs = torch.cat([state.transpose(1, 2), x], dim=1)  # [B, W-1+T, D]
    out = sum(weight[:, w] * inputs[:, w: w + x.shape[1]] for w in range(W)) + bias
    return F.silu(out), inputs[:, x.shape[1]:].transpose(1, 2)


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("T", LENGTHS)
def test_short_conv_matches_its_definition(T, W):
    x, w, bias, s0 = conv_inputs(T, W)
    ref, ref_state = conv_by_taps(x, w, bias, s0)
    state = s0.clone()
    close(short_conv(x, w, bias, state=state), ref, F64)
    close(state, ref_state, F64)
    zeros_ref, _ = conv_by_taps(x, w, torch.zeros_like(bias), torch.zeros_like(s0))
    close(short_conv(x, w), zeros_ref, F64)  # no state: zeros before x; no bias


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("T", [1, 2, 7, 33])
def test_short_conv_steps_and_pieces_match_the_whole(T, W):
    x, w, bias, s0 = conv_inputs(T, W)
    whole_state = s0.clone()
    whole = short_conv(x, w, bias, state=whole_state)
    state = s0.clone()
    steps = [short_conv(x[:, t: t + 1], w, bias, state=state) for t in range(T)]
    close(torch.cat(steps, 1), whole, F64)
    close(state, whole_state, F64)
    for cut in range(1, T):  # includes pieces shorter than W - 1, whose states carry initial-state values
        state = s0.clone()
        pieces = [short_conv(x[:, :cut], w, bias, state=state), short_conv(x[:, cut:], w, bias, state=state)]
        close(torch.cat(pieces, 1), whole, F64)
        close(state, whole_state, F64)


# ----------------------------------------------------------------------------- dtypes and gradients


def test_low_precision_inputs_keep_dtype_and_fp32_states():
    q, k, v, g, beta, h0 = (t.bfloat16() for t in linear_inputs(9, True))
    for o, s in (chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True),
                 fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True),
                 chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True),
                 fused_recurrent_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True),
                 chunk_retention(q, k, v, initial_state=h0, output_final_state=True),
                 fused_recurrent_retention(q, k, v, initial_state=h0, output_final_state=True)):
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert chunk_gated_delta_rule(q, k, v, g, beta)[1] is None
    i = {k: (t.bfloat16() if t is not None else None) for k, t in ssd_inputs(9, 2, True, (4,)).items()}
    out, s = mamba_chunk_scan_combined(**i, chunk_size=4, dt_softplus=True, return_final_states=True)
    assert out.dtype == torch.bfloat16 and s.dtype == torch.float32
    y, s = selective_state_update(i["initial_states"], i["x"][:, 0], i["dt"][:, 0], i["A"], i["B"][:, 0],
                                  i["C"][:, 0], D=i["D"], z=i["z"][:, 0], dt_bias=i["dt_bias"], dt_softplus=True)
    assert y.dtype == torch.bfloat16 and s.dtype == torch.float32
    x, w, bias, s0 = (t.bfloat16() for t in conv_inputs(5, 4))
    state = s0.float()  # as the blocks' new_state makes it
    assert short_conv(x, w, bias, state=state).dtype == torch.bfloat16
    assert state.dtype == torch.float32 and torch.equal(state, x[:, -3:].transpose(1, 2).float())


def _conv_whole(x, weight, bias, state):
    state = state.clone()  # short_conv writes it in place
    return short_conv(x, weight, bias, state=state), state


def _conv_steps(x, weight, bias, state):
    state = state.clone()
    return torch.cat([short_conv(x[:, t: t + 1], weight, bias, state=state) for t in range(x.shape[1])], 1), state


GRAD_CASES = {
    "gated_delta_rule": (
        lambda: dict(zip(("q", "k", "v", "g", "beta", "initial_state"), linear_inputs(21, True, H=2))),
        lambda **i: chunk_gated_delta_rule(**i, output_final_state=True, chunk_size=8),
        lambda **i: fused_recurrent_gated_delta_rule(**i, output_final_state=True),
    ),
    "simple_gla": (
        lambda: dict(zip(("q", "k", "v", "g", "_", "initial_state"), linear_inputs(21, True, H=2))),
        lambda **i: chunk_simple_gla(**i, output_final_state=True, chunk_size=8),
        lambda **i: fused_recurrent_simple_gla(**i, output_final_state=True),
    ),
    "retention": (
        lambda: dict(zip(("q", "k", "v", "_", "_", "initial_state"), linear_inputs(21, True, H=2))),
        lambda **i: chunk_retention(**i, output_final_state=True),
        lambda **i: fused_recurrent_retention(**i, output_final_state=True),
    ),
    "ssd": (
        lambda: ssd_inputs(21, 2, True, (4, 3)),
        lambda **i: mamba_chunk_scan_combined(**i, chunk_size=8, dt_softplus=True, return_final_states=True),
        ssd_via_steps,
    ),
    "conv": (
        lambda: dict(zip(("x", "weight", "bias", "state"), conv_inputs(9, 4))),
        _conv_whole,
        _conv_steps,
    ),
}


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_a_bfloat16_autocast_leaves_the_ops_in_float32(name):
    """Under the trainer's bfloat16 autocast, the ops compute exactly as they do outside it (in
    float32, from bfloat16 inputs); autocast used to round their matmuls back to bfloat16."""
    make, full, step = GRAD_CASES[name]
    inputs = {k: t.bfloat16() if t.dtype == torch.float64 else t for k, t in make().items() if k != "_"}
    for fn in (full, step):
        plain = fn(**inputs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = fn(**inputs)
        for a, b in zip(plain, autocast):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_gradients_chunked_match_recurrent(name):
    make, full, step = GRAD_CASES[name]
    grads = []
    for fn in (full, step):
        inputs = {k: t.requires_grad_() for k, t in make().items() if k != "_"}
        out, state = fn(**inputs)
        gen = torch.Generator().manual_seed(2)
        loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum() \
            + (state * torch.randn(state.shape, generator=gen, dtype=state.dtype)).sum()
        loss.backward()
        grads.append({k: t.grad for k, t in inputs.items()})
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        assert torch.isfinite(grads[0][k]).all(), k
        close(grads[0][k], grads[1][k], F64)


@pytest.mark.parametrize("chunked, recurrent, with_beta", [
    (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, True),
    (chunk_simple_gla, fused_recurrent_simple_gla, False),
])
def test_float32_chunks_keep_their_precision_after_a_reset(chunked, recurrent, with_beta):
    """In float32 (the ops' compute dtype for float32 and bfloat16 models), a chunk whose early
    tokens reset the state (a decay of 0, or a Mamba2 dt spike: g ~ -1000) computes the decays of
    its later tokens as accurately as the recurrence does. Taken as differences G_i - G_j of running
    sums near -3000, they would be off by float32's spacing there (2.4e-4, relatively) instead."""
    q, k, v, g, beta, h0 = (t.float() for t in linear_inputs(64, init=True, B=1, H=2))
    g[:, [1, 3]] = -torch.inf
    g[:, 5] = -1500.0
    gates = dict(g=g, beta=beta) if with_beta else dict(g=g)
    o, s = chunked(q, k, v, chunk_size=64, initial_state=h0, output_final_state=True, **gates)
    wide = {name: t.double() for name, t in gates.items()}
    o_ref, s_ref = recurrent(q.double(), k.double(), v.double(), initial_state=h0.double(), output_final_state=True, **wide)
    close(o, o_ref, dict(atol=1e-5, rtol=1e-5))
    # the final state sums every key decayed to its chunk's end: within 5e-8 here, where decays
    # taken as G_C - G_j would put it 1e-5 off (the gated delta rule's state is the smaller)
    close(s, s_ref, dict(atol=1e-6, rtol=1e-6))
