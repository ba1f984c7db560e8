"""Analytic costs of a spec: parameters, FLOPs and cache bytes, summed over its plan.

Each block owns its formulas (``BlockSpec.params / flops / state_bytes``) and each FFN its own;
this module only walks the plan, the same plan the model runs and the cache is laid out by, and
adds what the model itself owns: embeddings, norms, the global K,V projection, ParScale's stream
mixing and the head. A loop counts its weights once and its FLOPs T times.

FLOPs are 2 x multiply-adds of matmuls and convolutions, plus a decoding step's elementwise
passes over a recurrent state and conv tail (``state_update``); norms, activations and softmax
are not counted. The kinds are listed in ``archlab.block.FLOP_KINDS``.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, replace
from functools import cached_property
from typing import get_args

import torch

from archlab.block import FLOP_KINDS, BlockSpec, CacheBytes, Flops, whole_number
from archlab.plan import Plan, Step
from archlab.registry import RegistryError, named, raised
from archlab.spec import InferenceDtype, ModelSpec, YocoLayout
from archlab.table import MIB, Format, render, si

DTYPE_BYTES = {name: getattr(torch, name).itemsize for name in (*get_args(InferenceDtype), "float64")}  # float64: a reference model's
SHORTEST_TRAINING_LENGTH = 2  # tokens in a training sequence, at least: a block's FLOPs read one token as a decoding step

# Dense bf16 peak FLOP/s by device name (vendor datasheets, without sparsity), for MFU.
PEAK_FLOPS = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835.5e12,
    "H100": 989.4e12,  # SXM
    "H200 NVL": 835.5e12,
    "H200": 989.4e12,  # SXM
    "GH200": 989.4e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A10G": 70e12,
    "L40S": 362e12,
    "MI300X": 1307.4e12,
    "MI250X": 383e12,
}


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s for a device name as torch reports it (longest match wins); an
    unknown device gets a warning and None rather than a guess."""
    matches = [key for key in PEAK_FLOPS if key.lower() in device_name.lower()]
    if not matches:
        warnings.warn(f"no peak FLOP/s known for {device_name!r}; MFU not reported", stacklevel=2)
        return None
    return PEAK_FLOPS[max(matches, key=len)]


FORMULA_RESULTS = {  # what each of a block's cost formulas gives back
    "params": "a whole number of 0 or more",
    "state_bytes": "a whole number of 0 or more, or a CacheBytes of two",
    "flops": f"a Flops (a Counter) of kinds {sorted(FLOP_KINDS)} to whole counts of 0 or more",
}


def formula(block: BlockSpec, name: str, *args):
    """A block's cost formula (``params``, ``flops``, ``state_bytes``); one that raises, or gives
    back something else than ``FORMULA_RESULTS`` says, is named with its block and plugin, wherever
    a command first asks for it (rather than failing, or miscounting, in the sums after it)."""
    try:
        value = getattr(block, name)(*args)
    except Exception as exc:
        raise RegistryError(raised(block, f"{name}()", exc)) from exc
    if not _wanted(name, value):
        raise RegistryError(f"{named(block)}: its {name}() returned {value!r}, where {FORMULA_RESULTS[name]} is wanted")
    return value


def _wanted(name: str, value) -> bool:
    """Whether a formula's value is what ``FORMULA_RESULTS`` says it gives back."""
    if name == "flops":
        return isinstance(value, Flops) and value.keys() <= FLOP_KINDS.keys() and all(_count(v) for v in value.values())
    if name == "state_bytes" and isinstance(value, CacheBytes):
        return _count(value.global_) and _count(value.local)
    return _count(value)


def _count(value) -> bool:
    """A whole number, 0 or more (not a yes/no value)."""
    return whole_number(value) and value >= 0


def _times(flops: Flops, count: int) -> Flops:
    return Flops({kind: value * count for kind, value in flops.items()})


@dataclass
class CostRow:
    spec: str
    seq_len: int
    params_total: int
    params_non_embedding: int
    params_active: int
    train_flops_per_token: int
    prefill_flops: int
    decode_flops: int
    kv_global_bytes: int
    kv_local_bytes: int

    @property
    def kv_total_bytes(self) -> int:
        return self.kv_global_bytes + self.kv_local_bytes

    def as_dict(self) -> dict:
        return {**self.__dict__, "kv_total_bytes": self.kv_total_bytes}


class Cost:
    """The costs of one spec."""

    def __init__(self, spec: ModelSpec):
        self.spec, self.plan = spec, Plan.of(spec)
        self.contexts = spec.build_contexts()
        self.streams = spec.streams

    def _ctx(self, layer: int):
        return self.contexts[self.plan.half_of(layer)]

    # -- parameters -------------------------------------------------------------------------

    @cached_property
    def embedding_params(self) -> int:
        spec = self.spec
        return spec.vocab_size * spec.d_model * (1 if spec.tie_embeddings else 2)

    @cached_property
    def params_total(self) -> int:
        spec, d = self.spec, self.spec.d_model
        layers = sum(
            formula(spec.block_at(i), "params", self._ctx(i)) + spec.ffn.params(d) + 2 * d for i in range(spec.n_layers)
        )
        total = self.embedding_params + layers + d  # + the final norm
        if isinstance(spec.layout, YocoLayout):
            total += d + d * spec.layout.global_kv.width  # the global K,V's norm and projections
        if self.streams > 1:  # ParScale's stream-mixing MLP: P*D -> D -> P, with biases
            total += self.streams * d * d + d + d * self.streams + self.streams
        return total

    @cached_property
    def params_active(self) -> int:
        """Parameters one token uses in a pass through the layers: an MoE counts its router, top-k
        and shared experts. A looped MoE layer may route a token to other experts on each pass, and
        each of ParScale's streams routes it on its own, which the router decides, not the spec."""
        d = self.spec.d_model
        unused = self.spec.ffn.params(d) - self.spec.ffn.active_params(d)
        return self.params_total - self.spec.n_layers * unused

    # -- FLOPs ------------------------------------------------------------------------------

    def flops(self, steps: tuple[Step, ...], n: int, start: int = 0, logits: int | None = None) -> Flops:
        """FLOPs of ``steps`` for ``n`` tokens at positions start.., and of the head for the
        last ``logits`` of them (all ``n`` by default)."""
        spec, d = self.spec, self.spec.d_model
        total = Flops()
        projections = sum(step.project for step in steps)
        if projections:
            total["matmul"] += projections * 2 * n * d * spec.layout.global_kv.width
        # a layer's FLOPs hang on its block and whether it reuses K,V: worked out once per pair,
        # however many loop iterations repeat it
        runs = Counter((i, self.plan.reuses_kv(step, i)) for step, i in self.plan.applications(steps))
        for (i, reuse_kv), times in runs.items():
            layer = formula(spec.block_at(i), "flops", self._ctx(i), n, start, reuse_kv) + Flops(matmul=n * spec.ffn.flops_per_token(d))
            total += _times(layer, times)
        total = _times(total, self.streams)
        logits = n if logits is None else logits
        total["matmul"] += 2 * logits * d * (spec.vocab_size + (self.streams * (d + 1) if self.streams > 1 else 0))
        return total

    def forward_flops(self, n: int) -> Flops:
        """A training forward pass over n tokens."""
        return self.flops(self.plan.steps, _tokens("n", n))

    def train_flops_per_token(self, seq_len: int) -> int:
        """Forward and backward (3 x forward) per token at training length ``seq_len``."""
        return self.train_flops_per_sequence(seq_len) // seq_len

    def train_flops_per_sequence(self, seq_len: int) -> int:
        """Forward and backward (3 x forward) of one training sequence of ``seq_len`` tokens, exact:
        what a budget is divided by, where the per-token figure (rounded down) could buy a step more."""
        if _tokens("seq_len", seq_len) < SHORTEST_TRAINING_LENGTH:
            raise ValueError(f"training FLOPs need sequences of {SHORTEST_TRAINING_LENGTH} tokens or more, got {seq_len}")
        return 3 * sum(self.forward_flops(seq_len).values())

    def prefill_flops(self, n: int) -> Flops:
        """Prefill of an n-token prompt: the prefill steps over the first n - 1 tokens (in YOCO
        the self-decoder and the global K,V; the cross-decoder only as far as a K,V per iteration
        needs), then the last token through the whole model, as the engine runs it. Chunked cores
        count the prompt as one chunk run."""
        _tokens("n", n)
        all_but_last = self.flops(self.plan.prefill_steps, n - 1, logits=0) if n > 1 else Flops()
        return all_but_last + self.decode_flops(n)

    def decode_flops(self, context: int) -> Flops:
        """One decoding step whose token is the ``context``-th of the sequence."""
        return self.flops(self.plan.steps, 1, start=_tokens("context", context) - 1)

    # -- cache ------------------------------------------------------------------------------

    def cache_bytes(self, context: int, dtype: str | None = None) -> CacheBytes:
        """Per sequence at ``context`` tokens, in ``dtype`` (default: the spec's inference dtype).
        Global: what grows with the context (the global K,V, full-attention K,V); local: window
        rings, recurrent and conv states. Every loop-dependent slot is counted per iteration."""
        spec = self.spec
        _tokens("context", context, least=0)
        if dtype is not None and dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
        kv_bytes = DTYPE_BYTES[dtype or spec.inference_dtype]
        grows = local = 0
        if isinstance(spec.layout, YocoLayout):
            projections = sum(step.project for step in self.plan.steps)
            grows += projections * context * spec.layout.global_kv.width * kv_bytes
        for layer, slots in Counter(layer for _, _, layer in self.plan.state_keys()).items():
            block = spec.block_at(layer)
            size = formula(block, "state_bytes", self._ctx(layer), context, kv_bytes)
            if not isinstance(size, CacheBytes):  # the whole of it, as the flag says
                size = CacheBytes(size, 0) if block.grows_kv_cache else CacheBytes(0, size)
            grows, local = grows + slots * size.global_, local + slots * size.local
        return CacheBytes(grows * self.streams, local * self.streams)

    def row(self, seq_len: int) -> CostRow:
        size = self.cache_bytes(_tokens("seq_len", seq_len))
        return CostRow(
            spec=self.spec.name,
            seq_len=seq_len,
            params_total=self.params_total,
            params_non_embedding=self.params_total - self.embedding_params,
            params_active=self.params_active,
            train_flops_per_token=self.train_flops_per_token(seq_len),
            prefill_flops=sum(self.prefill_flops(seq_len).values()),
            decode_flops=sum(self.decode_flops(seq_len).values()),
            kv_global_bytes=size.global_,
            kv_local_bytes=size.local,
        )


def _tokens(name: str, n: object, least: int = 1) -> int:
    """A count of tokens a cost is asked at, or a ValueError naming it (rather than a block's
    formula blamed for the number it then returns)."""
    if not whole_number(n) or n < least:
        raise ValueError(f"{name} must be a whole number of tokens >= {least}, got {n!r}")
    return int(n)


def equal_flops_steps(reference: ModelSpec, steps: int, other: ModelSpec, seq_len: int) -> int:
    """Training steps of ``other`` that spend the training FLOPs of ``reference`` trained for
    ``steps`` steps, at the same tokens per step and sequence length (rounded down). Divided as
    whole sequences' FLOPs: per-token figures, each rounded down, could give a step more."""
    def per_sequence(spec: ModelSpec) -> int:
        return Cost(spec).train_flops_per_sequence(seq_len)  # refuses a length training cannot cost

    return steps * per_sequence(reference) // per_sequence(other)


def readable(row: CostRow) -> dict:
    """A row for people: SI prefixes for counts, MiB for cache memory."""
    return {
        "spec": row.spec,
        "seq_len": row.seq_len,
        "params total": si(row.params_total),
        "params active": si(row.params_active),
        "train FLOPs/token": si(row.train_flops_per_token),
        "prefill FLOPs": si(row.prefill_flops),
        "decode FLOPs": si(row.decode_flops),
        "KV global MiB": row.kv_global_bytes / MIB,
        "KV local MiB": row.kv_local_bytes / MIB,
        "KV total MiB": row.kv_total_bytes / MIB,
    }


COST_PAGE_TITLE = "# Costs per spec"  # a cost page's first line: what --doc may write over


def cost_doc(specs: list[tuple[str, ModelSpec]], lengths: list[int], command: str) -> str:
    """The generated cost page: one table over (row label, spec) and lengths, and how to read it."""

    rows = [readable(replace(Cost(spec).row(n), spec=label)) for label, spec in specs for n in lengths]
    return (
        f"{COST_PAGE_TITLE}\n\n"
        f"Generated by `{command}`; run it again when a spec or a cost formula changes.\n\n"
        + render(rows, Format.md)
        + "\n- **params**: a loop counts its weights once; *active* counts what one token uses in a pass through"
        " the layers (MoE: router, top-k and shared experts; a loop's passes may each route it to other experts).\n"
        "- **FLOPs**: 2 x multiply-adds of matmuls, and the recurrent blocks' state updates, short"
        " convolutions and triangular solves (Gated DeltaNet's, c^2 per right-hand side of a chunk of c);"
        " norms, activations and softmax are not counted. Attention"
        " counts each query against the keys it may see (causal, or its window); kernels that mask rather than"
        " cut compute more (decoding over a cache's whole capacity, the PyTorch window's blocks; see the README's"
        " Cost tables). *train*: 3 x the forward"
        " pass at that sequence length, per token: the model's FLOPs, as MFU counts them (a backward pass that"
        " recomputes, as the PyTorch chunked recurrences' does, runs more). *prefill*: the prefill steps over the prompt (in the YOCO"
        " family the self-decoder and the global K,V; the cross-decoder only in a loop that projects a K,V per"
        " iteration) plus the last token through the"
        " whole model. *decode*: one step whose token is the seq_len-th. A loop multiplies its layers' FLOPs"
        " by T.\n"
        "- **KV**: cache bytes per sequence at seq_len tokens in the spec's inference dtype. *global* grows with"
        " the context (the global K,V, full-attention K,V); *local* does not (window rings, recurrent and conv"
        " states; the recurrent and conv states kept in float32). Every loop-dependent part is counted per iteration.\n"
    )
