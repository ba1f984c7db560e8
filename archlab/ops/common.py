"""Pieces shared by the ops and the blocks (the dtype they compute in, state setup, chunking,
decay masks, decay parameter init, running a linear recurrence, a gated heads' output)."""
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn


def float32_or_wider(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which a model of ``dtype`` keeps what the kernels keep in float32 (recurrent
    and conv states, gates, rotations, router scores): float32, or the model's dtype if wider,
    so that a float64 model, a reference, rounds nothing to float32."""
    return torch.promote_types(dtype, torch.float32)


def without_autocast(op):
    """Run a PyTorch op in the dtype it chooses (float32 or wider), autocast or not: under a
    bfloat16 autocast its matmuls and convolutions would otherwise be rounded back to bfloat16,
    about doubling its error."""
    @functools.wraps(op)
    def run(*args, **kwargs):
        device = next(t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
        with torch.autocast(device.type, enabled=False):
            return op(*args, **kwargs)
    return run


def setup_state(q, v, scale, initial_state):
    """Compute dtype, default scale 1/sqrt(K) and the starting state (zeros if none given)."""
    B, _, H, K = q.shape
    dtype = float32_or_wider(q.dtype)
    S = q.new_zeros(B, H, K, v.shape[-1], dtype=dtype) if initial_state is None else initial_state.to(dtype)
    return dtype, K ** -0.5 if scale is None else scale, S


def to_chunks(x, C):
    """[B, T, H, ...] -> [B, H, N, C, ...], zero-padding T to a multiple of C (padding is a no-op step)."""
    x = x.transpose(1, 2)
    x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, -x.shape[2] % C))
    return x.reshape(*x.shape[:2], -1, C, *x.shape[3:])


def chunk_log_decays(g):
    """(g, G) [..., C]: the log-decays g [..., C] and their running sums G within each chunk. A
    decay of 0 (g = -inf: forget everything) is taken as g = -1000, whose exp is exactly 0 in
    float32 and float64 alike, so that sums stay finite (and their gradients free of nan)."""
    g = g.clamp(min=-1000.0)
    return g, g.cumsum(-1)


def decay_matrix(g):
    """exp(g_{j+1} + ... + g_i) for j <= i, else 0: the causal decay mask within a chunk, from the
    (clamped) log-decays g [..., C]; returns [..., C, C]. Each entry is summed over its own segment
    (the Mamba-2 listing's stable segsum) rather than taken as G_i - G_j of the running sums: after
    a reset (a decay near 0) in a chunk those sums are large, and their difference keeps only
    float32's absolute spacing there (2.4e-4 near -3000) of a decay that may be near 1. The last
    row is the chunk's state-update decay exp(G_C - G_j)."""
    C = g.shape[-1]
    causal = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
    steps = g[..., None, :].expand(*g.shape, C).masked_fill(causal, 0)  # [j, t]: g_t where t > j
    return steps.cumsum(-1).transpose(-1, -2).masked_fill(~causal, float("-inf")).exp()  # summed along rows: fast


def decay_parameters(heads: int) -> tuple[nn.Parameter, nn.Parameter]:
    """Mamba2's per-head (A_log, dt_bias) init: A = U(1, 16), dt log-uniform in [1e-3, 1e-1]
    (at least 1e-4) stored as softplus^-1(dt); drawn in this order from the global generator."""
    A_log = torch.empty(heads).uniform_(1, 16).log()
    dt = torch.empty(heads).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp(min=1e-4)
    return nn.Parameter(A_log), nn.Parameter(dt + torch.log(-torch.expm1(-dt)))


def linear_recurrence(ops: dict, chunk_op: str, step_op: str, q, k, v, state, chunk_size, **gates):
    """Run a linear-recurrent core of ``ops`` (a block's kernels, fla's calling convention: RetNet,
    GLA, Gated DeltaNet): the chunked form over a sequence, the recurrent one for a decoding step
    (one token). With a ``state`` it starts from it and overwrites it in place with the final state."""
    if state is None:
        return ops[chunk_op](q, k, v, **gates, chunk_size=chunk_size)[0]
    carry = dict(initial_state=state, output_final_state=True)
    if q.shape[1] == 1:
        o, final = ops[step_op](q, k, v, **gates, **carry)
    else:
        o, final = ops[chunk_op](q, k, v, **gates, **carry, chunk_size=chunk_size)
    state.copy_(final)
    return o


def gated_head_output(mixer: nn.Module, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """RetNet's and Gated DeltaNet's output: their heads o [B, N, H, V] through the mixer's per-head
    ``head_norm``, gated by silu(``gate_proj`` x), then ``o_proj`` back to the width. The norm
    reads the heads in its weight's dtype: under autocast they come in bfloat16, which PyTorch's
    fused RMSNorm refuses beside a float32 weight (a warning, and its slower path)."""
    o = mixer.head_norm(o.to(mixer.head_norm.weight.dtype)) * F.silu(mixer.gate_proj(x)).view_as(o)
    return mixer.o_proj(o.flatten(2))
