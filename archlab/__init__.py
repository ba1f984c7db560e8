"""archlab: declarative exploration of efficient decoder architectures (YOCO, YOCO-U, baselines).

    spec = archlab.load_spec("specs/tiny/yoco-u.yaml")
    model = archlab.build_model(spec)
    logits = model(input_ids)  # [batch, length, vocab]
    archlab.Cost(spec).row(8192)  # parameters, FLOPs and cache bytes, without building it
"""

from archlab.block import BlockSpec, BuildContext, MixerInput, Problems
from archlab.cost import Cost
from archlab.engine import Engine, Generation, Sampling, generate
from archlab.model import Model, build_model
from archlab.spec import ModelSpec, SpecError, load_spec, validate_spec
from archlab.train.checkpoint import load_trained

__all__ = [
    "BlockSpec",
    "BuildContext",
    "Cost",
    "Engine",
    "Generation",
    "Sampling",
    "generate",
    "MixerInput",
    "Model",
    "ModelSpec",
    "Problems",
    "SpecError",
    "build_model",
    "load_spec",
    "load_trained",
    "validate_spec",
]
