"""The spec language: pydantic models of an architecture, and YAML loading with ``extends``.

A spec file is YAML. ``extends: other.yaml`` (relative to the file) deep-merges the file over
its parent; a mapping whose ``type``/``position`` tag changes keeps only the parent's fields its
new kind also has. Validation runs in two passes: pydantic checks types and keys, then
``ModelSpec.problems()`` checks combinations that need the whole model (heads vs width, loop
range vs stack, ...). Both report through ``SpecError`` with dotted field paths.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Hashable, Iterable, Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, Union, get_args

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, PositiveFloat, PositiveInt, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError
from torch import nn

from archlab.block import MAX_SIZE, YES_OR_NO, BlockSpec, BuildContext, Problem, Problems, Size, Strict
from archlab.ffn import MoE, SwiGLU
from archlab.files import path_kind, regular
from archlab.registry import block_specs, raised
from archlab.table import first_few

SchemaVersion = Literal[1]  # of specs, training configs and studies alike
SCHEMA_VERSION = get_args(SchemaVersion)[0]


class SpecError(Exception):
    """A spec that cannot be used, with every problem found and the file it came from."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = problems
        lines = [f"{source}: {len(problems)} problem(s)"]
        lines += [f"  {p.loc}: {p.msg}" for p in problems]
        super().__init__("\n".join(lines))


def _tag_shorthand(key: str):
    """Let ``rope`` stand for ``{type: rope}`` (likewise for every tagged union but the layout, which
    always has fields to give)."""
    return BeforeValidator(lambda v: {key: v} if isinstance(v, str) else v)


# --- position encoding, norm, FFN ------------------------------------------------------------


class RoPE(Strict):
    type: Literal["rope"]
    theta: float = Field(10_000.0, gt=1)  # the base: at 1 or below, no pair turns slower than a radian a token


class NoPosition(Strict):
    type: Literal["none"]


Position = Annotated[Union[RoPE, NoPosition], Field(discriminator="type"), _tag_shorthand("type")]


class RMSNorm(Strict):
    type: Literal["rmsnorm"] = "rmsnorm"
    eps: PositiveFloat = 1e-6

    def build(self, dim: int) -> nn.Module:
        return nn.RMSNorm(dim, eps=self.eps)


class LayerNorm(Strict):
    type: Literal["layernorm"]
    eps: PositiveFloat = 1e-5

    def build(self, dim: int) -> nn.Module:
        return nn.LayerNorm(dim, eps=self.eps, bias=False)


Norm = Annotated[Union[RMSNorm, LayerNorm], Field(discriminator="type"), _tag_shorthand("type")]


FFN = Annotated[Union[SwiGLU, MoE], Field(discriminator="type"), _tag_shorthand("type")]


# --- blocks and layouts ----------------------------------------------------------------------


@cache
def block_union() -> Any:
    """The discriminated union of every registered block spec (built once, from entry points)."""
    classes = tuple(block_specs().values())
    tagged = [Field(discriminator="type")] if len(classes) > 1 else []  # a lone class is no union
    return Annotated[(Union[classes], *tagged, _tag_shorthand("type"))]


if TYPE_CHECKING:  # for readers and linters; at run time ``Block`` is the union of the installed blocks
    Block = BlockSpec


def _resolve_blocks() -> None:
    """Bind the ``Block`` annotation to the installed plugins, on first use rather than at import,
    so that a broken plugin is reported as an error instead of breaking ``import archlab``."""
    if ModelSpec.__pydantic_complete__:
        return
    namespace = {"Block": block_union()}
    for model in _subclasses(HoldsBlocks):  # as defined: the parts before the wholes that hold them
        model.model_rebuild(_types_namespace=namespace)


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


class HoldsBlocks(Strict):
    """A spec model that holds ``Block``s. pydantic rebuilds a model left incomplete at its first
    use (``ModelSpec(**data)``, ``model_validate``): that rebuild binds ``Block`` too."""

    @classmethod
    def model_rebuild(cls, **kwargs: Any) -> bool | None:
        if "_types_namespace" in kwargs:
            return super().model_rebuild(**kwargs)
        _resolve_blocks()
        return True


NUL_IN_PATH = "a path cannot hold a NUL byte"  # the system takes none (Python raises ValueError, not OSError)


def _no_nul(path: str) -> str:
    if "\0" in path:
        raise PydanticCustomError("nul_in_path", NUL_IN_PATH)
    return path


PathName = Annotated[str, AfterValidator(_no_nul)]  # a file or folder a spec, config or study names


# bounds far past any real model, so that a typo is refused here rather than spent in validation,
# planning and the allocator (a width's, archlab.block.Size, beside the blocks that use it)
MAX_LAYERS = 1024  # in one half
MAX_LOOP_TIMES = 256


class Half(HoldsBlocks):
    """A run of layers: ``blocks`` is a pattern repeated over ``n_layers`` (e.g. [gdn, gdn, swa])."""

    n_layers: int = Field(gt=0, le=MAX_LAYERS)
    blocks: tuple[Block, ...]
    position: Position = RoPE(type="rope")

    @field_validator("blocks")
    @classmethod
    def _some(cls, blocks: tuple) -> tuple:
        """At least one block: checked after the blocks themselves (a tuple's min_length would also
        count a list whose one block is invalid as empty, and say so under the block's own error)."""
        if not blocks:
            raise ValueError("give at least one block")
        return blocks

    @model_validator(mode="after")
    def _no_position_unread(self) -> Half:
        """Left out, a half's position is none when no block of it reads one (gdn, mamba2): RoPE
        there would be shown as if it were used. Given, it is kept: a run saved with it loads."""
        if "position" not in self.model_fields_set and not any(block.reads_position for block in self.blocks):
            derived = self.model_copy(update={"position": NoPosition(type="none")})
            derived.__pydantic_fields_set__.discard("position")  # still not given: worked out again from other blocks
            return derived
        return self

    def block_at(self, i: int) -> BlockSpec:
        return self.blocks[i % len(self.blocks)]


class CrossHalf(Half):
    """The YOCO cross-decoder: by default plain cross-attention to the global K,V, without RoPE."""

    blocks: tuple[Block, ...] = Field(
        default_factory=lambda: [{"type": "cross_attention"}], validate_default=True
    )
    position: Position = NoPosition(type="none")


class StackLayout(HoldsBlocks):
    """A plain decoder: every layer mixes its own input."""

    type: Literal["stack"]
    layers: Half


class GlobalKV(Strict):
    """Shape of YOCO's one global K,V, projected once from the self-decoder output."""

    n_kv_heads: Size
    head_dim: Size

    @property
    def width(self) -> int:
        """The values one position's K and V hold together."""
        return 2 * self.n_kv_heads * self.head_dim


class YocoLayout(HoldsBlocks):
    """Decoder-decoder: self-decoder, one global K,V projection, cross-decoder reading it."""

    type: Literal["yoco"]
    self_decoder: Half
    global_kv: GlobalKV
    cross_decoder: CrossHalf


Layout = Annotated[Union[StackLayout, YocoLayout], Field(discriminator="type")]


# --- the loop -------------------------------------------------------------------------------

KVCache = Literal["shared", "per_iteration"]


class _Loop(Strict):
    times: Annotated[int, Field(ge=1, le=MAX_LOOP_TIMES, description="iterations T of the looped layers")]
    kv_cache: KVCache | None = Field(
        None,
        description="one K,V cache for all iterations ('shared') or one per iteration ('per_iteration'):"
        " required for loops over layers with a length-growing K,V cache, optional over window attention"
        " (left out: per iteration), not allowed elsewhere",
    )


class NoLoop(Strict):
    position: Literal["none"]


class LowerLoop(_Loop):
    """The YOCO self-decoder (YOCO-U)."""

    position: Literal["lower"]


class UpperLoop(_Loop):
    """The YOCO cross-decoder."""

    position: Literal["upper"]


class PrefixLoop(_Loop):
    """The first ``n_layers`` layers (RINS)."""

    position: Literal["prefix"]
    n_layers: PositiveInt


class AllLoop(_Loop):
    """The whole stack (Universal Transformer)."""

    position: Literal["all"]


class RangeLoop(_Loop):
    """Layers ``start`` .. ``end - 1`` (global layer indices)."""

    position: Literal["range"]
    start: int = Field(ge=0)
    end: PositiveInt


Loop = Annotated[
    Union[NoLoop, LowerLoop, UpperLoop, PrefixLoop, AllLoop, RangeLoop],
    Field(discriminator="position"),
    _tag_shorthand("position"),
]


class ParScale(Strict):
    """Parallel scaling: P weight-shared streams with learned prefix K,V, mixed by learned weights
    (as ParScale's own code: each stream normalised, softmax weights from an MLP of all streams,
    smoothed towards uniform)."""

    streams: int = Field(2, ge=2, le=MAX_SIZE)
    prefix_len: Size = 48
    smoothing: float = Field(0.01, ge=0, lt=1)  # weights = softmax * (1 - s) + s / P


# --- the model ------------------------------------------------------------------------------


InferenceDtype = Literal["float32", "bfloat16", "float16"]  # the dtypes a model runs inference in: a cache's bytes, --dtype


class ModelSpec(HoldsBlocks):
    """A whole architecture. Field order is the order ``archlab show`` prints."""

    schema_version: SchemaVersion
    name: str = Field(min_length=1)
    description: str = ""
    vocab_size: int = Field(gt=0, le=2**31 - 1)  # bounded, so that a typo is refused here rather than by the allocator
    d_model: Size
    norm: Norm = RMSNorm()
    ffn: FFN = SwiGLU()
    layout: Layout
    loop: Loop = NoLoop(position="none")
    parscale: ParScale | None = None
    tie_embeddings: bool = False
    init_std: PositiveFloat = 0.02
    inference_dtype: InferenceDtype = "float32"

    @field_validator("name")
    @classmethod
    def _one_line(cls, name: str) -> str:
        """A name labels table rows, plots and study variants: a blank one, or one over two lines, would break them."""
        if not name.strip() or name != name.strip() or any(c in name for c in "\r\n"):
            raise PydanticCustomError("one_line_name", "a name is one line of text, with no space at either end")
        return name

    # -- structure derived from the layout; the plan (archlab.plan) builds on these --

    @property
    def halves(self) -> list[tuple[str, Half]]:
        """(path, half) in layer order."""
        if isinstance(self.layout, YocoLayout):
            return [("layout.self_decoder", self.layout.self_decoder), ("layout.cross_decoder", self.layout.cross_decoder)]
        return [("layout.layers", self.layout.layers)]

    @property
    def n_layers(self) -> int:
        return sum(h.n_layers for _, h in self.halves)

    @property
    def streams(self) -> int:
        """ParScale's P weight-shared streams; 1 without ParScale."""
        return self.parscale.streams if self.parscale else 1

    def build_contexts(self) -> list[BuildContext]:
        """Each half's ``build_context``, in layer order."""
        return [self.build_context(h) for h in range(len(self.halves))]

    def loop_range(self) -> tuple[int, int] | None:
        """Global layer indices [start, end) of the looped layers, or None."""
        loop, halves = self.loop, self.halves
        match loop.position:
            case "none":
                return None
            case "lower":
                return (0, halves[0][1].n_layers)
            case "upper":
                return (halves[0][1].n_layers, self.n_layers)
            case "prefix":
                return (0, loop.n_layers)
            case "all":
                return (0, self.n_layers)
            case "range":
                return (loop.start, loop.end)

    def build_context(self, half_index: int) -> BuildContext:
        half = self.halves[half_index][1]
        yoco = isinstance(self.layout, YocoLayout)
        cross = yoco and half_index == 1
        return BuildContext(
            d_model=self.d_model,
            rope_theta=half.position.theta if isinstance(half.position, RoPE) else None,
            global_kv_heads=self.layout.global_kv.n_kv_heads if cross else None,
            global_head_dim=self.layout.global_kv.head_dim if cross else None,
            streams=self.streams,
            prefix_len=self.parscale.prefix_len if self.parscale else 0,
            init_std=self.init_std,
        )

    def problems(self) -> list[Problem]:
        """Combinations that pydantic's per-field checks cannot see."""
        root = Problems()
        yoco = isinstance(self.layout, YocoLayout)
        for half_index, (path, half) in enumerate(self.halves):
            ctx = self.build_context(half_index)
            cross = yoco and half_index == 1
            if len(half.blocks) > half.n_layers:
                root.at(f"{path}.blocks").add(f"{len(half.blocks)} blocks for {half.n_layers} layers: the pattern's blocks"
                                              f" past layer {half.n_layers} would never be built")
            for i, block in enumerate(half.blocks):
                at = root.at(f"{path}.blocks").at(i)
                try:
                    block.check(ctx, at)
                except Exception as exc:  # a plugin's own check: said as a problem of the spec that uses it
                    at.add(raised(block, "check", exc))
                if block.reads_global_kv and not cross:
                    at.at("type").add(
                        f"{block.type!r} reads the global K,V, which exists only in a YOCO cross-decoder"
                    )
                if cross and not block.reads_global_kv:
                    at.at("type").add(
                        f"{block.type!r} does not read the global K,V; the cross-decoder needs blocks that do"
                        f" (registered: {sorted(n for n, c in block_specs().items() if c.reads_global_kv)})"
                    )
                if self.parscale and not block.supports_streams and block.grows_kv_cache:
                    at.at("type").add(f"{block.type!r} cannot give ParScale streams their own prefix K,V")
        if self.parscale and not any(
            b.supports_streams for _, h in self.halves for b in h.blocks
        ):
            root.at("parscale").add(
                "ParScale streams differ only through prefix K,V, but no block here supports it"
                f" (blocks that do: {sorted(n for n, c in block_specs().items() if c.supports_streams)})"
            )
        self.ffn.check(root.at("ffn"))
        if yoco and isinstance(self.layout.cross_decoder.position, RoPE):
            if self.layout.global_kv.head_dim % 2:
                root.at("layout.global_kv.head_dim").add(f"RoPE in the cross-decoder needs an even head_dim, got {self.layout.global_kv.head_dim}")
        self._check_loop(root.at("loop"))
        return root.found

    def _check_loop(self, at: Problems) -> None:
        span = self.loop_range()
        if span is None:
            return
        start, end = span
        n, loop = self.n_layers, self.loop
        if loop.position == "upper" or loop.position == "lower":
            if not isinstance(self.layout, YocoLayout):
                at.at("position").add(f"{loop.position!r} names a YOCO half; this layout is a plain stack"
                                      " (use 'prefix', 'all' or 'range')")
                return
        if loop.position == "range" and end <= start:
            at.at("end").add(f"{end} must be past start ({start}): the loop covers layers start .. end - 1")
            return
        if not (0 <= start < end <= n):
            at.add(f"layers {start}..{end - 1} are outside the stack of {n} layers (0..{n - 1})")
            return
        if isinstance(self.layout, YocoLayout):
            boundary = self.layout.self_decoder.n_layers
            if loop.position == "all":
                at.at("position").add(f"'all' loops a plain stack; in a YOCO layout, 'lower' loops the self-decoder"
                                      f" (0..{boundary - 1}) and 'upper' the cross-decoder ({boundary}..{n - 1}), or 'range' a part of one")
                return
            if start < boundary < end:
                at.add(
                    f"layers {start}..{end - 1} straddle the global K,V projection after layer {boundary - 1};"
                    f" a loop must lie within the self-decoder (0..{boundary - 1}) or the cross-decoder"
                    f" ({boundary}..{n - 1})"
                )
                return
        looped = [self.block_at(i) for i in range(start, end)]
        with_cache = sorted({b.type for b in looped if b.grows_kv_cache or b.reads_global_kv})
        if with_cache and loop.kv_cache is None:
            at.at("kv_cache").add(
                f"required: the looped layers keep or read a length-growing K,V cache ({', '.join(with_cache)});"
                " allowed: 'shared' (all iterations use one cache) or 'per_iteration' (each keeps its own)"
            )
        unshared = sorted({b.type for b in looped if b.grows_kv_cache and not b.shares_kv})
        if loop.kv_cache == "shared" and unshared:  # they would each keep a cache per iteration, whatever the spec says
            at.at("kv_cache").add(f"'shared' is not possible: {', '.join(unshared)} cannot share a K,V cache across iterations"
                                  " (shares_kv is False); use 'per_iteration'")
        if not with_cache and not any(b.shares_kv for b in looped) and loop.kv_cache is not None:
            at.at("kv_cache").add(
                f"not applicable: layers {start}..{end - 1} keep no K,V cache that iterations could share"
                f" (blocks: {', '.join(sorted({b.type for b in looped}))}); remove it"
            )

    def block_at(self, layer: int) -> BlockSpec:
        """The block of global layer index ``layer``."""
        for _, half in self.halves:
            if layer < half.n_layers:
                return half.block_at(layer)
            layer -= half.n_layers
        raise IndexError(layer)


# --- loading --------------------------------------------------------------------------------


def _tag_of(key: str | None) -> str:
    """The field that tells apart the members of the union under ``key`` (a half's ``position``
    is a union of its own, tagged by ``type``)."""
    return "position" if key == "loop" else "type"


def _retagged(mapping: dict, key: str | None, tag: str) -> dict:
    """``mapping`` (held under ``key``) turned into the union's member tagged ``tag``: the fields
    that member also has carry over (a loop's ``times``, a block's ``n_heads``); the rest do not
    apply to it (a SwiGLU's ``hidden`` in an MoE)."""
    member = _member(key, tag)
    if member is None or mapping.get(_tag_of(key)) == tag:  # unknown kind, or the same: validation names what is wrong
        fields = mapping
    else:
        fields = member.model_fields
    return {name: value for name, value in mapping.items() if name in fields and name != _tag_of(key)} | {_tag_of(key): tag}


def _retag(mapping: dict, key: str | None, tag: str, path: str) -> list[str]:
    """``_retagged``, in place, for the mapping at ``path``; the paths of the fields it dropped."""
    kept = _retagged(mapping, key, tag)
    gone = [f"{path}.{name}" for name in mapping if name not in kept]
    mapping.clear()
    mapping.update(kept)
    return gone


def _deep_merge(base: Any, over: Any, key: str | None = None) -> Any:
    """``over`` laid on ``base`` (the mapping under ``key``), key by key. A shorthand on either
    side stands for its mapping (``layernorm`` for ``{type: layernorm}``), so it merges as one."""
    tag = _tag_of(key)
    if key in _unions() and isinstance(base, dict) != isinstance(over, dict):
        base, over = ({tag: side} if isinstance(side, str) else side for side in (base, over))
    if not (isinstance(base, dict) and isinstance(over, dict)):
        return over
    old, new = base.get(tag), over.get(tag)
    if isinstance(new, str) and old != new:  # another member, or one named over its union's default
        base = _retagged(base, key, new)
    merged = dict(base)
    for name, value in over.items():
        merged[name] = _deep_merge(base[name], value, name) if name in base else value
    return merged


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load``, but a key given twice in one mapping is an error (the YAML spec forbids it;
    PyYAML keeps the last silently, so the first of two ``d_model`` lines would be ignored)."""

    def construct_mapping(self, node, deep=False):
        first: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # "<<: *base" merges a mapping, whose keys the ones given here may override
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # PyYAML refuses it itself
            if key in first:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (first on line {first[key].line + 1})", key_node.start_mark
                )
            first[key] = key_node.start_mark
        return super().construct_mapping(node, deep)

    def compose_document(self):
        node = super().compose_document()
        _expanded_size(node, {}, set())
        return node


MAX_YAML_NODES = 100_000  # values in one file with its aliases expanded: far past any spec, far short of an alias bomb's


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_: set[int]) -> int:
    """The values under ``node`` with every alias expanded (each alias is the node it names, so
    ``a: &a [*a]`` contains itself); refuses a structure without end, or too large to walk."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_:
        raise yaml.constructor.ConstructorError(None, None, "an alias refers to a value that contains it, which has no end", node.start_mark)
    open_.add(id(node))
    children = node.value if isinstance(node, yaml.SequenceNode) else (
        [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
    size = sizes[id(node)] = 1 + sum(_expanded_size(child, sizes, open_) for child in children)
    open_.discard(id(node))
    if size > MAX_YAML_NODES:
        raise yaml.constructor.ConstructorError(
            None, None, f"its aliases expand to over {MAX_YAML_NODES:,} values; write a spec out, or use extends", node.start_mark)
    return size


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain data only, no Python objects


MAX_EXTENDS = 100  # files in one extends chain: far past any real one, well short of Python's recursion limit


def _read_yaml(path: Path, chain: tuple[Path, ...], origins: dict[str, str]) -> dict:
    """Load one file and its ``extends`` ancestors, merged. ``chain`` (the files that extended
    into this one, as given) detects cycles; paths print as the user wrote them. ``origins`` gets
    the file that set each value (``_note``)."""
    origin = f" (extended from {chain[-1]})" if chain else ""
    try:
        resolved = path.resolve()
    except (RuntimeError, OSError):  # a symbolic link that leads back to itself (RuntimeError before Python 3.13)
        raise SpecError(str(path), [Problem("<file>", f"is a symbolic link that leads back to itself, not a YAML file{origin}")]) from None
    if resolved in {p.resolve() for p in chain}:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise SpecError(str(chain[0]), [Problem("extends", f"cycle: {cycle}")])
    try:
        kind = path_kind(path)
    except OSError as exc:  # a name too long for the system, a folder on the way that cannot be searched
        raise SpecError(str(path), [Problem("<file>", f"cannot read: {exc.strerror}{origin}")]) from None
    if kind == "folder":
        raise SpecError(str(path), [Problem("<file>", f"is a folder, not a YAML file{origin}")])
    if kind is None:
        raise SpecError(str(path), [Problem("<file>", f"not found{origin or ' (no such file)'}")])
    try:
        regular(path)  # a FIFO, a device or a link to nothing, said as the run files' reader says them
    except OSError as exc:
        raise SpecError(str(path), [Problem("<file>", f"{exc.strerror}{origin}")]) from None
    try:
        data = _parse_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "<yaml>"
        what = getattr(exc, "problem", None) or str(exc)
        raise SpecError(str(path), [Problem(at, f"YAML syntax error: {what}")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(str(path), [Problem("<file>", f"cannot read: {exc}")]) from None
    except ValueError as exc:  # a number past Python's limit on digits
        raise SpecError(str(path), [Problem("<yaml>", f"cannot read a value: {str(exc).split(';')[0]}")]) from None
    except RecursionError:
        raise SpecError(str(path), [Problem("<yaml>", "nested too deeply to read")]) from None
    if data is None:
        raise SpecError(str(path), [Problem("<root>", "the file is empty; it must be a YAML mapping (key: value lines)")])
    if not isinstance(data, dict):
        raise SpecError(str(path), [Problem("<root>", f"the file must be a YAML mapping (key: value lines), got {type(data).__name__}")])
    parent = data.pop("extends", None)
    if parent is None:
        _note(data, str(path), origins)
        return data
    if not isinstance(parent, str) or not parent.strip():
        raise SpecError(str(path), [Problem("extends", "must be a path to another spec file")])
    if "\0" in parent:
        raise SpecError(str(path), [Problem("extends", NUL_IN_PATH)])
    if len(chain) >= MAX_EXTENDS:
        raise SpecError(str(chain[0]), [Problem("extends", f"a chain of more than {MAX_EXTENDS} files (through {path})")])
    merged = _deep_merge(_read_yaml(path.parent / parent, (*chain, path), origins), data)
    _note(data, str(path), origins)  # after the ancestors: what this file sets overrides theirs
    return merged


def _note(data: Any, source: str, origins: dict[str, str], at: str = "") -> None:
    """Record ``source`` as where each value in ``data`` was set, under its path as errors print it.
    A value a later file or override replaced whole keeps its entry, but is no longer in the data:
    ``validate_as`` traces only values that are."""
    origins.update((path, source) for path, _ in leaves(data, at))


def leaves(data: Any, at: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) of every leaf of nested mappings and lists, paths as errors print them
    (``layout.self_decoder.blocks[0].window``); an empty mapping or list is a leaf."""
    if isinstance(data, dict) and data:
        for key, value in data.items():
            yield from leaves(value, f"{at}.{key}" if at else str(key))
    elif isinstance(data, list) and data:
        for index, value in enumerate(data):
            yield from leaves(value, f"{at}[{index}]")
    else:
        yield at, data


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


ABSENT = _Absent()  # the value of a leaf one side of ``differences`` lacks


def differences(old: Any, new: Any) -> dict[str, tuple[Any, Any]]:
    """The leaves of two nested mappings that differ, by path, each with its (old, new) value
    (``ABSENT`` where one side lacks it)."""
    before, after = dict(leaves(old)), dict(leaves(new))
    paths = [*before, *(path for path in after if path not in before)]
    pairs = {path: (before.get(path, ABSENT), after.get(path, ABSENT)) for path in paths}
    return {path: pair for path, pair in pairs.items() if pair[0] != pair[1]}


def describe_differences(old: Any, new: Any) -> list[str]:
    """``differences`` as lines ``path old -> new`` (``described``)."""
    return described(differences(old, new))


def described(changed: dict[str, tuple[Any, Any]]) -> list[str]:
    """Changes by path, each (old, new), as lines ``path old -> new`` (floats to 6 significant digits)."""
    def shown(value: Any) -> str:
        return f"{value:.6g}" if isinstance(value, float) else str(value)

    return [f"{path} {shown(was)} -> {shown(now)}" for path, (was, now) in changed.items()]


def spec_changes(old: ModelSpec, new: ModelSpec) -> str:
    """How spec ``new`` differs from ``old``, on one line: at most five changes, then how many more; empty
    where they are equal."""
    changed = describe_differences(old.model_dump(mode="json"), new.model_dump(mode="json"))
    return first_few(changed, 5, "; ")


def _loc(parts: tuple, data: Any) -> str:
    """pydantic's loc as a dotted path through the input, without the union tags it inserts."""
    out, key = "", None
    for part in parts:
        if isinstance(data, dict) and part not in data and (part in (data.get("type"), data.get("position")) or _member(key, part)):
            continue  # the tag of the union member pydantic chose (a default's, where the mapping gave none: Strict._default_kind)
        key = part if isinstance(part, str) else key
        if isinstance(data, str) and part == data:
            continue  # a shorthand tag ("rope") that pydantic expanded; the keys after it are kept
        data = data[part] if isinstance(data, (dict, list)) and _has(data, part) else None
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


def _key_path(err: dict) -> tuple:
    """Where an error is: pydantic's loc; a key that is not text, at the mapping holding it
    (pydantic's loc gives it as text, or true as 1)."""
    if _is_key_error(err):
        return err["loc"][:-2] if err["loc"][-1:] == ("[key]",) else err["loc"][:-1]
    return err["loc"]


def _is_key_error(err: dict) -> bool:
    """A key that is not text: of a spec's mapping (invalid_key), or of a mapping field (at "[key]")."""
    return err["type"] == "invalid_key" or err["loc"][-1:] == ("[key]",)


def _has(data: dict | list, key: Any) -> bool:
    return key in data if isinstance(data, dict) else isinstance(key, int) and 0 <= key < len(data)


def _describe(err: dict) -> str:
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        return "unknown key (not part of the schema; check its spelling and level)"
    if err["type"] == "union_tag_invalid":
        ctx, tag = err["ctx"], err["ctx"]["discriminator"].strip(chr(39))
        given = err["input"].get(tag, ctx["tag"]) if isinstance(err["input"], dict) else ctx["tag"]  # ctx's is str()'d: None is 'None'
        return _unknown_kind(err["loc"], tag, given, ctx["expected_tags"])
    if err["type"] == "model_attributes_type" and (key := _union_at(err["loc"])):  # null, a number: no kind at all
        tag = _tag_of(key)
        kinds = ", ".join(map(repr, _union_tags(err["loc"], tag)))
        if key == "layout":  # the one union without a shorthand
            return f"must be a mapping with a {tag} (one of: {kinds}) and its fields, got {_given(err['input'])}"
        return _unknown_kind(err["loc"], tag, err["input"], kinds)
    if _is_key_error(err):  # true, null, 3 or a date, unquoted
        key = err["input"]
        kind = "null" if key is None else YAML_KINDS.get(type(key).__name__, type(key).__name__)
        return f"the key {yaml.safe_dump(key).splitlines()[0]} is read by YAML as {kind}, not text: quote it"
    if err["type"] == "union_tag_not_found":
        tag = err["ctx"]["discriminator"].strip(chr(39))
        kinds = _union_tags(err["loc"], tag)
        return f"missing {tag!r}, which says what kind this is" + (f" (one of: {', '.join(kinds)})" if kinds else "")
    if err["loc"][-1:] == ("blocks",) and isinstance(given := err.get("input"), str):
        if re.fullmatch(r"[\w-]+", given):
            return f"is a list (a pattern of blocks), not the one block {given!r}: write [{given}]"
        quoted = "; YAML reads a list in quotes as text: write it without them" if given.lstrip().startswith("[") else ""
        return f"is a list (a pattern of blocks), not the text {given!r}{quoted}"
    if err["type"] == "int_parsing" and isinstance(given := err["input"], str) and (number := _yaml_text_number(given)) is not None:
        whole = f": write {number:.0f}" if number.is_integer() and abs(number) < 1e15 else ""
        return f"must be a whole number; YAML reads {given} as text, not a number{whole}"
    if err["type"] == "int_parsing_size":
        return f"is too large a number (got {err['input']!r})"
    if err["type"] == "literal_error" and err["loc"][-1:] == ("schema_version",):
        return f"unsupported schema_version {err['input']!r}; this archlab reads version {SCHEMA_VERSION}"
    if "input" in err and not isinstance(err["input"], (dict, list)) and err["type"] != YES_OR_NO:  # which says it, as YAML writes it
        return f"{msg} (got {err['input']!r})"
    return msg


def _yaml_text_number(text: str) -> float | None:
    """The number in text that YAML 1.1 reads as text: an exponent without a sign or a point (1e3)."""
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _unknown_kind(loc: tuple, tag: str, given: Any, allowed: str) -> str:
    """Every kind given that is none the union has (a tag, null or a number) is said alike."""
    plugins = " (blocks come from installed archlab.blocks plugins; `archlab blocks` lists them)" if "blocks" in loc else ""
    return f"unknown {tag} {_given(given)}; allowed: {allowed}{plugins}"


YAML_KINDS = {"bool": "a boolean", "int": "a number", "float": "a number", "date": "a date", "datetime": "a date and time"}


def _given(value: Any) -> str:
    """A value as the YAML it came from would name it (null, not None)."""
    return "null" if value is None else repr(value)


def _union_at(loc: tuple) -> str | None:
    """The key of the tagged union whose value is at ``loc`` itself (a block: an item of ``blocks``)."""
    key = loc[-2] if len(loc) > 1 and isinstance(loc[-1], int) else loc[-1]
    return key if key in _unions() and (key == "blocks") == isinstance(loc[-1], int) else None


def _unions() -> dict[str, Any]:
    """The keys that hold a tagged union (each but ``layout`` may be given as a shorthand string)."""
    return {"layout": Layout, "ffn": FFN, "norm": Norm, "position": Position, "loop": Loop, "blocks": block_union()}


def _members(key: str | None) -> tuple[type[BaseModel], ...]:
    """The member classes of the union held under ``key`` (none for another key)."""
    union = _unions().get(key)
    if union is None:
        return ()
    inner = get_args(union)[0]
    return get_args(inner) or (inner,)  # a lone block class is no Union


def _member(key: str | None, tag: Any) -> type[BaseModel] | None:
    """The member of the union held under ``key`` that ``tag`` names (None for an unknown one)."""
    return next((m for m in _members(key) if tag in get_args(m.model_fields[_tag_of(key)].annotation)), None)


def _union_tags(loc: tuple, tag: str) -> list[str]:
    """The tags a discriminated union at ``loc`` takes: of the union its nearest named key holds."""
    key = next((part for part in reversed(loc) if part in _unions()), None)
    return [tag_value for member in _members(key) for tag_value in get_args(member.model_fields[tag].annotation)]


M = TypeVar("M", bound=BaseModel)


def validate_as(cls: type[M], data: dict, source: str, origins: dict[str, str] | None = None) -> M:
    """Validate a mapping as ``cls``; every problem (and those of its ``problems()``, if it has
    one) is raised as one SpecError naming ``source``, and the file (of ``origins``) that set the
    value where that is another."""
    try:
        obj = cls.model_validate(data)
    except ValidationError as exc:
        found = [Problem(_loc(_key_path(e), data), _describe(e)) for e in exc.errors()]
    else:
        found = obj.problems() if hasattr(obj, "problems") else []
    if found:
        traced = {path: origins[path] for path, _ in leaves(data) if path in (origins or {})}
        raise SpecError(source, [_with_origin(p, source, traced) for p in found]) from None
    return obj


def _with_origin(problem: Problem, source: str, origins: dict[str, str]) -> Problem:
    """The problem, naming the file that set its very value where that is another (not a file that
    set a value it is derived from, such as a head count from d_model)."""
    origin = origins.get(problem.loc)
    return problem if origin is None or Path(origin) == Path(source) else Problem(problem.loc, f"{problem.msg} (set in {origin})")


def load_yaml(path: str | Path, origins: dict[str, str] | None = None) -> dict:
    """Read a YAML file of archlab's (spec, training config, study) with its ``extends`` merged;
    ``origins``, if given, gets the file that set each value."""
    return _read_yaml(Path(path), (), {} if origins is None else origins)


def validate_spec(data: dict, source: str = "<spec>", origins: dict[str, str] | None = None) -> ModelSpec:
    """Validate an already-merged mapping (e.g. a study's override of a spec)."""
    _resolve_blocks()
    return validate_as(ModelSpec, data, source, origins)


def revalidated(spec: ModelSpec) -> ModelSpec:
    """``spec`` validated again from what was given in it. One varied by ``model_copy(update=...)``
    skipped validation: its fields' limits (a loop of 0 times), the defaults worked out from other
    fields (a half's position, from its blocks), a new tag's fields (``position: range`` with its
    ``start``) and the checks across fields; and a key no spec has (``d_mdoel``) was kept without a word."""
    return validate_spec(_what_was_given(spec), spec.name)


def _what_was_given(value: Any) -> Any:
    """What was given in a spec model, as validation takes it: the fields set (those left out are
    worked out again), and keys ``model_copy(update=...)`` put there that no field of it has."""
    if isinstance(value, BaseModel):
        fields = type(value).model_fields
        return {key: _what_was_given(item) for key, item in vars(value).items() if key in value.model_fields_set or key not in fields}
    if isinstance(value, (list, tuple)):
        return [_what_was_given(item) for item in value]
    return value


def _is_index(part: str) -> bool:
    """Whether a part of a dotted path is a list index: ASCII digits ("²" is a digit int() refuses)."""
    return part.isascii() and part.isdigit()


def set_dotted(data: dict, key: str, value: Any) -> dict:
    """A copy of ``data`` with ``value`` at the dotted path ``key``; a number indexes a list
    (``layout.self_decoder.blocks.0.window``). Missing mappings on the way are created. A new
    tag (``layout.self_decoder.blocks.0.type=attention``) keeps only the fields its kind has, as
    ``extends`` does."""
    return _set_dotted(data, key, value)[0]


def _set_dotted(data: dict, key: str, value: Any) -> tuple[dict, list[str]]:
    """``set_dotted``, and the paths it took away: the fields a new tag dropped, or ``key`` itself
    where its value was replaced whole."""
    data = copy.deepcopy(data)
    node: Any = data
    parts = _canonical(key).split(".")
    for depth, part in enumerate(parts):
        if isinstance(node, list):
            if not _is_index(part) or int(part) >= len(node):
                raise SpecError(key, [Problem(".".join(parts[: depth + 1]), f"no item {part} in a list of {len(node)}")])
            part = int(part)
        elif not isinstance(node, dict):
            raise SpecError(key, [Problem(".".join(parts[:depth]), f"is {node!r}, not a mapping or list")])
        path, holder = ".".join(parts[: depth + 1]), _holder(parts[: depth + 1])
        if depth == len(parts) - 1:
            old = node[part] if isinstance(node, list) or part in node else None
            if holder in _unions() and isinstance(value, str) and isinstance(old, dict):  # a shorthand: a new tag
                return data, _retag(old, holder, value, path)
            parent = _holder(parts[:depth])
            if parent in _unions() and part == _tag_of(parent) and isinstance(value, str):
                return data, _retag(node, parent, value, ".".join(parts[:depth]))
            kind = old if isinstance(old, str) else old.get(_tag_of(holder)) if isinstance(old, dict) else None
            if holder in _unions() and isinstance(value, dict) and _tag_of(holder) not in value and kind is not None:
                value = {_tag_of(holder): kind, **value}  # the kind it replaces, not the default's (Strict._default_kind)
            node[part] = value
            return data, [path]
        if isinstance(node, dict) and node.get(part) is None:
            if _is_index(parts[depth + 1]):
                raise SpecError(key, [Problem(path, f"is not given, so its item {parts[depth + 1]} cannot be set alone:"
                                                    f" give it whole, as {path}=[...]")])
            node[part] = _default_tag(data, parts[: depth + 1])
        elif isinstance(node[part], str) and holder in _unions():  # a shorthand stands for its mapping
            node[part] = {_tag_of(holder): node[part]}
        node = node[part]
    return data, []


def _default_tag(data: dict, parts: list[str]) -> dict:
    """What a spec's mapping left out at the dotted path ``parts`` stands for while a field inside it
    is set: its default's tag, where it is a tagged union with a default (``norm``: ``{type:
    rmsnorm}``, so that ``norm.eps=1e-5`` sets the default norm's eps), else nothing. The models
    holding it are found through ``data``, each union's member by the tag given there."""
    model: Any = ModelSpec
    node: Any = data
    for part in parts[:-1]:
        field = model.model_fields.get(part) if isinstance(node, dict) else None
        if field is None:
            return {}
        node = node[part]
        tag = node if isinstance(node, str) else node.get(_tag_of(part)) if isinstance(node, dict) else None
        model = _member(part, tag) if part in _unions() else field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return {}
    field = model.model_fields.get(parts[-1])
    default = field.get_default(call_default_factory=True) if field and parts[-1] in _unions() else None
    return {_tag_of(parts[-1]): getattr(default, _tag_of(parts[-1]))} if isinstance(default, BaseModel) else {}


def _canonical(key: str) -> str:
    """``key`` with each list index written as int() reads it: ``blocks.00`` is ``blocks.0``."""
    return ".".join(str(int(part)) if _is_index(part) else part for part in key.split("."))


def set_each_dotted(data: dict, items: Iterable[tuple[str, Any]], source: str) -> dict:
    """``set_dotted`` for each (key, value) in turn. A key that would replace, whole, what an
    earlier one set inside it (``...blocks.0`` after ``...blocks.0.window``) is refused: the
    earlier value would be lost without a word. So is a new tag that drops a field set before
    (``blocks.0.type=attention`` after ``blocks.0.window``)."""
    items = list(items)
    if bad := [key for key, _ in items if not isinstance(key, str) or "" in key.strip().split(".")]:
        raise SpecError(source, [Problem(repr(key), "a key is a dotted path of names (of keys, or a list's indices)") for key in bad])
    done: list[str] = []
    for key, value in items:
        key = _canonical(key)
        data, taken = _set_dotted(data, key, value)
        if lost := [k for k in done if any(k.startswith(f"{t}.") or k == t != key for t in taken)]:
            said = "replaces whole what {} set inside it before" if taken == [key] else "is a kind without what {} set before"
            raise SpecError(source, [Problem(key, f"{said.format(', '.join(lost))}; set {key} first")])
        done.append(key)
    return data


Overrides = Mapping[str, Any] | Iterable[str]  # {key: value}, or --set's KEY=VALUE strings (or one such string)


def apply_overrides(data: dict, overrides: Overrides, origins: dict[str, str] | None = None) -> dict:
    """Dotted overrides: a mapping ``{"optimizer.lr": 1e-3}``, its values as given, or ``--set``'s
    ``optimizer.lr=1e-3`` strings, their values read as YAML (``origins`` records them as set by
    ``overrides`` or ``--set``)."""
    if isinstance(overrides, Mapping):
        source, items = "overrides", list(overrides.items())
    else:
        source, items = "--set", [_key_value(item) for item in ([overrides] if isinstance(overrides, str) else overrides)]
    data = set_each_dotted(data, items, source)
    for key, value in items if origins is not None else ():  # under the path errors print: blocks.00 is blocks[0]
        _note(value, source, origins, re.sub(r"\.([0-9]+)(?=\.|$)", r"[\1]", _canonical(key)))
    return data


def _key_value(item: Any) -> tuple[str, Any]:
    """A ``KEY=VALUE`` override as its key and its value parsed as YAML."""
    key, sep, value = item.partition("=") if isinstance(item, str) else ("", "", "")
    if not sep or not key:
        raise SpecError("--set", [Problem(str(item), "expected KEY=VALUE, e.g. optimizer.lr=1e-3")])
    try:
        return key, _parse_yaml(value)
    except yaml.YAMLError as exc:
        raise SpecError("--set", [Problem(item, f"the value is not YAML: {getattr(exc, 'problem', None) or exc}")]) from None
    except ValueError as exc:  # a number past Python's limit on digits, as in a file
        raise SpecError("--set", [Problem(item[:60], f"the value cannot be read: {str(exc).split(';')[0]}")]) from None
    except RecursionError:
        raise SpecError("--set", [Problem(item[:60], "the value is nested too deeply to read")]) from None


def _holder(path: list[str]) -> str | None:
    """The named key a dotted path ends in, past list indices (``blocks`` for ``...blocks.0``)."""
    return next((part for part in reversed(path) if not _is_index(part)), None)


def load_spec(path: str | Path, overrides: Overrides | None = ()) -> ModelSpec:
    """Read, merge (``extends``), override (``{key: value}`` or ``KEY=VALUE`` strings, as
    ``apply_overrides``) and validate a spec file."""
    origins: dict[str, str] = {}
    data = apply_overrides(load_yaml(path, origins), overrides or (), origins)
    return validate_spec(data, str(path), origins)


def spec_to_yaml(spec: ModelSpec) -> str:
    """The resolved spec with every default filled in, as YAML that validates again."""
    return yaml.safe_dump(_tags_first(spec.model_dump(mode="json")), sort_keys=False)


def _tags_first(data: Any) -> Any:
    """Put each mapping's ``type``/``position`` tag first, where a reader looks for it."""
    if isinstance(data, list):
        return [_tags_first(v) for v in data]
    if not isinstance(data, dict):
        return data
    first = [k for k in ("type", "position") if isinstance(data.get(k), str)]
    return {k: _tags_first(data[k]) for k in (*first, *(k for k in data if k not in first))}
