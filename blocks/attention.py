"""Causal softmax self-attention with GQA and RoPE: full (``attention``) or banded (``swa``).

ParScale streams each get ``prefix_len`` learned K,V rows prepended to every attention layer,
visible to every query of their stream. Loop iterations that share the K,V cache reuse the K,V
written by the first iteration (``MixerInput.kv_memo``).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import PositiveInt
from torch import nn

from archlab.block import BlockSpec, BuildContext, MixerInput, Problems, check_heads
from archlab.rope import Rotary


def band_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, 1, Nq, Nk] bool from positions q_pos [B, Nq] and k_pos [B or 1, Nk]: query i sees key j
    iff 0 <= pos_i - pos_j and, with a window W, pos_i - pos_j < W. Negative key positions are empty."""
    offset = q_pos[:, :, None] - k_pos[:, None, :]
    allowed = (offset >= 0) & (k_pos[:, None, :] >= 0)
    return (allowed if window is None else allowed & (offset < window))[:, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA on sequence-first tensors [B, N, H, D]; K,V may have fewer heads (GQA)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(1, 2)


def write_rows(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache[b, slots[b, i]] = values[b, i] for every row b (in place)."""
    rows = torch.arange(cache.shape[0], device=cache.device)[:, None]
    cache[rows, slots] = values.to(cache.dtype)


class AttentionSpec(BlockSpec):
    """Full causal self-attention; every layer keeps a K,V cache as long as the context."""

    type: Literal["attention"]
    n_heads: PositiveInt = 8
    n_kv_heads: PositiveInt | None = None  # None: as many as n_heads (no GQA)
    head_dim: PositiveInt | None = None  # None: d_model // n_heads

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
        check_heads(problems, ctx.d_model, self.n_heads, self.head_dim)
        heads, kv_heads, head_dim = self.shape(ctx.d_model)
        if heads % kv_heads:
            problems.at("n_kv_heads").add(f"n_kv_heads={kv_heads} must divide n_heads={heads}")
        if ctx.rope_theta is not None and head_dim % 2:
            problems.at("head_dim").add(f"RoPE needs an even head_dim, got {head_dim}")

    def build(self, ctx: BuildContext) -> nn.Module:
        return SelfAttention(ctx, *self.shape(ctx.d_model), window=self.window_size())


class SelfAttention(nn.Module):
    def __init__(self, ctx: BuildContext, heads: int, kv_heads: int, head_dim: int, window: int | None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, head_dim, window
        self.q_proj = nn.Linear(ctx.d_model, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(ctx.d_model, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(ctx.d_model, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, ctx.d_model, bias=False)
        self.rotary = Rotary(head_dim, ctx.rope_theta) if ctx.rope_theta is not None else None
        if ctx.streams > 1:
            shape = (ctx.streams, ctx.prefix_len, kv_heads, head_dim)
            self.prefix_k = nn.Parameter(torch.randn(shape) * 0.02)
            self.prefix_v = nn.Parameter(torch.randn(shape) * 0.02)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x if self.rotary is None else self.rotary(x, positions)

    def new_state(self, batch: int, capacity: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """K,V rows: one per position, or a ring of the last ``window`` positions."""
        rows = capacity if self.window is None else min(self.window, capacity)
        shape = (batch, rows, self.kv_heads, self.head_dim)
        return {"k": torch.zeros(shape, dtype=dtype), "v": torch.zeros(shape, dtype=dtype)}

    def forward(self, x: torch.Tensor, inp: MixerInput) -> torch.Tensor:
        batch, n, _ = x.shape
        q = self.rope(self.q_proj(x).view(batch, n, self.heads, self.head_dim), inp.positions)
        if inp.kv_memo is not None and "kv" in inp.kv_memo:
            k, v, mask = inp.kv_memo["kv"]
        else:
            k, v, mask = self.keys(x, inp)
            if inp.kv_memo is not None:
                inp.kv_memo["kv"] = (k, v, mask)
        out = attend(q, k, v, mask)
        return self.o_proj(out.reshape(batch, n, self.heads * self.head_dim))

    def keys(self, x: torch.Tensor, inp: MixerInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V the queries attend to and the mask; writes the new tokens into the state, if any."""
        batch, n, _ = x.shape
        k = self.rope(self.k_proj(x).view(batch, n, self.kv_heads, self.head_dim), inp.positions)
        v = self.v_proj(x).view(batch, n, self.kv_heads, self.head_dim)
        k_pos, state = inp.positions, inp.state
        if state is not None and self.window is None:  # the cache row of a token is its position
            write_rows(state["k"], inp.positions, k)
            write_rows(state["v"], inp.positions, v)
            k, v = state["k"], state["v"]
            k_pos = torch.arange(k.shape[1], device=x.device)[None]
        elif state is not None:  # ring: slot s holds the latest earlier position p with p % R == s
            ring = state["k"].shape[1]
            first = inp.positions[:, :1] - 1
            slot = torch.arange(ring, device=x.device)[None]
            ring_pos = first - (first - slot) % ring  # negative where nothing was written yet
            keep = min(n, ring)
            k_all, v_all = torch.cat((state["k"], k.to(state["k"].dtype)), 1), torch.cat((state["v"], v.to(state["v"].dtype)), 1)
            write_rows(state["k"], inp.positions[:, -keep:] % ring, k[:, -keep:])
            write_rows(state["v"], inp.positions[:, -keep:] % ring, v[:, -keep:])
            k, v, k_pos = k_all, v_all, torch.cat((ring_pos, inp.positions), 1)
        mask = band_mask(inp.positions, k_pos, self.window)
        if hasattr(self, "prefix_k"):
            copies = batch // self.prefix_k.shape[0]  # rows are (sequence, stream), stream fastest
            k = torch.cat((self.prefix_k.repeat(copies, 1, 1, 1).to(k.dtype), k), dim=1)
            v = torch.cat((self.prefix_v.repeat(copies, 1, 1, 1).to(v.dtype), v), dim=1)
            mask = torch.cat((mask.new_ones(*mask.shape[:3], self.prefix_k.shape[1]), mask), dim=-1)
        return k, v, mask
