"""Inference state laid out like the plan, not as a generic list of K,V.

- the global K,V: one per projection step (one in YOCO, whatever T is; one per iteration in a
  cross-decoder loop that does not share it), a row per position;
- a state per (segment, iteration, layer), made by the layer's mixer (K,V rows, a window ring,
  recurrent and conv states); layers whose K,V a loop shares keep one for all iterations, and
  stateless mixers (cross-attention) none.

Every tensor is batch-first, so a subset of sequences can be taken out, prefilled and put back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from archlab.plan import Step

State = dict[str, torch.Tensor]


@dataclass
class CacheBytes:
    """Bytes held per sequence: ``global`` grows with the context, ``local`` does not."""

    global_: int
    local: int

    @property
    def total(self) -> int:
        return self.global_ + self.local


class Cache:
    def __init__(self, model, sequences: int, capacity: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.sequences, self.capacity, self.streams = sequences, capacity, model.streams
        rows = sequences * model.streams
        with torch.device(device):
            self.global_kv: dict[Step, State] = {
                step: model.global_kv.new_state(rows, capacity, dtype) for step in model.plan.steps if step.project
            }
            states = {key: model.layers[key[2]].mixer.new_state(rows, capacity, dtype) for key in model.plan.state_keys()}
        self.layers: dict[tuple[int, int, int], State] = {key: s for key, s in states.items() if s}
        self._grows = {key: model.spec.block_at(key[2]).grows_kv_cache for key in self.layers}

    def bytes_per_sequence(self) -> CacheBytes:
        def size(state: State) -> int:
            return sum(t.numel() * t.element_size() for t in state.values())

        global_ = sum(size(s) for s in self.global_kv.values())
        global_ += sum(size(s) for key, s in self.layers.items() if self._grows[key])
        local = sum(size(s) for key, s in self.layers.items() if not self._grows[key])
        return CacheBytes(global_ // self.sequences, local // self.sequences)

    def local_tensors(self) -> list[torch.Tensor]:
        """The tensors that do not grow with the context (windows, recurrent and conv states):
        the ones a repeated decoding step would change, where a growing cache only rewrites
        the same rows."""
        return [t for key, s in self.layers.items() if not self._grows[key] for t in s.values()]

    def _states(self) -> list[State]:
        return [*self.global_kv.values(), *self.layers.values()]

    def take(self, sequences: torch.Tensor) -> Cache:
        """A cache holding copies of the given sequences' rows."""
        rows = self._rows(sequences)
        sub = object.__new__(Cache)
        sub.sequences, sub.capacity, sub.streams, sub._grows = len(sequences), self.capacity, self.streams, self._grows
        sub.global_kv = {k: {n: t[rows] for n, t in s.items()} for k, s in self.global_kv.items()}
        sub.layers = {k: {n: t[rows] for n, t in s.items()} for k, s in self.layers.items()}
        return sub

    def put(self, sequences: torch.Tensor, sub: Cache) -> None:
        """Write back rows taken with ``take``."""
        rows = self._rows(sequences)
        for mine, theirs in zip(self._states(), sub._states()):
            for name, tensor in mine.items():
                tensor[rows] = theirs[name]

    def fill_from(self, sub: Cache) -> None:
        """Copy ``sub``'s sequences into every consecutive group of as many of ours."""
        if self.sequences % sub.sequences:
            raise ValueError(f"{sub.sequences} sequences do not tile {self.sequences}")
        for first in range(0, self.sequences, sub.sequences):
            self.put(torch.arange(first, first + sub.sequences), sub)

    def _rows(self, sequences: torch.Tensor) -> torch.Tensor:
        """Cache rows of sequences: ParScale keeps its streams next to each other."""
        return (sequences[:, None] * self.streams + torch.arange(self.streams, device=sequences.device)).flatten()
