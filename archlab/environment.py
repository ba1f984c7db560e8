"""What a training run's numbers depend on besides its spec and config: the code, Python, PyTorch,
the device and, on a GPU, the kernel packages. A run repeats to the bit only where all of these
match, so training runs and study trials keep them beside their results."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import tomllib
from pathlib import Path

import torch
import yaml

from archlab.bench import device_name
from archlab.files import path_kind, regular, write_text_whole
from archlab.ops.dispatch import PACKAGES, installed
from archlab.registry import distributions


def _described_code() -> str:
    """archlab's version and, when it runs from a git checkout, the commit (``-dirty`` with
    uncommitted changes to tracked files)."""
    checkout = Path(__file__).resolve().parents[1]
    try:
        version = importlib.metadata.version("archlab")
    except importlib.metadata.PackageNotFoundError:  # a source checkout run without installing it (PYTHONPATH)
        try:
            version = tomllib.loads((checkout / "pyproject.toml").read_text())["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            version = "not installed"
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


def environment(device: torch.device, processes: int = 1, blocks: tuple[type, ...] = ()) -> dict[str, str]:
    """The setting a run trains in: the code (archlab's, and the versions of the plugin packages
    that registered ``blocks``, the spec classes of its blocks), the Python whose standard library
    the stdlib corpus is, PyTorch, the device (and how many processes share the work) and what runs
    the ops there."""
    found = {"archlab": CODE_VERSION, **distributions(blocks), "python": platform.python_version(), "torch": str(torch.__version__),
             "device": device_name(device)}
    if processes > 1:  # DDP sums the gradients of each process's slice: another split, another order
        found["processes"] = str(processes)
    if device.type == "cpu":  # the vector instructions torch's CPU kernels use: another set sums in another order
        found["cpu kernels"] = torch.backends.cpu.get_cpu_capability()
    else:  # blocks take the kernel packages here; on a CPU they never run
        found.update(_kernel_packages())
    return found


SETTINGS_FILE = "environment.yaml"  # in a run folder: the settings it trained in, each with the step it began at


class SettingsError(ValueError):
    """A run's environment.yaml that does not read as its settings, said in words."""


def read_settings(run_dir: Path) -> list[dict]:
    """The settings a run's environment.yaml records, each with the step it began at (``from step``);
    none for a run from before runs kept them."""
    file = run_dir / SETTINGS_FILE
    if path_kind(file) is None:
        return []
    try:
        settings = yaml.safe_load(regular(file).read_text(errors="backslashreplace"))
    except yaml.YAMLError:
        settings = None
    if not (isinstance(settings, list) and all(isinstance(s, dict) and isinstance(s.get("from step"), int) for s in settings)):
        raise SettingsError(f"{file} is not a list of the settings the run trained in, each with the step it began at ('from step')")
    return settings


def write_settings(run_dir: Path, settings: list[dict]) -> None:
    write_text_whole(run_dir / SETTINGS_FILE, yaml.safe_dump(settings, sort_keys=False))


def setting_of(recorded: dict) -> dict:
    """A recorded setting without the step it began at, as ``environment`` gives it."""
    return {name: value for name, value in recorded.items() if name != "from step"}


def describe(setting: dict) -> str:
    return ", ".join(f"{name} {value}" for name, value in setting.items())


def setting_lines(by_setting: dict[str, list[str]], noun: str) -> list[str]:
    """What things (trials, runs) trained with, as described settings -> their names: one line when
    they agree, else each setting with its names, since results repeat to the bit only within one."""
    if len(by_setting) <= 1:
        return [f"- trained with: {described}" for described in by_setting]
    return [f"- trained in {len(by_setting)} settings (a {noun} repeats to the bit only within one):",
            *(f"  - {described}: {noun}{'s' * (len(names) > 1)} {', '.join(names)}" for described, names in by_setting.items())]
