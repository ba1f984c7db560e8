"""Block discovery: every installed ``archlab.blocks`` entry point names one BlockSpec subclass."""

from __future__ import annotations

import inspect
import warnings
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import get_args

from archlab.block import BlockSpec

GROUP = "archlab.blocks"


class RegistryError(Exception):
    """No block can be used: none is registered, or a block breaks the protocol (its module lacks what
    the model calls or gives back the wrong shape, its own code raises)."""


def plugin(cls: type) -> str:
    """Where a block spec class is defined, as its entry point names it (``module:Class``)."""
    return f"{cls.__module__}:{cls.__qualname__}"


def said(exc: BaseException) -> str:
    """An exception as one line: its type and message (its repr where the message is empty)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc)


def named(block: BlockSpec) -> str:
    """A block as errors about its own code name it: its type and the plugin that defines it."""
    return f"block {block.type!r} ({plugin(type(block))})"


def raised(block: BlockSpec, call: str, exc: BaseException) -> str:
    """What a block's own code that raised is said as: the block, its plugin, the call and the error,
    where a traceback would show the plugin's code to someone who only wrote a spec."""
    return f"{named(block)}: its {call} raised {said(exc)}"


class BrokenPlugin(UserWarning):
    """An installed block plugin that cannot be used, left out (a spec naming it says so)."""


def distributions(classes) -> dict[str, str]:
    """The installed packages, other than archlab, that registered these block spec classes, with
    their versions: a run's numbers depend on their code as on archlab's."""
    found, tags = {}, {_tags(cls): cls for cls in classes}
    for ep in entry_points(group=GROUP):
        if ep.dist is not None and not _is_archlab(ep) and (ep.name,) in tags and _load(ep) is tags[(ep.name,)]:
            found[ep.dist.name] = ep.dist.version  # the class it loads, wherever its module re-exports it from
    return found


def _tags(cls: type[BlockSpec]) -> tuple:
    return get_args(cls.model_fields["type"].annotation)


def _is_archlab(ep: EntryPoint) -> bool:
    return ep.dist is not None and ep.dist.name == "archlab"


@cache
def block_specs() -> dict[str, type[BlockSpec]]:
    """Map of block ``type`` name to its spec class, from the installed entry points. A broken
    plugin is left out with a notice naming what is wrong, rather than failing every command."""
    named: dict[str, dict[str, EntryPoint]] = {}
    for ep in entry_points(group=GROUP):
        named.setdefault(ep.name, {})[ep.value] = ep  # one package seen twice on the path counts once
    found: dict[str, type[BlockSpec]] = {}
    for name, points in sorted(named.items()):
        if len(points) > 1:  # else one would silently replace the other, whichever the path lists last
            own = [ep for ep in points.values() if _is_archlab(ep)]
            kept = f"; archlab's own {own[0].value} is kept" if own else "; none of them is used"
            warnings.warn(f"block type {name!r} is registered more than once ({', '.join(sorted(points))}); a plugin"
                          f" must take a name of its own{kept}", BrokenPlugin, stacklevel=2)
            if not own:
                continue
            points = {own[0].value: own[0]}
        (ep,) = points.values()
        why = _load(ep)
        if isinstance(why, str):
            warnings.warn(f"block plugin {ep.name!r} ({ep.value}) {why}; it is left out", BrokenPlugin, stacklevel=2)
            continue
        found[ep.name] = why
    if not found:
        raise RegistryError(f"no blocks registered under the {GROUP!r} entry-point group; is archlab installed?")
    return found


def _load(ep: EntryPoint) -> type[BlockSpec] | str:
    """The plugin's spec class, or why it cannot be used."""
    try:
        cls = ep.load()
    except (Exception, SystemExit) as exc:  # a broken plugin names itself instead of killing every command
        return f"failed to import: {said(exc)}"
    if not (isinstance(cls, type) and issubclass(cls, BlockSpec)):
        return "is not a subclass of archlab.BlockSpec"
    if inspect.isabstract(cls):
        return f"does not define {', '.join(sorted(cls.__abstractmethods__))}, which every block spec must define"
    tags = _tags(cls)
    if tags != (ep.name,):
        return f"must declare type: Literal[{ep.name!r}], has {tags}"
    return cls
