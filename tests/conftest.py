import contextlib
import io
import os
import signal
import sys
from pathlib import Path

# The Triton kernels of fla and mamba-ssm then run on the CPU, in Triton's interpreter
# (tests/test_kernels_interpreted.py). Triton reads the flag when it decorates a kernel, so it is
# set before either package is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# One thread for torch here and in every command a test starts, so that a test's several processes
# (torchrun's, concurrent study workers) do not contend for a small machine's cores; the tests'
# models are too small to gain from a second thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# pytest-xdist's workers run with COLUMNS=80 in their environment, and a rich console made while COLUMNS is set keeps
# that width for good, where the in-process commands set their own (``in_process_cli``).
os.environ.pop("COLUMNS", None)

import pytest
import torch

import archlab

ROOT = Path(__file__).resolve().parents[1]
TINY = sorted((ROOT / "specs" / "tiny").glob("*.yaml"))
PAPER = sorted((ROOT / "specs" / "paper").glob("*.yaml"))


def ids(paths):
    return [f"{p.parent.name}/{p.stem}" for p in paths]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _commands_write_temporary_files_under_pytests(tmp_path_factory):
    """The commands tests start (torchrun leaves a folder for each launch) write their temporary
    files where pytest keeps and clears its own, not in the machine's /tmp."""
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))


def tiny_model(name: str):
    spec = archlab.load_spec(ROOT / "specs" / "tiny" / f"{name}.yaml")
    return spec, archlab.build_model(spec)


def in_process_cli(patch: pytest.MonkeyPatch):
    """archlab's command line, run in this process from the checkout (``patch`` undoes the folder,
    the terminal width and argv it sets): a function of the arguments giving (exit code, stdout, stderr)."""
    from archlab.cli import main

    patch.setenv("COLUMNS", "500")  # no line breaks inside a message
    patch.chdir(ROOT)

    def run(*args) -> tuple[int | str | None, str, str]:
        patch.setattr(sys, "argv", ["archlab", *map(str, args)])
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exited:
            main()
        return exited.value.code, stdout.getvalue(), stderr.getvalue()

    return run


@pytest.fixture
def cli(monkeypatch):
    """The command run in this process, for the many bad inputs that fail before any real work:
    returns (exit code, stdout, stderr). An exception it lets out fails the test, as a traceback would."""
    return in_process_cli(monkeypatch)


@contextlib.contextmanager
def files_no_bigger_than(size):
    """Writes past ``size`` bytes in a file fail (EFBIG), as on a disk that fills midway: a
    file-size limit on this process, its hard limit left as it was, so that it can be lifted."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))  # CPython ignores SIGXFSZ: the write fails instead
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@contextlib.contextmanager
def no_longer_than(seconds):
    """Work in this process that runs for ever (a worker that never finds a dead worker's trial
    stale, a loop over a count asked for) fails the test, as a subprocess's timeout would, rather
    than hang it."""

    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def interruptible() -> None:
    """``preexec_fn`` of a child a test sends SIGINT: one started from a shell's background job
    inherits SIGINT ignored, and Python then raises no KeyboardInterrupt for it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def parsed(args: list[str]):
    """The archlab command ``args`` names, parsed as archlab parses its own without running it;
    click's usage error, saying what is wrong, is raised as it comes."""
    import typer

    from archlab.cli import _expand_list_options, app

    command = typer.main.get_command(app)
    rest = _expand_list_options(args)
    context = command.make_context("archlab", list(rest))
    while isinstance(command, typer.core.TyperGroup):  # archlab, then study
        _, command, rest = command.resolve_command(context, rest)
        context = command.make_context(command.name, list(rest), parent=context)
    return command
