"""The global K,V as the cross-decoder reads it: rows per position, or pages from a pool.

A contiguous cache gives every sequence a row per position up to the batch's capacity, so a
ragged batch holds its longest sequence's length for every row. A paged cache keeps the global
K,V in one pool of pages of ``page_size`` positions (256 in the paper's serving stack), handed
out as each sequence reaches them: the batch holds what its sequences use, rounded up to a page.

Pages are handed out on the device with static shapes, so a decoding step that crosses a page
boundary still replays from one CUDA graph. They are handed out in order and not returned while
the cache lives. A spare page past the pool's end takes the writes of a row the pool had no page
left for; it is never read, and ``PageTable.check`` then reports the shortage.

Decoding reads the pool where it lies, with one of two kernels:
- ``torch``: every page scores its sequence's query and keeps its maximum, sum and weighted
  values, and each sequence combines its pages' partial results (flash-decoding's split of the
  keys, one split per page), in batched matmuls;
- ``flex``: FlexAttention, each head's pool one sequence whose blocks are pages (as PyTorch's
  paged attention for it), compiled on CUDA into its decoding kernel.
Longer query blocks gather their sequence's pages into rows first.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from archlab.block import ceil_div
from archlab.ops.attention import attend, band_mask, flex_kernel


class KVRows(NamedTuple):
    """K, V [B, M, Hkv, Dh] with a row per position, and the positions [B or 1, M]."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor

    def attend(self, q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """Attention of q [B, N, H, Dh] at q_pos [B, N] over the keys at or before each query."""
        return attend(q, self.k, self.v, band_mask(q_pos, self.positions, None))


class CacheFull(RuntimeError):
    """A paged cache ran out of pages, or a sequence went past its capacity."""


def past_capacity(capacity: int) -> CacheFull:
    return CacheFull(f"a sequence went past the cache's capacity of {capacity} positions")


def pages_for(lengths: list[int], page_size: int) -> int:
    """Pages that sequences of these lengths hold."""
    return sum(ceil_div(n, page_size) for n in lengths)


PAGE_KERNELS = ("torch", "flex")


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the tensors hold."""
    return sum(t.numel() * t.element_size() for t in tensors)


class PageTable:
    """Which pool page holds each page of positions of each row; shared by every paged state
    of a cache (they all grow together). ``select`` makes a view of some rows."""

    def __init__(self, rows: int, pages: int, page_size: int, capacity: int, device: torch.device | str = "cpu",
                 kernel: str = "torch"):
        """``kernel``: how a decoding step reads the pages, ``torch`` (split by page, batched
        matmuls) or ``flex`` (FlexAttention)."""
        self.page_size, self.pages, self.capacity, self.kernel = page_size, pages, capacity, kernel
        width = ceil_div(capacity, page_size)
        with torch.device(device):
            self.rows = torch.arange(rows)  # the rows of the table this view covers
            self.table = torch.full((rows, width + 1), self.spare)  # [row, page of positions]; last column: a dump
            self.held = torch.zeros(rows, dtype=torch.long)  # pages each row holds
            self.owner = torch.full((pages + 1,), -1)  # pool page -> row (-1: free, or the spare page)
            self.first = torch.zeros(pages + 1, dtype=torch.long)  # pool page -> its first position
            self.handed = torch.zeros((), dtype=torch.long)  # pages handed out (asked for, past the pool too)
            self.overrun = torch.zeros((), dtype=torch.bool)  # a position past the capacity was asked for

    def nbytes(self) -> int:
        """What its tensors hold, in bytes."""
        return tensor_bytes((self.rows, self.table, self.held, self.owner, self.first))

    @property
    def spare(self) -> int:
        """The pool page past the last: it takes the writes the pool had no page for, never read."""
        return self.pages

    @property
    def width(self) -> int:
        return self.table.shape[1] - 1

    def select(self, rows: torch.Tensor) -> PageTable:
        """A view of some of this view's rows, sharing the table and the pool's bookkeeping."""
        view = copy.copy(self)
        view.rows = self.rows[rows]
        return view

    def reserve(self, ends: torch.Tensor, span: int) -> None:
        """Hand out pages so that each row holds positions [0, ends[r]). A call adds at most
        ``span`` positions per row, which bounds the pages it may hand out (static shapes)."""
        self.overrun |= (ends > self.capacity).any()
        need = ceil_div(ends, self.page_size).clamp(max=self.width)
        held = self.held[self.rows]
        col = held[:, None] + torch.arange(min(ceil_div(span, self.page_size) + 1, self.width), device=ends.device)
        new = col < need[:, None]
        page = self.handed + new.flatten().cumsum(0).view_as(new) - 1
        fits = new & (page < self.pages)
        page = torch.where(fits, page, self.spare)
        col = col.clamp(max=self.width)  # columns past the table go to the dump column, unchanged
        table = self.table[self.rows]
        self.table[self.rows] = table.scatter(1, col, torch.where(new, page, table.gather(1, col)))
        self.owner.scatter_(0, page.flatten(), torch.where(fits, self.rows[:, None], -1).flatten())
        self.first.scatter_(0, page.flatten(), torch.where(fits, col * self.page_size, 0).flatten())
        self.held[self.rows] = torch.maximum(held, need)
        self.handed += new.sum()

    def needed(self, ends: torch.Tensor) -> int:
        """Pages the rows hold once each holds positions [0, ends[r]) (the pages they hold kept)."""
        return int(torch.maximum(self.held[self.rows], ceil_div(ends.to(self.held.device), self.page_size)).sum())

    def ran_out(self) -> bool:
        """Whether a row asked for more than the pool or the capacity holds: its table then sends
        positions to the spare page for good."""
        return bool(self.overrun) or int(self.handed) > self.pages

    def check(self) -> None:
        """Raise ``CacheFull`` if a row asked for more than the pool or the capacity holds."""
        if self.overrun:
            raise past_capacity(self.capacity)
        handed = int(self.handed)
        if handed > self.pages:
            raise CacheFull(
                f"the cache's {self.pages} K,V pages of {self.page_size} positions ran out: its sequences"
                f" needed {handed} by then. Make the cache with more pages (pages={handed} or more)"
            )

    def column(self, positions: torch.Tensor) -> torch.Tensor:
        """The table column holding each position; past the capacity's last page, the dump column,
        so that an overrun lands on the spare page and ``check`` names it (no index error first)."""
        return (positions // self.page_size).clamp(max=self.width)

    def write(self, positions: torch.Tensor, *pools: tuple[torch.Tensor, torch.Tensor]) -> None:
        """For each (pool [Hkv, pages + 1, page_size, Dh], values [rows, N, Hkv, Dh]): the pool at
        the rows' positions [rows or 1, N] = the values. The slots are found once for all pools."""
        positions = positions.expand(len(self.rows), -1)
        page, slot = self.table[self.rows].gather(1, self.column(positions)), positions % self.page_size
        for pool, values in pools:
            pool[:, page, slot] = values.movedim(2, 0).to(pool.dtype)

    def copy_from(self, source: PageTable, pools: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Give this view's rows copies of ``source``'s rows' pages: (ours, theirs) per pool."""
        if source.table is self.table and torch.equal(source.rows, self.rows):
            return  # the same pages
        self.reserve((source.held[source.rows] * self.page_size).clamp(max=self.capacity), span=self.capacity)
        mine, theirs = self.table[self.rows], source.table[source.rows]
        for ours, pool in pools:
            ours[:, mine] = pool[:, theirs]


@dataclass
class PagedKV:
    """The global K,V in pools [Hkv, pages + 1, page_size, Dh], read through a page table.

    Heads come first so that each head's pool is one long sequence of pages: a view both
    FlexAttention (one sequence, pages as its blocks) and a batched matmul (a page per matrix)
    read in place."""

    k: torch.Tensor
    v: torch.Tensor
    page_table: PageTable

    def attend(self, q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """Attention of q [rows, N, H, Dh] at q_pos [rows or 1, N] over the keys at or before each query."""
        if q.shape[1] > 1:
            table = self.page_table.table[self.page_table.rows, :-1]
            k, v = (pool[:, table].permute(1, 2, 3, 0, 4).flatten(1, 2) for pool in (self.k, self.v))  # [rows, width * page_size, Hkv, Dh]
            return attend(q, k, v, band_mask(q_pos, torch.arange(k.shape[1], device=q.device)[None], None))
        q_pos = q_pos.expand(len(q), -1)
        return self._flex(q, q_pos) if self.page_table.kernel == "flex" else self._split_by_page(q, q_pos)

    def _split_by_page(self, q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        rows, n, heads, dim = q.shape
        out = self._combine_pages(*self._page_partials(q, q_pos), rows)  # [Hkv, rows, group, n, Dh]
        return out.permute(1, 3, 0, 2, 4).reshape(rows, n, heads, dim).to(q.dtype)

    def _page_partials(self, q: torch.Tensor, q_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each pool page's attention of its sequence's queries over its keys, before the softmax's
        division: the weighted values [Hkv, pages, group, n, Dh], and the scores' maximum and the
        weights' sum [Hkv, pages, group, n]."""
        rows, n, heads, dim = q.shape
        kv_heads, pages, size, _ = self.k.shape
        group = heads // kv_heads
        local = torch.full((self.page_table.table.shape[0] + 1,), -1, device=q.device)  # row of the table -> row of q
        local[self.page_table.rows] = torch.arange(rows, device=q.device)
        mine = local[self.page_table.owner]  # the spare and free pages' owner -1 reads local's last entry, -1
        seen, mine = mine >= 0, mine.clamp(min=0)
        # scores of each page's keys against its sequence's queries, the query heads of a K,V head side by side
        folded = q[mine].view(pages, n, kv_heads, group, dim).permute(2, 0, 3, 1, 4).reshape(kv_heads * pages, group * n, dim)
        keys = self.k.view(kv_heads * pages, size, dim).transpose(1, 2)
        scores = matmul_fp32(folded, keys).view(kv_heads, pages, group, n, size) * dim**-0.5
        key_pos = self.page_table.first[:, None] + torch.arange(size, device=q.device)
        visible = seen[:, None, None] & (key_pos[:, None, :] <= q_pos[mine][:, :, None])  # [pages, n, size]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        top = scores.amax(-1)
        weights = torch.exp(scores - torch.where(top.isfinite(), top, 0)[..., None])
        values = self.v.view(kv_heads * pages, size, dim)
        out = matmul_fp32(weights.flatten(2, 3).flatten(0, 1).to(values.dtype), values).view(kv_heads, pages, group, n, dim)
        return out, top, weights.sum(-1)

    def _combine_pages(self, out: torch.Tensor, top: torch.Tensor, total: torch.Tensor, rows: int) -> torch.Tensor:
        """Each sequence's attention [Hkv, rows, group, n, Dh] from its pages' partial results
        (``_page_partials``), each rescaled to the sequence's highest score."""
        pages = self.k.shape[1]
        # each sequence's pages, in position order (unheld columns point at the spare page: all masked), gathered a
        # few columns at a time: all at once, the partials took rows x columns x H x Dh, however few pages were held
        table = self.page_table.table[self.page_table.rows]
        top = top[:, table]  # the scores' maxima alone: no Dh
        peak = top.amax(2, keepdim=True)
        step = ceil_div(pages, rows)  # columns at once: their copy of the partials stays within the pool's size (a full pool: all)
        summed = weighed = 0
        for first in range(0, table.shape[1], step):
            columns = table[:, first : first + step]
            scale = torch.exp(top[:, :, first : first + step] - peak).nan_to_num(0.0)  # exp(-inf - -inf): nothing visible
            summed = summed + (out[:, columns] * scale[..., None]).sum(2)
            weighed = weighed + (total[:, columns] * scale).sum(2)
        return summed / weighed[..., None]

    def _flex(self, q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """FlexAttention over each head's pool as one sequence whose blocks are pages (its
        decoding kernel on CUDA splits the keys itself)."""
        kv_heads, pages, size, dim = self.k.shape
        k, v = (pool.view(1, kv_heads, pages * size, dim) for pool in (self.k, self.v))
        out = flex_kernel(q.device.type)(q.transpose(1, 2), k, v, block_mask=self.block_mask(q_pos), enable_gqa=True)
        return out.transpose(1, 2)

    def block_mask(self, q_pos: torch.Tensor):
        """The pages each row's query [rows, 1] at q_pos sees, as FlexAttention blocks: the row's
        pages before the one holding its position are full; that page is the one partial block."""
        from torch.nn.attention.flex_attention import BlockMask

        _, pages, size, _ = self.k.shape
        table, owner, first, mine = self.page_table.table[self.page_table.rows], self.page_table.owner, self.page_table.first, self.page_table.rows
        full = self.page_table.column(q_pos[:, 0] + 1)
        partial = ((q_pos[:, 0] + 1) % size > 0).int()

        def visible(b, h, q_idx, kv_idx):
            page = kv_idx // size
            return (owner[page] == mine[b]) & (first[page] + kv_idx % size <= q_pos[b, q_idx])

        # the partial page leads a list as wide as the full pages': a kernel may index both
        # lists with the strides and width of the first (CUDA's decoding kernel does)
        held = table[:, :-1].contiguous()
        seen = torch.cat([table.gather(1, full[:, None]), held[:, :-1]], 1)
        return BlockMask.from_kv_blocks(
            partial[:, None, None], seen[:, None, None].int(), full[:, None, None].int(), held[:, None, None].int(),
            BLOCK_SIZE=(FLEX_QUERY_BLOCK, size), mask_mod=visible, seq_lengths=(q_pos.shape[1], pages * size),
            compute_q_blocks=False,  # those serve the backward pass only
        )


FLEX_QUERY_BLOCK = 128


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched a @ b with a float32 (or wider) result, as attention scores need. On CUDA,
    half-precision operands are multiplied as they are into a float32 result; elsewhere they
    are widened first."""
    if a.dtype in (torch.float16, torch.bfloat16):
        if a.is_cuda:
            return torch.bmm(a, b, out_dtype=torch.float32)
        a, b = a.float(), b.float()
    return torch.bmm(a, b)
