"""Softmax attention on sequence-first tensors [B, N, H, Dh]: masks by position, SDPA with GQA,
the training kernels (flash-attn, fla, FlexAttention), blockwise sliding windows, and K,V rows.

Shared by the attention blocks, the cross-decoder and the model's global K,V.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from archlab.block import ceil_div
from archlab.ops.dispatch import Kernels

ATTENTION_KERNELS = ("flash_attn", "fla", "flex")  # backends for whole-sequence (training) attention
ATTENTION_AUTO = ("flash_attn",)  # those ``auto`` takes: fla's and FlexAttention's speed is still to be measured


def causal_kernels(block: str, backend: str) -> Kernels:
    """The whole-sequence (training) attention of a block, on the backend its spec names."""
    return Kernels(block, backend, ATTENTION_KERNELS, ("causal_attention",), ATTENTION_AUTO)


def band_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, 1, Nq, Nk] bool from positions q_pos [B, Nq] and k_pos [B or 1, Nk]: query i sees key j
    iff 0 <= pos_i - pos_j and, with a window W, pos_i - pos_j < W. Negative key positions are empty."""
    offset = q_pos[:, :, None] - k_pos[:, None, :]
    allowed = (offset >= 0) & (k_pos[:, None, :] >= 0)
    return (allowed if window is None else allowed & (offset < window))[:, None]


def attention_pairs(n: int, start: int, window: int | None) -> int:
    """(query, key) pairs of queries at positions start..start+n-1, each seeing the keys at or
    before it, the last ``window`` of them with a window."""

    def upto(m: int) -> int:  # sum over positions 1..m of min(position, W)
        if window is None or m <= window:
            return m * (m + 1) // 2
        return window * (window + 1) // 2 + (m - window) * window

    return upto(start + n) - upto(start)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA on sequence-first tensors [B, N, H, D]; K,V may have fewer heads (GQA). A mask of
    None means plain causal attention over the same positions (the fast kernel).

    With a mask and GQA, the query heads sharing a K,V head are folded into the query axis
    (``folded_attention``), so no kernel copies K,V per query head: decoding over a long cache then
    reads it once per layer. On the CPU a chunk of queries is left to SDPA's own GQA, which took
    less than repeating the mask for each folded head: a 16K prefill of the tiny transformer (4
    heads on 2) took 10.7 s unfolded and 13.4 s folded, where 50 decoding steps at 64K (16 heads
    on 4) took 0.66 s folded and 2.9 s unfolded.
    """
    heads, kv_heads = q.shape[2], k.shape[2]
    if mask is not None and heads != kv_heads and (q.shape[1] == 1 or q.device.type != "cpu"):
        return folded_attention(q, k, v, mask)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=mask is None, enable_gqa=True)
    return out.transpose(1, 2)


def folded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked GQA attention with each K,V head's query heads folded into the query axis (the mask
    repeated for each): SDPA then reads K,V once per K,V head."""
    batch, n, heads, dim = q.shape
    kv_heads = k.shape[2]
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    group = heads // kv_heads
    folded = q.view(batch, n, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, group * n, dim)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask.repeat(1, 1, group, 1))
    return out.view(batch, kv_heads, group, n, dim).permute(0, 3, 1, 2, 4).reshape(batch, n, heads, dim)


def causal_attention(q, k, v, positions, window: int | None) -> torch.Tensor:
    """Attention of a whole sequence from position 0 over itself (training): SDPA's fast causal
    kernel, or blockwise SDPA with a window. The kernel backends adapt to this signature
    (``archlab.ops.dispatch``)."""
    return attend(q, k, v, None) if window is None else local_attend(q, k, v, positions, positions, window)


def flex_causal(q, k, v, positions, window: int | None) -> torch.Tensor:
    """The same with PyTorch's FlexAttention: the band is a block mask, so empty blocks are skipped
    (compiled on CUDA; eager elsewhere, where only the forward pass is supported)."""
    n = q.shape[1]
    mask = band_block_mask(n, window, str(q.device))
    out = flex_kernel(q.device.type)(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)


@functools.lru_cache(maxsize=16)
def band_block_mask(n: int, window: int | None, device: str):
    """FlexAttention's block mask of causal (banded) attention over n positions, built once per
    shape: every layer of every step reuses it, and building it costs as much as a short attention."""
    from torch.nn.attention.flex_attention import create_block_mask

    def allowed(b, h, query, key):
        return (query >= key) & (query - key < window) if window else query >= key

    return create_block_mask(allowed, None, None, n, n, device=device)


@functools.cache
def flex_kernel(device_type: str):
    """FlexAttention compiled on CUDA; eager elsewhere, by choice, so without torch's warning that
    eager FlexAttention is unfused."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        return torch.compile(flex_attention)

    def eager(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(*args, **kwargs)

    return eager


def write_rows(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache[b, slots[b, i]] = values[b, i] for every row b (in place)."""
    rows = torch.arange(cache.shape[0], device=cache.device)[:, None]
    cache[rows, slots] = values.to(cache.dtype)


def append_kv(state: dict, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Write k, v at their positions into a row-per-position cache; return the whole cache and
    its key positions. A position past the cache is written on its last row rather than out of
    bounds (on CUDA a device-side assert, fatal to the process): the cache noted the overrun when
    the engine reserved the positions, and ``Cache.check`` names it."""
    positions = positions.clamp(max=state["k"].shape[1] - 1)
    write_rows(state["k"], positions, k)
    write_rows(state["v"], positions, v)
    return state["k"], state["v"], torch.arange(state["k"].shape[1], device=k.device)[None]


def with_prefix(q, k, v, mask, prefix):
    """Prepend ParScale's per-stream prefix K,V, visible to every query."""
    if prefix is None:
        return q, k, v, mask
    pk, pv = prefix
    mask = torch.cat((mask.new_ones(*mask.shape[:-1], pk.shape[1]), mask), dim=-1)
    return q, torch.cat((pk, k), 1), torch.cat((pv, v), 1), mask


def local_attend(q, k, v, q_pos, k_pos, window, prefix=None, block: int | None = None):
    """Sliding-window attention in blocks, linear in the number of queries.

    Keys must be the contiguous positions that end at the last query (history first, then the
    queries' own, as ``keys`` returns them). Each block of ``b`` queries (``block``; by default
    W, at least 64) attends to the ``b + W - 1`` keys that can fall inside its windows, plus the
    prefix: (b + W - 1) / W times the pairs the windows need. A window longer than the keys
    sees them all, as one of their length does: it is clamped to that, so that memory scales with
    the keys rather than the window.
    """
    batch, n, heads, dim = q.shape
    window = min(window, k.shape[1])
    q_pos = q_pos.expand(batch, -1)
    b = block or max(window, 64)
    blocks = ceil_div(n, b)
    front = window - (k.shape[1] - n)  # left-pad so the keys start W positions before the queries
    back = blocks * b - n
    k = F.pad(k, (0, 0, 0, 0, front, back))[:, 1:]
    v = F.pad(v, (0, 0, 0, 0, front, back))[:, 1:]
    k_pos = F.pad(k_pos.expand(batch, -1), (front, back), value=-1)[:, 1:]
    q = F.pad(q, (0, 0, 0, 0, 0, back)).view(batch * blocks, b, heads, dim)
    q_pos = F.pad(q_pos, (0, back), mode="replicate").view(batch, blocks, b)
    span = b + window - 1

    def windows(t):
        return t.unfold(1, span, b).movedim(-1, 2).flatten(0, 1)  # [B * blocks, span, ...]

    k_win, v_win = windows(k), windows(v)
    k_pos_win = k_pos.unfold(1, span, b).flatten(0, 1)  # [B * blocks, span]
    mask = band_mask(q_pos.flatten(0, 1), k_pos_win, window)
    if prefix is not None:
        prefix = tuple(p.repeat_interleave(blocks, dim=0) for p in prefix)
    out = attend(*with_prefix(q, k_win, v_win, mask, prefix))
    return out.reshape(batch, blocks * b, heads, dim)[:, :n]
