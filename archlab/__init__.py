"""archlab: declarative exploration of efficient decoder architectures (YOCO, YOCO-U, baselines).

    spec = archlab.load_spec("specs/tiny/yoco-u.yaml")
    model = archlab.build_model(spec)
    logits = model(input_ids)  # [batch, length, vocab]
    archlab.Cost(spec).row(8192)  # parameters, FLOPs and cache bytes, without building it

The names below are imported when first used, so that the ``archlab`` command can set how it ends
on Ctrl-C before torch loads.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "archlab.block": ("BlockSpec", "BuildContext", "MixerInput", "Problems"),
    "archlab.cost": ("Cost",),
    "archlab.engine": ("Engine", "Generation", "Sampling", "generate"),
    "archlab.model": ("Model", "build_model"),
    "archlab.spec": ("ModelSpec", "SpecError", "load_spec", "validate_spec"),
    "archlab.train.checkpoint": ("load_trained",),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'archlab' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
