"""Room checked before a large allocation on the CPU, where one too large for what is free is
not refused but filled until the kernel's OOM killer ends the process without a word."""

import os
import subprocess
import sys

import pytest
import torch

import archlab
import archlab.memory
from archlab.cache import Cache
from archlab.cost import Cost
from archlab.memory import NoRoom, Watched, free_bytes
from archlab.train.checkpoint import checkpoints
from conftest import ROOT, TINY, ids

SPEC = "specs/tiny/transformer.yaml"  # 1 KiB of cache a position
WEIGHTS = Cost(archlab.load_spec(ROOT / SPEC)).params_total * 4


@pytest.fixture
def free(monkeypatch):
    """Set what the CPU has free, in bytes (the meta device keeps having no memory to check)."""
    cpu_only = free_bytes
    return lambda size: monkeypatch.setattr(archlab.memory, "free_bytes", lambda device: cpu_only(device) and size)


def test_the_cpu_says_what_it_has_free_and_other_devices_leave_it_to_their_allocator():
    assert 0 < free_bytes("cpu") <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert free_bytes("meta") is None and free_bytes(torch.device("cuda", 0)) is None


def test_the_memory_free_is_read_in_kilobytes_as_the_kernel_gives_it(monkeypatch):
    """/proc/meminfo counts in kB: a MemAvailable of 3 GiB read as bytes would refuse a 4 MiB cache."""
    import io

    meminfo = "MemTotal:       16384000 kB\nMemFree:         1000 kB\nMemAvailable:    3145728 kB\n"
    monkeypatch.setattr(archlab.memory, "open", lambda path: io.StringIO(meminfo), raising=False)
    assert free_bytes("cpu") == 3 * 2**30
    monkeypatch.setattr(archlab.memory, "open", lambda path: io.StringIO("MemTotal: 16384000 kB\n"), raising=False)
    assert free_bytes("cpu") is None  # a kernel that does not say


@pytest.mark.parametrize("path", TINY, ids=ids(TINY))
def test_a_cache_asks_for_what_its_cost_counts_and_nothing_is_made_without_room(path, free):
    spec = archlab.load_spec(path)
    model = archlab.build_model(spec)
    free(0)
    with pytest.raises(NoRoom) as refused:
        Cache(model, 3, 40, torch.float32)
    assert refused.value.asked == 3 * Cost(spec).cache_bytes(40, "float32").total
    free(refused.value.asked)  # exactly enough
    assert Cache(model, 3, 40, torch.float32).bytes_per_sequence().total * 3 == refused.value.asked


def test_a_paged_cache_asks_for_its_page_table_too_before_making_it(free):
    """The table (a page per column per row, its row and first position per page) was made
    before the check and left out of it: at a page of 1 position it outgrew the pages it saves."""
    model = archlab.build_model(archlab.load_spec(TINY[0].parent / "yoco-u.yaml"))
    from archlab.kv import PageTable

    table = PageTable(3 * model.streams, 3 * 40, 1, 40, "meta").nbytes()
    states = 3 * Cache(model, 3, 40, torch.float32, "meta", page_size=1).bytes_per_sequence().total
    assert table == (3 * 41 + 3 + 3 + 2 * 121) * 8  # table with its dump column, rows, held, owner and first per page and the spare
    free(states + table - 1)
    with pytest.raises(NoRoom) as refused:
        Cache(model, 3, 40, torch.float32, page_size=1)
    assert 0 <= refused.value.asked - (states + table) < 3  # bytes_per_sequence divides the pool's bytes by 3
    free(refused.value.asked)
    assert Cache(model, 3, 40, torch.float32, page_size=1).table_bytes() == table


@pytest.mark.parametrize("path", TINY, ids=ids(TINY))
def test_a_model_asks_for_its_weights_as_built(path, free):
    spec = archlab.load_spec(path)
    weights = sum(p.numel() * p.element_size() for p in archlab.build_model(spec, device="meta").parameters())
    free(weights - 1)
    with pytest.raises(NoRoom) as refused:
        archlab.build_model(spec, dtype=torch.bfloat16)  # built in float32, then cast
    assert refused.value.asked == weights and refused.value.what == "its weights in float32"
    free(weights)
    assert archlab.build_model(spec) is not None
    assert archlab.build_model(spec, device="meta") is not None  # no memory asked of the meta device


def test_a_model_past_any_machine_is_refused_in_words_on_every_device(cli, tmp_path):
    """Sizes each within the schema's bounds can still multiply past 2**53 (a million experts of a
    million wide): on the meta device torch raised "Overflow when unpacking long long" (at 1e30
    parameters), a TypeError that named nothing."""
    spec = archlab.load_spec(ROOT / "specs/tiny/transformer.yaml",
                             ["d_model=4096", "ffn={type: moe, n_experts: 1048576, top_k: 1, expert_hidden: 1048576}"])
    for device in ("meta", "cpu"):
        with pytest.raises(MemoryError, match=r"^transformer has 5\.4e\+16 parameters, past 2\*\*53, which no machine holds: is a"):
            archlab.build_model(spec, device=device)
    (tmp_path / "huge.yaml").write_text(archlab.spec.spec_to_yaml(spec))
    code, _, stderr = cli("build", tmp_path / "huge.yaml")
    assert code == 1 and "parameters does not fit in memory; lower d_model, n_layers or the FFN's size" in stderr, stderr


def test_generate_refuses_a_cache_without_room_before_writing_the_prompt(cli, free):
    free(2 * WEIGHTS)  # the weights fit, a cache of 10,002 positions does not
    code, stdout, stderr = cli("generate", SPEC, "--prompt", "hi", "--max-new-tokens", 10_000)
    assert code == 1 and "a cache for 2 prompt + 10,000 new tokens does not fit in memory (a cache's states (1 sequence of up to 10,002 positions) ask" \
        " for 9.8 MiB" \
        f" with {2 * WEIGHTS / 2**20:.1f} MiB free); lower --max-new-tokens" in stderr, stderr
    assert stdout == ""  # not "hi" with the error after it on the same line


def test_bench_refuses_a_batch_without_room_before_making_its_prompts(cli, free, monkeypatch):
    free(2 * WEIGHTS)
    monkeypatch.setattr(torch, "randint", lambda *args, **kwargs: pytest.fail("prompts made for a batch with no room"))
    code, _, stderr = cli("bench", SPEC, "--seq-len", "16", "--gen", "7", "--batch", 10**5)
    assert code == 1 and "transformer: a batch of 100000 x (16 prompt + 7 new tokens) does not fit in memory (its cache's states" \
        f" ask for 2.3 GiB with {2 * WEIGHTS / 2**20:.1f} MiB free)" in stderr, stderr


def test_training_counts_its_gradients_and_optimizer_state_and_leaves_no_run(cli, free, tmp_path):
    free(2 * WEIGHTS)  # the weights fit; with their gradients and AdamW's two moments they do not
    code, _, stderr = cli("train", SPEC, "--out", tmp_path / "run", "--steps", "1")
    said = f"(its float32 weights, gradients and AdamW's two moments ask for {4 * WEIGHTS / 2**20:.1f} MiB with {2 * WEIGHTS / 2**20:.1f} MiB free)"
    assert code == 1 and said in stderr, stderr
    assert not (tmp_path / "run").exists()



def test_a_trained_model_without_room_is_said_in_words(cli, free, tmp_path):
    code, _, stderr = cli("train", SPEC, "--out", tmp_path / "run", "--steps", "1", "--set", "seq_len=16", "--set", "batch_size=2",
                          "--set", "micro_batch_size=2", "--set", "data.max_bytes=20000", "--set", "eval_batches=1")
    assert code in (0, None), stderr
    free(WEIGHTS - 1)
    code, stdout, stderr = cli("generate", tmp_path / "run", "--prompt", "hi")
    assert code == 1 and f"transformer, the model of {tmp_path / 'run'}, does not fit in memory here (its weights in float32 ask for" \
        in stderr and "Traceback" not in stderr and not stdout, stderr


def archlab_told_free(free: int, *args) -> subprocess.CompletedProcess:
    """archlab in a process of its own, told that ``free`` bytes are free: its memory grows as its work's
    does, with no heap freed by earlier tests to take again."""
    told = f"import sys, archlab.memory, archlab.cli; archlab.memory.free_bytes = lambda device: {free}; archlab.cli.main()"
    return subprocess.run([sys.executable, "-c", told, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "500"})


def test_a_first_training_step_that_outgrows_the_memory_free_is_stopped_in_words(tmp_path):
    """8 x 1,024 tokens of the transformer take about 200 MiB: stopped with 64 MiB free, run with 1 GiB."""
    larger = ["--steps", "2", "--set", "seq_len=1024", "--set", "batch_size=8", "--set", "micro_batch_size=8",
              "--set", "data.max_bytes=400000", "--set", "eval_batches=1"]
    stopped = archlab_told_free(64 * 2**20, "train", SPEC, "--out", tmp_path / "stopped", *larger)
    assert stopped.returncode == 1 and "Traceback" not in stopped.stderr, stopped.stderr
    assert f"training transformer ({WEIGHTS // 4:,} parameters) in micro-batches of 8 x 1,024 tokens does not fit in memory (its first" \
        " step's activations, gradients and AdamW moments had taken" in stopped.stderr, stopped.stderr
    assert "of the 64.0 MiB free when they were stopped); lower micro_batch_size, seq_len or the spec's sizes; no checkpoint" \
        in stopped.stderr and not (tmp_path / "stopped" / "checkpoints").exists(), stopped.stderr
    trained = archlab_told_free(2**30, "train", SPEC, "--out", tmp_path / "trained", *larger)
    assert trained.returncode == 0 and len(checkpoints(tmp_path / "trained")) == 1, trained.stderr


def test_scoring_or_a_build_check_that_outgrows_the_memory_free_is_stopped_in_words(cli, tmp_path):
    """downstream's first batch is watched as these are (tests/test_train.py)."""
    code, _, stderr = cli("train", SPEC, "--out", tmp_path / "run", "--steps", "1", "--set", "seq_len=64", "--set", "batch_size=2",
                          "--set", "micro_batch_size=2", "--set", "data.max_bytes=400000", "--set", "eval_batches=1")
    assert code in (0, None), stderr
    scoring = "run: 8 windows of 2,048 tokens does not fit in memory (its activations had taken"
    for command, free, said in (
            (["evaluate", tmp_path / "run", "--sequences", "8"], 8, scoring), (["layers", tmp_path / "run", "--sequences", "8"], 8, scoring),
            (["niah", tmp_path / "run", "--sequences", "8", "--depths", "1"], 24,  # its cache, 15.5 MiB, is made
             "run: 8 probes of up to 2,048 tokens, 8 at a time does not fit in memory (its caches and activations had taken"),
            (["build", SPEC], 8, "transformer: a check of 2 x 2,048 tokens does not fit in memory (its activations and gradients had taken")):
        stopped = archlab_told_free(free * 2**20, *command, "--seq-len", "2K")
        assert stopped.returncode == 1 and "Traceback" not in stopped.stderr, stopped.stderr
        assert said in stopped.stderr and f"of the {free}.0 MiB free when they were stopped); lower --seq-len" in stopped.stderr, stopped.stderr


def test_needle_probes_or_a_cache_that_would_not_fit_are_refused_before_any_probe_is_drawn(cli, tmp_path, monkeypatch):
    """Probes are drawn before any is searched: at 64M tokens they were still being drawn two
    minutes on (about 400 bytes a token as one is drawn, 72 as each is kept); at 8M they fit, and
    the cache of the longest did not, which was found only once all were drawn."""
    from archlab.train.needle import Probes

    code, _, stderr = cli("train", SPEC, "--out", tmp_path / "run", "--steps", "1", "--set", "seq_len=64", "--set", "batch_size=2",
                          "--set", "micro_batch_size=2", "--set", "data.max_bytes=400000", "--set", "eval_batches=1")
    assert code in (0, None), stderr
    monkeypatch.setattr(archlab.memory, "free_bytes", lambda device: 5 * 2**30 if torch.device(device).type == "cpu" else None)
    monkeypatch.setattr(Probes, "draw", lambda *args: pytest.fail("a probe was drawn"))
    for length, options, said in (("64M", [], "run: 20 probes of up to 67,108,864 tokens, 8 at a time does not fit in memory (the probes' prompts ask for 115.0 GiB with 5.0 GiB free)"),
                                  ("8M", ["--sequences", "1", "--depths", "1"],
                                   "run: 1 probe of up to 8,388,608 tokens, 1 at a time does not fit in memory (its cache's states ask"
                                   " for 8.0 GiB with 5.0 GiB free)")):  # 8,388,608 positions and 16 generated
        code, _, stderr = cli("niah", tmp_path / "run", "--seq-len", length, *options)
        assert code == 1 and said in stderr and "lower --seq-len, --batch, --depths or --sequences" in stderr, stderr


def test_a_watched_backward_pass_is_stopped_where_its_memory_grows(monkeypatch):
    """The backward pass runs in autograd's engine, without a line of Python between its ops, and is
    watched all the same; a pass with room is computed as unwatched."""
    spec = archlab.load_spec(ROOT / SPEC)
    model = archlab.build_model(spec)
    tokens = torch.randint(0, spec.vocab_size, (2, 32))
    expected = torch.autograd.grad(model(tokens, targets=tokens), model.embed.weight)[0]
    with Watched("cpu", "its pass"):
        assert torch.equal(torch.autograd.grad(model(tokens, targets=tokens), model.embed.weight)[0], expected)
    with Watched("meta", "its pass") as watched:  # nothing says what the meta device (or CUDA) has free
        assert watched.free is None

    backward = []
    monkeypatch.setattr(archlab.memory, "free_bytes", lambda device: 2**30)
    monkeypatch.setattr(archlab.memory, "resident_bytes", lambda: 2**40 if backward else 2**20)  # grows once backward begins
    monkeypatch.setattr(Watched, "READ_EVERY", 1)
    with pytest.raises(NoRoom) as stopped, Watched("cpu", "its pass"):
        loss = model(tokens, targets=tokens)
        loss.register_hook(lambda grad: backward.append(True))
        loss.backward()
    assert backward and str(stopped.value) == "its pass had taken 1,024.0 GiB of the 1.0 GiB free when they were stopped"


def test_the_watch_leaves_room_for_another_op_as_large_as_the_largest_yet(monkeypatch):
    """Grown by 50 MiB of 100 MiB free: ops of 4 MiB go on, and once one of 48 MiB has been made,
    another as large would pass nine tenths of what was free."""
    monkeypatch.setattr(archlab.memory, "free_bytes", lambda device: 100 * 2**20)
    reads = iter([0] + [50 * 2**20] * 10)  # when the work begins, then as it goes
    monkeypatch.setattr(archlab.memory, "resident_bytes", lambda: next(reads))
    with Watched("cpu", "its pass"):
        for _ in range(8):
            torch.ones(2**20)  # 4 MiB each
        with pytest.raises(NoRoom) as stopped:
            torch.ones(12 * 2**20)
    assert str(stopped.value) == "its pass had taken 50.0 MiB of the 100.0 MiB free when they were stopped"


def test_the_watch_keeps_room_for_the_largest_op_yet_after_smaller_ones(monkeypatch):
    """A 48 MiB op read with nothing grown yet; grown by 50 MiB of 100 MiB free, ops of 4 MiB are
    stopped at the next read: another as large as that earlier one would pass nine tenths."""
    monkeypatch.setattr(archlab.memory, "free_bytes", lambda device: 100 * 2**20)
    grown = [0]
    monkeypatch.setattr(archlab.memory, "resident_bytes", lambda: grown[0])
    with Watched("cpu", "its pass"):
        torch.ones(12 * 2**20)  # 48 MiB
        grown[0] = 50 * 2**20
        with pytest.raises(NoRoom) as stopped:
            for _ in range(8):
                torch.ones(2**20)  # 4 MiB each: 54 MiB, with room for another
    assert str(stopped.value) == "its pass had taken 50.0 MiB of the 100.0 MiB free when they were stopped"


def test_flex_attention_runs_watched(cli, tmp_path):
    """FlexAttention is a higher-order op, traced by torch.compile even in eager mode: the watch
    passes it on, and its tracing on."""
    spec = tmp_path / "flexed.yaml"
    spec.write_text(f"extends: {ROOT / SPEC}\nname: flexed\nlayout:\n  layers:\n    blocks: [{{type: attention, n_heads: 4, n_kv_heads: 2, backend: flex}}]\n")
    code, stdout, stderr = cli("build", spec)
    assert code in (0, None) and "ok fwd only (no CPU backward for attention: flex), costs, decoding" in " ".join(stdout.split()), stderr


def test_a_prefill_that_outgrows_the_memory_free_is_stopped_before_the_prompt_is_written(tmp_path):
    """64 ParScale streams make a 400-token prompt's prefill 25,600 rows of activations (the cache,
    checked before it is made, takes 25.1 MiB): stopped with 48 MiB free, run with 1 GiB."""
    spec = tmp_path / "streams.yaml"
    spec.write_text(f"extends: {ROOT / 'specs/tiny/parscale.yaml'}\nname: streams\nparscale: {{streams: 64, prefix_len: 4}}\n")
    prompt = "the prompt " * 36 + "abcd"
    stopped = archlab_told_free(48 * 2**20, "generate", spec, "--prompt", prompt, "--max-new-tokens", 2)
    assert stopped.returncode == 1 and "Traceback" not in stopped.stderr and stopped.stdout == "", stopped.stderr
    assert "a prefill of 400 tokens does not fit in memory (its activations had taken" in stopped.stderr \
        and "of the 48.0 MiB free when they were stopped); lower the prompt or the spec's sizes" in stopped.stderr, stopped.stderr
    written = archlab_told_free(2**30, "generate", spec, "--prompt", prompt, "--max-new-tokens", 2)
    assert written.returncode == 0 and written.stdout.startswith(prompt), written.stderr
