"""The training loss through the LM head: whole logits then F.cross_entropy, against the chunked
``linear_cross_entropy`` (``model(tokens, targets=...)``), at the paper's 100K vocabulary.

    .venv/bin/python benchmarks/head_loss.py [--batch 4] [--seq-len 1024]

Reports, from one run on this machine (tiny yoco-u with the paper's vocabulary, float32, CPU):
the peak memory and time of a forward and backward pass, and the loss and gradient differences.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import archlab
from archlab.bench import PeakMemory
from archlab.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]


def step(model: archlab.Model, tokens: torch.Tensor, targets: torch.Tensor, chunked: bool) -> dict:
    model.zero_grad(set_to_none=True)
    with PeakMemory(tokens.device) as peak:
        began = time.perf_counter()
        if chunked:
            loss = model(tokens, targets=targets)
        else:
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        seconds = time.perf_counter() - began
    return {"loss": loss.item(), "peak_mb": peak.peak, "seconds": seconds,
            "grads": torch.cat([p.grad.flatten() for p in model.parameters()])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args()
    if args.batch < 1 or args.seq_len < 1:
        parser.error("give --batch and --seq-len of 1 or more")
    path = ROOT / "specs" / "tiny" / "yoco-u.yaml"
    spec = load_spec(path, ["vocab_size=100352"])
    torch.manual_seed(0)
    model = archlab.build_model(spec)
    tokens, targets = (torch.randint(0, spec.vocab_size, (args.batch, args.seq_len)) for _ in range(2))
    step(model, tokens[:1, :64], targets[:1, :64], True)  # warm-up
    chunked, plain = (step(model, tokens, targets, c) for c in (True, False))  # the smaller first: memory the process keeps after a step can only lower the next figure
    logits_mb = args.batch * args.seq_len * spec.vocab_size * 4 / 2**20
    print(f"tiny yoco-u, vocabulary {spec.vocab_size:,}, {args.batch} x {args.seq_len} tokens, float32,"
          f" CPU ({torch.get_num_threads()} threads); the logits alone are {logits_mb:,.0f} MB\n")
    print("| loss | peak MB | fwd+bwd s |\n|---|---|---|")
    for name, r in (("logits, then F.cross_entropy", plain), ("linear_cross_entropy", chunked)):
        print(f"| {name} | {r['peak_mb']:,.0f} | {r['seconds']:.2f} |")
    grad_err = float((chunked["grads"] - plain["grads"]).norm() / plain["grads"].norm())
    print(f"\nchunked / plain: peak {chunked['peak_mb'] / plain['peak_mb']:.2f}x, time {chunked['seconds'] / plain['seconds']:.2f}x;"
          f" loss {chunked['loss']:.6f} vs {plain['loss']:.6f}, gradient relative difference {grad_err:.1e}")


if __name__ == "__main__":
    main()
