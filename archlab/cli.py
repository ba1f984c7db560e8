"""The ``archlab`` command."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.table import Table

from archlab.model import build_model
from archlab.registry import RegistryError, block_specs
from archlab.spec import ModelSpec, SpecError, load_spec, spec_to_yaml

app = typer.Typer(
    help="archlab: declarative exploration of efficient decoder architectures.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
out = Console()
err = Console(stderr=True)

SpecPaths = Annotated[list[Path], typer.Argument(help="spec files, or folders searched for *.yaml")]
CPU_CHECK_LIMIT = 20_000_000  # parameters; larger specs are built on the meta device only


def _expand(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        files.extend(sorted(path.rglob("*.yaml")) if path.is_dir() else [path])
    return files


def _report(exc: SpecError) -> None:
    err.print(f"[bold red]error[/] in [bold]{exc.source}[/]:", highlight=False)
    for problem in exc.problems:
        err.print(f"  [cyan]{problem.loc}[/]: {problem.msg}", highlight=False, soft_wrap=True)


def _load_all(paths: list[Path]) -> tuple[list[tuple[Path, ModelSpec]], int]:
    """Load every spec, reporting each bad one; returns the good ones and the count of bad."""
    good, bad = [], 0
    for path in _expand(paths):
        try:
            good.append((path, load_spec(path)))
        except SpecError as exc:
            _report(exc)
            bad += 1
    return good, bad


@app.command()
def validate(paths: SpecPaths) -> None:
    """Check specs; name every problem with its field path. Exit 1 if any spec is invalid."""
    good, bad = _load_all(paths)
    for path, spec in good:
        out.print(f"[green]ok[/]    {path}  ({spec.name})", highlight=False)
    if bad or not good:
        err.print(f"{bad} of {bad + len(good)} spec(s) invalid" if good or bad else "no spec files found")
        raise typer.Exit(1)


@app.command()
def show(path: Annotated[Path, typer.Argument(help="a spec file")]) -> None:
    """Print the resolved spec (extends merged, defaults filled in) as YAML."""
    try:
        spec = load_spec(path)
    except SpecError as exc:
        _report(exc)
        raise typer.Exit(1) from None
    sys.stdout.write(spec_to_yaml(spec))


@app.command()
def blocks() -> None:
    """List the registered block plugins and their options."""
    table = Table("type", "plugin", "options (defaults)")
    for name, cls in block_specs().items():
        fields = ", ".join(
            f"{k}={'required' if f.is_required() else f.default!r}" for k, f in cls.model_fields.items() if k != "type"
        )
        table.add_row(name, f"{cls.__module__}:{cls.__qualname__}", fields)
    out.print(table)


def _describe_structure(model) -> str:
    parts = []
    for seg in model.segments:
        half = ("self", "cross")[seg.half] if model.global_kv is not None else "layers"
        span = f"{seg.start}-{seg.end - 1}" if seg.end - seg.start > 1 else f"{seg.start}"
        loop = f" x{seg.times}{' shared-kv' if seg.share_kv else ''}" if seg.times > 1 else ""
        parts.append(f"{half}[{span}]{loop}")
    return " ".join(parts)


@app.command()
def build(
    paths: SpecPaths,
    seq_len: Annotated[int, typer.Option(help="tokens in the CPU forward/backward check")] = 64,
) -> None:
    """Validate and build every spec; run a forward and backward pass on the CPU for those small
    enough, and build the rest on the meta device. Prints parameters and structure per spec."""
    good, bad = _load_all(paths)
    table = Table("spec", "structure", "params", "check")
    failed = 0
    for path, spec in good:
        model = build_model(spec, device="meta")
        params = sum(p.numel() for p in model.parameters())
        check = "built on meta"
        if params <= CPU_CHECK_LIMIT:
            model = build_model(spec)
            tokens = torch.randint(0, spec.vocab_size, (2, seq_len))
            start = time.perf_counter()
            logits, aux = model.forward_with_aux(tokens)
            (logits.float().logsumexp(-1).mean() + aux).backward()
            grads_ok = all(p.grad is None or p.grad.isfinite().all() for p in model.parameters())
            ok = bool(logits.isfinite().all()) and grads_ok
            failed += not ok
            check = f"{'[green]ok' if ok else '[red]non-finite'}[/] fwd+bwd {time.perf_counter() - start:.1f}s"
        table.add_row(spec.name, _describe_structure(model), f"{params:,}", check)
    out.print(table)
    if bad or failed or not good:
        raise typer.Exit(1)


def main() -> None:
    try:
        app()
    except RegistryError as exc:
        err.print(f"[bold red]error[/]: {exc}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
