"""Simple GLA and RetNet retention in pure PyTorch, mirroring fla.ops.simple_gla / fla.ops.retention.

Per head, with state S [K, V] and a scalar per-token log-decay g_t <= 0:
    S_t = exp(g_t) S_{t-1} + k_t v_t^T,    o_t = S_t^T (scale q_t)
Retention is the special case of a fixed per-head decay gamma_h = 1 - 2^(-5-h).
Layout is sequence-first like fla: q, k [B, T, H, K], v [B, T, H, V], g [B, T, H], states
[B, H, K, V]. Computed in fp32 (fp64 stays fp64), autocast or not; outputs keep q's dtype, states are fp32.
fla's simple_gla functions have a g_gamma argument between g and scale, so pass everything after
v by keyword for a drop-in swap.
"""
import torch

from archlab.ops.common import chunk_log_decays, decay_matrix, float32_or_wider, setup_state, to_chunks, without_autocast


@without_autocast
def chunk_simple_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, chunk_size=64):
    """Chunked form: decay-masked attention inside a chunk plus the carried state across chunks.

    Returns (o [B, T, H, V], final_state [B, H, K, V] or None).
    """
    B, T, H, _ = q.shape
    out_dtype, V = q.dtype, v.shape[-1]
    dtype, scale, S = setup_state(q, v, scale, initial_state)
    q, k, v, g = (to_chunks(x.to(dtype), chunk_size) for x in (q, k, v, g))
    q = q * scale
    g, G = chunk_log_decays(g)  # [B, H, N, C]
    decay = decay_matrix(g)  # exp(G_i - G_j), j <= i, each summed over its own segment
    attn = q @ k.transpose(-1, -2) * decay
    k_to_end = k * decay[..., -1, :, None]  # keys decayed to their chunk's end: exp(G_C - G_j) k_j
    o = []
    for n in range(q.shape[2]):
        Gn, kn, vn = G[:, :, n], k_to_end[:, :, n], v[:, :, n]
        o.append((q[:, :, n] * Gn.exp()[..., None]) @ S + attn[:, :, n] @ vn)
        S = S * Gn[..., -1, None, None].exp() + kn.transpose(-1, -2) @ vn
    o = torch.stack(o, 2).reshape(B, H, -1, V)[:, :, :T].transpose(1, 2)
    return o.to(out_dtype), S if output_final_state else None


@without_autocast
def fused_recurrent_simple_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    """Step-by-step recurrence (reference / decoding). Returns (o [B, T, H, V], final_state or None)."""
    out_dtype = q.dtype
    dtype, scale, S = setup_state(q, v, scale, initial_state)
    q, k, v, g = (x.to(dtype) for x in (q, k, v, g))
    o = []
    for t in range(q.shape[1]):
        S = S * g[:, t, :, None, None].exp() + k[:, t, :, :, None] * v[:, t, :, None, :]
        o.append(((q[:, t, :, :, None] * scale) * S).sum(-2))
    return torch.stack(o, 1).to(out_dtype), S if output_final_state else None


def retention_log_decay(n_heads, device=None, dtype=torch.float32):
    """RetNet's fixed per-head log decays log(1 - 2^(-5-h)), h = 0..n_heads-1, shape [H] (fp32 as
    fla, or a wider dtype)."""
    return torch.log(1 - 2.0 ** (-5.0 - torch.arange(n_heads, dtype=dtype, device=device)))


def _retention_g(q):
    B, T, H, _ = q.shape
    return retention_log_decay(H, q.device, float32_or_wider(q.dtype)).expand(B, T, H)


def chunk_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, chunk_size=64):
    """Multi-scale retention (chunked): chunk_simple_gla with g = log(gamma_h). Returns (o, final_state).

    fla's kernel takes chunk_size only as a keyword (a power of 2), so pass it by keyword."""
    return chunk_simple_gla(q, k, v, _retention_g(q), scale, initial_state, output_final_state, chunk_size)


def fused_recurrent_retention(q, k, v, scale=None, initial_state=None, output_final_state=False):
    """Multi-scale retention (recurrent): fused_recurrent_simple_gla with g = log(gamma_h)."""
    return fused_recurrent_simple_gla(q, k, v, _retention_g(q), scale, initial_state, output_final_state)
