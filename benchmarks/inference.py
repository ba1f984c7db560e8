"""Long-context inference on the CPU, tiny specs: how prefill and decode costs grow with length.

    .venv/bin/python benchmarks/inference.py

Reports, from one run on this machine:
- prefill time from 2K to 16K tokens for yoco-u and the transformer (linear would be 8x);
- the self-decoder's cost per decoded token (prefill steps only: every loop iteration plus the
  global K,V projection) at growing context, which should not grow; and the whole decode step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import archlab
from archlab.bench import bench
from archlab.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = [2048, 4096, 8192, 16384]
DECODE_CONTEXTS = [2048, 16384, 65536]


def model_of(name: str) -> archlab.Model:
    torch.manual_seed(0)
    return archlab.build_model(archlab.load_spec(ROOT / "specs" / "tiny" / f"{name}.yaml")).eval()


def prefill_scaling() -> list[str]:
    lines = ["| spec | " + " | ".join(f"prefill s @ {n // 1024}K" for n in LENGTHS) + " | 16K / 2K |", "|" + "---|" * (len(LENGTHS) + 2)]
    for name in ("yoco-u", "transformer"):
        model = model_of(name)
        bench(model, name, 1024, 1, 1)  # warm-up
        seconds = [n / bench(model, name, n, 1, 1).prefill_tok_s for n in LENGTHS]
        lines.append(f"| {name} | " + " | ".join(f"{s:.3f}" for s in seconds) + f" | {seconds[-1] / seconds[0]:.1f}x |")
    return lines


@torch.no_grad()
def decode_costs(name: str, steps: int = 24) -> list[float]:
    """Median ms per token of the prefill steps alone, then of the whole model, at each context."""
    model = model_of(name)
    engine = Engine(model, prefill_chunk=4096)
    out = []
    for context in DECODE_CONTEXTS:
        cache = engine.new_cache(1, context + 2 * steps)
        engine.prefill([torch.randint(0, 256, (context,))], cache)
        token = torch.zeros(1, 1, dtype=torch.long)
        for full in (False, True):
            times = []
            for i in range(steps):
                start = torch.tensor([context + (steps if full else 0) + i])
                t0 = time.perf_counter()
                engine.feed(token, start, cache, full=full)
                times.append(time.perf_counter() - t0)
            out.append(1000 * statistics.median(times))
    return out


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()  # --help
    print(f"# archlab inference benchmark (CPU, {torch.get_num_threads()} threads, torch {torch.__version__})\n")
    print("## Prefill time against prompt length (batch 1)\n")
    print("\n".join(prefill_scaling()))
    print("\n## Decode cost per token against context (yoco-u, batch 1, median of 24 steps)\n")
    costs = decode_costs("yoco-u")
    print("| context | self-decoder + K,V projection (ms) | whole decode step (ms) |\n|---|---|---|")
    for i, context in enumerate(DECODE_CONTEXTS):
        print(f"| {context // 1024}K | {costs[2 * i]:.2f} | {costs[2 * i + 1]:.2f} |")
    print(f"\nself-decoder per-token cost, {DECODE_CONTEXTS[-1] // 1024}K / {DECODE_CONTEXTS[0] // 1024}K context:"
          f" {costs[-2] / costs[0]:.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
