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
