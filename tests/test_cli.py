"""The installed ``archlab`` command, run as a user would, and block plugins from another package."""

import contextlib
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import typer
import yaml
from safetensors.torch import load_file, save_file, save_model
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from archlab import build_model, load_spec
from archlab.cache import Cache
from archlab.registry import block_specs, plugin
from archlab.engine import Engine
from archlab.spec import spec_to_yaml
from archlab.table import Decimals, Format, parse_budget, parse_length, render, tokens_label
from archlab.train.checkpoint import CheckpointError, file_hash, load
from conftest import ROOT, files_no_bigger_than, interruptible, parsed, tiny_model

SPEC = "specs/tiny/transformer.yaml"


def archlab(*args, cwd=ROOT, env=None):
    """The installed command in a process of its own, as a user runs it. Most tests run it in this
    process instead (conftest's ``cli``), as a process costs seconds to start; one is kept where it
    is what a test is about: the command as a user starts it, and block plugins installed for it
    through ``env`` (entry points are read once a process)."""
    return subprocess.run(
        [sys.executable, "-m", "archlab", *map(str, args)],
        cwd=cwd, env={**os.environ, "COLUMNS": "200", **(env or {})}, capture_output=True, text=True, timeout=300,
    )


# Commands run in turn in one fresh process, each as conftest's ``cli`` runs one: its exit code and
# what it wrote to stdout and stderr (a traceback, for an exception it lets out). For commands with
# a block plugin installed through ``env`` whose results do not depend on which runs first: not for
# a broken plugin's notices, said once a process.
SESSION = """
import contextlib, io, json, sys, traceback
from archlab.cli import main

commands, said = json.loads(sys.argv[1]), []
with open(sys.argv[2], "w") as results:
    for args in commands:
        sys.argv = ["archlab", *args]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as exc:  # as Python exits: None is 0, a message is printed and is 1
                code = 0 if exc.code is None else exc.code
                if not isinstance(code, int):
                    print(code, file=sys.stderr)
                    code = 1
            except BaseException:
                traceback.print_exc()
                code = 1
        said.append([code, out.getvalue(), err.getvalue()])
    json.dump(said, results)
"""


def archlab_session(tmp_path, *commands, env):
    """Each command's result, as ``archlab`` gives it, from one process started with ``env``."""
    said = tmp_path / "said.json"
    process = subprocess.run(
        [sys.executable, "-c", SESSION, json.dumps([list(map(str, command)) for command in commands]), said],
        cwd=ROOT, env={**os.environ, "COLUMNS": "200", **env}, capture_output=True, text=True, timeout=600,
    )
    assert process.returncode == 0 and "Traceback" not in process.stdout + process.stderr, process.stdout + process.stderr
    results = json.loads(said.read_text())
    assert len(results) == len(commands)
    return [subprocess.CompletedProcess(command, code, out, err) for command, (code, out, err) in zip(commands, results)]


def test_validate_reports_bad_spec_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "specs/tiny/yoco.yaml").read_text().replace("n_heads: 4", "n_heads: 5"))
    good = ROOT / "specs/tiny/yoco-u.yaml"
    result = archlab("validate", bad, good)
    assert result.returncode == 1
    assert str(bad) in result.stderr
    assert "layout.self_decoder.blocks[0].n_heads" in result.stderr
    assert "5 heads do not divide d_model=64" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert "ok" in result.stdout and "yoco-u" in result.stdout


# The installed command's start, with what argv[1] names happening as Python first looks for torch:
# a Ctrl-C or SIGTERM landing while the command's modules load, or a disk with no room for the
# temporary file that torch's imports (dill's, where it is installed) make.
AT_STARTUP = """
import errno, os, signal, sys

event = sys.argv[1]

class AtTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and event == "full disk":
            raise FileNotFoundError(errno.ENOENT, "No usable temporary directory found in ['/tmp', '/var/tmp']")
        if name == "torch":
            os.kill(os.getpid(), getattr(signal, event))

sys.meta_path.insert(0, AtTorch())
sys.argv = ["archlab", "cost", "specs/tiny/transformer.yaml"]
from archlab.launch import main
main()
"""


def _started_with(event):
    return subprocess.run([sys.executable, "-c", AT_STARTUP, event], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_while_the_command_starts_ends_it_with_the_shells_status_and_no_traceback(name):
    """Python's handler raised KeyboardInterrupt inside torch's import and printed a traceback through
    it, for a Ctrl-C in the command's first second or so."""
    result = _started_with(name)
    assert (result.returncode, result.stdout, result.stderr) == (128 + getattr(signal, name), "", "")


# The installed command, with the signal argv[1] names sent to itself as Python shuts down once the
# command is done: in an atexit callback the command registers (run first: before torch's and
# archlab's own), or as Python tears its modules down, after the last.
AT_EXIT = """
import atexit, os, signal, sys, time
import archlab.cli

def stop(kill=os.kill, pid=os.getpid(), signum=getattr(signal, sys.argv[1]), sleep=time.sleep):
    kill(pid, signum)
    sleep(0.5)

class Late:
    def __del__(self, stop=stop):  # the module's own names are gone by then
        stop()

if sys.argv[2] == "atexit":
    command = archlab.cli.main
    archlab.cli.main = lambda: (atexit.register(stop), command())[1]
else:
    late = Late()
sys.argv = ["archlab", "cost", "specs/tiny/transformer.yaml"]
from archlab.launch import main
sys.exit(main())
"""


@pytest.mark.parametrize("when", ["atexit", "teardown"])
@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_once_the_command_is_done_ends_it_with_its_own_status_and_all_it_wrote(name, when):
    """Python's shutdown printed a KeyboardInterrupt raised in an atexit callback of torch's, or was
    ended by SIGTERM (-15), after the command had done its work; in the half second Python takes to
    tear torch down, after the atexit callbacks, either ended the process by the signal."""
    result = subprocess.run([sys.executable, "-c", AT_EXIT, name, when], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (0, "")
    assert "| transformer |" in result.stdout and result.stdout.endswith("\n")


# The installed command, whose teardown hangs once its work is done, with a limit of a second.
HANGS_IN_TEARDOWN = """
import sys, time
import archlab.launch

class Hangs:
    def __del__(self, sleep=time.sleep):  # run as Python tears the module down, past the last atexit callback
        sleep(60)

hangs = Hangs()
archlab.launch.TEARDOWN_LIMIT_S = 1
sys.argv = ["archlab", "cost", "specs/tiny/transformer.yaml"]
archlab.launch.main()
"""


def test_a_teardown_that_hangs_is_ended(tmp_path):
    """Past the last atexit callback SIGINT and SIGTERM are ignored, so a teardown that hung could
    only be killed; it now ends on its own once it has taken TEARDOWN_LIMIT_S."""
    began = time.monotonic()
    result = subprocess.run([sys.executable, "-c", HANGS_IN_TEARDOWN], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGALRM and time.monotonic() - began < 50, (result.returncode, result.stderr)
    assert "| transformer |" in result.stdout and result.stdout.endswith("\n")


# The installed command, whose work lets out the interrupt argv[1] names, as one landing once its
# handling of interrupts is over would.
LET_OUT = """
import sys
import archlab.cli
from archlab.interrupts import Terminated

def interrupted():
    raise {"SIGINT": KeyboardInterrupt, "SIGTERM": Terminated}[sys.argv[1]]

archlab.cli.main = interrupted
from archlab.launch import main
sys.exit(main())
"""


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_an_interrupt_past_the_commands_handling_exits_with_the_shells_status_and_no_traceback(name):
    """Python printed its traceback and ended the process by SIGINT (-2), once seen after a study
    worker had said it was interrupted."""
    result = subprocess.run([sys.executable, "-c", LET_OUT, name], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout, result.stderr) == (128 + getattr(signal, name), "", "")


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_command_stopped_midway_says_so_with_the_shells_status(tmp_path, name):
    """generate (as bench, build, cost...) ended without a word in the middle of its line: typer's
    exit 130 for a Ctrl-C, a process killed by SIGTERM."""
    run = fake_run(tmp_path / "run")
    command = [sys.executable, "-m", "archlab", "generate", str(run), "--prompt", "ab", "--max-new-tokens", "100000"]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=interruptible)
    assert proc.stdout.read(4)  # the prompt and the first tokens: generating
    proc.send_signal(getattr(signal, name))
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + getattr(signal, name) and stderr.decode().endswith("\ninterrupted\n"), stderr.decode()


def test_a_command_run_off_the_main_thread_runs(capsys):
    """Every command is interruptible, which sets signal handlers: only the main thread may, and a
    command a caller ran in another thread failed with "signal only works in main thread"."""
    from archlab.cli import app

    ended = []
    worker = threading.Thread(target=lambda: ended.append(app(["validate", str(ROOT / SPEC)], standalone_mode=False)))
    worker.start()
    worker.join(60)
    assert ended == [None], capsys.readouterr().err


def test_a_disk_too_full_for_the_imports_is_said_in_a_line():
    """A disk full to the last block (temporary folder too) failed torch's import, and every command
    printed a traceback through it."""
    result = _started_with("full disk")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == ("error: archlab could not load its modules: [Errno 2] No usable temporary directory found in"
                             " ['/tmp', '/var/tmp']\n")


def test_blocks_lists_every_plugin_whole_on_a_narrow_terminal():
    """On 80 columns the plugin column was cut with an ellipsis ("blocks.attention:Attention…")."""
    result = archlab("blocks", env={"COLUMNS": "80"})
    assert result.returncode == 0 and "…" not in result.stdout, result.stdout + result.stderr
    column = "".join(line.split("│")[2].strip() for line in result.stdout.splitlines() if line.startswith("│"))
    for name, cls in block_specs().items():
        assert plugin(cls) in column, name


def test_validate_whole_zoo_and_show(cli, tmp_path):
    code, out, stderr = cli("validate", "specs")
    assert code in (0, None), stderr
    assert out.count("ok") == 28
    code, shown, stderr = cli("show", "specs/tiny/rins.yaml")
    assert code in (0, None), stderr
    resolved = yaml.safe_load(shown)
    assert "extends" not in resolved
    assert resolved["loop"] == {"position": "prefix", "times": 3, "kv_cache": "per_iteration", "n_layers": 2}
    assert resolved["layout"]["layers"]["blocks"][0]["n_kv_heads"] == 2  # inherited from transformer.yaml
    (tmp_path / "resolved.yaml").write_text(shown)
    assert cli("validate", tmp_path / "resolved.yaml")[0] in (0, None)


def test_a_training_run_stands_for_its_spec(cli, tmp_path):
    """A run folder holds the spec it trained beside its training config; the spec commands read
    the spec alone, from the run or from a folder of runs, whose table rows name each run."""
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        (runs / name).mkdir(parents=True)
        (runs / name / "spec.yaml").write_text(cli("show", "specs/tiny/yoco-u.yaml")[1])
        (runs / name / "config.yaml").write_text("steps: 5\nbatch_size: 4\n")
    run = runs / "a"
    for command in (["validate", run], ["validate", runs], ["show", run], ["cost", run, "--seq-len", "1K"],
                    ["cost", runs, "--seq-len", "1K"], ["equal-flops", "specs/tiny/yoco.yaml", runs, "--seq-len", "1K"]):
        code, out, stderr = cli(*command)
        assert code in (0, None), (command, stderr)
        assert "yoco-u" in out, command
        if runs in command and command[0] != "validate":  # validate names each file
            assert f"yoco-u ({runs / 'a'})" in out and f"yoco-u ({runs / 'b'})" in out, command
    checkpoint = run / "checkpoints" / "step-00000005"  # one of its checkpoints too, as generate takes: was "a folder, not a YAML file"
    checkpoint.mkdir(parents=True)
    for command in (["validate", checkpoint], ["show", checkpoint], ["cost", checkpoint, "--seq-len", "1K"]):
        code, out, stderr = cli(*command)
        assert code in (0, None) and "yoco-u" in out, (command, stderr)
    assert cli("cost", checkpoint, "--seq-len", "1K")[1] == cli("cost", run, "--seq-len", "1K")[1]


def test_a_study_or_training_config_given_as_a_spec_is_named_as_such_and_a_spec_named_twice_costed_once(cli, tmp_path):
    """Each was a page of schema errors (every spec field missing, every key of its own unknown);
    a spec given twice gave its rows twice."""
    config = tmp_path / "config.yaml"
    config.write_text("steps: 20\nbatch_size: 4\nseq_len: 32\n")
    code, out, stderr = cli("cost", "studies/architectures.yaml", config, SPEC, SPEC, SPEC.replace("tiny/", "tiny/../tiny/"),
                            "--seq-len", "64", "--format", "csv")
    assert code == 1 and stderr.splitlines() == [
        "error: studies/architectures.yaml is a study (run it with `archlab study run`), not a model spec",
        f"error: {config} is a training config (give it to `archlab train --config`), not a model spec"], stderr
    assert len(out.strip().splitlines()) == 2, out  # a header and one row


@pytest.mark.parametrize("command", ["show", "generate", "train", "validate", "build"])
def test_every_command_given_a_study_or_training_config_as_a_spec_names_it_as_such(cli, tmp_path, command):
    """show, generate and train gave the page of schema errors that validate and cost had stopped giving."""
    config = tmp_path / "config.yaml"
    config.write_text("steps: 20\nbatch_size: 4\nseq_len: 32\n")
    for path, said in ((config, "a training config (give it to `archlab train --config`)"),
                       ("studies/architectures.yaml", "a study (run it with `archlab study run`)")):
        code, _, stderr = cli(command, path, *(["--out", tmp_path / "run"] if command == "train" else []))
        assert code == 1 and f"error: {path} is {said}, not a model spec" in stderr and "Field required" not in stderr, stderr


@pytest.mark.parametrize("command", [["validate"], ["cost", "--seq-len", "64"], ["build"]])
def test_a_fifo_given_as_a_spec_is_refused_not_waited_on(tmp_path, command):
    """The spec's reader refused it; then the check of whether it was a study or a training config
    read it again with read_text, which waited for a writer for ever (validate, cost, build, bench),
    also for a FIFO among the specs of a folder, whose other rows never came."""
    folder = tmp_path / "zoo"
    folder.mkdir()
    shutil.copy(ROOT / SPEC, folder / "good.yaml")
    os.mkfifo(folder / "pipe.yaml")
    result = subprocess.run([sys.executable, "-m", "archlab", command[0], str(folder), *command[1:]], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    said = " ".join(result.stderr.split())
    assert result.returncode == 1 and f"{folder / 'pipe.yaml'}: <file>: is not a regular file (a FIFO, a device or a socket)" in said, said
    assert load_spec(ROOT / SPEC).name in result.stdout, result.stdout  # the good spec's row or line


def test_cost_of_runs_names_one_it_cannot_read_and_gives_the_others(cli, tmp_path):
    """One run's spec that no longer loads (its plugin gone) gave no row at all."""
    runs = tmp_path / "runs"
    for name, spec in (("a", "yoco-u"), ("b", "yoco-u"), ("c", "transformer")):
        (runs / name).mkdir(parents=True)
        (runs / name / "spec.yaml").write_text(cli("show", f"specs/tiny/{spec}.yaml")[1])
    (runs / "b" / "spec.yaml").write_text((runs / "b" / "spec.yaml").read_text().replace("type: swa", "type: causal_mean"))
    code, out, stderr = cli("cost", runs, "--seq-len", "1K", "--format", "json")
    assert code == 1 and f"error in {runs / 'b' / 'spec.yaml'}" in stderr and "unknown type 'causal_mean'" in stderr
    assert [row["spec"] for row in json.loads(out)] == [f"yoco-u ({runs / 'a'})", f"transformer ({runs / 'c'})"]
    code, out, _ = cli("cost", runs, "--seq-len", "1K", "--doc", tmp_path / "costs.md")  # a page of some would pass for all
    assert code == 1 and out == "" and not (tmp_path / "costs.md").exists()


def test_rows_of_specs_sharing_a_name_name_their_files(cli):
    code, out, _ = cli("cost", "specs/tiny/yoco-u.yaml", "specs/paper/yoco-u.yaml", "specs/tiny/yoco.yaml", "--seq-len", "1K")
    assert code in (0, None)
    assert "| yoco-u (specs/tiny/yoco-u.yaml) |" in out and "| yoco-u (specs/paper/yoco-u.yaml) |" in out and "| yoco |" in out


def readme_command_lines() -> list[list[str]]:
    """The arguments of each ``archlab`` command in the README's shell blocks (continued lines joined)."""
    readme = (ROOT / "README.md").read_text()
    lines = [line for block in re.findall(r"```bash\n(.*?)```", readme, re.S) for line in block.replace("\\\n", " ").splitlines()]
    commands = []
    for words in (shlex.split(line, comments=True) for line in lines):
        starts = [i for i, word in enumerate(words) if os.path.basename(word) == "archlab"]
        commands += [list(itertools.takewhile(lambda word: word not in ("&&", "|", ";"), words[i + 1 :])) for i in starts]
    return commands


def test_the_readmes_command_lines_are_given_as_archlab_reads_them():
    """Parsed as archlab parses its own, without running any: each one can be copied as it stands
    (``--format md|csv|json`` read as one value, which no format is)."""
    commands = readme_command_lines()
    assert len(commands) > 20 and ["cost", "specs/paper", "--seq-len", "16K", "64K", "256K", "--doc", "docs/costs.md"] in commands
    for args in commands:
        try:
            parsed(args)
        except Exception as exc:  # click's usage errors, with what was wrong
            pytest.fail(f"archlab {' '.join(args)}: {exc}")


def test_show_missing_file_is_a_clear_error(cli):
    code, _, stderr = cli("show", "specs/tiny/nope.yaml")
    assert code == 1
    assert "specs/tiny/nope.yaml" in stderr and "not found" in stderr
    assert "Traceback" not in stderr


def test_build_runs_tiny_specs(cli):
    code, out, stderr = cli("build", "specs/tiny/yoco-u.yaml", "specs/tiny/rins.yaml", "--seq-len", "1K")  # a length as cost takes it
    assert code in (0, None), stderr
    assert "self[0-1] x3" in out and "layers[0-1] x3" in out
    assert "ok" in out
    code, out, stderr = cli("build", "specs/tiny/nope.yaml")
    assert code == 1 and "not found" in stderr and out == ""  # no empty table


def readme_plugin() -> str:
    """The block plugin the README's "Writing one" shows, run as printed there."""
    readme = (ROOT / "README.md").read_text()
    return re.search(r"\*\*Writing one\.\*\*.*?```python\n(.*?)```", readme, re.S)[1]


PLUGIN = readme_plugin()


def install_plugin(root, *entries):
    """A real distribution on sys.path: dist-info metadata with entry points, and the README's module."""
    (root / "my_blocks.py").write_text(PLUGIN)
    info = root / "my_blocks-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-blocks\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[archlab.blocks]\n" + "".join(f"{entry}\n" for entry in entries))
    return {"PYTHONPATH": str(root)}


def test_block_from_another_installed_package(cli, tmp_path):
    # registered where its package re-exports it, as packages often do: found there as in its own module
    env = install_plugin(tmp_path, "causal_mean = my_exports:CausalMeanSpec")
    (tmp_path / "my_exports.py").write_text("from my_blocks import CausalMeanSpec  # noqa: F401\n")
    spec = tmp_path / "mine.yaml"
    spec.write_text(textwrap.dedent(f"""\
        extends: {ROOT / 'specs/tiny/yoco-u.yaml'}
        name: yoco-u-causal-mean
        layout:
          self_decoder:
            blocks: [causal_mean, {{type: swa, window: 8, n_heads: 4}}]
    """))
    listed, built, generated, costed = archlab_session(
        tmp_path, ["blocks"], ["build", spec, "--seq-len", "24"], ["generate", spec, "--prompt", "abc", "--max-new-tokens", "5"],
        ["cost", spec, "--seq-len", "1K", "--format", "json"], env=env)
    assert listed.returncode == 0 and "causal_mean" in listed.stdout and "my_blocks:CausalMeanSpec" in listed.stdout
    assert built.returncode == 0, built.stderr
    assert "yoco-u-causal-mean" in built.stdout and "ok" in built.stdout
    assert generated.returncode == 0, generated.stderr
    assert costed.returncode == 0, costed.stderr
    (row,) = json.loads(costed.stdout)
    assert row["kv_local_bytes"] == 3 * (4 * 64 + 2 * 8 * 4 * 16 * 4)  # T x (running sum + a ring of 8 rows x 4 heads)
    code, _, stderr = cli("validate", spec)  # this process has no such plugin
    assert code == 1 and "unknown type 'causal_mean'" in stderr

    run = tmp_path / "run"
    (trained,) = archlab_session(tmp_path, ["train", spec, "--out", run, "--data", "mqar", "--steps", "1", "--set", "seq_len=32",
                                            "--set", "batch_size=2"], env=env)
    assert trained.returncode == 0, trained.stderr
    (setting,) = yaml.safe_load((run / "environment.yaml").read_text())  # its numbers depend on the plugin's code too
    assert setting["my-blocks"] == "0.1" and list(setting)[:3] == ["from step", "archlab", "my-blocks"], setting


def test_the_readmes_plugin_package_installs_as_printed(tmp_path):
    """Its pyproject.toml, beside the module and a researcher's specs/ folder (which setuptools'
    discovery took for the package, leaving the module out), installed by pip and listed."""
    readme = (ROOT / "README.md").read_text()
    package = tmp_path / "my-blocks"
    (package / "specs").mkdir(parents=True)
    (package / "specs" / "mine.yaml").write_text("extends: yoco-u.yaml\n")
    (package / "my_blocks.py").write_text(PLUGIN)
    (package / "pyproject.toml").write_text(re.search(r"Register it in .*?```toml\n(.*?)```", readme, re.S)[1])
    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                                "--disable-pip-version-check", "--target", site, package], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    (listed,) = archlab_session(tmp_path, ["blocks"], env={"PYTHONPATH": str(site)})
    assert listed.returncode == 0 and "my_blocks:CausalMeanSpec" in listed.stdout and "notice" not in listed.stderr, listed


UNSHARED = '''
from typing import ClassVar, Literal

from blocks.attention import AttentionSpec


class UnsharedSpec(AttentionSpec):  # a K,V cache that cannot be shared across loop iterations
    type: Literal["unshared"]
    shares_kv: ClassVar[bool] = False
'''


def test_build_names_where_values_first_go_non_finite():
    """A spec whose sizes or init overflow fails ``build`` with where: the first module whose output
    holds nan or inf, or, past a finite forward pass, the parameters whose gradients do."""
    from archlab.checks import cpu_check

    model = build_model(load_spec(ROOT / SPEC))
    with torch.no_grad():
        model.layers[1].ffn.down.weight[0, 0] = float("inf")
    check = cpu_check(model, 16)
    assert not check.finite and check.problems == ["the forward pass gives nan or inf: first out of layers.1.ffn.down (Linear)"]

    model = build_model(load_spec(ROOT / SPEC))
    model.layers[2].mixer.o_proj.weight.register_hook(lambda grad: grad * float("nan"))
    check = cpu_check(model, 16)
    assert not check.finite and check.problems == ["the forward pass is finite, the gradients of 1 parameter(s) are not:"
                                                   " layers.2.mixer.o_proj.weight"]


def test_build_checks_decoding_over_24_tokens_at_least_whatever_the_seq_len():
    """``build --seq-len 4``: the forward pass takes 4 tokens, decoding still three sequences of 24
    (prompts of 12, 12 and 9). Over 4 alone its prompts would be 2, 2 and -1 tokens, and a sound spec
    would fail, its decoding said to differ by 0.8 of the largest logit."""
    from archlab.checks import cpu_check

    model = build_model(load_spec(ROOT / SPEC))
    check = cpu_check(model, 4)
    assert check.finite and check.problems == []


MISTAKES = {  # the README's plugin with one mistake made in it: what is changed, what build says, the inference dtype
    "params": (("return ctx.d_model ** 2", "return ctx.d_model ** 2 + 2"), "params() sum to 209,540, the built model holds 209,536",
               "float32"),
    "state bytes": (("return max(4, kv_bytes) * ctx.d_model  #", "return 7  #"), "state_bytes() give", "float32"),
    "state bytes in the inference dtype": (("dtype=float32_or_wider(dtype))", "dtype=dtype)"),
                                           "at 1 token in bfloat16, the cache holds", "bfloat16"),  # 4 bytes counted, 2 held
    "state ignored": (("if inp.state is not None:", "if False:"), "decoding prompts of different lengths token by token differs",
                      "float32"),
    "one row's positions": (("(inp.positions + 1)", "(inp.positions[:1] + 1)"),
                            "(blocks: causal_mean, cross_attention; does each module's", "float32"),
    "state not batch-first": (("zeros(batch, self.proj.in_features,", "zeros(self.proj.in_features, batch,"),
                              "block 'causal_mean': new_state(1, ...) must give a dict of tensors ({} for none) with a first dimension"
                              " of 1", "float32"),
    "no state dict": (("return {\"sum\": torch.zeros(batch, self.proj.in_features, dtype=float32_or_wider(dtype))}", "return None"),
                      "block 'causal_mean': new_state(1, ...) must give a dict of tensors ({} for none) with a first dimension of 1,"
                      " a row per sequence and stream; got NoneType", "float32"),
    "state bytes raise": (("return max(4, kv_bytes) * ctx.d_model  #", "assert False  #"),
                          "block 'causal_mean' (causal_mean:CausalMeanSpec): its state_bytes() raised AssertionError()",
                          "float32"),
    "state of one row": (("sums[:, -1])", "sums[-1])"), "decoding prompts of different lengths raised RuntimeError",
                         "float32"),  # fine at batch 1
    "one row's state in a chunk": (('sums + inp.state["sum"][:, None]', 'sums + inp.state["sum"][: 1 if x.shape[1] > 1 else None, None]'),
                                   "decoding prompts of different lengths token by token differs", "float32"),  # in chunks only
    "flops not Flops": (("return Flops(matmul=2 * n * ctx.d_model ** 2)", "return 2 * n * ctx.d_model ** 2"),
                        "block 'causal_mean' (causal_mean:CausalMeanSpec): its flops() returned 139264, where a Flops (a Counter)"
                        " of kinds", "float32"),
    "output of another shape": ((".to(x.dtype))\n", ".to(x.dtype))[..., 1:]\n"),
                                "block 'causal_mean' (causal_mean:CausalMeanSpec): its forward returned [2, 64, 63] for an x of"
                                " [2, 64, 64]", "float32"),  # a traceback from the residual add after it
}


def test_build_checks_a_plugins_formulas_and_decoding(tmp_path):
    """Each mistake above made in the README's plugin (which passes as printed: the test after) is
    found by build, and named. The mistakes are blocks of their own, ``causal_mean_0`` and on, each
    in its module and spec, built in one process: a process costs seconds to start."""
    entries, specs, wanted = [], [], {}
    for index, (mistake, said, dtype) in enumerate(MISTAKES.values()):
        block = f"causal_mean_{index}"
        assert mistake[0] in PLUGIN
        (tmp_path / f"{block}.py").write_text(PLUGIN.replace(*mistake).replace('"causal_mean"', f'"{block}"'))
        entries.append(f"{block} = {block}:CausalMeanSpec")
        (tmp_path / block).mkdir()
        specs.append(mine(tmp_path / block, dtype, block))
        wanted[f"mine-{index}"] = said.replace("causal_mean", block)
    result = archlab("build", *specs, env=install_plugin(tmp_path, *entries))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    errors = ("\n" + result.stderr).split("\nerror: ")
    for (name, said), mistake in zip(wanted.items(), MISTAKES, strict=True):
        found = [error for error in errors if error.startswith(f"{name}: ")]
        assert len(found) == 1 and said in found[0], (mistake, found, result.stderr)
        assert any(f" {name} " in row and "1 problem(s)" in row for row in result.stdout.splitlines()), (mistake, result.stdout)


def mine(folder, dtype, block="causal_mean"):
    """A YOCO of the README's block (or another of that name), inferring in ``dtype``, named after the block."""
    spec = folder / "mine.yaml"
    name = "mine" + block.removeprefix("causal_mean").replace("_", "-")
    spec.write_text(f"extends: {ROOT / 'specs/tiny/yoco.yaml'}\nname: {name}\nlayout: {{self_decoder: {{blocks: [{block}]}}}}\n"
                    f"inference_dtype: {dtype}\n")
    return spec


def test_build_passes_the_plugin_the_mistakes_above_are_made_in(tmp_path):
    """In each inference dtype the mistakes above are checked in: each fails on its mistake alone."""
    env = install_plugin(tmp_path, "causal_mean = my_blocks:CausalMeanSpec")
    specs = []
    for dtype in ("float32", "bfloat16"):
        (tmp_path / dtype).mkdir()
        specs.append(mine(tmp_path / dtype, dtype))
    result = archlab("build", *specs, env=env)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert result.stdout.count(" ok") == 2 and "problem(s)" not in result.stdout, result.stdout


def test_the_plugins_state_keeps_a_float64_model_exact():
    """As the README advises its reader: a float64 model's running sum is not rounded to float32,
    in the full forward pass or decoding token by token (it was, by about 5e-8)."""
    from archlab.block import MixerInput

    namespace: dict = {}
    exec(PLUGIN, namespace)
    mean = namespace["CausalMean"](16).double()
    x = torch.randn(3, 12, 16, dtype=torch.float64)
    with torch.no_grad():
        exact = mean.proj(x.cumsum(1) / torch.arange(1, 13, dtype=torch.float64)[:, None])
        full = mean(x, MixerInput(torch.arange(12)[None]))
        state = mean.new_state(3, 12, torch.float64)
        stepped = torch.cat([mean(x[:, [i]], MixerInput(torch.full((3, 1), i), state)) for i in range(12)], dim=1)
    torch.testing.assert_close(full, exact, rtol=0, atol=1e-12)
    torch.testing.assert_close(stepped, exact, rtol=0, atol=1e-12)


REUSING = '''
from typing import Literal

from blocks.attention import AttentionSpec


class ReusingSpec(AttentionSpec):  # its count of an iteration that reuses the K,V is no Flops
    type: Literal["reusing"]

    def flops(self, ctx, n, start=0, reuse_kv=False):
        return 0 if reuse_kv else super().flops(ctx, n, start, reuse_kv)
'''


def in_a_shared_loop(tmp_path, name, source, spec_class):
    """The plugin block ``name`` installed, and a Universal Transformer of it whose loop shares one K,V."""
    env = install_plugin(tmp_path, f"{name} = {name}:{spec_class}")
    (tmp_path / f"{name}.py").write_text(source)
    spec = tmp_path / "s.yaml"
    spec.write_text(f"extends: {ROOT / 'specs/tiny/universal-transformer.yaml'}\nname: u\n"
                    f"layout: {{layers: {{blocks: [{{type: {name}, n_heads: 4}}]}}}}\nloop: {{kv_cache: shared}}\n")
    return env, spec


def test_build_checks_the_flops_of_an_iteration_that_reuses_the_kv(tmp_path):
    """Cost asks for it in a loop with a shared K,V, and failed there with a traceback."""
    env, spec = in_a_shared_loop(tmp_path, "reusing", REUSING, "ReusingSpec")
    result = archlab("build", spec, env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert ("error: u: block 'reusing' (reusing:ReusingSpec): its flops() returned 0, where a Flops (a Counter) of kinds"
            in result.stderr and "(at n=17, start=0, reuse_kv=True)" in result.stderr), result.stderr


def test_a_shared_loop_cache_is_refused_for_a_plugin_that_cannot_share_it(tmp_path):
    env, spec = in_a_shared_loop(tmp_path, "unshared", UNSHARED, "UnsharedSpec")
    per_iteration = tmp_path / "per-iteration.yaml"
    per_iteration.write_text(spec.read_text().replace("shared}", "per_iteration}"))
    result, other = archlab_session(tmp_path, ["validate", spec], ["validate", per_iteration], env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "loop.kv_cache: 'shared' is not possible: unshared cannot share a K,V cache across iterations" in result.stderr
    assert other.returncode == 0, other.stderr


BROKEN = '''
from typing import Literal

from torch import nn

from archlab import BlockSpec
from archlab.block import Flops


class HalfSpec(BlockSpec):  # a spec class without its cost formulas
    type: Literal["half"]

    def build(self, ctx):
        return nn.Identity()


class StatelessSpec(HalfSpec):  # its formulas, but a module without an inference state
    type: Literal["stateless"]

    def params(self, ctx):
        return 0

    def flops(self, ctx, n, start=0, reuse_kv=False):
        return Flops()

    def state_bytes(self, ctx, context, kv_bytes):
        return 0


class Forwardless(nn.Module):
    def new_state(self, batch, capacity, dtype):
        return {}


class ForwardlessSpec(StatelessSpec):  # a module with an inference state but no forward
    type: Literal["forwardless"]

    def build(self, ctx):
        return Forwardless()


class PairSpec(StatelessSpec):  # one class for two block types: a spec's type names one block, and an entry point one class
    type: Literal["pair", "couple"]
'''


BROKEN_PLUGINS = {  # an entry point that cannot be used: what its notice says, and the block type a spec would use it by
    "misnamed": ("mean = my_blocks:CausalMeanSpec", ["block plugin 'mean'", "Literal['mean']", "it is left out"], "mean"),
    "taken name": ("attention = my_blocks:CausalMeanSpec", ["block type 'attention' is registered more than once",
                                                            "blocks.attention:AttentionSpec", "my_blocks:CausalMeanSpec",
                                                            "archlab's own blocks.attention:AttentionSpec is kept"], None),
    "abstract": ("half = broken:HalfSpec", ["block plugin 'half'", "does not define flops, params, state_bytes", "it is left out"], "half"),
    "exits": ("quits = quits:Spec", ["block plugin 'quits'", "failed to import: SystemExit: 3", "it is left out"], "quits"),
    "two types": ("pair = broken:PairSpec", ["block plugin 'pair'", "must declare type: Literal['pair'], has ('pair', 'couple')",
                                              "it is left out"], "pair"),
}


def test_broken_plugins_are_named_and_left_out(tmp_path):
    """Every command still works for specs that use none of them; one that does is told its block
    is unknown, under the notices saying why. They are installed together, each said in a notice
    of its own."""
    env = install_plugin(tmp_path, *(entry for entry, _, _ in BROKEN_PLUGINS.values()))
    (tmp_path / "broken.py").write_text(BROKEN)
    (tmp_path / "quits.py").write_text("raise SystemExit(3)\n")
    result = archlab("validate", "specs/tiny/yoco.yaml", env=env)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    notices = [" ".join(notice.split()) for notice in ("\n" + result.stderr).split("\nnotice: ")[1:]]
    assert len(notices) == len(BROKEN_PLUGINS), result.stderr
    for case, (_, fragments, _) in BROKEN_PLUGINS.items():
        assert [notice for notice in notices if notice.startswith(fragments[0]) and all(f in notice for f in fragments)], (case, notices)

    specs = []
    for name in (name for _, _, name in BROKEN_PLUGINS.values() if name):
        specs.append(tmp_path / f"{name}.yaml")
        specs[-1].write_text(f"extends: {ROOT / 'specs/tiny/yoco.yaml'}\nname: {name}\nlayout: {{self_decoder: {{blocks: [{name}]}}}}\n")
    used = archlab("validate", *specs, env=env)
    assert used.returncode == 1 and "Traceback" not in used.stderr and "it is left out" in used.stderr, used.stderr
    for spec in specs:
        assert f"unknown type '{spec.stem}'" in used.stderr.split(str(spec), 1)[1].split("\nerror", 1)[0], (spec, used.stderr)


def test_a_plugin_module_without_what_the_model_calls_is_refused_when_built(tmp_path):
    lacking = {"stateless": "Identity, which has no new_state method", "forwardless": "Forwardless, which has no forward method"}
    env = install_plugin(tmp_path, *(f"{name} = broken:{name.capitalize()}Spec" for name in lacking))
    (tmp_path / "broken.py").write_text(BROKEN)
    commands = []
    for name in lacking:
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(f"extends: {ROOT / 'specs/tiny/yoco.yaml'}\nname: {name}\nlayout: {{self_decoder: {{blocks: [{name}]}}}}\n")
        commands += [["validate", spec], ["build", spec, ROOT / SPEC], ["generate", spec, "--prompt", "a", "--max-new-tokens", "2"]]
    results = archlab_session(tmp_path, *commands, env=env)
    for (name, lacks), (validated, built, generated) in zip(lacking.items(), (results[:3], results[3:]), strict=True):
        assert validated.returncode == 0, validated.stderr  # a spec as good as any
        said = f"block '{name}' (broken:{name.capitalize()}Spec): its build() returned {lacks}"
        assert built.returncode == 1 and f"error: {name}: {said}" in built.stderr and "Traceback" not in built.stderr, built.stderr
        assert " not built" in built.stdout and " transformer " in built.stdout and " ok " in built.stdout  # the others still checked
        assert generated.returncode == 2 and f"error: {said}" in generated.stderr and "Traceback" not in generated.stderr


def test_streamed_text_holds_back_only_what_a_later_token_may_change():
    """Bytes that never decode (as random weights give) read as replacement characters that are
    final: they were held back with the partial one after them, and a long run of them streamed
    nothing until the end. What is shown is always the start of the final text."""
    from archlab.cli import _settled

    generated = b"ab" + b"\xff" * 40 + "\u4f60".encode() + b"c<|e" + b"\xfe" + "\U0001f600".encode() + b"<|end|>"
    final = generated.decode("utf-8", "replace")
    shown = [_settled(generated[:n].decode("utf-8", "replace"), ("<|end|>",)) for n in range(len(generated) + 1)]
    assert all(final.startswith(part) for part in shown)
    assert shown[2 + 40] == "ab" + "\ufffd" * 39  # each invalid byte shown once the next comes
    assert shown[2 + 40 + 1] == shown[2 + 40 + 2] == "ab" + "\ufffd" * 40  # one and two of the character's three bytes: held back
    assert shown[2 + 40 + 3 + 4] == shown[2 + 40 + 3 + 1] == final[: 2 + 40 + 2]  # "<|e" may begin the stop text
    assert shown[-1] == final.removesuffix("<|end|>")


def test_a_reply_that_so_far_is_only_the_start_of_a_stop_text_shows_nothing_yet():
    """Text shorter than a stop text, all of it that text's beginning, may yet become the stop
    text (a reply whose first tokens are "<|"): none of it is shown until a later token settles it."""
    from archlab.cli import _settled

    assert _settled("<|e", ("<|end|>",)) == "" and _settled("<", ("<|end|>",)) == ""
    assert _settled("x<|e", ("<|end|>",)) == "x" and _settled("<x", ("<|end|>",)) == "<x"


def test_generate_streams_text_with_a_notice(cli):
    texts, shown = [], warnings.showwarning
    # a stop token that never comes changes nothing either
    for paging in ([], ["--page-size", "4"], ["--page-size", "4", "--page-kernel", "flex"], ["--stop", "\x01"]):
        code, out, stderr = cli("generate", "specs/tiny/yoco-u.yaml", "--prompt", "Hello", "--max-new-tokens", "12", "--seed", "1",
                                "--temperature", "0.8", "--top-k", "20", *paging)
        assert code in (0, None), stderr
        assert out.startswith("Hello") and len(out.encode()) > len("Hello")
        assert "random weights" in stderr
        assert "12 tokens" in stderr and "B global" in stderr
        assert ("(global: its whole pool of pages)" in stderr) == ("--page-size" in paging), stderr  # read as more than rows hold
        texts.append(out)
    assert texts[0] == texts[1] == texts[2] == texts[3]  # the seed fixes the random weights too; pages change nothing
    assert warnings.showwarning is shown  # the notices' form was the command's alone, not its caller's after it


def test_generate_stops_at_the_first_stop_text_to_come(cli, monkeypatch):
    """``--stop`` takes any text: generation stops once the first of them is written, wherever it
    falls among the tokens, and what may begin one is held back until it is known not to. The
    tokens are scripted (a bare spec's are bytes)."""
    script, taken = "x = [1 <| 2]\n\ndef f():\n    pass\n", []

    def scripted(engine, prompts, max_new_tokens, sampling, cache=None, held=0):
        for token in script.encode()[:max_new_tokens]:
            taken.append(token)
            yield torch.tensor([token]), None, torch.tensor([False])

    monkeypatch.setattr(Engine, "stream", scripted)
    for stops, shown in ((["\ndef", "<|end|>", "\n\n"], "x = [1 <| 2]\n\n"), (["pass"], "x = [1 <| 2]\n\ndef f():\n    pass"), (["z"], script)):
        taken.clear()
        code, stdout, stderr = cli("generate", "specs/tiny/yoco.yaml", "--prompt", "Hi", *(a for stop in stops for a in ("--stop", stop)))
        assert code in (0, None), stderr
        assert stdout == f"Hi{shown}\n" and len(taken) == len(shown) and f"{len(shown)} tokens in" in stderr, (stops, stdout)


def test_of_stop_texts_that_one_token_completes_the_first_to_begin_stops(capsys):
    """A token of many characters may complete two stop texts at once: the one that begins first
    is where generation stops (as its text, up to there, is what came first)."""
    from archlab.cli import _written
    from archlab.engine import Sampling

    class Words:  # a tokenizer of whole words
        def decode(self, ids):
            return "".join(["x = ", "abc", "d"][i] for i in ids)

    class Scripted:
        page_size, prefill_chunk, device = None, 2048, torch.device("cpu")

        def cache_for(self, lengths, new_tokens):
            return Cache(tiny_model("transformer")[1], 1, 4, torch.float32)

        def stream(self, prompts, max_new_tokens, sampling, cache, held):
            yield from ((torch.tensor([token]), None, None) for token in (0, 1, 2))

    written = _written(Scripted(), [0], 3, Sampling(), Words(), until=("bc", "a"))
    assert (written.text, written.stop, written.tokens, capsys.readouterr().out) == ("x = ", "a", 2, "x = ")


def test_a_stop_text_holding_a_replacement_character_is_not_met_by_a_character_still_being_decoded(capsys):
    """Bytes of a character not yet whole decode, for now, to U+FFFD: a stop text holding one is
    met only where the character stays one (bytes that never make a character), not by the first
    byte of an é; where generation ends on such bytes, they are final, and meet it there."""
    from archlab.cli import _written
    from archlab.engine import Sampling

    class Bytes:
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    class Scripted:
        page_size, prefill_chunk, device = None, 2048, torch.device("cpu")

        def __init__(self, tokens):
            self.tokens = tokens

        def cache_for(self, lengths, new_tokens):
            return Cache(tiny_model("transformer")[1], 1, 4, torch.float32)

        def stream(self, prompts, max_new_tokens, sampling, cache, held):
            yield from ((torch.tensor([token]), None, None) for token in self.tokens)

    for generated, until, expected in [(b"a\xc3\xa9b", ("\ufffd",), ("a\u00e9b", None, 4)),  # an é, whole two bytes later
                                       (b"a\xffb", ("\ufffd",), ("a", "\ufffd", 3)),  # a byte no character begins with
                                       (b"a\xc3", ("\ufffd",), ("a", "\ufffd", 2)),  # the last bytes, never completed
                                       (b"a\xc3\xa9;", ("\ufffd;", "\u00e9;"), ("a", "\u00e9;", 4))]:
        written = _written(Scripted(list(generated)), [0], len(generated), Sampling(), Bytes(), until=until)
        assert (written.text, written.stop, written.tokens) == expected, generated
        assert capsys.readouterr().out == expected[0]


def test_bench_json_and_plot(cli, tmp_path):
    png = tmp_path / "bench.png"
    code, out, stderr = cli("bench", "specs/tiny/yoco.yaml", "specs/tiny/yoco-u.yaml", "--seq-len", "256", "1K",
                            "--gen", "4", "--format", "json", "--plot", png)
    assert code in (0, None), stderr
    rows = json.loads(out)
    assert [(r["spec"], r["seq_len"]) for r in rows] == [("yoco", 256), ("yoco", 1024), ("yoco-u", 256), ("yoco-u", 1024)]
    by = {(r["spec"], r["seq_len"]): r for r in rows}
    for n in (256, 1024):
        assert by["yoco", n]["kv_global_mb"] == by["yoco-u", n]["kv_global_mb"]
        assert by["yoco-u", n]["kv_local_mb"] == 3 * by["yoco", n]["kv_local_mb"]
        assert by["yoco", n]["prefill_tok_s"] > 0 and by["yoco", n]["decode_tok_s"] > 0
    assert by["yoco", 1024]["kv_global_mb"] == (1024 + 1 + 4) * 2 * 2 * 16 * 4 / 2**20  # prompt, warm-up step, new tokens
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_prefills_a_few_rows_for_a_large_batch(cli):
    rows = {}
    for paging in ([], ["--page-size", "64"]):
        code, out, stderr = cli("bench", "specs/tiny/yoco-u.yaml", "--seq-len", "300", "--batch", "4", "--prefill-rows", "2",
                                "--gen", "3", "--format", "json", *paging)
        assert code in (0, None), stderr
        (row,) = json.loads(out)
        assert (row["batch"], row["prefill_rows"]) == (4, 2) and row["decode_tok_s"] > 0
        rows[row["page_size"]] = row
    # 304 positions a sequence: 5 pages of 64 each, and the pool's one spare page
    assert rows[64]["kv_global_mb"] == (4 * 5 + 1) * 64 * 2 * 2 * 16 * 4 / 4 / 2**20
    assert rows[None]["kv_global_mb"] == 304 * 2 * 2 * 16 * 4 / 2**20
    for bad, message in ((["--prefill-rows", "3"], "must divide --batch 4"), (["--cuda-graph"], "--cuda-graph needs --device cuda")):
        code, _, stderr = cli("bench", "specs/tiny/yoco-u.yaml", "--batch", "4", *bad)
        assert code == 2 and message in stderr and "Traceback" not in stderr


def test_a_length_is_labelled_as_the_command_line_writes_it_and_g_is_a_billion():
    """A report's column names its length in the largest unit that divides it (1M, not 1024K), and
    reads back as the same count; a budget's G is B."""
    labels = {2048: "2K", 16384: "16K", 1536: "1536", 2**20: "1M", 3 * 2**20: "3M", 2**20 + 1024: "1025K"}
    assert {n: tokens_label(n) for n in labels} == labels
    assert all(parse_length(label) == n for n, label in labels.items())
    assert parse_budget("2G") == parse_budget("2B") == 2 * 10**9


def test_a_budgets_k_is_a_thousand_tokens_and_one_token_is_a_budget():
    """--tokens counts in powers of ten throughout, K included (2K is 2,000 tokens, where a length's
    2K is 2,048): a study's budgets of 500K or 2K tokens must buy the steps their numbers say. The
    smallest budget is one token, which still trains a step."""
    assert [parse_budget(text) for text in ("2K", "500k", "1.5K", "1")] == [2000, 500_000, 1500, 1]


def test_bench_rejects_a_bad_length(cli):
    code, _, stderr = cli("bench", "specs/tiny/yoco.yaml", "--seq-len", "lots")
    assert code not in (0, None)
    assert "not a token count" in stderr and "Traceback" not in stderr


def test_lengths_count_in_powers_of_two_and_budgets_in_powers_of_ten():
    assert [parse_length(text) for text in ("2048", "16K", "256k", "1M", "1024M")] == [2048, 16384, 262144, 1048576, 2**30]
    for bad in ("", "0", "1.5K", "²", "٣٢", "-2K"):  # digits Python's int() refuses, or reads, beyond ASCII's
        with pytest.raises(ValueError, match="is not a token count"):
            parse_length(bad)
    assert [parse_budget(text) for text in ("2048", "50M", "1.5B", "300b", "2T", "1e9")] == [2048, 5 * 10**7, 15 * 10**8, 3 * 10**11, 2 * 10**12, 10**9]
    for bad in ("", "lots", "1.5", "0.0004K", "0", "-2M", "nanM", "infB", "50Mi"):
        with pytest.raises(ValueError, match="is not a whole number of tokens"):
            parse_budget(bad)


def expand(args, **paths):
    return [str(a).format(**paths) for a in args]


# (name, command, exit code, what stderr must say); {dir}: an empty folder, {file}: a file, {run}: a new run
# folder, {text}: a text corpus
BAD_PATHS = [
    ("train --out a file", ["train", SPEC, "--out", "{file}", "--steps", "1"], 1, "--out {file} is a file; a run is a folder"),
    ("study --out a file", ["study", "run", "loop-position", "--out", "{file}"], 2, "Invalid value for '--out': dir '{file}' is a file"),
    ("train --out a link to nowhere", ["train", SPEC, "--out", "{nowhere}", "--steps", "1"], 1, "{nowhere}: a link to {gone}, which is not there"),
    ("study --out a link to nowhere", ["study", "run", "loop-position", "--out", "{nowhere}"], 1, "{nowhere}: a link to {gone}, which is not there"),
    ("study --out a device", ["study", "run", "loop-position", "--out", "/dev/null"], 1, "error: /dev/null: not a folder"),  # "File exists"
    ("train --out under a file", ["train", SPEC, "--out", "{file}/run", "--steps", "1"], 1, "error: {file}/run: Not a directory"),
    ("train data.cache unwritable", ["train", SPEC, "--out", "{run}", "--steps", "1", "--data", "{text}", "--set", "data.cache=/proc/archlab"], 1,
     "error: /proc/archlab: No such file or directory"),
    ("cost --doc in no folder", ["cost", SPEC, "--doc", "{dir}/absent/cost.md"], 2, "--doc {dir}/absent/cost.md: no folder {dir}/absent"),  # as --plot
    ("cost --doc a folder", ["cost", SPEC, "--doc", "{dir}"], 2, "--doc {dir} is a folder; give a file in it, such as {dir}/page.md"),  # said after the costs
    ("cost --doc the current folder", ["cost", SPEC, "--doc", "."], 2, "--doc . is a folder"),  # a ValueError's traceback
    ("cost --doc the folder above", ["cost", SPEC, "--doc", "{dir}/.."], 2, "--doc {dir}/.. is a folder"),
    ("cost --doc not md", ["cost", SPEC, "--doc", "{file}"], 2, "--doc {file}: the cost page is a .md file; give a file name ending in .md"),  # a run's config.yaml was overwritten
    ("cost --doc as csv", ["cost", SPEC, "--doc", "{dir}/cost.md", "--format", "csv"], 2,
     "--doc writes a markdown page; --format csv goes with a table on stdout"),
    ("bench --plot in no folder", ["bench", SPEC, "--plot", "{dir}/absent/bench.png"], 2, "--plot {dir}/absent/bench.png: no folder {dir}/absent"),
    ("bench --plot not png", ["bench", SPEC, "--plot", "{dir}/bench.txt"], 2, "the plot is a .png file; give a file name ending in .png"),
    ("bench --plot over another file", ["bench", SPEC, "--plot", "{png}"], 2,
     "--plot {png} holds another file than a plot archlab wrote; give a new file, or remove it first"),  # replaced by the plot
    ("bench --plot a folder", ["bench", SPEC, "--plot", "{dir}"], 2, "--plot {dir} is a folder"),
    ("bench --plot under a file", ["bench", SPEC, "--plot", "{file}/bench.png"], 2, "--plot {file}/bench.png: {file} is not a folder"),  # "no folder"
    ("bench --plot where no file is made", ["bench", SPEC, "--plot", "/proc/bench.png"], 2,
     "--plot /proc/bench.png: no file can be written in /proc"),  # said after the benchmark had run
    ("cost an empty folder", ["cost", "{dir}"], 1, "error: no spec files found in {dir}"),
    ("bench an empty folder", ["bench", "{dir}"], 1, "error: no spec files found in {dir}"),
    ("show a folder", ["show", "{dir}"], 1, "<file>: is a folder, not a YAML file"),
    ("train --config a folder", ["train", SPEC, "--out", "{run}", "--config", "{dir}"], 1, "<file>: is a folder, not a YAML file"),
]


def test_cost_doc_writes_over_a_cost_page_alone(cli, tmp_path):
    """Given a copy of the README, it replaced it with an 11-line cost page."""
    notes = tmp_path / "notes.md"
    notes.write_text("# Notes\n\nkept\n")
    code, _, stderr = cli("cost", SPEC, "--seq-len", "1K", "--doc", notes)
    assert code == 2 and f"--doc {notes} holds another file than a cost page archlab wrote" in " ".join(stderr.split()), stderr
    assert notes.read_text() == "# Notes\n\nkept\n"
    page = tmp_path / "costs.md"
    for lengths in (["1K"], ["2K"]):  # written, then written over
        assert cli("cost", SPEC, "--seq-len", *lengths, "--doc", page)[0] in (0, None)
    assert "| 2,048 |" in page.read_text() and "| 1,024 |" not in page.read_text()
    page.write_bytes(page.read_bytes().replace(b"\n", b"\r\n"))  # checked out with CRLF line ends: still a cost page
    assert cli("cost", SPEC, "--seq-len", "1K", "--doc", page)[0] in (0, None)


def test_a_cost_page_the_disk_cannot_hold_leaves_the_page_that_was_there(cli, tmp_path):
    """Written in place, a disk that filled midway left the first blocks of the new page where the
    whole last one had been: a file size limit below the page's size stands for the full disk."""
    page = tmp_path / "costs.md"
    assert cli("cost", SPEC, "--seq-len", "1K", "--doc", page)[0] in (0, None)
    before = page.read_text()
    with files_no_bigger_than(200):
        code, _, stderr = cli("cost", SPEC, "--seq-len", "2K", "--doc", page)
    assert code == 1 and f"{page}: File too large" in stderr and "Traceback" not in stderr, stderr
    assert page.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["costs.md"]


@pytest.mark.parametrize("args,code,message", [c[1:] for c in BAD_PATHS], ids=[c[0] for c in BAD_PATHS])
def test_a_path_that_cannot_be_used_is_named(cli, tmp_path, args, code, message):
    paths = {"dir": tmp_path / "empty", "file": tmp_path / "file", "run": tmp_path / "run", "text": tmp_path / "corpus.txt",
             "nowhere": tmp_path / "nowhere", "gone": tmp_path / "gone", "png": tmp_path / "notes.png"}
    paths["dir"].mkdir()
    paths["nowhere"].symlink_to(paths["gone"])
    paths["file"].write_text("kept\n")
    paths["png"].write_text("kept\n")
    paths["text"].write_text("a small corpus\n" * 100)
    code_, _, stderr = cli(*expand(args, **paths))
    assert code_ == code and message.format(**paths) in stderr, stderr
    assert paths["file"].read_text() == paths["png"].read_text() == "kept\n" and not any(paths["dir"].iterdir())  # nothing there was touched


# (the commands run in turn, each with what it must print); {spec}: a spec named x[/] in a folder br[/]x, {run}: a run
# folder under exp [v2]/br[/]x
MARKUP_LIKE = {
    "validate": [(["validate", "{spec}"], "ok    {spec}  (x[/])")],
    "build": [(["build", "{spec}"], " x[/] ")],
    "generate": [(["generate", "{spec}", "--max-new-tokens", "2"], "notice: x[/] has random weights")],
    "train": [(["train", "{spec}", "--out", "{run}", "--steps", "1", "--set", "data.source=mqar", "--set", "seq_len=64", "--set", "batch_size=4",
                "--set", "micro_batch_size=4", "--set", "eval_batches=1"], "done: 1 step; checkpoints and metrics.jsonl in {run}"),
              (["train", "{spec}", "--out", "{run}", "--resume", "--steps", "2"], "resuming from {run}/checkpoints/step-00000001 (step 1)"),
              (["generate", "{run}", "--max-new-tokens", "2"], "weights from {run}/checkpoints/step-00000002; byte tokens")],
}


@pytest.mark.parametrize("command", MARKUP_LIKE)
def test_paths_and_names_that_look_like_markup_are_printed_as_they_are(cli, tmp_path, command):
    """The console reads [...] as markup: a [/] in a path or a spec's name stopped the command with a
    traceback (a training, once it had saved), and [v2] dropped out of the path it named."""
    paths = {"spec": tmp_path / "br[/]x" / "yoco.yaml", "run": tmp_path / "exp [v2]" / "br[/]x" / "run"}
    paths["spec"].parent.mkdir(parents=True)
    paths["spec"].write_text(f"extends: {ROOT / 'specs/tiny/yoco.yaml'}\nname: \"x[/]\"\n")
    for args, said in MARKUP_LIKE[command]:
        code, out, stderr = cli(*expand(args, **paths))
        assert code == 0 and "Traceback" not in out + stderr and said.format(**paths) in out + stderr, out + stderr


def test_an_error_naming_a_path_that_looks_like_markup_prints_it_as_written(cli, tmp_path):
    """An error is read to find the file at fault: a folder named ``[bold]x`` must be named as it is,
    not as ``x`` with its brackets taken for a style."""
    missing = tmp_path / "[bold]x" / "nothere"
    code, _, stderr = cli("train", SPEC, "--out", tmp_path / "run", "--data", missing)
    assert code == 1 and f"error: data source '{missing}': no such file or folder" in stderr, stderr


def test_messages_on_a_colour_terminal_colour_only_their_label(monkeypatch):
    """On a terminal, an error or notice is coloured in its label alone, and a line of progress not
    at all: the console's highlighter would colour the numbers, paths and quoted names inside them
    as though they were of note, and the text people read must stay as plain as in a log file."""
    import io

    from rich.console import Console

    import archlab.cli as cli_module

    screen = io.StringIO()
    monkeypatch.setattr(cli_module, "err", Console(file=screen, force_terminal=True, color_system="truecolor", width=500))
    said = "data source '/tmp/runs/12': 3 files, 1.5e3 tokens"
    for show in (cli_module._error, cli_module._notice, cli_module._say):
        screen.seek(0), screen.truncate()
        show(said)
        assert screen.getvalue().endswith(f"{said}\n") and "\x1b" not in screen.getvalue().split(": ", 1)[-1], repr(screen.getvalue())
    assert "\x1b" not in screen.getvalue()  # progress: no colour at all


# (command, what stderr must say): options out of bounds are refused before any work (exit 2)
BAD_OPTIONS = [
    (["build", SPEC, "--seq-len", "0"], "'0' is not a token count"),
    (["generate", SPEC, "--top-p", "0"], "Invalid value for '--top-p': top_p must be a number in (0, 1], got 0.0"),
    (["chat", SPEC, "--top-p", "1.5"], "Invalid value for '--top-p': top_p must be a number in (0, 1], got 1.5"),
    (["generate", SPEC, "--temperature", "nan"], "Invalid value for '--temperature': temperature must be a finite number >= 0, got nan"),  # as inf is; typer's bound said ">= 0"
    (["generate", SPEC, "--seed", str(2**70)], "Invalid value for '--seed'"),
    (["generate", SPEC, "--prompt", b"ab\xffcd".decode("utf-8", "surrogateescape")], "--prompt b'ab\\xffcd' is not UTF-8 text"),
    (["generate", SPEC, "--stop", b"\xff".decode("utf-8", "surrogateescape")], "--stop b'\\xff' is not UTF-8 text"),
    (["generate", SPEC, "--dtype", "float64"], "'float64' is not one of 'auto', 'float32', 'bfloat16', 'float16'"),
    (["train", SPEC, "--out", "{tmp}/run", "--flops", "inf"], "--flops must be a finite number, got inf"),
    (["train", SPEC, "--out", "{tmp}/run", "--flops", "1e300"], "--flops 1e+300 buys 3.31e+290 steps"),
    (["train", SPEC, "--out", "{tmp}/run", "--tokens", "999999T"], "more than the 1e+12 a run may take; check its units"),
    (["train", SPEC, "--out", "{tmp}/run", "--tokens", "1e400"], "--tokens 1e400 buys 4.88e+396 steps"),  # past any float
    (["train", SPEC, "--out", "{tmp}/run", "--steps", "2000000000000"], "Invalid value for '--steps'"),
    (["cost", SPEC, "--seq-len", "8", "1"], "--seq-len 1: training costs need sequences of 2 tokens or more"),
    (["equal-flops", SPEC, SPEC, "--seq-len", "1"], "--seq-len 1: training costs need sequences of 2 tokens or more"),
    (["cost", SPEC, "--seq-len", "1" + "0" * 20], f"1{'0' * 20} tokens is longer than the 1,073,741,824 (2^30) a context may be"),  # costed as 62.3Y FLOPs
    (["equal-flops", SPEC, SPEC, "--seq-len", "1025M"], "1025M tokens is longer than the 1,073,741,824 (2^30) a context may be"),
    (["bench", SPEC, "--seq-len", "--gen", "2"], "--seq-len takes a length (e.g. 2048, 16K), and was followed by --gen"),  # '--gen' is not a token count
    (["train", SPEC, "--out", "{tmp}/run", "--data", ""], "--data is empty; give stdlib, a path"),
    (["bench", SPEC, "--page-kernel", "flex"], "--page-kernel flex reads a paged global K,V; give --page-size too"),
    (["generate", SPEC, "--page-kernel", "flex"], "--page-kernel flex reads a paged global K,V; give --page-size too"),
    (["bench", SPEC, "--device", "bogus"], "--device 'bogus' is not a device; give cpu, cuda or cuda:N"),
    (["bench", SPEC, "--device", "meta"], "--device meta: archlab runs on cpu or cuda"),
    (["bench", SPEC, "--device", "cuda:99"], "--device cuda:99: "),  # no CUDA, or not that many devices
    (["evaluate", SPEC, "--sequences", "1000000000000"], "Invalid value for '--sequences'"),  # a recall task's: hours without a word
    (["layers", SPEC, "--sequences", "100001"], "Invalid value for '--sequences'"),
    (["niah", SPEC, "--depths", "1000000000000"], "Invalid value for '--depths'"),  # hours before its length was judged
    (["niah", SPEC, "--seed", "-1"], "Invalid value for '--seed'"),  # as generate's and chat's
]


def test_sampling_options_at_temperature_zero_are_said_to_do_nothing(cli):
    """Greedy decoding samples nothing: --top-k and --top-p were taken without a word, the tokens
    those of a run without them."""
    for options, said in ((["--top-k", "5"], "--top-k narrows what is sampled, and at --temperature 0 (greedy, the default)"
                                              " nothing is: it does nothing; give a --temperature above 0 to sample"),
                          (["--top-k", "5", "--top-p", "0.5"], "--top-k and --top-p narrow what is sampled, and at"
                                                               " --temperature 0 (greedy, the default) nothing is: they do nothing")):
        code, out, stderr = cli("generate", SPEC, "--prompt", "ab", "--max-new-tokens", "3", *options)
        assert code in (0, None) and said in " ".join(stderr.split()), stderr
        assert out == cli("generate", SPEC, "--prompt", "ab", "--max-new-tokens", "3")[1]
    code, _, stderr = cli("generate", SPEC, "--prompt", "ab", "--max-new-tokens", "3", "--top-k", "5", "--temperature", "0.7")
    assert code in (0, None) and "does nothing" not in stderr


@pytest.mark.parametrize("args,message", BAD_OPTIONS, ids=[" ".join(c[0][:1] + c[0][-2:]) for c in BAD_OPTIONS])
def test_an_option_out_of_bounds_is_refused(cli, tmp_path, args, message):
    code, _, stderr = cli(*expand(args, tmp=tmp_path))
    assert code == 2 and message in stderr, stderr
    assert not (tmp_path / "run").exists()


def test_a_run_that_lost_its_spec_is_said_so_and_its_config_not_read_as_a_spec(cli, tmp_path):
    """Its config.yaml and environment.yaml were read as specs: a screen of unknown keys."""
    run = tmp_path / "exp" / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("steps: 4\nseq_len: 64\n")
    shutil.copy(ROOT / SPEC, tmp_path / "exp" / "transformer.yaml")
    for args in (["validate", run], ["cost", run], ["show", run], ["validate", tmp_path / "exp"]):
        code, stdout, stderr = cli(*args)
        assert code == 1 and f"error in {run / 'spec.yaml'}:\n  <file>: not found" in stderr and "unknown key" not in stderr, stderr
    assert f"ok    {tmp_path / 'exp' / 'transformer.yaml'}  (transformer)" in stdout
    (run / "spec.yaml").mkdir()
    code, _, stderr = cli("validate", run)
    assert code == 1 and f"error in {run / 'spec.yaml'}:\n  <file>: is a folder" in stderr and "unknown key" not in stderr, stderr


@pytest.mark.parametrize("args,message,size", [  # a cache is sized before it is made; activations fail as they are
    (["generate", SPEC, "--max-new-tokens", 10**13], "a cache for 16 prompt + 10,000,000,000,000 new tokens does not fit in memory (a cache's states (1 sequence of up to"
     " 10,000,000,000,016 positions) ask for ",
     " TiB with "),
    (["bench", "specs/tiny/yoco.yaml", "--seq-len", "16", "--gen", 10**13], "yoco: a batch of 1 x (16 prompt + 10,000,000,000,000 new tokens) does not fit",
     " TiB with "),
    (["bench", "specs/tiny/yoco.yaml", "--seq-len", "16", "--gen", "1", "--page-size", 10**14], "in pages of 100,000,000,000,000 does not fit", " TiB with "),
    (["build", "specs/tiny/transformer.yaml", "--seq-len", "1024M"], "transformer: a check of 2 x 1,073,741,824 tokens does not fit in memory"
     " (its tokens and their embeddings ask for 528.0 GiB with ", " GiB free)"),  # the 16 GiB of tokens were made unwatched, and killed
], ids=["generate", "bench", "bench pages", "build"])
def test_a_cache_larger_than_memory_is_said_in_words(cli, args, message, size):
    code, _, stderr = cli(*args)
    assert code == 1 and message in stderr and size in stderr, stderr


def huge_chunks(folder):
    """Gated DeltaNet's 1,024 heads in chunks of 2^20 tokens, the most a spec takes: its first 16
    tokens ask for 64 GiB."""
    spec = folder / "chunks.yaml"
    spec.write_text(f"extends: {ROOT / 'specs/tiny/yoco-u-gdn.yaml'}\nname: chunks\n"
                    "layout: {self_decoder: {blocks: [{type: gdn, chunk_size: 1048576, n_heads: 1024, head_dim: 16}]}}\n")
    return spec


@pytest.mark.parametrize("command", [["generate", "--max-new-tokens", "2"], ["bench", "--seq-len", "16", "--gen", "2"]])
def test_a_first_forward_pass_larger_than_memory_is_said_in_words(cli, tmp_path, command):
    """Each block's output shape is checked first, which failed with a traceback."""
    code, _, stderr = cli(command[0], huge_chunks(tmp_path), *command[1:])
    assert code == 1 and "Traceback" not in stderr, stderr
    assert ("chunks: a forward pass of 16 tokens (each block's output shape checked) does not fit in memory (asked for"
            " 68,719,476,736 bytes); lower the spec's sizes") in stderr, stderr


@pytest.mark.parametrize("raised, asked", [
    (MemoryError("Unable to allocate 745. GiB for an array with shape (100000000000,) and data type int64"), "745 GiB"),  # numpy's
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate 1280000 bytes. Error code 12 (Cannot allocate memory)"), "1,280,000 bytes"),  # torch's on the CPU
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."), "2.00 GiB"),
])
def test_an_allocation_too_large_is_said_in_its_size(capsys, raised, asked):
    """numpy's size came out as "745. GiB"."""
    from archlab.cli import _fits_in_memory

    with pytest.raises(typer.Exit), _fits_in_memory("drawing the batch", "batch_size"):
        raise raised
    assert capsys.readouterr().err == f"error: drawing the batch does not fit in memory (asked for {asked}); lower batch_size\n"


def test_training_larger_than_memory_names_the_micro_batch_it_uses(cli, tmp_path):
    """Left at its default (16), micro_batch_size is the batch of 4 here, which the message named as 16."""
    code, _, stderr = cli("train", huge_chunks(tmp_path), "--out", tmp_path / "run", "--steps", "1", "--set", "batch_size=4")
    assert code == 1 and "training chunks (17,769,152 parameters) in micro-batches of 4 x " in stderr, stderr


@pytest.mark.parametrize("option,message", [(["--prompt", ""], "--prompt '' encodes to no tokens"),
                                            (["--stop", ""], "--stop '' is empty; give text to stop at")])
def test_generate_refuses_a_prompt_or_stop_it_cannot_use_before_drawing_weights(cli, option, message):
    code, stdout, stderr = cli("generate", "specs/tiny/yoco.yaml", *option)
    assert code == 2 and message in stderr, stderr
    assert "random weights" not in stderr and not stdout


def test_generate_with_byte_prompts_needs_a_vocabulary_of_256(cli, tmp_path):
    """A bare spec reads its prompt as UTF-8 bytes, ids 0 to 255: a vocabulary of 255 is refused
    before weights are drawn, where byte 255 would index past the embedding (the tiny specs'
    256 generate throughout this file)."""
    spec = tmp_path / "bytes.yaml"
    spec.write_text(f"extends: {ROOT / 'specs/tiny/transformer.yaml'}\nname: bytes\nvocab_size: 255\n")
    code, stdout, stderr = cli("generate", spec, "--prompt", "a", "--max-new-tokens", "1")
    assert code == 1 and "error: bytes has a vocabulary of 255; byte-level prompts need 256" in stderr, stderr
    assert "random weights" not in stderr and not stdout


@pytest.mark.parametrize("command", ["generate", "train"])
def test_a_model_larger_than_memory_is_said_in_words(cli, tmp_path, command):
    spec = tmp_path / "big.yaml"
    spec.write_text(f"extends: {ROOT / 'specs/tiny/yoco.yaml'}\nname: big\nd_model: {2**20}\n")  # 2^40-element matrices
    options = {"generate": ["--max-new-tokens", "2"], "train": ["--out", tmp_path / "run", "--steps", "1"]}[command]
    code, _, stderr = cli(command, spec, *options)
    assert code == 1 and "Traceback" not in stderr, stderr
    assert "10,998,146,662,400 parameters" in stderr and "does not fit in memory" in stderr, stderr
    assert ("no checkpoint had been written, so there is nothing to resume" in stderr) == (command == "train")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args", [["equal-flops", SPEC, "specs/tiny/yoco.yaml", "--seq-len", "8K", "16K"],
                                  ["build", SPEC, "--seq-len", "64", "1K"]])
def test_a_second_length_where_one_is_taken_is_refused(cli, args):
    """It was silently put in the first's place (the table was of 16K)."""
    code, stdout, stderr = cli(*args)
    assert code == 2 and f"--seq-len takes one length here; {args[-1]} is a second" in stderr and not stdout, stderr


def test_lengths_given_after_an_equals_sign_are_all_taken(cli):
    code, stdout, _ = cli("cost", SPEC, "--seq-len=2K", "4K", "--format", "csv")
    assert code == 0 and [line.split(",")[1] for line in stdout.splitlines()[1:]] == ["2048", "4096"]


def test_equal_flops_says_when_a_spec_gets_no_step(cli):
    code, stdout, stderr = cli("equal-flops", SPEC, "specs/tiny/yoco-u.yaml", "specs/tiny/yoco.yaml", "--steps", "1", "--seq-len", "2")
    assert code in (0, None) and "│ yoco-u      │ 2.44M             │ 0 " in stdout, stdout
    assert "notice: yoco-u: one step costs more FLOPs than the reference's 1 step(s) in all; give more --steps" in stderr, stderr


def test_equal_flops_takes_a_reference_runs_own_steps_and_length(cli, tmp_path):
    """A run trained on 128-token sequences was costed at 8K, where the comparison can flip (a
    transformer run got 0.625x of another's steps there, 1.75x at its own length), and the table
    said at neither."""
    from archlab.cost import equal_flops_steps

    run = tmp_path / "run"
    run.mkdir()
    (run / "spec.yaml").write_text(cli("show", SPEC)[1])
    (run / "config.yaml").write_text("steps: 300\nseq_len: 128\n")
    other = "specs/tiny/yoco-u.yaml"
    for given, (steps, n) in (([], (300, 128)), (["--steps", "50", "--seq-len", "8K"], (50, 8192))):
        code, out, stderr = cli("equal-flops", run, other, *given)
        matched = equal_flops_steps(load_spec(ROOT / SPEC), steps, load_spec(ROOT / other), n)
        row = next(line for line in out.splitlines() if "yoco-u" in line)
        assert code in (0, None) and f"{steps:,} reference steps of {n:,}-token sequences" in out, stderr
        assert row.split("│")[3].strip() == f"{matched:,}", out
    assert "20,000 reference steps of 8,192-token sequences" in cli("equal-flops", SPEC, other)[1]  # a spec: the defaults
    code, out, _ = cli("equal-flops", run, tmp_path)  # a folder holding the reference run: listed once, not twice
    assert code in (0, None) and out.count(f"({run})") == 1 and "spec.yaml)" not in out, out


def test_a_length_option_given_twice_where_one_is_taken_is_refused(cli):
    code, stdout, stderr = cli("equal-flops", SPEC, "specs/tiny/yoco.yaml", "--seq-len", "8K", "--seq-len", "16")
    assert code == 2 and "--seq-len takes one length here; it is given twice" in stderr and not stdout, stderr


def test_a_spec_folder_named_like_a_length_is_a_path(cli, tmp_path, monkeypatch):
    (tmp_path / "7b").mkdir()
    shutil.copy(ROOT / "specs" / "tiny" / "yoco.yaml", tmp_path / "7b" / "yoco.yaml")
    command = ("cost", "--seq-len", "16K", "7b", "--format", "csv")
    monkeypatch.chdir(tmp_path)  # after cli's own chdir, which it does when made
    code, stdout, stderr = cli(*command)
    assert code == 0 and stdout.splitlines()[1].startswith("yoco,16384,"), stderr


@pytest.mark.parametrize("count", [10**17, 10**19])  # sizes past int64: torch overflows before it allocates
def test_a_cache_past_any_size_is_said_in_words_too(cli, count):
    code, _, stderr = cli("generate", SPEC, "--max-new-tokens", count)
    assert code == 1 and f"+ {count:,} new tokens does not fit in memory; lower --max-new-tokens" in stderr, stderr


def test_generate_runs_in_the_specs_inference_dtype(cli, tmp_path):
    spec = tmp_path / "bf16.yaml"
    spec.write_text(f"extends: {ROOT / 'specs/tiny/yoco.yaml'}\nname: bf16\ninference_dtype: bfloat16\n")
    said = {}
    for dtype in ("auto", "float32"):
        code, _, stderr = cli("generate", spec, "--prompt", "ab", "--max-new-tokens", "2", "--dtype", dtype)
        assert code == 0, stderr
        said[dtype] = int(re.search(r"cache ([\d,]+) B global", stderr)[1].replace(",", ""))
    assert said["float32"] == 2 * said["auto"] > 0


def test_build_checks_a_kernel_without_a_cpu_backward_forward_only(cli, tmp_path):
    spec = tmp_path / "flex.yaml"
    spec.write_text(f"extends: {ROOT / 'specs/tiny/yoco.yaml'}\nname: flex\n"
                    "layout: {self_decoder: {blocks: [{type: swa, window: 16, n_heads: 4, n_kv_heads: 2, backend: flex}]}}\n")
    code, out, stderr = cli("build", spec, "--seq-len", "16")
    assert code == 0, stderr
    assert "ok fwd only (no CPU backward for swa: flex)" in out


def test_generate_refuses_a_kernel_that_cannot_run_before_printing_the_prompt(cli, tmp_path):
    spec = tmp_path / "fla.yaml"
    spec.write_text(f"extends: {ROOT / 'specs/tiny/yoco-u-gdn.yaml'}\n"
                    "layout: {self_decoder: {blocks: [{type: gdn, n_heads: 4, backend: fla}]}}\n")
    code, out, stderr = cli("generate", spec, "--prompt", "ab", "--max-new-tokens", "2")
    assert code == 2 and out == "", out  # 2: the exit of a kernel or plugin that cannot be had
    assert "gdn: backend 'fla' runs on CUDA devices only" in stderr


RECALL = "steps: 1\ndata: {source: mqar}\n"  # the config of a run on a recall task, which has no tokenizer


def fake_run(root, config=RECALL, weights=lambda t: t):
    """A training run as ``generate`` reads it, without training: the spec, its config and one
    checkpoint of random weights, each passed through ``weights``, with the step and hash a
    checkpoint's state.json records."""
    spec = load_spec(ROOT / SPEC)
    checkpoint = root / "checkpoints" / "step-00000001"
    checkpoint.mkdir(parents=True)
    (root / "spec.yaml").write_text(spec_to_yaml(spec))
    (root / "config.yaml").write_text(config)
    save_model(build_model(spec), str(checkpoint / "model.safetensors"))
    saved = load_file(checkpoint / "model.safetensors")
    save_file({name: weights(t) for name, t in saved.items()}, checkpoint / "model.safetensors")
    state = {"step": 1, "weights_blake2b": file_hash(checkpoint / "model.safetensors")}
    (checkpoint / "state.json").write_text(json.dumps(state))
    return root


WIDE_TOKENIZER = Tokenizer(WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0")).to_str()  # another run's, say
# (config.yaml, tokenizer.json or None, what the weights become, what stderr must say)
BAD_RUNS = [
    ("x: [\n", None, None, "config.yaml:\n  line 2, column 1: YAML syntax error"),
    ("- 1\n", None, None, "config.yaml:\n  <root>: the file must be a YAML mapping"),
    ("data: [1]\n", None, None, "config.yaml:\n  data: Input should be a valid dictionary"),
    ("steps: 1\n", "garbage", None, "tokenizer.json' could not be read: expected value at line 1 column 1"),
    ("steps: 1\n", "", None, "tokenizer.json' could not be read"),
    ("steps: 1\n", Tokenizer(WordLevel({}, unk_token="w0")).to_str(), None, "tokenizer.json' has no tokens"),  # was blamed on the prompt
    ("steps: 1\n", None, None, "the run's tokenizer is not at"),  # a run on text, its tokenizer gone
    ("steps: 1\n", WIDE_TOKENIZER, None, "tokenizer.json' has 300 tokens; the spec's vocab_size is 256"),
    (RECALL, None, lambda t: torch.full_like(t, float("nan")), "step-00000001 is damaged (non-finite weights: embed.weight"),
    (RECALL, None, lambda t: t.long(), "does not fit this model (weights of another dtype: embed.weight: torch.int64, not torch.float32; head.weight: "),
    (RECALL, None, lambda t: t.half(), "weights of another dtype: embed.weight: torch.float16, not torch.float32; "),
]


@pytest.mark.parametrize("config,tokenizer,weights,message", BAD_RUNS,
                         ids=["bad yaml", "list", "data list", "garbage tokenizer", "empty tokenizer", "tokenizer of no tokens", "no tokenizer", "wide tokenizer", "nan", "int64",
                              "float16"])
def test_generate_refuses_a_damaged_run(cli, tmp_path, config, tokenizer, weights, message):
    run = fake_run(tmp_path / "run", config, weights or (lambda t: t))
    if tokenizer is not None:
        (run / "tokenizer.json").write_text(tokenizer)
    code, out, stderr = cli("generate", run, "--max-new-tokens", "2")
    assert code == 1 and message in stderr and out == "", stderr


def test_resume_refuses_weights_of_another_dtype(tmp_path):
    run = fake_run(tmp_path, weights=lambda t: t.half())
    with pytest.raises(CheckpointError, match=r"step-00000001 does not fit this model \(weights of another dtype"):
        load(run / "checkpoints" / "step-00000001", build_model(load_spec(ROOT / SPEC)))


def test_weights_of_another_shape_are_named_in_one_line(cli, tmp_path):
    """A spec edited after training: which weights differ, not torch's lines of size mismatches."""
    run = fake_run(tmp_path / "run")
    (run / "spec.yaml").write_text((run / "spec.yaml").read_text().replace("d_model: 64", "d_model: 96"))
    code, _, stderr = cli("generate", run, "--max-new-tokens", "2")
    assert code == 1 and "does not fit this model (weights of another shape: embed.weight: [256, 64], not [256, 96]; " in stderr, stderr
    assert " more)" in stderr and "['" not in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1, stderr


@pytest.mark.parametrize("pickled", [b"\x80\x02h\x05.", b"\x80\x02q\x05.", b"\x80\x02J\x01\x00."],
                         ids=["memo never stored", "memo past the list", "integer cut short"])
def test_a_trainer_state_the_unpickler_chokes_on_is_damage(tmp_path, pickled):
    """KeyError, IndexError or struct.error from torch's weights-only unpickler, not a traceback."""
    run = fake_run(tmp_path)
    checkpoint = run / "checkpoints" / "step-00000001"
    (checkpoint / "state.json").write_text('{"step": 1}')
    (checkpoint / "trainer.pt").write_bytes(pickled)
    with pytest.raises(CheckpointError, match=r"step-00000001 is damaged \(trainer.pt does not load: (KeyError|IndexError|error)\)"):
        load(checkpoint, build_model(load_spec(ROOT / SPEC)))


@contextlib.contextmanager
def as_another_user():
    """Files read as a user other than their owner: as nobody, where the tests run as root (whom no
    file's permissions keep out)."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


@pytest.mark.parametrize("name", ["model.safetensors", "state.json", "trainer.pt"])
def test_a_checkpoint_file_the_user_may_not_read_is_said_so_and_not_called_damaged(name):
    """Each was called damaged, with advice to remove the checkpoint; safetensors even said that
    model.safetensors was missing (FileNotFoundError for a file it may not open)."""
    folder = Path(tempfile.mkdtemp())
    try:
        folder.chmod(0o755)  # tmp_path is root's alone: another user could not reach the run inside it
        checkpoint = fake_run(folder / "run") / "checkpoints" / "step-00000001"
        torch.save({"step": 1}, checkpoint / "trainer.pt")
        for file in checkpoint.iterdir():
            file.chmod(0o644)  # as a checkpoint shared with others is (safetensors writes its file for its owner alone)
        model = build_model(load_spec(ROOT / SPEC))
        with as_another_user():
            assert load(checkpoint, model)[0] == {"step": 1}  # readable, it loads (and what loading imports is imported as root)
        (checkpoint / name).chmod(0)
        with as_another_user(), pytest.raises(CheckpointError) as refused:
            load(checkpoint, model)
        assert str(refused.value) == (f"checkpoint {checkpoint} cannot be read by this user: {checkpoint / name}: Permission denied;"
                                      " give the user read permission (or run as the files' owner)")
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize("state, said", [
    (None, "(FileNotFoundError: "),  # a copy cut short: its hash, and so its bytes, cannot be checked
    ({"step": 2}, "(its state.json is at step 2)"),  # another checkpoint's
    ({"weights_blake2b": "0" * 32}, "(state.json gives no step count: "),
])
def test_generate_refuses_weights_without_their_own_state(cli, tmp_path, state, said):
    """Weights loaded to sample or score are checked as a resume checks them: a checkpoint whose
    state.json is gone, or records another step, is not taken in silence as the run's."""
    run = fake_run(tmp_path)
    recorded = run / "checkpoints" / "step-00000001" / "state.json"
    recorded.unlink() if state is None else recorded.write_text(json.dumps(state))
    code, _, stderr = cli("generate", run, "--prompt", "ab", "--max-new-tokens", "2")
    assert code == 1 and f"step-00000001 is damaged {said}" in stderr and "Traceback" not in stderr, stderr


def test_a_sound_fake_run_generates(cli, tmp_path):
    """The damaged runs above differ from this one only in what each damages."""
    code, out, stderr = cli("generate", fake_run(tmp_path), "--prompt", "ab", "--max-new-tokens", "2")
    assert code == 0 and out.startswith("ab"), stderr


def test_generate_names_logits_that_are_not_finite(cli, monkeypatch):
    """Weights that give NaN: the engine's FloatingPointError, in one line."""
    import archlab.cli as command

    built = command._built

    def spoiled(spec, *args, **kwargs):
        model = built(spec, *args, **kwargs)
        with torch.no_grad():
            model.head.weight[7, 0] = float("nan")
        return model

    monkeypatch.setattr(command, "_built", spoiled)
    code, _, stderr = cli("generate", "specs/tiny/yoco-u.yaml", "--prompt", "Hi", "--max-new-tokens", "4")
    assert code == 1 and "error: the model produced non-finite logits (nan or inf) for new token 0 of prompt(s) 0" in stderr, stderr


def test_bench_refuses_a_cuda_graph_for_a_model_that_cannot_be_captured(cli, monkeypatch):
    """Said before any measuring, in one line (the model is built on the CPU here, for want of a GPU)."""
    import archlab.cli as command

    built = command._built
    monkeypatch.setattr(command, "_built", lambda spec, device, dtype: built(spec, "cpu", dtype))
    monkeypatch.setattr(command, "_check_device", lambda name: None)
    code, _, stderr = cli("bench", "specs/tiny/yoco-u-moe.yaml", "--seq-len", "64", "--device", "cuda", "--cuda-graph")
    assert code == 1 and "error: cuda_graph: yoco-u-moe cannot decode from a CUDA graph: its MoEFFN picks its experts" in stderr, stderr


def test_a_closed_stream_reads_as_empty_and_takes_what_is_written_nowhere(cli, tmp_path):
    """``<&-`` and ``>&-`` close a stream, which Python then gives as None: each command runs as with
    /dev/null there, as rich's consoles already wrote nowhere, rather than failing on None."""
    code, _, stderr = cli("train", SPEC, "--out", tmp_path / "run", "--steps", "1", "--set", "seq_len=16", "--set", "batch_size=2",
                          "--set", "micro_batch_size=2", "--set", "data.max_bytes=20000", "--set", "eval_batches=1")
    assert code in (0, None), stderr
    for command, closed in ((["show", SPEC], [1]), (["generate", tmp_path / "run", "--prompt", "hi", "--max-new-tokens", "2"], [1]),
                            (["chat", tmp_path / "run", "--max-new-tokens", "2"], [0, 1])):
        result = subprocess.run([sys.executable, "-m", "archlab", *map(str, command)], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, timeout=300, preexec_fn=lambda: [os.close(fd) for fd in closed])
        assert result.returncode == 0 and "Traceback" not in result.stderr, (command, result.stderr)


def test_a_message_names_a_few_of_many_and_counts_the_rest():
    """The one form of "the first few, and how many more" that messages share (six wrote their own:
    ", ...", " and 4 more", "; and 4 more")."""
    from archlab.table import first_few

    assert first_few([f"f{i}" for i in range(1005)], 3) == "f0, f1, f2, and 1,002 more"
    assert first_few(["a", "b", "c"], 3, "; ") == "a; b; c" and first_few(["a", "b", "c", "d"], 2, "; ") == "a; b; and 2 more"
    assert first_few([], 3) == ""


def test_a_number_rounded_to_zero_from_below_is_shown_as_zero():
    """niah's table said a gain of -0.0000 a digit, and its map -0.00."""
    rows = [{"run": "a", "gain/digit": Decimals(-0.00001, 4)}, {"run": "b", "gain/digit": Decimals(-0.5, 4)}]
    table = render(rows, Format.md)
    assert "| 0.0000 |" in table and "| -0.5000 |" in table and "-0.0000" not in table, table
    assert f"{Decimals(-0.001, 2):.2f}" == "0.00"


@pytest.mark.parametrize("text,said", [("a: " + "[" * 3000 + "]" * 3000 + "\n", "<yaml>: nested too deeply to read"),
                                       ("d_model: 1" + "0" * 5000 + "\n", "<yaml>: cannot read a value: Exceeds the limit")],
                         ids=["nested past reading", "a number too long to read"])
@pytest.mark.parametrize("command", ["validate", "build", "cost"])
def test_a_spec_too_deep_or_long_to_read_is_reported_by_every_command_that_loads_specs(cli, tmp_path, command, text, said):
    """``show`` said so, but validate, build and cost, on asking whether the file was a study or a
    training config instead, read it again unguarded: a RecursionError or ValueError traceback."""
    (tmp_path / "s.yaml").write_text(text)
    code, out, stderr = cli(command, tmp_path / "s.yaml")
    assert code == 1 and said in stderr and "Traceback" not in out + stderr, out + stderr


# (name, command, the argument or option named); {tmp}: an empty folder, {run}: a training run
EMPTY_PATHS = [
    ("generate", ["generate", ""], "'SPEC_OR_RUN'"),
    ("chat", ["chat", ""], "'run'"),
    ("show", ["show", ""], "'path'"),
    ("validate", ["validate", SPEC, ""], "'paths'"),
    ("build", ["build", ""], "'paths'"),
    ("cost --doc", ["cost", SPEC, "--doc", ""], "'--doc'"),
    ("bench --plot", ["bench", SPEC, "--plot", ""], "'--plot'"),
    ("equal-flops", ["equal-flops", SPEC, ""], "'others'"),
    ("train spec", ["train", "", "--out", "{tmp}/run"], "'SPEC'"),
    ("train --out", ["train", SPEC, "--out", "", "--steps", "1"], "'--out'"),
    ("train --config", ["train", SPEC, "--out", "{tmp}/run", "--config", ""], "'--config'"),
    ("train --init", ["train", SPEC, "--out", "{tmp}/run", "--init", ""], "'--init'"),
    ("curves --baseline", ["curves", "{run}", "--baseline", ""], "'--baseline'"),
    ("evaluate", ["evaluate", ""], "'RUN'"),
    ("layers --plot", ["layers", "{run}", "--plot", ""], "'--plot'"),
    ("niah", ["niah", "", "{run}"], "'RUN'"),
    ("downstream --include-path", ["downstream", "{run}", "--include-path", ""], "'--include-path'"),
    ("study run --out", ["study", "run", "loop-position", "--out", ""], "'--out'"),
    ("study report --out", ["study", "report", "loop-position", "--out", ""], "'--out'"),
]


@pytest.mark.parametrize("args,named", [c[1:] for c in EMPTY_PATHS], ids=[c[0] for c in EMPTY_PATHS])
def test_an_empty_path_is_refused_by_name_not_read_as_the_current_folder(cli, tmp_path, args, named):
    """pathlib reads "" as "."; generate said ". is not a training run", and train --out "" trained into the current folder."""
    run = fake_run(tmp_path / "run")
    (tmp_path / "tmp").mkdir()
    before = sorted(p.name for p in ROOT.iterdir())
    code, out, stderr = cli(*expand(args, tmp=tmp_path / "tmp", run=run))
    assert code == 2 and f"Invalid value for {named}: an empty path names no file or folder" in stderr and out == "", stderr
    assert sorted(p.name for p in ROOT.iterdir()) == before and not any((tmp_path / "tmp").iterdir())


@pytest.mark.parametrize("command", [["study", "run"], ["study", "report"]])
def test_an_empty_study_name_is_refused_not_read_as_the_current_folder(cli, command):
    code, _, stderr = cli(*command, "")
    assert code == 2 and "Invalid value for 'study': an empty name; give a study file, or the name of a shipped one" in stderr, stderr


@pytest.mark.parametrize("replaced", ["folder", "device"])
def test_weights_that_are_no_file_are_named_not_said_as_no_such_device(cli, tmp_path, replaced):
    """A model.safetensors that is a folder, or a link to /dev/null, said "OSError: No such device"
    (and a FIFO, refused the same way, kept generate waiting for a writer)."""
    run = fake_run(tmp_path / "run")
    weights = run / "checkpoints/step-00000001/model.safetensors"
    weights.unlink()
    weights.mkdir() if replaced == "folder" else weights.symlink_to(os.devnull)
    code, out, stderr = cli("generate", run, "--max-new-tokens", "2")
    said = "is a folder, not a file" if replaced == "folder" else "is not a regular file (a FIFO, a device or a socket)"
    assert code == 1 and f"{said}: '{weights}'" in stderr and "No such device" not in stderr and out == "", stderr
    code, _, stderr = cli("train", SPEC, "--out", run, "--resume", "--steps", "2")
    assert code == 1 and f"{said}: '{weights}'" in stderr and "No such device" not in stderr, stderr


def test_a_resume_setting_a_kept_dotted_key_to_a_bad_value_is_told_the_run_keeps_it(cli, tmp_path):
    """A resume may not change data.max_bytes at all: that is said first, not that the value given is no number."""
    run = fake_run(tmp_path / "run")
    code, _, stderr = cli("train", SPEC, "--out", run, "--resume", "--set", "data.max_bytes=lots")
    assert code == 1 and "a resumed run keeps its data.max_bytes" in " ".join(stderr.split()), stderr


@pytest.mark.parametrize("option,given", [("--init", "-"), ("--init", "null"), ("--data", "-"), ("--data", "[x]")])
def test_init_and_data_are_taken_as_given_not_read_as_yaml_for_set(cli, tmp_path, option, given):
    """--init - said "error in --set: init: Input should be a valid string", an option not given; --init null trained afresh."""
    code, _, stderr = cli("train", SPEC, "--out", tmp_path / "run", "--steps", "1", "--set", "seq_len=64", option, given)
    assert code == 1 and "error in --set" not in stderr and f"/{given}" in stderr, stderr
