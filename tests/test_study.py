"""Studies: shipped definitions, one worker end to end, failures, dead workers, a report mid-study, PostgreSQL workers."""

import contextlib
import csv
import errno
import functools
import inspect
import io
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import optuna
import pytest
import sqlalchemy
import torch
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.storages import RetryHeartbeatStaleTrialCallback, fail_stale_trials
from optuna.trial import TrialState
from rich.console import Console
from safetensors import SafetensorError
from sqlalchemy.engine import make_url

from archlab.cost import Cost
from archlab.environment import environment
from archlab.spec import SpecError
from archlab.table import Format, render, si
from archlab.study.definition import STUDIES, load_study
from archlab.study.report import failures, passed_over, progress, readable, report, settings, summarize
from archlab.study.runner import (
    SameVariantAndSeed, StorageError, StudyChanged, WholeCallsStorage, check_unchanged, claim, join, learning_rate, open_study, planned_as, refused_by_the_machine, run_trial, settled, shown, storage_url,
    work,
)
from archlab.train.trainer import Trainer, Unwritten
from conftest import ROOT, files_no_bigger_than, interruptible, no_longer_than

SHIPPED = sorted(p.stem for p in STUDIES.glob("*.yaml"))
DIVERGED = r"TrainError: (loss|gradient norm) became"  # the trainer's reason for stopping a run that blew up


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("scale", ["tiny", "gpu"])
def test_shipped_studies_validate(name, scale):
    study = load_study(name, scale)
    assert study.definition.baseline in study.specs
    assert len(study.plan()) == len(study.specs) * len(study.definition.seeds) * study.definition.lr.points


def test_the_shipped_studies_are_the_papers():
    assert set(SHIPPED) == {"loop-position", "loop-count", "esa-kind", "architectures", "window", "finetune"}
    finetune = load_study("finetune")  # Figure 3: each fine-tuned from its own pretraining
    assert {v: (study.key, pretrained) for v, (study, pretrained) in finetune.pretraining.items()} == {
        "yoco": ("architectures-tiny", "yoco"), "yoco-u": ("architectures-tiny", "yoco-u")}
    assert all(finetune.specs[v] == load_study("architectures").specs[v] for v in finetune.specs)  # so that the weights fit
    positions = {v: s.loop.position for v, s in load_study("loop-position").specs.items()}
    assert positions == {"yoco": "none", "yoco-u": "lower", "upper-loop": "upper", "upper-loop-no-shared-kv": "upper", "deeper": "lower"}
    assert [s.loop.times for s in load_study("loop-count").specs.values()] == [1, 2, 3, 5]
    assert [s.layout.self_decoder.blocks[0].window for s in load_study("window", "gpu").specs.values()] == [128, 256, 512, 1024]


def mini(tmp_path, name="mini", variants=None, steps=4, **extra):
    definition = {
        "schema_version": 1, "name": name, "baseline": "yoco",
        "variants": variants or {"yoco": {"spec": "yoco.yaml"}, "yoco-u": {"spec": "yoco-u.yaml"}},
        "seeds": [0], "lr": {"low": 0.002, "high": 0.004, "points": 2}, **extra,
        "scales": {"tiny": {"specs": str(ROOT / "specs" / "tiny"), "train": {
            "steps": steps, "batch_size": 4, "micro_batch_size": 4, "seq_len": 32, "eval_interval": 2, "eval_batches": 1,
            "log_interval": 1, "checkpoint_interval": 1000, "keep_checkpoints": 1,
            "data": {"source": "stdlib", "max_bytes": 200_000}}}},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(definition))
    return path


def rewrite(path, **changes):
    """Change fields of a study file; the study as it now stands."""
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **changes}))
    return load_study(str(path))


OK = (0, None)  # the exit codes of a command that succeeded, run in this process (conftest's cli)


def trials_of(url, name):
    return optuna.load_study(study_name=f"{name}-tiny", storage=url).get_trials()


def test_a_study_runs_every_planned_trial_once_and_reports(tmp_path, cli):
    out = tmp_path / "out"
    code, stdout, stderr = cli("study", "run", mini(tmp_path), "--out", out)
    assert code in OK, stderr
    trials = trials_of(f"sqlite:///{out / 'optuna.db'}", "mini")
    assert len(trials) == 4 and all(t.state.name == "COMPLETE" for t in trials)
    assert sorted(settled(trials)) == [("yoco", 0, 0), ("yoco", 0, 1), ("yoco-u", 0, 0), ("yoco-u", 0, 1)]
    assert all(sorted(t.intermediate_values) == [2, 4] for t in trials)  # reported for the pruner
    assert all(t.user_attrs["environment"] == environment(torch.device("cpu")) for t in trials)
    assert f"- trained with: archlab {environment(torch.device('cpu'))['archlab']}, python " in stdout
    assert "| yoco-u |" in stdout and "vs baseline" in stdout and "4 complete" in stdout
    assert "lr grid of 2 points over [0.002, 0.004]" in stdout and "\n\n\n" not in stdout  # no question: no gap
    assert sum(line.startswith("trial ") and ": complete, val_loss " in line for line in stderr.splitlines()) == 4  # a log, not a terminal
    assert stderr.count("is read as far as data.max_bytes") == 1  # said once, not by every trial that reads the data again
    tokenizing = f"tokenizing data source 'stdlib' (200,000 characters, with a BPE of 256 tokens trained on it first) into {out / 'data'}"
    assert stderr.count(tokenizing) == 1  # said before the trials share it
    for png in ("curves.png", "loss_vs_flops.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    code, again, stderr = cli("study", "report", mini(tmp_path), "--out", out)  # the report alone, from the storage
    assert code in OK and again == stdout, stderr
    # the same table as numbers, for a notebook: each variant's val loss the mean over its chosen rate's trials
    code, as_json, stderr = cli("study", "report", mini(tmp_path), "--out", out, "--format", "json")
    assert code in OK and (out / "report.md").read_text() == stdout, stderr
    rows = {row["variant"]: row for row in json.loads(as_json)}
    for variant, row in rows.items():
        chosen_trials = [t for t in trials if planned_as(t)[0] == variant and learning_rate(t) == row["best lr"]]
        assert len(chosen_trials) == 1 and row["val loss"] == chosen_trials[0].value and row["failed"] == 0
        assert f"| {variant} | {si(row['params'])} | {si(row['train FLOPs'])} |" in stdout
    code, as_csv, stderr = cli("study", "report", mini(tmp_path), "--out", out, "--format", "csv")
    assert code in OK and [r["variant"] for r in csv.DictReader(io.StringIO(as_csv))] == list(rows) == ["yoco", "yoco-u"], stderr
    code, elsewhere, stderr = cli("study", "report", mini(tmp_path), "--storage", f"sqlite:///{out / 'optuna.db'}", "--out", tmp_path / "copy")
    assert code in OK and "4 complete" in elsewhere, stderr  # a storage named, not --out's
    assert (tmp_path / "copy" / "report.md").is_file()
    code, _, stderr = cli("study", "run", mini(tmp_path), "--out", out)  # a finished study runs nothing again
    assert code in OK and len(trials_of(f"sqlite:///{out / 'optuna.db'}", "mini")) == 4, stderr
    assert "tokenizing" not in stderr  # its corpus read back
    notes = tmp_path / "notes"  # a folder of someone's files, which the report and plots would overwrite
    notes.mkdir()
    (notes / "report.md").write_text("mine")
    (notes / "todo.txt").write_text("mine")
    for command in (["run", mini(tmp_path, "other")], ["report", mini(tmp_path), "--storage", f"sqlite:///{out / 'optuna.db'}"]):
        code, _, stderr = cli("study", *command, "--out", notes)
        assert code == 1 and f"--out {notes} holds files that are not a study's (report.md, todo.txt), which its report" in " ".join(stderr.split()), stderr
    assert sorted(p.name for p in notes.iterdir()) == ["report.md", "todo.txt"] and (notes / "report.md").read_text() == "mine"
    (notes / "todo.txt").unlink()  # someone's report alone, with no study's mark or database beside it: written over, it was
    for command in (["run", mini(tmp_path, "other")], ["report", mini(tmp_path), "--storage", f"sqlite:///{out / 'optuna.db'}"]):
        code, _, stderr = cli("study", *command, "--out", notes)
        assert code == 1 and f"--out {notes} holds files that are not a study's (report.md), which its report" in " ".join(stderr.split()), stderr
    assert [p.name for p in notes.iterdir()] == ["report.md"] and (notes / "report.md").read_text() == "mine"
    (notes / "trials").mkdir()  # a study's folder from before .study marked it: its report is the study's
    code, _, stderr = cli("study", "report", mini(tmp_path), "--storage", f"sqlite:///{out / 'optuna.db'}", "--out", notes)
    assert code in OK and (notes / "report.md").read_text().startswith("# Study `mini`"), stderr


def test_a_study_does_not_write_into_the_text_folder_it_trains_on(tmp_path, cli):
    """Each trial refused to start there, since its files would be read as training text: the study
    stops before any trial instead."""
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("def f(x):\n    return x\n" * 200)
    out = texts / "study"
    code, _, stderr = cli("study", "run", mini(tmp_path), "--data", texts, "--out", out)
    said = " ".join(stderr.split())
    assert code == 1 and "Traceback" not in stderr and f"--out {out} is inside the text folder {texts} the study trains on" in said, stderr
    assert sorted(p.name for p in texts.iterdir()) == ["a.txt"]


def test_a_study_under_torchrun_is_refused_rather_than_left_waiting(tmp_path, cli, monkeypatch):
    """Each process torchrun started ran a worker: one claimed the trial and waited in a collective
    for its peer, which waited for the trial. No storage is made."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, _, stderr = cli("study", "run", "loop-position", "--out", tmp_path / "study")
    assert code == 2 and "not under torchrun" in stderr and "Traceback" not in stderr, stderr
    assert not (tmp_path / "study").exists()


def test_a_failing_trial_is_recorded_and_the_study_goes_on(tmp_path, cli):
    variants = {"yoco": {"spec": "yoco.yaml"}, "exploding": {"spec": "yoco.yaml", "set": {"init_std": 1.0e30}}}
    path = mini(tmp_path, "failing", variants, steps=6)
    out = tmp_path / "out"
    code, stdout, stderr = cli("study", "run", path, "--out", out)
    assert code in OK, stderr
    trials = trials_of(f"sqlite:///{out / 'optuna.db'}", "failing")
    failed = [t for t in trials if t.state.name == "FAIL"]
    assert failed and all(re.match(DIVERGED, t.user_attrs["failure"]) for t in failed)
    assert sum(t.state.name == "COMPLETE" for t in trials) == 2  # the other variant still ran
    assert "0/2" in stdout  # pruned/failed column of the failing variant
    assert "4 planned: 2 complete, 0 running, 0 waiting, 2 failed, 0 pruned" in stdout and "incomplete" not in stdout
    listed = stdout.split("## Failed trials")[1]
    assert all(re.search(rf"\| {t.number} \| exploding \| 0 \| {t.user_attrs['lr']:.2g} \| {DIVERGED}", listed) for t in failed)


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # as the runner ignores them in a process of its own
def test_a_study_whose_every_trial_failed_fails(tmp_path, cli, caplog):
    variants = {"yoco": {"spec": "yoco.yaml", "set": {"init_std": 1.0e30}}}
    out = tmp_path / "out"
    code, _, stderr = cli("study", "run", mini(tmp_path, "doomed", variants, steps=2, lr={"low": 0.003, "high": 0.003, "points": 1}), "--out", out)
    assert code == 1 and "Traceback" not in stderr + caplog.text, stderr  # caplog: what a process would log
    assert [line for line in stderr.splitlines() if "notice" in line] == [  # the mini study reads the corpus's start
        "notice: data source 'stdlib' is read as far as data.max_bytes (200,000 characters) and no further; raise"
        " data.max_bytes to train on the rest"], stderr
    assert f"no trial succeeded (1 of 1 failed); why each failed is under Failed trials in {out / 'report.md'}" in stderr
    assert re.search(DIVERGED, (out / "report.md").read_text())


def test_an_unreachable_storage_is_named_without_its_password(tmp_path, cli, caplog):
    url = "postgresql://nobody:hunter2@127.0.0.1:1/none"  # nothing listens on port 1
    for command in ("run", "report"):
        code, stdout, stderr = cli("study", command, mini(tmp_path), "--storage", url, "--out", tmp_path / "out")
        assert code == 1 and "Traceback" not in stderr + caplog.text, stderr  # caplog: what a process would log to its stderr
        assert "cannot open the study storage postgresql://nobody:***@127.0.0.1:1/none" in stderr or (
            "no database driver for postgresql" in stderr)
        assert "hunter2" not in stdout + stderr + caplog.text


def test_a_server_that_does_not_answer_is_waited_on_once(tmp_path, cli):
    """A report first looks whether the server's database holds studies: one it could not reach was
    then waited on a second time, by opening the storage. (A run connects first for its planning
    lock, and stops there.)"""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    attempts, held = [], []  # when each connection came, and the connections

    def accept() -> None:  # connections taken and never answered, as a server that hangs
        with contextlib.suppress(OSError):
            while True:
                held.append(listener.accept()[0])
                attempts.append(time.monotonic())

    threading.Thread(target=accept, daemon=True).start()
    url = f"postgresql+psycopg://nobody@127.0.0.1:{listener.getsockname()[1]}/none?connect_timeout=2"
    try:
        code, _, stderr = cli("study", "report", mini(tmp_path), "--storage", url, "--out", tmp_path / "out")
        assert code == 1 and "cannot open the study storage postgresql+psycopg://nobody@127.0.0.1" in stderr, stderr
        assert len(attempts) == 1, (attempts, stderr)
    finally:
        listener.close()
        for connection in held:
            connection.close()


def test_a_storage_is_shown_without_its_password_and_a_local_file_by_its_relative_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shown(storage_url(Path("runs/study"), None)) == "sqlite:///runs/study/optuna.db"  # not this machine's folders
    assert shown("sqlite:////elsewhere/optuna.db") == "sqlite:////elsewhere/optuna.db"
    assert shown("postgresql://me:hunter2@db.lab:5432/studies") == "postgresql://me:***@db.lab:5432/studies"
    assert shown(f"sqlite:///{tmp_path}/runs/optuna.db?timeout=30") == "sqlite:///runs/optuna.db?timeout=30"
    for url in ("postgresql://me:hunt@r2@db.lab/studies", "postgresql://me:hunter2@db.lab:port/studies", "postgresql:/me:hunter2@db/x"):
        assert "hunt" not in shown(url) and "***@" in shown(url)  # URLs the parser misreads or refuses


def test_a_storage_whose_lock_file_cannot_be_made_is_named_as_the_storage(tmp_path, cli):
    """/proc is a folder where no file can be made: it read only '/proc/x.db.lock: No such file or directory'."""
    code, _, stderr = cli("study", "run", mini(tmp_path), "--storage", "sqlite:////proc/archlab-study.db", "--out", tmp_path / "out")
    assert code == 1 and "Traceback" not in stderr, stderr
    assert "the workers' lock file /proc/archlab-study.db.lock beside the database of sqlite:////proc/archlab-study.db cannot be" \
        " made: No such file or directory" in stderr


def test_a_damaged_storage_is_said_in_the_drivers_words_alone(tmp_path, cli):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "optuna.db").write_bytes(b"\x13\x37 not SQLite" * 400)
    for command in ("run", "report"):
        code, _, stderr = cli("study", command, mini(tmp_path), "--out", tmp_path / "out")
        assert code == 1 and stderr.strip().endswith("optuna.db: file is not a database"), stderr  # no [SQL: ...], no link
    assert (tmp_path / "out" / "optuna.db").read_bytes() == b"\x13\x37 not SQLite" * 400


# A finished study's records edited as by hand: what archlab then says is wrong (a report and a run alike)
EDITS = [
    ("update trial_user_attributes set value_json = '\"abc\"' where key = 'lr' and trial_id = 1",
     "trial 0: user attribute lr: input should be a valid number (got 'abc')"),
    ("update trial_user_attributes set value_json = '-1' where key = 'lr' and trial_id = 1",
     "trial 0: user attribute lr: input should be greater than 0 (got -1)"),
    ("update trial_user_attributes set value_json = '\"x\"' where key = 'flops_per_step' and trial_id = 2",
     "trial 1: user attribute flops_per_step: input should be a valid number (got 'x')"),
    ("update trial_user_attributes set value_json = '[1]' where key = 'setup' and trial_id = 1",
     "trial 0: user attribute setup: input should be a valid dictionary (got [1])"),
    ("update trial_user_attributes set value_json = '{\"torch\": 2}' where key = 'environment' and trial_id = 1",
     "trial 0: user attribute environment.torch: input should be a valid string (got 2)"),
    ("delete from trial_user_attributes where trial_id = 1", "trial 0: complete, with no learning rate; trial 0: complete, with no flops_per_step"),
    ("delete from trial_values where trial_id = 1", "trial 0: complete, with no value"),
    ("delete from trial_system_attributes where trial_id = 1",
     "trial 0: param variant: field required; trial 0: param seed: field required; trial 0: param slot: field required"),
    ("update trial_system_attributes set value_json = '{\"variant\": \"yoco\", \"seed\": \"a\", \"slot\": 0}' where trial_id = 1",
     "trial 0: system attribute fixed_params.seed: input should be a valid integer (got 'a')"),
    ("update study_user_attributes set value_json = '5' where key = 'starts'", "the study's user attribute starts: input should be a valid dictionary (got 5)"),
    ("insert into trial_user_attributes (trial_id, key, value_json) values (1, 'started_from',"
     " '{\"study\": \"pre-tiny\", \"trial\": 0, \"lr\": -1, \"checkpoint\": \"c\"}')",  # said as the study start it is, not as a run's too
     "trial 0: user attribute started_from.study.lr: input should be greater than 0 (got -1); restore"),
    ("update trial_user_attributes set value_json = '{bad' where key = 'lr' and trial_id = 1", "is damaged: Optuna cannot read its records (JSONDecodeError:"),
    ("update trial_values set value = NULL where trial_id = 1", "is damaged: Optuna cannot read its records (a trial's value or intermediate value disagrees"),
    ("update trials set state = 'DONE' where trial_id = 1", "is damaged: Optuna cannot read its records (LookupError: 'DONE' is not among"),
    # a value or evaluation of text was a traceback in the report; an infinite or negative loss changed which rate was chosen
    ("update trial_values set value = 'abc' where trial_id = 1", "trial 0: value: input should be a valid number (got 'abc')"),
    ("update trial_intermediate_values set intermediate_value = 'x' where trial_id = 1 and step = 2",
     "trial 0: intermediate_values.2: input should be a valid number (got 'x')"),
    ("update trial_values set value = NULL, value_type = 'INF_POS' where trial_id = 1", "trial 0: value: input should be a finite number (got inf)"),
    ("update trial_values set value = -3 where trial_id = 1", "trial 0: value: input should be greater than or equal to 0 (got -3.0)"),
    ("update trial_intermediate_values set intermediate_value = NULL, intermediate_value_type = 'NAN' where trial_id = 1 and step = 2",
     "trial 0: intermediate_values.2: input should be a finite number (got nan)"),  # a report of nan
    ("update trial_intermediate_values set intermediate_value = -3 where trial_id = 1 and step = 4",
     "trial 0: intermediate_values.4: input should be greater than or equal to 0 (got -3.0)"),
    # a trial deleted: the next made took its number's place in the count, and one trial was trained twice
    ("delete from trials where trial_id = 2", "trial 1 is missing (trials are numbered from 0 as they are made)"),
    ("update study_user_attributes set value_json = '[[[' where key = 'grace_period'",  # read with the studies' names: every study's
     "is damaged: Optuna cannot read its records (JSONDecodeError:"),
    ("delete from study_directions", "is damaged: Optuna cannot read its records (IndexError: list index out of range)"),
]


def test_a_storage_whose_records_were_edited_is_refused_by_the_record_at_fault(tmp_path, cli):
    """A learning rate of text or null, a setup or environment that is not a mapping, a trial with
    no value or attributes, JSON that does not parse: each came out of a report or a worker as a
    traceback; a negative learning rate, or flops_per_step of text, was reported (a plot of text)."""
    out = tmp_path / "out"
    code, _, stderr = cli("study", "run", mini(tmp_path), "--out", out)
    assert code in OK, stderr
    clean = (out / "optuna.db").read_bytes()
    for i, (edit, said) in enumerate(EDITS):
        database = tmp_path / f"edited-{i}.db"
        database.write_bytes(clean)
        with contextlib.closing(sqlite3.connect(database)) as db:
            db.execute(edit)
            db.commit()
        edited = database.read_bytes()
        for command in ["report"] + ["run"] * (i % 4 == 0):
            code, _, stderr = cli("study", command, mini(tmp_path), "--storage", f"sqlite:///{database}", "--out", tmp_path / f"report-{i}")
            message = " ".join(stderr.split())
            assert code == 1 and f"in sqlite:///{database} " in message and said in message, (edit, stderr)
            assert message.endswith("restore the database from a copy, or run the study afresh with another --out (or --storage)")
            assert database.read_bytes() == edited and not (tmp_path / f"report-{i}" / "report.md").exists()


def test_an_accuracy_studys_values_are_shares(tmp_path):
    """Where the metric is maximized, a completed trial's value is an accuracy: 1.5 is an edit."""
    from archlab.study.runner import check_records

    study = load_study(str(mini(tmp_path, "recall", metric="accuracy")), data="mqar")
    url = storage_url(tmp_path, None)
    recorded = open_study(study, url)
    for value in (0.0, 1.0, 1.5):
        trial = finished("yoco", 0, 0, value, 0.002)
        trial.user_attrs["flops_per_step"] = 1e9
        recorded.add_trial(trial)
        if value <= 1:
            check_records(recorded, url)
    with pytest.raises(StorageError, match=re.escape("trial 2: value: input should be less than or equal to 1 (got 1.5)")):
        check_records(recorded, url)


def test_an_in_memory_storage_is_refused(tmp_path, cli):
    """It would vanish with the worker (and it failed inside Optuna with a traceback)."""
    code, _, stderr = cli("study", "run", mini(tmp_path), "--storage", "sqlite://", "--out", tmp_path / "out")
    assert code == 1 and "Traceback" not in stderr, stderr
    assert "sqlite:// is an in-memory database: the study would end with this process" in stderr


def test_a_sqlite_storage_with_no_file_to_be_is_refused_before_the_corpus_is_tokenized(tmp_path, cli):
    """A folder, or a file in a folder not there: the first worker tokenized the corpus, then said
    SQLite's "unable to open database file"; the report said "no SQLite database" of the folder."""
    (tmp_path / "dbdir").mkdir()
    folder = f"names a folder, {tmp_path / 'dbdir'}, not a SQLite database file"
    for url, said in ((f"sqlite:///{tmp_path / 'dbdir'}", {"run": folder, "report": folder}),
                      (f"sqlite:///{tmp_path / 'nodir/x.db'}", {"run": f"there is no folder {tmp_path / 'nodir'} to hold its database; make it first",
                                                               "report": f"no SQLite database {tmp_path / 'nodir/x.db'}"})):
        for command in ("run", "report"):
            code, _, stderr = cli("study", command, mini(tmp_path), "--storage", url, "--out", tmp_path / "out")
            assert code == 1 and said[command] in " ".join(stderr.split()), stderr
        assert not (tmp_path / "out" / "data").exists() and not (tmp_path / "nodir").exists()


def test_a_study_in_a_database_opened_read_only_is_reported_and_not_run(tmp_path, cli):
    """A ``file:`` URI read-only (``?mode=ro&uri=true``): the report said there was no database (the
    URI read as a file's name) and, found, failed on loading the study with a write; a run trained
    a trial, then said it had lost the storage."""
    out = tmp_path / "out"
    code, _, stderr = cli("study", "run", mini(tmp_path), "--out", out)
    assert code in OK, stderr
    database = out / "optuna.db"
    saved = database.read_bytes()
    read_only = f"sqlite:///file:{database}?mode=ro&uri=true"
    for uri in (read_only, read_only.replace("uri=true", "uri=1")):  # SQLAlchemy reads any true value as one
        code, stdout, stderr = cli("study", "report", mini(tmp_path), "--storage", uri, "--out", tmp_path / "report")
        assert code in OK and "| yoco-u |" in stdout, stderr
    code, _, stderr = cli("study", "run", mini(tmp_path), "--storage", read_only, "--out", out)
    assert code == 1 and "opens its database read-only (mode=ro), and a study run records its trials there" in " ".join(stderr.split()), stderr
    assert database.read_bytes() == saved
    code, _, stderr = cli("study", "report", mini(tmp_path), "--storage", f"sqlite:///file:{tmp_path / 'none.db'}?mode=ro&uri=true",
                          "--out", tmp_path / "report")
    assert code == 1 and f"no SQLite database {tmp_path / 'none.db'}" in stderr, stderr


@pytest.mark.parametrize("made", [lambda db: db.execute("create table kept (a)"), lambda db: None], ids=["another's", "empty"])
def test_a_report_of_a_database_holding_no_studies_writes_nothing_there(cli, tmp_path, made):
    """Opening a storage writes Optuna's tables into it: a report given another program's SQLite
    file, or an empty one, refused it with a dozen tables added."""
    database = tmp_path / "other.db"
    with contextlib.closing(sqlite3.connect(database)) as db:
        made(db)
        db.commit()
    saved = database.read_bytes()
    code, _, stderr = cli("study", "report", mini(tmp_path), "--storage", f"sqlite:///{database}", "--out", tmp_path / "report")
    assert code == 1 and f"SQLite database {database} holds no Optuna studies (it has no studies table)" in " ".join(stderr.split()), stderr
    assert database.read_bytes() == saved


def test_a_killed_worker_is_detected_and_its_trial_retried(tmp_path, cli):
    # one planned trial, long enough to be caught training: the next run has its retry alone to train
    path = mini(tmp_path, "killed", {"yoco": {"spec": "yoco.yaml"}}, steps=150, lr={"low": 0.003, "high": 0.003, "points": 1})
    out, url = tmp_path / "out", f"sqlite:///{tmp_path / 'out' / 'optuna.db'}"
    worker = subprocess.Popen([sys.executable, "-m", "archlab", "study", "run", str(path), "--out", str(out), "--grace-period", "2"],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and worker.poll() is None and not (out / "trials").is_dir():  # storage made, a trial claimed
        time.sleep(0.1)
    assert worker.poll() is None, "the worker ended before training its trial"
    study = optuna.load_study(study_name="killed-tiny", storage=url)
    while time.time() < deadline and worker.poll() is None:  # until it has reported an evaluation: caught training
        if any(t.state.name == "RUNNING" and t.intermediate_values for t in study.get_trials(deepcopy=False)):
            break
        time.sleep(0.05)
    worker.send_signal(signal.SIGKILL)
    assert worker.wait() == -signal.SIGKILL
    with no_longer_than(600):  # a run that never found the trial stale would wait for it for ever
        code, stdout, stderr = cli("study", "run", path, "--out", out, "--grace-period", "2")
    assert code in OK, stderr
    trials = trials_of(url, "killed")
    stale = [t for t in trials if t.state.name == "FAIL"]
    assert len(stale) == 1
    done = settled(trials)
    assert len(done) == 1 and all(t.state.name == "COMPLETE" for t in done.values()) and len(trials) == 2
    retry = [t for t in done.values() if t.system_attrs.get("failed_trial") == stale[0].number]
    assert len(retry) == 1
    # the report counts the planned trial once, by its retry, and says what became of the first attempt
    assert "1 planned: 1 complete, 0 running, 0 waiting, 0 failed, 0 pruned; 1 lost their worker" in stdout
    assert stdout.count("| 0/0 |") == 1
    assert f"| {stale[0].number} | {planned_as(stale[0])[0]} |" in stdout
    assert "stopped sending heartbeats after step" in stdout and f"| trial {retry[0].number}, complete |" in stdout


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_a_report_mid_study_says_it_is_incomplete(tmp_path):
    study = load_study(str(mini(tmp_path, "partial")))
    out = tmp_path / "out"
    url = storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=60)
    run_trial(study, optuna_study, optuna_study._pop_waiting_trial_id(), out, url)
    optuna_study._pop_waiting_trial_id()  # claimed by a worker still training it
    text = report(study, optuna_study, out, url)
    assert "4 planned: 1 complete, 1 running, 2 waiting, 0 failed, 0 pruned; **incomplete**: the table covers only the 1 of 4 that have finished" in text
    assert "Failed trials" not in text
    for fmt in (Format.json, Format.csv):  # no header to say so: a notice does (a script read a table of nulls, as if whole)
        with pytest.warns(UserWarning, match="study partial-tiny is incomplete: the table covers only the 1 of 4 planned trials that have finished"):
            report(study, optuna_study, out, url, fmt)


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_trials_trained_under_another_definition_are_not_reported_as_this_ones(tmp_path, cli):
    path, out = mini(tmp_path, "edited", steps=2), tmp_path / "out"
    study = load_study(str(path))
    url = storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=60)
    run_trial(study, optuna_study, optuna_study._pop_waiting_trial_id(), out, url)  # yoco, seed 0, lr slot 0 (lr 0.002)
    trained = optuna_study.get_trials()[0]
    edit = functools.partial(rewrite, path)
    edit(lr={"low": 0.001, "high": 0.004, "points": 2})
    for command in ("run", "report"):
        code, _, stderr = cli("study", command, path, "--out", out)
        assert code == 1 and "Traceback" not in stderr, stderr
        assert "holds 1 trial that trained under another definition" in stderr
        assert "yoco seed 0 lr slot 0: lr 0.002 -> 0.001" in stderr
    after = trials_of(url, "edited")
    assert len(after) == 4 and after[0].state.name == "COMPLETE" and after[0].value == trained.value  # kept as it was
    # a change that no started trial trained under, and a new seed, are fine: the new seed's trials are planned
    edited = edit(lr={"low": 0.002, "high": 0.008, "points": 2}, seeds=[0, 1])
    check_unchanged(edited, optuna_study)
    assert len(join(edited, out, url, grace_period=60).get_trials()) == 8
    edited = edit(variants={"yoco": {"spec": "yoco.yaml", "set": {"init_std": 0.01}}, "yoco-u": {"spec": "yoco-u.yaml"}})
    with pytest.raises(StudyChanged, match=r"spec\.init_std 0\.02 -> 0\.01"):
        check_unchanged(edited, optuna_study)
    with pytest.raises(StudyChanged, match=r"yoco seed 0 lr slot 0: lr 0\.002 \(a grid point\) -> drawn over \[0\.002, 0\.008\] \(tpe\); "):
        check_unchanged(edit(sampler="tpe"), optuna_study)  # it listed lr[0] (absent) -> 0.002, lr[1] (absent) -> 0.008
    edited = edit(sampler="grid")
    # a trial recorded before trials kept their setup is checked by the lr and steps it kept
    legacy = optuna.create_study(study_name="edited-tiny")
    legacy.add_trial(optuna.trial.create_trial(
        params={"variant": "yoco", "seed": 0, "slot": 1}, value=2.0, user_attrs={"lr": 0.004, "steps": 2},
        distributions={"variant": optuna.distributions.CategoricalDistribution(["yoco", "yoco-u"]),
                       "seed": optuna.distributions.CategoricalDistribution([0, 1]), "slot": optuna.distributions.IntDistribution(0, 1)}))
    with pytest.raises(StudyChanged, match=r"yoco seed 0 lr slot 1: lr 0\.004 -> 0\.008\n"):
        check_unchanged(edited, legacy)
    # a training config field added to archlab since a trial ran trains as before it existed, at its default
    older = optuna.create_study(study_name="edited-tiny")
    now = edit(variants={"yoco": {"spec": "yoco.yaml"}, "yoco-u": {"spec": "yoco.yaml"}})
    setup = now.setup("yoco-u", 1)
    before_init = {**setup, "train": {key: value for key, value in setup["train"].items() if key != "init"}}
    older.add_trial(optuna.trial.create_trial(
        params={"variant": "yoco-u", "seed": 0, "slot": 1}, value=2.0, user_attrs={"setup": before_init},
        distributions={"variant": optuna.distributions.CategoricalDistribution(["yoco", "yoco-u"]),
                       "seed": optuna.distributions.CategoricalDistribution([0, 1]), "slot": optuna.distributions.IntDistribution(0, 1)}))
    check_unchanged(now, older)
    tiny = yaml.safe_load(path.read_text())["scales"]["tiny"]
    with pytest.raises(StudyChanged, match=r"train\.grad_clip 1 -> 0\.5"):
        check_unchanged(edit(scales={"tiny": {**tiny, "train": {**tiny["train"], "grad_clip": 0.5}}}), older)


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_a_study_whose_text_changed_since_its_trials_ran_is_refused(tmp_path, cli):
    """Removing the shared corpus, as the refusal of the changed text allows, tokenizes the new text:
    the trials still to run would train on it beside those that trained on the old."""
    text = tmp_path / "text.txt"
    first = "".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(1500))
    text.write_text(first)
    bpe = {"vocab_size": 512}  # a tokenizer trained on the text, which another text changes
    path = mini(tmp_path, "retexted", steps=2, variants={"yoco": {"spec": "yoco.yaml", "set": bpe}, "yoco-u": {"spec": "yoco-u.yaml", "set": bpe}})
    out = tmp_path / "out"
    tiny = yaml.safe_load(path.read_text())["scales"]["tiny"]
    study = rewrite(path, scales={"tiny": {**tiny, "train": {**tiny["train"], "data": {"source": str(text)}}}})
    url = storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=60)
    assert run_trial(study, optuna_study, claim(optuna_study, url, out), out, url)
    text.write_text("".join(f"class K{i}(Base):\n    size = {i} ** 2\n" for i in range(1500)))  # tokenized otherwise too
    code, _, stderr = cli("study", "run", path, "--out", out)
    assert code == 1 and "held before it changed" in stderr, stderr  # the shared corpus's own refusal
    subprocess.run(["rm", "-r", str(out / "data")], check=True)  # as that refusal allows
    tokenizer = (out / "tokenizer.json").read_bytes()
    code, _, stderr = cli("study", "run", path, "--out", out)
    said = " ".join(stderr.split())
    assert code == 1 and "Traceback" not in stderr and "the 1 trial of retexted-tiny run so far trained on another corpus than" in said, stderr
    assert not (out / "data").exists() and (out / "tokenizer.json").read_bytes() == tokenizer  # as it found them
    assert [t.state for t in trials_of(url, "retexted")].count(TrialState.COMPLETE) == 1  # nothing else trained
    text.write_text(first)  # put back: tokenized again to the same tokens, the study goes on
    assert len(join(study, out, url, grace_period=60).get_trials()) == 4


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_variants_and_seeds_may_be_added_and_removed_after_trials_ran(tmp_path):
    path, out = mini(tmp_path, "grown", steps=2, lr={"low": 0.003, "high": 0.003, "points": 1}), tmp_path / "out"
    study = load_study(str(path))
    url = storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=60)
    assert run_trial(study, optuna_study, claim(optuna_study, url, out), out, url)  # yoco seed 0; yoco-u seed 0 is still queued
    log = io.StringIO()
    shrunk = rewrite(path, variants={"yoco": {"spec": "yoco.yaml"}}, seeds=[0, 1])
    work(shrunk, out, None, Console(file=log, width=200), grace_period=60)
    now = {planned_as(t): t for t in trials_of(url, "grown")}
    assert now[("yoco", 1, 0)].state.name == "COMPLETE"  # the added seed trained
    dropped = now[("yoco-u", 0, 0)]  # the removed variant's queued trial is left to workers that plan it, not trained
    assert dropped.state.name == "WAITING" and "yoco-u" not in log.getvalue()
    regrown = rewrite(path, variants={"yoco": {"spec": "yoco.yaml"}, "yoco-u": {"spec": "yoco-u.yaml"}})  # put back: trained
    work(regrown, out, None, Console(file=log, width=200), grace_period=60)
    done = settled(trials_of(url, "grown"))
    assert sorted(done) == [("yoco", 0, 0), ("yoco", 1, 0), ("yoco-u", 0, 0), ("yoco-u", 1, 0)]
    assert all(t.state.name == "COMPLETE" for t in done.values()) and not failures(regrown, trials_of(url, "grown"))


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_a_trial_taken_by_a_worker_that_died_before_training_goes_stale_even_mid_claim(tmp_path):
    study, out = load_study(str(mini(tmp_path, "claimed"))), tmp_path / "out"
    url = storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=1)
    claimed = claim(optuna_study, url, out)  # the worker dies here, before its heartbeat thread starts
    storage, taken = optuna_study._storage, []

    class Killed(BaseException):
        """The worker's death, as SIGKILL would leave it: nothing below the take runs."""

    def killed_once_taken(trial_id, state, values=None):  # a kill inside the claim, right after the take
        taken.append(trial_id)
        assert type(storage).set_trial_state_values(storage, trial_id, state, values)
        raise Killed

    with pytest.MonkeyPatch.context() as patch, pytest.raises(Killed):
        patch.setattr(storage, "set_trial_state_values", killed_once_taken)
        claim(optuna_study, url, out)
    deadline = time.time() + 60  # well past the grace period (SQLite's clock counts whole seconds: stale within 3 s)
    while True:
        fail_stale_trials(optuna_study)  # what the next worker does first
        if all(storage.get_trial(dead).state.name != "RUNNING" for dead in (claimed, *taken)) or time.time() > deadline:
            break
        time.sleep(0.2)
    for dead in (claimed, *taken):
        stale = optuna_study._storage.get_trial(dead)
        retry = [t for t in optuna_study.get_trials() if t.system_attrs.get("failed_trial") == stale.number]
        assert stale.state.name == "FAIL" and len(retry) == 1 and retry[0].state.name == "WAITING"
        assert planned_as(retry[0]) == planned_as(stale)


CLAIMER = """
import sys, time
from pathlib import Path
import numpy as np
import optuna
from optuna.storages import RDBStorage
from archlab.study.runner import claim
url, out, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
study = optuna.load_study(study_name="race", storage=RDBStorage(url, heartbeat_interval=1, grace_period=60,
                                                               engine_kwargs={"connect_args": {"timeout": 60}}))
Path(f"{out}.ready").touch()  # imported and connected: the test starts every worker at once
while not go.exists():
    time.sleep(0.01)
claimed = []
while (trial_id := claim(study, url, out)) is not None:
    claimed.append(trial_id)
print(*claimed)
"""


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_workers_on_one_sqlite_file_never_claim_the_same_trial(tmp_path):
    """SQLite ignores the SELECT ... FOR UPDATE that makes an Optuna claim one worker's. The
    workers share the storage, not a study folder (each its own --out)."""
    url, go = f"sqlite:///{tmp_path / 'optuna.db'}", tmp_path / "go"
    queued = optuna.create_study(study_name="race", storage=url)
    for k in range(100):  # without the lock, 4 workers claimed some 15 of 100 twice
        queued.enqueue_trial({"k": k})
    (tmp_path / "claimer.py").write_text(CLAIMER)
    workers = [subprocess.Popen([sys.executable, str(tmp_path / "claimer.py"), url, str(tmp_path / f"out{i}"), str(go)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    ready = [tmp_path / f"out{i}.ready" for i in range(4)]
    deadline = time.time() + 300
    while not all(r.exists() for r in ready) and time.time() < deadline and all(w.poll() is None for w in workers):
        time.sleep(0.05)  # until every worker has imported and is waiting
    go.touch()
    outputs = [w.communicate(timeout=300) for w in workers]
    assert all(w.returncode == 0 for w in workers), [stderr for _, stderr in outputs]
    claims = [int(t) for stdout, _ in outputs for t in stdout.split()]
    assert sorted(claims) == [t._trial_id for t in queued.get_trials()]  # each trial claimed once


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_a_metric_that_is_not_a_number_fails_the_trial_with_that_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "evaluate", lambda self, data: {"eval_loss": float("nan"), "eval_ppl": float("nan")})
    study, out = load_study(str(mini(tmp_path, "nan", steps=4))), tmp_path / "out"
    url = storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=60)
    assert run_trial(study, optuna_study, claim(optuna_study, url, out), out, url)
    trial = optuna_study.get_trials()[0]
    assert trial.state.name == "FAIL" and not trial.intermediate_values  # stopped at its first evaluation
    why = "TrainError: evaluation loss became nan after step 2; training stopped before logging or saving it, no checkpoint had been written"
    assert [row["why"] for row in failures(study, optuna_study.get_trials())] == [why]


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_a_worker_whose_trial_was_taken_over_goes_on(tmp_path, monkeypatch):
    path = mini(tmp_path, "paused", {"yoco": {"spec": "yoco.yaml"}}, steps=2, lr={"low": 0.003, "high": 0.003, "points": 1})
    study, out = load_study(str(path)), tmp_path / "out"
    fit, taken = Trainer.fit, []

    def paused(self, steps, **kwargs):  # while this worker is stopped, another fails its trial as stale and queues it again
        if not taken:
            optuna_study = join(study, out, storage_url(out, None), grace_period=60)
            taken.append(optuna_study.get_trials(states=(optuna.trial.TrialState.RUNNING,))[0])
            optuna_study._storage.set_trial_state_values(taken[0]._trial_id, optuna.trial.TrialState.FAIL)
            RetryHeartbeatStaleTrialCallback(max_retry=2)(optuna_study, taken[0])
        return fit(self, steps, **kwargs)

    monkeypatch.setattr(Trainer, "fit", paused)
    log = io.StringIO()
    optuna_study = work(study, out, None, Console(file=log, width=200), grace_period=60)
    assert f"trial {taken[0].number} (yoco seed 0 lr slot 0) was taken over: this worker sent no heartbeat for over 60 s" in log.getvalue()
    first, retry = optuna_study.get_trials()
    assert first.state.name == "FAIL" and "failure" not in first.user_attrs and not first.intermediate_values  # left as the other worker left it
    assert retry.state.name == "COMPLETE" and retry.system_attrs["failed_trial"] == first.number


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_a_report_reads_only_a_study_that_is_there(tmp_path, cli):
    path, out = mini(tmp_path, "named"), tmp_path / "out"
    study = load_study(str(path))
    url = storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=60)  # planned; nothing trained yet
    report(study, optuna_study, tmp_path / "new" / "dir", url)  # a directory not yet there
    assert (tmp_path / "new" / "dir" / "report.md").is_file() and (tmp_path / "new" / "dir" / "curves.png").is_file()
    (out / "report.md").write_text("kept")
    code, _, stderr = cli("study", "report", mini(tmp_path, "renamed"), "--out", out)
    assert code == 1 and "Traceback" not in stderr, stderr
    assert f"error: no study renamed-tiny in {url}; it holds named-tiny (was the study renamed" in " ".join(stderr.split())
    assert (out / "report.md").read_text() == "kept" and optuna.get_all_study_names(url) == ["named-tiny"]


def test_an_interrupted_worker_says_what_becomes_of_its_trial(tmp_path):
    path, out = mini(tmp_path, "interrupted", steps=150), tmp_path / "out"
    worker = subprocess.Popen([sys.executable, "-m", "archlab", "study", "run", str(path), "--out", str(out)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
    deadline = time.time() + 300
    while time.time() < deadline and not (out / "trials").is_dir():
        time.sleep(0.1)
    worker.send_signal(signal.SIGINT)
    _, stderr = worker.communicate(timeout=60)
    assert worker.returncode == 130 and "Traceback" not in stderr, stderr
    assert ("interrupted; finished trials are kept, and a trial this worker was training runs again once it has sent no"
            " heartbeat for --grace-period (60 s): taken by a worker still running, or by the next `study run`") in " ".join(stderr.split())
    (trial,) = [t for t in trials_of(f"sqlite:///{out / 'optuna.db'}", "interrupted") if t.state.name == "RUNNING"]
    assert trial.user_attrs["stopped_worker"] == trial.user_attrs["worker"]  # the report counts it as stopped, not running
    assert trial.user_attrs["stopped_by"] == "Ctrl-C or SIGTERM"


def test_a_worker_interrupted_as_it_writes_the_report_says_so(tmp_path, cli, monkeypatch):
    """A Ctrl-C that comes once the trials are done, while the report and plots are written, stops
    the worker as one during a trial does, saying so: it ended the worker with no word."""
    import archlab.study.report

    path, out = mini(tmp_path, "late", steps=2), tmp_path / "out"
    assert cli("study", "run", path, "--out", out)[0] in OK

    def interrupted(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(archlab.study.report, "report", interrupted)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # not ignored, as in a shell's background job
    try:
        code, _, stderr = cli("study", "run", path, "--out", out)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130 and "Traceback" not in stderr, stderr
    assert ("interrupted as the report was written; every trial is kept, and `archlab study report` writes the report"
            in " ".join(stderr.split()))


def test_a_worker_sent_sigterm_as_it_writes_the_report_says_so_and_exits_143(tmp_path, cli, monkeypatch):
    """SIGTERM, as docker stop sends it, once the trials are done: the report is written within the
    worker's handling of it, as the trials are, not under whatever handler the process had."""
    import archlab.study.report

    path, out = mini(tmp_path, "late-term", steps=2), tmp_path / "out"
    assert cli("study", "run", path, "--out", out)[0] in OK

    def terminated(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)
        return ""

    monkeypatch.setattr(archlab.study.report, "report", terminated)
    unhandled = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: unhandled.append(signum))  # not the test process's end
    try:
        code, _, stderr = cli("study", "run", path, "--out", out)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143 and not unhandled and "Traceback" not in stderr, (code, stderr)
    assert "interrupted as the report was written; every trial is kept" in " ".join(stderr.split())


def test_a_ctrl_c_during_a_storage_call_lands_once_the_call_is_done(tmp_path):
    """A SIGINT that comes while optuna writes to the study's storage is raised when the write is
    done: cut inside SQLAlchemy's session, a write could leave SQLite locked, and the worker's last
    write, marking its trial as stopped, waited a minute for it."""
    database = tmp_path / "optuna.db"
    storage = WholeCallsStorage(f"sqlite:///{database}", engine_kwargs={"connect_args": {"timeout": 1}})
    trial_id = optuna.create_study(storage=storage).ask()._trial_id
    libraries = tuple(str(Path(library.__file__).parent) for library in (optuna, sqlalchemy))
    lines = []

    def count(frame, event, arg):
        lines.append(event == "line" and frame.f_code.co_filename.startswith(libraries))
        return count

    storage.set_trial_user_attr(trial_id, "cut at", 0)
    sys.settrace(count)
    storage.set_trial_user_attr(trial_id, "cut at", 0)  # as each below: its statements cached, its row there
    sys.settrace(None)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # not ignored, as in a shell's background job
    cuts = range(1, sum(lines), sum(lines) // 30)  # lines of optuna's storage and SQLAlchemy's session
    sent = []
    try:
        for cut in cuts:
            seen = iter(range(cut))

            def interrupt(frame, event, arg):
                if event == "line" and frame.f_code.co_filename.startswith(libraries) and next(seen, None) is None:
                    sys.settrace(None)
                    sent.append(cut)
                    signal.raise_signal(signal.SIGINT)
                return interrupt

            try:
                sys.settrace(interrupt)
                storage.set_trial_user_attr(trial_id, "cut at", cut)
                raised = False
            except KeyboardInterrupt:
                raised = True
            sys.settrace(None)
            assert raised == (cut in sent), cut  # a call that ran fewer lines than the one counted (seen in a full suite) is not cut
            other = sqlite3.connect(database, timeout=0)
            other.execute("BEGIN IMMEDIATE")  # no lock left held: "database is locked" if there were
            other.close()
            assert storage.get_trial_user_attrs(trial_id)["cut at"] == cut  # written whole
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGINT, previous)
    assert len(sent) >= len(cuts) - 2, (sent, list(cuts))


def test_a_report_of_a_postgresql_database_holding_no_studies_writes_nothing_there(tmp_path, cli):
    """Opening a storage writes Optuna's tables into its database: a report given another tool's
    PostgreSQL database refused it with a dozen tables added (SQLite's case: above)."""
    url = os.environ.get("ARCHLAB_TEST_POSTGRES")
    if not url:
        pytest.skip("ARCHLAB_TEST_POSTGRES is not set (.ci/run starts a PostgreSQL server and sets it)")
    name = f"other{uuid.uuid4().hex[:8]}"
    server = sqlalchemy.create_engine(make_url(url).set(database="postgres"), isolation_level="AUTOCOMMIT")
    with server.connect() as connection:
        connection.execute(sqlalchemy.text(f"create database {name}"))
    other = make_url(url).set(database=name)
    try:
        code, _, stderr = cli("study", "report", mini(tmp_path), "--storage", other.render_as_string(hide_password=False),
                              "--out", tmp_path / "report")
        assert code == 1 and f"{other.render_as_string()} holds no Optuna studies (it has no studies table)" in " ".join(stderr.split()), stderr
        engine = sqlalchemy.create_engine(other)
        assert sqlalchemy.inspect(engine).get_table_names() == []
        engine.dispose()
    finally:
        with server.connect() as connection:
            connection.execute(sqlalchemy.text(f"drop database {name} with (force)"))
        server.dispose()


def test_two_workers_share_a_postgresql_study(tmp_path):
    url = os.environ.get("ARCHLAB_TEST_POSTGRES")
    if not url:
        pytest.skip("ARCHLAB_TEST_POSTGRES is not set (.ci/run starts a PostgreSQL server and sets it)")
    url = make_url(url).set(password="hunter2").render_as_string(hide_password=False)  # the test server trusts any
    name = f"pg{uuid.uuid4().hex[:8]}"
    variants = {v: {"spec": f"{v}.yaml"} for v in ("yoco", "yoco-u", "upper-loop", "deeper")}
    path = mini(tmp_path, name, variants, steps=8)
    command = [sys.executable, "-m", "archlab", "study", "run", str(path), "--storage", url]
    workers = [subprocess.Popen([*command, "--out", str(tmp_path / f"w{i}")], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}) for i in range(2)]
    for worker in workers:
        stdout, stderr = worker.communicate(timeout=600)
        assert worker.returncode == 0, stderr
        assert "hunter2" not in stdout + stderr and f"{make_url(url).username}:***@" in stdout  # the storage, not its password
    trials = trials_of(url, name)
    keys = [planned_as(t) for t in trials]
    assert len(trials) == 8 and len(set(keys)) == 8  # every planned trial once: none lost, none duplicated
    assert all(t.state.name == "COMPLETE" for t in trials), [(t.number, t.state.name, t.user_attrs.get("failure")) for t in trials]
    assert len({t.user_attrs["worker"] for t in trials}) == 2  # both workers took trials


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_a_pruned_trial_is_logged_with_where_it_was_cut(tmp_path, monkeypatch):
    monkeypatch.setattr(optuna.Trial, "should_prune", lambda self: True)  # every trial, at its first evaluation
    path = mini(tmp_path, "cut", {"yoco": {"spec": "yoco.yaml"}}, pruner="median", lr={"low": 0.003, "high": 0.003, "points": 1})
    log = io.StringIO()
    (trial,) = work(load_study(str(path)), tmp_path / "out", None, Console(file=log, width=200), grace_period=60).get_trials()
    assert trial.state.name == "PRUNED" and list(trial.intermediate_values) == [2]
    assert f"trial 0 (yoco seed 0 lr slot 0): pruned at step 2 (val_loss {trial.intermediate_values[2]:.4f} there)" in log.getvalue()
    definition = yaml.safe_load(path.read_text())
    definition["scales"]["tiny"]["train"]["steps"] = 2  # its first evaluation is its last
    path.write_text(yaml.safe_dump({**definition, "name": "whole"}))
    (trial,) = work(load_study(str(path)), tmp_path / "whole", None, Console(file=io.StringIO()), grace_period=60).get_trials()
    assert trial.state.name == "COMPLETE" and trial.value == trial.intermediate_values[2]  # its last evaluation: trained whole


@pytest.mark.parametrize("given", ["0", "604801", str(10**20)])
def test_a_grace_period_under_a_second_or_over_a_week_is_refused_before_anything_is_written(tmp_path, cli, given):
    """10**20 s was stored with the study, and then overflowed Optuna's check of a heartbeat's age
    in every later run and report: a traceback, and advice to give that value again."""
    code, _, stderr = cli("study", "run", mini(tmp_path), "--out", tmp_path / "out", "--grace-period", given)
    assert code == 2 and "--grace-period" in stderr and "Traceback" not in stderr, stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["run", "report"])
@pytest.mark.parametrize("data", ["", "  "])
def test_an_empty_data_override_is_refused_rather_than_read_as_none(tmp_path, cli, command, data):
    """``--data ''`` (a variable left unset) trained the study's own data, saying nothing, as
    ``train --data ''`` once did."""
    code, _, stderr = cli("study", command, mini(tmp_path), "--out", tmp_path / "out", "--data", data)
    assert code == 2 and "--data is empty" in stderr and "Traceback" not in stderr, stderr
    assert not (tmp_path / "out").exists()


def test_bad_study_definitions_are_named(tmp_path, cli):
    path = mini(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["baseline"] = "gpt"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError, match="'gpt' is not one of the variants"):
        load_study(str(path))
    path.write_text(yaml.safe_dump({**data, "baseline": "yoco", "seeds": [0, -1]}))
    with pytest.raises(SpecError, match=r"seeds\[1\]: Input should be greater than or equal to 0"):
        load_study(str(path))
    for changes, problem in [
        ({"lr": {"low": 0.003, "high": 0.003, "points": 2}}, "lr: low = high = 0.003 gives 2 equal learning rates"),
        ({"lr": {"low": 0.004, "high": 0.002, "points": 2}}, "lr: low=0.004 is above high=0.002"),  # a grid run backwards, a range TPE refuses
        ({"seeds": [0, 1, 0]}, "seeds[2]: seed 0 is listed twice"),
        ({"variants": {**data["variants"], "yoco-u": {**data["variants"]["yoco-u"], "scale_set": {"tinyy": {"loop.times": 2}}}}},
         "variants.yoco-u.scale_set.tinyy: no scale 'tinyy'; this study has ['tiny']"),
        ({"variants": {**data["variants"], "a|b": data["variants"]["yoco"]}}, "variants.a|b: a variant's name is letters, digits"),
        ({"name": "../../outside"}, "name: a study's name is letters, digits"),  # it names the default --out folder
        ({"name": "n" * 250}, "name: a study's name is at most 100 characters (this one has 250): it names the trials' folders"),  # each trial failed
        ({"variants": {**data["variants"], "V" * 300: data["variants"]["yoco"]}}, f"variants.{'V' * 300}: a variant's name is at most 100"),
        ({"scales": {**data["scales"], "a/b": data["scales"]["tiny"]}}, "scales.a/b: a scale's name is letters, digits"),
        # study kk-x at scale tiny and study kk at scale x-tiny were one study: one key, kk-x-tiny, and one default --out
        ({"scales": {**data["scales"], "x-tiny": data["scales"]["tiny"]}}, "scales.x-tiny: a scale's name is letters, digits, '.' and '_'"
                                                                          " only: the study's key joins it to the study's name with '-'"),
        ({"lr": {"low": 0.001, "high": 0.003, "points": 100_000_000}}, "lr.points: Input should be less than or equal to 1000"),
        ({"report_seq_len": 10**30}, "report_seq_len: Input should be less than or equal to 1073741824"),  # a column of 10^24 MiB
        ({"lr": {"low": 1e-200, "high": 1e200, "points": 3}}, "lr: low=1e-200 and high=1e+200 are too far apart"),  # a grid of inf
        ({"lr": {"low": 1e-300, "high": 1e-200, "points": 1}}, "lr: low=1e-300 and high=1e-200 are too far apart"),  # their mean 0
        ({"variants": {**data["variants"], "yoco": {"spec": "yo\0co.yaml"}}}, "variants.yoco.spec: a path cannot hold a NUL byte"),
        ({"scales": {"tiny": {**data["scales"]["tiny"], "specs": str(ROOT / "specs/tiny/yoco.yaml")}}},
         f"scales.tiny.specs: {ROOT / 'specs/tiny/yoco.yaml'} is a file; give the folder holding the variants' specs"),
        ({"metric": "accuracy"}, "metric: accuracy is measured on the synthetic tasks ['mqar', 'copy'], but scale tiny trains on 'stdlib'"),
    ]:  # the last stays in the file
        path.write_text(yaml.safe_dump({**data, "baseline": "yoco", **changes}))
        with pytest.raises(SpecError, match=re.escape(problem)):
            load_study(str(path))
    assert load_study(str(path), data="mqar").definition.metric == "accuracy"  # a synthetic task measures it
    wider = {**data["variants"], "yoco-u": {**data["variants"]["yoco-u"], "set": {"vocab_size": 512}}}
    path.write_text(yaml.safe_dump({**data, "baseline": "yoco", "variants": wider}))
    with pytest.raises(SpecError, match=re.escape("variants: the variants' vocab_size differ (yoco 256, yoco-u 512), but their trials share"
                                                  " one corpus tokenized at one vocabulary")):
        load_study(str(path))
    assert load_study(str(path), data="mqar").specs["yoco-u"].vocab_size == 512  # a recall task of each vocabulary
    assert load_study(str(path), data=str(tmp_path / "ids.npy")).specs["yoco-u"].vocab_size == 512  # token ids: no tokenizer to share
    starved = mini(tmp_path, "starved", steps=1, budget="flops")  # yoco-u's step costs more than yoco's whole run
    with pytest.raises(SpecError, match=re.escape("variants.yoco-u: budget: flops gives it 0 steps: one of its steps costs more"
                                                  " training FLOPs than the baseline's whole run (steps: 1); raise scales.tiny.train.steps to at least 2")):
        load_study(str(starved))
    for variant, source, problem in [  # a variant's spec file, or its overrides, named with the variant
        ({"spec": "nosuch.yaml"}, f"{ROOT / 'specs/tiny/nosuch.yaml'} (variants.yoco-u of {path})", "<file>"),
        ({"spec": "yoco.yaml", "set": {"layout.self_decoder.blocks.5.window": 3}}, f"{path} (variants.yoco-u: set / scale_set.tiny)",
         "layout.self_decoder.blocks.5"),
        ({"spec": "yoco.yaml", "set": {"layout.self_decoder.blocks.0.window": 8, "layout.self_decoder.blocks.0": {"type": "swa", "n_heads": 4}}},
         f"{path} (variants.yoco-u: set / scale_set.tiny)", "layout.self_decoder.blocks.0"),  # the window would be lost
        ({"spec": "yoco.yaml", "set": {"loop..times": 2}}, f"{path} (variants.yoco-u: set / scale_set.tiny)", "'loop..times'"),  # was "loop."
        ({"spec": "yoco.yaml", "set": {1: 2}}, str(path), "variants.yoco-u.set"),  # was "variants.yoco-u.set[1].[key]"
    ]:
        path.write_text(yaml.safe_dump({**data, "baseline": "yoco", "variants": {**data["variants"], "yoco-u": variant}}, sort_keys=False))
        with pytest.raises(SpecError) as raised:
            load_study(str(path))
        assert raised.value.source == source and [p.loc for p in raised.value.problems] == [problem]
    with pytest.raises(SpecError, match="no scale 'huge'"):
        load_study("loop-position", "huge")
    block = {"type": "swa", "window": 4, "n_heads": 4, "n_kv_heads": 2}
    scaled = {"spec": "yoco.yaml", "set": {"layout.self_decoder.blocks.0.window": 8},  # a scale's own block replaces set's whole
              "scale_set": {"tiny": {"layout.self_decoder.blocks.0": block, "layout.self_decoder.blocks.0.window": 16}}}
    path.write_text(yaml.safe_dump({**data, "baseline": "yoco", "variants": {**data["variants"], "yoco-u": scaled}}, sort_keys=False))
    assert load_study(str(path)).specs["yoco-u"].layout.self_decoder.blocks[0].window == 16
    with pytest.raises(SpecError, match="no file or shipped study of that name"):
        load_study("loop-placement")
    code, _, stderr = cli("study", "run", "loop-placement")
    assert code == 1 and "shipped:" in stderr and "Traceback" not in stderr, stderr
    code, _, stderr = cli("study", "run", path.parent)
    assert code == 1 and "is a folder; give a study file (.yaml) or the name of a shipped study" in stderr, stderr
    (path.parent / "corpus.txt").write_text("text\n")  # there, but no study: it was said to be no file
    with pytest.raises(SpecError, match=re.escape("<study>: is not a study file (.yaml or .yml), nor a shipped study's name; shipped:")):
        load_study(str(path.parent / "corpus.txt"))
    (path.parent / "out" / "optuna.db").mkdir(parents=True)
    code, _, stderr = cli("study", "report", path, "--out", path.parent / "out")
    assert code == 1 and "its optuna.db is a folder, not a study's database" in stderr, stderr


def test_a_shipped_study_is_a_command(cli):
    code, stdout, stderr = cli("study", "window", "--help")
    assert code in OK and "Run (or join, or resume) a study" in stdout, stderr
    code, listed, stderr = cli("study", "--help")
    assert code in OK and all(name in listed for name in SHIPPED), stderr


def finished(variant, seed, slot, value, lr=None, state=TrialState.COMPLETE, curve=None):
    """A trial as a worker leaves it, planned as (variant, seed, slot), with its lr drawn by TPE."""
    params = {"variant": variant, "seed": seed, "slot": slot, **({"lr": lr} if lr else {})}
    distributions = {"variant": CategoricalDistribution(["yoco", "yoco-u"]), "seed": CategoricalDistribution([0, 1]),
                     "slot": CategoricalDistribution([0, 1]), "lr": FloatDistribution(1e-4, 1e-2, log=True)}
    return optuna.trial.create_trial(state=state, value=value if state == TrialState.COMPLETE else None, params=params,
                                     distributions={k: distributions[k] for k in params},
                                     intermediate_values=curve or {2: value, 4: value})


def test_the_trials_still_to_train_are_those_a_joining_worker_queues_retries_or_leaves_running(tmp_path):
    """A worker loads the weights of the starts of these alone. A trial failed with no reason and
    no retry (its worker died between failing it as stale and queueing its retry) is run again by
    no one, and was counted as still to train."""
    from archlab.study.runner import MAX_RETRY, NOT_PLANNED, _to_run

    study = load_study(str(mini(tmp_path, "left", variants={"yoco": {"spec": "yoco.yaml"}, "yoco-u": {"spec": "yoco-u.yaml"}}, seeds=[0, 1])))
    recorded = optuna.create_study()
    keys = sorted(study.planned())
    fail = functools.partial(finished, state=TrialState.FAIL)
    trials = [finished(*keys[0], 3.0), finished(*keys[1], None, state=TrialState.PRUNED), fail(*keys[2], None), fail(*keys[3], None),
              fail(*keys[4], None), fail(*keys[5], None), finished(*keys[6], None, state=TrialState.RUNNING)]  # keys[7]: none yet
    trials[2].user_attrs["failure"] = "TrainError: diverged"
    trials[3].user_attrs["failure"] = f"{NOT_PLANNED}: not in the plan"
    trials[5].system_attrs["retry_history"] = list(range(100, 100 + MAX_RETRY))  # retried as often as it may be
    for trial in trials:
        recorded.add_trial(trial)
    assert _to_run(study, recorded) == {keys[3], keys[5], keys[6], keys[7]}
    assert _to_run(study, None) == set(keys)


def test_a_baseline_with_no_evaluation_is_reported_without_the_comparison(tmp_path):
    """A baseline whose chosen trials share no evaluation step (a curve deleted from the storage)
    was a traceback in the report: min() of nothing."""
    study = load_study(str(mini(tmp_path, "bare")))
    recorded = optuna.create_study()
    for trial in (finished("yoco", 0, 0, 3.0, 0.002), finished("yoco-u", 0, 0, 2.5, 0.002)):
        trial.user_attrs["flops_per_step"] = 1e9
        if planned_as(trial)[0] == "yoco":  # the baseline
            trial.intermediate_values = {}
        recorded.add_trial(trial)
    text = report(study, recorded, tmp_path / "out", "sqlite:///study.db")
    assert re.search(r"\| yoco-u \|.*\| 2\.5000 \|", text) and "| yoco |" in text, text


def test_a_report_the_disk_cannot_hold_keeps_the_last_report_and_plots(tmp_path, monkeypatch):
    """report.md and the plots were written in place: a disk that filled as a report was rewritten
    left the first blocks of a PNG, or of the markdown, where the last whole ones had been. The
    report is shown before they are written: a full disk printed none."""
    study = load_study(str(mini(tmp_path, "full")))
    recorded = optuna.create_study()
    for trial in (finished("yoco", 0, 0, 3.0, 0.002), finished("yoco-u", 0, 0, 2.5, 0.002)):
        trial.user_attrs["flops_per_step"] = 1e9
        recorded.add_trial(trial)
    out = tmp_path / "out"
    report(study, recorded, out, "sqlite:///study.db")
    saved = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"report.md", "curves.png", "loss_vs_flops.png"} <= set(saved)
    for name in ("curves.png", "report.md"):  # each as a reporting past its size; the plots go first
        (out / name).write_bytes(b"an earlier " + name.encode())
        saved[name] = (out / name).read_bytes()
        if name == "report.md":
            monkeypatch.setattr("archlab.study.report.draw", lambda *args: {})  # only the markdown, then
        shown = []
        with files_no_bigger_than(200), pytest.raises(OSError) as raised:
            report(study, recorded, out, "sqlite:///study.db", show=shown.append)
        assert raised.value.filename == str(out / name), raised.value
        assert len(shown) == 1 and shown[0].startswith("# Study `full`") and "| yoco-u |" in shown[0], shown  # on screen all the same
        assert {p.name: p.read_bytes() for p in out.iterdir()} == saved, name  # as they were, and no temporary beside them


def test_a_storage_the_disk_cannot_create_is_said_and_leaves_no_empty_database(tmp_path):
    """SQLite makes the file before it writes the tables: a full disk left an empty optuna.db, which
    `study report` then read as a storage that holds no study."""
    study, database = load_study(str(mini(tmp_path, "full"))), tmp_path / "optuna.db"
    with files_no_bigger_than(0), pytest.raises(StorageError) as raised:
        open_study(study, f"sqlite:///{database}")
    assert str(raised.value).startswith(f"cannot open the study storage sqlite:///{database}: "), raised.value
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.yaml"]
    assert open_study(study, f"sqlite:///{database}").study_name == "full-tiny"  # once there is room


def test_a_median_pruner_weighs_a_trial_against_its_own_variant_and_seed():
    """yoco-u's curves lie far above yoco's here: against the median of all trials, every yoco-u
    trial would be cut; against yoco-u's own, one near their median goes on. Seed 1 is a worse
    seed: against seed 0's trials, its trial at the best rate was cut by its own twin."""
    study = optuna.create_study()
    for trial in (finished("yoco", 0, 0, 1.0), finished("yoco", 0, 1, 1.1), finished("yoco-u", 0, 0, 5.0), finished("yoco-u", 0, 1, 5.2)):
        study.add_trial(trial)
    running = finished("yoco-u", 0, 1, None, state=TrialState.RUNNING, curve={2: 5.05, 4: 5.05})
    median = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    assert median.prune(study, running)  # pooled: 5.05 is above the median of all four
    assert not SameVariantAndSeed(lambda: median).prune(study, running)
    worse = finished("yoco-u", 0, 1, None, state=TrialState.RUNNING, curve={2: 6.0, 4: 6.0})
    assert SameVariantAndSeed(lambda: median).prune(study, worse)
    twin = finished("yoco-u", 1, 0, None, state=TrialState.RUNNING, curve={2: 5.3, 4: 5.3})  # seed 1 at seed 0's best rate
    assert not SameVariantAndSeed(lambda: median).prune(study, twin)


def _runs(pruner, runs):
    """How each (variant, value at every evaluation, steps) run ends under ``pruner``, in order."""
    study = optuna.create_study(study_name="runs", pruner=pruner)  # the name places trials in Hyperband's brackets
    outcomes = []
    for slot, (variant, value, steps) in enumerate(runs):
        study.enqueue_trial({"variant": variant, "seed": 0, "slot": slot})
        trial = study.ask({"variant": CategoricalDistribution(["yoco", "yoco-u"]), "seed": CategoricalDistribution([0]),
                           "slot": CategoricalDistribution(list(range(len(runs))))})
        for step in range(2, steps + 1, 2):
            trial.report(value, step)
            if trial.should_prune():
                study.tell(trial, state=TrialState.PRUNED)
                outcomes.append(f"pruned at {step}")
                break
        else:
            study.tell(trial, value)
            outcomes.append("complete")
    return outcomes


def test_hyperband_weighs_a_trial_against_its_own_variant_and_its_steps():
    """yoco-u's best run lies above every yoco run: pooled Hyperband cuts it at its first rung.
    Per variant, its brackets are also sized by yoco-u's own steps (equal FLOPs: fewer of them)."""
    from archlab.study.runner import VariantHyperband

    runs = [("yoco", 1.0, 54), ("yoco", 1.1, 54), ("yoco", 1.2, 54), ("yoco-u", 5.2, 18), ("yoco-u", 5.1, 18), ("yoco-u", 5.0, 18)]
    assert _runs(optuna.pruners.HyperbandPruner(min_resource=2), runs)[3:] == ["pruned at 6"] * 3
    per_variant = SameVariantAndSeed(lambda: VariantHyperband(min_resource=2))
    assert _runs(per_variant, runs) == ["complete"] * 6  # the bracket's own view of the storage pruned the second
    per_variant = SameVariantAndSeed(lambda: VariantHyperband(min_resource=2))
    assert _runs(per_variant, runs + [("yoco", 1.5, 54)] * 2)[6:] == ["pruned at 6"] * 2  # worse runs of a variant still are


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_tpe_draws_differ_across_workers_and_resumes(tmp_path, monkeypatch):
    """Every worker process, and every resume, had a sampler seeded alike: its draws repeated."""
    monkeypatch.setattr(Trainer, "fit", lambda self, steps, **kw: [{"eval_loss": 1.0}])
    study = load_study(str(mini(tmp_path, "draws", {"yoco": {"spec": "yoco.yaml"}}, sampler="tpe",
                                lr={"low": 1e-4, "high": 1e-2, "points": 4})))
    out = tmp_path / "out"
    url = storage_url(out, None)
    for _ in range(2):  # two processes, one after the other: each opens the study afresh
        optuna_study = join(study, out, url, grace_period=60)
        for _ in range(2):
            assert run_trial(study, optuna_study, claim(optuna_study, url, out), out, url)
    lrs = [t.params["lr"] for t in optuna_study.get_trials()]
    assert len(lrs) == 4 and len(set(lrs)) == 4, lrs


def test_a_grid_lr_that_lost_a_seed_does_not_win_on_the_seeds_it_kept(tmp_path):
    """At 0.003 seed 0 diverged and seed 1 did well: scored on its survivor alone, it beat 0.002,
    where both seeds finished."""
    study = load_study(str(mini(tmp_path, "lost", seeds=[0, 1])))
    trials = [finished("yoco", 0, 0, 3.05, 0.002), finished("yoco", 1, 0, 3.05, 0.002),
              finished("yoco", 0, 1, None, 0.003, state=TrialState.FAIL, curve={2: 3.0}), finished("yoco", 1, 1, 2.90, 0.003)]
    (yoco, _) = summarize(study, trials)
    assert (yoco["val loss"], yoco["seeds"], yoco["best lr"], yoco["pruned"], yoco["failed"]) == (3.05, 2, 0.002, 0, 1)
    shown = readable(yoco, maximize=False)
    assert (shown["best lr"], shown["pruned/failed"]) == ("0.002", "0/1")
    assert "| yoco | " in (table := render([shown], Format.md)) and "| 3.0500 | 0.0000 | 2 |" in table
    # the rate it passed over is said, with its mean and seeds, rather than left for the reader to miss
    assert passed_over(study, trials) == [
        "- notice: `yoco` at lr 0.003 scored 2.9000, mean over 1 seed, better than the 3.0500 over 2 at its lr 0.002 in the table,"
        " which keeps the rates with the most seeds completed (its other seeds failed, were pruned or have not finished)"]
    assert passed_over(study, trials[:2] + [finished("yoco", 1, 1, 3.2, 0.003)]) == []  # a worse rate on fewer seeds goes unsaid


def test_a_grid_report_keeps_each_variants_best_rate_and_its_difference_from_the_baseline(tmp_path):
    """Every rate finished on both seeds, so the rate is chosen by its mean loss alone (the lower,
    for a loss); worked out by hand: its mean, its sample sd, and the variant's mean less the
    baseline's, negative where it does better."""
    study = load_study(str(mini(tmp_path, "grid", seeds=[0, 1])))
    trials = [finished("yoco", 0, 0, 3.0, 0.002), finished("yoco", 1, 0, 3.2, 0.002),
              finished("yoco", 0, 1, 2.8, 0.004), finished("yoco", 1, 1, 3.0, 0.004),
              finished("yoco-u", 0, 0, 2.5, 0.002), finished("yoco-u", 1, 0, 2.9, 0.002),
              finished("yoco-u", 0, 1, 3.3, 0.004), finished("yoco-u", 1, 1, 3.5, 0.004)]
    yoco, yoco_u = summarize(study, trials)
    shown = ("val loss", "best lr", "spread (sd)", "seeds", "vs baseline")
    assert tuple(yoco[k] for k in shown) == pytest.approx((2.9, 0.004, 0.02**0.5, 2, 0.0))
    assert tuple(yoco_u[k] for k in shown) == pytest.approx((2.7, 0.002, 0.08**0.5, 2, -0.2))
    assert tuple(readable(yoco_u, maximize=False)[k] for k in shown) == (2.7, "0.002", 0.2828, 2, "-0.2000")


def test_a_loss_studys_report_gives_the_chosen_rates_accuracy_and_a_dash_where_a_trial_has_none(tmp_path):
    """Where a reported trial scored an accuracy beside its loss (examples or a recall task), every
    row has the column: the mean over the seeds of the rate the table chose, as a percent; "-" for
    a variant one of whose chosen trials has none, or with no trial complete."""
    study = load_study(str(mini(tmp_path, "scored", seeds=[0, 1])))

    def scoring(trial, accuracy):
        trial.user_attrs = {} if accuracy is None else {"accuracy": accuracy}
        return trial

    yoco = [scoring(finished("yoco", 0, 0, 3.0, 0.002), 0.9), scoring(finished("yoco", 1, 0, 3.2, 0.002), 0.9),  # a rate not chosen
            scoring(finished("yoco", 0, 1, 2.8, 0.004), 0.25), scoring(finished("yoco", 1, 1, 3.0, 0.004), 0.30)]
    rows = summarize(study, [*yoco, scoring(finished("yoco-u", 0, 0, 2.5, 0.002), 0.5), scoring(finished("yoco-u", 1, 0, 2.9, 0.002), None)])
    assert [(row["best lr"], row["accuracy"]) for row in rows] == [(0.004, pytest.approx(0.275)), (0.002, None)]  # (0.25 + 0.30) / 2
    assert [readable(row, maximize=False)["accuracy"] for row in rows] == ["27.5%", "-"]
    rows = summarize(study, [*yoco, finished("yoco-u", 0, 0, None, state=TrialState.FAIL)])
    assert [readable(row, maximize=False)["accuracy"] for row in rows] == ["27.5%", "-"]
    assert summarize(study, [finished("yoco", 0, 0, 3.0, 0.002)])[0].keys().isdisjoint({"accuracy"})  # a text corpus scores none


def test_a_reports_flops_and_cache_columns_are_the_cost_tables_own(tmp_path):
    """Each row's training FLOPs are a step's (a sequence's x batch) times its steps, and its cache
    column the whole cache, global and local, at the report's length: the comparisons between
    variants scale them all alike, so a dropped factor shows only here. At 17 tokens a sequence's
    FLOPs are not a whole number of FLOPs a token: they were rounded down to one, unlike the
    budgets that set the steps."""
    from archlab.table import MIB, si, tokens_label

    path = mini(tmp_path, "columns")
    definition = yaml.safe_load(path.read_text())
    definition["scales"]["tiny"]["train"]["seq_len"] = 17
    path.write_text(yaml.safe_dump(definition))
    study = load_study(str(path))
    trials = [finished("yoco", 0, 0, 3.0, 0.002), finished("yoco-u", 0, 0, 2.9, 0.002)]
    n = study.definition.report_seq_len
    for row in summarize(study, trials):
        cost = Cost(study.specs[row["variant"]])
        per_step = sum(cost.forward_flops(17).values()) * 3 * 4  # batch 4 of 17 tokens
        assert row["train FLOPs"] == per_step * 4  # 4 steps
        assert readable(row, maximize=False)["train FLOPs"] == si(per_step * 4)
        size = cost.cache_bytes(n)
        assert size.local > 0 and row[f"KV MiB @ {tokens_label(n)}"] == (size.global_ + size.local) / MIB


def test_a_flops_budget_trains_each_variant_for_the_baselines_training_flops(tmp_path):
    """budget: flops gives each variant the whole steps whose training FLOPs (3 x forward, a batch of
    whole sequences) do not pass the baseline's run; that is what each trial's setup records and
    trains for. Its train config leaves out what a trial sets itself: steps, seed and lr."""
    study = load_study(str(mini(tmp_path, "matched", steps=40, budget="flops")))
    per_sequence = {v: 3 * sum(Cost(spec).forward_flops(32).values()) for v, spec in study.specs.items()}
    looped = 40 * per_sequence["yoco"] // per_sequence["yoco-u"]
    assert 0 < looped < 40  # a looped step costs more than the baseline's
    assert [study.steps(v) for v in ("yoco", "yoco-u")] == [40, looped]
    assert [study.setup(v, slot)["steps"] for v in ("yoco", "yoco-u") for slot in (0, 1)] == [40, 40, looped, looped]
    train = study.setup("yoco-u", 1)["train"]
    assert "steps" not in train and "seed" not in train and "lr" not in train["optimizer"] and train["batch_size"] == 4


def test_a_recorded_setup_that_no_longer_validates_is_compared_as_it_was(tmp_path):
    """A trial whose recorded training config holds a field archlab has since dropped is named as
    trained under another definition, with that field, rather than failing to validate."""
    study = load_study(str(mini(tmp_path, "dropped")))
    setup = study.setup("yoco", 0)
    older = optuna.create_study(study_name=study.key)
    older.add_trial(optuna.trial.create_trial(
        params={"variant": "yoco", "seed": 0, "slot": 0}, value=2.0, user_attrs={"setup": {**setup, "train": {**setup["train"], "warmup": 5}}},
        distributions={"variant": CategoricalDistribution(["yoco", "yoco-u"]), "seed": CategoricalDistribution([0]),
                       "slot": CategoricalDistribution([0, 1])}))
    with pytest.raises(StudyChanged, match=r"yoco seed 0 lr slot 0: train\.warmup 5 -> \(absent\)"):
        check_unchanged(study, older)


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_a_trials_value_is_its_metrics_record_and_a_loss_keeps_the_accuracy_beside_it(tmp_path, monkeypatch):
    """metric: accuracy takes a trial's value from its last evaluation's eval_acc; val_loss takes
    eval_loss, and keeps the accuracy a task scored (eval_acc) beside it for the report.
    (The training is stood in for: only what the trial records is looked at.)"""
    last = {}
    monkeypatch.setattr(Trainer, "fit", lambda self, steps, on_eval=None: [{"step": steps, **last}])

    def trained(name, record, metric):
        last.clear()
        last.update(record)
        study = load_study(str(mini(tmp_path, name, {"yoco": {"spec": "yoco.yaml"}}, steps=2, metric=metric,
                                    lr={"low": 0.003, "high": 0.003, "points": 1})), data="mqar")
        out = tmp_path / name
        url = storage_url(out, None)
        optuna_study = join(study, out, url, grace_period=60)
        assert run_trial(study, optuna_study, claim(optuna_study, url, out), out, url)
        (trial,) = optuna_study.get_trials()
        assert trial.state == TrialState.COMPLETE, trial.user_attrs.get("failure")
        return trial.value, trial.user_attrs.get("accuracy")

    assert trained("acc", {"eval_loss": 2.5, "eval_acc": 0.25}, "accuracy") == (0.25, None)  # the value is the accuracy
    assert trained("loss", {"eval_loss": 2.5, "eval_acc": 0.25}, "val_loss") == (2.5, 0.25)


def test_a_live_trial_beats_at_least_three_times_in_its_grace_period():
    """A heartbeat late by a beat or two must not get a live trial taken over as dead."""
    from archlab.study.runner import heartbeat_interval

    for grace in range(3, 200):
        assert 1 <= heartbeat_interval(grace) and 3 * heartbeat_interval(grace) <= grace, grace


def test_a_report_compares_each_variant_with_the_baseline_at_its_loss_and_at_its_flops(tmp_path):
    """The paper's Figure 2, on mean curves worked out by hand: yoco-u (a loop, so more FLOPs a
    step) comes down to yoco's last loss between its two evaluations, and at yoco's FLOPs it is
    between them too."""
    study = load_study(str(mini(tmp_path, "figure2", seeds=[0, 1])))
    curves = {"yoco": ({2: 3.0, 4: 2.0}, {2: 3.2, 4: 2.2}), "yoco-u": ({2: 2.4, 4: 1.4}, {2: 2.6, 4: 1.6})}
    trials = [finished(variant, seed, 0, curve[4], 0.002, curve=curve) for variant, pair in curves.items() for seed, curve in enumerate(pair)]
    yoco, yoco_u = summarize(study, trials)
    target = 2.1  # yoco's mean last loss; yoco-u's mean curve is 2.5 at step 2, 1.5 at step 4
    assert yoco_u["share of baseline tokens"] == pytest.approx((2 + 2 * (2.5 - target) / (2.5 - 1.5)) / 4)  # 0.7
    per_step = {v: Cost(spec).train_flops_per_sequence(32) * 4 for v, spec in study.specs.items()}
    at = 4 * per_step["yoco"] / per_step["yoco-u"]  # the step at which yoco-u has spent yoco's FLOPs: between 2 and 4
    assert 2 < at < 4 and yoco_u["vs baseline at its FLOPs"] == pytest.approx(2.5 + (1.5 - 2.5) * (at - 2) / 2 - target)
    assert (yoco["share of baseline tokens"], yoco["vs baseline at its FLOPs"]) == (1.0, 0.0)
    never = [finished("yoco-u", seed, 0, 2.5, 0.002, curve={2: 2.9, 4: 2.5}) for seed in (0, 1)]
    (_, late) = summarize(study, trials[:2] + never)
    assert late["share of baseline tokens"] is None and late["vs baseline at its FLOPs"] > 0
    assert readable(late, maximize=False)["share of baseline tokens"] == "-"
    from archlab.study.report import _against_baseline

    accuracy = _against_baseline({"a": ([2, 4], [0.2, 0.6], 10.0), "b": ([2, 4], [0.5, 0.9], 20.0)}, "a", maximize=True)
    assert accuracy["b"] == {"share of baseline tokens": 0.625, "vs baseline at its FLOPs": pytest.approx(-0.1)}  # up to 0.6 at step 2.5
    # the baseline against itself is 1 by construction: a curve that rises at its end, or is flat,
    # first came down to its last value before its end, and read below 1 against itself
    rising = _against_baseline({"a": ([2, 4, 6], [3.0, 2.0, 2.2], 10.0), "b": ([2, 4], [2.5, 1.5], 10.0)}, "a", maximize=False)
    assert (rising["a"]["share of baseline tokens"], rising["b"]["share of baseline tokens"]) == (1.0, 0.75)  # 2.0: at 4, and 3
    flat = _against_baseline({"a": ([2, 4, 6], [5.5, 5.5, 5.5], 10.0)}, "a", maximize=False)
    assert flat["a"] == {"share of baseline tokens": 1.0, "vs baseline at its FLOPs": 0.0}
    whole_steps = _against_baseline({"a": ([2, 4], [3.0, 2.0], 10.0), "b": ([2, 3], [2.9, 2.5], 12.0), "c": ([2], [2.6], 12.0)}, "a", False)
    assert whole_steps["b"]["vs baseline at its FLOPs"] == pytest.approx(0.5)  # 36 of a's 40: one step more would pass them
    assert whole_steps["c"]["vs baseline at its FLOPs"] is None  # 24: it never spent them


def test_a_report_names_each_setting_its_trials_trained_in(tmp_path):
    """Two machines, or one before and after an upgrade, may give other results for the same plan:
    the report says which trials trained where, and which kept no record."""
    study = load_study(str(mini(tmp_path, "mixed", seeds=[0, 1])))
    here = {"archlab": "0.1.0 at abc", "python": "3.11.7", "torch": "2.13.0+cpu", "device": "CPU (2 threads)"}
    there = {**here, "torch": "2.14.0+cpu"}
    recorded = optuna.create_study()
    for trial, kept in ((finished("yoco", 0, 0, 3.0), here), (finished("yoco", 1, 0, 3.1), there), (finished("yoco-u", 0, 0, 3.2), here),
                        (finished("yoco-u", 1, 0, 3.3), None)):
        trial.user_attrs.update({"environment": kept} if kept else {})
        recorded.add_trial(trial)
    assert settings(study, recorded.get_trials()) == [
        "- trained in 3 settings (a trial repeats to the bit only within one):",
        "  - archlab 0.1.0 at abc, python 3.11.7, torch 2.13.0+cpu, device CPU (2 threads): trials 0, 2",
        "  - archlab 0.1.0 at abc, python 3.11.7, torch 2.14.0+cpu, device CPU (2 threads): trial 1",
        "  - not recorded (trained before trials kept it): trial 3",
    ]
    assert settings(study, recorded.get_trials()[:1]) == ["- trained with: archlab 0.1.0 at abc, python 3.11.7, torch 2.13.0+cpu, device CPU (2 threads)"]
    assert settings(study, []) == []


def test_a_trial_lost_before_training_is_listed_with_its_planned_lr(tmp_path):
    study = load_study(str(mini(tmp_path, "early")))
    lost = finished("yoco", 0, 1, None, state=TrialState.FAIL, curve={2: 3.0})
    lost = optuna.trial.create_trial(state=TrialState.FAIL, params=lost.params, distributions=lost.distributions)
    (row,) = failures(study, [lost])
    assert row["why"] == "its worker stopped sending heartbeats before its first evaluation" and row["lr"] == "0.004"


def test_a_grid_of_learning_rates_is_log_spaced_from_low_to_high_and_one_point_is_their_geometric_mean():
    """points log-spaced rates include both ends; a single point stands at the middle of the range
    on a log scale (sqrt(low * high)), not at either end."""
    from archlab.study.definition import LearningRates

    assert LearningRates(low=1e-4, high=1e-2, points=1).grid() == pytest.approx([1e-3])
    assert LearningRates(low=1e-4, high=1e-2, points=3).grid() == pytest.approx([1e-4, 1e-3, 1e-2])
    assert LearningRates(low=1e-3, high=8e-3, points=4).grid() == pytest.approx([1e-3, 2e-3, 4e-3, 8e-3])


def test_a_tpe_study_scores_each_seed_by_its_best_draw(tmp_path):
    """Under TPE no two trials share a learning rate: grouping by it gave one trial per group, a
    minimum over draws reported as a mean of 1 seed. Each seed's best draw is averaged instead."""
    study = load_study(str(mini(tmp_path, "tpe", sampler="tpe", seeds=[0, 1])))
    trials = [finished("yoco", 0, 0, 2.0, 1e-3), finished("yoco", 0, 1, 1.8, 2e-3),
              finished("yoco", 1, 0, 1.9, 3e-3), finished("yoco", 1, 1, 2.1, 1e-3)]
    (yoco, _) = summarize(study, trials)
    assert (yoco["val loss"], yoco["seeds"], yoco["best lr"], yoco["best lr high"]) == (pytest.approx(1.85), 2, 2e-3, 3e-3)
    assert (shown := readable(yoco, maximize=False))["best lr"] == "0.002..0.003" and shown["spread (sd)"] == 0.0707


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_a_study_run_afresh_in_another_storage_trains_its_own_trials_and_another_study_is_refused(tmp_path, cli):
    """Trials are numbered from 0 in each study and storage: with one trials folder for all, the
    study run afresh met the first run's trials and failed, every one. Another study in the same
    --out wrote its report and plots over the first's, and its corpus refused the first's next run."""
    one = {"variants": {"yoco": {"spec": "yoco.yaml"}}, "steps": 2, "lr": {"low": 0.003, "high": 0.003, "points": 1}}  # trial 0 alone
    path, out = mini(tmp_path, "first", **one), tmp_path / "out"
    log = io.StringIO()
    for url in (None, f"sqlite:///{tmp_path / 'afresh.db'}"):
        done = work(load_study(str(path)), out, url, Console(file=log, width=200), grace_period=60).get_trials()
        assert [t.state.name for t in done] == ["COMPLETE"], log.getvalue()
    assert len(list((out / "trials").glob("*/0000-yoco-s0-lr0"))) == 2
    report(load_study(str(path)), optuna.load_study(study_name="first-tiny", storage=storage_url(out, None)), out, storage_url(out, None))
    other, elsewhere = mini(tmp_path, "second", **one), f"sqlite:///{tmp_path / 'other.db'}"
    code, _, stderr = cli("study", "run", other, "--out", tmp_path / "second", "--storage", elsewhere)
    assert code in OK, stderr

    def held():  # the lock files' beside: opened by every worker
        return sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*") if p.suffix != ".lock")

    before = held()
    for command in (["run", other], ["run", other, "--storage", elsewhere], ["report", other, "--storage", elsewhere]):
        code, _, stderr = cli("study", *command, "--out", out)
        assert code == 1 and f"error: --out {out} holds study first-tiny; give this study its own --out" in " ".join(stderr.split()), stderr
    assert held() == before  # nothing tokenized, written or created
    code, _, stderr = cli("study", "run", path, "--out", out)  # the first study, finished, runs nothing again
    assert code in OK, stderr


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_worker_on_an_older_definition_leaves_a_newer_ones_trials_waiting(tmp_path):
    """It failed them as no longer planned, though they were newer than its definition."""
    path, out = mini(tmp_path, "newer", variants={"yoco": {"spec": "yoco.yaml"}}), tmp_path / "out"
    older = load_study(str(path))
    url = storage_url(out, None)
    join(older, out, url, grace_period=60)
    newer = rewrite(path, variants={"yoco": {"spec": "yoco.yaml"}, "yoco-u": {"spec": "yoco-u.yaml"}})
    optuna_study = join(newer, out, url, grace_period=60)
    taken = [claim(optuna_study, url, out, older.planned()) for _ in range(3)]
    assert taken[2] is None and {planned_as(optuna_study._storage.get_trial(t))[0] for t in taken[:2]} == {"yoco"}
    assert {planned_as(t)[0] for t in optuna_study.get_trials(states=(TrialState.WAITING,))} == {"yoco-u"}


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_trial_lost_with_its_worker_past_its_retries_is_queued_by_the_next_run(tmp_path):
    """The interrupted worker says its trial "is run again by the next study run": after the
    automatic retries it was failed for good, and no run took it up again. One with retries left
    is the stale-trial callback's to queue (on PostgreSQL it may not have run yet)."""
    study, out = load_study(str(mini(tmp_path, "lost"))), tmp_path / "out"
    url = storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=60)
    storage = optuna_study._storage
    spent, fresh = claim(optuna_study, url, out), claim(optuna_study, url, out)
    storage.set_trial_system_attr(spent, "retry_history", [90, 91])  # lost twice before
    for trial_id in (spent, fresh):
        storage.set_trial_state_values(trial_id, TrialState.FAIL)  # as fail_stale_trials leaves it
    keys = {planned_as(storage.get_trial(t)): storage.get_trial(t).number for t in (spent, fresh)}
    again = join(study, out, url, grace_period=60).get_trials()
    by_key = {key: [t for t in again if planned_as(t) == key] for key in keys}
    spent_key, fresh_key = keys
    assert [t.state.name for t in by_key[spent_key]] == ["FAIL", "WAITING"]
    assert by_key[spent_key][1].system_attrs["retry_history"] == [90, 91, keys[spent_key]]  # the report follows it
    assert [t.state.name for t in by_key[fresh_key]] == ["FAIL"]


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_trial_lost_a_third_time_and_not_yet_failed_is_queued_by_the_next_run(tmp_path):
    """Still running when the next run joined (its worker dead, no one had failed it as stale), it
    was not seen as lost: that run's claim failed it, past its retries, and the run reported it
    failed without training it. The retry callback also appended to the trial it was handed."""
    study, out = load_study(str(mini(tmp_path, "stale"))), tmp_path / "out"
    url = storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=1)
    spent = claim(optuna_study, url, out)  # beats once, then its worker dies
    optuna_study._storage.set_trial_system_attr(spent, "retry_history", [90, 91])  # lost twice before
    number = optuna_study._storage.get_trial(spent).number
    time.sleep(2.5)
    again = join(study, out, url, grace_period=1)
    lost, retry = [t for t in again.get_trials() if planned_as(t) == planned_as(again._storage.get_trial(spent))]
    assert (lost.state.name, retry.state.name) == ("FAIL", "WAITING")
    assert lost.system_attrs["retry_history"] == [90, 91] and retry.system_attrs["retry_history"] == [90, 91, number]


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_storage_lost_while_a_trial_trains_is_said_and_fails_no_trial(tmp_path, cli, monkeypatch):
    """The database gone mid-trial gave three chained tracebacks, and a passing error was
    recorded as the trial's own failure; the trial now stays running, to go stale and run again."""
    definition = mini(tmp_path, "gone", variants={"yoco": {"spec": "yoco.yaml"}}, lr={"low": 0.003, "high": 0.003, "points": 1})
    cause = sqlalchemy.exc.OperationalError("UPDATE trials", {}, Exception("server closed the connection unexpectedly"))

    def report(self, *args, **kwargs):
        raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from cause

    monkeypatch.setattr(WholeCallsStorage, "set_trial_intermediate_value", report)
    code, _, stderr = cli("study", "run", definition, "--data", "mqar", "--out", tmp_path / "out")
    said = " ".join(stderr.split())
    assert code == 1 and "Traceback" not in stderr, stderr
    assert "lost the study storage" in said and "while trial 0 trained: server closed the connection unexpectedly;" in said, said
    monkeypatch.undo()
    url = storage_url(tmp_path / "out", None)
    (trial,) = optuna.load_study(study_name=load_study(str(definition)).key, storage=url).get_trials()
    assert trial.state == TrialState.RUNNING and "failure" not in trial.user_attrs


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
@pytest.mark.parametrize(("write", "error", "said"), [
    ("torch.save", OSError(errno.ENOSPC, "No space left on device"), "No space left on device); is the disk full?"),
    ("archlab.train.checkpoint.save_model", SafetensorError("No space left on device (os error 28)"), "(os error 28)); is the disk full?"),
    ("archlab.train.trainer.open", OSError(errno.EROFS, "Read-only file system"), "(Read-only file system); training stopped"),
    ("archlab.train.trainer.write_text_whole", OSError(errno.EDQUOT, "Disk quota exceeded", "spec.yaml"), "Disk quota exceeded: 'spec.yaml'."),
], ids=["checkpoint", "checkpoint-weights", "metrics", "run-files"])
def test_a_disk_that_refuses_a_trial_s_files_stops_the_worker_and_fails_no_trial(tmp_path, cli, monkeypatch, write, error, said):
    """A full disk failed the trial and then, in seconds, every trial after it, each recorded as
    failed and never run again; the worker now stops, and the trial goes stale to run again."""

    def refused(*args, **kwargs):
        raise error

    definition = mini(tmp_path, "full", steps=4)
    monkeypatch.setattr(write, refused, raising=False)  # trainer.py's open is the builtin, for its metrics lines alone
    code, _, stderr = cli("study", "run", definition, "--data", "mqar", "--out", tmp_path / "out")
    told = " ".join(stderr.split())
    assert code == 1 and "Traceback" not in stderr, stderr
    assert "trial 0 stopped: " in told and said in told and "This worker stops too, rather than fail the trials after it;" in told and "can write its files" in told, told
    monkeypatch.undo()
    trials = optuna.load_study(study_name=load_study(str(definition)).key, storage=storage_url(tmp_path / "out", None)).get_trials()
    assert [t.state.name for t in trials] == ["RUNNING", "WAITING", "WAITING", "WAITING"] and "failure" not in trials[0].user_attrs
    assert trials[0].user_attrs["stopped_by"] == "its disk would not take the trial's files"  # what the report says of it
    assert trials[0].user_attrs["stopped_worker"] == trials[0].user_attrs["worker"]


@pytest.mark.parametrize(("error", "stops"), [
    (OSError(errno.ENOSPC, "No space left on device"), True), (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
    (OSError(errno.EFBIG, "File too large"), True), (OSError(errno.EROFS, "Read-only file system"), True),
    (Unwritten("step 2's metrics could not be written"), True), (OSError(errno.ENOENT, "No such file or directory"), False),
    (OSError("190000 requested and 114656 written"), False), (ValueError("a trial's own mistake"), False),
], ids=["full", "quota", "file-size", "read-only", "unwritten", "missing", "no-errno", "other"])
def test_a_worker_stops_on_what_the_disk_refuses_and_fails_a_trial_for_anything_else(error, stops):
    """A disk full or read-only would fail every trial after this one: the worker stops on it. A
    file that is not there, or any other error, is the trial's own: it fails, and the next runs."""
    assert refused_by_the_machine(error) == stops


def test_every_call_of_the_study_storage_holds_signals_the_private_ones_optunas_cache_makes_too():
    """optuna's cache in front of the storage calls its private methods (_get_trials,
    _create_new_trial...): a Ctrl-C inside one of those left SQLite locked as inside a public one."""
    methods = {name: method for name, method in vars(optuna.storages.RDBStorage).items()
               if inspect.isfunction(method) and not name.startswith("__")}
    assert "_get_trials" in methods and "_create_new_trial" in methods
    for name, method in methods.items():
        assert getattr(WholeCallsStorage, name).__wrapped__ is method, name


@pytest.mark.parametrize(("url", "said"), [
    ("postgresql://alice:pw@127.0.0.1:port/db", "postgresql://alice:***@127.0.0.1:port/db: its port is not a number"),
    ("postgres://alice:pw@127.0.0.1:5432/db", "postgres://alice:***@127.0.0.1:5432/db: a PostgreSQL URL begins postgresql://"),
    ("postgresql://alice:p@ss@127.0.0.1:5432/db",  # the driver's error named the host 'ss@127.0.0.1', the password's end
     "postgresql://alice:***@127.0.0.1:5432/db: its user or password holds an @, which ends them in a URL; write it as %40"),
])
def test_a_storage_url_that_does_not_parse_is_one_line(tmp_path, cli, url, said):
    code, _, stderr = cli("study", "run", mini(tmp_path), "--storage", url, "--out", tmp_path / "out")
    assert code == 1 and said in " ".join(stderr.split()) and "Traceback" not in stderr, stderr


def test_a_study_keeps_the_direction_of_its_metric(tmp_path):
    """Created to minimize val_loss, then renamed variants measured by accuracy: nothing was
    compared, and pruners and TPE went on treating low accuracy as good."""
    study, out = load_study(str(mini(tmp_path, "way"))), tmp_path / "out"
    out.mkdir()
    url = storage_url(out, None)
    optuna.create_study(study_name=study.key, storage=url, direction="maximize")
    with pytest.raises(StorageError, match="created to maximize its metric, and its metric is now val_loss, which it would minimize"):
        open_study(study, url)


def test_a_storage_error_is_said_as_the_driver_said_it():
    """Optuna's StorageInternalError keeps SQLAlchemy's error as its cause, and that the driver's."""
    from archlab.study.runner import _in_words

    try:
        try:
            raise sqlalchemy.exc.ProgrammingError("SELECT", {}, Exception("permission denied for table version_info"))
        except sqlalchemy.exc.ProgrammingError as exc:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from exc
    except optuna.exceptions.StorageInternalError as wrapped:
        assert _in_words(wrapped) == "permission denied for table version_info"


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def completed(study, storage, trial_id, value=1.0):
    """A claimed trial marked complete as a worker leaves it: its setup, learning rate and FLOPs a
    step recorded, then its value."""
    variant, _, slot = planned_as(storage.get_trial(trial_id))
    setup = study.setup(variant, slot)
    for key, kept in (("setup", setup), ("lr", setup["lr"]), ("flops_per_step", 1e9)):
        storage.set_trial_user_attr(trial_id, key, kept)
    storage.set_trial_state_values(trial_id, TrialState.COMPLETE, [value])


def test_the_workers_of_a_study_share_one_grace_period(tmp_path):
    """A worker with a shorter one failed live workers' trials as stale, and each ran twice; one
    that joined as another had just joined, before either took a trial, was let in. With no trial
    running and no worker joined for the grace period, a new run may set another."""
    study, out = load_study(str(mini(tmp_path, "grace"))), tmp_path / "out"
    url = storage_url(out, None)
    refused = "this study's workers use --grace-period 60; .* give --grace-period 60 .*no worker has joined for 60 s"
    optuna_study = join(study, out, url, grace_period=60)
    with pytest.raises(StorageError, match=refused):  # the first worker has yet to take a trial
        join(study, out, url, grace_period=2)
    optuna_study.set_user_attr("joined", time.time() - 61)
    claim(optuna_study, url, out)  # a worker is training
    with pytest.raises(StorageError, match=refused):
        join(study, out, url, grace_period=2)
    join(study, out, url, grace_period=60)
    complete = functools.partial(completed, study, optuna_study._storage)
    complete(optuna_study.get_trials(states=(TrialState.RUNNING,))[0]._trial_id)
    with pytest.raises(StorageError, match=refused):  # that worker joined just now
        join(study, out, url, grace_period=2)
    optuna_study.set_user_attr("joined", time.time() - 61)
    assert join(study, out, url, grace_period=2).user_attrs["grace_period"] == 2
    for trial in optuna_study.get_trials(states=(TrialState.WAITING,)):
        complete(trial._trial_id)
    assert join(study, out, url, grace_period=60).user_attrs["grace_period"] == 60  # nothing left to run: no worker to judge


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_worker_that_joined_within_the_running_workers_grace_period_keeps_it_from_another(tmp_path):
    """The worker that joined 30 s ago, within its workers' 60 s, may yet take a trial: a worker
    given 2 s, by which that worker is long gone, is refused; one given 120 s once they agreed on 2 s
    (by which it is gone) is let in."""
    study, out = load_study(str(mini(tmp_path, "recent"))), tmp_path / "out"
    url = storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=60)
    optuna_study.set_user_attr("joined", time.time() - 30)
    with pytest.raises(StorageError, match="this study's workers use --grace-period 60"):
        join(study, out, url, grace_period=2)
    optuna_study.set_user_attr("grace_period", 2)
    assert join(study, out, url, grace_period=120).user_attrs["grace_period"] == 120


def test_a_study_that_recorded_no_join_has_no_worker_alive_but_one_training():
    """A study joined before workers recorded when they joined: its waiting trials wait on no live
    worker, and a running one is trained by one."""
    from archlab.study.runner import _workers_alive

    optuna_study = optuna.create_study()
    optuna_study.enqueue_trial({"x": 1.0})
    optuna_study.enqueue_trial({"x": 2.0})
    assert not _workers_alive(optuna_study, 60)
    optuna_study.ask()
    assert _workers_alive(optuna_study, 60)


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_trial_an_earlier_version_failed_as_not_planned_is_queued_again(tmp_path):
    study, out = load_study(str(mini(tmp_path, "legacy"))), tmp_path / "out"
    url = storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=60)
    taken = claim(optuna_study, url, out)
    optuna_study._storage.set_trial_user_attr(taken, "failure", "NotPlanned: the study no longer plans yoco seed 0 lr slot 0")
    optuna_study._storage.set_trial_state_values(taken, TrialState.FAIL)
    key = planned_as(optuna_study._storage.get_trial(taken))
    assert [t.state.name for t in join(study, out, url, grace_period=60).get_trials() if planned_as(t) == key] == ["FAIL", "WAITING"]


def test_a_study_folder_whose_name_holds_a_question_mark_keeps_its_database(tmp_path):
    """Pasted into the URL, "q?x/optuna.db" named the database "q" beside the folder."""
    out = tmp_path / "q?x"
    url = storage_url(out, None)
    assert make_url(url).database == str(out / "optuna.db")
    assert url == f"sqlite:///{tmp_path}/q%3Fx/optuna.db"


def test_tpe_learns_each_variants_learning_rate_from_that_variant_alone():
    """Pooled, the trials of the variant best at 1e-4 drew every other variant's rates to 1e-4."""
    from archlab.study.runner import SameVariantSampler

    study = optuna.create_study()
    lr = FloatDistribution(1e-5, 1e-1, log=True)
    fixed = {"variant": CategoricalDistribution(["yoco", "yoco-u"]), "seed": CategoricalDistribution([0]),
             "slot": optuna.distributions.IntDistribution(0, 100)}
    for slot, rate in enumerate(np.geomspace(1e-5, 1e-1, 20)):
        for variant, best, offset in (("yoco", 1e-4, 1.0), ("yoco-u", 1e-2, 5.0)):  # yoco-u's losses all worse than yoco's
            study.add_trial(optuna.trial.create_trial(params={"variant": variant, "seed": 0, "slot": slot, "lr": rate},
                                                      distributions={**fixed, "lr": lr}, value=offset + abs(np.log10(rate / best))))
    study.enqueue_trial({"variant": "yoco-u", "seed": 0, "slot": 99})
    drawing = study._storage.get_trial(study.ask()._trial_id)
    draws = [SameVariantSampler(optuna.samplers.TPESampler(seed=s)).sample_independent(study, drawing, "lr", lr) for s in range(20)]
    pooled = [optuna.samplers.TPESampler(seed=s).sample_independent(study, drawing, "lr", lr) for s in range(20)]
    assert 1e-3 < np.median(draws) < 1e-1 and np.median(pooled) < 1e-3


def test_a_report_from_a_sqlite_file_that_is_not_there_makes_none(tmp_path, cli):
    typo = tmp_path / "typo.db"
    code, _, stderr = cli("study", "report", mini(tmp_path), "--storage", f"sqlite:///{typo}")
    assert code not in OK and f"no SQLite database {typo}; give the --storage the study ran with" in stderr, stderr
    assert "Traceback" not in stderr and not typo.exists()


def test_a_run_refused_as_it_joins_leaves_no_study_to_report(tmp_path, cli):
    """The study was created and its trials queued before the data and the studies its variants
    start from were checked: `report` then showed an empty study, and exited 0."""
    out, nowhere = tmp_path / "out", str(tmp_path / "nonexistent")
    code, _, stderr = cli("study", "run", mini(tmp_path), "--out", out, "--data", nowhere)
    assert code == 1 and "no such file or folder (given with --data)" in stderr, stderr
    start = mini(tmp_path, "tuned", {"yoco": {"spec": "yoco.yaml", "init": {"study": str(mini(tmp_path, "never"))}}})
    code, _, stderr = cli("study", "run", start, "--out", tmp_path / "tuned")
    assert code == 1 and "starts from the trials of study never-tiny, which is neither in" in " ".join(stderr.split()), stderr
    for path, folder, data in ((mini(tmp_path), out, ["--data", nowhere]), (start, tmp_path / "tuned", [])):
        code, _, stderr = cli("study", "report", path, "--out", folder, *data)
        assert code == 1 and "no study has run here yet (no optuna.db)" in " ".join(stderr.split()), stderr


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_a_corpus_in_the_study_folder_is_refused_without_blaming_the_data(tmp_path):
    """A corpus tokenized at another vocabulary is the folder's, not the data's: the advice to give
    other data with --data sent the reader after data that was fine."""
    path, out = mini(tmp_path, "vocab", {"yoco": {"spec": "yoco.yaml"}}), tmp_path / "out"
    join(load_study(str(path)), out, storage_url(out, None), grace_period=60)
    bigger = rewrite(path, variants={"yoco": {"spec": "yoco.yaml", "set": {"vocab_size": 512}}})
    with pytest.raises(Exception, match=f"{out / 'data'} holds a corpus tokenized with vocab_size 256") as refused:
        join(bigger, out, storage_url(out, None), grace_period=60)
    assert "--data" not in str(refused.value)
    mine = tmp_path / "mine"  # a folder of one's own as --out: its tokenizer.json was replaced by the study's
    mine.mkdir()
    (mine / "tokenizer.json").write_text("one's own")
    with pytest.raises(Exception, match=f"{mine} holds a tokenizer.json that no run tokenizing there wrote") as refused:
        join(load_study(str(path)), mine, storage_url(mine, None), grace_period=60)
    assert "--data" not in str(refused.value) and (mine / "tokenizer.json").read_text() == "one's own"
    (out / "data" / "corpus.json").write_text("garbage")  # a record gone bad: nor is that the data's fault
    with pytest.raises(Exception, match=f"the tokenized corpus in {out / 'data'} is damaged") as refused:
        join(load_study(str(path)), out, storage_url(out, None), grace_period=60)
    assert "--data" not in str(refused.value)


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_a_metric_of_the_other_direction_is_refused_with_advice_that_works(tmp_path):
    """Renamed as advised, the study was refused again by the --out it was given, which holds the first."""
    path, out = mini(tmp_path, "direction", variants={"yoco": {"spec": "yoco.yaml"}}), tmp_path / "out"
    join(load_study(str(path)), out, storage_url(out, None), grace_period=60)
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "metric": "accuracy"}))
    with pytest.raises(StorageError, match=re.escape("was created to minimize its metric, and its metric is now accuracy, which it would"
                                                     " maximize; a study keeps the direction of its metric: give this one another"
                                                     " name (and another --out, where one was given)")):
        join(load_study(str(path), data="mqar"), out, storage_url(out, None), grace_period=60)


def test_the_report_says_which_trials_lost_their_worker_and_what_became_of_them(tmp_path):
    """A trial whose worker was stopped counted as running; trials lost with their worker were
    said to have run again while their retries waited."""
    study = load_study(str(mini(tmp_path, "progress")))
    stopped = finished("yoco", 0, 0, None, state=TrialState.RUNNING, curve={2: 3.0})
    stopped.user_attrs.update({"worker": "host:1", "stopped_worker": "host:1"})
    lost = [optuna.trial.create_trial(state=TrialState.FAIL, params=t.params, distributions=t.distributions)
            for t in (finished("yoco", 0, 1, 3.0), finished("yoco-u", 0, 0, 3.0))]
    recorded = optuna.create_study()
    for trial in (stopped, *lost):
        recorded.add_trial(trial)
    for number in (1, 2):
        RetryHeartbeatStaleTrialCallback()(recorded, recorded.trials[number])
    line = progress(study, recorded.trials)
    assert line.startswith("- trials: 4 planned: 0 complete, 0 running, 3 waiting, 0 failed, 0 pruned, 1 whose worker was stopped"
                           " (it runs again once silent for the --grace-period)")
    assert line.endswith("; 2 lost their worker (see Failed trials): 2 queued again and waiting")
    claimed = recorded.trials[3]  # a retry taken by another worker: the mark it copied is not its own
    recorded._storage.set_trial_state_values(claimed._trial_id, state=TrialState.RUNNING)
    recorded._storage.set_trial_user_attr(claimed._trial_id, "worker", "host:2")
    line = progress(study, recorded.trials)
    assert "1 running, 2 waiting" in line and line.endswith("; 2 lost their worker (see Failed trials): 1 ran again, 1 queued again and waiting")


def test_a_study_name_that_is_not_shipped_is_answered_with_the_shipped_ones(cli):
    code, _, stderr = cli("study", "nonexistent")
    assert code == 2 and "error: no command, shipped study or study file 'nonexistent': the commands are report, run; the shipped" \
        " studies architectures, esa-kind, " in " ".join(stderr.split()), stderr
    code, _, stderr = cli("study", "reprot", "loop-position")  # a mistyped command: not taken for a study with an extra argument
    assert code == 2 and "'reprot': the commands are report, run" in stderr and "extra argument" not in stderr, stderr
    code, _, stderr = cli("study", "missing.yaml")  # a study file, which run says is missing
    assert code == 1 and "missing.yaml" in stderr and "not found" in stderr, stderr


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_a_folder_from_before_the_owner_file_is_its_own_storages_study(tmp_path, cli, monkeypatch):
    """A study folder made before the .study file was claimed by the next study run in it, and the
    study whose storage and trials it held was refused its own folder."""
    path, out = mini(tmp_path, "first", steps=2, variants={"yoco": {"spec": "yoco.yaml"}}, lr={"low": 0.003, "high": 0.003, "points": 1}), tmp_path / "out"
    join(load_study(str(path)), out, storage_url(out, None), grace_period=60)
    (out / ".study").unlink()  # as a folder from before it
    code, _, stderr = cli("study", "run", mini(tmp_path, "second"), "--out", out)
    assert code == 1 and f"--out {out} holds study first-tiny; give this study its own --out" in " ".join(stderr.split()), stderr
    monkeypatch.chdir(tmp_path)  # the report names its storage whole, not as typed from here: it is read from anywhere
    code, _, stderr = cli("study", "run", path, "--out", out)
    assert code in OK, stderr
    assert f"- storage `sqlite:///{out.resolve() / 'optuna.db'}` (open it with" in (out / "report.md").read_text()


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_retry_claimed_by_a_worker_of_the_stopped_ones_name_is_not_counted_stopped(tmp_path, monkeypatch):
    """A retry copies its trial's stopped mark; a worker restarted with the same host name and pid
    (a container's) took it, and the report counted it as stopped while it ran."""
    import os
    import socket

    from archlab.study.runner import STOPPED

    path, out = mini(tmp_path, "again", steps=2, variants={"yoco": {"spec": "yoco.yaml"}}, lr={"low": 0.003, "high": 0.003, "points": 1}), tmp_path / "out"
    study, url = load_study(str(path)), storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=60)
    (waiting,) = optuna_study.get_trials(states=(TrialState.WAITING,))
    optuna_study._storage.set_trial_user_attr(waiting._trial_id, STOPPED, f"{socket.gethostname()}:{os.getpid()}")
    seen, fit = [], Trainer.fit

    def watched(self, steps, **kwargs):
        seen.append(progress(study, optuna_study.get_trials()))
        return fit(self, steps, **kwargs)

    monkeypatch.setattr(Trainer, "fit", watched)
    assert run_trial(study, optuna_study, claim(optuna_study, url, out), out, url)
    assert seen and "1 running" in seen[0] and "stopped" not in seen[0], seen


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_retry_claimed_keeps_neither_its_trials_stopped_mark_nor_what_stopped_it(tmp_path, monkeypatch):
    """A retry copies its trial's user attributes: claimed, it is another worker's, not one stopped
    by its disk, as optuna-dashboard showed it while it trained."""
    import archlab.study.runner as runner
    from archlab.study.runner import STOPPED, STOPPED_BY

    study, out = load_study(str(mini(tmp_path, "marks"))), tmp_path / "out"
    url = storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=60)
    waiting = optuna_study.get_trials(states=(TrialState.WAITING,))[0]
    optuna_study._storage.set_trial_user_attr(waiting._trial_id, STOPPED, "host:1")
    optuna_study._storage.set_trial_user_attr(waiting._trial_id, STOPPED_BY, "its disk would not take the trial's files")
    seen = []

    def outcome(study, trial, key, out, url):
        seen.append(optuna_study._storage.get_trial(trial._trial_id).user_attrs)
        return 1.0, TrialState.COMPLETE, None

    monkeypatch.setattr(runner, "_outcome", outcome)
    taken = claim(optuna_study, url, out)
    assert taken == waiting._trial_id and run_trial(study, optuna_study, taken, out, url)
    assert seen[0].get(STOPPED) is None and seen[0].get(STOPPED_BY) is None, seen


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_worker_reporting_while_another_writes_its_folders_owner_finds_its_own_study(tmp_path, monkeypatch):
    """Workers sharing an --out each write its .study file as they join and as they report, and a
    reporting worker reads it without the workers' lock. Written in place, it was read emptied
    mid-write: of three workers finishing together, one was refused its own folder (`--out OUT holds
    study ; give this study its own --out`) and exited 1, its trials complete and no report written."""
    import builtins

    from archlab.study.runner import refuse_other_study

    path = mini(tmp_path, "owned", steps=2, variants={"yoco": {"spec": "yoco.yaml"}}, lr={"low": 0.003, "high": 0.003, "points": 1})
    study, out = load_study(str(path)), tmp_path / "out"
    url = storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=60)
    real, seen = builtins.open, []

    def opened(file, mode="r", *args, **kwargs):  # another worker reads the folder's owner as each file there is opened to write
        handle = real(file, mode, *args, **kwargs)
        if "w" in mode and isinstance(file, (str, os.PathLike)) and Path(file).parent == out:
            try:
                refuse_other_study(out, study)
                seen.append(None)
            except StorageError as exc:
                seen.append(f"{Path(file).name}: {exc}")
        return handle

    monkeypatch.setattr(builtins, "open", opened)
    monkeypatch.setattr(io, "open", opened)  # pathlib's
    join(study, out, url, grace_period=60)  # a second worker joins
    report(study, optuna_study, out, url)  # and one reports
    assert seen and not any(seen), [s for s in seen if s]


def test_an_empty_study_file_is_said_to_be_empty(tmp_path, cli):
    for text in ("", "# nothing yet\n"):
        (tmp_path / "empty.yaml").write_text(text)
        code, _, stderr = cli("study", "run", tmp_path / "empty.yaml", "--out", tmp_path / "out")
        assert code == 1 and "the file is empty" in stderr and "NoneType" not in stderr, stderr


def test_archlab_run_from_a_source_checkout_it_was_not_installed_from_names_its_version(monkeypatch):
    import importlib.metadata
    import tomllib

    from archlab.environment import _described_code

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert _described_code().split(" at ")[0] == version


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_a_pruned_trial_is_not_reported_under_another_pruner(tmp_path, cli):
    """The pruner was no part of what a trial recorded: a study that pruned a trial under median and
    was then edited to pruner: none reported it as pruned, under "pruner: none", and chose the
    variant's best lr without it. A trial the pruner let complete is the same under any pruner."""
    path, out = mini(tmp_path, "repruned", steps=2, pruner="median"), tmp_path / "out"
    study, url = load_study(str(path)), storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=60)
    assert run_trial(study, optuna_study, claim(optuna_study, url, out), out, url)  # yoco seed 0 lr slot 0: complete
    cut = optuna.Trial(optuna_study, claim(optuna_study, url, out))  # yoco seed 0 lr slot 1, pruned as a pruner would
    cut.set_user_attr("setup", study.setup("yoco", 1))
    cut.report(5.0, 2)
    optuna_study.tell(cut, state=TrialState.PRUNED)
    edited = rewrite(path, pruner="none")
    with pytest.raises(StudyChanged, match=r"holds 1 trial that trained under another definition of the study:\n"
                                           r"  yoco seed 0 lr slot 1: pruner median -> none\n"):
        check_unchanged(edited, optuna_study)
    code, _, stderr = cli("study", "run", path, "--out", out)
    assert code == 1 and "yoco seed 0 lr slot 1: pruner median -> none" in stderr and "Traceback" not in stderr, stderr
    assert [t.state for t in trials_of(url, "repruned")][:2] == [TrialState.COMPLETE, TrialState.PRUNED]  # kept as they were
    rewrite(path, pruner="median")
    check_unchanged(load_study(str(path)), optuna_study)  # put back: fine
    setup = {name: value for name, value in study.setup("yoco", 1).items() if name != "pruner"}  # as recorded before pruners were
    legacy, older = optuna.create_study(), finished("yoco", 0, 1, None, state=TrialState.PRUNED, curve={2: 5.0})
    older.user_attrs["setup"] = setup
    legacy.add_trial(older)
    check_unchanged(rewrite(path, pruner="hyperband"), legacy)  # which pruner cut it is not known
    with pytest.raises(StudyChanged, match=r"yoco seed 0 lr slot 1: pruned, and the study now has pruner: none"):
        check_unchanged(rewrite(path, pruner="none"), legacy)  # but that one did


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_a_report_does_not_count_a_killed_workers_trial_as_running(tmp_path):
    """A worker killed (SIGKILL, a lost machine) left its trial running in the storage until another
    worker joined, and `study report` meanwhile said it was running, however long it had been silent."""
    study = load_study(str(mini(tmp_path, "zombie", steps=2)))
    out = tmp_path / "out"
    url = storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=4)  # seconds: a report under a loaded machine's full suite took over 1
    claim(optuna_study, url, out)  # taken, with its first beat, by a worker killed at once
    text = report(study, optuna_study, out, url)
    assert "4 planned: 0 complete, 1 running, 3 waiting" in text  # still within the grace period
    time.sleep(5)
    line = next(line for line in report(study, optuna_study, out, url).splitlines() if line.startswith("- trials:"))
    assert line.startswith("- trials: 4 planned: 0 complete, 0 running, 3 waiting, 0 failed, 0 pruned, 1 whose worker has sent no heartbeat"
                           " for over the --grace-period (killed, or paused; it runs again at the next `study run`"), line
    assert optuna_study.get_trials()[0].state == TrialState.RUNNING  # a report fails nothing


def test_a_trial_whose_worker_was_stopped_is_listed_as_stopped_not_silent(tmp_path):
    """A worker stopped by Ctrl-C, SIGTERM or its disk marks its trial; once failed as stale, Failed
    trials said of it only that its worker stopped sending heartbeats, as of a worker killed. A mark
    recorded without what stopped the worker is of Ctrl-C or SIGTERM, as when no other stopped it."""
    study = load_study(str(mini(tmp_path, "stopped")))
    recorded = optuna.create_study()
    stopped, full, unsaid, killed = (finished(variant, 0, slot, None, state=TrialState.FAIL, curve={2: 3.0})
                                     for variant in ("yoco", "yoco-u") for slot in (0, 1))
    stopped.user_attrs.update({"worker": "host:1", "stopped_worker": "host:1", "stopped_by": "Ctrl-C or SIGTERM"})
    full.user_attrs.update({"worker": "host:3", "stopped_worker": "host:3", "stopped_by": "its disk would not take the trial's files"})
    unsaid.user_attrs.update({"worker": "host:4", "stopped_worker": "host:4"})
    killed.user_attrs.update({"worker": "host:2"})
    for trial in (stopped, full, unsaid, killed):
        recorded.add_trial(trial)
    rows = failures(study, recorded.trials)
    assert [row["why"] for row in rows] == ["its worker host:1 was stopped (Ctrl-C or SIGTERM) after step 2",
                                             "its worker host:3 was stopped (its disk would not take the trial's files) after step 2",
                                             "its worker host:4 was stopped (Ctrl-C or SIGTERM) after step 2",
                                             "its worker host:2 stopped sending heartbeats after step 2"]


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_a_storage_that_lost_the_study_is_refused_where_its_trials_trained(tmp_path, cli):
    """A database dropped and made again (or a SQLite file removed) numbered the trials from 0 again,
    into the folders of the earlier trials of those numbers: every trial failed ("already holds a
    run; pass --resume"), was recorded as failed and never run again."""
    path, out = mini(tmp_path, "lost", steps=2), tmp_path / "out"
    study, url = load_study(str(path)), storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=60)
    assert run_trial(study, optuna_study, claim(optuna_study, url, out), out, url)
    (out / "optuna.db").unlink()  # the storage lost, its trials' folders kept
    code, _, stderr = cli("study", "run", path, "--out", out)
    said = " ".join(stderr.split())
    assert code == 1 and "holds no study lost-tiny, but" in said and "holds 1 trial of it (0000-yoco-s0-lr0)" in said, stderr
    assert "Traceback" not in stderr and not (out / "optuna.db").exists() or not optuna.get_all_study_names(url)  # nothing queued


def test_each_seed_of_a_study_trains_with_that_seed(tmp_path, cli):
    """A trial planned with seed s trains with seed s: with the config's seed instead, every seed
    of a study trained the same run, and its spread over seeds was zero."""
    out = tmp_path / "out"
    study = mini(tmp_path, variants={"yoco": {"spec": "yoco.yaml"}}, steps=2, seeds=[3, 5], lr={"low": 0.003, "high": 0.003, "points": 1})
    code, _, stderr = cli("study", "run", study, "--out", out)
    assert code in OK, stderr
    trials = trials_of(f"sqlite:///{out / 'optuna.db'}", "mini")
    assert sorted(planned_as(t)[1] for t in trials) == [3, 5]
    for trial in trials:
        config = yaml.safe_load((Path(trial.user_attrs["run"]) / "config.yaml").read_text())
        assert config["seed"] == planned_as(trial)[1]
    assert trials[0].value != trials[1].value


def test_a_reports_markdown_table_signs_its_differences_and_rounds_each_column_its_own_way(tmp_path):
    """The markdown table is read by people comparing variants: a variant worse than the baseline
    reads "+0.1000" (a sign on every difference, so better and worse are told apart at a glance),
    the share of the baseline's tokens three decimals, scores four, the cache two, counts with SI
    prefixes; JSON and CSV keep the numbers whole."""
    study = load_study(str(mini(tmp_path, "shown", seeds=[0, 1])))
    trials = [finished("yoco", 0, 0, 2.5, 0.002), finished("yoco", 1, 0, 2.7, 0.002),
              finished("yoco-u", 0, 0, 2.6, 0.002), finished("yoco-u", 1, 0, 2.8, 0.002)]
    (_, worse) = summarize(study, trials)
    assert worse["vs baseline"] == pytest.approx(0.1)
    kv = next(column for column in worse if column.startswith("KV MiB"))
    row = {**worse, "params": 1_234_567, "train FLOPs": 2.5e12, kv: 1.23456, "share of baseline tokens": 1.23456,
           "vs baseline at its FLOPs": 0.05}
    table = render([readable(row, maximize=False)], Format.md)
    assert "| yoco-u | 1.23M | 2.50T | 1.23 | 4 | 2.7000 | 0.1414 | 2 | 0.002 | 0/0 | +0.1000 | 1.235 | +0.0500 |" in table, table
    better = readable({**row, "vs baseline": -0.1, "vs baseline at its FLOPs": -0.05}, maximize=False)
    assert (better["vs baseline"], better["vs baseline at its FLOPs"]) == ("-0.1000", "-0.0500")


def test_an_accuracy_studys_report_shows_its_metric_as_a_score_and_a_variant_with_none_complete_as_zero_seeds(tmp_path):
    """metric: accuracy is the table's score column, four decimals like a loss, and the baseline
    line says higher is better without the note on a loss study's extra accuracy column (there is
    none beside it). A variant none of whose trials completed is still a row: 0 seeds, "-" for
    every figure it has not got, so the reader sees it ran and failed rather than a gap."""
    study = load_study(str(mini(tmp_path, "acc", metric="accuracy")), data="mqar")
    recorded = optuna.create_study(direction="maximize")
    for trial in (finished("yoco", 0, 0, 0.25, 0.002), finished("yoco", 0, 1, 0.5, 0.004),
                  finished("yoco-u", 0, 0, None, 0.002, state=TrialState.FAIL)):
        trial.user_attrs["flops_per_step"] = 1e9  # for the plot against FLOPs
        recorded.add_trial(trial)
    markdown = report(study, recorded, tmp_path / "out", "sqlite:///study.db")
    assert "- baseline: `yoco`; higher accuracy is better\n" in markdown and "of the tokens scored" not in markdown
    (yoco, none) = summarize(study, recorded.get_trials())
    assert (yoco["accuracy"], yoco["best lr"], none["seeds"], none["accuracy"]) == (0.5, 0.004, 0, None)
    shown = readable(none, maximize=True)
    assert (shown["seeds"], shown["accuracy"], shown["best lr"], shown["pruned/failed"]) == (0, "-", "-", "0/1")
    assert "| yoco | " in markdown and " | 0.5000 | - | 1 | 0.004 | 0/0 | +0.0000 |" in markdown, markdown


def test_a_write_the_disk_cut_short_stops_the_worker_as_a_full_disk_does(tmp_path, monkeypatch):
    """numpy says a short write (a corpus a trial tokenizes into its own folder) with no errno: the
    trial failed, and so, in turn, did every trial after it on the same full disk."""
    from archlab.files import write_whole

    def cut_short(f):
        raise OSError("190000 requested and 114656 written")

    with pytest.raises(OSError) as raised:
        write_whole(tmp_path / "train.npy", cut_short)
    assert "is the disk full?" in str(raised.value) and refused_by_the_machine(raised.value)
