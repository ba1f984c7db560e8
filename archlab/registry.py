"""Block discovery: every installed ``archlab.blocks`` entry point names one BlockSpec subclass."""

from __future__ import annotations

from functools import cache
from importlib.metadata import entry_points
from typing import get_args

from archlab.block import BlockSpec

GROUP = "archlab.blocks"


class RegistryError(Exception):
    """An installed block plugin is broken (not a spec class, or a name that disagrees with it)."""


@cache
def block_specs() -> dict[str, type[BlockSpec]]:
    """Map of block ``type`` name to its spec class, from the installed entry points."""
    found: dict[str, type[BlockSpec]] = {}
    for ep in sorted(entry_points(group=GROUP), key=lambda ep: ep.name):
        try:
            cls = ep.load()
        except Exception as exc:  # a broken plugin names itself instead of killing every command
            raise RegistryError(f"block plugin {ep.name!r} ({ep.value}) failed to import: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, BlockSpec)):
            raise RegistryError(f"block plugin {ep.name!r} ({ep.value}) is not a subclass of archlab.BlockSpec")
        tags = get_args(cls.model_fields["type"].annotation)
        if tags != (ep.name,):
            raise RegistryError(
                f"block plugin {ep.name!r} ({ep.value}) must declare type: Literal[{ep.name!r}], has {tags}"
            )
        found[ep.name] = cls
    if not found:
        raise RegistryError(f"no blocks registered under the {GROUP!r} entry-point group; is archlab installed?")
    return found
