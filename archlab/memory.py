"""Room for a large allocation, checked before it is made.

On CUDA an allocation larger than the device raises ``torch.OutOfMemoryError``. On the CPU one
larger than the machine's whole memory fails too, but several that each fit, and together do not,
succeed and are then filled page by page until the kernel's OOM killer ends the process, with no
word said. The CPU's free memory is therefore checked before a cache or a model is made, and work
whose memory is not known beforehand (activations) is watched as it runs (``Watched``).
"""

from __future__ import annotations

import os
import re
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def binary_units(size: int) -> str:
    """Bytes as people read them: 812 B, 3.7 MiB, 47.7 GiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size} B"


class NoRoom(torch.OutOfMemoryError):
    """An allocation refused before it was tried: ``asked`` bytes for ``what``, ``free`` free; or,
    ``partway``, work stopped once it had taken ``asked`` bytes and wanted more."""

    def __init__(self, asked: int, free: int, what: str, partway: bool = False):
        taken = (f"had taken {binary_units(asked)} of the {binary_units(free)} free when they were stopped" if partway
                 else f"ask for {binary_units(asked)} with {binary_units(free)} free")
        super().__init__(f"{what} {taken}")
        self.asked, self.free, self.what = asked, free, what


def out_of_memory(exc: BaseException) -> bool:
    """An allocation larger than the machine: torch.OutOfMemoryError on CUDA (NoRoom, refused
    beforehand); on the CPU a RuntimeError, and for a size past int64 a RuntimeError or a
    TypeError unpacking it."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, (RuntimeError, TypeError)) and re.search(r"can't allocate memory|overflow", str(exc), re.I) is not None


def free_bytes(device: torch.device | str) -> int | None:
    """What a new allocation on the CPU can take without pushing anything out (Linux's
    MemAvailable); None on other devices, where a failing allocation says so itself, or where
    the kernel does not say."""
    if torch.device(device).type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            available = [line.split()[1] for line in meminfo if line.startswith("MemAvailable:")]
    except OSError:  # not Linux
        return None
    return int(available[0]) * 1024 if available else None  # given in kB


def check_room(asked: int, device: torch.device | str, what: str) -> None:
    """Raise ``NoRoom`` if ``asked`` bytes, for ``what``, are more than the device has free."""
    free = free_bytes(device)
    if free is not None and asked > free:
        raise NoRoom(asked, free, what)


def resident_bytes() -> int:
    """The memory this process holds now (Linux's resident set)."""
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


ACTIVATIONS = "its activations"  # what a watched forward pass holds, as its NoRoom says


class Watched(TorchDispatchMode):
    """Work watched as it runs on the CPU, op by op, forward and backward. The bytes of the tensors
    each op makes are counted, and after every ``READ_EVERY`` of them the process's resident
    memory is read. NoRoom stops the work once that growth, with room for another op as large as
    the largest yet, passes nine tenths of what was free when the work began (the kernel's
    estimate of what is free is not exact). Where nothing says what is free (CUDA, whose
    allocator raises itself) it watches nothing."""

    READ_EVERY = 16 * 2**20
    supports_higher_order_operators = True  # FlexAttention's flex_attention is one: passed on, its output counted

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compiled code (``compile: true``, FlexAttention's own tracing) compiles as it would unwatched;
        its ops are not counted, and the resident memory read after the next counted ones."""
        return True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Not wrapped when the class is made, as TorchDispatchMode would, to keep Dynamo out of
        ``__torch_dispatch__``: the wrapper imports Dynamo at the first op, 1.2 s in every command
        watched. ``__enter__`` wraps it where Dynamo is loaded already (``compile: true``)."""
        return False

    def __init__(self, device: torch.device | str, what: str):
        super().__init__()
        self.device, self.what = device, what
        self.free: int | None = None

    def __enter__(self):
        self.free = free_bytes(self.device)
        if self.free is None:
            return self
        cls = type(self)
        if "torch._dynamo" in sys.modules and "_dynamo_kept_out" not in cls.__dict__:
            # Compiled code is about (compile: true). A compiled layer's frame resumed after a graph break (MoE's
            # host read of its experts) runs under Dynamo's frame hook, which would otherwise trace this mode's
            # __torch_dispatch__, its shapes symbolic (nonzero's), and fail at their nbytes. Dynamo is loaded
            # already, so keeping it out costs nothing here.
            cls.__torch_dispatch__ = torch._disable_dynamo(cls.__dict__["__torch_dispatch__"], recursive=True)
            cls._dynamo_kept_out = True
        self.start, self.made, self.largest = resident_bytes(), 0, 0
        return super().__enter__()

    def __exit__(self, *exc):
        return None if self.free is None else super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        made = out.nbytes if isinstance(out, torch.Tensor) else sum(t.nbytes for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        self.made, self.largest = self.made + made, max(self.largest, made)
        if self.made >= self.READ_EVERY:
            self.made = 0
            grown = resident_bytes() - self.start
            if grown + self.largest > 0.9 * self.free:
                raise NoRoom(grown, self.free, self.what, partway=True)
        return out
