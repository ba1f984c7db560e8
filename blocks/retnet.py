"""RetNet multi-scale retention, or YOCO's gated retention (``gated: true``).

Retention decays each head's state by a fixed gamma_h = 1 - 2^(-5-h); gated retention decays it
by a per-token, per-head gate logsigmoid(W_g x) / 16. Either way the output is per-head RMSNorm,
gated by silu(W_gate x), then projected back to the width.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from archlab.block import BlockSpec, BuildContext, Flops, MixerInput, Problems, Size, check_heads, check_rope_head_dim, odd_under_rope, round_up
from archlab.ops.common import float32_or_wider, gated_head_output, linear_recurrence
from archlab.ops.dispatch import Kernels, check_chunk_size
from archlab.rope import Rotary


class RetentionSpec(BlockSpec):
    type: Literal["retnet"]
    n_heads: Size = 4
    head_dim: Size | None = None  # query/key head size; None: d_model // n_heads
    value_dim: Size | None = None  # value head size; None: 2 * head_dim (as RetNet)
    gated: bool = False
    chunk_size: Size = 64
    backend: Literal["auto", "torch", "fla"] = "auto"

    def dims(self, d_model: int) -> tuple[int, int]:
        head_dim = self.head_dim or d_model // self.n_heads
        return head_dim, self.value_dim or 2 * head_dim

    def check(self, ctx: BuildContext, problems: Problems) -> None:
        check_heads(problems, ctx.d_model, self.n_heads, self.head_dim, lambda heads, size: odd_under_rope(ctx, size))
        check_rope_head_dim(problems, ctx, self.n_heads, self.dims(ctx.d_model)[0], given=self.head_dim is not None)
        check_chunk_size(problems, "chunk_simple_gla" if self.gated else "chunk_retention", self.chunk_size, self.backend)

    def build(self, ctx: BuildContext) -> nn.Module:
        return Retention(ctx, self)

    def params(self, ctx: BuildContext) -> int:
        key, value = self.dims(ctx.d_model)
        h, d = self.n_heads, ctx.d_model
        return d * h * (2 * key + 3 * value + (1 if self.gated else 0)) + value

    def flops(self, ctx: BuildContext, n: int, start: int = 0, reuse_kv: bool = False) -> Flops:
        key, value = self.dims(ctx.d_model)
        h, d = self.n_heads, ctx.d_model
        dense = 2 * n * d * h * (2 * key + 3 * value + (1 if self.gated else 0))
        if n == 1:  # decay (1), write k v^T (2), read q S (2)
            return Flops(matmul=dense, state_update=5 * h * key * value)
        padded, c = round_up(n, self.chunk_size), self.chunk_size
        return Flops(matmul=dense, mixer=h * (2 * padded * c * (key + value) + 4 * padded * key * value))

    def state_bytes(self, ctx: BuildContext, context: int, kv_bytes: int) -> int:
        key, value = self.dims(ctx.d_model)
        return max(4, kv_bytes) * self.n_heads * key * value  # float32 or wider, as new_state keeps it


class Retention(nn.Module):
    def __init__(self, ctx: BuildContext, spec: RetentionSpec):
        super().__init__()
        self.heads, self.chunk_size, self.gated = spec.n_heads, spec.chunk_size, spec.gated
        gla, retention = ("chunk_simple_gla", "fused_recurrent_simple_gla"), ("chunk_retention", "fused_recurrent_retention")
        self.chunk_op, self.step_op = gla if spec.gated else retention  # names of the ops in self.kernels
        self.kernels = Kernels("retnet", spec.backend, ("fla",), (self.chunk_op, self.step_op), chunk_size=spec.chunk_size)
        self.head_dim, self.value_dim = spec.dims(ctx.d_model)
        d, h = ctx.d_model, self.heads
        self.q_proj = nn.Linear(d, h * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, h * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, h * self.value_dim, bias=False)
        self.gate_proj = nn.Linear(d, h * self.value_dim, bias=False)
        self.decay_proj = nn.Linear(d, h, bias=False) if spec.gated else None
        self.head_norm = nn.RMSNorm(self.value_dim, eps=1e-6)
        self.o_proj = nn.Linear(h * self.value_dim, d, bias=False)
        self.rotary = Rotary(self.head_dim, ctx.rope_theta) if ctx.rope_theta is not None else None

    def new_state(self, batch: int, capacity: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {"S": torch.zeros(batch, self.heads, self.head_dim, self.value_dim, dtype=float32_or_wider(dtype))}

    def forward(self, x: torch.Tensor, inp: MixerInput) -> torch.Tensor:
        batch, n, _ = x.shape
        q = self.q_proj(x).view(batch, n, self.heads, self.head_dim)
        k = self.k_proj(x).view(batch, n, self.heads, self.head_dim)
        v = self.v_proj(x).view(batch, n, self.heads, self.value_dim)
        if self.rotary is not None:
            q, k = self.rotary(q, inp.positions), self.rotary(k, inp.positions)
        gates = {}
        if self.gated:  # decay per token and head
            gates["g"] = F.logsigmoid(self.decay_proj(x).to(float32_or_wider(x.dtype))) / 16
        state = None if inp.state is None else inp.state["S"]
        o = linear_recurrence(self.kernels(x.device), self.chunk_op, self.step_op, q, k, v, state, self.chunk_size, **gates)
        return gated_head_output(self, o, x)
