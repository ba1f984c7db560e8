"""A paged global K,V against rows per position, for a ragged batch (one long prompt, short others).

    .venv/bin/python benchmarks/paged_kv.py [--long 32K] [--short 1K] [--batch 8] [--gen 32]

Reports, from one run on this machine:
- measured, tiny yoco-u on the CPU: the global K,V each layout allocates, peak memory, and
  decode tokens/s over the same prompts, with the tokens compared;
- measured, tiny yoco-u in bfloat16 on the CPU: the memory one decoding step takes over pages of
  1 to 256 positions and over rows, for one 30K prompt and seven of 100;
- allocated, the paper-scale yoco-u in bfloat16 (built on the meta device, so nothing is
  computed): the global K,V of a batch of 32 whose lengths run evenly from 8K to 256K, with
  pages of 256 against rows for the longest, beside an H100's 80 GB.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import archlab
from archlab.bench import PeakMemory
from archlab.table import MIB, parse_length
from archlab.engine import Engine
from archlab.kv import pages_for

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


@torch.no_grad()
def measure(model: archlab.Model, prompts: list[torch.Tensor], gen: int, page_size: int | None) -> dict:
    engine = Engine(model, prefill_chunk=4096, page_size=page_size)
    lengths = [len(p) for p in prompts]
    with PeakMemory(engine.device) as peak:
        cache = engine.cache_for(lengths, gen + 2)
        logits = engine.prefill(prompts, cache)
        positions, tokens = torch.tensor(lengths), [logits.argmax(-1)]
        logits = engine.decode(tokens[-1][:, None], positions, cache)  # untimed, as archlab bench's first step
        start = time.perf_counter()
        for i in range(1, gen + 1):
            tokens.append(logits.argmax(-1))
            logits = engine.decode(tokens[-1][:, None], positions + i, cache)
        seconds = time.perf_counter() - start
        cache.check()
    return {
        "global_mb": cache.bytes_per_sequence().global_ * len(prompts) / MIB,
        "peak_mb": peak.peak,
        "decode_tok_s": len(prompts) * gen / seconds,
        "tokens": torch.stack(tokens).tolist(),
    }


@torch.no_grad()
def decode_step_memory(page_sizes: tuple = (1, 4, 16, 256, None)) -> list[str]:
    """One decoding step's peak memory over the cache it reads, for a ragged batch: over pages, each
    sequence's partials are combined from the pages it holds, which must not cost what a row per
    position of the whole capacity would."""
    model = archlab.build_model(archlab.load_spec(ROOT / "specs" / "tiny" / "yoco-u.yaml"), dtype=torch.bfloat16).eval()
    lengths = [30_000] + [100] * 7
    prompts = [torch.randint(0, model.spec.vocab_size, (n,)) for n in lengths]
    lines = ["| global K,V | cache MiB | one decoding step's peak MiB |", "|---|---|---|"]
    for page_size in page_sizes:
        engine = Engine(model, prefill_chunk=4096, page_size=page_size)
        cache = engine.cache_for(lengths, 4)
        logits = engine.prefill(prompts, cache)
        with PeakMemory(engine.device) as peak:
            engine.decode(logits.argmax(-1)[:, None], torch.tensor(lengths), cache)
        size = cache.bytes_per_sequence()
        lines.append(f"| {f'pages of {page_size}' if page_size else 'rows'} | {size.total * len(lengths) / MIB:.1f} | {peak.peak:.1f} |")
    return lines


def paper_scale(batch: int = 32, page_size: int = 256) -> list[str]:
    spec = archlab.load_spec(ROOT / "specs" / "paper" / "yoco-u.yaml")
    model = archlab.build_model(spec, device="meta", dtype=torch.bfloat16)
    engine = Engine(model, page_size=page_size)
    lengths = torch.linspace(8192, 262144, batch).long().tolist()
    weights = sum(p.numel() for p in model.parameters()) * 2 / GIB
    lines = [f"| {spec.name}, batch {batch}, 8K..256K | global K,V GiB | with bf16 weights ({weights:.1f} GiB) |", "|---|---|---|"]
    paged = engine.new_cache(batch, max(lengths), pages_for(lengths, page_size))
    rows = Engine(model).new_cache(batch, max(lengths))
    for name, cache in ((f"pages of {page_size}", paged), ("rows for the longest", rows)):
        size = cache.bytes_per_sequence().global_ * batch / GIB
        lines.append(f"| {name} | {size:.1f} | {size + weights:.1f} |")
    return lines


def tokens_arg(text: str) -> int:
    try:
        return parse_length(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", type=tokens_arg, default=32768)
    parser.add_argument("--short", type=tokens_arg, default=1024)
    parser.add_argument("--batch", type=at_least_one, default=8)
    parser.add_argument("--gen", type=at_least_one, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = archlab.build_model(archlab.load_spec(ROOT / "specs" / "tiny" / "yoco-u.yaml")).eval()
    lengths = [args.long] + [args.short] * (args.batch - 1)
    prompts = [torch.randint(0, model.spec.vocab_size, (n,)) for n in lengths]
    for size in (None, 256):  # warm-up: a layout measured first paid its one-time costs in its peak
        measure(model, prompts[:2], 2, size)
    results = {name: measure(model, prompts, args.gen, size) for name, size in (("rows", None), ("pages of 256", 256))}
    rows, paged = results.values()
    print(f"tiny yoco-u, CPU ({torch.get_num_threads()} threads), prompts of {lengths}, {args.gen} new tokens each\n")
    print("| layout | global K,V MiB | peak MiB | decode tok/s |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['global_mb']:.1f} | {r['peak_mb']:.1f} | {r['decode_tok_s']:,.0f} |")
    print(f"\npaged / rows: global K,V {paged['global_mb'] / rows['global_mb']:.3f}x, peak {paged['peak_mb'] / rows['peak_mb']:.2f}x,"
          f" decode {paged['decode_tok_s'] / rows['decode_tok_s']:.2f}x; same tokens: {paged['tokens'] == rows['tokens']}\n")
    print("\n".join(decode_step_memory()) + "\n")
    print("\n".join(paper_scale()))


if __name__ == "__main__":
    main()
