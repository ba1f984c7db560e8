"""Causal softmax self-attention with GQA and RoPE: full (``attention``) or banded (``swa``).

ParScale streams each get ``prefix_len`` learned K,V rows prepended to every attention layer,
visible to every query of their stream. Loop iterations that share the K,V cache reuse the K,V
written by the first iteration (``MixerInput.kv_memo``).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from archlab.block import BlockSpec, BuildContext, Flops, MixerInput, Problems, Size, check_heads, check_rope_head_dim, odd_under_rope
from archlab.ops.attention import append_kv, attend, attention_pairs, band_mask, causal_kernels, local_attend, with_prefix, write_rows
from archlab.ops.dispatch import Kernels
from archlab.rope import Rotary


class AttentionSpec(BlockSpec):
    """Full causal self-attention; every layer keeps a K,V cache as long as the context."""

    type: Literal["attention"]
    n_heads: Size = 8
    n_kv_heads: Size | None = None  # None: as many as n_heads (no GQA)
    head_dim: Size | None = None  # None: d_model // n_heads
    backend: Literal["auto", "torch", "flash_attn", "fla", "flex"] = "auto"  # of whole-sequence (training) attention

    grows_kv_cache: ClassVar[bool] = True
    shares_kv: ClassVar[bool] = True
    supports_streams: ClassVar[bool] = True

    def window_size(self) -> int | None:
        """Keys a query sees, itself included; None: the whole prefix."""
        return None

    def shape(self, d_model: int) -> tuple[int, int, int]:
        """(query heads, K,V heads, head dim)."""
        return self.n_heads, self.n_kv_heads or self.n_heads, self.head_dim or d_model // self.n_heads

    def check(self, ctx: BuildContext, problems: Problems) -> None:
        kv = self.n_kv_heads or 1
        check_heads(problems, ctx.d_model, self.n_heads, self.head_dim,
                    lambda heads, size: f"n_heads a multiple of n_kv_heads={kv}" if heads % kv else odd_under_rope(ctx, size))
        heads, kv_heads, head_dim = self.shape(ctx.d_model)
        if heads % kv_heads:
            problems.at("n_kv_heads").add(f"n_kv_heads={kv_heads} must divide n_heads={heads}")
        check_rope_head_dim(problems, ctx, heads, head_dim, given=self.head_dim is not None)

    def build(self, ctx: BuildContext) -> nn.Module:
        return SelfAttention(ctx, *self.shape(ctx.d_model), window=self.window_size(), kernels=causal_kernels(self.type, self.backend))

    def params(self, ctx: BuildContext) -> int:
        heads, kv_heads, head_dim = self.shape(ctx.d_model)
        prefix = 2 * ctx.streams * ctx.prefix_len * kv_heads * head_dim
        return 2 * ctx.d_model * (heads + kv_heads) * head_dim + prefix

    def flops(self, ctx: BuildContext, n: int, start: int = 0, reuse_kv: bool = False) -> Flops:
        heads, kv_heads, head_dim = self.shape(ctx.d_model)
        projected = 2 * heads + (0 if reuse_kv else 2 * kv_heads)  # q, o (+ k, v)
        pairs = attention_pairs(n, start, self.window_size()) + n * ctx.prefix_len
        return Flops(matmul=2 * n * ctx.d_model * projected * head_dim, attention=4 * heads * head_dim * pairs)

    def state_bytes(self, ctx: BuildContext, context: int, kv_bytes: int) -> int:
        _, kv_heads, head_dim = self.shape(ctx.d_model)
        window = self.window_size()
        rows = context if window is None else min(window, context)
        return 2 * rows * kv_heads * head_dim * kv_bytes


class SelfAttention(nn.Module):
    def __init__(self, ctx: BuildContext, heads: int, kv_heads: int, head_dim: int, window: int | None, kernels: Kernels):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, head_dim, window
        self.kernels = kernels  # of whole-sequence (training) attention
        self.qkv_proj = nn.Linear(ctx.d_model, (heads + 2 * kv_heads) * head_dim, bias=False)  # one matmul for q, k, v
        self.o_proj = nn.Linear(heads * head_dim, ctx.d_model, bias=False)
        self.rotary = Rotary(head_dim, ctx.rope_theta) if ctx.rope_theta is not None else None
        prefix_shape = (ctx.streams, ctx.prefix_len, kv_heads, head_dim)  # ParScale's per-stream prefix K,V; none without it
        self.prefix_k = nn.Parameter(torch.randn(prefix_shape) * ctx.init_std) if ctx.prefix_len else None
        self.prefix_v = nn.Parameter(torch.randn(prefix_shape) * ctx.init_std) if ctx.prefix_len else None

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x if self.rotary is None else self.rotary(x, positions)

    def new_state(self, batch: int, capacity: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """K,V rows: one per position, or a ring of the last ``window`` positions."""
        rows = capacity if self.window is None else min(self.window, capacity)
        shape = (batch, rows, self.kv_heads, self.head_dim)
        return {"k": torch.zeros(shape, dtype=dtype), "v": torch.zeros(shape, dtype=dtype)}

    def project(self, x: torch.Tensor, positions: torch.Tensor, queries_only: bool = False):
        """q [B, N, H, Dh] (and k, v [B, N, Hkv, Dh]) with RoPE applied to q and k."""
        batch, n, _ = x.shape
        if queries_only:  # K,V come from an earlier loop iteration: project q alone
            weight = self.qkv_proj.weight[: self.heads * self.head_dim]
            return self.rope(F.linear(x, weight).view(batch, n, self.heads, self.head_dim), positions)
        qkv = self.qkv_proj(x).view(batch, n, self.heads + 2 * self.kv_heads, self.head_dim)
        qk = self.rope(qkv[:, :, : self.heads + self.kv_heads], positions)
        return qk[:, :, : self.heads], qk[:, :, self.heads :], qkv[:, :, self.heads + self.kv_heads :]

    def forward(self, x: torch.Tensor, inp: MixerInput) -> torch.Tensor:
        batch, n, _ = x.shape
        if inp.kv_memo is not None and "kv" in inp.kv_memo:
            q = self.project(x, inp.positions, queries_only=True)
            k, v, k_pos = inp.kv_memo["kv"]
        else:
            q, k, v = self.project(x, inp.positions)
            k, v, k_pos = self.keys(k, v, inp)
            if inp.kv_memo is not None:
                inp.kv_memo["kv"] = (k, v, k_pos)
        prefix = None
        if self.prefix_k is not None:
            copies = batch // self.prefix_k.shape[0]  # rows are (sequence, stream), stream fastest
            prefix = (self.prefix_k.repeat(copies, 1, 1, 1).to(k.dtype), self.prefix_v.repeat(copies, 1, 1, 1).to(v.dtype))
        if inp.causal and prefix is None:
            out = self.kernels(x.device)["causal_attention"](q, k, v, inp.positions, self.window)
        elif self.window is None or n == 1:
            out = attend(*with_prefix(q, k, v, band_mask(inp.positions, k_pos, self.window), prefix))
        else:
            out = local_attend(q, k, v, inp.positions, k_pos, self.window, prefix)
        return self.o_proj(out.reshape(batch, n, self.heads * self.head_dim))

    def keys(self, k: torch.Tensor, v: torch.Tensor, inp: MixerInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V [B, M, Hkv, Dh] the new tokens' queries may attend to and their positions
        [B or 1, M], in position order; writes the new k, v into the state, if any."""
        n, state = k.shape[1], inp.state
        if state is None:
            return k, v, inp.positions
        if self.window is None:  # the cache row of a token is its position
            return append_kv(state, inp.positions, k, v)
        # a ring of R rows: slot s holds the latest written position p with p % R == s
        ring, decoding = state["k"].shape[1], n == 1
        positions = inp.positions.expand(state["k"].shape[0], -1)  # [1, N] too: each row reads its own ring
        if decoding:  # the new row replaces the oldest, so the ring is then exactly the window
            write_rows(state["k"], positions % ring, k)
            write_rows(state["v"], positions % ring, v)
        last = positions[:, :1] - (0 if decoding else 1)
        ring_pos = last - (last - torch.arange(ring, device=k.device)[None]) % ring  # < 0: never written
        order = ring_pos.argsort(dim=1)
        gather = order[:, :, None, None].expand(-1, -1, self.kv_heads, self.head_dim)
        k_ring, v_ring, ring_pos = state["k"].gather(1, gather), state["v"].gather(1, gather), ring_pos.gather(1, order)
        if decoding:
            return k_ring, v_ring, ring_pos
        k_all = torch.cat((k_ring, k.to(k_ring.dtype)), 1)
        v_all = torch.cat((v_ring, v.to(v_ring.dtype)), 1)
        keep = min(n, ring)
        write_rows(state["k"], positions[:, -keep:] % ring, k[:, -keep:])
        write_rows(state["v"], positions[:, -keep:] % ring, v[:, -keep:])
        return k_all, v_all, torch.cat((ring_pos, positions), 1)
