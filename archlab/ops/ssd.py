"""Mamba-2 SSD (state space duality) in pure PyTorch, mirroring mamba_ssm's Triton ops
(ops/triton/ssd_combined.py: mamba_chunk_scan_combined; ops/triton/selective_state_update.py).

Per head h, with state S [P, N], dt processed as softplus(dt + dt_bias) clamped to dt_limit:
    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T,    y_t = S_t C_t + D_h x_t,    out_t = y_t * silu(z_t)
B and C are shared by groups of heads (head h uses group h // (H / G), as mamba_ssm).
Computed in fp32 (fp64 stays fp64), autocast or not; outputs keep x's dtype, states are fp32.
"""
import torch.nn.functional as F

from archlab.ops.common import float32_or_wider, without_autocast
from archlab.ops.retention import chunk_simple_gla


def _dt(dt, dt_bias, dt_softplus):
    dt = dt if dt_bias is None else dt + dt_bias
    return F.softplus(dt) if dt_softplus else dt  # F.softplus is the identity above 20, as the kernels


def _skip_and_gate(y, x, D, z):
    """mamba_ssm's output epilogue: y + D x, then gated by silu(z)."""
    if D is not None:
        y = y + x * D.reshape(D.shape[0], -1).to(y.dtype)  # D [H] or [H, P]
    return y if z is None else y * F.silu(z.to(y.dtype))


@without_autocast
def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """One decoding step of the recurrence above; returns (out [b, h, p], new_state [b, h, p, n]).

    state [b, h, p, n], x [b, h, p], dt [b, h] or [b, h, p], A [h] or [h, p, n], B, C [b, g, n],
    D [h] or [h, p], z [b, h, p], dt_bias [h] or [h, p]. mamba_ssm writes the state in place and
    returns only out; ours is functional (returns the new state, no in-place write) so it stays
    autograd-friendly. No dt_limit clamp, as mamba_ssm's step.
    """
    b, h, p = x.shape
    dtype = float32_or_wider(x.dtype)
    xf = x.to(dtype)
    dt = _dt(dt.to(dtype).reshape(b, h, -1), None if dt_bias is None else dt_bias.reshape(h, -1), dt_softplus)
    dt = dt[..., None]  # [b, h, p or 1, 1]
    A = A.to(dtype) if A.dim() == 3 else A.to(dtype)[:, None, None]
    Bh, Ch = (t.to(dtype).repeat_interleave(h // t.shape[1], dim=1)[:, :, None, :] for t in (B, C))  # [b, h, 1, n]
    state = state.to(dtype) * (dt * A).exp() + dt * Bh * xf[..., None]
    out = _skip_and_gate((state * Ch).sum(-1), xf, D, z)
    return out.to(x.dtype), state


def _as_gla(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit, dtype):
    """SSD inputs [b, l, h, ...] as simple GLA's: q = C, k = B (groups expanded to heads),
    v = dt x, g = dt A (log decay per head and token), with the kernels' dt processing; q, k, v
    in ``dtype``, g in float32 or wider."""
    h = x.shape[2]
    wide = float32_or_wider(x.dtype)
    dt = _dt(dt.to(wide), dt_bias, dt_softplus).clamp(*dt_limit)
    q, k = (t.repeat_interleave(h // t.shape[2], dim=2).to(dtype) for t in (C, B))
    return q, k, (x.to(wide) * dt[..., None]).to(dtype), dt * A.to(wide)


def chunk_scan_from_gla(chunk_simple_gla, wide=False):
    """``mamba_chunk_scan_combined`` computed by a ``chunk_simple_gla`` (fla's kernel or ours).

    SSD is simple GLA with one decay per head and token (``_as_gla``), scale 1, the state stored
    transposed ([K=n, V=p] against mamba's [p, n]); the D skip and z gate follow. ``chunk_size``
    is passed on by keyword: both take it (fla 0.6 only a power of 2). fla's kernels take q, k, v
    in x's dtype; ``wide`` hands them over in float32 or wider instead, so that nothing is rounded
    to a bfloat16 x's dtype before the output (our op computes in float32 anyway).
    """

    def scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
             dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False):
        dtype = float32_or_wider(x.dtype) if wide else x.dtype
        q, k, v, g = _as_gla(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit, dtype)
        initial = None if initial_states is None else initial_states.transpose(-1, -2).contiguous()
        y, final = chunk_simple_gla(q, k, v, g=g, scale=1.0, initial_state=initial, output_final_state=return_final_states,
                                    chunk_size=chunk_size)
        out = _skip_and_gate(y.to(g.dtype), x.to(g.dtype), D, z).to(x.dtype)
        return (out, final.transpose(-1, -2)) if return_final_states else out

    return scan


def state_update_from_gla(fused_recurrent_simple_gla):
    """``selective_state_update`` (functional, per-head dt/A/D/dt_bias) by a one-token
    ``fused_recurrent_simple_gla``, with the same mapping as ``chunk_scan_from_gla``."""

    def update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
        unbounded = (-float("inf"), float("inf"))  # the step does not clamp dt
        q, k, v, g = _as_gla(x[:, None], dt[:, None], A, B[:, None], C[:, None], dt_bias, dt_softplus, unbounded, x.dtype)
        y, final = fused_recurrent_simple_gla(q, k, v, g=g, scale=1.0, initial_state=state.transpose(-1, -2).contiguous(),
                                              output_final_state=True)
        out = _skip_and_gate(y[:, 0].to(g.dtype), x.to(g.dtype), D, z).to(x.dtype)
        return out, final.transpose(-1, -2)

    return update


# Chunked SSD (quadratic, decay-masked attention inside chunks, state passing across chunks) is
# our chunked simple GLA; x [b, l, h, p], dt [b, l, h], A [h] (< 0), B, C [b, l, g, n], D [h] or
# [h, p], z [b, l, h, p], dt_bias [h], initial_states [b, h, p, n]. Returns out [b, l, h, p], or
# (out, final_states [b, h, p, n]) if return_final_states. Unlike mamba_ssm there is no seq_idx /
# cu_seqlens (pass arguments after chunk_size by keyword).
mamba_chunk_scan_combined = chunk_scan_from_gla(chunk_simple_gla, wide=True)  # chunk_simple_gla runs without autocast
