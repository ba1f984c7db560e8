"""Gated DeltaNet (Yang et al.): a delta-rule state with a data-dependent decay.

Per head: q, k, v through a short causal conv and silu, q and k L2-normalised; write strength
beta = sigmoid(W_b x); decay g = -exp(A_log) * softplus(W_a x + dt_bias) (as Mamba2's dt). The
output is per-head RMSNorm gated by silu(W_gate x), projected back to the width.
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import PositiveFloat
from torch import nn

from archlab.block import MAX_SIZE, BlockSpec, BuildContext, Flops, MixerInput, Problems, Size, check_heads, round_up
from archlab.ops.common import decay_parameters, float32_or_wider, gated_head_output, linear_recurrence
from archlab.ops.conv import short_conv
from archlab.ops.dispatch import Kernels, check_chunk_size


class GatedDeltaNetSpec(BlockSpec):
    type: Literal["gdn"]
    reads_position: ClassVar[bool] = False  # order lives in the decaying state
    n_heads: Size = 4
    head_dim: Size | None = None  # query/key head size; None: d_model // n_heads
    expand_v: PositiveFloat = 2.0  # value head size = expand_v * head_dim
    conv_size: Size = 4
    chunk_size: Size = 64
    backend: Literal["auto", "torch", "fla"] = "auto"

    def dims(self, d_model: int) -> tuple[int, int]:
        head_dim = self.head_dim or d_model // self.n_heads
        return head_dim, int(head_dim * self.expand_v)

    def conv_channels(self, d_model: int) -> int:
        """The channels of the short convolutions over q, k and v, together."""
        key, value = self.dims(d_model)
        return self.n_heads * (2 * key + value)

    def check(self, ctx: BuildContext, problems: Problems) -> None:
        check_heads(problems, ctx.d_model, self.n_heads, self.head_dim,
                    lambda heads, size: None if (size * self.expand_v) % 1 == 0 else "expand_v * head_dim a whole number")
        value = self.dims(ctx.d_model)[0] * self.expand_v
        if value % 1:
            problems.at("expand_v").add(f"expand_v * head_dim = {value} must be a whole number")
        elif value > MAX_SIZE:
            problems.at("expand_v").add(f"expand_v * head_dim = {value:g}, a value head size past {MAX_SIZE:,}")
        check_chunk_size(problems, "chunk_gated_delta_rule", self.chunk_size, self.backend)

    def build(self, ctx: BuildContext) -> nn.Module:
        return GatedDeltaNet(ctx, self)

    def params(self, ctx: BuildContext) -> int:
        key, value = self.dims(ctx.d_model)
        h, d = self.n_heads, ctx.d_model
        return d * h * (2 * key + 3 * value + 2) + self.conv_channels(d) * self.conv_size + 2 * h + value

    def flops(self, ctx: BuildContext, n: int, start: int = 0, reuse_kv: bool = False) -> Flops:
        key, value = self.dims(ctx.d_model)
        h, d = self.n_heads, ctx.d_model
        dense = 2 * n * d * h * (2 * key + 3 * value + 2)
        conv = 2 * self.conv_channels(d) * n * self.conv_size
        if n == 1:  # conv tails; decay, read k S, write k u^T, read q S
            return Flops(matmul=dense, state_update=conv + 7 * h * key * value)
        padded, c = round_up(n, self.chunk_size), self.chunk_size
        mixer = h * padded * (4 * c * key + 2 * c * value + 6 * key * value)
        return Flops(matmul=dense, conv=conv, mixer=mixer, solve=h * padded * c * (key + value))

    def state_bytes(self, ctx: BuildContext, context: int, kv_bytes: int) -> int:
        key, value = self.dims(ctx.d_model)
        states = self.conv_channels(ctx.d_model) * (self.conv_size - 1) + self.n_heads * key * value
        return max(4, kv_bytes) * states  # float32 or wider, as new_state keeps them


def conv_weights(dim: int, size: int) -> nn.Conv1d:
    """Depthwise causal conv weights (applied through ``short_conv``)."""
    return nn.Conv1d(dim, dim, size, groups=dim, bias=False)


class GatedDeltaNet(nn.Module):
    def __init__(self, ctx: BuildContext, spec: GatedDeltaNetSpec):
        super().__init__()
        self.heads, self.chunk_size = spec.n_heads, spec.chunk_size
        self.head_dim, self.value_dim = spec.dims(ctx.d_model)
        self.kernels = Kernels("gdn", spec.backend, ("fla",), ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
                               chunk_size=spec.chunk_size)
        d, h = ctx.d_model, self.heads
        key_width, value_width = h * self.head_dim, h * self.value_dim
        self.q_proj = nn.Linear(d, key_width, bias=False)
        self.k_proj = nn.Linear(d, key_width, bias=False)
        self.v_proj = nn.Linear(d, value_width, bias=False)
        self.q_conv = conv_weights(key_width, spec.conv_size)
        self.k_conv = conv_weights(key_width, spec.conv_size)
        self.v_conv = conv_weights(value_width, spec.conv_size)
        self.a_proj = nn.Linear(d, h, bias=False)
        self.b_proj = nn.Linear(d, h, bias=False)
        self.A_log, self.dt_bias = decay_parameters(h)
        self.gate_proj = nn.Linear(d, value_width, bias=False)
        self.head_norm = nn.RMSNorm(self.value_dim, eps=1e-6)
        self.o_proj = nn.Linear(value_width, d, bias=False)

    def new_state(self, batch: int, capacity: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Conv tails of q, k, v and the delta-rule state."""
        tail = self.q_conv.kernel_size[0] - 1
        key_width, value_width = self.q_conv.in_channels, self.v_conv.in_channels
        zeros = partial(torch.zeros, dtype=float32_or_wider(dtype))
        return {
            "q_conv": zeros(batch, key_width, tail),
            "k_conv": zeros(batch, key_width, tail),
            "v_conv": zeros(batch, value_width, tail),
            "S": zeros(batch, self.heads, self.head_dim, self.value_dim),
        }

    def forward(self, x: torch.Tensor, inp: MixerInput) -> torch.Tensor:
        batch, n, _ = x.shape
        head_shape, state = (batch, n, self.heads, -1), inp.state or {}

        def conv(name: str, proj: nn.Linear) -> torch.Tensor:
            return short_conv(proj(x), getattr(self, name).weight.squeeze(1), state=state.get(name)).view(head_shape)

        q = F.normalize(conv("q_conv", self.q_proj), dim=-1)
        k = F.normalize(conv("k_conv", self.k_proj), dim=-1)
        v = conv("v_conv", self.v_proj)
        wide = float32_or_wider(x.dtype)
        beta = self.b_proj(x).to(wide).sigmoid()
        g = -self.A_log.to(wide).exp() * F.softplus(self.a_proj(x).to(wide) + self.dt_bias)
        o = linear_recurrence(self.kernels(x.device), "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", q, k, v,
                              state.get("S"), self.chunk_size, g=g, beta=beta)
        return gated_head_output(self, o, x)
