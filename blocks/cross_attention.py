"""YOCO cross-attention: each layer makes its own queries and reads the one global K,V."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from torch import nn

from archlab.block import BlockSpec, BuildContext, Flops, MixerInput, Problems, Size
from archlab.rope import Rotary
from archlab.ops.attention import attention_pairs, causal_kernels
from archlab.ops.dispatch import Kernels


class CrossAttentionSpec(BlockSpec):
    type: Literal["cross_attention"]
    n_heads: Size | None = None  # None: d_model // the global head_dim
    backend: Literal["auto", "torch", "flash_attn", "fla", "flex"] = "auto"  # of whole-sequence (training) attention

    reads_global_kv: ClassVar[bool] = True
    keeps_state: ClassVar[bool] = False

    def heads(self, ctx: BuildContext) -> int:
        return self.n_heads or ctx.d_model // ctx.global_head_dim

    def check(self, ctx: BuildContext, problems: Problems) -> None:
        if ctx.global_kv_heads is None:
            return  # outside a cross-decoder; the model reports that
        heads = self.heads(ctx)
        derived = "" if self.n_heads else (f" (n_heads unset: d_model // layout.global_kv.head_dim = {ctx.d_model} //"
                                           f" {ctx.global_head_dim} = {heads}; give n_heads)")
        if not self.n_heads and ctx.d_model % ctx.global_head_dim:
            problems.at("n_heads").add(f"d_model={ctx.d_model} is not a multiple of the global K,V's head_dim"
                                       f" {ctx.global_head_dim}, so the query heads cannot be derived from it; give n_heads")
            return
        if heads % ctx.global_kv_heads:  # heads >= 1: n_heads is a Size, and d_model a multiple of head_dim
            problems.at("n_heads").add(
                f"{heads} query heads must be a multiple of the global K,V's"
                f" {ctx.global_kv_heads} heads (layout.global_kv.n_kv_heads){derived}"
            )

    def build(self, ctx: BuildContext) -> nn.Module:
        return CrossAttention(ctx, self.heads(ctx), causal_kernels(self.type, self.backend))

    def params(self, ctx: BuildContext) -> int:
        return 2 * ctx.d_model * self.heads(ctx) * ctx.global_head_dim

    def flops(self, ctx: BuildContext, n: int, start: int = 0, reuse_kv: bool = False) -> Flops:
        width = self.heads(ctx) * ctx.global_head_dim
        return Flops(matmul=4 * n * ctx.d_model * width, attention=4 * width * attention_pairs(n, start, None))

    def state_bytes(self, ctx: BuildContext, context: int, kv_bytes: int) -> int:
        return 0  # the global K,V it reads is the model's


class CrossAttention(nn.Module):
    def __init__(self, ctx: BuildContext, heads: int, kernels: Kernels):
        super().__init__()
        self.kernels = kernels  # of whole-sequence (training) attention
        self.heads, self.head_dim = heads, ctx.global_head_dim
        self.q_proj = nn.Linear(ctx.d_model, heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, ctx.d_model, bias=False)
        self.rotary = Rotary(self.head_dim, ctx.rope_theta) if ctx.rope_theta is not None else None

    def new_state(self, batch: int, capacity: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {}  # it only reads the model's global K,V

    def forward(self, x: torch.Tensor, inp: MixerInput) -> torch.Tensor:
        batch, n, _ = x.shape
        q = self.q_proj(x).view(batch, n, self.heads, self.head_dim)
        if self.rotary is not None:
            q = self.rotary(q, inp.positions)
        if inp.causal:
            k, v, _ = inp.global_kv
            out = self.kernels(x.device)["causal_attention"](q, k, v, inp.positions, None)
        else:
            out = inp.global_kv.attend(q, inp.positions)
        return self.o_proj(out.reshape(batch, n, self.heads * self.head_dim))
