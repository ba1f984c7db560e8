"""The ``archlab`` command."""

from __future__ import annotations

import _thread
import importlib
import itertools
import json
import math
import os
import re
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from decimal import Decimal
from enum import Enum
from fractions import Fraction
from pathlib import Path
from typing import Annotated, NamedTuple, get_args

import torch
import typer
from typer.core import TyperGroup
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

from archlab.block import Problem, ceil_div
from archlab.cache import Cache
from archlab.checks import SHAPE_CHECK_LENGTH, first_forward
from archlab.cost import COST_PAGE_TITLE, SHORTEST_TRAINING_LENGTH, Cost, cost_doc, equal_flops_steps, readable
from archlab.engine import Engine, Sampling, check_capturable
from archlab.ffn import MoE
from archlab.files import path_kind, write_text_whole
from archlab.interrupts import Terminated, held_signals, interrupted_status
from archlab.kv import PAGE_KERNELS
from archlab.memory import ACTIVATIONS, NoRoom, Watched, out_of_memory
from archlab.model import build_model
from archlab.ops.dispatch import BackendError
from archlab.registry import RegistryError, block_specs, plugin, said
from archlab.spec import InferenceDtype, ModelSpec, SpecError, load_spec, load_yaml, spec_changes, spec_to_yaml
from archlab.study.definition import shipped_studies
from archlab.table import Format, first_few, parse_budget, parse_length, render, si
from archlab.train.checkpoint import RESTORE_SPEC, RUN_SPEC, CheckpointError, checkpoints, load_trained, resolve, step_of
from archlab.train.config import MAX_STEPS, RESUMABLE, SEED_LIMIT, TrainConfig, holds_examples, kept_on_resume, load_config
from archlab.train.curves import Axis, labels, tokens_apart


def _takes_paths(param) -> bool:
    """Whether a command's argument or option is a path, or a list of them."""
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    return annotation is Path or getattr(annotation, "__args__", None) == (Path,)


def _refusing_empty(param) -> None:
    """``param`` refuses an empty path: pathlib reads "" as ".", the current folder, which a run
    would be trained into, or read from, unasked."""
    process = param.process_value

    def process_value(ctx, value):
        given = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(each, str) and each == "" for each in given):
            raise typer.BadParameter("an empty path names no file or folder", ctx=ctx, param=param)
        return process(ctx, value)

    param.process_value = process_value
    param.refuses_empty = True


class PathsGroup(TyperGroup):
    """A group whose commands each refuse an empty path argument or option, the one place this is
    said, and say so when a Ctrl-C or SIGTERM stops them."""

    def invoke(self, ctx):
        """Every command interruptible (``_interruptible``, once, around the whole command): one
        stopped by Ctrl-C or SIGTERM ends with a word and the shell's status, where it ended
        without one (typer's exit 130, or the process killed by SIGTERM) in the middle of a
        generated line or a table. Those that keep work (train, study run, chat) catch the
        interrupt and say themselves what they kept."""
        try:
            with _interruptible():
                return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            if out.is_terminal:  # the cursor may stand after a token generate was streaming
                sys.stdout.write("\n")
            err.print("interrupted", highlight=False)
            raise typer.Exit(interrupted_status(exc)) from None

    def get_command(self, ctx, cmd_name):
        command = super().get_command(ctx, cmd_name)
        for param in getattr(command, "params", ()):
            if _takes_paths(param) and not getattr(param, "refuses_empty", False):
                _refusing_empty(param)
        return command


app = typer.Typer(
    cls=PathsGroup,
    help="archlab: declarative exploration of efficient decoder architectures.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="markdown",  # reflows docstrings in the command list, where "rich" keeps their line breaks
)
out = Console()
err = Console(stderr=True, soft_wrap=True)  # messages whole: a log file is not a terminal to wrap them for

SpecPaths = Annotated[list[Path], typer.Argument(help="spec files, training runs, or folders searched for *.yaml")]
PageSize = Annotated[int | None, typer.Option(min=1, help="keep the global K,V in pages of this many positions (YOCO layouts; 256 in the paper's serving stack)")]
FormatOption = Annotated[Format, typer.Option("--format")]


PageKernel = Enum("PageKernel", {k: k for k in PAGE_KERNELS}, type=str)
PageKernelOption = Annotated[PageKernel, typer.Option(help="how decoding reads the pages: batched matmuls (torch) or FlexAttention (flex)")]
CPU_CHECK_LIMIT = 20_000_000  # parameters; larger specs are built on the meta device only


def _is_run(folder: Path) -> bool:
    """A training run's folder: its spec, checkpoints or metrics (a run that lost its spec.yaml is
    still one, and its config.yaml is no spec)."""
    return (folder / RUN_SPEC).exists() or (folder / "checkpoints").is_dir() or (folder / "metrics.jsonl").exists()


def _run_of(path: Path) -> Path | None:
    """The training run a folder is, or whose checkpoint folder it is (checkpoints/step-*)."""
    if _is_run(path):
        return path
    return path.parents[1] if path.parent.name == "checkpoints" and path.is_dir() and _is_run(path.parents[1]) else None


def _spec_file(path: Path) -> Path:
    """A training run's folder, or one of its checkpoints', stands for the spec it trained."""
    run = _run_of(path)
    return path if run is None else run / RUN_SPEC


def _expand(paths: list[Path]) -> list[Path]:
    """Spec files; a folder gives its *.yaml, where a training run gives its spec alone (not its
    training config)."""
    files: list[Path] = []
    for path in paths:
        if (run := _run_of(path)) is not None:
            files.append(run / RUN_SPEC)
        elif path.is_dir():
            found = sorted(path.rglob("*.yaml"))
            runs = {f.parent for f in found if _is_run(f.parent)}
            files.extend(sorted([f for f in found if f.parent not in runs] + [run / RUN_SPEC for run in runs]))
        else:
            files.append(path)
    unique: dict[Path, Path] = {}  # a file named twice: its row once, where first named
    for file in files:
        try:
            key = file.resolve()
        except (RuntimeError, OSError):  # a link that leads back to itself: load_spec names it
            key = file.absolute()
        unique.setdefault(key, file)
    return list(unique.values())


def _report(exc: SpecError) -> None:
    err.print(f"[bold red]error[/] in [bold]{escape(exc.source)}[/]:", highlight=False)
    for problem in exc.problems:
        err.print(f"  [cyan]{escape(problem.loc)}[/]: {escape(problem.msg)}", highlight=False)


def _say(line: str) -> None:
    """A line of progress on stderr, shown as it is (a data source's name may read as markup)."""
    err.print(line, highlight=False, markup=False)


def _error(text: str) -> None:
    """One line naming what is wrong (any markup-like text in it shown as it is)."""
    err.print(f"[bold red]error[/]: {escape(text)}", highlight=False)


def _notice(text: str) -> None:
    """One line of something worth knowing that stops nothing (any markup-like text in it shown as it is)."""
    err.print(f"[yellow]notice[/]: {escape(text)}", highlight=False)


def _load_all(paths: list[Path]) -> tuple[list[tuple[Path, ModelSpec]], int]:
    """Load every spec, reporting each bad one; returns the good ones and the count of bad."""
    good, bad, files = [], 0, _expand(paths)
    if not files:
        _error(f"no spec files found in {' '.join(map(str, paths))}")
    for path in files:
        try:
            good.append((path, _load_spec_file(path)))
        except SpecError as exc:
            _report_spec(path, exc)
            bad += 1
    return good, bad


def _report_spec(path: Path, exc: SpecError) -> None:
    """A spec file that does not load, said: as what it is instead where it is another of archlab's
    files, whose schema errors would say only that every spec field is missing."""
    instead = _not_a_spec(path)
    _error(f"{path} is {instead}, not a model spec") if instead else _report(exc)


def _not_a_spec(path: Path) -> str | None:
    """What a YAML file given where a spec is due is instead, where it is one of archlab's others."""
    from archlab.train.config import TrainConfig

    try:
        loaded = load_yaml(path)  # what cannot be read (a FIFO, a YAML error) is said by the spec's own error
    except SpecError:
        return None
    keys = set(loaded) if isinstance(loaded, dict) else set()
    if {"variants", "baseline"} <= keys:
        return "a study (run it with `archlab study run`)"
    if keys and keys <= set(TrainConfig.model_fields) and not keys <= set(ModelSpec.model_fields):
        return "a training config (give it to `archlab train --config`)"
    return None


@app.command()
def validate(paths: SpecPaths) -> None:
    """Check specs; name every problem with its field path. Exit 1 if any spec is invalid."""
    good, bad = _load_all(paths)
    for path, spec in good:
        out.print(f"[green]ok[/]    {escape(str(path))}  ({escape(spec.name)})", highlight=False)
    if bad:
        err.print(f"{bad} of {bad + len(good)} spec(s) invalid")
    if bad or not good:
        raise typer.Exit(1)


@app.command()
def show(path: Annotated[Path, typer.Argument(help="a spec file or a training run")]) -> None:
    """Print the resolved spec (extends merged, defaults filled in) as YAML."""
    sys.stdout.write(spec_to_yaml(_load_one(path)))


@app.command()
def blocks() -> None:
    """List the registered block plugins and their options."""
    table = Table("type", Column("plugin", overflow="fold"), "options (defaults)")  # folded, not cut, on a narrow terminal
    for name, cls in block_specs().items():
        fields = ", ".join(
            f"{k}={'required' if f.is_required() else f.default!r}" for k, f in cls.model_fields.items() if k != "type"
        )
        table.add_row(name, plugin(cls), fields)
    out.print(table)


def _describe_structure(model) -> str:
    parts = []
    for seg in model.plan.segments:
        half = ("self", "cross")[seg.half] if model.global_kv is not None else "layers"
        span = f"{seg.start}-{seg.end - 1}" if seg.end - seg.start > 1 else f"{seg.start}"
        loop = f" x{seg.times}{' shared-kv' if seg.share_kv else ''}" if seg.times > 1 else ""
        parts.append(f"{half}[{span}]{loop}")
    return " ".join(parts)


@app.command()
def build(
    paths: SpecPaths,
    seq_len: Annotated[str, typer.Option(help="tokens in the CPU forward/backward check (e.g. 64, 1K)")] = "64",
) -> None:
    """Validate and build every spec. Those small enough for the CPU also run a forward and
    backward pass (forward only where a kernel has no CPU backward), have their cost formulas
    checked against the built model and its cache, and decode token by token as a full forward
    pass computes; the rest are built on the meta device. Prints parameters and structure."""
    from archlab.checks import cpu_check

    n = _lengths([seq_len])[0]
    good, bad = _load_all(paths)
    if not good:
        raise typer.Exit(1)  # no table of nothing under the errors
    table = Table("spec", "structure", "params", "check")
    failed, problems = 0, []
    for label, (_, spec) in zip(_labels(good), good):
        try:
            model = _built(spec, device="meta")
        except RegistryError as exc:  # a block's module without what the model calls: the other specs still checked
            problems.append(f"{label}: {exc}")
            failed += 1
            table.add_row(escape(label), "-", "-", "[red]not built")
            continue
        params = sum(p.numel() for p in model.parameters())
        check = "built on meta"
        if params <= CPU_CHECK_LIMIT:
            model = _built(spec)
            start = time.perf_counter()
            with _fits_in_memory(f"{spec.name}: a check of 2 x {n:,} tokens", "--seq-len or the spec's sizes"):
                result = cpu_check(model, n)
            problems += [f"{label}: {problem}" for problem in result.problems]
            ok = result.finite and not result.problems
            failed += not ok
            verdict = "[green]ok" if ok else f"[red]{len(result.problems)} problem(s)"
            checked = f"{result.passes}, costs, decoding" if result.finite else result.passes
            check = f"{verdict}[/] {checked} {time.perf_counter() - start:.1f}s"
        table.add_row(escape(label), _describe_structure(model), f"{params:,}", check)
    out.print(table)
    for problem in problems:
        _error(problem)
    if bad or failed:
        raise typer.Exit(1)


def _labels(loaded: list[tuple[Path, ModelSpec]]) -> list[str]:
    """Table rows' names: each spec's, with the run's folder where it came from one (runs of one
    spec, as a study's, differ only there), or its file where two share a name."""
    labels = [f"{spec.name} ({path.parent})" if path.name == RUN_SPEC else spec.name for path, spec in loaded]
    return [f"{spec.name} ({path})" if labels.count(label) > 1 else label for label, (path, spec) in zip(labels, loaded)]


def _load_spec_file(path: Path) -> ModelSpec:
    """``load_spec``, where the spec.yaml of a run holding a checkpoint is gone is said as such, with
    where the spec is recorded (it was "not found (no such file)")."""
    saved = path.parent / "checkpoints"
    if path.name == RUN_SPEC and path_kind(path) is None and saved.is_dir() and any(step_of(p) is not None for p in saved.iterdir()):
        raise SpecError(str(path), [Problem("<file>", f"is gone from the run {path.parent}; {RESTORE_SPEC}")])
    return load_spec(path)


def _load_one(path: Path) -> ModelSpec:
    spec_file = _spec_file(path)
    try:
        return _load_spec_file(spec_file)
    except SpecError as exc:
        _report_spec(spec_file, exc)
        raise typer.Exit(1) from None


def _data_given(data: str | None) -> str | None:
    """--data of a training or a study: an empty one read as none, and trained on the default data unasked."""
    if data is not None and not data.strip():
        raise typer.BadParameter("--data is empty; give stdlib, a path, hf:NAME[:split], mqar or copy, or leave it out")
    return data


def _lengths(values: list[str], least: int = 1) -> list[int]:
    """The token counts of --seq-len, each once (a length given twice would be a row twice), in
    the order given."""
    if option := next((v for v in values if re.match(r"-[^\d]", v)), None):  # --seq-len --gen 2: the next option taken for its value
        raise typer.BadParameter(f"--seq-len takes a length (e.g. 2048, 16K), and was followed by {option}")
    try:
        lengths = [parse_length(v) for v in values]
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if min(lengths) < least:
        raise typer.BadParameter(f"--seq-len {min(lengths)}: training costs need sequences of {least} tokens or more"
                                 " (a single token is counted as a decoding step)")
    return list(dict.fromkeys(lengths))


@contextmanager
def _fits_in_memory(what: str, options: str, page_size: int | None = None, kept: Callable[[], str] | None = None):
    """An allocation larger than the machine (or refused beforehand, ``archlab.memory``), named by
    what asked for it (``what``, in pages of ``page_size`` if paged) and the options that size it,
    rather than by the allocator's internals; ``kept`` says what of the work survives."""
    try:
        yield
    except (RuntimeError, TypeError, MemoryError) as exc:
        if not out_of_memory(exc):
            raise
        if isinstance(exc, NoRoom):
            size = f" ({exc})"
        else:
            # "... 1280000 bytes" (CPU), "... 2.00 GiB" (CUDA), "... 745. GiB" (numpy)
            asked = re.search(r"allocate (\d+(?:\.\d+)?)\.? ?(\w+)", str(exc))
            size = " (asked for {} {})".format(re.sub(r"\d{4,}", lambda m: f"{int(m[0]):,}", asked[1]), asked[2]) if asked else ""
        paged, options = (f" in pages of {page_size:,}", f"{options} or --page-size") if page_size else ("", options)
        after = f"; {kept()}" if kept else ""
        _error(f"{what}{paged} does not fit in memory{size}; lower {options}{after}")
        raise typer.Exit(1) from None


def _import_whole(module: str) -> None:
    """Import ``module`` with SIGINT and SIGTERM held until it is done, then delivered: one landing
    inside an extension module's import (torch._dynamo's of triton) ended the process from C++, with
    "terminate called after throwing an instance of 'nanobind::python_error'"."""
    with held_signals():
        importlib.import_module(module)


@contextmanager
def _interruptible():
    """SIGTERM (from timeout, docker stop, a scheduler, or torchrun stopping its other workers) stops
    long work as Ctrl-C does, saying what was kept, where it would end the process without a word.
    Either signal that lands while Python runs a finalizer (a ``__del__``, a weakref callback) raises
    there, where Python prints the interrupt and drops it and the work would go on as if none came:
    it is delivered again a moment later, from another thread, once the finalizer is done, unless
    the work has ended by then (what it would have stopped has been done). Only the main thread is
    interrupted: in another (a caller's), this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one ends the process, as if none were caught
        raise Terminated

    def deliver_again(unraisable):
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            return previous_hook(unraisable)
        signum = signal.SIGINT
        if isinstance(unraisable.exc_value, Terminated):
            signum = signal.SIGTERM
            signal.signal(signum, terminate)
        later = threading.Timer(0.05, _thread.interrupt_main, args=(signum,))  # not in this hook, where it would be dropped too
        later.daemon = True
        later.start()
        pending.append(later)

    previous_signal, previous_hook = signal.signal(signal.SIGTERM, terminate), sys.unraisablehook
    sys.unraisablehook, pending = deliver_again, []
    try:
        yield
    finally:
        for later in pending:  # else it would land in whatever runs next, outside any handler
            later.cancel()
        signal.signal(signal.SIGTERM, previous_signal)
        sys.unraisablehook = previous_hook


DTYPES = {name: getattr(torch, name) for name in get_args(InferenceDtype)}
Dtype = Enum("Dtype", {k: k for k in ("auto", *DTYPES)}, type=str)
DtypeOption = Annotated[Dtype, typer.Option(help="the model's dtype; auto: the spec's inference_dtype")]


def _built(spec: ModelSpec, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
    """``build_model``, with a model larger than memory named by its size."""
    with _fits_in_memory(f"{spec.name} with its {Cost(spec).params_total:,} parameters", "d_model, n_layers or the FFN's size"):
        return build_model(spec, device=device, dtype=dtype)


def _runnable(spec: ModelSpec, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
    """``_built``, with every block's output shape checked on a short sequence (``first_forward``):
    a plugin's forward that gives back another shape is named, not met in the residual add after it."""
    model = _built(spec, device, dtype)
    with _fits_in_memory(f"{spec.name}: a forward pass of {SHAPE_CHECK_LENGTH} tokens (each block's output shape checked)",
                         "the spec's sizes"):
        first_forward(model)
    return model


def _dtype(spec: ModelSpec, dtype: Dtype) -> torch.dtype:
    return DTYPES[spec.inference_dtype if dtype.value == "auto" else dtype.value]


def _utf8(option: str, text: str) -> str:
    """Text from the command line, refused if it holds bytes that are not UTF-8 (the shell passes them through)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise typer.BadParameter(f"{option} {text.encode('utf-8', 'surrogateescape')!r} is not UTF-8 text") from None
    return text


class TextCodec:
    """Text <-> token ids: a trained run's tokenizer, or raw UTF-8 bytes for a bare spec."""

    def __init__(self, tokenizer_file: Path | None, vocab_size: int):
        self.tokenizer = None
        if tokenizer_file is not None:
            from archlab.train.data import DataError, load_tokenizer

            try:
                self.tokenizer = load_tokenizer(str(tokenizer_file), vocab_size)
            except DataError as exc:  # the run's own: a damaged one, or another run's
                raise CheckpointError(str(exc)) from None

    def encode(self, text: str) -> list[int]:
        from archlab.train.data import encode

        return encode(self.tokenizer, [text], "the prompt")[0].ids if self.tokenizer else list(text.encode())

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer:
            return self.tokenizer.decode(ids, skip_special_tokens=False)  # an end of message may be one (<|end|>)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@app.command()
def generate(
    source: Annotated[Path, typer.Argument(metavar="SPEC_OR_RUN", help="a spec (random weights), or a training run / checkpoint")],
    prompt: Annotated[str, typer.Option(help="prompt text")] = "Once upon a time",
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    temperature: Annotated[float, typer.Option(help="0 is greedy; a finite number >= 0")] = 0.0,
    top_k: Annotated[int | None, typer.Option(min=1)] = None,
    top_p: Annotated[float | None, typer.Option(help="sample from the fewest tokens whose probabilities reach it, in (0, 1]")] = None,
    seed: Annotated[int | None, typer.Option(min=0, max=SEED_LIMIT - 1,
                                             help="sampling seed; for a bare spec, also its random weights (default 0)")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop once this text is written (shown too); may be given again")] = None,
    prefill_chunk: Annotated[int, typer.Option(min=1)] = 2048,
    page_size: PageSize = None,
    page_kernel: PageKernelOption = PageKernel("torch"),
    dtype: DtypeOption = Dtype("auto"),
) -> None:
    """Generate text, streaming it as it comes. A training run (its directory or a checkpoint
    folder) brings its weights and tokenizer; a bare spec brings random weights and byte tokens."""
    from archlab.train.data import DataError

    sampling = _sampling(temperature, top_k, top_p, seed)
    _check_paging(page_size, page_kernel)
    prompt, stop = _utf8("--prompt", prompt), tuple(_utf8("--stop", text) for text in stop or ())
    if "" in stop:
        raise typer.BadParameter("--stop '' is empty; give text to stop at")
    if source.is_dir():
        spec, model, codec = _trained(source)
        if codec.tokenizer is None:
            _notice(f"{source} has no tokenizer (it trained on token ids or a recall task): text is read and printed as UTF-8"
                    " bytes, ids 0 to 255, which its ids need not be")
    else:
        spec, model = _load_one(source), None  # drawn once the prompt is known to be usable
        codec = TextCodec(None, spec.vocab_size)
    if codec.tokenizer is None and spec.vocab_size < 256:
        _error(f"{spec.name} has a vocabulary of {spec.vocab_size}; byte-level prompts need 256")
        raise typer.Exit(1)
    try:
        ids = torch.tensor(codec.encode(prompt), dtype=torch.long)
    except DataError as exc:  # a word-level tokenizer without an unknown token, say
        _error(str(exc))
        raise typer.Exit(1) from None
    if not len(ids):  # the engine starts from a token: there is no beginning-of-text one to stand in
        raise typer.BadParameter(f"--prompt {prompt!r} encodes to no tokens; give text to start from")
    runs_in = _dtype(spec, dtype)
    if model is None:
        torch.manual_seed(0 if seed is None else seed)  # the same command draws the same weights
        model = _runnable(spec, dtype=runs_in)  # drawn in float32, then cast: the same weights in any dtype
        _notice(f"{spec.name} has random weights (no checkpoint given); expect noise.")
    engine = Engine(model.to(runs_in).eval(), prefill_chunk, page_size=page_size, page_kernel=page_kernel.value)
    written = _written(engine, ids, max_new_tokens, sampling, codec, until=stop, lead=prompt)
    sys.stdout.write(f"{written.stop or ''}\n")
    size = written.cache.bytes_per_sequence()
    err.print(
        f"{written.tokens} token{'' if written.tokens == 1 else 's'} in {written.seconds:.2f}s; cache {size.global_:,} B global"
        f" + {size.local:,} B local per sequence" + (" (global: its whole pool of pages)" if page_size and model.global_kv else ""),
        highlight=False,
    )


def _sampling(temperature: float, top_k: int | None, top_p: float | None, seed: int | None) -> Sampling:
    """The sampling options, refused as the command line's where they do not make one, and said
    where they do nothing."""
    try:
        sampling = Sampling(temperature, top_k, top_p, seed)
    except ValueError as exc:  # "top_p must be ...": said of --top-p
        raise typer.BadParameter(str(exc), param_hint=f"'--{str(exc).split()[0].replace('_', '-')}'") from None
    if temperature == 0 and (given := [f"--{name}" for name, value in (("top-k", top_k), ("top-p", top_p)) if value is not None]):
        one = len(given) == 1
        _notice(f"{' and '.join(given)} {'narrows' if one else 'narrow'} what is sampled, and at --temperature 0 (greedy, the"
                f" default) nothing is: {'it does' if one else 'they do'} nothing; give a --temperature above 0 to sample")
    return sampling


def _trained(source: Path) -> tuple[ModelSpec, torch.nn.Module, TextCodec]:
    """A training run's spec, its latest weights and its text; one that does not load ends the command in words."""
    try:
        spec, model, checkpoint, tokenizer = load_trained(source)
        codec = TextCodec(tokenizer, spec.vocab_size)
    except SpecError as exc:
        _report(exc)
        raise typer.Exit(1) from None
    except CheckpointError as exc:
        _error(str(exc))
        raise typer.Exit(1) from None
    _say(f"weights from {checkpoint}; {'tokenizer ' + str(tokenizer) if tokenizer else 'byte tokens'}")
    return spec, model, codec


class Written(NamedTuple):
    """What ``_written`` generated and wrote out."""

    text: str  # up to the text of ``until`` it stopped at, which is left out
    stop: str | None  # that text
    tokens: int
    cache: Cache  # holds the prompt and the tokens (where it stopped, all but the last)
    prompted: list[torch.Tensor]  # the cache's ``mark`` once it held the prompt, to rewind to
    seconds: float  # from once the cache was made


def _cache_for(engine: Engine, prompt: int, max_new_tokens: int, room: int = 0) -> Cache:
    """A cache for a prompt and its new tokens (and ``room`` more positions), or its size said in words."""
    more = f" and room for {room:,} more" if room else ""
    with _fits_in_memory(f"a cache for {prompt:,} prompt + {max_new_tokens:,} new tokens{more}", "--max-new-tokens", engine.page_size):
        return engine.cache_for([prompt], max_new_tokens + room)


def _written(engine: Engine, ids: list[int] | torch.Tensor, max_new_tokens: int, sampling: Sampling, codec: TextCodec,
             until: tuple[str, ...] = (), lead: str = "", cache: Cache | None = None, held: int = 0) -> Written:
    """The text generated after ``ids``, up to the first of the texts ``until`` to come (as
    stop strings go: wherever it falls in a token), written out as it comes, after ``lead`` (the
    prompt, a header: written once the prompt is in the cache, so that a cache refused, or a
    prefill stopped for memory, leaves no line begun). ``cache``, ``held``: a cache that holds
    the first ``held`` tokens of ``ids`` already. The prefill's memory is watched
    (``archlab.memory.Watched``): its activations grow with the prompt's chunks and the spec."""
    cache = cache or _cache_for(engine, len(ids), max_new_tokens)
    start, new, shown, stop = time.perf_counter(), [], "", None
    stream = engine.stream([torch.as_tensor(ids)], max_new_tokens, sampling, cache, held)
    fed, chunk = len(ids) - held, engine.prefill_chunk
    passes, lower = (f" in passes of {chunk:,}", "--prefill-chunk") if fed > chunk else ("", "the prompt")
    try:
        with _fits_in_memory(f"a prefill of {fed:,} tokens{passes}", f"{lower} or the spec's sizes"), Watched(engine.device, ACTIVATIONS):
            first = next(stream)
        sys.stdout.write(lead)
        for tokens, _, _ in itertools.chain([first], stream):
            if not new:  # the first token: the cache holds the prompt alone
                prompted = cache.mark()
            new.append(int(tokens[0]))
            text = codec.decode(new)
            place, stop = _first_stop(text.removesuffix("\ufffd"), until)  # a last character partly decoded may read otherwise yet
            if stop is not None:
                text = text[:place]
                break
            text = _settled(text, until)
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
            shown = text
        else:  # the last token's bytes are final now
            text = codec.decode(new)
            place, stop = _first_stop(text, until)
            text = text[:place]
    except FloatingPointError as exc:  # weights that give NaN
        sys.stdout.write("\n" if new else "")  # after the line begun
        _error(str(exc))
        raise typer.Exit(1) from None
    sys.stdout.write(text[len(shown) :])
    return Written(text, stop, len(new), cache, prompted, time.perf_counter() - start)


def _first_stop(text: str, until: tuple[str, ...]) -> tuple[int, str | None]:
    """Where the first of the texts ``until`` to come begins in ``text``, and which it is (the
    text's length and None where none has come)."""
    met = [(text.index(end), end) for end in until if end in text]
    return min(met) if met else (len(text), None)


def _settled(text: str, until: tuple[str, ...]) -> str:
    """The part of ``text`` no later token can change: without a last character partly decoded
    (bytes that may yet make one read as one replacement character; those before it that never
    will are final, and shown) and what may begin a text of ``until``."""
    text = text.removesuffix("\ufffd")
    return text[: len(text) - max((_begun(text, end) for end in until), default=0)]


def _begun(text: str, end: str) -> int:
    """How many characters at the end of ``text`` are the beginning of ``end``."""
    return next((n for n in range(min(len(text), len(end)), 0, -1) if end.startswith(text[-n:])), 0)


@app.command()
def chat(
    run: Annotated[Path, typer.Argument(help="a training run (or checkpoint) fine-tuned on conversations")],
    system: Annotated[str | None, typer.Option(help="a system message the conversation begins with")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="the longest reply, in tokens")] = 256,
    temperature: Annotated[float, typer.Option(help="0 is greedy; a finite number >= 0")] = 0.0,
    top_k: Annotated[int | None, typer.Option(min=1)] = None,
    top_p: Annotated[float | None, typer.Option(help="sample from the fewest tokens whose probabilities reach it, in (0, 1]")] = None,
    seed: Annotated[int | None, typer.Option(min=0, max=SEED_LIMIT - 1, help="sampling seed: reply N samples from seed + N - 1")] = None,
    dtype: DtypeOption = Dtype("auto"),
) -> None:
    """Talk with a run fine-tuned on conversations. Each message read (its lines up to a blank
    line) is the user's; the reply, the assistant's, ends where training ended a message (at
    <|end|>, which is not shown). The conversation so far is tokenized as training tokenized it,
    piece by piece, which a prompt given to generate is not, and stays in the cache: a turn feeds
    only the last reply (so tokenized) and the new message."""
    from archlab.train.data import HEADERS, MESSAGE_END, DataError, holds_pairs, reply_prompt

    sampling = _sampling(temperature, top_k, top_p, seed)
    system = None if system is None else _utf8("--system", system)
    if system is not None and MESSAGE_END in system:  # named as the option, not as the conversation's message 1
        raise typer.BadParameter(f"holds {MESSAGE_END}, which ends a message where the model reads it; take it out",
                                 param_hint="'--system'")
    spec, model, codec = _trained(run)
    if codec.tokenizer is None:
        _error(f"{run} trained on token ids or a recall task, with no tokenizer to read a conversation with; chat with a run fine-tuned"
               " on a .jsonl of conversations")
        raise typer.Exit(1)
    config = _trained_config(resolve(run)[0])  # a damaged config.yaml is named, as the other commands name it
    source = None if config is None else config.data.source
    if source is not None and not holds_examples(source):
        _notice(f"{run} trained on {source}, not on conversations: its replies need not end where a message does")
    elif source is not None and holds_pairs(source):
        _notice(f"{run} trained on the prompt/response pairs of {source}, not on conversations: it learned a response after a"
                " bare prompt, ended by a newline, not the turns chat gives it (`generate --prompt` asks as it learned)")
    engine = Engine(model.to(_dtype(spec, dtype)).eval())
    messages = [] if system is None else [{"role": "system", "content": system}]
    typed = sys.stdin.isatty()
    try:
        if messages:
            reply_prompt(messages, codec.tokenizer)  # a system message the tokenizer cannot encode is refused before any is typed
        if typed:
            _say("a message ends at a blank line; Ctrl-D (or Ctrl-C) ends the conversation")
        said: list[int] = []  # the last prompt, which the last reply's cache held before it
        reply, replies = None, 0
        for message in _messages(sys.stdin):
            if MESSAGE_END in message:
                refused = f"a message cannot hold {MESSAGE_END}, which ends a message where the model reads it"
                if not typed:
                    _error(refused)
                    raise typer.Exit(1)
                _say(f"{refused}; type it again without it")  # a slip, not the conversation's end
                continue
            messages.append({"role": "user", "content": message})
            prompt = reply_prompt(messages, codec.tokenizer)
            if not typed:  # the transcript shows what was said, as a terminal does
                sys.stdout.write(f"{HEADERS['user']}{message}\n\n")
            # the conversation so far stays in the cache: only the reply (as training tokenized it) and the message are fed
            held = len(said) if reply is not None and prompt[: len(said)] == said and len(prompt) + max_new_tokens <= reply.cache.capacity else 0
            if held:
                reply.cache.rewind(reply.prompted)
            cache = reply.cache if held else _cache_for(engine, len(prompt), max_new_tokens, room=len(prompt) + max_new_tokens)
            replies += 1  # each its own draws: one seed for all would repeat the first reply's random numbers in every one
            drawn = sampling if seed is None else replace(sampling, seed=(seed + replies - 1) % SEED_LIMIT)
            reply = _written(engine, prompt, max_new_tokens, drawn, codec, until=(MESSAGE_END,), lead=HEADERS["assistant"],
                             cache=cache, held=held)
            said = prompt
            sys.stdout.write("\n" if reply.text.endswith("\n") else "\n\n")  # then a blank line, as after a message typed
            if reply.stop is None:
                _say(f"(the reply was cut at --max-new-tokens {max_new_tokens})")
            messages.append({"role": "assistant", "content": reply.text})
    except DataError as exc:  # a message the tokenizer cannot encode
        _error(str(exc))
        raise typer.Exit(1) from None
    except (UnicodeDecodeError, UnicodeEncodeError) as exc:  # read strictly, or with each byte that is not UTF-8 a surrogate
        byte = exc.object[exc.start] if isinstance(exc, UnicodeDecodeError) else ord(exc.object[exc.start]) & 0xFF
        _error(f"the input is not UTF-8 text (byte 0x{byte:02x})")
        raise typer.Exit(1) from None
    except KeyboardInterrupt as exc:
        sys.stdout.write("\n")
        raise typer.Exit(interrupted_status(exc)) from None


def _messages(lines) -> Iterator[str]:
    """The messages typed: each its lines up to a blank line, or up to the end of the input. A
    byte that is not UTF-8, which a C.UTF-8 locale reads as a surrogate, raises UnicodeEncodeError."""
    message = []
    for line in lines:
        line.encode("utf-8")
        if line.strip():
            message.append(line.rstrip("\r\n"))
        elif message:
            yield "\n".join(message)
            message = []
    if message:
        yield "\n".join(message)


def _check_device(name: str) -> torch.device:
    """The device named, refused before any model is built for it if it cannot be used."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise typer.BadParameter(f"--device {name!r} is not a device; give cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise typer.BadParameter(f"--device {name}: archlab runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise typer.BadParameter(f"--device {name}: {why}")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise typer.BadParameter(f"--device {name}: there are {torch.cuda.device_count()} CUDA device(s)")
    return device


def _check_paging(page_size: int | None, page_kernel: PageKernel) -> None:
    """A page kernel named for a cache kept in rows would be ignored, and its measurement taken for the other's."""
    if page_size is None and page_kernel.value != "torch":
        raise typer.BadParameter(f"--page-kernel {page_kernel.value} reads a paged global K,V; give --page-size too (the paper's"
                                 " serving stack uses 256)")


def _check_output(option: str, path: Path, suffix: str, what: str, ours: Callable[[bytes], bool]) -> None:
    """Refuse a file the command writes (``option``'s ``path``) that could not be written, or that
    would replace a file it did not write (``ours``: whether a file's first bytes are its own), before
    the command spends its time."""
    if path.is_dir():
        raise typer.BadParameter(f"{option} {path} is a folder; give a file in it, such as {path / (what.split()[-1] + suffix)}")
    if path.suffix.lower() != suffix:
        raise typer.BadParameter(f"{option} {path}: the {what} is a {suffix} file; give a file name ending in {suffix}")
    if path.is_file() and (head := _first_bytes(path)) is not None and not ours(head):  # a README, notes, a photo
        raise typer.BadParameter(f"{option} {path} holds another file than a {what} archlab wrote; give a new file, or remove it first")
    if not path.parent.is_dir():
        raise typer.BadParameter(f"{option} {path}: {path.parent} is not a folder" if path.parent.exists() else
                                 f"{option} {path}: no folder {path.parent}")
    try:  # a folder that takes no file (read-only, or /proc): said now, not once the work is done
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as exc:
        raise typer.BadParameter(f"{option} {path}: no file can be written in {path.parent} ({exc.strerror})") from None


def _first_bytes(path: Path) -> bytes | None:
    """The first bytes of ``path``; None where it cannot be read (whether it may be written over is said when it is)."""
    try:
        with open(path, "rb") as f:
            return f.read(256)
    except OSError:
        return None


def _check_plot_path(path: Path) -> None:
    _check_output("--plot", path, ".png", "plot", lambda head: head.startswith(b"\x89PNG") and b"Matplotlib" in head)


@app.command()
def bench(
    paths: SpecPaths,
    seq_len: Annotated[list[str], typer.Option(help="prompt lengths, e.g. 2048 8K 32K")] = ["2048", "8192"],  # noqa: B006
    batch: Annotated[int, typer.Option(min=1)] = 1,
    gen: Annotated[int, typer.Option(min=1, help="new tokens per sequence")] = 128,
    prefill_chunk: Annotated[int, typer.Option(min=1)] = 2048,
    prefill_rows: Annotated[int | None, typer.Option(min=1, help="prefill only this many prompts (a divisor of --batch) and copy their cache to the rest")] = None,
    dtype: DtypeOption = Dtype("auto"),
    device: Annotated[str, typer.Option(help="cpu, cuda, ...")] = "cpu",
    cuda_graph: Annotated[bool, typer.Option(help="replay each decoding step from a captured CUDA graph")] = False,
    page_size: PageSize = None,
    page_kernel: PageKernelOption = PageKernel("torch"),
    fmt: FormatOption = Format.md,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="write a PNG of throughput and memory")] = None,
) -> None:
    """Prefill and decode throughput, peak memory and cache MiB per sequence (global, local; the
    cache the run fills, sized for the prompt, an untimed first step and the new tokens), per
    spec and prompt length: the paper's inference tables and memory-vs-length figure."""
    from rich.progress import Progress

    from archlab.bench import bench as measure
    from archlab.bench import plot

    lengths = _lengths(seq_len)
    if prefill_rows is not None and batch % prefill_rows:
        raise typer.BadParameter(f"--prefill-rows {prefill_rows} must divide --batch {batch}")
    if cuda_graph and not device.startswith("cuda"):
        raise typer.BadParameter(f"--cuda-graph needs --device cuda, got {device}")
    _check_paging(page_size, page_kernel)
    _check_device(device)
    if plot_path is not None:
        _check_plot_path(plot_path)
    good, bad = _load_all(paths)
    if bad or not good:
        raise typer.Exit(1)
    rows = []
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("bench", total=len(good) * len(lengths))
        for label, (_, spec) in zip(_labels(good), good):
            model = _runnable(spec, device, _dtype(spec, dtype)).eval()
            if cuda_graph:
                try:
                    check_capturable(model)
                except ValueError as exc:
                    _error(str(exc))
                    raise typer.Exit(1) from None
            for n in lengths:
                progress.update(task, description=f"{escape(spec.name)} @ {n:,} tokens")
                with _fits_in_memory(f"{spec.name}: a batch of {batch} x ({n:,} prompt + {gen:,} new tokens)",
                                     "--seq-len, --batch or --gen", page_size):
                    rows.append(measure(model, label, n, batch, gen, prefill_chunk, prefill_rows=prefill_rows, cuda_graph=cuda_graph,
                                        page_size=page_size, page_kernel=page_kernel.value))
                progress.advance(task)
    sys.stdout.write(render([r.as_dict() for r in rows], fmt))
    if plot_path is not None:
        plot(rows, str(plot_path))
        err.print(f"plot written to {plot_path}", markup=False)


@app.command()
def cost(
    paths: SpecPaths,
    seq_len: Annotated[list[str], typer.Option(help="context lengths, e.g. 16K 64K 256K")] = ["16K", "64K", "256K"],  # noqa: B006
    fmt: FormatOption = Format.md,
    doc: Annotated[Path | None, typer.Option(help="write the markdown cost page here instead")] = None,
) -> None:
    """Parameters, FLOPs (training per token, prefill, decode) and cache bytes per sequence
    (global, local), one row per spec and length. A spec that cannot be loaded or costed is named,
    the others' rows still given; exit 1 if any was."""

    lengths = _lengths(seq_len, SHORTEST_TRAINING_LENGTH)
    if doc is not None:  # not a run's config.yaml, a README or notes, overwritten with an 11-line page
        _check_output("--doc", doc, ".md", "cost page", lambda head: head.decode(errors="replace").splitlines()[:1] == [COST_PAGE_TITLE])
    good, bad = _load_all(paths)
    if not good or (bad and doc is not None):  # a page of some of the specs would read as a page of them all
        raise typer.Exit(1)
    labelled = list(zip(_labels(good), (spec for _, spec in good)))
    if doc is not None:
        if fmt is not Format.md:
            _error(f"--doc writes a markdown page; --format {fmt.value} goes with a table on stdout")
            raise typer.Exit(2)
        command = "archlab cost " + " ".join(str(p) for p in paths) + " --seq-len " + " ".join(seq_len) + f" --doc {doc}"
        write_text_whole(doc, cost_doc(labelled, lengths, command))  # a full disk leaves the page that was there
        err.print(f"wrote {doc}", markup=False)
        return
    rows = []
    for label, spec in labelled:
        try:
            rows += [replace(Cost(spec).row(n), spec=label) for n in lengths]
        except RegistryError as exc:  # a block's formula that raises
            _error(f"{label}: {exc}")
            bad += 1
    if rows:
        sys.stdout.write(render([readable(r) if fmt is Format.md else r.as_dict() for r in rows], fmt))
    if bad:
        raise typer.Exit(1)


@app.command("equal-flops")
def equal_flops(
    reference: Annotated[Path, typer.Argument(help="the spec whose training budget is matched")],
    others: Annotated[list[Path], typer.Argument(help="specs to give the same training FLOPs")],
    steps: Annotated[int | None, typer.Option(min=1, help="training steps of the reference (default: a run's own, else 20,000)")] = None,
    seq_len: Annotated[str | None, typer.Option(help="training sequence length (default: a run's own, else 8K)")] = None,
) -> None:
    """Steps each spec may train for to spend the reference's training FLOPs (same tokens per step).
    A reference that is a training run gives its own steps and sequence length, unless given."""

    trained = _trained_config(reference)
    n = _lengths([seq_len], SHORTEST_TRAINING_LENGTH)[0] if seq_len is not None else trained.seq_len if trained else 8 * 1024
    steps = steps or (trained.steps if trained else 20_000)
    ref = _load_one(reference)
    good, bad = _load_all(others)
    if bad or not good:
        raise typer.Exit(1)
    table = Table("spec", "train FLOPs/token", "steps at equal FLOPs", "vs reference",
                  title=f"{steps:,} reference steps of {n:,}-token sequences", title_justify="left")
    first = _spec_file(reference)
    compared = [(first, ref), *((path, spec) for path, spec in good if path.resolve() != first.resolve())]  # a folder holding it
    stepless = []
    for label, (_, spec) in zip(_labels(compared), compared):
        matched = equal_flops_steps(ref, steps, spec, n)
        table.add_row(escape(label), si(Cost(spec).train_flops_per_token(n)), f"{matched:,}", f"{matched / steps:.3f}x")
        if not matched:
            stepless.append(label)
    out.print(table)
    if stepless:
        _notice(f"{', '.join(stepless)}: one step costs more FLOPs than the reference's {steps:,} step(s) in all; give more --steps")


def _trained_config(path: Path):
    """The training config of a run (its folder, or its spec.yaml), or None: a spec, or a run whose
    config.yaml is gone (a damaged one is said as such)."""
    run = _spec_file(path).parent
    if not _is_run(run) or path_kind(run / "config.yaml") is None:
        return None
    try:
        return load_config(str(run / "config.yaml"))
    except SpecError as exc:
        _report(exc)
        raise typer.Exit(1) from None


def _budget_steps(spec: ModelSpec, cfg, steps: int | None, tokens: str | None, flops: float | None, say: Console) -> int:
    """The optimizer steps a budget buys (--tokens rounds up, --flops down); a budget under one
    step still trains one, and says so on ``say``."""

    if tokens is None and flops is None:
        return steps or cfg.steps
    tokens_per_step = cfg.batch_size * cfg.seq_len
    step_size = f"batch_size {cfg.batch_size} x seq_len {cfg.seq_len} = {tokens_per_step:,} tokens"
    if tokens is not None:
        try:
            amount = parse_budget(tokens)
        except ValueError as exc:
            raise typer.BadParameter(f"--tokens: {exc}") from None
        option, per_step = f"--tokens {tokens}", tokens_per_step
        steps = ceil_div(amount, per_step)
    else:
        if not math.isfinite(flops):
            raise typer.BadParameter(f"--flops must be a finite number, got {flops}")
        # whole sequences' FLOPs, as equal-flops divides them: a per-token figure, rounded down, could buy a step more
        option, amount, per_step = f"--flops {flops:g}", flops, Cost(spec).train_flops_per_sequence(cfg.seq_len) * cfg.batch_size
        step_size += f", {si(per_step)} FLOPs"
        steps = math.floor(Fraction(amount) / per_step)
    if amount < per_step:
        say.print(f"[yellow]notice[/]: {option} is less than one step ({step_size}); training 1 step", highlight=False)
    if steps > MAX_STEPS:
        raise typer.BadParameter(f"{option} buys {Decimal(steps):.3g} steps ({step_size}), more than the {MAX_STEPS:.0e} a run"
                                 " may take; check its units")
    return max(1, steps)


@app.command()
def train(
    spec_path: Annotated[Path, typer.Argument(metavar="SPEC", help="the architecture spec (or a run's folder, for its spec)")],
    out: Annotated[Path, typer.Option(help="run directory: checkpoints, metrics.jsonl, spec and config")],
    data: Annotated[str | None, typer.Option(help="stdlib | PATH (text file/folder, .bin/.npy tokens, .jsonl examples) | hf:NAME[:split] | mqar | copy",
                                             callback=_data_given)] = None,
    config: Annotated[Path | None, typer.Option(help="training config YAML")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help=f"override a config field: optimizer.lr=1e-3 (on --resume, only {', '.join(RESUMABLE)})")] = None,
    steps: Annotated[int | None, typer.Option(min=1, max=MAX_STEPS, help="optimizer steps")] = None,
    tokens: Annotated[str | None, typer.Option(help="train for this many tokens (e.g. 50M, 1.5B; K, M, B, T = 1e3, 1e6, 1e9, 1e12)")] = None,
    flops: Annotated[float | None, typer.Option(min=1, help="train for this many FLOPs (analytic)")] = None,
    resume: Annotated[bool, typer.Option(help="continue the run in --out from its last checkpoint")] = False,
    init: Annotated[Path | None, typer.Option(help="fine-tune: start from a training run's weights (its latest checkpoint, or a checkpoint folder)")] = None,
) -> None:
    """Train a spec. Exactly resumable after a crash; distributed under torchrun. With --init,
    fine-tune a trained run: on more text, or on a .jsonl of prompt/response examples or conversations."""
    from archlab.train.data import DataError
    from archlab.train.trainer import Relayed, Trainer, TrainError, launched_processes, micro_batch_size

    if sum(x is not None for x in (steps, tokens, flops)) > 1:
        raise typer.BadParameter("give at most one of --steps, --tokens, --flops")
    say = err if _first_process() else Console(stderr=True, quiet=True)  # under torchrun, once
    try:
        _import_whole("torch._dynamo")  # the first forward pass's; a Ctrl-C inside it once aborted the process
        if out.exists() and not out.is_dir():
            raise TrainError(f"--out {out} is a file; a run is a folder")
        spec = _load_one(spec_path)
        if resume:
            saved = out / "config.yaml"
            if config or data or init:
                raise TrainError("a resumed run keeps the config, data and starting weights it started with; drop --config,"
                                 " --data and --init (--set may change what a resume can, such as optimizer.lr)")
            if path_kind(saved) is None:  # another kind of path is said as load_config reads it
                held = "it holds checkpoints but its config.yaml is gone; restore that file to resume" if checkpoints(out) else "no config.yaml"
                raise TrainError(f"nothing to resume in {out}: {held}")
            trained = load_spec(out / RUN_SPEC)
            if changed := spec_changes(trained, spec):
                raise TrainError(f"{out} was trained with a different spec than {spec_path}: {changed}")
            try:
                cfg = load_config(str(saved), set_ or [])  # the trainer refuses what a resume may not change
            except SpecError:  # set beside what the run keeps (batch_size=3 against its micro-batches): name that first
                keys = [item.partition("=")[0] for item in set_ or []]
                fields = [key for key in keys if key.split(".")[0] in TrainConfig.model_fields]  # a stray (lr for optimizer.lr): its own error
                refusal = kept_on_resume(fields, moe=isinstance(spec.ffn, MoE))
                if refusal:
                    raise TrainError(refusal) from None
                raise
        else:
            for option, path, written in (("--config", config, "config.yaml"), ("SPEC", _spec_file(spec_path), RUN_SPEC)):
                if path is not None and Path(path).resolve() == (out / written).resolve():
                    raise TrainError(f"{option} {path} is where the run writes its resolved {written}, over what it holds; keep it"
                                     " outside --out")
            # quoted: the path or source as given, not read as YAML ("-" a list, "null" none, "1e3" a number) and said to be --set's
            given = [*([f"data.source={json.dumps(data)}"] if data else []), *([f"init={json.dumps(str(init))}"] if init else [])]
            for option, key, value, what in (("--data", "data.source", data, "sources"), ("--init", "init", init, "starts")):
                clash = next((item for item in set_ or [] if item.partition("=")[0] == key), None)
                if value and clash:  # else the option would win without a word
                    raise TrainError(f"{option} {value} and --set {clash} name two {what}; give one")
            cfg = load_config(str(config) if config else None, [*(set_ or []), *given])
        cfg = cfg.model_copy(update={"steps": _budget_steps(spec, cfg, steps, tokens, flops, say)})
        with _fits_in_memory(f"training {spec.name} ({Cost(spec).params_total:,} parameters) in micro-batches of"
                             f" {micro_batch_size(cfg, launched_processes())} x {cfg.seq_len:,} tokens",
                             "micro_batch_size, seq_len or the spec's sizes", kept=lambda: _kept_of(out, memory=True)):
            Trainer(spec, cfg, out, err).fit(cfg.steps, resume=resume)
    except SpecError as exc:
        _report(exc)
        raise typer.Exit(1) from None
    except Relayed:  # the first process said it
        raise typer.Exit(1) from None
    except (DataError, CheckpointError, TrainError) as exc:
        _error(str(exc))
        raise typer.Exit(1) from None
    except KeyboardInterrupt as exc:
        say.print(f"interrupted; {_kept_of(out)}", highlight=False)
        raise typer.Exit(interrupted_status(exc)) from None
    except RuntimeError as exc:
        if launched_processes() == 1 or not _lost_peer(exc):
            raise
        err.print(f"another process of this run stopped ({escape(str(exc).splitlines()[0])}); {_kept_of(out)}", highlight=False)
        raise typer.Exit(1) from None
    say.print(f"done: {cfg.steps} step{'' if cfg.steps == 1 else 's'}; checkpoints and metrics.jsonl in {out}", highlight=False, markup=False)


TrainedRuns = Annotated[list[Path], typer.Argument(metavar="RUN", help="training run folders")]
ScoringBatch = Annotated[int, typer.Option(min=1, help="windows run through the model at once")]
ScoringDevice = Annotated[str | None, typer.Option(help="cpu, cuda or cuda:N (default: cuda where there is one)")]


@app.command()
def curves(
    runs: TrainedRuns,
    x: Annotated[Axis, typer.Option(help="what the plot's curves run against")] = Axis.step,
    baseline: Annotated[Path | None, typer.Option(help="a run to compare each with, as the paper's Figure 2: tokens to its loss, loss at its FLOPs")] = None,
    fmt: FormatOption = Format.md,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="write a PNG of training and evaluation loss")] = None,
) -> None:
    """Training runs side by side, from their metrics.jsonl (finished or still training): the last
    logged losses, the best evaluation and tokens/s; against a --baseline, the tokens each takes
    to reach its loss and the loss each has at its FLOPs; with --plot, their loss curves."""
    from archlab.train.curves import Run, RunError, plot, started_from, trained_with

    if plot_path is not None:
        _check_plot_path(plot_path)
    given = runs if baseline is None or _real(baseline) in map(_real, runs) else [baseline, *runs]
    folders = _each_once(given)
    try:
        read = [Run.read(folder, label) for folder, label in zip(folders, labels(folders))]
        against = read[[_real(folder) for folder in folders].index(_real(baseline))] if baseline is not None else None
        rows = [run.row() | (run.against(against) if against else {}) for run in read]
        if plot_path is not None:
            plot(read, x, plot_path, against)
    except RunError as exc:
        _error(str(exc))
        raise typer.Exit(1) from None
    sys.stdout.write(render(rows, fmt))
    for line in trained_with(read) + started_from(read) + tokens_apart(folders, [run.label for run in read]):
        _say(line)
    if plot_path is not None:
        err.print(f"plot written to {plot_path}", markup=False)


# Past these, a count asked for ran for hours before a word (1e12 sequences for a synthetic task,
# 1e12 depths): far more than any measurement needs, refused as the command line's.
MAX_SEQUENCES = 100_000
MAX_DEPTHS = 1_000
NAMED_DEPTHS = 5  # of the depths a needle could not be put near, those a notice names; the table has each


@app.command()
def evaluate(
    runs: TrainedRuns,
    seq_len: Annotated[list[str], typer.Option(help="context lengths, e.g. 2K 4K 8K")] = ["2K", "4K", "8K"],  # noqa: B006
    last: Annotated[int, typer.Option(min=1, help="tokens scored at the end of each window (not for recall tasks)")] = 512,
    sequences: Annotated[int, typer.Option(min=1, max=MAX_SEQUENCES, help="windows per length")] = 16,
    batch: ScoringBatch = 8,
    device: ScoringDevice = None,
    data: Annotated[str | None, typer.Option(help="score on all of this corpus instead of the held-out split: a text file or folder, stdlib, hf:NAME (read with each run's tokenizer), a token file, mqar or copy")] = None,
    fmt: FormatOption = Format.md,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="write a PNG of loss against context length")] = None,
) -> None:
    """How well trained runs use longer contexts: the held-out loss of the same last tokens given
    prefixes of each length (the paper's last-512-token perplexity); on a recall task, loss and
    accuracy of the answers in fresh sequences of each length; on examples, of the responses."""
    from archlab.train.evaluate import evaluate as scored
    from archlab.train.evaluate import plot, scorable

    lengths = _lengths(seq_len)
    on = _scoring_device(device)

    def score(run: Path, label: str) -> list[dict]:
        _say(f"{label}: {', '.join(f'{n:,}' for n in lengths)} tokens")
        with _fits_in_memory(f"{label}: {batch} windows of {max(lengths):,} tokens", "--seq-len or --batch"):
            return [result.row(label) for result in scored(run, lengths, last, sequences, on, data, batch, _say)]

    rows = [row for found in _each_trained_run(runs, data, plot_path, score, scorable).values() for row in found]
    sys.stdout.write(render(rows, fmt))
    for line in tokens_apart(runs, labels(runs)):
        _say(line)
    if plot_path is not None:
        plot(rows, plot_path)
        err.print(f"plot written to {plot_path}", markup=False)


def _scoring_device(name: str | None) -> torch.device:
    return _check_device(name) if name is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _each_once(paths: list[Path]) -> list[Path]:
    """``paths``, each folder once, by the first spelling given: r1, ./r1 and r1/ were three rows of one run."""
    found: dict[str, Path] = {}
    for path in paths:
        found.setdefault(_real(path), path)
    return list(found.values())


def _real(path: Path) -> str:
    """Where ``path`` leads; a link in a loop, which Path.resolve raises on, is taken as it is (and refused as no run)."""
    return os.path.realpath(path)


def _each_trained_run(runs: list[Path], data: str | None, plot_path: Path | None, score: Callable[[Path, str], list],
                      check: Callable[[Path], object] = resolve) -> dict[str, list]:
    """``score(run, label)`` of each run, by its label; ``--data``, ``--plot`` and ``check`` of every
    path (a run, or a checkpoint folder) come first, and a run that cannot be scored ends the
    command in one line."""
    from archlab.train.data import DataError
    from archlab.train.evaluate import EvaluationError

    if data is not None and not data.strip():  # it would read as the current folder
        raise typer.BadParameter("--data is empty; give a corpus, or leave it out for each run's held-out split")
    if plot_path is not None:
        _check_plot_path(plot_path)
    scored, label, runs = {}, None, _each_once(runs)
    try:
        for run in runs:  # each path before any is scored
            check(run)
        for run, label in zip(runs, labels(runs)):
            scored[label] = score(run, label)
        return scored
    except SpecError as exc:
        _report(exc)
        raise typer.Exit(1) from None
    except (CheckpointError, DataError, EvaluationError) as exc:
        _error(f"{label}: {exc}" if label is not None and len(runs) > 1 else str(exc))  # which of the runs
        raise typer.Exit(1) from None


@app.command()
def layers(
    runs: TrainedRuns,
    seq_len: Annotated[str | None, typer.Option(help="tokens per window (default: the length each run trained on)")] = None,
    sequences: Annotated[int, typer.Option(min=1, max=MAX_SEQUENCES, help="windows measured")] = 16,
    batch: ScoringBatch = 8,
    device: ScoringDevice = None,
    data: Annotated[str | None, typer.Option(help="measure on this corpus instead of the held-out split (as evaluate's --data)")] = None,
    fmt: FormatOption = Format.md,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="write a PNG of distance against depth")] = None,
) -> None:
    """How far each layer application turns the hidden state, loop iterations unrolled: the angular
    distance between its input and output, averaged over held-out tokens (the paper's Figure 8)."""
    from archlab.train.representations import measure, plot, summary

    length = _lengths([seq_len])[0] if seq_len is not None else None
    on = _scoring_device(device)

    def score(run: Path, label: str) -> list:
        windows = f"{batch} windows of {f'{length:,} tokens' if length else 'the length it trained on'}"
        with _fits_in_memory(f"{label}: {windows}", "--seq-len or --batch"):
            return measure(run, length, sequences, on, data, batch, _say)

    measured = _each_trained_run(runs, data, plot_path, score)
    sys.stdout.write(render([m.row(label) for label, found in measured.items() for m in found], fmt))
    for label, found in measured.items():
        for line in summary(label, found):
            _say(line)
    if plot_path is not None:
        plot(measured, plot_path)
        err.print(f"plot written to {plot_path}", markup=False)


class HaystackKind(str, Enum):
    noise = "noise"
    text = "text"


@app.command()
def niah(
    runs: TrainedRuns,
    seq_len: Annotated[list[str], typer.Option(help="prompt lengths with the tokens generated, e.g. 2K 4K 8K")] = ["1K", "2K", "4K"],  # noqa: B006
    depths: Annotated[int, typer.Option(min=1, max=MAX_DEPTHS, help="needle depths, spread evenly through the haystack")] = 5,
    sequences: Annotated[int, typer.Option(min=1, max=MAX_SEQUENCES, help="probes per length and depth")] = 4,
    haystack: Annotated[HaystackKind, typer.Option(help="noise: a line repeated (RULER's S-NIAH-1); text: the held-out split or --data (as S-NIAH-2)")] = HaystackKind.noise,
    new_tokens: Annotated[int, typer.Option(min=1, help="tokens generated after each prompt")] = 16,
    seed: Annotated[int, typer.Option(min=0, max=SEED_LIMIT - 1, help="draws the keys, numbers and places in the text")] = 0,
    batch: ScoringBatch = 8,
    device: ScoringDevice = None,
    data: Annotated[str | None, typer.Option(help="the text haystack: a text file or folder, stdlib or hf:NAME")] = None,
    fmt: FormatOption = Format.md,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="write a PNG heat map of the share found by length and depth")] = None,
) -> None:
    """Needle in a haystack (the paper's Table 4, RULER's single-needle tasks) for runs trained on
    text: the share of probes whose greedy answer holds the number hidden in a long prompt, by
    length and depth, and the loss of the number's tokens with its gain from the needle."""
    from archlab.train.needle import niah as probed
    from archlab.train.needle import misplaced, plot, probeable, rows, summary

    lengths = _lengths(seq_len)
    if data is not None and haystack is HaystackKind.noise:
        raise typer.BadParameter("--data is the text haystack; give --haystack text with it")
    on = _scoring_device(device)

    def score(run: Path, label: str) -> list:
        _say(f"{label}: {', '.join(f'{n:,}' for n in lengths)} tokens")
        probes = depths * sequences * len(lengths)
        with _fits_in_memory(f"{label}: {probes:,} probe{'s' * (probes > 1)} of up to {max(lengths):,} tokens, {min(batch, probes)} at a time",
                             "--seq-len, --batch, --depths or --sequences"):
            return probed(run, lengths, depths, sequences, on, haystack.value, data, batch, new_tokens, seed, _say)

    found = _each_trained_run(runs, data, plot_path, score, probeable)
    sys.stdout.write(render([row for label, some in found.items() for row in rows(label, some)], fmt))
    for label, some in found.items():
        _say(summary(label, some))
        if far := misplaced(some):
            said = first_few([f"{length:,} tokens, {asked:.1f}% (placed at {placed:.1f}%)" for length, asked, placed in far], NAMED_DEPTHS, "; ")
            _notice(f"{label}: the needle sits far from the depth asked at {said}: a haystack this short has few lines to"
                    " put it between; give longer lengths, or read `placed %`")
    if plot_path is not None:
        plot(found, plot_path)
        err.print(f"plot written to {plot_path}", markup=False)


@app.command()
def downstream(
    runs: TrainedRuns,
    tasks: Annotated[str, typer.Option(help="lm-evaluation-harness task or group names, comma-separated, e.g. arc_easy,hellaswag")],
    num_fewshot: Annotated[int | None, typer.Option(min=0, help="examples before each question (default: each task's own)")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="score only the first N documents of each task")] = None,
    include_path: Annotated[Path | None, typer.Option(exists=True, help="a folder of task YAML files of your own")] = None,
    max_length: Annotated[int | None, typer.Option(min=2, help="tokens the model reads (default: the length each run trained on)")] = None,
    batch: ScoringBatch = 8,
    device: ScoringDevice = None,
    averaged: Annotated[str, typer.Option("--average", help="metrics the average takes, comma-separated: each task's first that it reports")] = "acc_norm,acc",
    fmt: FormatOption = Format.md,
) -> None:
    """Downstream tasks through lm-evaluation-harness (the paper's Table 2) for runs trained on
    text: each run's scores by task and metric, with their standard errors, and their average
    over the tasks."""
    import unittest.mock

    try:
        import lm_eval

        from archlab.train.downstream import ArchlabLM, average, metrics, raised_by_model, targets_among_choices, task_manager
    except ImportError:
        _error("downstream tasks need lm-evaluation-harness: pip install 'archlab[eval]'")
        raise typer.Exit(1) from None
    from archlab.train.evaluate import EvaluationError, Loaded

    names = _named("--tasks", tasks, "task", "arc_easy,hellaswag")
    preferred = _named("--average", averaged, "metric", "acc_norm,acc")
    try:
        manager = task_manager(names, include_path)
    except ValueError as exc:
        raise typer.BadParameter(f"--tasks: {exc}") from None
    on = _scoring_device(device)

    def score(run: Path, label: str) -> list:
        _say(f"{label}: {', '.join(names)}")
        model = ArchlabLM(Loaded.of(run), on, batch, max_length)
        with _fits_in_memory(f"{label}: {batch} sequences of {model.max_length:,} tokens", "--max-length or --batch"):
            try:  # the harness records the commit of the folder it runs in, and outside a repository git says "fatal"
                with unittest.mock.patch("lm_eval.evaluator.get_git_commit_hash", lambda: None), targets_among_choices(names):
                    results = lm_eval.simple_evaluate(model=model, tasks=names, num_fewshot=num_fewshot, limit=limit,
                                                      task_manager=manager, verbosity="ERROR")
            except EvaluationError:  # archlab's own word on the tasks (targets_among_choices), said below
                raise
            except Exception as exc:
                if raised_by_model(exc):  # archlab's own: named where it is caught below, or a fault to see whole
                    raise
                if isinstance(exc, OSError):  # a dataset that cannot be fetched or read
                    raise EvaluationError(f"the tasks could not be loaded: {exc}") from None
                # a task the harness cannot run: a template naming no field, a target past the choices, no documents
                raise EvaluationError(f"lm-evaluation-harness could not run {', '.join(names)} ({said(exc)})") from None
        mean, left_out = average(label, results, names, preferred)
        if mean is not None and left_out:
            err.print(f"{label}: the average leaves out {', '.join(left_out)}, which report none of {', '.join(preferred)}",
                      highlight=False, markup=False)
        elif mean is None and len(names) > 1:
            err.print(f"{label}: no average, as {len(names) - len(left_out)} of the {len(names)} tasks report any of"
                      f" {', '.join(preferred)}", highlight=False, markup=False)
        return metrics(label, results) + ([mean] if mean else [])

    rows = [row for found in _each_trained_run(runs, None, None, score).values() for row in found]
    sys.stdout.write(render(rows, fmt))


def _named(option: str, given: str, what: str, example: str) -> list[str]:
    """The names a comma-separated option gives; none is refused before any work."""
    names = [name.strip() for name in given.split(",") if name.strip()]
    if not names:
        raise typer.BadParameter(f"{option} {given!r} names no {what}; give names such as {example}")
    return names


def _lost_peer(exc: RuntimeError) -> bool:
    """Whether a collective failed because another process of the job is gone (killed, or out of
    memory): torch.distributed's own error, or gloo's and NCCL's connection errors, raised as
    RuntimeError."""
    return isinstance(exc, torch.distributed.DistError) or any(name in str(exc) for name in ("gloo", "NCCL"))


def _kept_of(out: Path, memory: bool = False) -> str:
    """What a training stopped midway leaves to resume from (stopped for memory: with what a
    resume may lower)."""
    if not checkpoints(out):
        return "no checkpoint had been written, so there is nothing to resume"
    how = " --set micro_batch_size=N (not for an MoE spec; seq_len and the spec are a new run's)" if memory else ""
    return f"the checkpoints already written are intact (continue with --resume{how})"


class StudyGroup(PathsGroup):
    """``archlab study NAME ...`` is ``archlab study run NAME ...`` for a shipped study or a study
    file; another word is neither, and is answered with both the commands and the shipped studies."""

    def resolve_command(self, ctx, args):
        word = args[0] if args else ""
        if word and word not in self.commands and not word.startswith("-"):
            if word not in (shipped := shipped_studies()) and not Path(word).exists() and not word.endswith((".yaml", ".yml")):
                _error(f"no command, shipped study or study file {word!r}: the commands are {', '.join(sorted(self.commands))};"
                       f" the shipped studies {', '.join(shipped)}")
                raise typer.Exit(2)
            args = ["run", *args]
        return super().resolve_command(ctx, args)


study_app = typer.Typer(
    cls=StudyGroup,
    help="Studies on Optuna: controlled architecture experiments. `archlab study NAME` runs a shipped"
    f" study: {', '.join(shipped_studies())}.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
app.add_typer(study_app, name="study")


def _study_given(study: str) -> str:
    """A study's file or name: an empty one is neither (as a path it reads as the current folder)."""
    if not study:
        raise typer.BadParameter("an empty name; give a study file, or the name of a shipped one")
    return study


StudyName = Annotated[str, typer.Argument(help="a study file, or the name of a shipped one", callback=_study_given)]
Scale = Annotated[str, typer.Option(help="a scale of the study: tiny (CPU, the default) or gpu")]
Storage = Annotated[str | None, typer.Option(help="Optuna storage URL (postgresql://... for several workers); default: SQLite in --out")]
StudyOut = Annotated[Path | None, typer.Option("--out", file_okay=False, help="study directory; default runs/studies/NAME-SCALE")]
MAX_GRACE_PERIOD = 7 * 24 * 3600  # a week: Optuna's check of a heartbeat's age overflows past about 8.6e13 s
GracePeriod = Annotated[int, typer.Option(min=1, max=MAX_GRACE_PERIOD, help="seconds without a heartbeat before a trial counts as dead")]
StudyData = Annotated[str | None, typer.Option(help="override the study's data source (give the report the same one)",
                                               callback=_data_given)]


def _study_errors(action):
    """Run a study action, turning bad input into one clear message."""
    from archlab.study.runner import StorageError
    from archlab.train.data import DataError

    try:
        return action()
    except SpecError as exc:
        _report(exc)
        raise typer.Exit(1) from None
    except (DataError, StorageError) as exc:
        _error(str(exc))
        raise typer.Exit(1) from None


@study_app.command("run")
def study_run(
    study: StudyName,
    scale: Scale = "tiny",
    storage: Storage = None,
    out: StudyOut = None,
    grace_period: GracePeriod = 60,
    data: StudyData = None,
) -> None:
    """Run (or join, or resume) a study as one worker, then print its report."""
    from archlab.study.definition import load_study
    from archlab.study.report import all_failed, report
    from archlab.study.runner import default_dir, storage_url, work
    from archlab.train.trainer import launched_processes

    if launched_processes() > 1:  # each process would be a worker whose trials wait on the others' collectives
        _error("a study trains each trial in one process: start `archlab study run` once per worker (workers on one"
               " machine or many share a --storage), not under torchrun")
        raise typer.Exit(2)

    def action():
        loaded = load_study(study, scale, data)
        where, optuna_study = out or default_dir(loaded), None
        try:  # interruptible, as every command is (PathsGroup.invoke): the report too
            optuna_study = work(loaded, where, storage, err, grace_period)
            report(loaded, optuna_study, where, storage_url(where, storage), show=sys.stdout.write)
        except KeyboardInterrupt as exc:
            if optuna_study is None:
                err.print("interrupted; finished trials are kept, and a trial this worker was training runs again once it has"
                          f" sent no heartbeat for --grace-period ({grace_period} s): taken by a worker still running, or by"
                          " the next `study run`", highlight=False)
            else:
                err.print("interrupted as the report was written; every trial is kept, and `archlab study report` writes"
                          " the report", highlight=False)
            raise typer.Exit(interrupted_status(exc)) from None
        if all_failed(loaded, optuna_study.get_trials(deepcopy=False)):
            planned = len(loaded.planned())
            _error(f"no trial succeeded ({planned} of {planned} failed); why each failed is under Failed trials in"
                   f" {where / 'report.md'}")
            raise typer.Exit(1)
        _say(f"report and plots in {where}")

    _study_errors(action)


@study_app.command("report")
def study_report(
    study: StudyName,
    scale: Scale = "tiny",
    storage: Storage = None,
    out: StudyOut = None,
    data: StudyData = None,
    fmt: Annotated[Format, typer.Option("--format", help="md: the whole report; csv or json: the variants' table, its figures as"
                                                         " numbers (report.md and the plots are written either way)")] = Format.md,
) -> None:
    """The study's report (markdown; its table alone in CSV or JSON with --format) and plots
    (PNG), from its storage."""
    from archlab.study.definition import load_study
    from archlab.study.report import report
    from archlab.study.runner import check_unchanged, default_dir, open_study, storage_url

    def action():
        loaded = load_study(study, scale, data)
        where = out or default_dir(loaded)
        url = storage_url(where, storage)
        if storage is None and (where / "optuna.db").is_dir():
            raise SpecError(str(where), [Problem("<study>", "its optuna.db is a folder, not a study's database")])
        if storage is None and not (where / "optuna.db").exists():
            raise SpecError(str(where), [Problem("<study>", "no study has run here yet (no optuna.db); run it first, or give"
                                                            " the --out (or --storage) it ran with")])
        optuna_study = open_study(loaded, url, create=False)
        check_unchanged(loaded, optuna_study)
        report(loaded, optuna_study, where, url, fmt, show=sys.stdout.write)

    _study_errors(action)


LENGTH_OPTIONS = ("--seq-len",)
LIST_COMMANDS = ("bench", "cost", "evaluate", "niah")  # where they take several values


def _expand_list_options(argv: list[str]) -> list[str]:
    """Let ``bench --seq-len 2048 8K 32K`` stand for ``--seq-len 2048 --seq-len 8K --seq-len 32K``
    (``--seq-len=2048 8K`` too). Where the option takes one value, a second is refused
    (ValueError), rather than taken for a file or put in the first's place."""
    several = next((arg for arg in argv if not arg.startswith("-")), "") in LIST_COMMANDS
    expanded, option, seen, named = [], None, 0, set()
    for arg in argv:
        name, given, _ = arg.partition("=")
        if name in LENGTH_OPTIONS:
            if name in named and not several:
                raise ValueError(f"{name} takes one length here; it is given twice")
            option, seen = name, int(bool(given))
            named.add(name)
        elif option and re.fullmatch(r"\d[\d.]*[a-zA-Z]?", arg) and not Path(arg).exists():
            # a length, or something meant as one (parse_length names it), that is no spec's path (7b)
            if seen and not several:
                raise ValueError(f"{option} takes one length here; {arg} is a second")
            if seen:
                expanded.append(option)
            seen += 1
        else:
            option = None
        expanded.append(arg)
    return expanded


def _first_process() -> bool:
    """Whether this is the first process torchrun started, or the only one."""
    return os.environ.get("RANK", "0") == "0"


def _show_notice(message, category, filename, lineno, file=None, line=None) -> None:
    """Library warnings (a kernel fallback, an ignored option) read as the command's own notices."""
    if not _first_process():  # under torchrun, said once
        return
    _notice(str(message))


def main() -> None:
    for stream, mode in (("stdin", "r"), ("stdout", "w"), ("stderr", "w")):  # closed (<&-, >&-): Python makes it None
        if getattr(sys, stream) is None:
            setattr(sys, stream, open(os.devnull, mode))  # read as empty, written nowhere, as rich's consoles already do
    with warnings.catch_warnings():  # the notices' form for this command only, not for a caller's code after it
        warnings.showwarning = _show_notice
        try:
            args = _expand_list_options(sys.argv[1:])
        except ValueError as exc:
            _error(str(exc))
            sys.exit(2)
        try:
            app(args=args)
        except (RegistryError, BackendError) as exc:
            _error(str(exc))
            sys.exit(2)
        except OSError as exc:  # a path given (--out, --doc, data.cache, ...) that cannot be read or written
            where = f"{exc.filename}: " if exc.filename else ""
            _error(where + (exc.strerror or str(exc)))
            sys.exit(1)


if __name__ == "__main__":
    main()
