"""Inference state laid out like the plan, not as a generic list of K,V.

- the global K,V: one per projection step (one in YOCO, whatever T is; one per iteration in a
  cross-decoder loop that does not share it), a row per position or pages of one pool
  (``archlab.kv``);
- a state per (segment, iteration, layer), made by the layer's mixer (K,V rows, a window ring,
  recurrent and conv states); layers whose K,V a loop shares keep one for all iterations, and
  stateless mixers (cross-attention) none. Each of its tensors grows with the context or does not
  (``growing``): only those that do not are put back before a prefill, and marked and rewound.

Every other tensor is batch-first, so a subset of sequences can be taken out, prefilled and put
back (a paged global K,V stays where it is: the subset gets a view of its page table).
"""

from __future__ import annotations

import copy

import torch

from archlab.block import CacheBytes
from archlab.kv import PageTable, pages_for, past_capacity, tensor_bytes
from archlab.memory import check_room
from archlab.plan import Step
from archlab.registry import RegistryError

State = dict[str, torch.Tensor]


def _row_first(state: State, rows: int, block: str) -> State:
    """A block's state as the cache keeps it, checked once when the cache is made: a dict of
    tensors with a row per sequence and stream first, which the cache takes and puts back by row."""
    if not (isinstance(state, dict) and all(isinstance(t, torch.Tensor) and t.shape[:1] == (rows,) for t in state.values())):
        got = ({name: tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for name, t in state.items()}
               if isinstance(state, dict) else type(state).__name__)
        raise RegistryError(f"block {block!r}: new_state({rows}, ...) must give a dict of tensors ({{}} for none) with a first"
                            f" dimension of {rows}, a row per sequence and stream; got {got}")
    return state


GROWTH_CONTEXTS = (1 << 20, 1 << 21)  # tokens: past any window, so a tensor whose size differs between these grows


def growing(mixer: torch.nn.Module, dtype: torch.dtype) -> dict[str, bool]:
    """Each tensor of ``mixer``'s state, by name, and whether it grows with the context: of a size
    that differs between two contexts past any window (made on the meta device: no memory)."""
    with torch.device("meta"):
        small, large = (mixer.new_state(1, context, dtype) for context in GROWTH_CONTEXTS)
    return {name: tensor.shape != large[name].shape for name, tensor in small.items()}


def _grown(model, layer: int, state: State, dtype: torch.dtype) -> set[str]:
    """The tensors of a layer's state that grow: none in a block whose flag says its state does
    not grow (``archlab build`` checks the flag, in ``archlab.checks.growth_problems``), and in
    one whose flag says it does, those ``growing`` finds, or all where its new_state cannot be
    made that large (a block with a context limit of its own)."""
    if not model.spec.block_at(layer).grows_kv_cache:
        return set()
    try:
        return {name for name, grows in growing(model.layers[layer].mixer, dtype).items() if grows}
    except Exception:  # whatever the block's own check raises: its whole state is taken as growing, as flagged
        return set(state)


class Cache:
    """``page_size``: keep the global K,V in a pool of ``pages`` pages of that many positions
    (by default enough for every sequence to reach ``capacity``) instead of a row per position,
    read by ``page_kernel`` (``archlab.kv``). Models without a global K,V keep rows whatever
    it says."""

    def __init__(self, model, sequences: int, capacity: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 page_size: int | None = None, pages: int | None = None, page_kernel: str = "torch"):
        self.sequences, self.capacity, self.streams = sequences, capacity, model.streams
        rows = sequences * model.streams
        self.page_table = None
        self.overrun = torch.zeros((), dtype=torch.bool, device=device)  # contiguous: a position past the capacity was fed
        if page_size is not None and model.global_kv is not None:
            pages = pages_for([capacity] * rows, page_size) if pages is None else pages
            self.page_table = PageTable(rows, pages, page_size, capacity, "meta", page_kernel)  # sized first, as the states are

        def new_global(on: torch.device | str = device) -> State:
            with torch.device(on):
                if self.page_table is None:
                    return model.global_kv.new_state(rows, capacity, dtype)
                return model.global_kv.new_pool(pages, page_size, dtype)

        def initial(key: tuple[int, int, int], rows: int, on: torch.device | str = device) -> State:
            """A layer's state as ``new_state`` makes it (again in ``start_over``)."""
            with torch.device(on):
                return model.layers[key[2]].mixer.new_state(rows, capacity, dtype)

        projections, keys = [step for step in model.plan.steps if step.project], model.plan.state_keys()
        shapes = [new_global("meta") for _ in projections]  # the meta device: shapes, no memory
        shapes += [_row_first(initial(key, rows, "meta"), rows, model.spec.block_at(key[2]).type) for key in keys]
        check_room(sum(tensor_bytes(shape.values()) for shape in shapes) + self.table_bytes(), device,
                   f"a cache's states ({sequences:,} sequence{'s' * (sequences != 1)} of up to {capacity:,} positions)")
        if self.page_table is not None:  # allocated whole: a small page size's table is as large as the pages it saves
            self.page_table = PageTable(rows, pages, page_size, capacity, device, page_kernel)
        self.global_kv: dict[Step, State] = {step: new_global() for step in projections}
        states = {key: initial(key, rows) for key in keys}
        self.layers: dict[tuple[int, int, int], State] = {key: s for key, s in states.items() if s}
        self._grows = {key: _grown(model, key[2], state, dtype) for key, state in self.layers.items()}
        # where a state both grows and does not: the first row of its fixed tensors as new_state made them, for
        # start_over (making them again would allocate the growing ones too)
        self._initial_fixed = {key: {name: t[:1].clone() for name, t in s.items() if name not in self._grows[key]}
                               for key, s in self.layers.items() if self._grows[key]}
        self._initial = initial
        self.fresh = True  # nothing fed into it yet (the engine says when)

    def table_bytes(self) -> int:
        """The page table's, beside the states: a page and its row per page, a page per column per row."""
        return 0 if self.page_table is None else self.page_table.nbytes()

    def bytes_per_sequence(self) -> CacheBytes:
        """What the cache holds, per sequence (a paged cache: its whole pool)."""
        global_ = sum(tensor_bytes(s.values()) for s in self.global_kv.values()) + tensor_bytes(self._layer_tensors(grown=True))
        local = tensor_bytes(self.local_tensors())
        return CacheBytes(global_ // self.sequences, local // self.sequences)

    def _layer_tensors(self, grown: bool) -> list[torch.Tensor]:
        return [t for key, s in self.layers.items() for name, t in s.items() if (name in self._grows[key]) == grown]

    def local_tensors(self) -> list[torch.Tensor]:
        """The tensors that do not grow with the context (windows, recurrent and conv states):
        the ones a repeated decoding step would change, where a growing cache only rewrites
        the same rows."""
        return self._layer_tensors(grown=False)

    def mark(self) -> list[torch.Tensor]:
        """A copy of the states that decoding changes in place, to ``rewind`` to: the cache then
        holds again what it held here (a growing K,V needs none, as in ``start_over``)."""
        return [t.clone() for t in self.local_tensors()]

    def rewind(self, marked: list[torch.Tensor]) -> None:
        """Put back the states ``mark`` copied, in place."""
        for tensor, copy_ in zip(self.local_tensors(), marked, strict=True):
            tensor.copy_(copy_)

    def start_over(self) -> None:
        """Put the states that do not grow back as ``new_state`` made them, in place (a captured
        CUDA graph keeps their memory): a prefill starts its sequences at position 0, where a
        recurrent state left by an earlier use would carry on silently. A growing K,V needs
        nothing: its old rows lie past the new positions, and each is written before it is read."""
        for key, state in self.layers.items():
            initial = self._initial_fixed[key] if self._grows[key] else self._initial(key, self.sequences * self.streams)
            for name, tensor in initial.items():
                state[name].copy_(tensor)  # _initial_fixed's one row is broadcast over all of them
        self.overrun.zero_()  # the rows an overrun wrote are rewritten before they are read
        self.fresh = True

    def reserve(self, ends: torch.Tensor, span: int) -> None:
        """Make room for positions below ends [rows], at most ``span`` past the last call's
        (the engine asks before every step that writes); a contiguous cache notes, on the
        device, whether any lies past its capacity."""
        if self.page_table is not None:
            self.page_table.reserve(ends, span)
        else:
            self.overrun |= (ends > self.capacity).any()

    def check(self) -> None:
        """Raise ``CacheFull`` if a sequence went past the capacity, or a paged cache ran out of
        pages (a sync with the device)."""
        if self.page_table is not None:
            self.page_table.check()
        elif self.overrun:
            raise past_capacity(self.capacity)

    def _states(self) -> list[State]:
        return [*self.global_kv.values(), *self.layers.values()]

    def take(self, sequences: torch.Tensor) -> Cache:
        """A cache holding copies of the given sequences' rows; a paged global K,V is shared,
        with a view of the page table for those rows."""
        rows = self._rows(sequences)
        sub = copy.copy(self)
        sub.sequences = len(sequences)
        if self.page_table is None:
            sub.global_kv = {k: {n: t[rows] for n, t in s.items()} for k, s in self.global_kv.items()}
        else:
            sub.page_table = self.page_table.select(rows)
        sub.layers = {k: {n: t[rows] for n, t in s.items()} for k, s in self.layers.items()}
        return sub

    def put(self, sequences: torch.Tensor, sub: Cache) -> None:
        """Write back rows taken with ``take``, or copy another cache's sequences in."""
        rows = self._rows(sequences)
        if (self.page_table is None) != (sub.page_table is None):
            raise ValueError("cannot copy sequences between a paged and a contiguous cache")
        if self.page_table is None:
            states = zip(self._states(), sub._states(), strict=True)
        else:  # pages are copied page by page; the rest row by row
            pools = [(ours[n], pool[n]) for ours, pool in zip(self.global_kv.values(), sub.global_kv.values(), strict=True) for n in ours]
            self.page_table.select(rows).copy_from(sub.page_table, pools)
            states = zip(self.layers.values(), sub.layers.values(), strict=True)
        for state, other in states:
            for name, tensor in state.items():
                tensor[rows] = other[name]

    def fill_from(self, sub: Cache) -> None:
        """Copy ``sub``'s sequences into every consecutive group of as many of ours."""
        if self.sequences % sub.sequences:
            raise ValueError(f"{sub.sequences} sequences do not tile {self.sequences}")
        for first in range(0, self.sequences, sub.sequences):
            self.put(torch.arange(first, first + sub.sequences), sub)

    def _rows(self, sequences: torch.Tensor) -> torch.Tensor:
        """Cache rows of sequences: ParScale keeps its streams next to each other."""
        return (sequences[:, None] * self.streams + torch.arange(self.streams, device=sequences.device)).flatten()


def check_cache_room(model, sequences: int, capacity: int, dtype: torch.dtype, device: torch.device | str,
                     page_size: int | None = None, page_kernel: str = "torch") -> None:
    """Refuse (``NoRoom``) a cache that ``device`` has no room for, sized on the meta device: before
    the work that would end in making it (a bench's prompts, a needle test's probes)."""
    shapes = Cache(model, sequences, capacity, dtype, "meta", page_size, page_kernel=page_kernel)
    check_room(sequences * shapes.bytes_per_sequence().total + shapes.table_bytes(), device, "its cache's states")
