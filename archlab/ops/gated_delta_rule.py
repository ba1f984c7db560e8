"""Gated delta rule (Gated DeltaNet) in pure PyTorch, mirroring fla.ops.gated_delta_rule.

Per head, with state S [K, V], log-decay g_t <= 0 and write strength beta_t:
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T (scale q_t)
Layout is sequence-first like fla: q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H], states
[B, H, K, V]. No l2norm is applied to q/k (as fla's default). Computed in fp32 (fp64 stays fp64), autocast or not;
outputs keep q's dtype, states are fp32. fla's own functions take more (keyword) options and its
fused_recurrent puts gk/gv before beta, so pass everything after v by keyword for a drop-in swap.
"""
import torch

from archlab.ops.common import chunk_log_decays, decay_matrix, setup_state, to_chunks, without_autocast


@without_autocast
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           chunk_size=64):
    """Chunked form (WY/UT transform). Returns (o [B, T, H, V], final_state [B, H, K, V] or None).

    Within a chunk with cumulative log-decay G, the delta-rule writes u_i = beta_i (v_i - S'_i^T k_i)
    satisfy (I + A) u = beta v - beta exp(G) k S_0 with A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i),
    so one triangular solve for all chunks gives U, W with u = U - W S_0; only S_0 is sequential.
    """
    B, T, H, _ = q.shape
    out_dtype, V = q.dtype, v.shape[-1]
    dtype, scale, S = setup_state(q, v, scale, initial_state)
    q, k, v, g, beta = (to_chunks(x.to(dtype), chunk_size) for x in (q, k, v, g, beta))
    g, G = chunk_log_decays(g)  # [B, H, N, C]
    decay = decay_matrix(g)  # exp(G_i - G_j), j <= i, each summed over its own segment
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2) * decay).tril(-1)  # the unit diagonal is implied by unitriangular=True
    rhs = torch.cat([v * beta[..., None], kb * G.exp()[..., None]], dim=-1)
    U, W = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split([V, k.shape[-1]], -1)
    q = q * scale
    attn = q @ k.transpose(-1, -2) * decay
    k_to_end = k * decay[..., -1, :, None]  # keys decayed to their chunk's end: exp(G_C - G_j) k_j
    o = []
    for n in range(q.shape[2]):
        Gn, kn = G[:, :, n], k_to_end[:, :, n]
        u = U[:, :, n] - W[:, :, n] @ S  # the chunk's actual delta-rule writes, now that S_0 is known
        o.append((q[:, :, n] * Gn.exp()[..., None]) @ S + attn[:, :, n] @ u)
        S = S * Gn[..., -1, None, None].exp() + kn.transpose(-1, -2) @ u
    o = torch.stack(o, 2).reshape(B, H, -1, V)[:, :, :T].transpose(1, 2)
    return o.to(out_dtype), S if output_final_state else None


@without_autocast
def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """Step-by-step recurrence (reference / decoding). Returns (o [B, T, H, V], final_state or None)."""
    out_dtype = q.dtype
    dtype, scale, S = setup_state(q, v, scale, initial_state)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    o = []
    for t in range(q.shape[1]):
        S = S * g[:, t, :, None, None].exp()
        kt = k[:, t, :, :, None]  # [B, H, K, 1]
        u = beta[:, t, :, None] * (v[:, t] - (kt * S).sum(-2))
        S = S + kt * u[:, :, None, :]
        o.append(((q[:, t, :, :, None] * scale) * S).sum(-2))
    return torch.stack(o, 1).to(out_dtype), S if output_final_state else None
