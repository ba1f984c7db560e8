"""Inference measurements: prefill and decode throughput, peak memory, cache bytes per sequence.

The same function backs ``archlab bench`` and the scripts under ``benchmarks/``. Times are wall
clock on whatever device the model is on; on the CPU, peak memory is the rise of the process's
resident set (sampled during the run, from a start where freed memory was handed back), on CUDA
the allocator's peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
import time
from dataclasses import asdict, dataclass

import torch

from archlab.cache import check_cache_room
from archlab.engine import Engine
from archlab.files import save_figure_whole
from archlab.memory import resident_bytes
from archlab.model import Model
from archlab.table import MIB


@dataclass
class BenchRow:
    spec: str
    seq_len: int
    batch: int
    gen: int
    prefill_rows: int  # prompts prefilled (and timed); the others got copies of their cache
    page_size: int | None  # None: the global K,V a row per position
    page_kernel: str | None  # how decoding read the pages
    prefill_tok_s: float
    decode_tok_s: float
    peak_mb: float
    kv_global_mb: float
    kv_local_mb: float
    device: str

    @property
    def kv_total_mb(self) -> float:
        return self.kv_global_mb + self.kv_local_mb

    def as_dict(self) -> dict:
        """The fields, with the total cache beside its two parts."""
        fields = asdict(self)
        device = fields.pop("device")
        return {**fields, "kv_total_mb": self.kv_total_mb, "device": device}


class PeakMemory:
    """Peak memory over a ``with`` block, relative to its start (MiB)."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0.0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            release_freed_memory()
            self.start, self.high, self.running = resident_bytes(), resident_bytes(), True
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.high = max(self.high, resident_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = (torch.cuda.max_memory_allocated(self.device) - self.start) / MIB
        else:
            self.running = False
            self.thread.join()
            self.peak = (max(self.high, resident_bytes()) - self.start) / MIB


@functools.cache
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c"))


def release_freed_memory() -> None:
    """Return the memory the C allocator keeps after frees to the OS (glibc's malloc_trim), so that
    a new allocation shows in the resident set rather than reusing pages already counted: without
    it a measurement after a larger one can read below its own cache."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def bench(model: Model, name: str, seq_len: int, batch: int, gen: int, prefill_chunk: int = 2048, seed: int = 0,
          prefill_rows: int | None = None, cuda_graph: bool = False, page_size: int | None = None,
          page_kernel: str = "torch") -> BenchRow:
    """Prefill ``batch`` random prompts of ``seq_len`` tokens, then decode ``gen`` tokens greedily.
    Each is timed after an untimed first call, which loads and tunes kernels (a prefill of one
    chunk) or captures the CUDA graph (a decoding step).

    With ``prefill_rows`` (a divisor of ``batch``) only that many prompts are prefilled and timed;
    their cache rows are then copied into the rest of the batch, which decodes as a whole. A
    decode step costs the same whatever the cached tokens are, so long contexts at a large batch
    are measured without prefilling every row. ``page_size``, ``page_kernel``: a paged global
    K,V (``Engine``).
    """
    rows = prefill_rows or batch
    if batch % rows:
        raise ValueError(f"prefill_rows={rows} must divide batch={batch}")
    engine = Engine(model, prefill_chunk, cuda_graph, page_size, page_kernel)
    check_cache_room(model, batch, seq_len + 1 + gen, engine.dtype, engine.device, engine.page_size, page_kernel)  # before its prompts are made
    generator = torch.Generator().manual_seed(seed)
    prompts = list(torch.randint(0, model.spec.vocab_size, (rows, seq_len), generator=generator).to(engine.device))
    warm_up = min(seq_len, prefill_chunk)  # one chunk, untimed: the first call loads and tunes kernels
    engine.prefill([p[:warm_up] for p in prompts], engine.new_cache(rows, warm_up + 1))
    with PeakMemory(engine.device) as peak:
        cache = engine.new_cache(batch, seq_len + 1 + gen)
        prefilled = cache if rows == batch else cache.take(torch.arange(rows, device=engine.device))
        sync(engine.device)
        start = time.perf_counter()
        logits = engine.prefill(prompts, prefilled)
        sync(engine.device)
        prefill_s = time.perf_counter() - start
        if prefilled is not cache:
            cache.fill_from(prefilled)
            logits = logits.repeat(batch // rows, 1)
            del prefilled
        def step(logits: torch.Tensor, position: int) -> torch.Tensor:
            tokens = logits.argmax(dim=-1)[:, None]
            return engine.decode(tokens, torch.full((batch,), position, device=engine.device), cache)

        logits = step(logits, seq_len)  # untimed
        sync(engine.device)
        start = time.perf_counter()
        for i in range(1, gen + 1):
            logits = step(logits, seq_len + i)
        sync(engine.device)
        decode_s = time.perf_counter() - start
        cache.check()
    size = cache.bytes_per_sequence()
    return BenchRow(
        spec=name,
        seq_len=seq_len,
        batch=batch,
        gen=gen,
        prefill_rows=rows,
        page_size=cache.page_table and cache.page_table.page_size,
        page_kernel=cache.page_table and cache.page_table.kernel,
        prefill_tok_s=rows * seq_len / prefill_s,
        decode_tok_s=batch * gen / decode_s,
        peak_mb=peak.peak,
        kv_global_mb=size.global_ / MIB,
        kv_local_mb=size.local / MIB,
        device=device_name(engine.device),
    )


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    return f"CPU ({threads} thread{'s' * (threads != 1)})"


def plot(rows: list[BenchRow], path: str) -> None:
    """Prefill and decode throughput and cache memory against length, one line per spec."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.2))
    axes = fig.subplots(1, 3)
    panels = [
        ("prefill_tok_s", "prefill tokens/s"),
        ("decode_tok_s", "decode tokens/s"),
        ("kv_total_mb", "cache MiB per sequence"),
    ]
    for ax, (field, label) in zip(axes, panels):
        for name in dict.fromkeys(r.spec for r in rows):
            mine = sorted((r for r in rows if r.spec == name), key=lambda r: r.seq_len)
            ax.plot([r.seq_len for r in mine], [getattr(r, field) for r in mine], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    batch, gen = rows[0].batch, rows[0].gen
    fig.suptitle(f"archlab bench: batch {batch}, {gen} new tokens, {rows[0].device}")
    fig.tight_layout()
    save_figure_whole(fig, path, dpi=120)

