"""Training throughput on the CPU: archlab's trainer on the tiny transformer spec against a plain
Hugging Face ``LlamaForCausalLM`` training loop of the same size (width, depth, heads, KV heads,
FFN, vocabulary, sequence, batch and threads).

    .venv/bin/python benchmarks/train_vs_hf.py [--steps 40]

Both sides: AdamW, fp32 on the CPU, gradient clipping at 1.0, one optimizer step per batch drawn
at random offsets from the same tokens; a step's time includes drawing its batch. The first steps
warm up; the median step time of the rest is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

import archlab
from archlab.train.config import TrainConfig
from archlab.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 5


def archlab_tok_s(spec, tokens_file: Path, steps: int, batch: int, seq_len: int) -> float:
    cfg = TrainConfig.model_validate({
        "steps": steps, "batch_size": batch, "micro_batch_size": batch, "seq_len": seq_len, "log_interval": 1,
        "eval_interval": 10_000, "checkpoint_interval": 10_000, "data": {"source": str(tokens_file)},
    })
    with tempfile.TemporaryDirectory() as run:
        Trainer(spec, cfg, Path(run) / "run", Console(quiet=True)).fit(steps)
        records = [json.loads(line) for line in (Path(run) / "run" / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tok_s"] for r in records[WARMUP:])


def hf_tok_s(spec, tokens: np.ndarray, steps: int, batch: int, seq_len: int) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    block = spec.layout.layers.blocks[0]
    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.d_model, intermediate_size=spec.ffn.hidden_for(spec.d_model),
        num_hidden_layers=spec.n_layers, num_attention_heads=block.n_heads, num_key_value_heads=block.n_kv_heads,
        max_position_embeddings=seq_len, rms_norm_eps=spec.norm.eps, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    rng, times = np.random.default_rng(0), []
    for _ in range(steps):
        began = time.perf_counter()  # a step includes drawing its batch, as archlab's does
        starts = rng.integers(0, len(tokens) - seq_len - 1, batch)
        rows = torch.from_numpy(np.stack([tokens[s : s + seq_len + 1].astype(np.int64) for s in starts]))
        loss = model(input_ids=rows[:, :-1], labels=rows[:, :-1]).loss  # HF shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
    return batch * seq_len / statistics.median(times[WARMUP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help=f"steps each trains; the first {WARMUP} are not timed")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    if args.steps <= WARMUP or args.batch < 1 or args.seq_len < 2:
        parser.error(f"give --steps above {WARMUP} (the warm-up), --batch of 1 or more and --seq-len of 2 or more")
    spec = archlab.load_spec(ROOT / "specs/tiny/transformer.yaml")
    tokens = np.random.default_rng(0).integers(0, spec.vocab_size, 500_000).astype(np.uint16)
    with tempfile.TemporaryDirectory() as tmp:
        tokens_file = Path(tmp) / "tokens.bin"
        tokens.tofile(tokens_file)
        ours = archlab_tok_s(spec, tokens_file, args.steps, args.batch, args.seq_len)
    theirs = hf_tok_s(spec, tokens, args.steps, args.batch, args.seq_len)
    print(f"# Training throughput, tiny transformer, CPU ({torch.get_num_threads()} threads), batch {args.batch} x {args.seq_len}\n")
    print("| loop | tokens/s |\n|---|---|")
    print(f"| archlab trainer | {ours:,.0f} |\n| HF LlamaForCausalLM loop | {theirs:,.0f} |")
    print(f"\narchlab / HF: {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
