"""Which implementation a block's core op runs: the pure-PyTorch ops here, or a CUDA kernel.

A block spec names a ``backend``: ``auto`` takes the first installed kernel package on a CUDA
device and the pure-PyTorch ops elsewhere (with a notice when a CUDA run falls back); ``torch``
forces the PyTorch ops; a package name (``fla``, ``mamba_ssm``, ``flash_attn``) or ``flex``
(PyTorch's FlexAttention) insists on it and fails with a clear message where it cannot run.
Because the PyTorch ops mirror the kernels' names, layouts and state arguments, and the blocks
pass everything after the leading tensors by keyword, a kernel is a drop-in.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from collections.abc import Callable, Mapping
from functools import cache
from typing import TYPE_CHECKING

import torch

from archlab.ops.ssd import chunk_scan_from_gla, state_update_from_gla

if TYPE_CHECKING:
    from archlab.block import Problems

# backend -> (module to import, pip package)
PACKAGES = {"fla": ("fla", "flash-linear-attention"), "mamba_ssm": ("mamba_ssm", "mamba-ssm"), "flash_attn": ("flash_attn", "flash-attn")}

# (backend, op) -> "module:function" of the kernel; the torch backend uses archlab.ops
KERNELS = {
    ("torch", "chunk_gated_delta_rule"): "archlab.ops.gated_delta_rule:chunk_gated_delta_rule",
    ("torch", "fused_recurrent_gated_delta_rule"): "archlab.ops.gated_delta_rule:fused_recurrent_gated_delta_rule",
    ("torch", "chunk_retention"): "archlab.ops.retention:chunk_retention",
    ("torch", "fused_recurrent_retention"): "archlab.ops.retention:fused_recurrent_retention",
    ("torch", "chunk_simple_gla"): "archlab.ops.retention:chunk_simple_gla",
    ("torch", "fused_recurrent_simple_gla"): "archlab.ops.retention:fused_recurrent_simple_gla",
    ("torch", "mamba_chunk_scan_combined"): "archlab.ops.ssd:mamba_chunk_scan_combined",
    ("torch", "selective_state_update"): "archlab.ops.ssd:selective_state_update",
    ("fla", "chunk_gated_delta_rule"): "fla.ops.gated_delta_rule:chunk_gated_delta_rule",
    ("fla", "fused_recurrent_gated_delta_rule"): "fla.ops.gated_delta_rule:fused_recurrent_gated_delta_rule",
    ("fla", "chunk_retention"): "fla.ops.retention:chunk_retention",
    ("fla", "fused_recurrent_retention"): "fla.ops.retention:fused_recurrent_retention",
    ("fla", "chunk_simple_gla"): "fla.ops.simple_gla:chunk_simple_gla",
    ("fla", "fused_recurrent_simple_gla"): "fla.ops.simple_gla:fused_recurrent_simple_gla",
    ("mamba_ssm", "mamba_chunk_scan_combined"): "mamba_ssm.ops.triton.ssd_combined:mamba_chunk_scan_combined",
    ("mamba_ssm", "selective_state_update"): "mamba_ssm.ops.triton.selective_state_update:selective_state_update",
    ("torch", "causal_attention"): "archlab.ops.attention:causal_attention",
    ("flex", "causal_attention"): "archlab.ops.attention:flex_causal",
    ("flash_attn", "flash_attn_func"): "flash_attn:flash_attn_func",
    ("fla", "parallel_attn"): "fla.ops.attn:parallel_attn",
}


class BackendError(Exception):
    """A named backend that cannot run here, said in words."""


@cache  # asked for every layer (by its Kernels and by the model's checks); the answer does not change in a process
def installed(backend: str) -> bool:
    if backend in ("torch", "flex"):
        return True
    return importlib.util.find_spec(PACKAGES[backend][0]) is not None


def runs_on(backend: str, device_type: str) -> bool:
    """PyTorch's ops and FlexAttention run anywhere; the kernel packages on CUDA devices."""
    return backend in ("torch", "flex") or device_type == "cuda"


def trains_on(backend: str, device_type: str) -> bool:
    """PyTorch's ops train anywhere; FlexAttention (its backward pass) and the kernel packages on CUDA."""
    return backend == "torch" or device_type == "cuda"


@cache
def _notice(block: str, backends: tuple[str, ...]) -> None:
    packages = ", ".join(PACKAGES[b][1] for b in backends if b in PACKAGES) or "none"
    warnings.warn(
        f"{block}: no CUDA kernel package installed ({packages}); using the PyTorch implementation."
        " pip install 'archlab[cuda]' for the kernels, or set backend: torch to silence this",
        stacklevel=3,
    )


def choose(block: str, requested: str, backends: tuple[str, ...], device_type: str, auto: tuple[str, ...] | None = None) -> str:
    """The backend a block runs on a device. ``backends``: the block's kernel backends; ``auto``:
    those ``auto`` may take, in order of preference (default: all but flex, taken only when named)."""
    if requested == "torch":
        return "torch"
    if requested == "auto":
        if device_type != "cuda":
            return "torch"  # the kernels are CUDA-only; on the CPU the PyTorch ops are the implementation
        candidates = auto if auto is not None else tuple(b for b in backends if b != "flex")
        for backend in candidates:
            if installed(backend):
                return backend
        _notice(block, candidates)
        return "torch"
    if requested not in backends:
        raise BackendError(f"{block}: backend {requested!r} has no kernel for this block; allowed: auto, torch, {', '.join(backends)}")
    if not installed(requested):
        module, package = PACKAGES[requested]
        raise BackendError(
            f"{block}: backend {requested!r} needs the {package} package ({module}), which is not installed;"
            " pip install 'archlab[cuda]' on a CUDA machine, or use backend: auto"
        )
    if not runs_on(requested, device_type):
        raise BackendError(f"{block}: backend {requested!r} runs on CUDA devices only; this model is on {device_type}")
    return requested


def kernel(backend: str, op: str, table: Mapping[tuple[str, str], str | Callable] | None = None):
    """The function of ``op`` in ``backend``, adapted to archlab's signature where it differs; a
    block's own ``table`` (a plugin's: (backend, op) -> "module:function" or the function) first."""
    if table and (backend, op) in table:
        target = table[(backend, op)]
        return _load(target) if isinstance(target, str) else target
    if (backend, op) in ADAPTERS:
        base, adapt = ADAPTERS[(backend, op)]
        return adapt(_load(KERNELS[(backend, base)]))
    return _load(KERNELS[(backend, op)])


def _load(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _functional_state_update(in_place):
    """mamba-ssm updates the state in place, returns only the output and wants per-head values
    broadcast over the head dimension (as its Mamba2.step does); archlab's op returns both."""

    def update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
        _, heads, head_dim, d_state = state.shape
        state = state.clone()
        per_dim = dict(
            dt=dt if dt.dim() == 3 else dt[..., None].expand(-1, -1, head_dim),
            A=A if A.dim() == 3 else A[:, None, None].expand(heads, head_dim, d_state),
            D=D if D is None or D.dim() == 2 else D[:, None].expand(heads, head_dim),
            dt_bias=dt_bias if dt_bias is None or dt_bias.dim() == 2 else dt_bias[:, None].expand(heads, head_dim),
        )
        out = in_place(state, x, per_dim["dt"], per_dim["A"], B, C, D=per_dim["D"], z=z, dt_bias=per_dim["dt_bias"], dt_softplus=dt_softplus)
        return out, state

    return update


def _causal_from_flash_attn(flash_attn_func):
    """flash-attn's window is the keys left and right of the query: W - 1 and 0. It runs fp16 and
    bf16 only, so other dtypes (a float32 model, training with precision fp32) take the PyTorch op."""

    def causal_attention(q, k, v, positions, window):
        if q.dtype not in (torch.float16, torch.bfloat16):
            _dtype_notice("flash_attn", q.dtype)
            return kernel("torch", "causal_attention")(q, k, v, positions, window)
        return flash_attn_func(q, k, v, causal=True, window_size=(window - 1, 0) if window else (-1, -1))

    return causal_attention


def _causal_from_parallel_attn(parallel_attn):
    """fla's Triton attention; a window skips the key blocks outside it, with no mask in memory."""

    def causal_attention(q, k, v, positions, window):
        return parallel_attn(q, k, v, window_size=window)

    return causal_attention


# (backend, op) -> (the backend's op that does the work, adapter to archlab's signature). Mamba2's
# SSD is simple GLA with a per-head decay, so fla's simple_gla kernels run it where mamba-ssm is absent.
ADAPTERS = {
    ("mamba_ssm", "selective_state_update"): ("selective_state_update", _functional_state_update),
    ("fla", "mamba_chunk_scan_combined"): ("chunk_simple_gla", chunk_scan_from_gla),
    ("fla", "selective_state_update"): ("fused_recurrent_simple_gla", state_update_from_gla),
    ("flash_attn", "causal_attention"): ("flash_attn_func", _causal_from_flash_attn),
    ("fla", "causal_attention"): ("parallel_attn", _causal_from_parallel_attn),
}


# fla's chunk kernels that run some chunk sizes only ("module:function" -> the sizes in words; whether
# a size is one): 0.6.0 refuses the others at the call, but for powers of 2 under 16, which
# Triton's matrix products over the chunk (chunk_h's, chunk_o's) refuse to compile for 16-bit inputs.
FLA_CHUNK_SIZES = {
    "fla.ops.gated_delta_rule:chunk_gated_delta_rule": ("16, 32 or 64", lambda size: size in (16, 32, 64)),
    **dict.fromkeys(("fla.ops.simple_gla:chunk_simple_gla", "fla.ops.retention:chunk_retention"),
                    ("a power of 2 from 16", lambda size: size >= 16 and size & (size - 1) == 0)),
}
# fla kernels whose backward runs fla's gated chunk_bwd_dqkwg (a per-token decay g)
FLA_GATED_BACKWARD = {"fla.ops.gated_delta_rule:chunk_gated_delta_rule", "fla.ops.simple_gla:chunk_simple_gla",
                      "fla.ops.comba:chunk_comba", "fla.ops.precond_gated_delta_rule:chunk_precond_gated_delta_rule"}
FLA_NAMED = FLA_CHUNK_SIZES.keys() | FLA_GATED_BACKWARD


def fla_kernel(backend: str, op: str, table: Mapping[tuple[str, str], str | Callable] | None = None) -> str | None:
    """The fla kernel named above that does ``op``'s work on ``backend``, or None. A block's own
    ``table`` may name it by another of its modules, or give the function itself: it is found by
    what it is (a function of the block's own that calls fla's is not)."""
    if backend != "fla":
        return None
    if table and (backend, op) in table:
        target = table[(backend, op)]
    else:
        target = KERNELS.get((backend, ADAPTERS[(backend, op)][0] if (backend, op) in ADAPTERS else op))
    if target in FLA_NAMED:
        return target
    if target is None or not installed("fla"):
        return None
    function = _load(target) if isinstance(target, str) else target
    return next((name for name in sorted(FLA_NAMED) if _load(name) is function), None)


def chunk_size_refused(backend: str, op: str, chunk_size: int | None, table: Mapping | None = None) -> str | None:
    """Why ``backend``'s kernel for ``op`` cannot take ``chunk_size``, or None."""
    return _size_refused(fla_kernel(backend, op, table), op, chunk_size)


def _size_refused(kernel_name: str | None, op: str, chunk_size: int | None) -> str | None:
    sizes = FLA_CHUNK_SIZES.get(kernel_name) if chunk_size is not None else None
    if sizes is None or sizes[1](chunk_size):
        return None
    return f"fla's {op} runs chunk sizes of {sizes[0]}, not {chunk_size}"


def check_chunk_size(problems: Problems, op: str, chunk_size: int, backend: str, table: Mapping | None = None) -> None:
    """A block that names fla is refused a chunk size fla cannot take when its spec is read, not at
    its first step on a GPU (``auto`` runs the op on PyTorch there instead, with a notice)."""
    if why := chunk_size_refused(backend, op, chunk_size, table):
        problems.at("chunk_size").add(f"{why}; choose such a size, or set backend: auto or torch")


@cache
def fla_refuses_gated_backward() -> bool:
    """fla raises in the backward of its gated chunk kernels on Hopper GPUs with Triton >= 3.4.0
    and < 3.7.1, whose results there are wrong (fla #640), unless tilelang takes over: asked with
    fla's own flags, once, before a training step fails on it."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    return IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1 and importlib.util.find_spec("tilelang") is None


def cannot_run(backend: str, op: str, chunk_size: int | None = None, table: Mapping | None = None) -> str | None:
    """Why an installed kernel must not run ``op`` here, at a block's chunk size, or None."""
    kernel_name = fla_kernel(backend, op, table)  # found once: for a plugin's function, by importing fla's modules
    if kernel_name in FLA_GATED_BACKWARD and fla_refuses_gated_backward():
        return ("fla's gated chunk backward is wrong with Triton >= 3.4.0, < 3.7.1 on Hopper GPUs (fla #640);"
                " upgrade Triton to >= 3.7.1 or install tilelang")
    return _size_refused(kernel_name, op, chunk_size)


@cache
def _dtype_notice(backend: str, dtype) -> None:
    warnings.warn(f"{backend} runs fp16 and bf16 only; attention in {dtype} runs on the PyTorch implementation", stacklevel=3)


@cache
def _fallback_notice(block: str, op: str, reason: str) -> None:
    warnings.warn(f"{block}: {op} runs on the PyTorch implementation: {reason}", stacklevel=3)


class Kernels:
    """A block's core ops, chosen once per device type. A block keeps its own as ``self.kernels``,
    where ``Model.compile_layers`` finds them to choose before tracing. A plugin block whose ops
    are not in ``KERNELS`` gives its own ``table``, its PyTorch ops under ``"torch"``; one naming an
    fla kernel of ``FLA_CHUNK_SIZES`` or ``FLA_GATED_BACKWARD`` gets their fallbacks too. A
    chunked block gives its ``chunk_size``, which some kernels cannot take."""

    def __init__(self, block: str, requested: str, backends: tuple[str, ...], ops: tuple[str, ...], auto: tuple[str, ...] | None = None,
                 table: Mapping[tuple[str, str], str | Callable] | None = None, chunk_size: int | None = None):
        self.block, self.requested, self.backends, self.ops, self.auto, self.table = block, requested, backends, ops, auto, table
        self.chunk_size = chunk_size
        self._chosen: dict[str, dict] = {}
        available = {**KERNELS, **ADAPTERS, **(table or {})}
        if missing := [(b, op) for b in ("torch", *backends) for op in ops if (b, op) not in available]:
            raise BackendError(f"{block}: no function for {', '.join(f'{op} on {b}' for b, op in missing)}; a block's kernel table"
                               " names each of its ops for torch and for each backend it offers")

    def backend(self, device_type: str) -> str:
        return choose(self.block, self.requested, self.backends, device_type, self.auto)

    def __call__(self, device) -> dict:
        if device.type not in self._chosen:
            backend = self.backend(device.type)
            self._chosen[device.type] = {op: self._resolve(backend, op) for op in self.ops}
        return self._chosen[device.type]

    def _resolve(self, backend: str, op: str):
        reason = None if backend == "torch" else cannot_run(backend, op, self.chunk_size, self.table)
        if reason is None:
            return kernel(backend, op, self.table)
        if self.requested == backend:
            raise BackendError(f"{self.block}: backend {backend!r} cannot run {op} here: {reason}")
        _fallback_notice(self.block, op, reason)
        return kernel("torch", op, self.table)
