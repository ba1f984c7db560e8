"""The contract every block plugin implements.

A block is the sequence mixer of one layer (the part between the pre-norm and the residual add).
Its plugin is a pydantic spec class, tagged by a literal ``type``, that knows how to check itself
against the model around it and how to build its ``nn.Module``. The model never asks which block
it holds: it reads the capability flags below and calls ``build``.
"""

from __future__ import annotations

import math
import numbers
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, get_args, get_origin

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError, PydanticKnownError
from torch import nn

if TYPE_CHECKING:
    from archlab.kv import KVRows, PagedKV


MAX_SIZE = 2**20
Size = Annotated[int, Field(gt=0, le=MAX_SIZE)]
"""A width, head count, head size, hidden size, chunk or window: bounded far past any real model's,
so that a typo (``hidden: 1e30``) is refused here rather than spent in costing and the allocator."""

YES_OR_NO = "yes_or_no_for_a_number"  # the error type of Strict's check


class Strict(BaseModel):
    """Base of every spec model: unknown keys are errors, numbers are finite and never yes/no values,
    fields cannot be reassigned once validated (and a model spec's block lists are tuples)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="wrap")
    @classmethod
    def _no_yes_or_no_for_a_number(cls, data: Any, handler: Callable[[Any], Any]) -> Any:
        """pydantic reads true as 1, and YAML reads true, yes and on as true: ``n_heads: yes`` would
        build one head; so are a list's items (``betas: [no, 0.95]``). (A field validator cannot do
        this: pydantic allows none on a ``type`` tag.) Said with the mapping's other problems, which
        validating the rest finds."""
        given = data.items() if isinstance(data, dict) else ()
        numbers_given = [(key, value) for key, value in given if (info := cls.model_fields.get(key)) and _wants_a_number(info.annotation)]
        errors = [{"type": PydanticCustomError(YES_OR_NO, "got {value}, a yes/no value where a number is wanted", {"value": str(item).lower()}),
                   "loc": (key,) if index is None else (key, index), "input": item}
                  for key, value in numbers_given
                  for index, item in (enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)])
                  if isinstance(item, bool)]
        if not errors:
            return handler(data)
        wrong = {error["loc"][0] for error in errors}
        try:
            handler({key: value for key, value in data.items() if key not in wrong})
        except ValidationError as exc:
            errors += [_details(error) for error in exc.errors() if not (error["type"] == "missing" and error["loc"][0] in wrong)]
        raise ValidationError.from_exception_data(cls.__name__, errors)

    @model_validator(mode="before")
    @classmethod
    def _default_kind(cls, data: Any) -> Any:
        """A mapping without its tag, for a field whose default is one kind of a tagged union, is that
        kind where no key it gives is another kind's field alone: ``norm: {eps: 1e-5}`` sets the
        default RMSNorm's eps, as ``--set norm.eps=1e-5`` does, and ``norm: {epsilon: 1e-5}`` is said
        to hold an unknown key. Where one is (``loop: {times: 3}``), the tag is said to be missing."""
        if not isinstance(data, dict):
            return data
        tagged = {}
        for key, info in cls.model_fields.items():
            value, default, tag = data.get(key), info.default, info.discriminator
            if not (isinstance(tag, str) and isinstance(value, dict) and tag not in value and isinstance(default, BaseModel)):
                continue
            others = {name for kind in get_args(info.annotation) for name in getattr(kind, "model_fields", {})}
            if not (value.keys() - type(default).model_fields.keys()) & others:
                tagged[key] = {tag: getattr(default, tag), **value}
        return {**data, **tagged} if tagged else data


def _details(error: dict) -> dict:
    """A pydantic error as it was raised, to be raised again with others: its type's own, or its
    message as said where the type is a validator's own (a ``PydanticCustomError``)."""
    try:
        kind = PydanticKnownError(error["type"], error.get("ctx")).type
    except KeyError:
        kind = PydanticCustomError(error["type"], error["msg"], error.get("ctx"))
    return {"type": kind, "loc": error["loc"], "input": error["input"], **({"ctx": error["ctx"]} if "ctx" in error else {})}


def _wants_a_number(annotation: Any) -> bool:
    kinds = _kinds(annotation)
    return bool(kinds & {int, float}) and bool not in kinds


def _kinds(annotation: Any) -> set:
    """The plain types an annotation admits (through Optional, unions, Annotated and Literal)."""
    if get_origin(annotation) is Literal:
        return {type(value) for value in get_args(annotation)}
    args = get_args(annotation)
    return set().union(*map(_kinds, args)) if args else {annotation}


@dataclass(frozen=True)
class BuildContext:
    """What a block may know about the model it is built into."""

    d_model: int
    rope_theta: float | None  # None: this half uses no position encoding
    global_kv_heads: int | None = None  # set in the cross-decoder of a YOCO layout
    global_head_dim: int | None = None
    streams: int = 1  # ParScale parallel streams (1: off)
    prefix_len: int = 0  # ParScale learned prefix K,V per stream
    init_std: float = 0.02  # the model's weight init, for weights a block draws itself (nn.Linear's the model redraws)


@dataclass
class MixerInput:
    """What a mixer gets besides its input x [B, N, D].

    Training passes no ``state``. Inference passes the layer's state (the dict its module's
    ``new_state`` made), which the mixer reads and updates in place for the N new tokens.
    """

    positions: torch.Tensor  # [B or 1, N] absolute positions of the tokens in x
    state: dict[str, torch.Tensor] | None = None
    global_kv: KVRows | PagedKV | None = None  # the cross-decoder's K,V
    kv_memo: dict | None = None  # set when loop iterations share this layer's K,V (first one writes it)
    causal: bool = False  # x is a whole sequence from position 0 and keys are its own: a plain causal mask


Flops = Counter  # FLOPs by kind; the kinds:
FLOP_KINDS = {
    "matmul": "projections, FFN, router and head (2 x multiply-adds)",
    "attention": "QK^T and AV, counting each query only against the keys it may see",
    "mixer": "the chunked form of a linear-recurrent core (its matmuls, chunks padded as computed)",
    "conv": "depthwise causal convolutions over a sequence",
    "solve": "the triangular solve of the chunked delta rule",
    "state_update": "a decoding step's recurrent state and conv-tail updates (elementwise)",
}


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: where (a dotted field path) and what."""

    loc: str
    msg: str


@dataclass
class Problems:
    """Collects problems under a path prefix, so nested checks report full field paths."""

    prefix: str = ""
    found: list[Problem] = field(default_factory=list)

    def at(self, key: str | int) -> Problems:
        part = f"[{key}]" if isinstance(key, int) else (f".{key}" if self.prefix else key)
        return Problems(self.prefix + part, self.found)

    def add(self, msg: str) -> None:
        self.found.append(Problem(self.prefix or "<root>", msg))


@dataclass
class CacheBytes:
    """Bytes of inference state per sequence: ``global_`` grows with the context, ``local`` does not."""

    global_: int
    local: int

    @property
    def total(self) -> int:
        return self.global_ + self.local


class BlockSpec(Strict):
    """Base class of block specs. Subclasses set ``type: Literal[...]`` and the flags below."""

    type: str

    reads_global_kv: ClassVar[bool] = False  # cross-decoder block: attends to the global K,V
    grows_kv_cache: ClassVar[bool] = False  # keeps a state that grows with the context (a K,V cache), whole or in part
    shares_kv: ClassVar[bool] = False  # honours MixerInput.kv_memo (loops with kv_cache: shared)
    keeps_state: ClassVar[bool] = True  # has inference state, so a prefill must run it
    supports_streams: ClassVar[bool] = False  # can give ParScale streams their own prefix K,V
    reads_position: ClassVar[bool] = True  # rotates by its half's position encoding (BuildContext.rope_theta)

    def check(self, ctx: BuildContext, problems: Problems) -> None:
        """Report combinations that are impossible for this block in this model."""

    @abstractmethod
    def params(self, ctx: BuildContext) -> int:
        """Parameters of the built module."""

    @abstractmethod
    def flops(self, ctx: BuildContext, n: int, start: int = 0, reuse_kv: bool = False) -> Flops:
        """Forward FLOPs of ``n`` tokens at positions ``start``..``start + n - 1``, the state
        holding the ``start`` tokens before them. ``n == 1`` is a decoding step (the recurrent
        form); ``reuse_kv``: the K,V come from an earlier loop iteration."""

    @abstractmethod
    def state_bytes(self, ctx: BuildContext, context: int, kv_bytes: int) -> int | CacheBytes:
        """Bytes of ``new_state`` for one sequence of ``context`` tokens, ``kv_bytes`` the bytes
        of one value in the cache's dtype (a state kept float32 or wider: ``max(4, kv_bytes)``):
        growing with the context (global) where ``grows_kv_cache`` says so, else local; or, for a
        state that is both, ``CacheBytes``."""

    @abstractmethod
    def build(self, ctx: BuildContext) -> nn.Module:
        """Return the mixer module, which has

        - ``forward(x [B, N, D], inp: MixerInput) -> [B, N, D]``, and
        - ``new_state(batch, capacity, dtype) -> dict[str, Tensor]``: its inference state before
          any token (a prefill puts a used cache's back to it), for sequences of up to
          ``capacity`` tokens (``{}`` for a stateless mixer). Every tensor in it counts towards
          the cache bytes, so keep bookkeeping out of it.
        """


def ceil_div(a, b):
    """How many pieces of b cover a: a / b rounded up (ints, or integer tensors elementwise)."""
    return -(-a // b)


def whole_number(value: object) -> bool:
    """An int (Python's or numpy's): not a bool, nor a float that happens to be whole."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def round_up(n: int, multiple: int) -> int:
    """n rounded up to a multiple, e.g. the tokens a chunked op computes on (n padded to whole chunks)."""
    return ceil_div(n, multiple) * multiple


def check_heads(problems: Problems, d_model: int, n_heads: int, head_dim: int | None,
                unfit: Callable[[int, int], str | None] = lambda heads, size: None) -> None:
    """Heads must tile the width when the head size is derived from it. The counts offered instead
    are those the block can use too: ``unfit(heads, head size)`` says what one lacks (None: nothing)."""
    if head_dim is None and d_model % n_heads:
        small = [h for h in range(1, math.isqrt(d_model) + 1) if d_model % h == 0]  # not a loop over a huge width
        divisors = sorted({*small, *(d_model // h for h in small)})
        lacking = {n: unfit(n, d_model // n) for n in divisors}
        usable = [n for n, lack in lacking.items() if lack is None]
        needs = " and ".join(dict.fromkeys(lack for lack in lacking.values() if lack is not None))
        offered = (f"allowed: one of {usable[:12]}" + (" ..." if len(usable) > 12 else "") + ", or set head_dim explicitly" if usable
                   else f"none that does suits this block, which needs {needs}: set head_dim explicitly")
        problems.at("n_heads").add(f"{n_heads} heads do not divide d_model={d_model}; {offered}")


def odd_under_rope(ctx: BuildContext, head_size: int) -> str | None:
    """What a head of ``head_size`` lacks under RoPE, which turns its channels in pairs (None: nothing)."""
    return "an even head size, for RoPE" if ctx.rope_theta is not None and head_size % 2 else None


def check_rope_head_dim(problems: Problems, ctx: BuildContext, n_heads: int, head_dim: int, given: bool) -> None:
    """RoPE turns a head's channels in pairs: under it, a head's size must be even. One derived from
    d_model is said to be, as the spec does not give it."""
    if odd_under_rope(ctx, head_dim):
        derived = "" if given else f" (d_model={ctx.d_model} // n_heads={n_heads}); set head_dim, or n_heads that leave it even"
        problems.at("head_dim").add(f"RoPE needs an even head_dim, got {head_dim}{derived}")
