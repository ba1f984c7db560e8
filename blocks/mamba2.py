"""Mamba2 (SSD): a selective state-space mixer with scalar-times-identity decay per head.

in_proj gives the gate z, the SSM input x, B, C and dt; x, B, C pass through a causal conv and
silu; the SSD scan runs with A = -exp(A_log), a D skip and softplus(dt + dt_bias); the output is
RMSNorm(y * silu(z)) (grouped by ``n_groups``), projected back to the width.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from archlab.block import BlockSpec, BuildContext, Flops, MixerInput, Problems, Size, round_up
from archlab.ops.common import decay_parameters, float32_or_wider
from archlab.ops.conv import short_conv
from archlab.ops.dispatch import Kernels, check_chunk_size


class Mamba2Spec(BlockSpec):
    type: Literal["mamba2"]
    reads_position: ClassVar[bool] = False  # order lives in the decaying state
    d_state: Size = 128
    d_conv: Size = 4
    expand: Size = 2
    head_dim: Size = 64
    n_groups: Size = 1
    chunk_size: Size = 256
    backend: Literal["auto", "torch", "mamba_ssm", "fla"] = "auto"

    def dims(self, d_model: int) -> tuple[int, int]:
        """(inner width, heads)."""
        inner = self.expand * d_model
        return inner, inner // self.head_dim

    def check(self, ctx: BuildContext, problems: Problems) -> None:
        inner, heads = self.dims(ctx.d_model)
        if inner % self.head_dim:
            problems.at("head_dim").add(f"head_dim={self.head_dim} must divide expand * d_model = {inner}")
        elif heads % self.n_groups:
            problems.at("n_groups").add(f"n_groups={self.n_groups} must divide the {heads} heads")
        check_chunk_size(problems, "mamba_chunk_scan_combined", self.chunk_size, self.backend)

    def build(self, ctx: BuildContext) -> nn.Module:
        return Mamba2(ctx, self)

    def conv_dim(self, d_model: int) -> int:
        """The channels the short conv mixes: x, B and C."""
        return self.dims(d_model)[0] + 2 * self.n_groups * self.d_state

    def params(self, ctx: BuildContext) -> int:
        inner, heads = self.dims(ctx.d_model)
        conv = self.conv_dim(ctx.d_model)
        return ctx.d_model * (2 * inner + conv + heads) + conv * (self.d_conv + 1) + 3 * heads + inner

    def flops(self, ctx: BuildContext, n: int, start: int = 0, reuse_kv: bool = False) -> Flops:
        inner, heads = self.dims(ctx.d_model)
        conv_dim, p, state = self.conv_dim(ctx.d_model), self.head_dim, self.d_state
        dense = 2 * n * ctx.d_model * (2 * inner + conv_dim + heads)
        conv = 2 * conv_dim * n * self.d_conv
        if n == 1:  # conv tail; decay, write dt B x, read C S
            return Flops(matmul=dense, state_update=conv + 5 * heads * p * state)
        padded, c = round_up(n, self.chunk_size), self.chunk_size
        return Flops(matmul=dense, conv=conv, mixer=heads * (2 * padded * c * (state + p) + 4 * padded * state * p))

    def state_bytes(self, ctx: BuildContext, context: int, kv_bytes: int) -> int:
        heads = self.dims(ctx.d_model)[1]
        states = self.conv_dim(ctx.d_model) * (self.d_conv - 1) + heads * self.head_dim * self.d_state
        return max(4, kv_bytes) * states  # float32 or wider, as new_state keeps them


class Mamba2(nn.Module):
    def __init__(self, ctx: BuildContext, spec: Mamba2Spec):
        super().__init__()
        self.inner, self.heads = spec.dims(ctx.d_model)
        self.head_dim, self.groups, self.d_state, self.chunk_size = spec.head_dim, spec.n_groups, spec.d_state, spec.chunk_size
        self.conv_dim = spec.conv_dim(ctx.d_model)
        # fla (its simple_gla kernels running the SSD) only when named: unproven on a GPU so far
        self.kernels = Kernels("mamba2", spec.backend, ("mamba_ssm", "fla"), ("mamba_chunk_scan_combined", "selective_state_update"),
                               auto=("mamba_ssm",), chunk_size=spec.chunk_size)
        self.in_proj = nn.Linear(ctx.d_model, self.inner + self.conv_dim + self.heads, bias=False)
        self.conv = nn.Conv1d(self.conv_dim, self.conv_dim, spec.d_conv, groups=self.conv_dim, bias=True)
        self.A_log, self.dt_bias = decay_parameters(self.heads)
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm_weight = nn.Parameter(torch.ones(self.inner))
        self.out_proj = nn.Linear(self.inner, ctx.d_model, bias=False)

    def new_state(self, batch: int, capacity: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Conv tail of x, B, C and the SSM state."""
        return {
            "conv": torch.zeros(batch, self.conv_dim, self.conv.kernel_size[0] - 1, dtype=float32_or_wider(dtype)),
            "ssm": torch.zeros(batch, self.heads, self.head_dim, self.d_state, dtype=float32_or_wider(dtype)),
        }

    def forward(self, x: torch.Tensor, inp: MixerInput) -> torch.Tensor:
        batch, n, _ = x.shape
        conv_state, ssm_state = (inp.state["conv"], inp.state["ssm"]) if inp.state is not None else (None, None)
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.heads], dim=-1)
        xbc = short_conv(xbc, self.conv.weight.squeeze(1), self.conv.bias, state=conv_state)
        xs, B, C = xbc.split([self.inner, self.groups * self.d_state, self.groups * self.d_state], dim=-1)
        xs = xs.reshape(batch, n, self.heads, self.head_dim)
        B, C = B.reshape(batch, n, self.groups, self.d_state), C.reshape(batch, n, self.groups, self.d_state)
        A = -self.A_log.to(float32_or_wider(x.dtype)).exp()
        ops, ssd_args = self.kernels(x.device), dict(D=self.D, dt_bias=self.dt_bias, dt_softplus=True)
        if ssm_state is None:
            y = ops["mamba_chunk_scan_combined"](xs, dt, A, B, C, self.chunk_size, **ssd_args)
        else:
            if n == 1:  # a decoding step uses the recurrent form
                y, new_ssm = ops["selective_state_update"](ssm_state, xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], **ssd_args)
                y = y[:, None]
            else:
                y, new_ssm = ops["mamba_chunk_scan_combined"](xs, dt, A, B, C, self.chunk_size, initial_states=ssm_state,
                                                              return_final_states=True, **ssd_args)
            ssm_state.copy_(new_ssm)
        y = y.reshape(batch, n, self.inner) * F.silu(z)
        y = F.rms_norm(y.view(batch, n, self.groups, -1), (self.inner // self.groups,), eps=1e-5)
        return self.out_proj(y.view(batch, n, self.inner) * self.norm_weight)
