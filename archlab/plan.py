"""Spec -> plan: the one description of the model's structure.

A segment is a contiguous run of layers within one half, applied ``times`` times with shared
weights; the steps are the forward pass as a flat list. The model's forward pass, its inference
cache and the cost tables all walk the same plan, so they cannot disagree about what runs how
often or what state is kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from archlab.spec import ModelSpec


@dataclass(frozen=True)
class Segment:
    half: int  # index into spec.halves: 0 = self-decoder (or the whole stack), 1 = cross-decoder
    start: int  # global layer indices [start, end)
    end: int
    times: int = 1
    share_kv: bool = False  # iterations after the first reuse the first's K,V (and the global K,V)

    @property
    def layers(self) -> range:
        return range(self.start, self.end)


def segments(spec: ModelSpec) -> tuple[Segment, ...]:
    """Split each half at the loop's boundaries; the looped part carries the loop's T."""
    loop = spec.loop_range()
    out, first = [], 0
    for half_index, (_, half) in enumerate(spec.halves):
        cuts = sorted({first, first + half.n_layers, *(c for c in loop or () if first < c < first + half.n_layers)})
        for start, end in zip(cuts, cuts[1:]):
            looped = loop is not None and loop[0] <= start and end <= loop[1]
            out.append(
                Segment(
                    half=half_index,
                    start=start,
                    end=end,
                    times=spec.loop.times if looped else 1,
                    share_kv=looped and spec.loop.kv_cache == "shared",
                )
            )
        first += half.n_layers
    return tuple(out)


@dataclass(frozen=True)
class Step:
    """One thing the forward pass does, in order: project the global K,V, or run a segment's
    layers once (iteration ``iteration`` of segment ``segment``)."""

    segment: int
    iteration: int
    project: bool = False


def steps(segs: tuple[Segment, ...]) -> tuple[Step, ...]:
    """The forward pass as a flat list. The global K,V is projected before the first
    cross-decoder segment, and again at each later iteration of a loop that does not share it."""
    out: list[Step] = []
    projected = False
    for s, seg in enumerate(segs):
        if seg.half == 1 and not projected:
            out.append(Step(s, 0, project=True))
            projected = True
        for t in range(seg.times):
            if t > 0 and seg.half == 1 and not seg.share_kv:
                out.append(Step(s, t, project=True))
            out.append(Step(s, t))
    return tuple(out)


def prefill_end(spec: ModelSpec, segs: tuple[Segment, ...], plan: tuple[Step, ...]) -> int:
    """How many leading steps a prefill must run: up to the last one that leaves inference
    state behind. In YOCO that is the global K,V projection, so the cross-decoder is skipped,
    unless a looped one projects a K,V per iteration: then its iterations up to the last
    projection run too."""
    stateful = [
        step.project or any(spec.block_at(i).keeps_state for i in segs[step.segment].layers) for step in plan
    ]
    return max((i + 1 for i, keeps in enumerate(stateful) if keeps), default=0)


@dataclass(frozen=True, eq=False)
class Plan:
    spec: ModelSpec
    segments: tuple[Segment, ...]
    steps: tuple[Step, ...]
    prefill_steps: tuple[Step, ...]  # the leading steps a prefill runs

    @classmethod
    def of(cls, spec: ModelSpec) -> Plan:
        segs = segments(spec)
        plan = steps(segs)
        return cls(spec, segs, plan, plan[: prefill_end(spec, segs, plan)])

    def half_of(self, layer: int) -> int:
        return next(seg.half for seg in self.segments if layer in seg.layers)

    def shared(self, step: Step, layer: int) -> bool:
        """Whether this layer's K,V at this step is the loop's one shared K,V."""
        return self.segments[step.segment].share_kv and self.spec.block_at(layer).shares_kv

    def reuses_kv(self, step: Step, layer: int) -> bool:
        """An iteration after the first in a loop that shares K,V: it reads, never writes, K,V."""
        return step.iteration > 0 and self.shared(step, layer)

    def state_key(self, step: Step, layer: int) -> tuple[int, int, int]:
        """The cache slot of a layer at a step: loops that share K,V keep the first iteration's."""
        return (step.segment, 0 if self.shared(step, layer) else step.iteration, layer)

    def applications(self, steps: tuple[Step, ...] | None = None) -> Iterator[tuple[Step, int]]:
        """(step, layer) for every layer application of ``steps`` (all by default), in forward order."""
        return ((step, i) for step in (self.steps if steps is None else steps) if not step.project
                for i in self.segments[step.segment].layers)

    def state_keys(self) -> list[tuple[int, int, int]]:
        """Every distinct layer state slot, in forward order."""
        return list(dict.fromkeys(self.state_key(step, i) for step, i in self.applications()))
