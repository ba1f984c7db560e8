"""The training config: YAML validated like a spec, with dotted ``--set key=value`` overrides."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import Field, PositiveFloat, PositiveInt, ValidationError

from archlab.block import Problem, Problems, Strict
from archlab.cost import SHORTEST_TRAINING_LENGTH
from archlab.spec import SCHEMA_VERSION, PathName, SchemaVersion, SpecError, apply_overrides, differences, load_yaml, validate_as

SEED_LIMIT = 2**63  # seeds are 0 .. SEED_LIMIT - 1: what torch and numpy both take
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]
Beta = Annotated[float, Field(ge=0, lt=1)]  # AdamW's decay of a moment estimate
SYNTHETIC = ("mqar", "copy")  # recall tasks, generated rather than read
NAMED_SOURCES = ("stdlib", *SYNTHETIC)  # data sources that are not paths (nor hf:NAME)
TOKEN_FILES = (".bin", ".npy")  # data sources of token ids, which need no tokenizer
EXAMPLES = ".jsonl"  # a data source of prompt/response examples or conversations, trained on their responses alone
MAX_STEPS = 10**12  # optimizer steps: past any run's, so that a budget off by its units is refused, not started
MAX_STEP_TOKENS = 2**28  # tokens a step: 16x the largest published batches, so that a typo is refused, not built row by row


class Optimizer(Strict):
    """AdamW; weight decay applies to tensors of two or more dimensions (matrices, conv filters,
    ParScale's prefixes), not to 1-D ones (norms' gains, biases, gates)."""

    lr: PositiveFloat = 3e-3
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    eps: PositiveFloat = 1e-8
    weight_decay: float = Field(0.1, ge=0)


class Schedule(Strict):
    """Linear warmup, then cosine decay toward ``min_lr_ratio * lr``, reached one step past the last."""

    warmup_steps: int = Field(20, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


class Data(Strict):
    """Where tokens come from.

    ``source``: ``stdlib`` (the Python standard library's source, on every machine), a text file
    or folder of text files, a token file (``.bin`` of uint16/uint32 or ``.npy``), ``hf:NAME``
    (a Hugging Face dataset, streamed; needs network), a synthetic task ``mqar`` / ``copy``, or a
    ``.jsonl`` file of ``{"prompt": ..., "response": ...}`` examples or ``{"messages": [...]}``
    conversations for supervised fine-tuning, where only the responses' (the assistant messages')
    tokens are trained on and scored.
    """

    source: PathName = "stdlib"
    tokenizer: PathName | None = None  # a tokenizer.json; None: train a byte-level BPE on the corpus
    max_bytes: PositiveInt = 16_000_000  # characters of text read from a corpus to tokenize
    val_fraction: float = Field(0.05, gt=0, lt=0.5)
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # of a raw .bin token file
    hf_text_field: str = "text"
    cache: PathName | None = None  # folder for the tokenized corpus and tokenizer; None: the run directory

    def anchored(self) -> Data:
        """The same data with its paths absolute, as a run records them: resumed, or read by
        ``generate``, from another folder, the run still finds its corpus, tokenizer and cache."""
        return self.model_copy(update={"source": anchored_source(self.source), "tokenizer": absolute(self.tokenizer),
                                       "cache": absolute(self.cache)})


def absolute(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(path)


def holds_token_ids(source: str) -> bool:
    """Whether a data source names a file of token ids by its suffix (.npy, .bin; .NPY from a
    case-blind system too)."""
    return Path(source).suffix.lower() in TOKEN_FILES


def tokenized(source: str) -> bool:
    """Whether a run on this source tokenizes text, and so keeps a tokenizer.json: not a recall
    task, not a file of token ids."""
    return source not in SYNTHETIC and not holds_token_ids(source)


def holds_examples(source: str) -> bool:
    """Whether a data source is a file of examples (prompt/response pairs or conversations)."""
    return Path(source).suffix.lower() in (EXAMPLES, ".ndjson")  # JSON Lines' other name; .JSONL from a case-blind system


def anchored_source(source: str) -> str:
    """A data source as a run records it: a path made absolute, a named source (or hf:NAME) as it is."""
    return source if source in NAMED_SOURCES or source.startswith("hf:") else os.path.abspath(source)


def divisor_below(n: int, limit: int) -> int:
    """The largest divisor of ``n`` below ``limit``: a micro-batch size that splits it whole."""
    return next(d for d in range(min(limit - 1, n), 0, -1) if n % d == 0)


class TrainConfig(Strict):
    schema_version: SchemaVersion = SCHEMA_VERSION
    steps: int = Field(200, gt=0, le=MAX_STEPS)
    batch_size: PositiveInt = 16  # sequences per optimizer step, over all processes
    micro_batch_size: PositiveInt = 16  # sequences per forward pass per process; left out, at most each process's share of the batch
    seq_len: int = Field(128, ge=SHORTEST_TRAINING_LENGTH)  # 1 is refused: costs (MFU, --flops) would count its pass as a decoding step
    optimizer: Optimizer = Optimizer()
    schedule: Schedule = Schedule()
    grad_clip: float = Field(1.0, ge=0)  # 0: off
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    compile: bool = False
    seed: Seed = 0
    eval_interval: PositiveInt = 50
    eval_batches: PositiveInt = 4
    log_interval: PositiveInt = 10
    checkpoint_interval: PositiveInt = 100
    keep_checkpoints: PositiveInt = 3
    data: Data = Data()
    init: PathName | None = None  # a training run (its latest checkpoint) or checkpoint folder to start from: fine-tuning

    def autocast(self, device: torch.device) -> AbstractContextManager:
        """Where the model runs on ``device``, as this config trains it: bf16 autocast, or as it is."""
        bf16 = self.precision == "bf16" or (self.precision == "auto" and device.type == "cuda")
        return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()

    def problems(self) -> list[Problem]:
        root = Problems()
        given = "micro_batch_size" in self.model_fields_set
        if self.batch_size % self.micro_batch_size and (given or self.batch_size > self.micro_batch_size):
            default = "" if given else " (the default)"
            root.at("micro_batch_size").add(
                f"{self.micro_batch_size}{default} does not divide batch_size={self.batch_size}; the gradient is"
                f" accumulated over whole micro-batches: set micro_batch_size to a divisor, such as"
                f" {divisor_below(self.batch_size, self.micro_batch_size)}"
            )
        if (tokens := self.batch_size * self.seq_len) > MAX_STEP_TOKENS:
            root.at("batch_size").add(f"{self.batch_size:,} sequences of seq_len={self.seq_len:,} tokens are {tokens:,} tokens a step, more"
                                      f" than the {MAX_STEP_TOKENS:,} (2^28) a step may take; check its units")
        if not self.data.source.strip():  # read as a path, the current folder, whose every text file would be trained on
            root.at("data").at("source").add("is empty; give stdlib, a path, hf:NAME[:split], mqar or copy")
        elif self.data.source.startswith("hf:") and not self.data.source[3:].partition(":")[0].strip():
            root.at("data").at("source").add(f"{self.data.source!r} names no dataset; give hf:NAME[:split]")
        for at, path in ((root.at("data").at("tokenizer"), self.data.tokenizer), (root.at("data").at("cache"), self.data.cache),
                         (root.at("init"), self.init)):
            if path is not None and not path.strip():  # read as a path, the current folder
                at.add("is empty; give a path, or leave it out")
        if self.data.cache and holds_examples(self.data.source):
            root.at("data").at("cache").add(f"{self.data.cache!r}: a {EXAMPLES} file's examples are tokenized at each start,"
                                            " into no cache; drop data.cache")
        return root.found


RESUMABLE = ("steps", "optimizer", "schedule", "grad_clip", "micro_batch_size", "compile", "eval_interval", "eval_batches",
             "log_interval", "checkpoint_interval", "keep_checkpoints")
"""What a resume may change (with MoE, not micro_batch_size: the balance loss is taken over each pass).
The rest (batch_size, seq_len, seed, data, precision) decides which tokens a step reads or how it
computes them, so changing it would make the resumed run another experiment."""


def resumable(moe: bool) -> list[str]:
    """The fields a resume of this run may change."""
    return [key for key in RESUMABLE if not (key == "micro_batch_size" and moe)]


def kept_on_resume(keys: list[str], moe: bool) -> str | None:
    """Why a resume may not change these dotted keys, or None where it may change them all."""
    fixed = [key for key in keys if key.split(".")[0] not in resumable(moe)]
    if not fixed:
        return None
    moe_note = " (with MoE, micro_batch_size: the balance loss is taken over each pass)" if moe else ""
    return (f"a resumed run keeps its {', '.join(fixed)}: it decides which tokens a step reads or how it computes"
            f" them{moe_note}; a resume may --set {', '.join(resumable(moe))}")


def changes(old: TrainConfig, new: TrainConfig) -> dict[str, tuple]:
    """The fields that differ, as dotted keys, each with its (old, new) values."""
    return differences(old.model_dump(mode="json"), new.model_dump(mode="json"))


def changes_since_trained(trained: object, config: TrainConfig) -> dict[str, tuple]:
    """``changes`` from ``trained``, the config a checkpoint's state.json records, to ``config``;
    none where it records none (written before checkpoints did) or one this version no longer
    reads, which leave nothing to compare."""
    try:
        return changes(TrainConfig.model_validate(trained), config)
    except ValidationError:
        return {}


def load_config(path: str | None, overrides: list[str] = ()) -> TrainConfig:
    keys = [key for key, sep, _ in (item.partition("=") for item in overrides) if sep and key]  # the rest: a KEY=VALUE error below
    strays = [key for key in keys if key.split(".")[0] not in TrainConfig.model_fields]
    if strays:  # most often a spec field, which pydantic alone would call an unknown key
        raise SpecError("--set", [Problem(key, f"not a training config field: did you mean {_home(key)}?" if _home(key) else
                                          "not a training config field: --set reaches only the training config; a spec field"
                                          " belongs in the spec file, or in a spec that `extends` it") for key in strays])
    origins: dict[str, str] = {}
    data = apply_overrides(load_yaml(path, origins) if path else {}, list(overrides), origins)
    try:
        return validate_as(TrainConfig, data, path or "--set", origins)
    except SpecError as exc:  # a nested field given at the top (lr: for optimizer.lr) is named where it goes
        raise SpecError(exc.source, [Problem(p.loc, f"{p.msg}; did you mean {_home(p.loc)}?") if _home(p.loc) and
                                     p.msg.startswith("unknown key") else p for p in exc.problems]) from None


def _home(key: str) -> str | None:
    """Where a top-level key that is not a field belongs: the section holding a field of that name."""
    for section, field in TrainConfig.model_fields.items():
        holder = field.annotation
        if isinstance(holder, type) and issubclass(holder, Strict) and key in holder.model_fields:
            return f"{section}.{key}"
    return None
