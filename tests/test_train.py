"""Training as a user runs it: real data, exact resume after SIGKILL, clear failures, torchrun."""

import contextlib
import copy
import hashlib
import importlib.metadata
import json
import math
import os
import pickle
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from rich.console import Console
from safetensors.torch import load_file

from archlab.bench import device_name
from archlab.environment import describe, environment
from archlab.spec import load_spec
from archlab.train.checkpoint import CheckpointError, checkpoints, file_hash
from archlab.train.config import RESUMABLE, TrainConfig, kept_on_resume, load_config
from archlab.train.data import DataError, RecallTask, TokenSource, load_tokenizer, read_texts, train_tokenizer
from archlab.train.trainer import Trainer, lr_factor
from conftest import ROOT, files_no_bigger_than, in_process_cli, interruptible, no_longer_than

SMALL = ["--set", "seq_len=64", "--set", "batch_size=8", "--set", "micro_batch_size=4", "--set", "data.max_bytes=400000",
         "--set", "eval_batches=2", "--set", "log_interval=1"]


def archlab(*args, cwd=ROOT, **kwargs):
    return subprocess.run([sys.executable, "-m", "archlab", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "COLUMNS": "500"}, **kwargs)  # no line breaks inside a message


def losses(run_dir):
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def clean_failure(result, *fragments):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def refused(outcome, *fragments):
    """An in-process command (the ``cli`` fixture) that failed with one clear message: the form of
    ``clean_failure`` for a command run in this process, where a traceback is an exception let out."""
    code, out, stderr = outcome
    assert "Traceback" not in stderr + out, stderr
    assert code not in (0, None) and all(fragment in stderr for fragment in fragments), stderr


def test_killed_run_resumes_bitwise(tmp_path):
    spec = "specs/tiny/transformer.yaml"
    common = [*SMALL, "--set", "checkpoint_interval=5", "--set", "eval_interval=1000", "--steps", "120"]
    resumed = tmp_path / "resumed"
    proc = subprocess.Popen([sys.executable, "-m", "archlab", "train", spec, "--out", resumed, *common], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = resumed / "checkpoints" / "step-00000010"
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    started = max((resumed / "checkpoints").glob("step-*"))
    shutil.copytree(started, tmp_path / started.name)  # the resumed run removes it later (keep_checkpoints)
    resume = archlab("train", spec, "--out", resumed, "--resume", "--steps", "120")
    assert resume.returncode == 0, resume.stderr
    assert "resuming from" in resume.stderr
    assert "total goes from" not in resume.stderr  # the same total: the same schedule, nothing to say

    reference = tmp_path / "reference"  # keeps every checkpoint, for the message below
    straight = archlab("train", spec, "--out", reference, *common, "--set", "keep_checkpoints=24")
    assert straight.returncode == 0, straight.stderr
    assert len(losses(reference)) == 120
    assert len(list((resumed / "checkpoints").glob("step-*"))) == 3  # keep_checkpoints
    if losses(resumed) == losses(reference):  # bitwise
        return
    # Rarely (twice in several hundred runs here; cause unknown) an uninterrupted run lands an ulp
    # away from the others. A second one tells a resume that differs from a reference that does.
    again = tmp_path / "again"
    assert archlab("train", spec, "--out", again, *common).returncode == 0
    if losses(again) == losses(reference):
        pytest.fail(where_they_part(resumed, reference, tmp_path / started.name))
    if losses(again) != losses(resumed):
        pytest.skip(f"uninterrupted runs differ here ({parting(again, reference)}), so resuming cannot be checked bit for bit")
    warnings.warn(f"one uninterrupted run differed from another and from the resumed run ({parting(reference, again)})")


def parting(a, b) -> str:
    """Where the losses of two runs first differ, in words."""
    for (step, x), (_, y) in zip(losses(a), losses(b)):
        if x != y:
            return f"step {step}: {a.name} {x!r}, {b.name} {y!r}"
    return f"{len(losses(a))} steps logged by {a.name}, {len(losses(b))} by {b.name}"


def where_they_part(resumed, reference, started) -> str:
    """The first step whose loss differs, and whether the checkpoint the run resumed from holds the
    reference's weights at that step: if it does, the difference arose in the resumed process's
    arithmetic; if not, in the killed process's last updates."""
    weights = [load_file(folder / "model.safetensors") for folder in (started, reference / "checkpoints" / started.name)]
    differ = [name for name in weights[0] if not torch.equal(weights[0][name], weights[1][name])]
    return (f"{parting(resumed, reference)}; the resumed run started from {started.name}, whose weights differ from the"
            f" reference's in {differ or 'no tensor'}")


def test_distributed_gloo_matches_one_process(cli, tmp_path):
    """micro_batch_size is left at its default, 16, which no share of a batch of 8 split in two
    took: each process passes its whole share, as one process does its whole batch."""
    spec = "specs/tiny/yoco-u.yaml"
    at_default = [arg for pair in zip(SMALL[::2], SMALL[1::2]) if pair[1] != "micro_batch_size=4" for arg in pair]
    common = [*at_default, "--set", "eval_interval=1000", "--steps", "6"]
    one = cli("train", spec, "--out", tmp_path / "one", *common)
    assert one[0] == 0, one[2]
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "archlab", "train",
         spec, "--out", str(tmp_path / "two"), *common],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert two.returncode == 0, two.stderr
    assert two.stderr.count("done: 6 steps") == 1  # said by the first process alone
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 7))
    for (_, x), (_, y) in zip(a, b):
        assert y == pytest.approx(x, rel=1e-4)
    settings = [yaml.safe_load((tmp_path / run / "environment.yaml").read_text())[0] for run in ("one", "two")]
    assert "processes" not in settings[0] and settings[1]["processes"] == "2"
    assert [load_config(str(tmp_path / run / "config.yaml")).micro_batch_size for run in ("one", "two")] == [8, 4]


@pytest.mark.parametrize("spec,diverge,what", [  # a NaN loss itself: test_study's exploding trials
    ("transformer", ["--set", "grad_clip=0", "--set", "optimizer.lr=1e6", "--set", "checkpoint_interval=2"], "became"),
    # clipped, the loss stays finite while the gradient is NaN; keeping one checkpoint would prune the good one
    ("yoco", ["--set", "optimizer.lr=1e4", "--set", "checkpoint_interval=1", "--set", "keep_checkpoints=1"], "gradient norm became nan"),
])
def test_divergence_stops_and_keeps_the_last_good_checkpoint(cli, tmp_path, spec, diverge, what):
    run = tmp_path / "run"
    result = cli("train", f"specs/tiny/{spec}.yaml", "--out", run, *SMALL, "--set", "schedule.warmup_steps=0", *diverge, "--steps", "50")
    refused(result, what, "training stopped before applying it")
    stderr = result[2]
    kept = sorted((run / "checkpoints").glob("step-*"))
    right_after = int(kept[-1].name.removeprefix("step-")) + 1 == int(re.search(r"at step (\d+);", stderr)[1])
    assert ("first step from" in stderr) == right_after  # its weights alone gave the NaN: no learning rate helps
    assert kept, "a good checkpoint was written before the run diverged"
    assert str(kept[-1]) in stderr
    weights = load_file(kept[-1] / "model.safetensors")
    assert all(t.isfinite().all() for t in weights.values())
    def refuse(constant):
        raise AssertionError(f"metrics.jsonl holds {constant}")
    records = [json.loads(line, parse_constant=refuse) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == int(kept[-1].name.removeprefix("step-"))  # nothing logged past the last good step
    if spec == "transformer":  # its last checkpoint's own weights give a NaN gradient: no learning rate helps
        again = cli("train", f"specs/tiny/{spec}.yaml", "--out", run, "--resume", "--set", "optimizer.lr=1e-3", "--steps", "50")
        refused(again, f"and it is the first step from {kept[-1]}, whose weights lead there at any learning rate",
                f"move {kept[-1].name} out of checkpoints/")


def test_a_spec_whose_initial_weights_diverge_is_sent_to_build(cli, tmp_path):
    spec = tmp_path / "huge-init.yaml"
    spec.write_text(f"extends: {ROOT / 'specs/tiny/transformer.yaml'}\nname: huge-init\ninit_std: 1.0e+30\n")
    refused(cli("train", spec, "--out", tmp_path / "run", *SMALL, "--steps", "2"), "became nan at step 1",
            "no checkpoint had been written; the spec's initial weights lead there: `archlab build` names where nan or inf first appear")
    code, out, _ = cli("build", spec)
    assert code == 1 and "1 problem(s)" in out


def test_weights_past_float_range_are_not_saved(cli, tmp_path):
    """The loss of the step that overflowed them is still finite; the checkpoint would be unusable."""
    run = tmp_path / "run"
    result = cli("train", "specs/tiny/transformer.yaml", "--out", run, *SMALL, "--set", "schedule.warmup_steps=0",
                 "--set", "optimizer.lr=1e39", "--set", "checkpoint_interval=1", "--steps", "5")
    refused(result, "weights became non-finite by step 1 (embed.weight", "training stopped before saving them",
            "no checkpoint had been written")
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["--data", "no/such/place"], ["no such file or folder"]),
        (["--set", "micro_batch_size=3"], ["micro_batch_size", "does not divide batch_size=8"]),
        (["--set", "data.source=''"], ["data.source: is empty; give stdlib, a path"]),  # read as a path: the current folder
        (["--set", "optimizer.learning_rate=1"], ["optimizer.learning_rate", "unknown key"]),
        (["--set", "seq_len=5000000"], ["sequence length 5000000 needs at least 5000001 tokens"]),
        (["--set", "lr"], ["expected KEY=VALUE"]),
        (["--set", "=3"], ["=3: expected KEY=VALUE"]),  # not "not a training config field"
        (["--data", "mqar", "--set", "data.source=copy"], ["--data mqar and --set data.source=copy name two sources; give one"]),
        (["--init", "a", "--set", "init=b"], ["--init a and --set init=b name two starts; give one"]),
        (["--set", "lr=1e-3"], ["lr: not a training config field: did you mean optimizer.lr?"]),
        (["--set", "layout.cross_decoder.blocks.0.backend=flex"],
         ["layout.cross_decoder.blocks.0.backend", "--set reaches only the training config", "a spec that `extends` it"]),
    ],
)
def test_bad_input_is_a_clear_error(cli, tmp_path, args, fragments):
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "run", *SMALL, "--steps", "2", *args), *fragments)


def test_a_config_key_at_the_wrong_level_is_pointed_to_its_section(cli, tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text("lr: 1.0e-3\nwarmup_steps: 3\n")
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "run", "--config", config),
            "lr: unknown key", "did you mean optimizer.lr?", "warmup_steps: unknown key", "did you mean schedule.warmup_steps?")
    assert not (tmp_path / "run").exists()


def test_empty_corpus_and_bad_token_file(cli, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("   \n")
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "r1", "--data", empty, *SMALL),
            "holds no text (looked at 1 file(s); a folder's files ending in .c, .csv,")
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(5000) % 300)  # ids beyond the vocabulary of 256
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "r2", "--data", tokens, *SMALL),
            "token id 299 >= vocab_size 256")
    np.save(tokens, np.arange(5000) % 200 - 5)
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "r3", "--data", tokens, *SMALL),
            "has token id -5; ids start at 0")
    np.save(tokens, np.array([[i] for i in range(5000)], dtype=object), allow_pickle=True)  # pickled objects
    objects = cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "r4", "--data", tokens, *SMALL)
    refused(objects, "holds Python objects, not token ids; save token ids with numpy.save")
    assert "allow_pickle" not in objects[2]
    tokens.write_bytes(pickle.dumps(list(range(5000))))  # a pickle, named .npy
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "r4", "--data", tokens, *SMALL),
            "is not a NumPy .npy file")
    raw = tmp_path / "tokens.bin"  # ids written as uint32, read with the default width of uint16
    (np.arange(5000) % 200).astype(np.uint32).tofile(raw)
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "r5", "--data", raw, *SMALL),
            "read as uint16 holds ids below 16 alone at its odd positions (at most 0) and up to 199", "set data.token_dtype: uint32")
    (np.arange(5000) % 200).tofile(raw)  # numpy's default int64: read as uint32 too, every other id was 0, and it trained
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "r5", "--data", raw, *SMALL, "--set", "data.token_dtype=uint32"),
            "as the high halves of 64-bit ids read as uint32 do; save them with numpy.save as .npy")
    big = tmp_path / "big.yaml"  # a 100K vocabulary's uint32 ids read as uint16: high halves of 0 and 1, which it trained on
    big.write_text(f"extends: {ROOT / 'specs/tiny/transformer.yaml'}\nname: big\nvocab_size: 100352\n")
    np.random.default_rng(0).integers(0, 100352, 20000).astype(np.uint32).tofile(raw)
    refused(cli("train", big, "--out", tmp_path / "r5", "--data", raw, *SMALL), "(at most 1) and up to 65")
    upper = tmp_path / "TOKENS.NPY"  # from a case-blind system: read as a token file, not as text
    with open(upper, "wb") as f:  # np.save would add .npy to the name
        np.save(f, np.arange(5000) % 200)
    assert cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "r7", "--data", upper, *SMALL, "--steps", "1")[0] == 0
    (np.arange(5000) % 200).astype(np.uint16).tofile(raw)  # and the other way round
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "r6", "--data", raw, *SMALL,
                "--set", "data.token_dtype=uint32"), "(read as uint32: is that the width it was written in?")


def test_a_text_folder_leaves_out_its_hidden_folders(tmp_path):
    """A project folder's .venv or .git would otherwise fill the corpus before the text meant."""
    from archlab.train.data import read_texts

    (tmp_path / ".venv" / "lib").mkdir(parents=True)
    (tmp_path / ".venv" / "lib" / "big.py").write_text("import os\n" * 1000)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.txt").write_text("the notes")
    assert read_texts(str(tmp_path), 5000) == ["the notes"]
    assert read_texts(str(tmp_path / ".venv"), 20) == ["import os\n" * 2]  # given as the corpus, it is read


def test_a_text_folder_follows_linked_folders_once_and_drops_byte_order_marks(tmp_path):
    """A linked subfolder was skipped without a word (a corpus of links held "no text"), and a
    file's byte-order mark became the first characters of the corpus."""
    from archlab.train.data import read_texts

    shared, corpus = tmp_path / "shared", tmp_path / "corpus"
    shared.mkdir()
    (shared / "a.txt").write_text("shared text")
    corpus.mkdir()
    (corpus / "linked").symlink_to(shared, target_is_directory=True)
    (corpus / "again").symlink_to(shared, target_is_directory=True)  # one folder, linked twice: read once
    (shared / "up").symlink_to(corpus, target_is_directory=True)  # a loop
    (corpus / "own.md").write_bytes("\ufeffits own".encode())
    assert read_texts(str(corpus), 5000) == ["shared text", "its own"]


@pytest.mark.parametrize("max_bytes", [1, 4095, 4096, 8193, 100_001])
def test_a_text_file_is_read_as_far_as_max_bytes_as_reading_it_whole_cut_it(tmp_path, max_bytes):
    """The same characters, newlines read as text mode reads them, so a corpus tokenizes as it did."""
    text = "".join(f"line {i}\r\nd\u00e9j\u00e0 \u20ac{i}\rdone \U0001f600\n" for i in range(10_000))
    (tmp_path / "text.txt").write_bytes(text.encode())
    with pytest.warns(UserWarning, match=re.escape(f"is read as far as data.max_bytes ({max_bytes:,} characters) and no further")):
        assert read_texts(str(tmp_path / "text.txt"), max_bytes) == [(tmp_path / "text.txt").read_text(encoding="utf-8")[:max_bytes]]


def test_a_corpus_cut_by_max_bytes_is_said_and_one_read_whole_is_not(tmp_path):
    """data.max_bytes (16M characters unless set) cut a larger corpus without a word, and the run
    trained on its first part, epoch after epoch."""
    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "b.txt").write_text("defg")
    (tmp_path / "c.txt").write_text("")  # after the budget is filled, nothing is left unread
    (tmp_path / "d.txt").write_bytes(b"\xff")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_texts(str(tmp_path), 7) == ["abc", "defg"]
        assert read_texts(str(tmp_path / "b.txt"), 4) == ["defg"]
    for max_bytes, read in ((3, ["abc"]), (6, ["abc", "def"])):  # a file left unread, and one cut
        with pytest.warns(UserWarning, match=re.escape(f"data source {str(tmp_path)!r} is read as far as data.max_bytes")):
            assert read_texts(str(tmp_path), max_bytes) == read


def test_a_tokenizer_with_an_id_past_the_vocabulary_is_refused(tmp_path):
    """Its ids may leave gaps: 27 tokens, one of them at 300, passed a count against a vocabulary
    of 256 and stopped the first step in the embedding."""
    from tokenizers import Tokenizer, models

    path = tmp_path / "words.json"
    Tokenizer(models.WordLevel({chr(97 + i): i for i in range(26)} | {"[UNK]": 300}, unk_token="[UNK]")).save(str(path))
    with pytest.raises(DataError, match=re.escape(f"tokenizer {str(path)!r} gives '[UNK]' the id 300, past the spec's vocab_size 256")):
        load_tokenizer(str(path), 256)
    assert load_tokenizer(str(path), 301).token_to_id("[UNK]") == 300


def test_a_run_writes_neither_over_its_tokenizer_nor_into_the_text_it_reads(cli, tmp_path):
    """A tokenizer kept where the run writes its own was written over (its template dropped), or
    removed with a failed attempt's corpus; a run inside its text folder trained on its own spec,
    config and tokenizer."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "text.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 500)
    for holder, where in ((tmp_path / "run", "--out"), (tmp_path / "cache", "data.cache")):
        holder.mkdir()
        train_tokenizer(["the quick brown fox"], 256).save(str(holder / "tokenizer.json"))
        given = (holder / "tokenizer.json").read_bytes()
        refused(cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "run", "--data", corpus / "text.txt", *SMALL,
                    "--set", f"data.cache={tmp_path / 'cache'}" if where == "data.cache" else "seed=0",
                    "--set", f"data.tokenizer={holder / 'tokenizer.json'}", "--steps", "1"),
                f"data.tokenizer {holder / 'tokenizer.json'} is where the run writes the tokenizer it reads its text with,"
                f" over what it holds; keep it outside {where}")
        assert (holder / "tokenizer.json").read_bytes() == given and sorted(os.listdir(holder)) == ["tokenizer.json"]
    inside = corpus / "runs/a"
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", inside, "--data", corpus, *SMALL, "--steps", "1"),
            f"--out {inside} is inside the text folder {corpus}: the files the run writes there would be read as training text")
    assert not (corpus / "runs").exists()
    (tmp_path / "runs").mkdir()
    (corpus / "linked").symlink_to(tmp_path / "runs")  # a linked folder is read as its own are
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", corpus / "linked/a", "--data", corpus, *SMALL, "--steps", "1"),
            f"--out {corpus / 'linked/a'} is inside the text folder {corpus}")
    assert not os.listdir(tmp_path / "runs")
    (corpus / "linked").unlink()
    hidden = corpus / ".runs/a"  # a folder's hidden folders are not read
    assert cli("train", "specs/tiny/transformer.yaml", "--out", hidden, "--data", corpus, *SMALL, "--steps", "1")[0] == 0


def test_a_finished_run_resumed_with_nothing_to_do_writes_nothing(cli, tmp_path):
    """It rewrote metrics.jsonl all the same, so the resume of a run on a read-only disk failed."""
    run = tmp_path / "run"
    assert cli("train", "specs/tiny/transformer.yaml", "--out", run, "--set", "data.source=mqar", *SMALL, "--steps", "2")[0] == 0
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in run.rglob("*")}
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume")
    assert code == 0 and before == {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in run.rglob("*")}, stderr


def test_a_run_named_as_its_recall_task_trains(cli, tmp_path, monkeypatch):
    """``--out mqar --data mqar`` was refused as a run inside "the text folder mqar": the run's own, just made."""
    monkeypatch.chdir(tmp_path)
    code, _, stderr = cli("train", ROOT / "specs/tiny/transformer.yaml", "--out", "mqar", "--data", "mqar", *SMALL, "--steps", "1")
    assert code == 0 and (tmp_path / "mqar" / "checkpoints").is_dir(), stderr


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
def test_a_stream_or_device_is_refused_as_no_regular_file_before_it_is_read(tmp_path):
    """/dev/zero was read whole, until the kernel killed the run with no word; a FIFO blocked the
    run without one, and a FIFO named .npy was read as text."""
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    for source in ("/dev/zero", str(fifo)):
        with pytest.raises(DataError, match=r"not a regular file or folder \(a FIFO, a device or a socket\)$"):
            read_texts(source, 100_000)


def test_a_token_or_examples_file_that_is_no_regular_file_is_said_to_be_what_it_is(tmp_path):
    """Each was said to be "no such file" (examples), or read as a text corpus (a folder or FIFO
    named .npy or .bin), or a device said to hold no text."""
    from archlab.train.config import Data
    from archlab.train.data import prepare

    (tmp_path / "folder.npy").mkdir()
    (tmp_path / "folder.npy" / "a.txt").write_text("text " * 1000)
    os.mkfifo(tmp_path / "fifo.jsonl")
    (tmp_path / "zero.bin").symlink_to("/dev/zero")
    (tmp_path / "loop.jsonl").symlink_to(tmp_path / "loop.jsonl")
    for name, said in [("folder.npy", "a folder, not a file"), ("fifo.jsonl", "not a regular file (a FIFO, a device or a socket)"),
                       ("zero.bin", "not a regular file (a FIFO, a device or a socket)"), ("loop.jsonl", "a symbolic link to nothing, or in a loop"),
                       ("none.npy", "no such file")]:
        with pytest.raises(DataError, match=re.escape(f"data source '{tmp_path / name}': {said}")):
            prepare(Data(source=str(tmp_path / name)), 256, 32, 0, tmp_path / "run")
    (tmp_path / "cache").write_text("")  # was "File exists"
    with pytest.raises(DataError, match=re.escape(f"data.cache '{tmp_path / 'cache'}': not a folder")):
        prepare(Data(source=str(tmp_path / "folder.npy" / "a.txt"), cache=str(tmp_path / "cache")), 256, 32, 0, tmp_path / "cache")


def test_a_folder_of_a_corpus_that_cannot_be_listed_is_named(tmp_path, monkeypatch):
    """os.walk skipped a folder it could not list (no permission) without a word: its files were
    left out of the corpus, and a corpus whose top folder was so said it held no text, not why."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("text " * 100)
    (tmp_path / "sub" / "b.txt").write_text("more " * 100)
    scandir = os.scandir

    def refused(path=".", locked=str(tmp_path / "sub")):
        if os.fspath(path) in (locked, str(tmp_path / "locked")):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refused)
    with pytest.warns(UserWarning, match=re.escape("could not list 1 folder(s), whose files are left out: sub (Permission denied)")):
        assert read_texts(str(tmp_path), 100_000) == ["text " * 100]
    (tmp_path / "locked").mkdir()
    with pytest.raises(DataError, match=re.escape(f"could not list 1 folder(s), whose files are left out: {tmp_path / 'locked'} (Permission denied)")):
        read_texts(str(tmp_path / "locked"), 100_000)


def test_a_file_that_is_not_utf8_is_named(cli, tmp_path):
    """A Latin-1 file is not "no text": the error names it and its first bad byte."""
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "run", "--data", latin1, *SMALL),
            f"data source {str(latin1)!r} holds no text (looked at 1 file(s)); left out 1 file(s) that are not UTF-8 text:"
            f" {latin1} (not UTF-8: byte 0xe9); convert text in another encoding to UTF-8")


def test_a_folder_names_the_files_it_leaves_out(tmp_path):
    """Files of a folder that are not UTF-8 text are left out with a notice naming them, not in silence."""
    (tmp_path / "old").mkdir()
    for i in range(6):
        (tmp_path / "old" / f"latin{i}.txt").write_bytes("caf\u00e9\n".encode("latin-1"))
    (tmp_path / "zeros.txt").write_bytes(b"\0" * 5000)
    (tmp_path / "good.txt").write_text("caf\u00e9 au lait\n")
    with pytest.warns(UserWarning) as said:
        assert read_texts(str(tmp_path), 5000) == ["caf\u00e9 au lait\n"]
    bad = "(not UTF-8: byte 0xe9)"
    assert [str(w.message) for w in said] == [(
        f"data source {str(tmp_path)!r}: left out 7 file(s) that are not UTF-8 text: old/latin0.txt {bad}, old/latin1.txt {bad},"
        f" old/latin2.txt {bad}, old/latin3.txt {bad}, old/latin4.txt {bad}, and 2 more; convert text in another encoding to"
        " UTF-8 (e.g. iconv -f latin1 -t utf-8)"
    )]


def test_corrupt_checkpoint_and_existing_run_are_refused_without_loss(cli, tmp_path):
    run = tmp_path / "run"
    assert cli("train", "specs/tiny/transformer.yaml", "--out", run, *SMALL, "--steps", "4",
               "--set", "checkpoint_interval=2")[0] == 0
    again = cli("train", "specs/tiny/transformer.yaml", "--out", run, *SMALL, "--steps", "4")
    refused(again, "already holds a run", "--resume")
    latest = sorted((run / "checkpoints").glob("step-*"))[-1]
    for damaged, fragment in (("trainer.pt", "trainer.pt does not load"), ("model.safetensors", "is damaged")):
        (latest / damaged).write_bytes(b"garbage" * 30)
        before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
        resumed = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "8")
        refused(resumed, fragment, "remove it to resume from the one before")
        assert "weights_only" not in resumed[2]  # torch's advice to load it unsafely is not passed on
        assert before == {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    shutil.rmtree(sorted((run / "checkpoints").glob("step-*"))[0])  # the one before: none left to go back to
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "8"), "is damaged (SafetensorError",
            "and no checkpoint before it is kept: train the run again into a new --out (or remove this one's checkpoints and metrics.jsonl)")
    other = cli("train", "specs/tiny/yoco.yaml", "--out", run, "--resume")
    refused(other, "was trained with a different spec than specs/tiny/yoco.yaml: name transformer -> yoco;")


def test_optimizer_state_of_another_shape_is_refused_before_anything_is_written(cli, tmp_path):
    """AdamW's ``load_state_dict`` checks only how many parameters a group has; its fused step read
    a moment of another shape (a trainer.pt from a narrower run) out of bounds and killed the process."""
    run = tmp_path / "run"
    assert cli("train", "specs/tiny/transformer.yaml", "--out", run, *SMALL, "--steps", "2")[0] == 0
    latest = sorted((run / "checkpoints").glob("step-*"))[-1]
    state = torch.load(latest / "trainer.pt", weights_only=True)
    moments = state["optimizer"]["state"][0]
    shape = tuple(moments["exp_avg"].shape)
    moments["exp_avg"] = moments["exp_avg"][:3].clone()
    torch.save(state, latest / "trainer.pt")
    info = json.loads((latest / "state.json").read_text())  # saved as its own: its hash recorded
    (latest / "state.json").write_text(json.dumps({**info, "trainer_blake2b": file_hash(latest / "trainer.pt")}))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    way_out = "remove it to resume from the one before" if len(checkpoints(run)) > 1 else "no checkpoint before it is kept"
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "4"),
            f"checkpoint {latest} is damaged (unusable trainer state: its exp_avg for a parameter of shape {shape} is"
            f" {(3, *shape[1:])})", way_out)
    assert before == {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    state["optimizer"]["state"][0]["exp_avg"] = torch.zeros(shape)  # its own shape again
    for damage, said in [  # a traceback at load or at the first step (config.yaml rewritten by then), or trained on
        (lambda optimizer: optimizer["state"][0].pop("exp_avg_sq"), f"its exp_avg_sq for a parameter of shape {shape} is NoneType"),
        (lambda optimizer: optimizer["state"][0]["exp_avg_sq"].view(-1)[:1].fill_(float("nan")), "holds values no AdamW step makes"),
        (lambda optimizer: optimizer["state"][0].update(step=torch.tensor([1.0, 2.0])), "its step count for a parameter of shape"),
        (lambda optimizer: optimizer.update(state="hello"), "unusable trainer state: "),
    ]:
        damaged = copy.deepcopy(state)
        damage(damaged["optimizer"])
        torch.save(damaged, latest / "trainer.pt")
        (latest / "state.json").write_text(json.dumps({**info, "trainer_blake2b": file_hash(latest / "trainer.pt")}))
        before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
        refused(cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "4"), said, way_out)
        assert before == {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}


def test_a_spec_edited_since_its_checkpoint_is_refused_on_resume(cli, tmp_path):
    """Weights that still fit another loop count would have trained on as another model under the
    run's name: the checkpoint records the spec it trained."""
    run = tmp_path / "run"
    assert cli("train", "specs/tiny/yoco-u.yaml", "--out", run, *SMALL, "--steps", "2")[0] == 0
    (run / "spec.yaml").write_text((run / "spec.yaml").read_text().replace("times: 3", "times: 2"))
    latest = run / "checkpoints/step-00000002"
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    refused(cli("train", run, "--out", run, "--resume", "--steps", "4"),
            f"checkpoint {latest} trained another spec than the run's spec.yaml (loop.times 3 -> 2): put spec.yaml back as it"
            f" was to resume, or start a new run from these weights with --init {latest}")
    assert before == {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    edited = f"notice: {run / 'spec.yaml'} is not the spec checkpoint {latest} trained (loop.times 3 -> 2); it runs as edited"
    code, _, stderr = cli("generate", run, "--max-new-tokens", "1")  # as one may mean, a notice only
    assert code == 0 and edited in " ".join(stderr.split()), stderr
    state = json.loads((latest / "state.json").read_text())
    del state["spec"]  # as checkpoints were written before they recorded it: nothing to compare
    (latest / "state.json").write_text(json.dumps(state))
    code, _, stderr = cli("generate", run, "--max-new-tokens", "1")
    assert code == 0 and "it runs as edited" not in stderr, stderr
    code, _, stderr = cli("train", run, "--out", run, "--resume", "--steps", "3")
    assert code == 0, stderr


def test_a_config_edited_since_its_checkpoint_is_refused_on_resume(cli, tmp_path):
    """A --set of seq_len or seed is refused against config.yaml; the same edit made to config.yaml
    resumed as another experiment, its tokens counted anew from step 0. Settings a resume may
    change are taken from the file as before."""
    run = tmp_path / "run"
    assert cli("train", "specs/tiny/transformer.yaml", "--out", run, *SMALL, "--steps", "2")[0] == 0
    config = (run / "config.yaml").read_text()
    assert "\nseq_len: 64\n" in config and "\nseed: 0\n" in config and "\n  lr: 0.003\n" in config
    (run / "config.yaml").write_text(config.replace("\nseq_len: 64\n", "\nseq_len: 32\n").replace("\nseed: 0\n", "\nseed: 1\n"))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    refused(cli("train", run, "--out", run, "--resume", "--steps", "4"),
            f"{run / 'config.yaml'} was edited since checkpoint {run / 'checkpoints/step-00000002'} was saved (seq_len 64 -> 32, seed"
            " 0 -> 1): a resumed run keeps these")
    assert before == {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    (run / "config.yaml").write_text(config.replace("\n  lr: 0.003\n", "\n  lr: 0.001\n"))
    code, _, stderr = cli("train", run, "--out", run, "--resume", "--steps", "3")
    assert code == 0 and json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3, stderr


def test_ctrl_c_before_the_first_checkpoint_says_there_is_nothing_to_resume(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "archlab", "train", "specs/tiny/transformer.yaml", "--out", run, *SMALL,
                             "--steps", "1000", "--set", "checkpoint_interval=1000"], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            preexec_fn=interruptible)
    deadline = time.time() + 120
    while not (run / "metrics.jsonl").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, stderr
    assert "interrupted; no checkpoint had been written, so there is nothing to resume" in stderr and "Traceback" not in stderr


def test_only_checkpoints_named_by_the_trainer_are_resumed_and_pruned(cli, tmp_path):
    run = tmp_path / "run"
    assert cli("train", "specs/tiny/transformer.yaml", "--out", run, *SMALL, "--steps", "4",
               "--set", "checkpoint_interval=2", "--set", "keep_checkpoints=2")[0] == 0
    latest = run / "checkpoints" / "step-00000004"
    shutil.copytree(latest, run / "checkpoints" / "step-00000004-keep")  # a user's copy, by a name of its own
    state = latest / "state.json"
    good = state.read_text()
    state.write_text(good.replace('"step": 4', '"step": 3'))
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "6"),
            f"checkpoint {latest} is damaged (its state.json is at step 3)")
    state.write_text(good)
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "8")
    assert code == 0, stderr
    assert f"resuming from {latest} (step 4)" in stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000004-keep", "step-00000006", "step-00000008"]


def test_token_files_tokenizer_and_budgets(cli, tmp_path):
    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 256, 20000).astype(np.uint16).tofile(tokens)
    run = tmp_path / "bin"
    code, _, stderr = cli("train", "specs/tiny/yoco-u-moe.yaml", "--out", run, "--data", tokens, *SMALL, "--tokens", "2K")
    assert code == 0, stderr
    records = losses(run)
    assert len(records) == 4  # 2048 tokens / (8 x 64) per step
    assert "less than one step" not in stderr
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert "moe_max_load" in first and first["moe_max_load"] >= 1.0

    text = tmp_path / "corpus"
    text.mkdir()
    (text / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    run = tmp_path / "text"
    from archlab.cost import Cost
    import archlab as lab

    per_step = Cost(lab.load_spec(ROOT / "specs/tiny/transformer.yaml")).train_flops_per_sequence(64) * 8
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--data", text, *SMALL, "--flops", str(3.5 * per_step))
    assert code == 0, stderr
    assert len(losses(run)) == 3
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(run / "tokenizer.json"))
    assert tokenizer.decode(tokenizer.encode("the lazy dog").ids) == "the lazy dog"
    code, stdout, stderr = cli("generate", run, "--prompt", "the lazy", "--max-new-tokens", "6")
    assert code == 0, stderr
    assert "weights from" in stderr and "tokenizer" in stderr
    assert stdout.startswith("the lazy")
    spec, model, used, tokens = lab.load_trained(str(run))  # the README's way in from Python
    assert (spec.name, used.name, tokens) == ("transformer", "step-00000003", run / "tokenizer.json")
    assert not model.training  # for inference: a plugin's dropout, say, off
    weights, held = load_file(used / "model.safetensors"), model.state_dict()
    assert len(weights.keys() & held.keys()) >= len(held) - 1  # all (one name fewer where embeddings are tied)
    assert all(torch.equal(weights[name], held[name]) for name in weights.keys() & held.keys())
    reuse = cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "reuse", "--data", text, *SMALL,
                "--set", f"data.tokenizer={run / 'tokenizer.json'}", "--steps", "2")
    assert reuse[0] == 0, reuse[2]
    assert (tmp_path / "reuse" / "data" / "train.npy").is_file()


def test_a_run_records_its_data_paths_whole_so_it_is_found_from_anywhere(cli, tmp_path, monkeypatch):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    (tmp_path / "elsewhere").mkdir()

    spec = ROOT / "specs/tiny/transformer.yaml"
    monkeypatch.chdir(tmp_path)  # each command run from the folder a user would run it in
    trained = cli("train", spec, "--out", "run", "--data", "corpus", *SMALL, "--set", "data.cache=shared", "--steps", "2")
    assert trained[0] == 0, trained[2]
    config, corpus = tmp_path / "run" / "config.yaml", tmp_path / "shared" / "data" / "corpus.json"
    data = yaml.safe_load(config.read_text())["data"]
    assert (data["source"], data["cache"]) == (str(tmp_path / "corpus"), str(tmp_path / "shared"))
    monkeypatch.chdir(tmp_path / "elsewhere")
    code, _, stderr = cli("generate", "../run", "--prompt", "the lazy", "--max-new-tokens", "4")
    assert code == 0, stderr
    assert "tokenizer ../run/tokenizer.json" in stderr  # its own copy
    assert (tmp_path / "run" / "tokenizer.json").read_bytes() == (tmp_path / "shared" / "tokenizer.json").read_bytes()
    resumed = cli("train", spec, "--out", "../run", "--resume", "--steps", "3")
    assert resumed[0] == 0, resumed[2]
    for file in (config, corpus):  # as a run recorded them before paths were made absolute
        file.write_text(file.read_text().replace(str(tmp_path) + "/", ""))
    monkeypatch.chdir(tmp_path)
    older = cli("train", spec, "--out", "run", "--resume", "--steps", "4")  # from where it was started
    assert older[0] == 0, older[2]
    own = (tmp_path / "run" / "tokenizer.json").read_bytes()
    # another corpus in the shared cache, as its refusal of other data advises, replaces the cache's tokenizer, not the run's
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "b.txt").write_text("a wholly different text, with words of its own: zebra quartz. " * 400)
    shutil.rmtree(tmp_path / "shared" / "data")
    wider = tmp_path / "v512.yaml"  # a vocabulary with merges to learn: tokenizers of 256 byte tokens are all alike
    wider.write_text(f"extends: {spec}\nname: v512\nvocab_size: 512\n")
    assert cli("train", wider, "--out", "other-run", "--data", "other", *SMALL, "--set", "data.cache=shared", "--steps", "1")[0] == 0
    assert (tmp_path / "shared" / "tokenizer.json").read_bytes() != own == (tmp_path / "run" / "tokenizer.json").read_bytes()
    (tmp_path / "run" / "tokenizer.json").unlink()  # as a run from before runs kept a copy, reading the cache's
    (tmp_path / "shared" / "tokenizer.json").unlink()  # byte tokens in its place would print garbage
    refused(cli("generate", "run", "--max-new-tokens", "4"),
            f"the run's tokenizer is not at {tmp_path / 'shared' / 'tokenizer.json'}, where data.cache")


def test_mqar_reports_accuracy(cli, tmp_path):
    run = tmp_path / "mqar"
    code, _, stderr = cli("train", "specs/tiny/yoco-u.yaml", "--out", run, "--data", "mqar", *SMALL, "--steps", "3",
                          "--set", "eval_interval=3")
    assert code == 0, stderr
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0.0 <= last["eval_acc"] <= 1.0 and last["eval_loss"] > 0
    # not a terminal: a plain line per logged step as it happens, the evaluation's accuracy with it
    lines = [line for line in stderr.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]
    assert "loss" in lines[0] and "lr" in lines[0] and "tok/s" in lines[0] and "eval" not in lines[0]
    assert f"acc {last['eval_acc']:.1%}" in lines[-1]


def test_a_terminal_gets_the_live_display(tmp_path):
    import io

    import archlab
    from rich.console import Console

    from archlab.train.trainer import Trainer

    spec = archlab.load_spec(ROOT / "specs" / "tiny" / "transformer.yaml")
    cfg = TrainConfig.model_validate({"batch_size": 4, "micro_batch_size": 4, "seq_len": 32, "data": {"source": "mqar"},
                                      "eval_interval": 2, "eval_batches": 1, "log_interval": 1})
    screen = io.StringIO()
    Trainer(spec, cfg, tmp_path / "run", Console(file=screen, force_terminal=True, force_interactive=True, width=200)).fit(2)
    assert "train" in screen.getvalue() and "acc " in screen.getvalue()
    assert "step 1/2" not in screen.getvalue()


@pytest.mark.skipif(torch.cuda.is_available(), reason="FlexAttention trains on CUDA")
def test_flex_attention_refuses_to_train_off_cuda_before_writing(cli, tmp_path):
    from archlab.spec import load_yaml, set_dotted

    data = load_yaml(ROOT / "specs" / "tiny" / "yoco-u.yaml")
    block = {"type": "swa", "window": 16, "n_heads": 4, "n_kv_heads": 2, "backend": "flex"}
    (tmp_path / "flex.yaml").write_text(yaml.safe_dump(set_dotted(data, "layout.self_decoder.blocks", [block])))
    run = tmp_path / "run"
    result = cli("train", tmp_path / "flex.yaml", "--out", run, "--data", "mqar", *SMALL, "--steps", "3")
    refused(result, "swa: backend flex has no backward pass on the CPU", "backend: torch or auto, or on a CUDA device")
    assert not run.exists()


def test_a_failed_start_leaves_its_folder_free_and_a_run_stays_protected(cli, tmp_path):
    run, first, second = tmp_path / "run", tmp_path / "first", tmp_path / "second"
    for corpus, text in ((first, "zzzz qqqq "), (second, "the quick brown fox. ")):
        corpus.mkdir()
        (corpus / "a.txt").write_text(text * 400)
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", run, "--data", "nothere/", *SMALL), "no such file")
    # a retry may fail after tokenizing (seq_len too long for the data): that corpus must not outlive it
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", run, "--data", first, *SMALL, "--set", "seq_len=100000"),
            "sequence length 100000")
    assert (run / "data" / "train.npy").is_file()
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume"),
            "nothing to resume", "start it without --resume")
    result = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--data", second, *SMALL, "--steps", "2")
    assert result[0] == 0, result[2]
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["source"] == str(second)
    from tokenizers import Tokenizer

    tokens = np.load(run / "data" / "train.npy")[:10].tolist()
    assert Tokenizer.from_file(str(run / "tokenizer.json")).decode(tokens) == "the quick "

    shutil.rmtree(run / "checkpoints")  # metrics alone are still a run
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", run, "--data", second, *SMALL),
            "holds the metrics of a run", "choose a new --out")
    assert before == {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}


def test_a_start_keeps_to_its_own_files_and_a_shared_corpus_to_its_data(cli, tmp_path):
    """A fresh run replaces only what a failed attempt of its own left; a folder holding anything
    else is refused untouched. A shared tokenized corpus serves only the data it was made from."""
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    for name in ("corpus.txt", "other.txt"):
        (home / "data" / name).write_text("the quick brown fox. " * 400)
    before = {p: p.read_bytes() for p in home.rglob("*") if p.is_file()}
    for attempt in (["--set", "seq_len=5000000"], []):
        refused(cli("train", "specs/tiny/transformer.yaml", "--out", home, "--data", home / "data" / "corpus.txt", *SMALL,
                    "--steps", "1", *attempt),
                "holds files that are not a training run's (data/corpus.txt, data/other.txt)", "choose an empty or new --out")
        assert before == {p: p.read_bytes() for p in home.rglob("*") if p.is_file()}
    mine = tmp_path / "mine"  # a config or spec kept in --out, which the run would write over
    mine.mkdir()
    (mine / "config.yaml").write_text("# mine\nsteps: 1\n")
    shutil.copy("specs/tiny/transformer.yaml", mine / "spec.yaml")
    for args, option in ((["specs/tiny/transformer.yaml", "--config", mine / "config.yaml"], "--config"), ([mine / "spec.yaml"], "SPEC")):
        refused(cli("train", *args, "--out", mine, *SMALL), f"{option} {mine / args[-1].name} is where the run writes its resolved",
                "keep it outside --out")
    assert (mine / "config.yaml").read_text() == "# mine\nsteps: 1\n" and sorted(p.name for p in mine.iterdir()) == ["config.yaml", "spec.yaml"]
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", mine, *SMALL),  # kept there, not given: replaced without a word
            "holds files that are not a training run's (config.yaml, spec.yaml)")
    assert (mine / "config.yaml").read_text() == "# mine\nsteps: 1\n" and sorted(p.name for p in mine.iterdir()) == ["config.yaml", "spec.yaml"]
    notes = tmp_path / "notes"  # a file named as the folder a run tokenizes into: "File exists", once the text was tokenized
    notes.mkdir()
    (notes / "data").write_text("mine")
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", notes, "--data", home / "data" / "corpus.txt", *SMALL),
            "holds files that are not a training run's (data)", "choose an empty or new --out")
    assert (notes / "data").read_text() == "mine" and [p.name for p in notes.iterdir()] == ["data"]

    shared, first, second = tmp_path / "shared", tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text("zzzz qqqq " * 400)
    second.write_text("the quick brown fox. " * 400)
    cache = ["--set", f"data.cache={shared}", *SMALL, "--steps", "1"]
    assert cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "a", "--data", first, *cache)[0] == 0
    made = {p: p.read_bytes() for p in shared.rglob("*") if p.is_file()}
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "b", "--data", second, *cache),
            f"{shared / 'data'} holds a corpus tokenized with source {str(first)!r}, not this data's",
            "give this data another data.cache")
    assert made == {p: p.read_bytes() for p in shared.rglob("*") if p.is_file()}
    again = cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "c", "--data", first, *cache)
    assert again[0] == 0, again[2]  # the same data reads the corpus back


def test_runs_sharing_a_cache_check_tokenize_and_read_back_its_corpus_one_at_a_time(tmp_path):
    """Each file of a tokenized corpus is written whole, but not the set: two runs tokenizing other
    corpora into one data.cache at once both went on, the files left were from either, and a run
    could read the other's back. A run now waits while another holds the cache's lock."""
    import fcntl
    import threading

    from archlab.train.config import Data
    from archlab.train.data import CORPUS_LOCK, prepare

    corpus, shared, prepared = tmp_path / "a.txt", tmp_path / "shared", []
    corpus.write_text("zzzz qqqq " * 400)
    shared.mkdir()
    run = threading.Thread(target=lambda: prepared.append(prepare(Data(source=str(corpus), cache=str(shared)), 256, 32, 0, shared)))
    with open(shared / CORPUS_LOCK, "a") as other:  # another run, tokenizing there
        fcntl.flock(other, fcntl.LOCK_EX)
        run.start()
        run.join(3)
        assert run.is_alive() and not (shared / "data").exists()  # waiting, nothing written
        fcntl.flock(other, fcntl.LOCK_UN)
    run.join(120)
    assert prepared and (shared / "data" / "train.npy").is_file()


def test_a_fifo_where_a_lock_file_belongs_is_refused_not_waited_on(tmp_path):
    """Opening a FIFO to write waits for a reader: a run sharing the cache, and a study's workers,
    hung there for good (here, until the alarm)."""
    import signal

    def waited(*_):
        pytest.fail("opened the FIFO, waiting for a reader")

    from archlab.study.runner import StorageError, storage_lock
    from archlab.train.config import Data
    from archlab.train.data import CORPUS_LOCK, DataError, prepare

    corpus, shared = tmp_path / "a.txt", tmp_path / "shared"
    corpus.write_text("zzzz qqqq " * 400)
    shared.mkdir()
    os.mkfifo(shared / CORPUS_LOCK)
    os.mkfifo(tmp_path / "optuna.db.lock")
    previous = signal.signal(signal.SIGALRM, waited)
    signal.alarm(60)
    try:
        with pytest.raises(DataError, match=f"its lock file {CORPUS_LOCK} cannot be made: is not a regular file \\(a FIFO"):
            prepare(Data(source=str(corpus), cache=str(shared)), 256, 32, 0, shared)
        with pytest.raises(StorageError, match="the workers' lock file .*optuna.db.lock beside the database of .* cannot be made: is not a"):
            with storage_lock(f"sqlite:///{tmp_path / 'optuna.db'}", tmp_path / "out"):
                pytest.fail("the workers' lock was taken on a FIFO")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_run_folder_in_use_by_another_training_is_refused_untouched(cli, tmp_path):
    """A resume of a run thought dead, still training elsewhere, would interleave the two's metrics."""
    import fcntl

    run = tmp_path / "run"
    assert cli("train", "specs/tiny/transformer.yaml", "--out", run, "--set", "data.source=mqar", *SMALL, "--steps", "2")[0] == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    held = os.open(run, os.O_RDONLY)  # as the training process holds it
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        refused(cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "4"),
                f"{run} is in use by another training process")
    finally:
        os.close(held)
    assert before == {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "4")[0] == 0  # let go
    (run / "config.yaml").unlink()
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "6"),
            "it holds checkpoints but its config.yaml is gone; restore that file to resume")

    import archlab

    cfg = TrainConfig.model_validate({"batch_size": 2, "micro_batch_size": 2, "seq_len": 16, "data": {"source": "mqar"}})
    with pytest.raises(Exception, match="nothing to resume"):
        Trainer(archlab.load_spec(ROOT / "specs" / "tiny" / "transformer.yaml"), cfg, tmp_path / "none", Console(quiet=True)).fit(2, resume=True)
    assert not (tmp_path / "none").exists()  # refused before writing: no folder left behind


def test_a_resume_may_change_the_optimizer_but_not_what_a_step_reads(cli, tmp_path):
    run = tmp_path / "run"
    assert cli("train", "specs/tiny/transformer.yaml", "--out", run, *SMALL, "--steps", "4", "--set", "checkpoint_interval=2")[0] == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for key in ("seq_len=32", "seed=1", "data.max_bytes=300000", "batch_size=6"):  # 6 does not split into micro-batches of 4
        refused(cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--set", key),
                f"a resumed run keeps its {key.partition('=')[0]}", "a resume may --set steps, optimizer")
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--set", "lr=1e-3")  # not a field
    refused((code, _, stderr), "lr: not a training config field: did you mean optimizer.lr?")
    assert "a resumed run keeps" not in stderr, stderr
    assert before == {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}

    # the optimizer state a checkpoint holds carries the settings it was saved with; the --set ones win
    cfg = TrainConfig.model_validate({**yaml.safe_load((run / "config.yaml").read_text()),
                                      "optimizer": {"lr": 1e-3, "weight_decay": 0.05, "betas": [0.8, 0.9], "eps": 1e-6}})
    trainer = Trainer(load_spec(run / "spec.yaml"), cfg, run, Console(quiet=True))
    assert trainer._resume(6) == 4
    decayed, rest = trainer.optimizer.param_groups
    assert (decayed["weight_decay"], rest["weight_decay"]) == (0.05, 0.0)
    assert all(group["betas"] == (0.8, 0.9) and group["eps"] == 1e-6 for group in (decayed, rest))

    code, _, stderr = cli("train", run, "--out", run, "--resume", "--steps", "6",  # the run's folder stands for its spec
                          "--set", "optimizer.lr=1e-3", "--set", "eval_interval=3")
    assert code == 0, stderr
    for said in ("the run's total goes from 4 to 6 steps", "optimizer.lr goes from 0.003 to 0.001", "eval_interval goes from 50 to 3",
                 "the learning rate of step 5 is", "config.yaml records the new values"):
        assert said in " ".join(stderr.split()), stderr
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert (saved["steps"], saved["optimizer"]["lr"], saved["eval_interval"]) == (6, 1e-3, 3)


def test_train_help_names_what_a_resume_may_set(cli):
    code, stdout, _ = cli("train", "--help")
    said = re.sub(r"[\s│]+", " ", stdout)  # the help panel wraps its lines inside borders
    assert code == 0 and f"on --resume, only {', '.join(RESUMABLE)})" in said, said


def test_a_moe_resume_keeps_its_micro_batches(cli, tmp_path):
    """The balance loss is taken over each pass, so splitting a step otherwise changes the objective."""
    run = tmp_path / "run"
    train = ["train", "specs/tiny/yoco-u-moe.yaml", "--out", run, "--set", "data.source=mqar", *SMALL]
    assert cli(*train, "--steps", "1")[0] == 0
    for size in (2, 3):  # 3 does not divide the batch of 8 either: what the run keeps is named first
        refused(cli("train", "specs/tiny/yoco-u-moe.yaml", "--out", run, "--resume", "--steps", "2", "--set", f"micro_batch_size={size}"),
                "a resumed run keeps its micro_batch_size", "with MoE, micro_batch_size: the balance loss is taken over each pass")


def test_a_resume_without_moe_may_change_its_micro_batches():
    """Only with MoE does a resume keep micro_batch_size (its balance loss is taken over each pass);
    without it, a micro-batch splits the same step's gradient otherwise, and may be --set."""
    assert kept_on_resume(["micro_batch_size", "optimizer.lr"], moe=False) is None
    said = kept_on_resume(["micro_batch_size", "optimizer.lr", "seq_len"], moe=True)
    assert said.startswith("a resumed run keeps its micro_batch_size, seq_len: ") and "micro_batch_size" not in said.partition("may --set")[2]


def test_a_looped_moe_run_resumed_with_other_evaluations_repeats_its_steps(cli, tmp_path):
    """The killed-run test resumes the plain Transformer, evaluating as the run did: a looped MoE
    model (routing, balance loss, a first step watched again) resumed with an evaluation after every
    step, which a resume may set, trains to the bit as the run it continues did."""
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    spec = "specs/tiny/yoco-u-moe.yaml"
    small = ["--set", "seq_len=32", "--set", "batch_size=4", "--set", "micro_batch_size=2", "--set", "eval_batches=1",
             "--set", "log_interval=1"]
    assert cli("train", spec, "--out", run, "--data", "mqar", *small, "--set", "checkpoint_interval=2", "--set", "eval_interval=1000",
               "--steps", "4")[0] == 0
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints/step-00000004")
    code, _, stderr = cli("train", spec, "--out", resumed, "--resume", "--steps", "4", "--set", "eval_interval=1")
    assert code == 0, stderr

    def steps(folder):
        return [{key: r[key] for key in ("step", "loss", "grad_norm", "moe_aux_loss", "moe_max_load")}
                for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())]

    assert steps(resumed) == steps(run) and len(steps(run)) == 4
    assert "eval_loss" in json.loads((resumed / "metrics.jsonl").read_text().splitlines()[2])  # step 3, evaluated this time
    weights = [(folder / "checkpoints/step-00000004/model.safetensors").read_bytes() for folder in (run, resumed)]
    assert weights[0] == weights[1]


def test_a_resume_that_fails_changes_nothing(cli, tmp_path):
    """Damage found on resuming (a metrics line, the corpus, the step) stops it before any file is
    written; a last metrics line cut short by a kill is dropped, as what came after the checkpoint."""
    finished = tmp_path / "finished"
    assert cli("train", "specs/tiny/transformer.yaml", "--out", finished, *SMALL, "--steps", "4",
               "--set", "checkpoint_interval=2")[0] == 0

    def damaged(name, damage):
        run = tmp_path / name
        shutil.copytree(finished, run)
        damage(run)
        return run

    def append(text):
        return lambda run: (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text() + text)

    def blank_line(run):
        lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
        (run / "metrics.jsonl").write_text("".join(lines[:2] + ["\n"] + lines[2:]))

    for run, fragment in ((damaged("blank", blank_line), "metrics.jsonl, line 3, is not a metrics record"),
                          (damaged("stepless", append('{"loss": 1.0}\n')), "line 5, is not a metrics record"),
                          (damaged("corpus", lambda run: (run / "data" / "val.npy").unlink()), "tokenized corpus in"),
                          (damaged("state", lambda run: (run / "checkpoints" / "step-00000004" / "state.json").write_text(
                              '{"step": "x"}')), "state.json gives no step count")):
        before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
        refused(cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "6"), fragment)
        assert before == {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}, run.name

    def cut_in_a_character(run):  # the bytes a kill leaves of a line: they need not be whole UTF-8
        with open(run / "metrics.jsonl", "ab") as file:
            file.write('{"step": 5, "note": "é'.encode()[:-1])

    for cut in (damaged("cut", append('{"step": 5, "lo')), damaged("cut in a character", cut_in_a_character)):
        resumed = cli("train", "specs/tiny/transformer.yaml", "--out", cut, "--resume", "--steps", "6")
        assert resumed[0] == 0, resumed[2]
        assert [step for step, _ in losses(cut)] == [1, 2, 3, 4, 5, 6]


def test_extending_a_finished_run_says_what_it_does_to_the_schedule(cli, tmp_path):
    run = tmp_path / "run"
    schedule = ["--set", "schedule.warmup_steps=1", "--set", "optimizer.lr=3e-3"]
    assert cli("train", "specs/tiny/transformer.yaml", "--out", run, "--data", "mqar", *SMALL, *schedule,
               "--steps", "4")[0] == 0
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "8")
    assert code == 0, stderr
    cfg = TrainConfig.model_validate(yaml.safe_load((run / "config.yaml").read_text()))
    assert cfg.steps == 8  # the steps trained, and what a later --resume continues to
    before, after = 3e-3 * lr_factor(4, 4, cfg), 3e-3 * lr_factor(4, 8, cfg)
    assert "from 4 to 8 steps" in stderr
    assert f"the learning rate of step 5 is {after:.2e}, not {before:.2e}" in stderr
    fifth = json.loads((run / "metrics.jsonl").read_text().splitlines()[4])
    assert fifth["step"] == 5 and fifth["lr"] == pytest.approx(after)
    shrunk = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "6")
    refused(shrunk, "at step 8, past the 6 steps asked")


def test_budgets_under_a_step_and_an_all_warmup_run_are_noticed(cli, tmp_path):
    for budget in (["--tokens", "10"], ["--flops", "5"]):
        run = tmp_path / budget[0].strip("-")
        code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--data", "mqar", *SMALL, *budget)
        assert code == 0, stderr
        assert f"{' '.join(budget)} is less than one step (batch_size 8 x seq_len 64 = 512 tokens" in stderr
        assert "the whole run is warm-up" in stderr  # warmup_steps 20 >= 1 step
        assert len(losses(run)) == 1
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "bad", "--tokens", "50Mi"),
            "--tokens: '50Mi' is not a whole number of tokens", "powers of 1,000")


def test_evaluation_runs_in_micro_batches_with_the_same_result(tmp_path):
    """Evaluation forwards no more sequences at once than a training pass, and sums the same."""
    import archlab
    from rich.console import Console

    from archlab.train.trainer import Trainer

    spec = archlab.load_spec(ROOT / "specs" / "tiny" / "yoco-u.yaml")
    task = RecallTask("mqar", spec.vocab_size, 64, seed=0)
    results, widest = [], []
    for micro in (8, 2):
        cfg = TrainConfig.model_validate({"batch_size": 8, "micro_batch_size": micro, "seq_len": 64, "eval_batches": 2})
        trainer = Trainer(spec, cfg, tmp_path / str(micro), Console(quiet=True))
        trainer.model.embed.register_forward_pre_hook(lambda module, args: widest.append(len(args[0])))
        results.append(trainer.evaluate(task))
    assert widest == [8, 8] + [2] * 8  # 2 eval batches of 8 sequences: a pass each, then 4 passes each
    assert results[1]["eval_acc"] == results[0]["eval_acc"]
    assert results[1]["eval_loss"] == pytest.approx(results[0]["eval_loss"], rel=1e-6)


def test_a_steps_gradient_norm_is_the_same_however_the_batch_is_split_into_passes(tmp_path):
    """Each pass's loss is divided by the number of passes before its backward, so the gradient,
    its logged norm and what grad_clip compares with are those of the whole batch. AdamW's first
    update hardly changes with the gradient's scale, so the weights after a step would not show a
    gradient that is the sum of the passes' rather than their mean: its norm does."""
    import archlab
    from rich.console import Console

    from archlab.train.trainer import Trainer

    spec = archlab.load_spec(ROOT / "specs" / "tiny" / "transformer.yaml")
    records = []
    for micro in (4, 1):
        cfg = TrainConfig.model_validate({"batch_size": 4, "micro_batch_size": micro, "seq_len": 32, "data": {"source": "mqar"},
                                          "eval_interval": 100, "eval_batches": 1, "log_interval": 1})
        (record,) = Trainer(spec, cfg, tmp_path / str(micro), Console(quiet=True)).fit(1)
        records.append(record)
    whole, split = records
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-4)


def test_mqar_answers_are_the_values_of_earlier_keys():
    task = RecallTask("mqar", 256, 64, seed=0)
    batch = task.batch("train", 3, 4)
    for row in range(4):
        seq = torch.cat([batch.inputs[row, :1], batch.targets[row]])
        pairs = {}
        for i in range(0, len(seq) - 1, 2):
            if not batch.mask[row, i]:  # a key-value pair of the prompt
                pairs.setdefault(int(seq[i]), int(seq[i + 1]))
        answers = batch.mask[row].nonzero()[:, 0]
        assert len(answers) > 0
        for t in answers.tolist():
            assert pairs[int(batch.inputs[row, t])] == int(batch.targets[row, t])
    again = task.batch("train", 3, 4)
    assert torch.equal(again.inputs, batch.inputs)  # a pure function of (seed, split, step)


def test_batches_of_any_size_split_across_processes_exactly():
    """Every batch_size a run may take (any multiple of the process count, not just the default)
    is cut into shares that rebuild the single-process batch row for row, its inputs, targets and
    counted positions: otherwise a run on several processes trains on other sequences than the same
    run on one."""
    tokens = np.arange(10_000, dtype=np.uint32)
    source = TokenSource(tokens[:9000], tokens[9000:], 32, seed=1, describe="t")
    for data in (source, RecallTask("mqar", 256, 64, seed=1)):
        for size, world in ((8, 2), (8, 4), (12, 3), (12, 4), (6, 2), (4, 4)):
            whole = data.batch("train", 3, size)
            shares = [data.batch("train", 3, size, rank, world) for rank in range(world)]
            assert [len(share.inputs) for share in shares] == [size // world] * world
            for field in ("inputs", "targets", "mask"):
                if getattr(whole, field) is not None:  # a token source counts every target: no mask
                    assert torch.equal(torch.cat([getattr(share, field) for share in shares]), getattr(whole, field))
        assert torch.equal(whole.targets[:, :-1], whole.inputs[:, 1:])


def test_a_batch_the_default_micro_batch_does_not_divide_says_so_and_what_would():
    from archlab.spec import SpecError

    with pytest.raises(SpecError, match=r"16 \(the default\) does not divide batch_size=24; .* such as 12"):
        load_config(None, ["batch_size=24"])
    assert load_config(None, ["batch_size=8"]).batch_size == 8  # the default is then the batch: the trainer takes it whole
    with pytest.raises(SpecError, match=r"micro_batch_size: 3 does not divide batch_size=16; .* such as 2"):
        load_config(None, ["micro_batch_size=3"])


@pytest.mark.parametrize("spec,sizes,processes,said", [
    ("transformer", [], 2, None),  # the default micro-batch: each process's share, 8
    ("transformer", ["micro_batch_size=16"], 2, "batch_size 16 gives each of 2 process(es) 8 sequences, not whole micro-batches of"
                                                " 16; set micro_batch_size to a divisor of 8, such as 8"),
    ("transformer", ["batch_size=4"], 3, "batch_size 4 does not split equally over 3 processes; give a multiple of 3 (a resumed run"
                                         " keeps its batch_size: resume it on 1, 2 or 4 processes)"),
    # a resume may not --set an MoE run's micro_batch_size: the process counts that keep it are named
    ("yoco-u-moe", ["batch_size=8", "micro_batch_size=4"], 4, "batch_size 8 gives each of 4 process(es) 2 sequences, not whole"
                                                              " micro-batches of 4; set micro_batch_size to a divisor of 2, such as 2; a resumed MoE run keeps its"
                                                              " micro-batches, over each of which its balance loss is taken: resume it on 1 or 2 processes"),
    ("yoco-u-moe", ["batch_size=4", "micro_batch_size=4"], 2, "batch_size 4 gives each of 2 process(es) 2 sequences, not whole"
                                                              " micro-batches of 4; set micro_batch_size to a divisor of 2, such as 2; a resumed MoE run keeps its"
                                                              " micro-batches, over each of which its balance loss is taken: resume it on 1 process"),
])
def test_a_batch_splits_over_the_processes_into_whole_micro_batches(monkeypatch, tmp_path, spec, sizes, processes, said):
    """Before any process group is needed: the split is checked first."""
    from archlab.train import trainer

    monkeypatch.setattr(trainer.World, "from_env", classmethod(lambda cls: cls(0, processes, 0)))
    cfg = load_config(None, ["seq_len=32", *sizes])
    spec = load_spec(ROOT / "specs/tiny" / f"{spec}.yaml")
    if said is None:
        made = trainer.Trainer(spec, cfg, tmp_path / "run", Console(quiet=True))
        assert (made.cfg.micro_batch_size, made.accumulation) == (8, 1)
        return
    with pytest.raises(trainer.TrainError) as raised:
        trainer.Trainer(spec, cfg, tmp_path / "run", Console(quiet=True))
    assert str(raised.value) == said


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig.model_validate({"schedule": {"warmup_steps": 10, "min_lr_ratio": 0.1}})
    factors = [lr_factor(s, 100, cfg) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))
    assert lr_factor(100, 100, cfg) == pytest.approx(0.1)


def test_schedule_is_one_at_the_end_of_warmup_and_just_above_the_floor_at_the_last_step():
    """The shipped studies trained on this schedule to the bit: the cosine starts from 1 at
    update ``warmup_steps`` and reaches the floor one past the last update, worked out by hand."""
    cfg = TrainConfig.model_validate({"schedule": {"warmup_steps": 10, "min_lr_ratio": 0.1}})
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 10) / 90)) for step in range(10, 100)]
    assert [lr_factor(step, 100, cfg) for step in range(10, 100)] == pytest.approx(cosine, rel=1e-12)
    assert lr_factor(10, 100, cfg) == 1.0 and lr_factor(99, 100, cfg) > 0.1


def test_compiled_layers_train_as_eager(tmp_path):
    """``compile: true`` compiles each layer, not the model: layers of a kind share compiled code,
    and training (the self-decoder looped, its K,V memo empty then full) matches eager."""
    import archlab
    from rich.console import Console

    from archlab.train.trainer import Trainer

    from torch._dynamo.utils import counters

    spec = archlab.load_spec(ROOT / "specs" / "tiny" / "yoco-u.yaml")
    runs = {}
    torch._dynamo.reset()
    counters.clear()  # graphs of earlier tests in this process
    for compile in (False, True):
        cfg = TrainConfig.model_validate({"batch_size": 4, "micro_batch_size": 4, "seq_len": 64, "data": {"source": "mqar"},
                                          "eval_interval": 3, "eval_batches": 1, "log_interval": 1, "compile": compile})
        trainer = Trainer(spec, cfg, tmp_path / str(compile), Console(quiet=True))
        runs[compile] = trainer.fit(3)
        assert all((layer._compiled_call_impl is not None) == compile for layer in trainer.model.layers)
    # 8 layer calls a pass (2 looped 3 times, 2 cross-decoder), training and evaluation: 4 graphs,
    # one per layer kind, with or without gradients; the count does not grow with depth or loops
    assert counters["stats"]["unique_graphs"] == 4  # none would be made had the first step's memory watch kept torch.compile out
    assert not counters["graph_break"]  # the kernels were chosen before tracing
    for eager, compiled in zip(runs[False], runs[True]):
        assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-5)
        assert compiled["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-4)
    assert runs[True][-1]["eval_loss"] == pytest.approx(runs[False][-1]["eval_loss"], rel=1e-5)


def test_compiled_moe_layers_train_as_eager_under_the_first_steps_memory_watch(tmp_path):
    """An MoE layer breaks its compiled graph where it reads its experts on the host; the frame
    resumed after that break runs Dynamo's frame hook, which traced the first step's memory watch
    (``Watched``) on the CPU and failed at the nbytes of nonzero's symbolic shape. Kept out of
    it, compiled MoE layers train as eager ones, and their load statistic is the same. Each layer
    call is given a list of its own for its balance loss: one list growing through the pass made
    the layer compile again at every call, to torch's limit (8), and the rest ran eagerly."""
    import archlab
    from rich.console import Console
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from archlab.model import Layer
    from archlab.train.trainer import Trainer

    spec = archlab.load_spec(ROOT / "specs" / "tiny" / "yoco-u-moe.yaml")
    runs = {}
    torch._dynamo.reset()
    for compile in (False, True):
        cfg = TrainConfig.model_validate({"batch_size": 2, "micro_batch_size": 2, "seq_len": 32, "data": {"source": "mqar"},
                                          "eval_interval": 100, "log_interval": 1, "compile": compile})
        runs[compile] = Trainer(spec, cfg, tmp_path / str(compile), Console(quiet=True)).fit(2)
    compiled = len(_debug_get_cache_entry_list(Layer.forward.__code__))  # a graph per layer kind, with and without gradients
    assert compiled < torch._dynamo.config.recompile_limit, compiled
    for eager, compiled in zip(runs[False], runs[True], strict=True):
        assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-5)
        assert compiled["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-4)
        assert compiled["moe_max_load"] == eager["moe_max_load"]


def test_moe_balance_loss_is_logged_as_recomputed_from_the_steps_batch(tmp_path):
    """``moe_aux_loss``: the balance loss each step trained on, recomputed in float64 from the
    router probabilities of the weights before the step, on its micro-batches: summed over every
    application of an MoE layer (2 layers looped 3 times, 2 cross-decoder layers), the mean over
    micro-batches."""
    import copy

    import archlab
    from rich.console import Console

    from archlab.ffn import MoEFFN
    from archlab.train.trainer import Trainer, micro_batches

    spec = archlab.load_spec(ROOT / "specs" / "tiny" / "yoco-u-moe.yaml")
    cfg = TrainConfig.model_validate({"batch_size": 4, "micro_batch_size": 2, "seq_len": 32, "data": {"source": "mqar"},
                                      "eval_interval": 100, "log_interval": 1})
    trainer = Trainer(spec, cfg, tmp_path / "run", Console(quiet=True))
    expected, step_of = [], trainer._step

    def step(step, steps, data, model):
        before = copy.deepcopy(trainer.model).double()
        seen = []
        for m in before.modules():
            if isinstance(m, MoEFFN):
                m.register_forward_hook(lambda m, args, out: seen.append((m, args[0].reshape(-1, args[0].shape[-1]))))
        losses = []
        for part in micro_batches(data.batch("train", step, cfg.batch_size), cfg.micro_batch_size):
            seen.clear()
            with torch.no_grad():
                before(part.inputs)
            assert len(seen) == 8
            loss = 0.0
            for m, tokens in seen:
                probs = (tokens @ m.router.weight.T).softmax(-1)
                routed = torch.bincount(probs.topk(2).indices.flatten(), minlength=8) / (2 * len(tokens))
                loss += 0.01 * 8 * float((routed * probs.mean(0)).sum())
            losses.append(loss)
        expected.append(sum(losses) / len(losses))
        return step_of(step, steps, data, model)

    trainer._step = step
    records = trainer.fit(2)
    assert [r["moe_aux_loss"] for r in records] == pytest.approx(expected, rel=1e-5)


def test_logged_speed_is_over_every_step_since_the_last_log(tmp_path, monkeypatch):
    """tokens/s in a logged record is the mean over the steps it stands for, not its own step's."""
    import types

    import archlab
    from archlab.train import trainer as trainer_module

    durations = iter([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    clock = types.SimpleNamespace(now=0.0, started=False)

    def perf_counter():  # a step's end is its start plus the next duration
        if clock.started:
            clock.now += next(durations)
        clock.started = not clock.started
        return clock.now

    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(perf_counter=perf_counter))
    spec = archlab.load_spec(ROOT / "specs" / "tiny" / "transformer.yaml")
    cfg = TrainConfig.model_validate({"batch_size": 2, "micro_batch_size": 2, "seq_len": 16, "data": {"source": "mqar"},
                                      "eval_interval": 100, "eval_batches": 1, "log_interval": 3})
    records = Trainer(spec, cfg, tmp_path / "run", Console(quiet=True)).fit(6)
    assert [r["step"] for r in records] == [3, 6]
    assert [r["tok_s"] for r in records] == [pytest.approx(2 * 16 * 3 / (1 + 2 + 3)), pytest.approx(2 * 16 * 3 / (4 + 5 + 6))]


def test_logged_mfu_is_the_models_training_flops_at_the_logged_speed_over_the_peak(tmp_path, monkeypatch):
    """MFU compares the model's own training FLOPs (the cost model's, of every sequence in the
    batch) at the logged speed with what the hardware could do: the number a study reads to tell a
    fast architecture from a well-fed one. It is the logged sequences/s times the FLOPs of a
    sequence, over the peak (here a made-up one, as the CPU has none). At 17 tokens those are not a
    whole number of FLOPs a token, which were rounded down."""
    import types

    import archlab
    from archlab.cost import Cost
    from archlab.train import trainer as trainer_module

    clock = types.SimpleNamespace(now=0.0)

    def perf_counter():  # every step, timed from one call to the next, takes half a second
        clock.now += 0.5
        return clock.now

    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(perf_counter=perf_counter))
    spec = archlab.load_spec(ROOT / "specs" / "tiny" / "yoco.yaml")
    cfg = TrainConfig.model_validate({"batch_size": 4, "micro_batch_size": 2, "seq_len": 17, "data": {"source": "mqar"},
                                      "eval_interval": 100, "eval_batches": 1, "log_interval": 2})
    trainer = Trainer(spec, cfg, tmp_path / "run", Console(quiet=True))
    trainer.peak = 1e9
    records = trainer.fit(2)
    (record,) = [r for r in records if "mfu" in r]
    assert record["tok_s"] == pytest.approx(4 * 17 / 0.5)
    assert record["mfu"] == pytest.approx(4 / 0.5 * 3 * sum(Cost(spec).forward_flops(17).values()) / 1e9, rel=1e-12)
    assert f"MFU {record['mfu']:.1%}" in trainer_module.status_line(record)


def test_evaluations_are_logged_between_log_intervals_and_the_last_step_is_evaluated_and_saved(tmp_path):
    """Each interval counts on its own: a step is logged at every log_interval and at every
    evaluation (an evaluation not logged would be lost from metrics.jsonl), evaluated at every
    eval_interval, saved at every checkpoint_interval, and the last step is evaluated and saved
    whatever the intervals."""
    import archlab
    from archlab.train.checkpoint import step_of

    spec = archlab.load_spec(ROOT / "specs" / "tiny" / "transformer.yaml")
    cfg = TrainConfig.model_validate({"batch_size": 2, "micro_batch_size": 2, "seq_len": 16, "data": {"source": "mqar"},
                                      "eval_interval": 3, "eval_batches": 1, "log_interval": 4, "checkpoint_interval": 4})
    evaluated = []
    records = Trainer(spec, cfg, tmp_path / "run", Console(quiet=True)).fit(5, on_eval=lambda step, _: evaluated.append(step))
    assert [(r["step"], "eval_loss" in r) for r in records] == [(3, True), (4, False), (5, True)]
    logged = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [3, 4, 5] and evaluated == [3, 5]
    assert [step_of(p) for p in checkpoints(tmp_path / "run")] == [4, 5]


def finished_run(tmp_path_factory, *args):
    """A tiny transformer trained with ``args`` in a folder of its own, for tests that copy it."""
    run = tmp_path_factory.mktemp("trained") / "run"
    with pytest.MonkeyPatch.context() as patch:
        code, _, stderr = in_process_cli(patch)("train", "specs/tiny/transformer.yaml", "--out", run, *args)
    assert code == 0, stderr
    return run


@pytest.fixture(scope="module")
def trained_on_text(tmp_path_factory):
    """A finished 4-step run on text: its tokenizer.json and tokenized corpus in the run folder."""
    return finished_run(tmp_path_factory, *SMALL, "--steps", "4", "--set", "checkpoint_interval=2")


def test_a_run_scored_with_a_config_edited_since_its_checkpoint_says_so(cli, trained_on_text, tmp_path):
    """layers (and every command that scores a run) measured at a seq_len edited into config.yaml
    after training, without a word; an edit of what scoring does not read is not said."""
    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**config, "seq_len": 48, "steps": 9}))
    edited = (f"notice: {run / 'config.yaml'} was edited since checkpoint {run / 'checkpoints' / 'step-00000004'} was saved"
              f" (seq_len {config['seq_len']} -> 48); the run is scored as edited")
    code, _, stderr = cli("layers", run, "--sequences", "1")
    assert code == 0 and edited in " ".join(stderr.split()), stderr
    (run / "config.yaml").write_text(yaml.safe_dump({**config, "steps": 9}))  # a resume's new total: not what scoring reads
    code, _, stderr = cli("layers", run, "--sequences", "1")
    assert code == 0 and "was edited since" not in stderr, stderr


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_chat_stopped_waiting_for_a_message_ends_with_the_signals_status(trained_on_text, name):
    """chat took SIGTERM, raised as an interrupt in every command since they all stop in words,
    for a Ctrl-C: exit 130."""
    command = [sys.executable, "-m", "archlab", "chat", str(trained_on_text), "--max-new-tokens", "1"]
    proc = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=interruptible)
    proc.stdin.write(b"hello\n\n")
    proc.stdin.flush()
    assert any(b"(the reply was cut at --max-new-tokens 1)" in line for line in proc.stderr)  # replied, and reading the next message
    proc.send_signal(getattr(signal, name))
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + getattr(signal, name) and b"Traceback" not in stderr, stderr.decode()


def test_a_resume_that_cannot_record_its_new_total_stops_before_saying_it_does(cli, trained_on_text, tmp_path, monkeypatch):
    """A run folder that cannot be written to (read-only) stops a resume at config.yaml: the
    notice that config.yaml records the new total came first, and the error named the file's
    temporary name."""
    import errno

    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)

    def read_only(path, text):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr("archlab.train.trainer.write_text_whole", read_only)
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "6")
    assert code == 1 and f"{run / 'config.yaml'}: Permission denied" in stderr, stderr
    assert "records the new values" not in stderr


def refused_untouched(cli, run, *fragments):
    """A resume of ``run`` refused with a clear message, every file of the run as it was."""
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "6")
    assert code not in (0, None) and all(fragment in stderr for fragment in fragments), stderr
    assert "total goes from" not in stderr  # said only as config.yaml records it
    assert before == {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    return stderr


def test_a_resume_points_to_a_metrics_line_that_is_not_utf8(cli, trained_on_text, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b"\xff\xfe garbage\n")
    refused_untouched(cli, run, f"{run / 'metrics.jsonl'}, line 5, is not a metrics record: \\xff\\xfe garbage;")


RUN_FILES = ["config.yaml", "metrics.jsonl", "environment.yaml", "data/val.npy", "data/corpus.json", "checkpoints/step-00000004/state.json",
             "checkpoints/step-00000004/trainer.pt"]


@pytest.mark.parametrize("name", RUN_FILES)
@pytest.mark.parametrize("replaced", ["device", "loop"])
def test_a_run_file_that_is_no_regular_file_is_refused_by_name_not_read(cli, trained_on_text, tmp_path, name, replaced):
    """A FIFO in a run file's place kept a resume waiting for a writer for ever; a device (here
    /dev/null, which reads as empty and so cannot hang the test) was read as the file, and a link
    to itself was taken as no file at all (metrics.jsonl: none logged yet; config.yaml: "gone")."""
    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    (run / name).unlink()
    (run / name).symlink_to(os.devnull if replaced == "device" else run / name)
    said = {"device": "is not a regular file (a FIFO, a device or a socket)", "loop": "is a symbolic link to nothing, or in a loop"}[replaced]
    if (name, replaced) == ("config.yaml", "loop"):  # read as YAML is, by a reader that tells a loop from a link to nothing
        said = "is a symbolic link that leads back to itself"
    stderr = " ".join(refused_untouched(cli, run).split())
    assert said in stderr and Path(name).name in stderr, stderr


def test_a_run_whose_spec_is_gone_is_said_to_hold_checkpoints_without_it(cli, trained_on_text, tmp_path):
    """generate, chat, layers, niah and evaluate said such a run was "not a training run with a
    checkpoint", though it holds one (here generate, layers and evaluate, which all resolve a run
    alike); a tokenizer.json that is a folder was "not at" its place."""
    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    recorded = json.loads((checkpoints(run)[-1] / "state.json").read_text())["spec"]
    assert load_spec(run / "spec.yaml").model_dump(mode="json") == recorded  # what the advice points to
    (run / "spec.yaml").unlink()
    gone = f"{run} holds checkpoints, but its spec.yaml is gone; restore the spec it trained (each checkpoint's state.json records it"
    for command in (["generate", run, "--max-new-tokens", "2"], ["layers", run, "--seq-len", "32"],
                    ["evaluate", run, "--seq-len", "32", "--last", "8", "--sequences", "1"]):
        refused(cli(*command), gone)
    (run / "checkpoints" / "step-00000099").write_text("")  # a file named as a checkpoint, which listing them refuses
    for command in (["cost", run], ["validate", run], ["train", run, "--out", tmp_path / "again"]):  # the run for its spec: "not found (no such file)"
        code, _, stderr = cli(*command)
        assert code == 1 and (f"<file>: is gone from the run {run}; restore the spec it trained (each checkpoint's"
                              " state.json records it") in " ".join(stderr.split()), stderr
    (run / "checkpoints" / "step-00000099").unlink()
    (run / "spec.yaml").mkdir()
    refused(cli("generate", run, "--max-new-tokens", "2"), f"{run} holds checkpoints, but its spec.yaml is a folder, not a file")
    (run / "spec.yaml").rmdir()
    shutil.copy(trained_on_text / "spec.yaml", run / "spec.yaml")
    (run / "tokenizer.json").unlink()
    (run / "tokenizer.json").mkdir()
    refused(cli("generate", run, "--max-new-tokens", "2"), f"tokenizer '{run / 'tokenizer.json'}': not a file")


def test_a_hash_is_not_passed_over_where_state_json_is_no_regular_file(cli, trained_on_text, tmp_path):
    """The hash was checked only where state.json was a file: a folder (or a FIFO, or a link to
    nothing) in its place let changed weights load without a word."""
    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    latest = checkpoints(run)[-1]
    weights = bytearray((latest / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (latest / "model.safetensors").write_bytes(weights)
    (latest / "state.json").unlink()
    (latest / "state.json").mkdir()
    refused(cli("generate", run, "--max-new-tokens", "2"), f"checkpoint {latest} is damaged", "is a folder, not a file")


@pytest.mark.parametrize("kind", ["folder", "dangling"])
def test_curves_of_a_run_whose_tokenizer_is_no_regular_file_says_it_is_not_found(cli, trained_on_text, tmp_path, kind):
    """Found as the run's tokenizer since generate names such a path for what it is, it was then read
    whole by curves: an error ("Is a directory"), or, of a FIFO, a wait for ever."""
    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    (run / "tokenizer.json").unlink()
    (run / "tokenizer.json").mkdir() if kind == "folder" else (run / "tokenizer.json").symlink_to(tmp_path / "nowhere")
    code, out, stderr = cli("curves", run, trained_on_text)
    assert code in (0, None) and "a tokenizer not found" in stderr and "Traceback" not in stderr, stderr


def test_evaluate_names_a_config_that_is_no_regular_file_rather_than_gone(cli, trained_on_text, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    (run / "config.yaml").unlink()
    (run / "config.yaml").symlink_to(os.devnull)
    code, _, stderr = cli("evaluate", run, "--seq-len", "32", "--last", "8", "--sequences", "1")
    assert code == 1 and "is not a regular file (a FIFO, a device or a socket)" in stderr and "no config.yaml" not in stderr, stderr


def test_generate_refuses_a_run_on_text_whose_tokenizer_and_config_are_both_gone(cli, trained_on_text, trained_on_mqar, tmp_path):
    """With its config.yaml gone too, a run on text was taken for one on token ids: generate printed
    its tokens as bytes, garbage, and succeeded. Its checkpoint records what it trained on."""
    for trained in (trained_on_text, trained_on_mqar):
        run = tmp_path / trained.parent.name
        shutil.copytree(trained, run)
        (run / "tokenizer.json").unlink(missing_ok=True)
        (run / "config.yaml").unlink()
        code, out, stderr = cli("generate", run, "--max-new-tokens", "2")
        if trained is trained_on_mqar:  # no tokenizer to lose: its ids are read and printed as bytes, as before
            assert code == 0 and "has no tokenizer (it trained on token ids or a recall task)" in " ".join(stderr.split()), stderr
        else:
            said = f"tokenizer is not at {run / 'tokenizer.json'}, and its config.yaml is gone too (it trained on the text of"
            assert code == 1 and out == "" and said in " ".join(stderr.split()), stderr


def test_a_data_cache_holding_a_tokenizer_no_run_wrote_is_refused_not_written_over(cli, tmp_path):
    """data.cache pointed at a folder of one's own: the BPE the run trained replaced its tokenizer.json."""
    cache = tmp_path / "mine"
    cache.mkdir()
    (cache / "tokenizer.json").write_text("one's own")
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "run", *SMALL, "--steps", "1", "--set", f"data.cache={cache}")
    assert code == 1 and f"{cache} holds a tokenizer.json that no run tokenizing there wrote" in " ".join(stderr.split()), stderr
    assert [p.name for p in cache.iterdir()] == ["tokenizer.json"] and (cache / "tokenizer.json").read_text() == "one's own"


def test_a_tokenizer_that_reads_much_of_the_text_as_unknown_is_said(cli, tmp_path):
    """A word-level tokenizer from other text trained on [UNK] for most of the corpus, without a word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "def": 1, "return": 2, "self": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "words.json"))
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "run", *SMALL, "--steps", "1",
                          "--set", f"data.tokenizer={tmp_path / 'words.json'}")
    said = " ".join(stderr.split())
    assert code == 0 and "of the tokens of data source 'stdlib' are the tokenizer's unknown token '[UNK]': it does not cover" in said, said
    share = float(said.split("% of the tokens of data source")[0].rsplit(" ", 1)[-1])
    assert 50 < share < 100, said  # the stdlib is not all def, return and self
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "bpe", *SMALL, "--steps", "1")
    assert code == 0 and "unknown token" not in stderr, stderr  # archlab's own byte-level BPE has none


def test_a_tokenizer_json_swapped_for_another_is_refused(cli, trained_on_text, tmp_path):
    """Another tokenizer of no more tokens than the model's read the run's ids as other text:
    generate printed it, and a resume went on to record it as the run's."""
    from tokenizers import Tokenizer, models

    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(200)}, unk_token="w0")).save(str(run / "tokenizer.json"))
    said = f"{run / 'tokenizer.json'} is not the tokenizer checkpoint {run / 'checkpoints/step-00000004'} trained with"
    for command in (["generate", run, "--max-new-tokens", "2"], ["evaluate", run, "--seq-len", "32", "--last", "8"]):
        code, out, stderr = cli(*command)
        assert code == 1 and said in " ".join(stderr.split()), stderr
    refused_untouched(cli, run, said)
    shutil.copy(trained_on_text / "tokenizer.json", run / "tokenizer.json")
    code, _, stderr = cli("generate", run, "--max-new-tokens", "2")
    assert code == 0, stderr


def test_non_finite_weights_are_refused_with_advice_each_command_can_follow(cli, trained_on_text, tmp_path):
    """evaluate advised "give an earlier checkpoint folder", which it refuses (it scores a run's latest)."""
    from safetensors.torch import load_file, save_file

    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    weights = run / "checkpoints/step-00000004/model.safetensors"
    tensors = load_file(weights)
    tensors["head.weight"][0, 0] = float("nan")
    save_file(tensors, weights)
    state = json.loads((weights.parent / "state.json").read_text())
    (weights.parent / "state.json").write_text(json.dumps({**state, "weights_blake2b": file_hash(weights)}))  # as a run that diverged saved it
    damaged = f"checkpoint {run / 'checkpoints/step-00000004'} is damaged (non-finite weights: head.weight)"
    code, _, stderr = cli("evaluate", run, "--seq-len", "32", "--last", "8", "--sequences", "1")
    assert code == 1 and f"{damaged}; remove it to score the one before" in " ".join(stderr.split()), stderr
    earlier = run / "checkpoints/step-00000002"
    code, _, stderr = cli("generate", run, "--max-new-tokens", "2")
    assert code == 1 and f"{damaged}; give the one before it, {earlier}" in " ".join(stderr.split()), stderr
    assert cli("generate", earlier, "--max-new-tokens", "2")[0] == 0
    shutil.move(run / "checkpoints/step-00000004", tmp_path / "removed")
    assert cli("evaluate", run, "--seq-len", "32", "--last", "8", "--sequences", "1")[0] == 0


@pytest.mark.parametrize("name", ["metrics.jsonl", "environment.yaml"])
def test_curves_names_the_run_file_that_is_no_regular_file(cli, trained_on_text, tmp_path, name):
    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    (run / name).unlink()
    (run / name).symlink_to(os.devnull)
    code, _, stderr = cli("curves", run)
    assert code == 1 and f"{run / name} is not a regular file (a FIFO, a device or a socket)" in " ".join(stderr.split()), stderr


def test_a_run_folder_that_is_a_link_in_a_loop_is_refused_in_words(cli, tmp_path):
    """Taking each run once resolved its path first, which raises on a loop: a traceback."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    code, _, stderr = cli("evaluate", loop, "--seq-len", "32")
    assert code == 1 and f"{loop} is not a training run with a checkpoint" in stderr and "Traceback" not in stderr, stderr


def test_a_shared_caches_tokenizer_copy_that_does_not_load_stops_a_resume(cli, tmp_path):
    """The data's checks read the cache's tokenizer, not the run's copy: the resume trained on and
    recorded the damaged copy's hash, and generate then refused the right one put back."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    shared = ["--set", f"data.cache={cache}", *SMALL]
    assert cli("train", "specs/tiny/transformer.yaml", "--out", run, *shared, "--steps", "2")[0] in (0, None)
    (run / "tokenizer.json").write_text("garbage")
    stderr = " ".join(refused_untouched(cli, run).split())
    assert "it is the run's copy of data.cache's tokenizer: remove it, and the resume copies the cache's again" in stderr, stderr
    (run / "tokenizer.json").unlink()
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "4")
    assert code in (0, None) and (run / "tokenizer.json").read_bytes() == (cache / "tokenizer.json").read_bytes(), stderr
    assert cli("generate", run, "--max-new-tokens", "2")[0] in (0, None)


def test_a_run_keeps_each_setting_it_trained_in_from_the_step_it_began_at(cli, trained_on_text, tmp_path):
    here = environment(torch.device("cpu"))
    assert yaml.safe_load((trained_on_text / "environment.yaml").read_text()) == [{"from step": 0, **here}]

    def resumed(name, recorded, steps):
        """A copy of the 4-step run, its environment.yaml as given (None: none), resumed to ``steps``;
        the settings it then records, and what the resume said."""
        run = tmp_path / name
        shutil.copytree(trained_on_text, run)
        (run / "environment.yaml").unlink()
        if recorded is not None:
            (run / "environment.yaml").write_text(yaml.safe_dump(recorded, sort_keys=False))
        code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", steps)
        assert code == 0, stderr
        return yaml.safe_load((run / "environment.yaml").read_text()), " ".join(stderr.split())

    older = {**here, "torch": "2.12.0"}
    kept, said = resumed("same", [{"from step": 0, **here}], 6)
    assert kept == [{"from step": 0, **here}] and "another setting" not in said
    kept, said = resumed("other", [{"from step": 0, **older}], 6)
    assert kept == [{"from step": 0, **older}, {"from step": 4, **here}]
    assert f"the steps before this resume trained in another setting (torch 2.12.0 -> {torch.__version__})" in said
    kept, said = resumed("two", [{"from step": 0, **here, "processes": "2"}], 6)  # said "processes 2 -> (absent)"
    assert "another setting (processes 2 -> 1)" in said, said
    # a setting recorded from step 4 on, whose steps the resume from step 4 trains again, goes
    kept, said = resumed("again", [{"from step": 0, **here}, {"from step": 4, **older}], 6)
    assert kept == [{"from step": 0, **here}] and "another setting" not in said
    kept, said = resumed("unrecorded", None, 6)  # a run from before runs kept their settings
    assert kept == [{"from step": 4, **here}] and "another setting" not in said
    kept, said = resumed("finished", [{"from step": 0, **older}], 4)  # nothing left to train: no step in this setting
    assert kept == [{"from step": 0, **older}] and "another setting" not in said

    damaged = tmp_path / "damaged"
    shutil.copytree(trained_on_text, damaged)
    (damaged / "environment.yaml").write_text("- torch: 2.13.0\n")
    refused_untouched(cli, damaged, f"{damaged / 'environment.yaml'} is not a list of the settings the run trained in",
                      "mend or remove it to resume")


def test_a_run_keeps_the_code_and_the_libraries_it_trains_with():
    kept = environment(torch.device("cpu"))
    assert kept["torch"] == torch.__version__ and kept["python"] == platform.python_version()
    assert kept["device"] == device_name(torch.device("cpu")) and kept["cpu kernels"] == torch.backends.cpu.get_cpu_capability()
    if (ROOT / ".git").exists():  # a checkout: its commit, as git names it
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
        assert kept["archlab"].startswith(f"{importlib.metadata.version('archlab')} at {head[:10]}")


def test_a_run_trained_on_archlabs_own_blocks_names_archlab_once_with_its_commit():
    """archlab's blocks are registered by archlab itself: listed as a plugin package, its bare
    version would replace the one that names the commit."""
    from archlab.registry import block_specs, distributions

    assert distributions(block_specs().values()) == {}
    assert environment(torch.device("cpu"), blocks=tuple(block_specs().values()))["archlab"] == environment(torch.device("cpu"))["archlab"]


@pytest.mark.parametrize("split", ["train", "val"])
@pytest.mark.parametrize("change", [lambda tokens: tokens[:5], lambda tokens: np.full_like(tokens, 7)], ids=["cut short", "rewritten"])
def test_cached_tokens_changed_since_tokenizing_are_the_caches_damage(cli, trained_on_text, tmp_path, split, change):
    """Token ids of the vocabulary each, so nothing else tells: a split cut short was said as the
    data's split too short for a sequence, and one rewritten was trained on by a run sharing the
    cache (a resume alone compared the tokens with its checkpoint's)."""
    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    recorded = json.loads((run / "data" / "corpus.json").read_text())["tokens"]
    np.save(run / "data" / f"{split}.npy", change(np.load(run / "data" / f"{split}.npy")))
    refused_untouched(cli, run, f"the tokenized corpus in {run / 'data'} is damaged (its train.npy and val.npy are not the tokens"
                      f" tokenized there: its corpus.json records {recorded}; they hold ", f"remove {run / 'data'} to tokenize it again")
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "sharing", *SMALL, "--steps", "1",
                          "--set", f"data.cache={run}")
    assert code == 1 and "are not the tokens tokenized there" in stderr and not (tmp_path / "sharing" / "checkpoints").exists(), stderr


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit decorators fla applies on import
def test_the_environment_names_the_kernel_packages_on_a_gpu_and_the_processes_sharing_a_run(monkeypatch):
    import fla
    import triton

    import archlab.environment

    cpu = environment(torch.device("cpu"))
    assert "processes" not in cpu and not {"flash-linear-attention", "triton"} & cpu.keys()  # no kernel package runs on a CPU
    assert environment(torch.device("cpu"), processes=2) == {**cpu, "processes": "2"}
    monkeypatch.setattr(archlab.environment, "device_name", lambda device: "NVIDIA H200")
    gpu = environment(torch.device("cuda"))
    assert gpu["device"] == "NVIDIA H200" and "cpu kernels" not in gpu
    assert (gpu["flash-linear-attention"], gpu["triton"]) == (fla.__version__, triton.__version__)


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_resume_refuses_a_cached_corpus_of_ids_past_the_vocabulary(cli, trained_on_text, tmp_path, split):
    """The cached corpus gets the checks a token file gets: an id past the vocabulary would stop the
    first step with an IndexError, after config.yaml had recorded the resume's new total."""
    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    np.save(run / "data" / f"{split}.npy", np.full(100000, 60000, np.uint16))
    refused_untouched(cli, run, f"the tokenized corpus in {run / 'data'} is damaged (its {split}.npy has token id 60000"
                      " >= vocab_size 256)", f"remove {run / 'data'} to tokenize it again")
    np.save(run / "data" / f"{split}.npy", np.arange(6).reshape(2, 3).astype(np.uint32))
    refused_untouched(cli, run, f"its {split}.npy must hold a 1-D array of integers, has uint32 (2, 3)")
    # numpy reads either as a pickle, and its word advised allow_pickle, which would run the file's code
    (run / "data" / f"{split}.npy").write_bytes(bytes(range(256)) * 8)
    assert "allow_pickle" not in refused_untouched(cli, run, f"(its {split}.npy is not a NumPy .npy file (it does not begin as one does))")
    np.save(run / "data" / f"{split}.npy", np.array([[1], [2]], dtype=object), allow_pickle=True)
    assert "allow_pickle" not in refused_untouched(cli, run, f"(its {split}.npy holds Python objects, not token ids)")
    shutil.rmtree(run / "data")  # as the message says: tokenized again, and the run goes on
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "6")
    assert code == 0, stderr
    assert [step for step, _ in losses(run)] == [1, 2, 3, 4, 5, 6]


def test_a_resume_refuses_a_run_whose_tokenizer_is_gone_or_garbage(cli, trained_on_text, tmp_path):
    """Training on without it would finish, and then ``generate`` could not read the run's text."""
    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    tokenizer = run / "tokenizer.json"
    tokenizer.write_text("garbage")
    refused_untouched(cli, run, f"the tokenizer {str(tokenizer)!r} could not be read",
                      f"the tokenized corpus in {run / 'data'} was made with it; put it back, or remove it and {run / 'data'}")
    shutil.rmtree(run / "data")  # as it says, but the tokenizer kept: its advice had been to remove the corpus alone, and again
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "6"),
            f"tokenizer {str(tokenizer)!r} could not be read", "put it back, or remove it to train one again from the text")
    tokenizer.unlink()  # then trained again from the text, as it was: the same tokens, which the checkpoint's fingerprint checks
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "6")
    assert code == 0, stderr


def test_a_run_records_a_paths_source_absolute_and_a_named_one_as_it_is(tmp_path, monkeypatch):
    """A run records its data with paths absolute, so that a resume from another folder finds them;
    a named source (stdlib, a recall task, hf:NAME) is no path, and made one it would read a file of that name."""
    from archlab.train.config import Data

    monkeypatch.chdir(tmp_path)
    for source in ("stdlib", "mqar", "copy", "hf:user/corpus:validation"):
        assert Data(source=source).anchored().source == source
    anchored = Data(source="corpus/text.txt", tokenizer="tok.json", cache="cache").anchored()
    assert (anchored.source, anchored.tokenizer, anchored.cache) == tuple(str(tmp_path / p) for p in ("corpus/text.txt", "tok.json", "cache"))


def test_a_hugging_face_datasets_text_field_is_named_where_its_rows_lack_it(tmp_path):
    """A missing field was said as "could not stream ...: 'text'"; a null one was trained on as the text "None"."""
    pytest.importorskip("datasets")
    rows = [{"content": "def f(x):\n    return x\n"}, {"content": None}, {"content": "x = 1\n"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(DataError, match=rf"^Hugging Face dataset '{tmp_path}': row 1 has no field 'text' \(it has 'content'\); set data.hf_text_field$"):
        read_texts(f"hf:{tmp_path}", 1000)
    assert read_texts(f"hf:{tmp_path}", 1000, "content") == [rows[0]["content"], rows[2]["content"]]
    (tmp_path / "train.jsonl").write_text('{"text": null}\n{"text": "  "}\n')  # was a traceback from numpy's concatenate
    with pytest.raises(DataError, match=rf"^Hugging Face dataset '{tmp_path}' \(split 'train'\) holds no text in its field 'text'"):
        read_texts(f"hf:{tmp_path}", 1000)


def test_a_hugging_face_source_streams_its_split_up_to_max_bytes_cut_as_files_are(monkeypatch):
    """``hf:NAME[:SPLIT]`` streams SPLIT of NAME (train where none is named), never downloading the
    whole dataset; its rows are read up to max_bytes characters and cut there, as a corpus of files
    is, with a notice where text is left unread: a row past the one that fills it is read to know,
    and no more (a stream may be endless). A ``datasets`` module of our own stands in for the
    library, so the test needs neither it nor the network."""
    asked, past = [], []

    def load_dataset(name, split, streaming):
        asked.append((name, split, streaming))

        def rows():
            yield from ({"text": "abc"}, {"text": None}, {"text": " \n"}, {"text": "defg"})
            while name == "user/endless":
                past.append(name)
                yield {"text": "hij"}

        return rows()

    monkeypatch.setitem(sys.modules, "datasets", SimpleNamespace(load_dataset=load_dataset))
    with pytest.warns(UserWarning, match=re.escape("data source 'hf:user/endless:validation' is read as far as data.max_bytes (7 ")):
        assert read_texts("hf:user/endless:validation", 7) == ["abc", "defg"]
    assert len(past) == 1
    with pytest.warns(UserWarning, match=re.escape("data source 'hf:user/endless' is read as far as data.max_bytes (5 ")):
        assert read_texts("hf:user/endless", 5) == ["abc", "de"]
    assert len(past) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_texts("hf:user/short", 7) == ["abc", "defg"]  # filled exactly by the last row: nothing left unread
        assert read_texts("hf:user/short", 8) == ["abc", "defg"]
    assert asked == [("user/endless", "validation", True), ("user/endless", "train", True)] + [("user/short", "train", True)] * 2


def test_a_byte_level_tokenizer_needs_a_vocabulary_of_256():
    """Its alphabet is the 256 bytes, each a token before any merge: with fewer, ids would pass the
    spec's vocabulary. 256 is enough, and gives the bytes alone."""
    with pytest.raises(DataError, match=r"^a byte-level tokenizer needs a vocabulary of at least 256; the spec has 255$"):
        train_tokenizer(["abc abc"], 255)
    assert train_tokenizer(["abc abc"], 256).get_vocab_size() == 256


def test_ids_past_uint16_are_kept_whole_in_text_and_examples(tmp_path):
    """A tokenizer of more than 65,536 tokens (Llama 3's has 128,256): a corpus's ids and an
    example's are kept as uint32, not wrapped round at 2**16 (70,000 would read as 4,464)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from archlab.train.config import Data
    from archlab.train.data import tokens_of

    wide = Tokenizer(models.WordLevel({"[UNK]": 0, "low": 5, "high": 70_000}, unk_token="[UNK]"))
    wide.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wide.save(str(tmp_path / "wide.json"))
    (tmp_path / "text.txt").write_text("low high high low\n")
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "low", "response": "high"}\n{"prompt": "high", "response": "low"}\n')
    ids, counted = tokens_of(Data(source=str(tmp_path / "text.txt")), 100_000, tmp_path / "wide.json")
    assert ids.tolist() == [5, 70_000, 70_000, 5] and counted is None
    ids, counted = tokens_of(Data(source=str(tmp_path / "pairs.jsonl")), 100_000, tmp_path / "wide.json")
    assert ids.tolist() == [5, 70_000, 70_000, 5] and counted.tolist() == [False, True, False, True]  # the END newline: no word


def test_a_npy_token_file_that_is_not_one_says_so(cli, tmp_path):
    tokens = tmp_path / "tokens.npy"
    tokens.write_text("hello world\n")
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "run", "--data", tokens, *SMALL, "--steps", "1"),
            f"token file {str(tokens)!r} is not a NumPy .npy file")


def test_a_checkpoints_files_share_one_mode(tmp_path):
    """safetensors wrote the weights 0600, readable by their owner alone, beside 0644 files."""
    from archlab.train import checkpoint

    saved = checkpoint.save(tmp_path, 1, torch.nn.Linear(2, 2), {"optimizer": {}}, {}, keep=1)
    assert len({(saved / name).stat().st_mode for name in ("model.safetensors", "trainer.pt", "state.json")}) == 1


def test_a_kill_while_old_checkpoints_are_removed_leaves_each_whole_or_gone(monkeypatch, tmp_path):
    """Rotation deleted a checkpoint's files in place: a kill midway left a folder named as a
    checkpoint without its weights, listed among those to resume or fine-tune from."""
    from archlab.train import checkpoint

    model = torch.nn.Linear(2, 2)
    for step in (1, 2):
        checkpoint.save(tmp_path, step, model, {"optimizer": {}}, {}, keep=2)
    deleting = shutil.rmtree

    def killed_after_one_file(path, *args, **kwargs):
        if kwargs.get("ignore_errors"):
            return deleting(path, *args, **kwargs)
        (path / "model.safetensors").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_after_one_file)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 3, model, {"optimizer": {}}, {}, keep=2)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-00000002", "step-00000003"]
    for kept in checkpoint.checkpoints(tmp_path):
        checkpoint.load_weights(kept, model)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", deleting)
    checkpoint.save(tmp_path, 4, model, {"optimizer": {}}, {}, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000003", "step-00000004"]


MQAR = ["--data", "mqar", "--set", "seq_len=32", "--set", "batch_size=8", "--set", "micro_batch_size=4", "--set", "log_interval=1"]


@pytest.fixture(scope="module")
def trained_on_mqar(tmp_path_factory):
    """A finished 3-step run on MQAR, its one checkpoint at step 3: copied by the tests that resume it."""
    return finished_run(tmp_path_factory, *MQAR, "--set", "checkpoint_interval=3", "--steps", "3")


def test_a_checkpoint_the_disk_cannot_hold_stops_the_run_and_keeps_the_last(cli, trained_on_mqar, tmp_path):
    """A file-size limit stands in for a full disk (CPython ignores SIGXFSZ, so a write past it
    fails): torch.save reports the short write as a RuntimeError, which was a traceback."""
    import resource

    run = tmp_path / "run"
    shutil.copytree(trained_on_mqar, run)
    limit = (run / "checkpoints/step-00000003/model.safetensors").stat().st_size + 100_000  # the weights fit, the optimizer's state not
    full = subprocess.run([sys.executable, "-m", "archlab", "train", "specs/tiny/transformer.yaml", "--out", str(run), "--resume", "--steps", "6"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "500"},
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    clean_failure(full, "the checkpoint of step 6 could not be written in", "is the disk full?",
                  f"Training stopped after step 6; the last one saved, {run / 'checkpoints/step-00000003'}, is intact")
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000003"]  # and no half-written folder
    resumed = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "6")
    assert resumed[0] == 0, resumed[2]


def test_an_evaluation_that_is_not_finite_stops_before_it_is_logged_or_saved(cli, tmp_path):
    """The update of step 1 overflows the weights: its own loss was finite, its evaluation is not.
    Logged, it wrote a bare NaN into metrics.jsonl; saved, a later error called it "good"."""
    run = tmp_path / "run"
    result = cli("train", "specs/tiny/transformer.yaml", "--out", run, *MQAR, "--set", "schedule.warmup_steps=0",
                 "--set", "optimizer.lr=1e39", "--set", "eval_interval=1", "--set", "eval_batches=1", "--set", "checkpoint_interval=1",
                 "--steps", "5")
    refused(result, "evaluation loss became nan after step 1; training stopped before logging or saving it, no checkpoint had been written")
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


def test_sigterm_stops_a_run_as_ctrl_c_does(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "archlab", "train", "specs/tiny/transformer.yaml", "--out", run, *MQAR,
                             "--set", "checkpoint_interval=2", "--steps", "100000"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list(run.glob("checkpoints/step-*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "interrupted; the checkpoints already written are intact (continue with --resume)" in stderr and "Traceback" not in stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_that_lands_in_a_finalizer_is_delivered_again(signum):
    """Python prints an exception raised in a ``__del__`` and drops it: a Ctrl-C landing there let a
    study worker finish its trial and exit 0, as if none had come. Work that ends before it comes
    again has done what it would have stopped: the interrupt is not left to land in what follows."""
    from archlab.cli import _interruptible
    from archlab.interrupts import Terminated

    class FinalizedAsTheSignalLands:
        def __del__(self):
            signal.raise_signal(signum)  # its handler runs here, inside the finalizer

    def wait(seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.01)

    kind = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job starts with SIGINT ignored
    try:
        with pytest.raises(KeyboardInterrupt) as caught, _interruptible():
            FinalizedAsTheSignalLands()
            wait(10)
        assert type(caught.value) is kind
        with _interruptible():
            FinalizedAsTheSignalLands()
        wait(0.5)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_during_an_import_is_held_until_the_import_is_whole(tmp_path, monkeypatch):
    """A Ctrl-C landing inside torch._dynamo's import of triton, an extension module, aborted the
    process from C++; it now waits for the import to end, and interrupts as usual after it."""
    from archlab.cli import _import_whole

    (tmp_path / "interrupted_midway.py").write_text("import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\n"
                                                   "time.sleep(0.2)\nWHOLE = True\n")
    monkeypatch.syspath_prepend(tmp_path)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # not ignored, as in a shell's background job
    try:
        with pytest.raises(KeyboardInterrupt):
            _import_whole("interrupted_midway")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sys.modules.pop("interrupted_midway").WHOLE


def test_signals_held_during_a_call_are_delivered_after_it_the_first_alone_by_the_handler_from_before():
    """A SIGTERM and then a SIGINT inside the call: neither lands inside it; after it, the handlers
    from before are back, and the SIGTERM alone is delivered (the SIGINT, a second asking, is not)."""
    from archlab.interrupts import held_signals

    delivered = []
    record = lambda signum, frame: delivered.append(signum)  # noqa: E731
    previous = {signum: signal.signal(signum, record) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        with held_signals():
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGINT)
            assert delivered == []
        assert delivered == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGINT) is record and signal.getsignal(signal.SIGTERM) is record
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_signals_are_held_only_in_the_main_thread_and_a_call_in_another_runs_as_it_is():
    """Python sets signal handlers in the main thread alone: in another (a study trial's heartbeat,
    which calls the storage) the call runs, rather than fail on setting them."""
    import threading

    from archlab.interrupts import held_signals

    ran, failed = [], []

    def call():
        try:
            with held_signals():
                ran.append(True)
        except Exception as exc:
            failed.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert ran == [True] and failed == []


def test_under_torchrun_what_stops_the_first_process_stops_the_others_in_words(tmp_path):
    """The first process prepares the data while the others wait; its error left them a traceback
    from the broken connection, and they named no checkpoint in a divergence message."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "archlab", "train",
                "specs/tiny/transformer.yaml"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "500"}
    missing = subprocess.run([*torchrun, "--out", str(tmp_path / "a"), *SMALL, "--data", str(tmp_path / "nowhere"), "--steps", "2"],
                             cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert missing.returncode != 0
    assert missing.stderr.count(f"error: data source '{tmp_path / 'nowhere'}': no such file or folder") == 1, missing.stderr
    assert "[rank1]" not in missing.stderr, missing.stderr
    diverged = subprocess.run([*torchrun, "--out", str(tmp_path / "b"), *MQAR, "--set", "checkpoint_interval=1", "--set", "grad_clip=0",
                               "--set", "schedule.warmup_steps=0", "--set", "optimizer.lr=1e6", "--steps", "10"],
                              cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    said = [line for line in diverged.stderr.splitlines() if line.startswith("error:")]
    assert len(said) == 2 and said[0] == said[1] and "checkpoints/step-" in said[0], diverged.stderr  # each process, the same
    import fcntl

    held = os.open(tmp_path / "b", os.O_RDONLY)  # as another training holds the run
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        busy = subprocess.run([*torchrun, "--out", str(tmp_path / "b"), "--resume", "--steps", "4"],
                              cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    finally:
        os.close(held)
    assert busy.stderr.count("is in use by another training process") == 1 and "[rank1]" not in busy.stderr, busy.stderr


def test_under_torchrun_a_stopped_run_lets_go_of_its_ddp_wrapper_before_leaving_the_group(tmp_path):
    """A run stopped by an error (here, a divergence) kept its DDP wrapper, whose reducer holds the
    process group, in the error's frames until the interpreter's exit, where gloo's teardown then
    ran and once deadlocked on the GIL (both processes idle, the job never ending). It is let go
    before the group is left."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import gc, sys, torch
        from archlab.cli import app
        from archlab.train import trainer
        close = trainer.World.close
        def counted(world):
            gc.collect()
            held = sum(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects())
            print(f"DDP wrappers held at close: {held}", file=sys.stderr)
            close(world)
        trainer.World.close = counted
        app()
    """))
    diverged = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), "train",
                               "specs/tiny/transformer.yaml", "--out", str(tmp_path / "run"), *MQAR, "--set", "grad_clip=0",
                               "--set", "schedule.warmup_steps=0", "--set", "optimizer.lr=1e6", "--steps", "10"],
                              cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "became nan" in diverged.stderr, diverged.stderr
    assert diverged.stderr.count("DDP wrappers held at close: 0") == 2, diverged.stderr


def test_a_resume_on_three_processes_repeats_the_uninterrupted_run_to_the_bit(tmp_path):
    """A resume promises the uninterrupted run's numbers to the bit in the same setting, torchrun's
    included. DDP lays the gradients out in buckets it rebuilds after its first step, in the order
    they became ready; a resumed run's first step was reduced in the first layout, the uninterrupted
    run's same step in the rebuilt one. Two processes' sum is a + b either way, but three or more
    add in an order that follows the layout (gloo's ring; NCCL's too), so every resume of such a run
    drifted from the run it replays a few steps on (a grad norm, then a loss, an ulp apart)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "-m", "archlab", "train",
                "specs/tiny/yoco-u.yaml"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [*MQAR, "--set", "batch_size=12", "--set", "micro_batch_size=2", "--set", "checkpoint_interval=3",
              "--set", "eval_interval=1000", "--set", "keep_checkpoints=10", "--steps", "8"]
    first = subprocess.run([*torchrun, "--out", str(straight), *common], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stderr
    shutil.copytree(straight, resumed)
    for later in ("step-00000006", "step-00000008"):  # as if killed after step 3's checkpoint
        shutil.rmtree(resumed / "checkpoints" / later)
    again = subprocess.run([*torchrun, "--out", str(resumed), "--resume", "--steps", "8"], cwd=ROOT, capture_output=True, text=True,
                           timeout=600, env=env)
    assert again.returncode == 0 and "resuming from" in again.stderr, again.stderr
    records = [[{k: v for k, v in json.loads(line).items() if k not in ("tok_s", "mfu")}
                for line in (run / "metrics.jsonl").read_text().splitlines()] for run in (straight, resumed)]
    assert records[1] == records[0]  # loss, grad norm, lr: the same floats
    final = [run / "checkpoints" / "step-00000008" for run in (straight, resumed)]
    assert (final[1] / "model.safetensors").read_bytes() == (final[0] / "model.safetensors").read_bytes()
    moments = [torch.load(folder / "trainer.pt", weights_only=True)["optimizer"]["state"] for folder in final]
    assert all(torch.equal(moments[1][i][k], moments[0][i][k]) for i in moments[0] for k in moments[0][i])


def test_killing_the_torchrun_launcher_outright_stops_its_training_processes(tmp_path):
    """torchrun starts its processes in a session of their own, so a launcher killed outright
    (SIGKILL, the out-of-memory killer), which passes nothing on, left them training to the end,
    holding the run folder and, on a GPU machine, the GPUs. They now stop as Ctrl-C stops them."""
    run = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "archlab",
                                 "train", "specs/tiny/yoco-u.yaml", "--out", str(run), *MQAR, "--steps", "100000",
                                 "--set", "eval_interval=100000"], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def state(pid: int) -> tuple[str, int] | None:  # (state, parent) from /proc, None once it is gone
        try:
            state, parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
        except OSError:
            return None
        return state, int(parent)

    workers: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.2)
        workers = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and (state(int(p.name)) or ("", 0))[1] == launcher.pid]
        assert len(workers) == 2
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 60
        while any((now := state(pid)) is not None and now[0] != "Z" for pid in workers):  # a zombie has stopped
            assert time.monotonic() < deadline, "its training processes went on without the launcher"
            time.sleep(0.2)
    finally:
        launcher.kill()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_process_left_alone_by_a_killed_peer_says_so_and_what_is_kept(cli, monkeypatch, tmp_path):
    """A process of a torchrun job whose peer was killed met gloo's broken connection as a page of
    traceback, naming no checkpoint; another RuntimeError is still a bug, let out."""
    from archlab.train import trainer

    def stopped_by(exc):
        def fit(*args, **kwargs):
            raise exc

        return lambda *args: SimpleNamespace(fit=fit)  # a Trainer whose fit meets ``exc``

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(trainer, "Trainer", stopped_by(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:"
                                                                     "43210: Connection reset by peer\nException raised from ...")))
    run = tmp_path / "run"
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", run, *SMALL),
            "another process of this run stopped ([gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:43210: Connection reset"
            " by peer); no checkpoint had been written")
    monkeypatch.setattr(trainer, "Trainer", stopped_by(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        cli("train", "specs/tiny/transformer.yaml", "--out", run, *SMALL)


def test_notices_under_torchrun_are_said_by_the_first_process_alone(monkeypatch, capsys):
    from archlab.cli import _show_notice

    for rank, said in (("1", ""), ("0", "notice: a kernel fell back")):
        monkeypatch.setenv("RANK", rank)
        _show_notice("a kernel fell back", UserWarning, "f.py", 1)
        assert capsys.readouterr().err.strip() == said


def test_metrics_the_disk_cannot_hold_stop_the_run_in_words(trained_on_mqar, tmp_path):
    import resource

    run = tmp_path / "run"
    shutil.copytree(trained_on_mqar, run)
    limit = (run / "metrics.jsonl").stat().st_size + 10  # not room for another line
    full = subprocess.run([sys.executable, "-m", "archlab", "train", "specs/tiny/transformer.yaml", "--out", str(run), "--resume", "--steps", "6"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "500"},
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    clean_failure(full, f"step 4's metrics could not be written to {run / 'metrics.jsonl'}", "training stopped there, its checkpoints as they were")


def test_a_spec_the_disk_cannot_hold_is_not_left_in_part_and_the_run_starts_again(cli, tmp_path):
    """spec.yaml was written in place: a disk that filled as a run began left the first blocks of
    the spec, where a run's other files are written whole or not at all."""
    import resource

    run, args = tmp_path / "run", ["train", "specs/tiny/transformer.yaml", "--out", str(tmp_path / "run"), "--steps", "1", *MQAR]
    full = subprocess.run([sys.executable, "-m", "archlab", *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "500"}, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300)))
    clean_failure(full, f"{run / 'spec.yaml'}: File too large")
    assert sorted(p.name for p in run.iterdir()) == ["environment.yaml"]  # no part of a spec, no temporary
    assert cli(*args)[0] in (0, None)


def test_a_resume_refuses_data_other_than_what_its_checkpoint_trained_on(cli, tmp_path):
    """A token file cut short, or a text corpus tokenized again from a changed source, was trained
    on without a word. Tokenized again from the same source, with the run's tokenizer, it is the same."""
    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 256, 200_000).astype(np.uint16).tofile(tokens)
    run = tmp_path / "on-tokens"
    assert cli("train", "specs/tiny/transformer.yaml", "--out", run, *SMALL, "--data", tokens, "--steps", "2",
               "--set", "checkpoint_interval=2")[0] == 0
    tokens.write_bytes(tokens.read_bytes()[:30_000])
    refused_untouched(cli, run, f"{str(tokens)!r} is not the data the run trained on: its checkpoint records 190000+10000 tokens,",
                      "the data now gives 14250+750 tokens", "put the run's data back to resume")
    tokens.write_bytes(tokens.read_bytes()[:2_000])  # too few for a sequence: not "use a shorter seq_len", which a resume keeps
    refused_untouched(cli, run, f"{str(tokens)!r} is not the data the run trained on: its validation split has 50 tokens, fewer than"
                      " one of the run's 64-token sequences needs; put the run's data back to resume")

    text = tmp_path / "text"
    text.mkdir()
    shutil.copy(ROOT / "archlab/cli.py", text)
    run = tmp_path / "on-text"
    assert cli("train", "specs/tiny/transformer.yaml", "--out", run, *SMALL, "--data", text, "--steps", "2",
               "--set", "checkpoint_interval=2")[0] == 0
    tokenizer = (run / "tokenizer.json").read_bytes()
    shutil.rmtree(run / "data")
    with open(text / "cli.py", "a") as f:
        f.write("# one more line\n")
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "3"),
            f"{str(text)!r} is not the data the run trained on", "the data now gives", "; put the run's data back to resume")
    assert (run / "tokenizer.json").read_bytes() == tokenizer  # tokenized again with the run's own, which is kept
    assert not (run / "data").exists()  # the corpus it refused: else the text put back was refused as other text than it
    refused(cli("evaluate", run, "--seq-len", "32", "--last", "8", "--sequences", "2"), f"is not the data {run} trained on",
            "; put the run's data back to score its held-out split")
    assert not (run / "data").exists() and (run / "tokenizer.json").read_bytes() == tokenizer
    shutil.copy(ROOT / "archlab/cli.py", text)
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "3")
    assert code == 0, stderr

    config = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(config.replace(f"source: {text}\n", "source: mqar\n"))  # its tokens in data/ are right
    refused_untouched(cli, run, "the synthetic mqar task is not the data the run trained on: its checkpoint records",
                      "the data now gives the synthetic mqar task; put the run's data back to resume")
    moved = text.rename(tmp_path / "moved")  # its corpus.json records where it was: the tokens read back decide
    (run / "config.yaml").write_text(config.replace(f"source: {text}\n", f"source: {moved}\n"))
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "4")
    assert code == 0, stderr
    code, _, stderr = cli("evaluate", run, "--seq-len", "32", "--last", "8", "--sequences", "2")
    assert code in (0, None), stderr


def test_a_resume_refuses_another_recall_task_than_its_checkpoint_trained_on(cli, trained_on_mqar, tmp_path):
    """A recall task's checkpoint recorded no corpus: a config.yaml edited to another task, or to
    text, trained on it without a word."""
    run = tmp_path / "run"
    shutil.copytree(trained_on_mqar, run)
    config = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(config.replace("source: mqar\n", "source: copy\n"))
    refused_untouched(cli, run, "the synthetic copy task is not the data the run trained on: its checkpoint records the synthetic"
                      " mqar task, the data now gives the synthetic copy task; put the run's data back to resume")
    refused(cli("evaluate", run, "--seq-len", "32"), f"the synthetic copy task is not the data {run} trained on: its checkpoint"
            " records the synthetic mqar task; put the run's data back, or give --data to score other data")
    text = tmp_path / "text.txt"
    text.write_text(ROOT.joinpath("archlab/cli.py").read_text())
    (run / "config.yaml").write_text(config.replace("source: mqar\n", f"source: {text}\n"))
    refused_untouched(cli, run, f"{str(text)!r} is not the data the run trained on: its checkpoint records the synthetic mqar task")


@pytest.mark.parametrize("command", [["evaluate", "--seq-len", "32", "--last", "8"], ["layers", "--seq-len", "32"]])
def test_a_run_scored_behind_its_logged_steps_says_at_which_step(cli, trained_on_text, tmp_path, command):
    """A run stopped between checkpoints, or still training, is scored at its latest checkpoint:
    its numbers were taken for those of the last step curves shows, without a word."""
    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    said = "is scored at its latest checkpoint"
    code, _, stderr = cli(command[0], run, *command[1:], "--sequences", "2")
    assert code in (0, None) and said not in stderr, stderr
    shutil.rmtree(run / "checkpoints" / "step-00000004")
    code, _, stderr = cli(command[0], run, *command[1:], "--sequences", "2")
    assert code in (0, None) and f"notice: {run} {said}, step 2; its metrics go on to step 4" in " ".join(stderr.split()), stderr


def test_a_run_without_its_config_still_generates_with_its_tokenizer(trained_on_text, tmp_path):
    from archlab.train.checkpoint import load_trained

    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    (run / "config.yaml").unlink()
    assert load_trained(run)[3] == run / "tokenizer.json"


def rotating(trained, tmp_path):
    """A copy of ``trained`` holding its step 2 alone, and a rotation to do: what a run training in it
    does as it saves step 4 with keep_checkpoints=1 (in place under its name, then step 2 removed)."""
    from archlab.train import checkpoint

    run, aside = tmp_path / "run", tmp_path / "step-00000004"
    shutil.copytree(trained, run)
    os.replace(run / "checkpoints" / "step-00000004", aside)

    def rotate():
        os.replace(aside, run / "checkpoints" / aside.name)
        checkpoint._remove(run / "checkpoints" / "step-00000002")

    return run, rotate


def rotated_as(module, name, rotate, monkeypatch):
    """``module.name`` (a function reading a checkpoint) patched to find it rotated away on its first call."""
    original, calls = getattr(module, name), []

    def patched(*args, **kwargs):
        if not calls:
            calls.append(rotate())
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, patched)


def test_a_checkpoint_removed_by_its_training_run_as_it_is_read_gives_way_to_the_one_that_replaced_it(
        cli, trained_on_text, tmp_path, monkeypatch):
    from archlab.train import checkpoint, evaluate

    run, rotate = rotating(trained_on_text, tmp_path)
    rotated_as(checkpoint, "_load_weights", rotate, monkeypatch)  # listed, then gone before its weights are opened
    _, model, used, _ = checkpoint.load_trained(run)
    assert used == run / "checkpoints" / "step-00000004"
    weights = load_file(used / "model.safetensors")
    assert all(torch.equal(t, weights[name]) for name, t in model.state_dict().items() if name in weights)

    run, rotate = rotating(trained_on_text, tmp_path / "generate")
    rotated_as(checkpoint, "_load_weights", rotate, monkeypatch)
    code, _, stderr = cli("generate", run, "--max-new-tokens", "1")
    assert code in (0, None) and f"weights from {run / 'checkpoints' / 'step-00000004'}" in " ".join(stderr.split()), stderr

    run, rotate = rotating(trained_on_text, tmp_path / "evaluate")
    rotated_as(evaluate, "info_of", rotate, monkeypatch)  # its weights read, then gone before its state.json is
    code, _, stderr = cli("evaluate", run, "--seq-len", "32", "--last", "8", "--sequences", "2")
    assert code in (0, None) and "damaged" not in stderr and "its metrics go on" not in stderr, stderr

    run, rotate = rotating(trained_on_text, tmp_path / "named")  # a checkpoint named as a folder has none after it
    rotated_as(checkpoint, "_load_weights", rotate, monkeypatch)
    named = run / "checkpoints" / "step-00000002"
    refused(cli("generate", named, "--max-new-tokens", "1"), f"checkpoint {named} was removed as it was read", "give the run's folder")


def test_a_listing_of_checkpoints_that_meets_one_removed_as_it_is_read_looks_again(trained_on_text, tmp_path, monkeypatch):
    run, rotate = rotating(trained_on_text, tmp_path)
    listed, iterdir = [], Path.iterdir

    def stale(folder):  # a listing read as the rotation happens: the old name, not yet the new one
        found = list(iterdir(folder))
        if folder == run / "checkpoints" and not listed:
            listed.append(rotate())
        yield from found

    monkeypatch.setattr(Path, "iterdir", stale)
    assert checkpoints(run) == [run / "checkpoints" / "step-00000004"]


def test_a_listing_of_checkpoints_reads_the_folder_once_and_refuses_a_checkpoint_name_held_by_no_folder(tmp_path, monkeypatch):
    """Beside the checkpoints, a file under a checkpoint's name and a link to nothing: neither is a
    checkpoint, nor one removed as it was listed, to list the folder again for. Each is refused by
    name: passed over, a resume went on from the checkpoint before it, retrained up to it, and
    failed to save there ("Not a directory"), leaving its temporary folders and config.yaml rewritten."""
    for step in (2, 4):
        (tmp_path / "checkpoints" / f"step-0000000{step}").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000009").write_text("a user's copy")
    (tmp_path / "checkpoints" / "step-00000010").symlink_to(tmp_path / "nowhere")
    listed, iterdir = [], Path.iterdir

    def counted(folder):
        listed.append(folder)
        return iterdir(folder)

    monkeypatch.setattr(Path, "iterdir", counted)
    for odd in ("step-00000009", "step-00000010"):
        with pytest.raises(CheckpointError, match=f"checkpoints/{odd} is named as a checkpoint but is no folder"):
            checkpoints(tmp_path)
        assert listed == [tmp_path / "checkpoints"]
        (tmp_path / "checkpoints" / odd).unlink()
        listed.clear()
    assert checkpoints(tmp_path) == [tmp_path / "checkpoints" / "step-00000002", tmp_path / "checkpoints" / "step-00000004"]


def run_with_checkpoints(folder, *steps):
    """A run folder as ``resolve`` reads it: spec.yaml, and an empty folder for each checkpoint."""
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "spec.yaml").write_text("name: x\n")
    for step in steps:
        (folder / "checkpoints" / f"step-{step:08d}").mkdir()
    return folder


def test_a_latest_checkpoint_removed_at_every_read_is_read_a_set_number_of_times_then_said(tmp_path):
    from archlab.train import checkpoint

    run, reads = run_with_checkpoints(tmp_path, 1), []

    def read(run_dir, used):  # each read outrun by the training run: its checkpoint replaced as it is read
        reads.append(used)
        os.replace(used, checkpoint.folder(run_dir, checkpoint.step_of(used) + 1))
        raise checkpoint.CheckpointError(f"checkpoint {used} is damaged")

    with pytest.raises(checkpoint.CheckpointError, match=f"the latest checkpoint of {run} was removed as it was read, "
                                                         f"{checkpoint.LISTINGS} times"):
        checkpoint.latest_read(run, read)
    assert reads == [checkpoint.folder(run, step) for step in range(1, checkpoint.LISTINGS + 1)]


def test_a_latest_checkpoint_listed_then_removed_before_resolve_returns_it_is_read_in_its_successor(tmp_path, monkeypatch):
    """The listing names step 2, which the training run removes before it is read (its files,
    read, not found): the read goes on to step 4, where resolve's check of the listing would
    have called the run one without a checkpoint."""
    from archlab.train import checkpoint

    run = run_with_checkpoints(tmp_path, 4)
    (run / "checkpoints" / "step-00000004" / "state.json").write_text("{}")
    listings, listed = [], checkpoint.checkpoints

    def stale(run_dir):  # the first listing, from before step 2 was removed
        listings.append(run_dir)
        return [checkpoint.folder(run_dir, 2)] if len(listings) == 1 else listed(run_dir)

    monkeypatch.setattr(checkpoint, "checkpoints", stale)
    assert checkpoint.latest_read(run, lambda run_dir, used: (used / "state.json").read_text()) == "{}"
    assert len(listings) == 2


def test_a_checkpoint_named_that_is_not_there_is_no_checkpoint_rather_than_one_removed_as_it_was_read(tmp_path):
    from archlab.train import checkpoint

    run = run_with_checkpoints(tmp_path, 2)
    missing = run / "checkpoints" / "step-00000099"
    for read in (checkpoint.resolve, lambda path: checkpoint.latest_read(path, lambda run_dir, used: None)):
        with pytest.raises(checkpoint.CheckpointError, match=f"^{re.escape(str(missing))} is not a training run with a checkpoint"):
            read(missing)


@pytest.mark.parametrize(("code", "unsaved", "full"), [("ENOSPC", True, True), ("EDQUOT", True, True), ("EFBIG", True, True),
                                                       ("EROFS", True, False), ("EACCES", False, False)])
def test_a_checkpoint_the_disk_refuses_is_unsaved_and_a_full_one_asks_whether_the_disk_is_full(tmp_path, monkeypatch, code, unsaved, full):
    """Full, over quota, past a file size limit or read-only: the machine's fault (Unsaved), on
    which a study's worker stops; a folder one may not write to is the run's own."""
    import errno

    from archlab.train import checkpoint

    def refused(*args, **kwargs):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(torch, "save", refused)
    with pytest.raises(checkpoint.CheckpointError) as raised:
        checkpoint.save(tmp_path, 2, torch.nn.Linear(2, 2), {}, {}, keep=1)
    assert isinstance(raised.value, checkpoint.Unsaved) == unsaved and str(raised.value).endswith("; is the disk full?") == full, raised.value
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_fine_tuning_start_from_a_run_whose_checkpoint_is_removed_as_it_is_read_starts_from_its_successor(
        cli, trained_on_text, tmp_path, monkeypatch):
    from archlab.train import checkpoint

    run, rotate = rotating(trained_on_text, tmp_path)
    rotated_as(checkpoint, "_load_weights", rotate, monkeypatch)  # listed, then gone before its weights are opened
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "tuned", "--init", run, "--steps", "1", *SMALL)
    assert code in (0, None) and "damaged" not in stderr, stderr
    assert load_config(str(tmp_path / "tuned" / "config.yaml")).init == str(run / "checkpoints" / "step-00000004")


def test_a_run_given_twice_is_one_row(cli, trained_on_text, monkeypatch):
    """r1, ./r1 and r1/ were three identical rows (and lines on the plot) of curves and evaluate."""
    monkeypatch.chdir(trained_on_text.parent)
    spellings = [trained_on_text.name, f"./{trained_on_text.name}", f"{trained_on_text.name}/", str(trained_on_text)]
    for command in (["curves", *spellings], ["curves", *spellings, "--baseline", f"./{trained_on_text.name}/"],
                    ["evaluate", *spellings, "--seq-len", "32", "--last", "8", "--sequences", "1", "--format", "json"]):
        code, out, stderr = cli(*command, *(["--format", "json"] if command[0] == "curves" else []))
        assert code in (0, None) and [row["run"] for row in json.loads(out)] == [trained_on_text.name], (command, stderr)


def test_curves_put_runs_side_by_side_as_their_metrics_logged_them(cli, trained_on_text, trained_on_mqar, tmp_path):
    code, out, stderr = cli("curves", trained_on_text, trained_on_mqar, "--format", "json", "--plot", tmp_path / "steps.png")
    assert code in (0, None), stderr
    for row, run in zip(json.loads(out), (trained_on_text, trained_on_mqar), strict=True):
        logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in logged if "eval_loss" in r]
        best = min(evals, key=lambda r: r["eval_loss"])
        assert (row["steps"], row["tokens"]) == (logged[-1]["step"], logged[-1]["tokens"])
        assert (row["loss"], row["eval loss"]) == (round(logged[-1]["loss"], 4), round(evals[-1]["eval_loss"], 4))
        assert (row["best eval loss"], row["at step"]) == (round(best["eval_loss"], 4), best["step"])
        assert row["tok/s"] == statistics.median(r["tok_s"] for r in logged)
    assert json.loads(out)[0]["eval acc"] is None and json.loads(out)[1]["eval acc"] is not None  # the recall task alone reports it
    code, out, stderr = cli("curves", trained_on_text, trained_on_mqar, "--format", "csv")
    assert out.splitlines()[0].endswith(",tok/s,eval acc") and out.splitlines()[1].endswith(",") and len(out.splitlines()) == 3, stderr
    assert (tmp_path / "steps.png").read_bytes().startswith(b"\x89PNG")
    assert f"- trained with: {describe(environment(torch.device('cpu')))}\n" in stderr  # both trained by this process
    # a text run's loss per token of its tokenizer beside a recall task's: said, where it was compared without a word
    tokenizer = hashlib.blake2b((trained_on_text / "tokenizer.json").read_bytes(), digest_size=4).hexdigest()
    apart = (f"notice: the runs' losses are per token of different tokenizers or data, and do not compare as numbers:"
             f" tokenizer {tokenizer}: {trained_on_text}; the mqar task: {trained_on_mqar}")  # both named run: by path
    assert apart in " ".join(stderr.split()), stderr
    evaluated = cli("evaluate", trained_on_text, trained_on_mqar, "--seq-len", "32", "--last", "8", "--sequences", "2")
    assert evaluated[0] in (0, None) and apart in " ".join(evaluated[2].split()), evaluated[2]
    assert "do not compare" not in cli("curves", trained_on_text, trained_on_text)[2]

    # the best evaluation is not the last: a hand-written log
    (tmp_path / "logged").mkdir()
    logged = [{"step": step, "loss": 4.0 - step / 10, "tokens": 512 * step, "tok_s": speed, **({"eval_loss": score} if score else {})}
              for step, speed, score in ((1, 9.0, 3.0), (2, 7.0, None), (3, 8.0, 2.5), (4, 1.0, 2.75))]
    (tmp_path / "logged" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged))
    code, out, stderr = cli("curves", tmp_path / "logged", "--format", "json")
    assert json.loads(out) == [{"run": "logged", "steps": 4, "tokens": 2048, "loss": 3.6, "eval loss": 2.75, "best eval loss": 2.5,
                                "at step": 3, "tok/s": 7.5}], stderr

    # against training FLOPs: each logged token at what the trainer counts a step to cost
    from archlab.train.curves import Axis, Run

    cfg = TrainConfig.model_validate(yaml.safe_load((trained_on_text / "config.yaml").read_text()))
    trainer = Trainer(load_spec(trained_on_text / "spec.yaml"), cfg, tmp_path / "unused", Console(quiet=True))
    run = Run.read(trained_on_text, "text")
    assert run.x(run.records, Axis.flops) == [r["tokens"] * trainer.flops_per_step / trainer.tokens_per_step for r in run.records]
    assert cli("curves", trained_on_text, "--x", "flops", "--plot", tmp_path / "flops.png")[0] in (0, None)
    assert (tmp_path / "flops.png").read_bytes().startswith(b"\x89PNG")


def test_a_plot_the_disk_cannot_hold_leaves_the_one_that_was_there(cli, trained_on_text, tmp_path):
    """Saved in place, a disk that filled midway left the first blocks of a PNG where the last whole plot had been."""
    plot = tmp_path / "curves.png"
    assert cli("curves", trained_on_text, "--plot", plot)[0] in (0, None)
    last = plot.read_bytes()
    with files_no_bigger_than(200):
        code, _, stderr = cli("curves", trained_on_text, "--x", "flops", "--plot", plot)
    assert code == 1 and f"{plot}: File too large" in stderr and "Traceback" not in stderr, stderr
    assert plot.read_bytes() == last and [p.name for p in tmp_path.iterdir()] == ["curves.png"]


def test_curves_read_a_run_still_training_and_name_what_they_cannot_read(cli, trained_on_text, tmp_path):
    running = tmp_path / "running" / "run"
    shutil.copytree(trained_on_text, running)
    with open(running / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # a line being written
    (running / "environment.yaml").write_text(yaml.safe_dump([{"from step": 0, "torch": "2.12.0"}, {"from step": 4, "torch": "2.13.0"}]))
    code, out, stderr = cli("curves", trained_on_text, running, "--format", "json")
    assert code in (0, None), stderr
    same, cut = json.loads(out)
    assert same == {**cut, "run": same["run"]} and (same["run"], cut["run"]) == (str(trained_on_text), str(running))  # names repeat: paths
    assert stderr.splitlines() == ["- trained in 2 settings (a run repeats to the bit only within one):",
                                   f"  - {describe(environment(torch.device('cpu')))}: run {trained_on_text}",
                                   f"  - torch 2.12.0 from step 0; then torch 2.13.0 from step 4: run {running}"]

    damaged = tmp_path / "damaged"
    shutil.copytree(trained_on_text, damaged)
    lines = (damaged / "metrics.jsonl").read_text().splitlines(keepends=True)
    (damaged / "metrics.jsonl").write_text("".join([lines[0], '{"step": "two"}\n', *lines[1:]]))
    configless = tmp_path / "configless"
    shutil.copytree(trained_on_text, configless)
    (configless / "config.yaml").unlink()
    unsettled = tmp_path / "unsettled"
    shutil.copytree(trained_on_text, unsettled)
    (unsettled / "environment.yaml").write_text("[1\n")
    for args, fragment in (([tmp_path / "absent"], f"{tmp_path / 'absent'} does not exist"),
                           ([damaged / "spec.yaml"], f"{damaged / 'spec.yaml'} is not a folder"),
                           ([tmp_path], f"{tmp_path} holds no metrics.jsonl: it is not a training run"),
                           ([unsettled], f"{unsettled / 'environment.yaml'} is not a list of the settings the run trained in"),
                           ([damaged], f"{damaged / 'metrics.jsonl'}, line 2, is not a metrics record (its step 'two' is not a step):"
                                       f" {{\"step\": \"two\"}}"),
                           ([configless, "--x", "flops", "--plot", tmp_path / "c.png"], "lacks config.yaml, which training FLOPs are"),
                           ([trained_on_text, "--plot", tmp_path], "is a folder; give a file in it, such as")):
        refused(cli("curves", *args), fragment)
    assert not (tmp_path / "c.png").exists()


@pytest.mark.parametrize("change, said", [
    (lambda records: records[1].update(eval_loss="x"), 'line 2, is not a metrics record (its eval_loss "x" is not a finite number)'),
    (lambda records: records[0].update(tok_s=None), "line 1, is not a metrics record (its tok_s null is not a finite number)"),
    (lambda records: records[2].update(loss=float("nan")), "line 3, is not a metrics record (its loss NaN is not a finite number)"),
    (lambda records: records[1].update(eval_loss=float("inf")), "line 2, is not a metrics record (its eval_loss Infinity is not"),
    (lambda records: records[0].update(loss=True), "line 1, is not a metrics record (its loss true is not a finite number)"),
    (lambda records: records[0].update(tokens=-6144), "line 1, is not a metrics record (its tokens -6144 are fewer than none)"),
    (lambda records: records.reverse(), "line 2, is not a metrics record (its step 3 does not follow step 4)"),
    (lambda records: records.insert(1, dict(records[0])), "line 2, is not a metrics record (its step 1 does not follow step 1)"),
    (lambda records: records[0].update(step=0), "line 1, is not a metrics record (its step 0 is not a step)"),
    (lambda records: records[2].update(tokens=1000), "line 3, is not a metrics record (its tokens 1000 are fewer than step 2's"),
    (lambda records: records[1].update(note="a" * 5_000_000), f'line 2, is not a metrics record (its note "{"a" * 59} is not a'),  # 5 MB said
], ids=["text", "null", "nan", "inf", "bool", "negative tokens", "reversed", "repeated", "step 0", "tokens going back", "a long value"])
def test_curves_refuse_metrics_training_did_not_write_and_name_the_line(cli, trained_on_text, tmp_path, change, said):
    """Each was read as a table (a NaN picked as the best loss, steps counted backwards) or failed with a traceback."""
    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    change(records)
    (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    refused(cli("curves", run, "--baseline", trained_on_text), f"{run / 'metrics.jsonl'}, {said}")


def test_windows_past_every_place_in_the_split_are_each_place_once_found_at_once():
    """Asked for more windows than the split has places to end one, every place is taken once, as
    before; 1e12 of them looped over every one asked for and ran for hours without a word."""
    from archlab.train.evaluate import windows

    tokens = np.arange(40)
    with no_longer_than(30):
        (every,) = windows(tokens, [8], 1_000_000_000_000).values()
    assert every.inputs[:, 0].tolist() == list(range(32)) and torch.equal(every.inputs, windows(tokens, [8], 32)[8].inputs)
    assert torch.equal(windows(tokens, [8], 33)[8].inputs, every.inputs)  # one more than there are places: the same


def test_windows_whose_scored_tokens_overlap_say_how_many_distinct_tokens_they_are():
    """evaluate's "tokens scored" counts a token once for each window whose last tokens hold it; with
    windows closer together than that, it said more tokens than the split has, without a word."""
    from archlab.train.evaluate import windows

    tokens = np.arange(200)  # tokens that are their own positions: a window's targets say where they are
    for sequences, overlapping in ((11, False), (12, True), (40, True)):  # ends 167 / (sequences - 1) apart
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            found = windows(tokens, [16, 32], sequences, last=16)
        for length, batch in found.items():
            assert batch.mask.sum(1).tolist() == [16] * sequences and not batch.mask[:, : length - 16].any()
        distinct = len(set(found[32].targets[found[32].mask].tolist()))
        assert (distinct < 16 * sequences) == overlapping
        assert [str(w.message) for w in said] == ([f"the last 16 tokens of the {sequences} windows overlap: the {16 * sequences} tokens"
                                                   f" they score are {distinct} distinct tokens of the held-out split; --sequences 11"
                                                   " or fewer scores each once"] if overlapping else [])
    counted = tokens % 4 == 0  # of examples, the responses alone are scored
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        (found,) = windows(tokens, [32], 40, counted=counted, last=16).values()
    scored = found.targets[found.mask]
    assert [str(w.message) for w in said] == [f"the last 16 tokens of the 40 windows overlap: the {len(scored)} tokens they score are"
                                              f" {len(set(scored.tolist()))} distinct tokens of the held-out split; --sequences 11 or"
                                              " fewer scores each once"]


def test_evaluate_says_when_its_windows_score_tokens_more_than_once(cli, trained_on_text):
    code, _, stderr = cli("evaluate", trained_on_text, "--seq-len", "32", "--last", "16", "--sequences", "2000")
    assert code in (0, None), stderr
    assert "windows overlap: the 32,000 tokens they score are" in stderr and "distinct tokens of the held-out split" in stderr
    code, _, stderr = cli("evaluate", trained_on_text, "--seq-len", "32", "--last", "16", "--sequences", "3")
    assert code in (0, None) and "overlap" not in stderr, stderr


def test_evaluate_scores_the_same_last_tokens_given_each_length_of_context(cli, trained_on_text, tmp_path):
    from archlab.train.checkpoint import load_trained
    from archlab.train.evaluate import evaluate, windows

    held_out = np.load(trained_on_text / "data" / "val.npy")
    batches = windows(held_out, [16, 64, 128], 5)
    longest = batches[128]
    assert torch.equal(longest.inputs[:, 1:], longest.targets[:, :-1]) and len(set(map(tuple, longest.inputs.tolist()))) == 5
    assert all("".join(map(chr, row)) in "".join(map(chr, held_out.tolist())) for row in longest.targets.tolist())  # slices of the split
    for n in (16, 64):  # the longest window's ends: the same tokens scored, with less context before them
        assert torch.equal(batches[n].inputs, longest.inputs[:, -n:]) and torch.equal(batches[n].targets, longest.targets[:, -n:])

    _, model, _, _ = load_trained(trained_on_text)
    results = evaluate(trained_on_text, [16, 64, 128], 16, 5, torch.device("cpu"), batch=2)  # batches of 2, 2 and 1
    one_at_a_time = evaluate(trained_on_text, [16, 64, 128], 16, 5, torch.device("cpu"), batch=1)
    assert [r.loss for r in results] == pytest.approx([r.loss for r in one_at_a_time], rel=1e-6)
    for result in results:  # the whole logits of every window at once, against a sequence at a time without them
        window = batches[result.length]
        with torch.no_grad():
            expected = F.cross_entropy(model(window.inputs)[:, -16:].flatten(0, 1), window.targets[:, -16:].flatten())
        assert (result.sequences, result.scored, result.accuracy) == (5, 5 * 16, None)
        assert result.loss == pytest.approx(expected.item(), rel=1e-5)

    code, out, stderr = cli("evaluate", trained_on_text, "--seq-len", "16", "64", "128", "--last", "16", "--sequences", "5",
                            "--format", "json", "--plot", tmp_path / "lengths.png")
    assert code in (0, None), stderr
    assert [(row["length"], row["loss"]) for row in json.loads(out)] == [(r.length, round(r.loss, 4)) for r in results]
    assert (tmp_path / "lengths.png").read_bytes().startswith(b"\x89PNG")


def test_evaluate_scores_a_recall_run_on_fresh_sequences_of_each_length(trained_on_mqar):
    from archlab.train.checkpoint import load_trained
    from archlab.train.evaluate import evaluate

    _, model, _, _ = load_trained(trained_on_mqar)
    for result in evaluate(trained_on_mqar, [32, 64], 512, 4, torch.device("cpu")):  # --last is not a recall task's
        probes = RecallTask("mqar", model.spec.vocab_size, result.length, 0).batch("val", 0, 4)
        with torch.no_grad():
            logits = model(probes.inputs)[probes.mask]
        answers = probes.targets[probes.mask]
        assert result.scored == len(answers) > 0
        assert result.loss == pytest.approx(F.cross_entropy(logits, answers).item(), rel=1e-5)
        assert result.accuracy == (logits.argmax(-1) == answers).float().mean().item()


def test_evaluate_names_what_it_cannot_score(cli, trained_on_text, tmp_path):
    held_out = len(np.load(trained_on_text / "data" / "val.npy"))
    configless = tmp_path / "configless"
    shutil.copytree(trained_on_text, configless)
    (configless / "config.yaml").unlink()
    for args, fragment in (([trained_on_text, "--seq-len", held_out], f"the held-out split has {held_out:,} tokens, fewer than the"
                                                                      f" {held_out + 1:,} a window of {held_out:,}"),
                           ([trained_on_text, "--seq-len", "16", "64", "--last", "32"], "--last 32 is longer than the shortest length, 16"),
                           ([tmp_path, "--seq-len", "64"], f"{tmp_path} is not a training run with a checkpoint"),
                           ([configless, "--seq-len", "64"], "has no config.yaml, which says how it trained"),
                           ([checkpoints(trained_on_text)[-1], "--seq-len", "64"],
                            f"{checkpoints(trained_on_text)[-1]} is a checkpoint; give its run's folder, {trained_on_text}, whose")):
        refused(cli("evaluate", *args), fragment)
    again = tmp_path / "again"
    shutil.copytree(trained_on_text, again)
    code, _, stderr = cli("evaluate", trained_on_text, again, "--seq-len", held_out)  # refused as it is scored: which of the two
    refused((code, _, stderr), f"error: {trained_on_text.name}: the held-out split has {held_out:,} tokens")
    code, _, stderr = cli("evaluate", trained_on_text, configless, "--seq-len", "64", "--last", "32")
    refused((code, _, stderr), f"error: {configless} has no config.yaml")
    assert "64 tokens" not in stderr, stderr  # refused before the first run is scored
    code, _, stderr = cli("evaluate", trained_on_text, tmp_path, "--seq-len", "64", "--last", "32")  # not a run: said before any is scored
    refused((code, _, stderr), f"{tmp_path} is not a training run with a checkpoint")
    assert "64 tokens" not in stderr, stderr
    code, _, stderr = cli("evaluate", trained_on_text, checkpoints(trained_on_text)[-1], "--seq-len", "64", "--last", "32")
    refused((code, _, stderr), f"{checkpoints(trained_on_text)[-1]} is a checkpoint; give its run's folder")
    assert "64 tokens" not in stderr, stderr  # nor a run scored before the checkpoint is refused
    damaged = tmp_path / "damaged"  # its state.json gave a traceback, JSONDecodeError or AttributeError
    shutil.copytree(trained_on_text, damaged)
    latest = checkpoints(damaged)[-1]
    for state, why in (('{"step": ', "JSONDecodeError: Expecting value"), ("[1, 2]", "its state.json is not a mapping: [1, 2]")):
        (latest / "state.json").write_text(state)
        refused(cli("evaluate", damaged, "--seq-len", "64"), f"checkpoint {latest} is damaged ({why}", "); remove it to score the one before")


def test_evaluate_scores_another_corpus_read_with_the_runs_tokenizer(cli, trained_on_text, trained_on_mqar, tmp_path):
    from tokenizers import Tokenizer

    from archlab.train.checkpoint import load_trained
    from archlab.train.evaluate import evaluate, windows

    corpus = tmp_path / "other.txt"
    corpus.write_text((ROOT / "README.md").read_text()[:6000])
    ids = np.asarray(Tokenizer.from_file(str(trained_on_text / "tokenizer.json")).encode(corpus.read_text()).ids, dtype=np.uint16)
    np.save(tmp_path / "ids.npy", ids)
    _, model, _, _ = load_trained(trained_on_text)
    window = windows(ids, [64], 3)[64]
    with torch.no_grad():
        expected = F.cross_entropy(model(window.inputs)[:, -16:].flatten(0, 1), window.targets[:, -16:].flatten()).item()
    (text,) = evaluate(trained_on_text, [64], 16, 3, torch.device("cpu"), data=str(corpus))
    (token_file,) = evaluate(trained_on_text, [64], 16, 3, torch.device("cpu"), data=str(tmp_path / "ids.npy"))
    assert text.loss == pytest.approx(expected, rel=1e-5) and token_file.loss == text.loss
    refused(cli("evaluate", trained_on_mqar, "--seq-len", "64", "--last", "16", "--data", corpus),
            "is text, and the run has no tokenizer to read it with")
    refused(cli("evaluate", trained_on_text, "--seq-len", "64K", "--last", "16", "--data", corpus),
            f"data source {str(corpus)!r} has {len(ids):,} tokens, fewer than")
    refused(cli("evaluate", trained_on_text, "--data", " "), "--data is empty")
    # a text run beside a recall run: one table, the text run's accuracy empty
    code, out, stderr = cli("evaluate", trained_on_text, trained_on_mqar, "--seq-len", "32", "--last", "16", "--sequences", "2",
                            "--format", "csv")
    assert code in (0, None) and out.splitlines()[0].endswith(",ppl,acc") and out.splitlines()[1].endswith(","), stderr
    # text is tokenized after the run's line, which says so first (the default stdlib takes 6 to 20 s); a token file is not
    said = (f"tokenizing data source {str(corpus)!r} ({len(corpus.read_text()):,} characters) with the run's tokenizer"
            f" {trained_on_text / 'tokenizer.json'}")
    for command in (["evaluate", "--seq-len", "64", "--last", "16", "--sequences", "2"], ["layers", "--seq-len", "64", "--sequences", "2"],
                    ["niah", "--seq-len", "512", "--depths", "1", "--sequences", "1", "--new-tokens", "12", "--haystack", "text"]):
        for data, line in ((corpus, said), (tmp_path / "ids.npy", None)):
            code, _, stderr = cli(command[0], trained_on_text, *command[1:], "--data", data)
            assert code in (0, None) and (line in stderr if line else "tokenizing" not in stderr), (command, stderr)


def angle(a: torch.Tensor, b: torch.Tensor) -> float:
    """The mean over tokens of arccos(cos(a, b)) / pi, in float64 numpy: the definition, written out."""
    a, b = a.double().flatten(0, -2).numpy(), b.double().flatten(0, -2).numpy()
    cosine = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    return float(np.mean(np.arccos(np.clip(cosine, -1, 1))) / np.pi)


@pytest.mark.parametrize("loop", ["lower", "upper"])
def test_layers_measure_each_application_of_a_loop_as_the_walk_step_by_step_gives(loop):
    """One layer per half, so each step of the plan is one layer application: the hidden state
    after each prefix of the plan's steps is then each application's output."""
    from archlab.model import build_model
    from archlab.train.representations import angular_distances, applications, summary

    spec = load_spec(ROOT / "specs" / "tiny" / f"{'yoco-u' if loop == 'lower' else 'upper-loop'}.yaml",
                     ["layout.self_decoder.n_layers=1", "layout.cross_decoder.n_layers=1"])
    model = build_model(spec).eval()
    inputs = torch.randint(0, spec.vocab_size, (3, 24))
    self_times, cross_times = (3, 1) if loop == "lower" else (1, 3)
    expected = ([("self_decoder", t, 0) for t in range(1, self_times + 1)] + [("cross_decoder", t, 1) for t in range(1, cross_times + 1)])
    assert [(a.half, a.iteration, a.layer) for a in applications(model)] == expected

    steps = model.plan.steps
    ends = [k + 1 for k, step in enumerate(steps) if not step.project]  # the prefixes ending at each layer application
    positions = torch.arange(inputs.shape[1])[None]
    with torch.no_grad():
        walked = [torch.stack([model.run(model.embed(row[None]), positions, steps[:end], causal=True)[0] for row in inputs])
                  for end in [0, *ends]]
    walked[0] = model.embed(inputs).detach()
    distances = angular_distances(model, inputs, batch=2)  # batches of 2 and 1
    assert distances == pytest.approx([angle(a, b) for a, b in zip(walked, walked[1:])], rel=1e-5)
    assert all(0 < d < 0.5 for d in distances)

    looped, entering = summary("run", [*zip_measured(model, distances)])
    loop_distances = distances[:3] if loop == "lower" else distances[1:]
    assert looped.endswith("mean distance by iteration: " + ", ".join(f"{d:.4f}" for d in loop_distances))
    assert entering == f"run: entering the cross_decoder, the distance goes from {distances[-cross_times - 1]:.4f} to {distances[-cross_times]:.4f}"


def zip_measured(model, distances):
    from archlab.train.representations import Measured, applications

    return (Measured(a, d) for a, d in zip(applications(model), distances))


def test_layers_measure_a_layer_that_leaves_the_hidden_state_as_it_was_as_turning_it_by_nothing():
    """A layer whose output is its input (a residual branch that adds nothing, as a layer that has
    learned to pass its input on does): the cosine of a float32 vector with itself rounds past 1
    for some tokens, whose arccos would be NaN and make the layer's mean NaN."""
    from archlab.model import build_model
    from archlab.train.representations import angular_distances

    spec = load_spec(ROOT / "specs" / "tiny" / "yoco.yaml")
    model = build_model(spec).eval()
    model.layers[1].register_forward_hook(lambda layer, args, output: args[0])  # before the measure's hook: it sees the input again
    distances = angular_distances(model, torch.randint(0, spec.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0)))
    assert all(math.isfinite(d) for d in distances) and distances[1] < 1e-3 < min(distances[:1] + distances[2:]), distances


def test_layers_summary_names_a_loops_layers_and_averages_each_iteration_over_them():
    """Two layers in the looped half: the summary names the loop's first and last layer and gives
    each iteration's mean over its layers (distances made up, each distinct, so any regrouping shows)."""
    from archlab.model import build_model
    from archlab.train.representations import Measured, applications, summary

    for name, half, layers, looped in (("yoco-u", "self_decoder", "0-1", range(0, 6)), ("upper-loop", "cross_decoder", "2-3", range(2, 8))):
        order = applications(build_model(load_spec(ROOT / "specs" / "tiny" / f"{name}.yaml")))
        distances = [0.01 * (k + 1) ** 2 for k in range(len(order))]
        assert len(order) == 8 and [order[k].layer for k in looped] == [int(layers[0]), int(layers[-1])] * 3
        means = [(distances[k] + distances[k + 1]) / 2 for k in looped[::2]]
        entering = [a.half for a in order].index("cross_decoder")
        assert summary("run", [Measured(a, d) for a, d in zip(order, distances)]) == [
            f"run: {half} layers {layers} looped, mean distance by iteration: " + ", ".join(f"{m:.4f}" for m in means),
            f"run: entering the cross_decoder, the distance goes from {distances[entering - 1]:.4f} to {distances[entering]:.4f}"]


def test_layers_refuse_a_forward_pass_that_applies_other_layers_than_its_plan(monkeypatch):
    """More applications than the plan has, or fewer, is said, and the measure's hooks come off."""
    import archlab.train.representations as representations
    from archlab.model import build_model

    spec = load_spec(ROOT / "specs" / "tiny" / "yoco.yaml")
    model = build_model(spec).eval()
    planned = representations.applications(model)
    inputs = torch.randint(0, spec.vocab_size, (1, 8))
    for plan in (planned[:-1], planned + planned[:1]):
        monkeypatch.setattr(representations, "applications", lambda model, plan=plan: plan)
        with pytest.raises(RuntimeError, match=f"the forward pass applied {len(planned)} layers where its plan has {len(plan)}$"):
            representations.angular_distances(model, inputs)
        assert not any(layer._forward_hooks for layer in model.layers)


def test_layers_measure_trained_runs_on_their_held_out_split(cli, trained_on_text, trained_on_mqar, tmp_path):
    from archlab.train.checkpoint import load_trained
    from archlab.train.evaluate import windows
    from archlab.train.representations import angular_distances

    _, model, _, _ = load_trained(trained_on_text)
    window = windows(np.load(trained_on_text / "data" / "val.npy"), [32], 3)[32]
    code, out, stderr = cli("layers", trained_on_text, trained_on_mqar, "--seq-len", "32", "--sequences", "3", "--format", "json",
                            "--plot", tmp_path / "layers.png")
    assert code in (0, None), stderr
    rows = json.loads(out)
    text = [row for row in rows if row["run"] == str(trained_on_text)]  # both folders are named run: each by its path
    assert [row["layer"] for row in text] == list(range(model.spec.n_layers))
    assert [row["distance"] for row in text] == [round(d, 4) for d in angular_distances(model.eval(), window.inputs)]
    assert {row["run"] for row in rows} == {str(trained_on_text), str(trained_on_mqar)}  # a recall run's fresh sequences too
    assert (tmp_path / "layers.png").read_bytes().startswith(b"\x89PNG")
    assert "looped" not in stderr and "entering" not in stderr  # a plain stack has neither

    code, out, stderr = cli("layers", trained_on_mqar, "--format", "csv")  # the length it trained on
    assert code in (0, None) and len(out.splitlines()) == 1 + model.spec.n_layers, stderr

    held_out = len(np.load(trained_on_text / "data" / "val.npy"))
    refused(cli("layers", trained_on_text, "--seq-len", held_out), f"the held-out split has {held_out:,} tokens, fewer than")
    refused(cli("layers", tmp_path, "--seq-len", "64"), f"{tmp_path} is not a training run with a checkpoint")
    refused(cli("layers", trained_on_text, "--data", ""), "--data is empty")
    refused(cli("layers", trained_on_text, "--plot", tmp_path), "is a folder")
    for command in ("layers", "evaluate"):
        refused(cli(command, trained_on_text, "--device", "tpu"), "--device 'tpu' is not a device")
        if not torch.cuda.is_available():
            refused(cli(command, trained_on_text, "--device", "cuda"), "--device cuda: ")


def test_niah_hides_one_needle_at_each_depth_in_the_longest_haystack_that_fits(trained_on_text):
    from tokenizers import Tokenizer

    from archlab.train.evaluate import EvaluationError
    from archlab.train.needle import NEEDLE, PROMPT, Haystack, Probes, depths

    tokenizer = Tokenizer.from_file(str(trained_on_text / "tokenizer.json"))
    lines = dict.fromkeys(line for line in (ROOT / "README.md").read_text().splitlines() if line.strip())  # each once: found by index below
    text = Haystack.text("\n".join(lines), "the README")
    for haystack in (Haystack.noise(), text):
        drawn = Probes(haystack, tokenizer, 12, seed=3)
        for length in (512, 900):
            for depth in depths(4):
                probe = drawn.draw(length, depth)
                prompt = tokenizer.decode(probe.prompt)
                needle = NEEDLE.format(key=probe.key, value=probe.value)
                head, _, question = PROMPT.partition("{context}")
                assert prompt.startswith(head) and prompt.endswith(question.format(key=probe.key)), prompt
                lines = prompt[len(head) : -len(question.format(key=probe.key))].split("\n")
                assert lines.count(needle) == 1 and prompt.count(probe.value) == 1
                haystack_lines = [line for line in lines if line != needle]
                sizes = [len(tokenizer.encode(line).ids) + 1 for line in haystack_lines]  # with its newline
                before, wanted = sum(sizes[: lines.index(needle)]), sum(sizes) * depth / 100
                assert abs(before - wanted) <= max(sizes) / 2  # the needle sits at the line boundary nearest its depth in tokens
                assert probe.placed == pytest.approx(100 * before / sum(sizes))
                assert len(probe.prompt) + 12 <= length  # the prompt and what is generated fit
                start = haystack.lines.index(haystack_lines[0])
                more = haystack.lines_from(start, len(haystack_lines) + 1)
                more.insert(drawn.place(more, depth)[0], needle)
                longer = PROMPT.format(context="\n".join(more), key=probe.key)
                assert len(tokenizer.encode(longer).ids) + 12 > length  # and one more line would not
                control = tokenizer.decode(probe.control)
                assert probe.value not in control and control.replace(re.search(rf"for {probe.key} is: (\d+)\.", control)[1], probe.value) == prompt
                assert tokenizer.decode(probe.answer) == f" {probe.value}"
    short = Probes(Haystack.text("one line\nand another", "two lines"), tokenizer, 12, seed=3)
    with pytest.warns(UserWarning, match=r"the haystack \(two lines\) runs out of lines within 512 tokens: its 2 lines are read again"):
        short.draw(512, 50.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # noise is one line repeated by design: nothing to say
        Probes(Haystack.noise(), tokenizer, 12, seed=3).draw(512, 50.0)
    with pytest.raises(EvaluationError) as refused:
        Probes(Haystack.noise(), tokenizer, 2, seed=3).draw(512, 50.0)  # no continuation could hold the number
    said = re.fullmatch(r"--new-tokens 2: the answer '\d{7}' takes (\d+) tokens of the run's tokenizer after the prompt;"
                        r" generate (\d+) or more \((\d+), with room for a few words before it\)", str(refused.value))
    assert said and said[1] == said[2] and int(said[3]) == int(said[1]) + 4, refused.value  # was "takes 8 ... generate 12 or more"


def test_niah_finds_the_longest_haystack_as_a_scan_of_every_count_does():
    """The search for the most lines that fit, against trying every count, on prompts whose lines
    take from 1 to 399 tokens, in runs of short and long ones (text's code and prose)."""
    from archlab.train.needle import longest

    rng = np.random.default_rng(0)
    for _ in range(300):
        runs = [rng.integers(1, rng.choice([3, 30, 400]), size=rng.integers(1, 400)) for _ in range(rng.integers(1, 30))]
        sizes = np.concatenate([[rng.integers(0, 500)], *runs]).cumsum()
        budget, last, asked = int(rng.integers(sizes[0], sizes[-1])), len(sizes) - 1, []

        def size(count):  # past the lines drawn, a line takes 50 tokens
            asked.append(count)
            return int(sizes[min(count, last)]) + 50 * max(count - last, 0)

        found = longest(size, budget)
        assert found == int(np.flatnonzero(sizes <= budget)[-1]), (budget, asked)
        assert len(asked) <= 4 * np.log2(len(sizes)) + 8, asked  # no scan: about as many as doubling and halving (fewer on real text)


def test_niah_finds_the_longest_haystack_past_lines_that_take_no_tokens():
    """Sizes flat for a stretch (lines the prompt's encoding takes nothing more for): the guess on
    the line through two equal sizes is not a division by zero, and the answer is the scan's."""
    from archlab.train.needle import longest

    for flat, budget in ((40, 120), (10, 100), (200, 230)):
        size = lambda count: 100 + max(0, count - flat)  # noqa: E731
        assert longest(size, budget) == max(count for count in range(flat + budget) if size(count) <= budget)


def test_niah_scores_greedy_answers_and_their_loss_as_a_full_recompute_does(cli, trained_on_text, trained_on_mqar, tmp_path):
    from tokenizers import Tokenizer

    from archlab.train.checkpoint import load_trained
    from archlab.train.needle import Found, niah

    found = niah(trained_on_text, [512, 600], 2, 2, torch.device("cpu"), haystack="text", new_tokens=10, batch=3)
    assert [(f.probe.length, round(f.probe.depth)) for f in found] == [(n, d) for n in (512, 600) for d in (25, 75) for _ in range(2)]
    _, model, _, _ = load_trained(trained_on_text)
    tokenizer = Tokenizer.from_file(str(trained_on_text / "tokenizer.json"))
    with torch.no_grad():
        for f in found:
            sequence = torch.tensor(f.probe.prompt)
            for _ in range(10):  # greedy decoding by the whole forward pass, no cache
                sequence = torch.cat([sequence, model(sequence[None])[0, -1].argmax()[None]])
            assert f.continuation == tokenizer.decode(sequence[len(f.probe.prompt) :].tolist())
            for prompt, loss in ((f.probe.prompt, f.answer_loss), (f.probe.control, f.control_loss)):
                whole = torch.tensor(prompt + f.probe.answer)
                expected = F.cross_entropy(model(whole[None, :-1])[0, -len(f.probe.answer) :], whole[-len(f.probe.answer) :], reduction="sum")
                assert loss == pytest.approx(expected.item(), rel=1e-5)
            assert f.loss_per_digit == f.answer_loss / 7 and f.gain_per_digit == (f.control_loss - f.answer_loss) / 7
    probe = found[0].probe  # a continuation holding the number is found, whatever surrounds it
    assert Found(probe, f" is it? It is {probe.value}.", 0.0, 0.0).hit and not Found(probe, f" {probe.value[:-1]}", 0.0, 0.0).hit
    assert not any(Found(probe, wrong, 0.0, 0.0).hit for wrong in (f" {probe.value}0", f" 1{probe.value}"))  # a longer number is another

    code, out, stderr = cli("niah", trained_on_text, "--seq-len", "512", "600", "--depths", "2", "--sequences", "2", "--haystack", "text",
                            "--new-tokens", "10", "--format", "json", "--plot", tmp_path / "niah.png")
    assert code in (0, None), stderr
    rows = json.loads(out)
    assert [(row["length"], row["depth %"], row["probes"]) for row in rows] == [(n, d, 2) for n in (512, 600) for d in (25.0, 75.0)]
    assert rows[0]["loss/digit"] == round(statistics.fmean(f.loss_per_digit for f in found[:2]), 4)
    assert rows[0]["placed %"] == round(statistics.fmean(f.probe.placed for f in found[:2]), 1)
    assert f"{sum(f.hit for f in found)} of 8 probes found" in stderr
    assert (tmp_path / "niah.png").read_bytes().startswith(b"\x89PNG")
    code, _, stderr = outcome = cli("niah", trained_on_mqar, "--seq-len", "512")
    refused(outcome, "trained on a recall task and has no tokenizer")
    assert "512 tokens" not in stderr  # refused before the line that begins a run's probes
    refused(cli("niah", trained_on_text, "--seq-len", "300"), "--seq-len 300: the question and the needle alone take")
    refused(cli("niah", trained_on_text, "--data", "README.md"), "--data is the text haystack; give --haystack text")
    code, _, stderr = cli("niah", trained_on_text, "--seq-len", "512", "--depths", "40", "--sequences", "1", "--new-tokens", "12",
                          "--batch", "64")  # a notice of some 40 KB named each of a thousand depths
    notice = next(line for line in stderr.splitlines() if "the needle sits far from the depth asked" in line)
    assert code in (0, None) and notice.count("% (placed at") == 5 and re.search(r"; and \d+ more: a haystack this short", notice), stderr


def test_needles_placed_far_from_the_depth_asked_are_named_and_a_gain_of_nothing_has_no_sign():
    """At 512 tokens a haystack of a few lines put needles asked at 17% and 50% at 0%, with no word
    beyond the table's `placed %`; a gain a hair below 0 was said as -0.0000."""
    from archlab.train.needle import Found, Probe, misplaced, summary

    def found(length, depth, placed, control_loss=1.0):
        return Found(Probe(length, depth, "calm-anchor", "1234567", [], [], [], placed), "", 1.0, control_loss)

    probes = [found(512, 16.7, 0.0), found(512, 16.7, 2.0), found(512, 50.0, 45.0), found(2048, 83.3, 100.0)]
    assert misplaced(probes) == [(512, 16.7, 1.0), (2048, 83.3, 100.0)]  # by the mean over a cell's probes, past 10 points
    assert "reading the needle gains +0.0000 a digit" in summary("run", [found(512, 50.0, 50.0, control_loss=1.0 - 1e-9)])


def test_niah_takes_a_length_the_question_and_needle_just_fit_and_new_tokens_that_just_hold_the_answer(trained_on_text):
    """The same seed draws the same key and number: at the length of the question and the needle
    alone, with the tokens to generate, the probe has no line of haystack; a token less is refused.
    New tokens as many as the answer's hold it; one fewer is refused."""
    from tokenizers import Tokenizer

    from archlab.train.evaluate import EvaluationError
    from archlab.train.needle import NEEDLE, PROMPT, Haystack, Probes

    tokenizer = Tokenizer.from_file(str(trained_on_text / "tokenizer.json"))
    first = Probes(Haystack.noise(), tokenizer, 12, seed=5).draw(512, 50.0)
    bare = tokenizer.encode(PROMPT.format(context=NEEDLE.format(key=first.key, value=first.value), key=first.key)).ids
    probe = Probes(Haystack.noise(), tokenizer, 12, seed=5).draw(len(bare) + 12, 50.0)
    assert (probe.key, probe.value, probe.prompt, probe.placed) == (first.key, first.value, bare, 0.0)
    with pytest.raises(EvaluationError, match=f"--seq-len {len(bare) + 11:,}: the question and the needle alone take {len(bare):,} tokens"):
        Probes(Haystack.noise(), tokenizer, 12, seed=5).draw(len(bare) + 11, 50.0)
    held = len(first.answer)
    assert Probes(Haystack.noise(), tokenizer, held, seed=5).draw(512, 50.0).answer == first.answer
    with pytest.raises(EvaluationError, match=f"--new-tokens {held - 1}: the answer"):
        Probes(Haystack.noise(), tokenizer, held - 1, seed=5).draw(512, 50.0)


def test_niah_says_once_that_a_text_haystack_runs_out_and_not_where_its_lines_just_fit(trained_on_text):
    """A haystack of three lines, at every length from none of them to five: the warning comes
    with a fourth line (the first read again), not with all three just fitting; and once a draw."""
    from tokenizers import Tokenizer

    from archlab.train.needle import NEEDLE, PROMPT, Haystack, Probes

    tokenizer = Tokenizer.from_file(str(trained_on_text / "tokenizer.json"))
    haystack = Haystack.text("the red fox runs far\na slow green river\nseven tall trees stand", "three lines")
    head, _, question = PROMPT.partition("{context}")
    drawn = Probes(haystack, tokenizer, 12, seed=1)
    with pytest.warns(UserWarning, match=r"the haystack \(three lines\) runs out of lines within 512 tokens: its 3 lines are read again"):
        first = drawn.draw(512, 50.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drawn.draw(512, 25.0)  # said for the first probe only
    bare = len(tokenizer.encode(PROMPT.format(context=NEEDLE.format(key=first.key, value=first.value), key=first.key)).ids)
    counts, length = set(), bare + 12
    while max(counts, default=0) < 5:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            probe = Probes(haystack, tokenizer, 12, seed=1).draw(length, 50.0)
        count = len(tokenizer.decode(probe.prompt)[len(head) : -len(question.format(key=probe.key))].split("\n")) - 1  # less the needle
        assert len(said) == (count > 3), (length, count, [str(w.message) for w in said])
        counts.add(count)
        length += 1
    assert counts == {0, 1, 2, 3, 4, 5}


def test_niah_probes_begin_their_haystack_at_a_line_drawn_at_random(trained_on_text):
    from tokenizers import Tokenizer

    from archlab.train.needle import PROMPT, Haystack, Probes

    tokenizer = Tokenizer.from_file(str(trained_on_text / "tokenizer.json"))
    lines = [f"line {i} of the haystack" for i in range(40)]  # more than fit: none read again
    drawn = Probes(Haystack.text("\n".join(lines), "forty lines"), tokenizer, 12, seed=0)
    head = PROMPT.partition("{context}")[0]
    firsts = {tokenizer.decode(drawn.draw(600, 90.0).prompt)[len(head) :].split("\n")[0] for _ in range(12)}
    assert firsts <= set(lines) and len(firsts) > 2, firsts


def test_niah_text_haystack_leaves_out_lines_of_whitespace_alone():
    from archlab.train.evaluate import EvaluationError
    from archlab.train.needle import Haystack

    assert Haystack.text("first\n  \n\t\nsecond\n\n", "text").lines == ["first", "second"]
    with pytest.raises(EvaluationError, match="blank has no text to hide a needle in"):
        Haystack.text(" \n\t\n", "blank")


def test_niah_rows_and_summary_average_the_loss_and_gain_a_digit_over_probes():
    """Hand-made results: a probe found and one not, losses summed over the value's 7 digits."""
    from archlab.train.needle import Found, Probe, rows, summary

    probes = [Probe(512, 50.0, "calm-donkey", value, [], [], [], placed) for value, placed in (("1234567", 48.0), ("7654321", 51.0))]
    found = [Found(probes[0], " 1234567", 7.0, 21.0), Found(probes[1], " 7654320", 14.0, 10.5)]
    # loss a digit: 1 and 2; gain a digit: (21 - 7) / 7 = 2 and (10.5 - 14) / 7 = -0.5
    assert summary("run", found) == ("run: 1 of 2 probes found; the answer's loss 1.5000 a digit (a uniform guess at each is 2.3026);"
                                     " reading the needle gains +0.7500 a digit")
    assert rows("run", found) == [{"run": "run", "length": 512, "depth %": 50.0, "placed %": 49.5, "probes": 2, "found": 0.5,
                                   "loss/digit": 1.5, "gain/digit": 0.75}]


def test_curves_compare_runs_with_a_baseline_at_its_loss_and_at_its_flops(cli, trained_on_text, tmp_path):
    """Hand-written logs of two specs, so that equal FLOPs are unequal tokens."""
    from archlab.cost import Cost
    from archlab.spec import spec_to_yaml

    def logged(name, spec, evals):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "spec.yaml").write_text(spec_to_yaml(load_spec(spec)))  # resolved, as a run keeps it
        shutil.copy(trained_on_text / "config.yaml", folder / "config.yaml")
        records = [{"step": i + 1, "loss": loss + 0.5, "tokens": tokens, "eval_loss": loss} for i, (tokens, loss) in enumerate(evals)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return folder

    baseline = logged("baseline", trained_on_text / "spec.yaml", [(100, 3.0), (200, 2.0), (300, 1.5)])
    looped = logged("looped", ROOT / "specs" / "tiny" / "yoco-u.yaml", [(100, 2.6), (200, 1.4), (300, 1.8), (400, 1.0)])
    never = logged("never", ROOT / "specs" / "tiny" / "yoco-u.yaml", [(50, 2.6), (100, 2.0)])
    short = logged("short", ROOT / "specs" / "tiny" / "yoco-u.yaml", [(80, 2.6), (160, 2.0)])  # 80 tokens a step
    code, out, stderr = cli("curves", looped, never, short, "--baseline", baseline, "--format", "json", "--plot", tmp_path / "vs.png")
    assert code in (0, None), stderr
    rows = {row["run"]: row for row in json.loads(out)}
    assert list(rows) == ["baseline", "looped", "never", "short"]  # the baseline first, though not among the runs

    seq_len = TrainConfig.model_validate(yaml.safe_load((trained_on_text / "config.yaml").read_text())).seq_len
    per_token = {name: Cost(load_spec(folder / "spec.yaml")).train_flops_per_token(seq_len) for name, folder in
                 (("baseline", baseline), ("looped", looped))}
    at_their_flops = 300 * per_token["baseline"] / per_token["looped"]  # the looped run's tokens at the baseline's last FLOPs
    assert 100 < at_their_flops < 400
    first = 100 + 100 * (2.6 - 1.5) / (2.6 - 1.4)  # first down to 1.5 between its first two evaluations, not after the third
    expected = np.interp(at_their_flops, [100, 200, 300, 400], [2.6, 1.4, 1.8, 1.0])
    assert rows["looped"]["tokens to baseline loss"] == round(first) and rows["looped"]["share of baseline tokens"] == round(first / 300, 3)
    assert rows["looped"]["loss at baseline FLOPs"] == round(expected, 4) and rows["looped"]["vs baseline"] == round(expected - 1.5, 4)
    assert [rows["baseline"][k] for k in ("tokens to baseline loss", "share of baseline tokens", "loss at baseline FLOPs", "vs baseline")] == [
        300, 1.0, 1.5, 0.0]
    assert rows["never"]["tokens to baseline loss"] is None and rows["never"]["loss at baseline FLOPs"] is None  # not that low, nor that far
    assert 160 < at_their_flops < 160 + 80  # short stopped less than a step before the baseline's FLOPs, as an equal-FLOPs budget does
    assert (rows["short"]["loss at baseline FLOPs"], rows["short"]["vs baseline"]) == (2.0, 0.5)
    assert (tmp_path / "vs.png").read_bytes().startswith(b"\x89PNG")
    # a baseline whose loss rises at its end: the target is its best, reached at 200 of its tokens,
    # and its own share is 1 (against its last loss, 2.0 was first reached at 200: 0.667 of itself)
    rising = logged("rising", trained_on_text / "spec.yaml", [(100, 3.0), (200, 2.0), (300, 2.2)])
    code, out, stderr = cli("curves", looped, "--baseline", rising, "--format", "json")
    rows = {row["run"]: row for row in json.loads(out)}
    assert [rows["rising"][k] for k in ("tokens to baseline loss", "share of baseline tokens", "vs baseline")] == [200, 1.0, 0.0], rows
    first = 100 + 100 * (2.6 - 2.0) / (2.6 - 1.4)
    assert (rows["looped"]["tokens to baseline loss"], rows["looped"]["share of baseline tokens"]) == (round(first), round(first / 200, 3))

    (tmp_path / "unevaluated").mkdir()
    (tmp_path / "unevaluated" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0, "tokens": 64}) + "\n")
    refused(cli("curves", looped, "--baseline", tmp_path / "unevaluated"), "has logged no evaluation to compare with")


def own_logprob(model, whole: list[int], scored: int) -> tuple[float, bool]:
    """The log-probability of the last ``scored`` tokens of ``whole`` from the whole logits."""
    with torch.no_grad():
        logits = model(torch.tensor(whole[:-1])[None])[0, -scored:]
    targets = torch.tensor(whole[-scored:])
    return F.log_softmax(logits, -1).gather(-1, targets[:, None]).sum().item(), bool((logits.argmax(-1) == targets).all())


def test_a_curve_a_whole_step_short_of_the_baselines_flops_is_not_taken_at_its_end():
    """By hand: a curve at 1000 and 2000 training FLOPs, 500 a step. Short of the baseline's 2400
    by less than a step, it is read at its end; short by a whole step (2500), a budget of the
    baseline's FLOPs would have trained one more, so it has no value there; within it, the line."""
    from archlab.train.curves import compared

    tokens, flops, values = [10.0, 20.0], [1000.0, 2000.0], [3.0, 2.0]
    assert compared(tokens, flops, values, 2.5, 2400.0, step_flops=500.0) == (15.0, 2.0)
    assert compared(tokens, flops, values, 2.5, 2500.0, step_flops=500.0) == (15.0, None)
    assert compared(tokens, flops, values, 2.5, 1250.0, step_flops=500.0) == (15.0, 2.75)


def test_a_continuation_is_greedy_only_if_every_one_of_its_tokens_is_the_argmax(trained_on_text):
    """Whole-logits greedy tokens after a context are greedy; the same with its last token
    changed to another is not, though all but one of its tokens still are."""
    pytest.importorskip("lm_eval")
    from archlab.train.downstream import ArchlabLM
    from archlab.train.evaluate import Loaded

    lm = ArchlabLM(Loaded.of(trained_on_text), torch.device("cpu"), batch=2, max_length=40)
    context = lm.tok_encode("def main():\n    print(")
    greedy = []
    with torch.no_grad():
        for _ in range(3):
            greedy.append(lm.model(torch.tensor(context + greedy)[None])[0, -1].argmax().item())
    other = greedy[:-1] + [(greedy[-1] + 1) % lm.model.spec.vocab_size]
    found = lm._loglikelihood_tokens([(None, context, greedy), (None, context, other)])
    assert [is_greedy for _, is_greedy in found] == [True, False]
    for (logprob, _), continuation in zip(found, (greedy, other)):
        assert logprob == pytest.approx(own_logprob(lm.model, context + continuation, 3)[0], rel=1e-5)


def test_downstream_tasks_score_a_run_as_its_whole_logits_do(trained_on_text):
    """lm-evaluation-harness's three kinds of request, against the model's whole logits."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from tokenizers import Tokenizer

    from archlab.train.downstream import ArchlabLM
    from archlab.train.evaluate import EvaluationError, Loaded

    lm = ArchlabLM(Loaded.of(trained_on_text), torch.device("cpu"), batch=2, max_length=40)
    model, tokenizer = lm.model, Tokenizer.from_file(str(trained_on_text / "tokenizer.json"))
    encode = lambda text: tokenizer.encode(text).ids  # noqa: E731
    pairs = [("def add(a, b):\n    return a", " + b"), ("import", " os"), ("x = 1\n" * 20, "y = 2"), ("", "import sys")]
    found = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)], disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(pairs, found, strict=True):
        whole = encode(context + continuation) if context else [encode("\n")[0], *encode(continuation)]  # a newline before an empty context
        scored = len(whole) - len(encode(context.rstrip())) if context else len(whole) - 1  # the harness scores a context's trailing space
        expected, expected_greedy = own_logprob(model, whole[-41:], scored)  # a long context keeps its last 40 tokens
        assert logprob == pytest.approx(expected, rel=1e-5) and greedy == expected_greedy

    text = "import os\nimport sys\n\ndef main():\n    print(os.getcwd())\n" * 3
    (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    ids = [encode("\n")[0], *encode(text)]
    assert len(ids) > 2 * 40 + 1  # three windows
    expected, ends = 0.0, list(range(41, len(ids), 40)) + [len(ids)]
    for previous, end in zip([1, *ends], ends):  # each window predicts its own tokens from the 40 before each
        expected += own_logprob(model, ids[max(0, end - 41) : end], end - previous)[0]
    assert total == pytest.approx(expected, rel=1e-5)

    prompts = ["def main():\n", "import"]
    whole = lm.generate_until([Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 6}), i) for i, p in enumerate(prompts)],
                              disable_tqdm=True)
    for prompt, text in zip(prompts, whole, strict=True):
        sequence = encode(prompt)
        with torch.no_grad():
            for _ in range(6):  # greedy by the whole forward pass, no cache
                sequence.append(model(torch.tensor(sequence)[None])[0, -1].argmax().item())
        assert text == tokenizer.decode(sequence[len(encode(prompt)) :]) and len(text) >= 4
    stops = [text[2:4] for text in whole]  # each cut where its own text has a stop string
    cut = lm.generate_until([Instance("generate_until", {}, (p, {"until": [stop, "never"], "max_gen_toks": 6}), i)
                             for i, (p, stop) in enumerate(zip(prompts, stops))], disable_tqdm=True)
    assert cut == [text.split(stop)[0] for text, stop in zip(whole, stops)]
    (empty,) = lm.generate_until([Instance("generate_until", {}, ("", {"until": [], "max_gen_toks": 3}), 0)], disable_tqdm=True)
    sequence = encode("\n")  # an empty context starts from the end-of-text newline
    with torch.no_grad():
        for _ in range(3):
            sequence.append(model(torch.tensor(sequence)[None])[0, -1].argmax().item())
    assert empty == tokenizer.decode(sequence[1:])

    long = "x = 1\n" * 20  # past the 40 tokens the model reads: each request keeps 40 less its own new tokens
    both = lm.generate_until([Instance("generate_until", {}, (long, {"until": [], "max_gen_toks": new}), i) for i, new in enumerate((4, 10))],
                             disable_tqdm=True)
    for new, text in zip((4, 10), both, strict=True):
        sequence = encode(long)[-(40 - new) :]
        with torch.no_grad():
            for _ in range(new):
                sequence.append(model(torch.tensor(sequence)[None])[0, -1].argmax().item())
        assert text == tokenizer.decode(sequence[40 - new :])
    with pytest.raises(EvaluationError, match="a task asks for 40 new tokens, and the model reads 40 \\(--max-length\\)"):
        lm.generate_until([Instance("generate_until", {}, ("import", {"until": [], "max_gen_toks": 40}), 0)], disable_tqdm=True)
    with pytest.raises(EvaluationError, match="a task's continuation of 41 tokens is longer than the 40 the model reads"):
        lm._loglikelihood_tokens([(None, [1], list(range(41)))])
    assert lm._loglikelihood_tokens([(None, [1], list(range(40)))])[0][0] < 0  # as long as it reads: scored whole


def test_downstream_scores_every_token_of_a_continuation_after_an_empty_context(trained_on_text):
    """An empty context is the end-of-text newline, before the whole continuation: one that
    begins with a newline has that newline scored too (the harness's own rule takes it as the
    context, as it would a tokenizer's BOS)."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from archlab.train.downstream import ArchlabLM
    from archlab.train.evaluate import Loaded

    lm = ArchlabLM(Loaded.of(trained_on_text), torch.device("cpu"), batch=2, max_length=40)
    pairs = [("", "\nimport os"), ("", "\n\n"), ("", "import os")]
    found = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)], disable_tqdm=True)
    for (_, continuation), (logprob, greedy) in zip(pairs, found, strict=True):
        whole = [lm.newline, *lm.tok_encode(continuation)]
        expected, expected_greedy = own_logprob(lm.model, whole, len(whole) - 1)
        assert logprob == pytest.approx(expected, rel=1e-5) and greedy == expected_greedy


def test_downstream_generation_reads_the_harness_aliases_of_max_gen_toks(trained_on_text):
    """max_new_tokens (or max_tokens, max_completion_tokens) in a task's generation_kwargs is its
    max_gen_toks, as the harness's own models read it, not the default 256."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from archlab.train.downstream import ArchlabLM
    from archlab.train.evaluate import Loaded

    lm = ArchlabLM(Loaded.of(trained_on_text), torch.device("cpu"), batch=2, max_length=40)
    asked = [{"until": [], "max_new_tokens": 5}, {"until": [], "max_tokens": 3}, {"until": [], "max_gen_toks": 4, "max_new_tokens": 9}]
    texts = lm.generate_until([Instance("generate_until", {}, ("import", kwargs), i) for i, kwargs in enumerate(asked)],
                              disable_tqdm=True)
    prompt = lm.tok_encode("import")
    for new, text in zip((5, 3, 4), texts, strict=True):
        sequence = list(prompt)
        with torch.no_grad():
            for _ in range(new):
                sequence.append(lm.model(torch.tensor(sequence)[None])[0, -1].argmax().item())
        assert text == lm.tokenizer.decode(sequence[len(prompt) :])


def test_downstream_generation_feeds_the_last_max_length_less_new_tokens_of_a_long_context(trained_on_text, monkeypatch):
    """A context past --max-length keeps as many of its last tokens as leave room for the tokens
    asked for: the prompt and what it generates fit in what the model reads (a repetitive text,
    whose greedy reply is the same either way, cannot show it)."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    import archlab.train.downstream as downstream
    from archlab.train.evaluate import Loaded

    fed = []
    real = downstream.Engine.generate
    monkeypatch.setattr(downstream.Engine, "generate", lambda self, prompts, n, *a, **k: fed.append([p.tolist() for p in prompts]) or real(self, prompts, n, *a, **k))
    lm = downstream.ArchlabLM(Loaded.of(trained_on_text), torch.device("cpu"), batch=1, max_length=40)
    long = "".join(f"v{i} = {i * 7}\n" for i in range(30))
    ids = lm.tok_encode(long)
    assert len(ids) > 40
    lm.generate_until([Instance("generate_until", {}, (long, {"until": [], "max_gen_toks": new}), i) for i, new in enumerate((4, 10))],
                      disable_tqdm=True)
    assert fed == [[ids[-36:]], [ids[-30:]]]


def test_the_downstream_average_takes_each_named_task_once_by_the_first_metric_it_reports():
    from archlab.train.downstream import average

    results = {"results": {
        "suite": {"alias": "suite", "acc,none": 0.5, "acc_stderr,none": 0.1},  # a group's aggregate over its members
        "suite_a": {"acc,none": 0.9, "acc_norm,none": 0.2}, "suite_b": {"acc,none": 0.1},
        "piqa": {"acc,none": 0.6, "acc_norm,none": 0.7, "acc_norm_stderr,none": 0.01},
        "gsm8k": {"exact_match,strict-match": 0.05}}}
    row, left_out = average("r", results, ["suite", "piqa", "gsm8k"], ["acc_norm", "acc"])
    assert row["value"] == round((0.5 + 0.7) / 2, 4) and row["task"] == "average of 2" and left_out == ["gsm8k"]
    row, left_out = average("r", results, ["suite", "piqa", "gsm8k"], ["exact_match", "acc"])
    assert row["value"] == round((0.5 + 0.6 + 0.05) / 3, 4) and left_out == []
    assert average("r", results, ["piqa", "gsm8k"], ["acc"]) == (None, ["gsm8k"])  # one task: nothing to average
    twice = {"results": {"gsm8k": {"exact_match,strict-match": 0.1, "exact_match,flexible-extract": 0.3}, "piqa": {"acc,none": 0.5}}}
    row, _ = average("r", twice, ["gsm8k", "piqa"], ["exact_match", "acc"])  # a metric under two filters: the first reported
    assert row["value"] == round((0.1 + 0.5) / 2, 4)


def test_downstream_rows_are_each_tasks_metrics_with_their_own_standard_errors():
    """The harness reports a metric's standard error beside it as "<metric>_stderr,<filter>": that is
    the error of a row, not a metric of its own, and entries without a filter (an alias) are none."""
    from archlab.train.downstream import metrics

    results = {"results": {"piqa": {"alias": "piqa", "acc,none": 0.6, "acc_stderr,none": 0.01, "acc_norm,none": 0.7,
                                    "acc_norm_stderr,none": "N/A", "sample_len": 10}}}
    rows = [(row["task"], row["metric"], row["value"], row["stderr"]) for row in metrics("r", results)]
    assert rows == [("piqa", "acc", 0.6, 0.01), ("piqa", "acc_norm", 0.7, None)]


def test_downstream_runs_a_task_of_ones_own_through_the_harness(cli, trained_on_text, trained_on_mqar, tmp_path, monkeypatch, capfd):
    pytest.importorskip("lm_eval")
    from tokenizers import Tokenizer

    from archlab.memory import ACTIVATIONS
    from archlab.train import downstream
    from archlab.train.checkpoint import load_trained

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    items = [{"question": "def add(a, b):\n    return a", "choices": [" + b", " * 7", " and not"], "answer": 0},
             {"question": "import os\nimport", "choices": [" sys", " 123"], "answer": 1},
             {"question": "for i in range(10):\n   ", "choices": [" print(i)", " ]]]", " 9"], "answer": 2}]
    (tmp_path / "pick.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    (tmp_path / "pick.yaml").write_text(yaml.safe_dump({
        "task": "archlab_pick", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(tmp_path / "pick.jsonl")}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}", "target_delimiter": "", "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}))
    only_acc = yaml.safe_load((tmp_path / "pick.yaml").read_text()) | {"task": "archlab_pick_acc", "metric_list": [{"metric": "acc"}]}
    (tmp_path / "pick_acc.yaml").write_text(yaml.safe_dump(only_acc))
    watched = []  # the first batch of each call, the longest, whose memory is watched (tests/test_memory.py)
    monkeypatch.setattr(downstream, "Watched", lambda device, what: watched.append(what) or contextlib.nullcontext())
    code, out, stderr = cli("downstream", trained_on_text, "--tasks", "archlab_pick,archlab_pick_acc", "--include-path", tmp_path,
                            "--format", "json")
    assert code in (0, None) and watched and set(watched) == {ACTIVATIONS}, stderr
    rows = json.loads(out)
    scores = {row["metric"]: row["value"] for row in rows if row["task"] == "archlab_pick"}

    _, model, _, _ = load_trained(trained_on_text)
    tokenizer = Tokenizer.from_file(str(trained_on_text / "tokenizer.json"))
    picked, picked_norm = [], []
    for item in items:  # the harness's context (its trailing space scored), truncated to the 64 tokens the run trained on
        context = tokenizer.encode(item["question"].rstrip()).ids
        logprobs = [own_logprob(model, tokenizer.encode(item["question"] + c).ids[-65:],
                                len(tokenizer.encode(item["question"] + c).ids) - len(context))[0] for c in item["choices"]]
        picked.append(int(np.argmax(logprobs)) == item["answer"])
        picked_norm.append(int(np.argmax([lp / len(c) for lp, c in zip(logprobs, item["choices"])])) == item["answer"])
    assert (scores["acc"], scores["acc_norm"]) == (round(np.mean(picked), 4), round(np.mean(picked_norm), 4))
    assert [row for row in rows if row["task"] == "archlab_pick_acc"][0]["value"] == round(np.mean(picked), 4)
    assert rows[-1] == {"run": rows[0]["run"], "task": "average of 2", "metric": "acc_norm, else acc",  # acc_norm where reported
                        "value": round((np.mean(picked_norm) + np.mean(picked)) / 2, 4), "stderr": None}
    capfd.readouterr()
    monkeypatch.chdir(tmp_path)  # outside a repository, whose commit the harness asks git for
    code, _, stderr = cli("downstream", trained_on_text, "--tasks", "archlab_pick,archlab_pick_acc", "--include-path", tmp_path,
                          "--average", "bogus")
    assert code in (0, None) and "no average, as 0 of the 2 tasks report any of bogus" in stderr, stderr
    assert "fatal" not in capfd.readouterr().err  # git's "not a git repository", on the process's own stderr
    monkeypatch.chdir(ROOT)

    refused(cli("downstream", trained_on_text, "--tasks", "archlab_pick,no_such_task", "--include-path", tmp_path),
            "--tasks: no task 'no_such_task' in lm-evaluation-harness or")
    fieldless = yaml.safe_load((tmp_path / "pick.yaml").read_text()) | {"task": "archlab_fieldless", "doc_to_text": "{{no_field}}"}
    (tmp_path / "fieldless.yaml").write_text(yaml.safe_dump(fieldless))
    refused(cli("downstream", trained_on_text, "--tasks", "archlab_fieldless", "--include-path", tmp_path),
            "lm-evaluation-harness could not run archlab_fieldless (UndefinedError: 'no_field' is undefined)")
    (tmp_path / "past.jsonl").write_text("".join(json.dumps(item | {"answer": 3} if i == 1 else item) + "\n" for i, item in enumerate(items)))
    past = yaml.safe_load((tmp_path / "pick.yaml").read_text()) | {"task": "archlab_past", "dataset_kwargs": {"data_files": {"test": str(tmp_path / "past.jsonl")}}}
    (tmp_path / "past.yaml").write_text(yaml.safe_dump(past))  # the harness warns below the level it shows, and scores it wrong
    refused(cli("downstream", trained_on_text, "--tasks", "archlab_past", "--include-path", tmp_path),
            "archlab_past: 1 of the documents scored have a target that is not among their choices, such as {'question': 'import os")
    with monkeypatch.context() as patch, pytest.raises(TypeError):  # a fault in scoring is not passed off as the harness's
        patch.setattr("archlab.train.downstream.continuation_scores", lambda *args: torch.ones(()).item(1))
        cli("downstream", trained_on_text, "--tasks", "archlab_pick", "--include-path", tmp_path)
    (tmp_path / "broken.yaml").write_text("task: archlab_broken\ndataset_path: json\n  test_split: [\n")
    refused(cli("downstream", trained_on_text, "--tasks", "archlab_broken", "--include-path", tmp_path),  # the harness skips it quietly
            f"--tasks: no task 'archlab_broken' in lm-evaluation-harness or {tmp_path}, where lm-evaluation-harness skipped"
            f" {tmp_path / 'broken.yaml'} (mapping values are not allowed in this context")
    refused(cli("downstream", trained_on_text, "--tasks", " , "), "--tasks ' , ' names no task")
    refused(cli("downstream", trained_on_mqar, "--tasks", "archlab_pick", "--include-path", tmp_path),
            "trained on a recall task and has no tokenizer")
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as where it is not installed
    refused(cli("downstream", trained_on_text, "--tasks", "arc_easy"), "pip install 'archlab[eval]'")


def test_a_tokenizer_path_that_is_a_folder_is_not_said_to_be_missing(tmp_path):
    from archlab.train.data import load_tokenizer

    with pytest.raises(DataError, match="not a file"):
        load_tokenizer(str(tmp_path), 256)
    with pytest.raises(DataError, match="no such file"):
        load_tokenizer(str(tmp_path / "tokenizer.json"), 256)


def test_a_missing_tokenizer_for_text_is_named_as_the_tokenizer(cli, tmp_path):
    """The corpus's fingerprint read it first, and said only the path with the system's words."""
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox. " * 200)
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "run", "--data", text, *SMALL,
                "--set", f"data.tokenizer={tmp_path / 'nope.json'}", "--steps", "1"),
            f"error: tokenizer {str(tmp_path / 'nope.json')!r}: no such file")


def test_weights_changed_on_the_disk_are_found_before_training_goes_on_from_them(cli, tmp_path):
    """A bit of a weight flipped still reads as a number; the hash state.json records finds it, on
    resuming and on fine-tuning, and in a command that scores or samples the run (which had
    scored the changed weights as the run's). A checkpoint saved before hashes were recorded loads
    as it did."""
    run = tmp_path / "run"
    assert cli("train", "specs/tiny/transformer.yaml", "--out", run, *SMALL, "--steps", "2")[0] in (0, None)
    saved = checkpoints(run)[-1]
    weights = bytearray((saved / "model.safetensors").read_bytes())
    weights[-1] ^= 1  # the lowest bit of the last weight
    (saved / "model.safetensors").write_bytes(weights)
    changed = f"checkpoint {saved} is damaged (its model.safetensors is not the file saved with it: a hash of its bytes differs)"
    for target, given in ((run, ["--resume", "--steps", "3"]), (tmp_path / "tuned", ["--init", saved, "--steps", "1"])):
        refused(cli("train", "specs/tiny/transformer.yaml", "--out", target, *SMALL, *given), changed)
    assert not (tmp_path / "tuned").exists() and checkpoints(run) == [saved]
    for command in (["generate", run, "--max-new-tokens", "2"], ["evaluate", run, "--seq-len", "16", "--last", "8", "--sequences", "1"]):
        code, _, stderr = cli(*command)
        assert code == 1 and changed in " ".join(stderr.split()), stderr
    state = json.loads((saved / "state.json").read_text())
    del state["weights_blake2b"]
    (saved / "state.json").write_text(json.dumps(state))
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "3")
    assert code in (0, None) and "weights_blake2b" in json.loads((checkpoints(run)[-1] / "state.json").read_text()), stderr


def test_optimizer_state_changed_on_the_disk_is_found_before_a_resume_trains_on_it(cli, tmp_path):
    """A byte flipped among trainer.pt's optimizer moments still unpickles as numbers and would
    steer the resumed run without a word; the hash state.json records finds it."""
    run = tmp_path / "run"
    assert cli("train", "specs/tiny/transformer.yaml", "--out", run, *SMALL, "--steps", "2")[0] in (0, None)
    saved = checkpoints(run)[-1]
    state = bytearray((saved / "trainer.pt").read_bytes())
    state[len(state) // 2] ^= 0x10
    (saved / "trainer.pt").write_bytes(state)
    torch.load(saved / "trainer.pt", weights_only=True)  # the damage reads as numbers
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "3"),
            f"checkpoint {saved} is damaged (its trainer.pt is not the file saved with it: a hash of its bytes differs)")
    assert checkpoints(run) == [saved]


def test_a_tokenizer_that_cannot_encode_the_text_is_one_line(cli, tmp_path):
    """A word-level tokenizer without an unknown token meets a word it lacks: the tokenizers
    library raises a bare Exception, which was a traceback in train, evaluate and generate."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({word: i for i, word in enumerate("hello world the cat sat".split())}))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "words.json"))
    (tmp_path / "known.txt").write_text("hello world the cat sat " * 400)
    (tmp_path / "unknown.txt").write_text("hello zebra world " * 400)
    train = ["train", "specs/tiny/transformer.yaml", "--steps", "1", "--set", "seq_len=32", "--set", "batch_size=2",
             "--set", f"data.tokenizer={tmp_path / 'words.json'}"]
    said = "the tokenizer cannot encode {}: WordLevel error: Missing [UNK] token from the vocabulary"
    refused(cli(*train, "--out", tmp_path / "refused", "--data", tmp_path / "unknown.txt"),
            said.format(f"data source {str(tmp_path / 'unknown.txt')!r}"))
    run = tmp_path / "run"
    assert cli(*train, "--out", run, "--data", tmp_path / "known.txt")[0] == 0
    refused(cli("generate", run, "--prompt", "zebra", "--max-new-tokens", "2"), said.format("the prompt"))
    refused(cli("evaluate", run, "--data", tmp_path / "unknown.txt"), said.format(f"data source {str(tmp_path / 'unknown.txt')!r}"))


def test_a_tokenized_corpus_is_not_reused_for_text_edited_since(cli, tmp_path):
    """The corpus recorded its source's name, not its text: a start after the text grew read back
    the tokens of the text before, in a run's own folder as in a shared data.cache (and with a
    data.tokenizer replaced at the same path)."""
    short = tmp_path / "short.txt"
    short.write_text("hi there")
    train = ["train", "specs/tiny/transformer.yaml", "--steps", "1", "--set", "seq_len=32", "--set", "batch_size=2"]
    refused(cli(*train, "--out", tmp_path / "grown", "--data", short), "the training split of", "has 7;")
    short.write_text("hi there " + "plenty more text now " * 200)
    code, _, stderr = cli(*train, "--out", tmp_path / "grown", "--data", short)
    assert code == 0, stderr  # tokenized again, in the run's own folder

    corpus, cache = tmp_path / "corpus", tmp_path / "cache"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 100)
    shared = [*train, "--data", corpus, "--set", f"data.cache={cache}"]
    assert cli(*shared, "--out", tmp_path / "first")[0] == 0
    assert cli(*shared, "--out", tmp_path / "same")[0] == 0  # the same text: the same tokens, read back
    (corpus / "b.txt").write_text("a second file, written after the corpus was tokenized. " * 100)
    before = {p: p.read_bytes() for p in cache.rglob("*") if p.is_file()}
    refused(cli(*shared, "--out", tmp_path / "second"),
            f"{cache / 'data'} holds a corpus tokenized from the text {str(corpus)!r} held before it changed")
    assert before == {p: p.read_bytes() for p in cache.rglob("*") if p.is_file()}

    # one tokenizer at two paths (two fine-tuned runs' own copies of a base's) reads the same text into the same tokens
    from archlab.train.data import train_tokenizer

    copies = [tmp_path / "base1.json", tmp_path / "base2.json"]
    for tokenizer in copies:
        tokenizer.write_text(train_tokenizer(["the lazy dog sleeps. " * 100], 256).to_str())
    for n, tokenizer in enumerate(copies):
        code, _, stderr = cli(*train, "--out", tmp_path / f"tuned{n}", "--data", corpus, "--set", f"data.cache={tmp_path / 'tuned'}",
                              "--set", f"data.tokenizer={tokenizer}")
        assert code == 0, stderr


def test_a_corpus_fingerprint_tells_apart_documents_split_otherwise_and_a_tokenizer_file_replaced(tmp_path):
    """Each document is tokenized apart, so the same characters split into other documents give
    other tokens, and so does another tokenizer file at the same path: either tokenizes again."""
    from archlab.train.data import _text_fingerprint

    assert _text_fingerprint(["ab", "c"], None) != _text_fingerprint(["a", "bc"], None)
    assert _text_fingerprint(["ab", "c"], None) == _text_fingerprint(["ab", "c"], None)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(train_tokenizer(["some text"], 260).to_str())
    before = _text_fingerprint(["ab"], str(tokenizer))
    tokenizer.write_text(train_tokenizer(["other words"], 262).to_str())
    assert _text_fingerprint(["ab"], str(tokenizer)) != before != _text_fingerprint(["ab"], None)


def test_tokenizer_training_cuts_only_runs_without_whitespace_longer_than_a_word():
    """Training on a whitespace-free run took time quadratic in its length: 11 s for 200K
    characters of DNA, and a 1 MB line did not finish in 150 s (now 0.14 s and 1.2 s here). So did
    a run of whitespace alone: 2.4 s for 80K spaces, hours for 5M, deaf to signals (now 10 s for
    a whole training run on it)."""
    from archlab.train.data import LONGEST_WORD, _training_pieces

    text = "def f(x):\n    return x\n" * 200 + "w" * LONGEST_WORD  # a run of exactly the limit is left whole
    assert list(_training_pieces(text)) == [text]
    dna = "reads: " + "ACGT" * 2_000 + " end"
    pieces = list(_training_pieces(dna))
    assert "".join(pieces) == dna and len(pieces) == 8  # cut at 1,000 to 7,000 of its 8,000 characters
    assert all(len(run) <= LONGEST_WORD for piece in pieces for run in piece.split())
    padded = "a" + " " * 2_500 + "b"
    pieces = list(_training_pieces(padded))
    assert "".join(pieces) == padded and len(pieces) == 3 and all(len(piece) <= LONGEST_WORD + 1 for piece in pieces)


def test_evaluate_refuses_a_held_out_split_that_is_not_the_runs(cli, tmp_path):
    """A resume refused data changed since by its fingerprint; evaluate scored whatever the source
    held now (shuffled examples: mostly training ones), without a word."""
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 6000))
    run = tmp_path / "run"
    assert cli("train", "specs/tiny/transformer.yaml", "--out", run, "--data", tokens, *SMALL, "--steps", "1")[0] == 0
    assert cli("evaluate", run, "--seq-len", "32", "--last", "8", "--sequences", "2")[0] == 0
    code, _, stderr = cli("generate", run, "--max-new-tokens", "2")  # its prompt was read as bytes without a word
    assert code in (0, None) and f"{run} has no tokenizer (it trained on token ids or a recall task): text is read and printed as" \
        " UTF-8 bytes" in " ".join(stderr.split()), stderr
    code, _, stderr = cli("chat", run)  # refused: no notice of how it would have read text first
    assert code == 1 and "has no tokenizer" not in stderr and "with no tokenizer to read a conversation with" in stderr, stderr
    np.save(tokens, np.random.default_rng(1).integers(0, 256, 6000))
    refused(cli("evaluate", run, "--seq-len", "32", "--last", "8", "--sequences", "2"),
            f"is not the data {run} trained on: its checkpoint records", "give --data to score other text")
    assert cli("evaluate", run, "--seq-len", "32", "--last", "8", "--sequences", "2", "--data", tokens)[0] == 0


@pytest.mark.parametrize("precision,scored_in_bf16", [("bf16", True), ("fp32", False), ("auto", False)])
def test_a_run_is_scored_in_the_precision_it_trained_in(precision, scored_in_bf16):
    """evaluate, needle, downstream and representations score a run as its config trained it: a
    `precision: bf16` run on the CPU in a bf16 autocast (it was scored in float32), and by the same
    rule a `precision: fp32` run on CUDA in float32 (it was scored in bf16)."""
    from archlab.model import build_model
    from archlab.train.evaluate import Loaded

    model = build_model(load_spec(ROOT / "specs" / "tiny" / "transformer.yaml"))
    loaded = Loaded(ROOT, model, TrainConfig(precision=precision), None, None, None)
    _, autocast = loaded.on(torch.device("cpu"))
    with autocast:
        assert torch.is_autocast_enabled("cpu") == scored_in_bf16
        if scored_in_bf16:
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def damaged_npy_header(path, how: str) -> None:
    """An .npy file whose header numpy's reader chokes on in its own words: a Python literal cut
    short (a TokenError from its tokenizer) or a dtype that does not parse (a SyntaxError)."""
    np.save(path, np.arange(100, dtype=np.uint16))
    data = bytearray(path.read_bytes())
    if how == "literal cut short":
        data[10:30] = b"X" * 20
    else:
        data = data.replace(b"'<u2'", b"',u2'")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["literal cut short", "dtype unparsable"])
def test_a_token_file_or_cached_corpus_whose_npy_header_is_garbled_is_named(cli, trained_on_text, tmp_path, how):
    """numpy raises tokenize.TokenError or SyntaxError for some garbled headers, not the ValueError
    the readers caught: a traceback from train, and from evaluate on the run."""
    tokens = tmp_path / "tokens.npy"
    damaged_npy_header(tokens, how)
    refused(cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "r", "--data", tokens, *SMALL),
            f"token file {str(tokens)!r} could not be read")
    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    damaged_npy_header(run / "data" / "val.npy", how)
    refused_untouched(cli, run, f"the tokenized corpus in {run / 'data'} is damaged", f"remove {run / 'data'} to tokenize it again")
    refused(cli("evaluate", run, "--seq-len", "32", "--sequences", "1", "--last", "8", "--device", "cpu"),
            f"the tokenized corpus in {run / 'data'} is damaged")


NESTED_PAST_READING = '{"spec": ' + "[" * 100_000 + "]" * 100_000 + "}"


@pytest.mark.parametrize("file,said", [
    ("checkpoints/step-00000004/state.json", "checkpoint {run}/checkpoints/step-00000004 is damaged (its state.json nests too deeply"),
    ("data/corpus.json", "the tokenized corpus in {run}/data is damaged (its corpus.json does not read as a record of what it was made from)"),
    ("metrics.jsonl", "{run}/metrics.jsonl, line 5, is not a metrics record (its JSON nests too deeply)"),
], ids=["state.json", "corpus.json", "metrics.jsonl"])
def test_a_run_file_whose_json_nests_past_reading_is_named(cli, trained_on_text, tmp_path, file, said):
    """json.loads raises RecursionError, not the ValueError of other damage, for JSON nested past
    Python's recursion limit: a traceback from a resume, evaluate, generate or curves of the run."""
    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    target = run / file
    target.write_text((target.read_text() if file == "metrics.jsonl" else "") + NESTED_PAST_READING + "\n")
    said = said.format(run=run)
    refused_untouched(cli, run, said)
    evaluated = cli("evaluate", run, "--seq-len", "32", "--sequences", "1", "--last", "8", "--device", "cpu")
    if file == "metrics.jsonl":  # which evaluate reads only for a note, as it reads another damaged line
        assert evaluated[0] == 0 and "Traceback" not in evaluated[2], evaluated[2]
        refused(cli("curves", run), said)
    elif file == "data/corpus.json":  # which generating does not read
        refused(evaluated, said)
        code, _, stderr = cli("generate", run, "--prompt", "def", "--max-new-tokens", "2")
        assert code == 0 and "Traceback" not in stderr, stderr
    else:  # whose hash of the weights generating checks them against
        refused(evaluated, said)
        refused(cli("generate", run, "--prompt", "def", "--max-new-tokens", "2"), said)


def test_a_run_is_refused_inside_another_runs_checkpoints_folder_which_it_would_break(cli, trained_on_text, tmp_path):
    """A run made at RUN/checkpoints/step-NNNNNNNN read as RUN's latest checkpoint, damaged: its
    resume and generate were refused, and its pruning would have removed the run made there."""
    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for out in (run / "checkpoints" / "step-00000009", run / "checkpoints" / "mine"):
        refused(cli("train", "specs/tiny/transformer.yaml", "--out", out, *SMALL, "--steps", "1"),
                f"--out {out} is inside the checkpoints folder of the run {run}")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    assert before == {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}


@pytest.mark.parametrize("max_gen_toks, said", [(0, None), (-3, "a task asks for -3 new tokens (max_gen_toks); give 0 or more"),
                                                ("abc", "a task's generation_kwargs cannot be read (invalid literal for int()")])
def test_a_generation_tasks_max_gen_toks_of_none_is_empty_and_one_unusable_is_named(cli, trained_on_text, tmp_path, monkeypatch,
                                                                                    max_gen_toks, said):
    """A task of one's own asking for 0 new tokens, fewer, or a word: the engine's ValueError on
    0 and -3, and int()'s on the word, came out of downstream as tracebacks."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "add.jsonl").write_text(json.dumps({"question": "def add(a, b):\n    return a", "answer": " + b"}) + "\n")
    (tmp_path / "add.yaml").write_text(yaml.safe_dump({
        "task": "archlab_add", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(tmp_path / "add.jsonl")}},
        "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": max_gen_toks}, "metric_list": [{"metric": "exact_match"}]}))
    outcome = cli("downstream", trained_on_text, "--tasks", "archlab_add", "--include-path", tmp_path, "--format", "json")
    if said is None:
        code, out, stderr = outcome
        assert code in (0, None), stderr
        assert [(row["metric"], row["value"]) for row in json.loads(out)] == [("exact_match", 0.0)]
    else:
        refused(outcome, said)


def test_a_length_given_twice_is_a_row_once(cli, trained_on_text):
    """``niah --seq-len 512 512`` drew the probes of 512 twice into one row, whose count was then
    twice ``--sequences``; ``cost`` gave the same row twice."""
    code, out, stderr = cli("niah", trained_on_text, "--seq-len", "512", "512", "--depths", "1", "--sequences", "1", "--format", "json")
    assert code in (0, None), stderr
    (row,) = json.loads(out)
    assert row["length"] == 512 and row["probes"] == 1 and "512, 512" not in stderr
    code, out, stderr = cli("cost", "specs/tiny/yoco.yaml", "--seq-len", "1K", "1024", "--format", "json")
    assert code in (0, None) and [row["seq_len"] for row in json.loads(out)] == [1024], out + stderr


def test_a_run_says_when_it_tokenizes_its_corpus(cli, tmp_path):
    """Tokenizing the default stdlib takes 6 to 20 s before the first step's line: the run says it
    is tokenizing first, so that it does not sit silent, and a resume, which reads the tokens
    back, says nothing."""
    text = tmp_path / "[bold]corpus.txt"  # a name that reads as markup is shown as it is
    text.write_text("def f(x):\n    return x + 1\n" * 400)
    run = tmp_path / "run"
    args = ("train", ROOT / "specs/tiny/transformer.yaml", "--out", run, "--data", text, *SMALL, "--steps", "1")
    code, _, stderr = cli(*args)
    said = " ".join(stderr.split())
    assert code == 0 and f"tokenizing data source '{text}' (10,800 characters, with a BPE of 256 tokens trained on it first)" in said, stderr
    code, _, stderr = cli("train", ROOT / "specs/tiny/transformer.yaml", "--out", run, "--resume", "--steps", "2")
    assert code == 0 and "tokenizing" not in stderr, stderr


def test_scoring_a_run_whose_tokenized_corpus_was_removed_says_it_tokenizes_it_again(cli, trained_on_text, tmp_path):
    """A run's held-out split whose tokens were removed (to free the disk) is tokenized again, with
    the run's own tokenizer, before it is scored: 6 to 20 s for the default stdlib, said first so
    the command does not sit silent, and said as the run's tokenizer at work, not a BPE trained
    afresh (which would give other tokens than the run trained on)."""
    run = tmp_path / "run"
    shutil.copytree(trained_on_text, run)
    shutil.rmtree(run / "data")
    code, _, stderr = cli("evaluate", run, "--seq-len", "32", "--last", "8", "--sequences", "2")
    said = " ".join(stderr.split())
    assert code in (0, None) and "tokenizing data source 'stdlib' (" in said and f" characters) into {run / 'data'}" in said, stderr
    assert "BPE" not in said and (run / "data" / "train.npy").is_file()
