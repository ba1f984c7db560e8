"""A conversation's turns on the CPU, tiny specs: the time before a reply's first token when the
cache keeps the conversation (``archlab chat``: rewind to where the last prompt ended, feed the
reply and the new message) against prefilling the whole conversation again each turn.

    .venv/bin/python benchmarks/conversation.py [--turns 16] [--message 128] [--reply 128]

Each turn adds a message and a reply of random tokens; the first token of each turn's reply
is checked to be the same both ways (float64, greedy), and the table gives the last turn's time
and the whole conversation's, and their ratios, from one run on this machine.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import archlab
from archlab.engine import Engine

ROOT = Path(__file__).resolve().parents[1]


def turns(name: str, count: int, message: int, reply: int) -> tuple[list[float], list[float]]:
    """Seconds to each turn's first reply token: keeping the cache, and prefilling afresh."""
    torch.manual_seed(0)
    model = archlab.build_model(archlab.load_spec(ROOT / "specs" / "tiny" / f"{name}.yaml"), dtype=torch.float64).eval()
    engine = Engine(model)
    conversation = torch.randint(0, model.spec.vocab_size, (message,))
    cache = engine.new_cache(1, count * (message + reply) + 1)
    kept, afresh, held, marked = [], [], 0, None
    for _ in range(count):
        if marked is not None:
            cache.rewind(marked)
        start = time.perf_counter()
        _, kept_logits, _ = next(engine.stream([conversation], 1, cache=cache, held=held))
        kept.append(time.perf_counter() - start)
        marked, held = cache.mark(), len(conversation)
        start = time.perf_counter()
        _, fresh_logits, _ = next(engine.stream([conversation], 1))
        afresh.append(time.perf_counter() - start)
        assert kept_logits.argmax() == fresh_logits.argmax(), "a turn decoded differently from its cache"
        conversation = torch.cat([conversation, torch.randint(0, model.spec.vocab_size, (reply + message,))])
    return kept, afresh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--message", type=int, default=128, help="tokens of each message")
    parser.add_argument("--reply", type=int, default=128, help="tokens of each reply")
    args = parser.parse_args()
    if min(args.turns, args.message, args.reply) < 1:
        parser.error("give --turns, --message and --reply of 1 or more")
    print(f"{args.turns} turns of a {args.message}-token message and a {args.reply}-token reply; seconds to a reply's first token\n")
    print("| spec | last turn, kept | last turn, afresh | ratio | all turns, kept | all turns, afresh | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in ("yoco-u", "yoco", "transformer", "yoco-u-mamba2"):
        kept, afresh = turns(name, args.turns, args.message, args.reply)
        print(f"| {name} | {kept[-1]:.3f} | {afresh[-1]:.3f} | {afresh[-1] / kept[-1]:.1f}x | {sum(kept):.2f} | {sum(afresh):.2f} |"
              f" {sum(afresh) / sum(kept):.1f}x |")


if __name__ == "__main__":
    main()
