"""Everything a GPU must show, in one run: kernel parity, the paper's inference table, training MFU.

    python benchmarks/gpu_check.py --out results/          # on a CUDA machine with archlab[cuda]
    python benchmarks/gpu_check.py --smoke --out /tmp/gc   # the same script on the CPU, tiny sizes

1. Parity: every block's kernel backend against its PyTorch backend (same weights, bf16): the
   training forward and input gradients, and 16 decoding steps through the recurrent state.
2. Inference (paper specs transformer, yoco, yoco-u, rins; batch 32, 128 new tokens): prefill and
   decode tokens/s and cache MB per sequence, length by length until memory or the time budget
   runs out.
3. Training: tokens/s and MFU of the paper-scale yoco-u under bf16 autocast.
Results go to OUT/gpu_check.json and OUT/gpu_check.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

import archlab
from archlab.bench import bench, device_name
from archlab.block import BuildContext, MixerInput
from archlab.ops.dispatch import installed
from archlab.train.config import TrainConfig
from archlab.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
console = Console(stderr=True)

# (block spec, kernel backends to compare with "torch")
PARITY = [
    ({"type": "gdn", "n_heads": 4, "chunk_size": 64}, ["fla"]),
    ({"type": "retnet", "n_heads": 4}, ["fla"]),
    ({"type": "retnet", "n_heads": 4, "gated": True}, ["fla"]),
    ({"type": "mamba2", "d_state": 64, "head_dim": 64, "chunk_size": 64}, ["mamba_ssm"]),
    ({"type": "swa", "window": 128, "n_heads": 8, "n_kv_heads": 2}, ["flash_attn", "flex"]),
    ({"type": "attention", "n_heads": 8, "n_kv_heads": 2}, ["flash_attn", "flex"]),
]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def parity(device: torch.device, dtype: torch.dtype, d_model: int, n: int) -> list[dict]:
    from archlab.spec import _resolve_blocks, block_specs

    _resolve_blocks()
    rows = []
    for fields, backends in PARITY:
        spec_class = block_specs()[fields["type"]]
        ctx = BuildContext(d_model=d_model, rope_theta=10_000.0)
        torch.manual_seed(0)
        reference = spec_class.model_validate({**fields, "backend": "torch"}).build(ctx).to(device, dtype)
        x = torch.randn(2, n, d_model, device=device, dtype=dtype, requires_grad=True)
        causal = MixerInput(torch.arange(n, device=device)[None], causal=True)
        ref_out = reference(x, causal)
        (ref_grad,) = torch.autograd.grad(ref_out.float().square().sum(), x)
        for backend in backends:
            row = {"block": fields["type"] + (" gated" if fields.get("gated") else ""), "backend": backend}
            if not installed(backend) or (device.type != "cuda" and backend != "flex"):
                rows.append({**row, "status": "skipped (not available here)"})
                continue
            kernel = spec_class.model_validate({**fields, "backend": backend}).build(ctx).to(device, dtype)
            kernel.load_state_dict(reference.state_dict())
            eager_flex = backend == "flex" and device.type != "cuda"  # FlexAttention has no CPU backward
            try:
                with torch.no_grad() if eager_flex else nullcontext():
                    out = kernel(x, causal)
                row["forward_rel_err"] = relative_error(out, ref_out)
                if not eager_flex:
                    (grad,) = torch.autograd.grad(out.float().square().sum(), x)
                    row["grad_rel_err"] = relative_error(grad, ref_grad)
                row["decode_rel_err"] = decode_parity(reference, kernel, x.detach(), device)
                row["status"] = "ok" if max(v for k, v in row.items() if k.endswith("rel_err")) < 3e-2 else "MISMATCH"
            except Exception as exc:  # a kernel that cannot run is a finding, not a crash of the check
                row["status"] = f"error: {type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            console.print(row)
    return rows


@torch.no_grad()
def decode_parity(reference, kernel, x, device, steps: int = 16) -> float:
    """Feed the first tokens one at a time through each module's own state; compare outputs."""
    states = [m.new_state(2, steps, x.dtype) for m in (reference, kernel)]
    states = [{k: t.to(device) for k, t in s.items()} for s in states]
    worst = 0.0
    for t in range(steps):
        inp = [MixerInput(torch.full((2, 1), t, device=device), state=s) for s in states]
        a, b = reference(x[:, t : t + 1], inp[0]), kernel(x[:, t : t + 1], inp[1])
        worst = max(worst, relative_error(b, a))
    return worst


def inference(device: torch.device, specs: list[str], lengths: list[int], batch: int, gen: int, budget_s: float) -> list[dict]:
    rows = []
    for name in specs:
        spec = archlab.load_spec(name)
        model = archlab.build_model(spec, device=device, dtype=getattr(torch, spec.inference_dtype)).eval()
        for n in lengths:
            began = time.perf_counter()
            try:
                row = bench(model, spec.name, n, batch, gen).as_dict()
            except torch.OutOfMemoryError:
                rows.append({"spec": spec.name, "seq_len": n, "batch": batch, "status": "out of memory"})
                torch.cuda.empty_cache()
                break
            rows.append({**row, "status": "ok"})
            console.print(rows[-1])
            if time.perf_counter() - began > budget_s:
                rows.append({"spec": spec.name, "seq_len": "longer", "status": f"skipped: {n} took over {budget_s:.0f} s"})
                break
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def training(device: torch.device, spec_path: str, batch: int, seq_len: int, steps: int) -> dict:
    spec = archlab.load_spec(spec_path)
    tokens = np.random.default_rng(0).integers(0, spec.vocab_size, 4_000_000).astype(np.uint32)
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "tokens.npy", tokens)
        cfg = TrainConfig.model_validate({
            "steps": steps, "batch_size": batch, "micro_batch_size": batch, "seq_len": seq_len, "log_interval": 1,
            "eval_interval": 10_000, "checkpoint_interval": 10_000, "data": {"source": str(Path(tmp) / "tokens.npy")},
        })
        records = Trainer(spec, cfg, Path(tmp) / "run", console).fit(steps)
    measured = records[len(records) // 2 :]  # past warm-up
    return {
        "spec": spec.name,
        "tokens_per_step": batch * seq_len,
        "tok_s": float(np.median([r["tok_s"] for r in measured])),
        "mfu": float(np.median([r["mfu"] for r in measured])) if "mfu" in measured[0] else None,
        "loss_first_last": [records[0]["loss"], records[-1]["loss"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, to check the script itself")
    parser.add_argument("--budget-s", type=float, default=90.0, help="stop a spec's lengths after one takes longer")
    args = parser.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    folder = ROOT / "specs" / ("tiny" if smoke else "paper")
    names = [str(folder / f"{n}.yaml") for n in ("transformer", "yoco", "yoco-u", "rins")]
    results = {
        "device": device_name(device),
        "torch": torch.__version__,
        "packages": {b: installed(b) for b in ("fla", "mamba_ssm", "flash_attn")},
        "parity": parity(device, torch.float32 if smoke else torch.bfloat16, 64 if smoke else 1024, 64 if smoke else 1024),
        "inference": inference(device, names, [256, 1024] if smoke else [8192, 32768, 65536, 131072, 262144],
                               2 if smoke else 32, 4 if smoke else 128, args.budget_s),
        "training": training(device, str(folder / "yoco-u.yaml"), 4 if smoke else 8, 64 if smoke else 2048, 6 if smoke else 20),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    lines = [f"# GPU check on {results['device']} (torch {results['torch']})", "", "## Parity (relative error, bf16)", ""]
    lines += [f"- {r['block']} / {r['backend']}: {r['status']} " + " ".join(f"{k}={v:.2e}" for k, v in r.items() if k.endswith("rel_err")) for r in results["parity"]]
    lines += ["", "## Inference", "", "| spec | seq_len | prefill tok/s | decode tok/s | KV MB | status |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['spec']} | {r['seq_len']} | {r.get('prefill_tok_s', 0):,.0f} | {r.get('decode_tok_s', 0):,.1f} | {r.get('kv_total_mb', 0):,.1f} | {r['status']} |" for r in results["inference"]]
    t = results["training"]
    lines += ["", "## Training", "", f"{t['spec']}: {t['tok_s']:,.0f} tokens/s, MFU {t['mfu'] if t['mfu'] is None else format(t['mfu'], '.1%')}"]
    (args.out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
