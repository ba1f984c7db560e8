"""Sliding-window attention: causal attention over the last ``window`` positions (keys i-W+1..i)."""

from __future__ import annotations

from typing import ClassVar, Literal

from archlab.block import Size
from blocks.attention import AttentionSpec


class SlidingWindowSpec(AttentionSpec):
    """Its cache is a ring of ``window`` rows, so it never grows with the context."""

    type: Literal["swa"]
    window: Size = 512

    grows_kv_cache: ClassVar[bool] = False

    def window_size(self) -> int | None:
        return self.window
