"""Spec -> segments: the one description of the model's structure.

A segment is a contiguous run of layers within one half, applied ``times`` times with shared
weights. The model's forward pass, and later its inference state and cost tables, all walk the
same segments, so they cannot disagree about what runs how often.
"""

from __future__ import annotations

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
    state behind. In YOCO that is the global K,V projection: the cross-decoder is skipped."""
    stateful = [
        step.project or any(spec.block_at(i).keeps_state for i in segs[step.segment].layers) for step in plan
    ]
    return max((i + 1 for i, keeps in enumerate(stateful) if keeps), default=0)
