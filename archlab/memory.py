"""Room for a large allocation, checked before it is made.

On CUDA an allocation larger than the device raises ``torch.OutOfMemoryError``. On the CPU one
larger than the machine's whole memory fails too, but several that each fit, and together do not,
succeed and are then filled page by page until the kernel's OOM killer ends the process, with no
word said. The CPU's free memory is therefore checked before a cache or a model is made.
"""

from __future__ import annotations

import torch


def binary_units(size: int) -> str:
    """Bytes as people read them: 812 B, 3.7 MiB, 47.7 GiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size} B"


class NoRoom(torch.OutOfMemoryError):
    """An allocation refused before it was tried: ``asked`` bytes for ``what``, ``free`` free."""

    def __init__(self, asked: int, free: int, what: str):
        super().__init__(f"{what} ask for {binary_units(asked)} with {binary_units(free)} free")
        self.asked, self.free, self.what = asked, free, what


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
