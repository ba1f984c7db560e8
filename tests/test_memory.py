"""Room checked before a large allocation on the CPU, where one too large for what is free is
not refused but filled until the kernel's OOM killer ends the process without a word."""

import os

import pytest
import torch

import archlab
import archlab.memory
from archlab.cache import Cache
from archlab.cost import Cost
from archlab.memory import NoRoom, free_bytes
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


def test_generate_refuses_a_cache_without_room_before_writing_the_prompt(cli, free):
    free(2 * WEIGHTS)  # the weights fit, a cache of 10,002 positions does not
    code, stdout, stderr = cli("generate", SPEC, "--prompt", "hi", "--max-new-tokens", 10_000)
    assert code == 1 and "a cache for 2 prompt + 10,000 new tokens does not fit in memory (its states ask for 9.8 MiB" \
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
