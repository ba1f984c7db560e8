"""Block discovery: every installed ``archlab.blocks`` entry point names one BlockSpec subclass."""

from __future__ import annotations

import inspect
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import get_args

from archlab.block import BlockSpec

GROUP = "archlab.blocks"


class RegistryError(Exception):
    """An installed block plugin is broken (not a spec class, or a name that disagrees with it)."""


@cache
def block_specs() -> dict[str, type[BlockSpec]]:
    """Map of block ``type`` name to its spec class, from the installed entry points."""
    named: dict[str, dict[str, EntryPoint]] = {}
    for ep in entry_points(group=GROUP):
        named.setdefault(ep.name, {})[ep.value] = ep  # one package seen twice on the path counts once
    found: dict[str, type[BlockSpec]] = {}
    for name, points in sorted(named.items()):
        if len(points) > 1:  # else one would silently replace the other, whichever the path lists last
            raise RegistryError(f"block type {name!r} is registered more than once ({', '.join(sorted(points))}); a plugin"
                                " must take a name of its own")
        (ep,) = points.values()
        try:
            cls = ep.load()
        except (Exception, SystemExit) as exc:  # a broken plugin names itself instead of killing every command
            raise RegistryError(f"block plugin {ep.name!r} ({ep.value}) failed to import: {type(exc).__name__}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, BlockSpec)):
            raise RegistryError(f"block plugin {ep.name!r} ({ep.value}) is not a subclass of archlab.BlockSpec")
        if inspect.isabstract(cls):
            raise RegistryError(f"block plugin {ep.name!r} ({ep.value}) does not define {', '.join(sorted(cls.__abstractmethods__))},"
                                " which every block spec must")
        tags = get_args(cls.model_fields["type"].annotation)
        if tags != (ep.name,):
            raise RegistryError(
                f"block plugin {ep.name!r} ({ep.value}) must declare type: Literal[{ep.name!r}], has {tags}"
            )
        found[ep.name] = cls
    if not found:
        raise RegistryError(f"no blocks registered under the {GROUP!r} entry-point group; is archlab installed?")
    return found
