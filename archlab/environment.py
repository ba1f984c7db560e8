"""What a training run's numbers depend on besides its spec and config: the code, Python, PyTorch,
the device and, on a GPU, the kernel packages. A run repeats to the bit only where all of these
match, so training runs and study trials keep them beside their results."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
from pathlib import Path

import torch

from archlab.bench import device_name
from archlab.ops.dispatch import PACKAGES, installed


def _described_code() -> str:
    """archlab's version and, when it runs from a git checkout, the commit (``-dirty`` with
    uncommitted changes to tracked files)."""
    version = importlib.metadata.version("archlab")
    checkout = Path(__file__).resolve().parents[1]
    if not (checkout / ".git").exists():  # an installed copy: a repository around site-packages is not its source
        return version
    try:
        described = subprocess.run(["git", "-C", str(checkout), "describe", "--always", "--dirty", "--abbrev=10"],
                                   capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):  # no git here
        return version
    return f"{version} at {described}"


CODE_VERSION = _described_code()  # as this process loaded it: an edit to the checkout while a run trains does not run


def _kernel_packages() -> dict[str, str]:
    """The installed kernel packages a block's ``auto`` backend may take on a GPU, and the Triton
    that compiles fla's and mamba-ssm's kernels."""
    names = [package for backend, (_, package) in PACKAGES.items() if installed(backend)]
    found = {}
    for name in [*names, "triton"]:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # importable, but not installed as a distribution
            continue
    return found


def environment(device: torch.device, processes: int = 1) -> dict[str, str]:
    """The setting a run trains in: the code, the Python whose standard library the stdlib corpus
    is, PyTorch, the device (and how many processes share the work) and what runs the ops there."""
    found = {"archlab": CODE_VERSION, "python": platform.python_version(), "torch": str(torch.__version__), "device": device_name(device)}
    if processes > 1:  # DDP sums the gradients of each process's slice: another split, another order
        found["processes"] = str(processes)
    if device.type == "cpu":  # the vector instructions torch's CPU kernels use: another set sums in another order
        found["cpu kernels"] = torch.backends.cpu.get_cpu_capability()
    else:  # blocks take the kernel packages here; on a CPU they never run
        found.update(_kernel_packages())
    return found
