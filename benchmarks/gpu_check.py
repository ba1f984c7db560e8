"""Everything a GPU must show, in one run: kernel parity, the paper's inference table, training MFU.

    bash benchmarks/gpu_check.sh OUT_DIR                   # on a CUDA machine (installs the extras)
    python benchmarks/gpu_check.py --smoke --out /tmp/gc   # the same script on the CPU, tiny sizes

1. Parity: every block's kernel backend against its PyTorch backend (same weights, bf16): the
   training forward and input gradients, 16 decoding steps through the recurrent state, and the
   time of a forward and backward pass on each.
   ``window``: the self-decoder's window attention alone at paper sizes, on SDPA over query
   blocks of several sizes and on each kernel backend.
2. Decode graphs: for each paper spec, decoding steps replayed from a captured CUDA graph give the
   eager steps' logits; ``paged``: the same for yoco-u, the graph reading a paged global K,V
   (pages of 256, one handed out during the replays; each page kernel) against eager steps over
   rows.
3. Inference (paper specs transformer, yoco, yoco-u, rins; batch 32, 128 new tokens): prefill and
   decode tokens/s and cache MiB per sequence, length by length until memory or the time budget
   runs out. Long prompts are prefilled for a few rows and their cache copied to the batch.
   ``inference-paged``: yoco-u again with its global K,V in pages of 256, read by each kernel.
4. Training: tokens/s and MFU of the paper-scale yoco-u under bf16 autocast, on SDPA (``training``),
   with the window on fla's kernel (``training-fla``) or both attentions on FlexAttention
   (``training-flex``), with each layer compiled (``training-compiled``, and with the window on
   fla: ``training-fla-compiled``); ``training-profile``:
   where a step's kernel time goes (matmuls, attention, the rest) and its heaviest kernels.
5. ``commands``: archlab's commands end to end on the tiny specs, as a researcher runs them
   (train, under torchrun too, fine-tune on conversations, evaluate, layers, niah, generate over
   rows and pages, chat, curves, a two-trial study): each one's exit status, time and the device
   it trained on.

Results go to OUT/gpu_check.json and OUT/gpu_check.md, rewritten before and after every section,
so a run cut short keeps what it measured; a section's rows land in OUT/running.jsonl as each is
measured, so one cut short keeps its rows too, even when the whole check is killed. A section that
fails records its error (and the rows it measured) and the next one runs.
Each section (parity: each block and backend) runs in a process of its own, killed with what it
started if it outlives its limit: a kernel or compiler hung in native code never returns to
Python for the limit's alarm to stop it, and would hold the rest of the device time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path

import numpy as np
import torch
import yaml
from rich.console import Console

import archlab
from archlab.bench import bench, sync
from archlab.cost import Cost, peak_flops
from archlab.block import BuildContext, MixerInput
from archlab.engine import Engine
from archlab.environment import environment
from archlab.kv import PAGE_KERNELS
from archlab.ops import dispatch
from archlab.ops.dispatch import FLA_GATED_BACKWARD, fla_kernel, installed, runs_on, trains_on
from archlab.table import parse_length
from archlab.train.config import TrainConfig
from archlab.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("parity,window,graphs,paged,training,training-profile,training-fla,training-flex,inference,inference-paged,eager,"
            "training-compiled,training-fla-compiled,commands")  # all of them, in the order they run
console = Console(stderr=True)
TOLERANCE = 3e-2  # relative error of a bf16 kernel against the bf16 PyTorch path (both ~1e-2 from fp64)
KILL_GRACE_S = 20  # past a section's limit, for its own alarm to land and its result to be written
ROWS: Path | None = None  # in a section's process: the file each row is appended to as it is measured

# (block spec, kernel backends to compare with "torch")
PARITY = [
    ({"type": "gdn", "n_heads": 4, "chunk_size": 64}, ["fla"]),
    ({"type": "retnet", "n_heads": 4}, ["fla"]),
    ({"type": "retnet", "n_heads": 4, "gated": True}, ["fla"]),
    ({"type": "mamba2", "d_state": 64, "head_dim": 64}, ["mamba_ssm", "fla"]),  # chunk 256, as the specs: fla now gets it too
    ({"type": "swa", "window": 128, "n_heads": 8, "n_kv_heads": 2}, ["flash_attn", "fla", "flex"]),
    ({"type": "attention", "n_heads": 8, "n_kv_heads": 2}, ["flash_attn", "fla", "flex"]),
]


def emit(row: dict) -> dict:
    """Say ``row`` and append it to ``ROWS`` at once, so that a section cut short by its limit, or
    the whole check killed, still hands over what it measured."""
    console.print(row)
    if ROWS:
        with ROWS.open("a") as rows:
            rows.write(json.dumps(row, default=str) + "\n")
    return row


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def median_ms(run, device: torch.device, repeats: int = 5) -> float:
    run()  # warm-up: kernel compilation and tuning stay out of the time
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@contextmanager
def time_limit(seconds: int):
    """Stop what runs inside after ``seconds`` (a Triton autotune or compile that never ends
    costs one row or section, not the device time of the whole check). Limits nest: an inner
    one ends no later than the one around it, which runs on afterwards."""
    outer_left = signal.alarm(0)  # seconds left to an enclosing limit; 0: none
    limit = min(seconds, outer_left) if outer_left else seconds

    def expire(signum, frame):
        raise TimeoutError(f"no result within {limit} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit)
    began = time.monotonic()
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left:
            signal.alarm(max(1, round(outer_left - (time.monotonic() - began))))


def run_apart(command: list[str], seconds: float) -> str | None:
    """Run ``command`` as a process group of its own; kill the group when it ends or after
    ``seconds``, so nothing it started (compile workers, say) outlives it. Return why it gave no
    result, or None. The group stays in the check's session, so that whatever ends the session
    (the device's time limit) ends the section too, even when the check itself was killed."""
    proc = subprocess.Popen(command, preexec_fn=os.setpgrp)
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return f"killed after {seconds:.0f} s: hung where the section's own limit could not stop it"
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return None if proc.returncode == 0 else f"exited with status {proc.returncode}"


def section_apart(command: list[str], limit_s: float, part: Path, rows: Path) -> tuple[list | dict | None, str | None]:
    """Run one section's ``command`` in a process of its own (``run_apart``), its limit counted
    from now, and return its result and its error: a section that failed, hit its limit or was
    killed gives the rows it measured before, or None."""
    part.unlink(missing_ok=True)
    rows.unlink(missing_ok=True)
    until = time.monotonic() + limit_s
    why = run_apart([*command, "--part", str(part), "--until", str(until), "--rows", str(rows)], limit_s + KILL_GRACE_S)
    outcome = json.loads(part.read_text()) if part.exists() else {"error": why or "it wrote no result"}
    written = rows.read_text().splitlines(keepends=True) if rows.exists() else []
    measured = [json.loads(line) for line in written if line.endswith("\n")]  # not a line cut by the kill
    rows.unlink(missing_ok=True)
    return outcome.get("result", measured or None), outcome.get("error")


def block_label(fields: dict) -> str:
    return fields["type"] + (" gated" if fields.get("gated") else "")


def parity_rows(blocks: str, backends_wanted: str, device: torch.device) -> list[tuple[str, dict]]:
    """Each parity row as (PARITY_INDEX:BACKEND, the row so far), in PARITY's order, for the block
    types in ``blocks`` and the backends in ``backends_wanted`` (all when empty). Backends that
    cannot run here come marked skipped; the others run one per process."""
    wanted, wanted_backends = (set(filter(None, given.split(","))) for given in (blocks, backends_wanted))
    rows = []
    for i, (fields, backends) in enumerate(PARITY):
        if wanted and fields["type"] not in wanted:
            continue
        for backend in backends:
            if wanted_backends and backend not in wanted_backends:
                continue
            row = {"block": block_label(fields), "backend": backend}
            if not installed(backend) or not runs_on(backend, device.type):
                row["status"] = "skipped (not available here)"
            rows.append((f"{i}:{backend}", row))
    return rows


def backward_refused(kernels) -> bool:
    """Whether fla refuses the backward of one of these kernels here (fla #640): their forward and
    decoding can still be measured, with archlab's refusal of the backend lifted."""
    if kernels.backend("cuda") != "fla" or not dispatch.fla_refuses_gated_backward():
        return False
    return any(fla_kernel("fla", op, kernels.table) in FLA_GATED_BACKWARD for op in kernels.ops)


def parity(device: torch.device, dtype: torch.dtype, d_model: int, n: int, which: str, row_limit_s: int) -> list[dict]:
    """One parity row (``which``: PARITY_INDEX:BACKEND): a block's kernel backend against its
    PyTorch backend with the same weights, in the forward pass, input gradients and 16 decoding
    steps, and a forward and backward pass's time on each. Where fla refuses a kernel's backward
    here, the row still gives its forward and decoding."""
    from archlab.spec import _resolve_blocks, block_specs

    _resolve_blocks()
    index, backend = which.split(":")
    fields = PARITY[int(index)][0]
    row = {"block": block_label(fields), "backend": backend}
    spec_class = block_specs()[fields["type"]]
    ctx = BuildContext(d_model=d_model, rope_theta=10_000.0)
    torch.manual_seed(0)
    reference = spec_class.model_validate({**fields, "backend": "torch"}).build(ctx).to(device, dtype)
    x = torch.randn(2, n, d_model, device=device, dtype=dtype, requires_grad=True)
    causal = MixerInput(torch.arange(n, device=device)[None], causal=True)
    kernel = spec_class.model_validate({**fields, "backend": backend}).build(ctx).to(device, dtype)
    kernel.load_state_dict(reference.state_dict())
    forward_only = not trains_on(backend, device.type)  # FlexAttention has no CPU backward
    if device.type == "cuda" and backward_refused(kernel.kernels):
        dispatch.fla_refuses_gated_backward = lambda: False  # this process measures the forward alone
        forward_only, row["grad"] = True, "refused by fla (#640)"
    console.print(f"{row['block']} / {backend} ...")
    try:
        with time_limit(row_limit_s):
            ref_out = reference(x, causal)
            with torch.no_grad() if forward_only else nullcontext():
                out = kernel(x, causal)
            row["forward_rel_err"] = relative_error(out, ref_out)
            if not forward_only:
                grad_out = torch.randn_like(ref_out)  # given, so that no loss's own kernels are timed
                (ref_grad,) = torch.autograd.grad(ref_out, x, grad_out)
                (grad,) = torch.autograd.grad(out, x, grad_out)
                row["grad_rel_err"] = relative_error(grad, ref_grad)
                row["torch_ms"] = median_ms(lambda: reference(x, causal).backward(grad_out), device)
                row["kernel_ms"] = median_ms(lambda: kernel(x, causal).backward(grad_out), device)
            if set(kernel.kernels.ops) - {"causal_attention"}:  # attention's kernels run whole sequences; both decode on SDPA
                row["decode_rel_err"] = decode_parity(reference, kernel, x.detach(), device)
        worst = max(v for k, v in row.items() if k.endswith("rel_err"))
        row["status"] = "ok" if worst < TOLERANCE else "MISMATCH"
    except Exception as exc:  # a kernel that cannot run is a finding, not a crash of the check
        row["status"] = f"error: {type(exc).__name__}: {exc}"[:300]
    return [emit(row)]


def window_kernels(device: torch.device, dtype: torch.dtype, spec_path: str, batch: int, n: int, row_limit_s: int) -> list[dict]:
    """The self-decoder's window attention of a spec alone, forward and backward, on every path that
    computes it: SDPA over query blocks of several sizes (the PyTorch backend's default is W,
    computing about twice the pairs the windows need), and the kernel backends. SDPA's causal flash
    kernel over the whole sequence gives the scale. TFLOP/s count the pairs the windows need, fwd + bwd."""
    from archlab.ops.attention import ATTENTION_KERNELS, attend, attention_pairs, causal_kernels, local_attend

    spec = archlab.load_spec(spec_path)
    block = spec.layout.self_decoder.blocks[0]
    window, (heads, kv_heads, dim) = block.window, block.shape(spec.d_model)
    torch.manual_seed(0)
    q = torch.randn(batch, n, heads, dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, n, kv_heads, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    positions = torch.arange(n, device=device)[None]
    default = max(window, 64)
    paths = {f"sdpa, blocks of {b}" + (" (default)" if b == default else ""):
             (lambda b: lambda: local_attend(q, k, v, positions, positions, window, block=b))(b)
             for b in sorted({default, 64, 128, 256}, key=lambda b: (b != default, b))}
    paths.update({backend: (lambda f: lambda: f(q, k, v, positions, window))(causal_kernels("swa", backend)(device)["causal_attention"])
                  for backend in ATTENTION_KERNELS
                  if installed(backend) and trains_on(backend, device.type)})
    paths["sdpa flash, whole causal (scale)"] = lambda: attend(q, k, v, None)

    grad_out = torch.randn_like(q)  # given, so that no loss's own kernels are timed

    def grads(out):
        return torch.autograd.grad(out, (q, k, v), grad_out)

    reference = None  # the default path's output and gradients, from its own row (the first)
    rows = []
    for name, run in paths.items():
        row = {"path": name}
        windowed = "whole" not in name
        pairs = attention_pairs(n, 0, window if windowed else None)
        try:
            with time_limit(row_limit_s):
                if windowed:
                    out = run()
                    results = (out, *grads(out))
                    reference = reference or results
                    row["rel_err"] = max(relative_error(a, b) for a, b in zip(results, reference))
                row["ms"] = median_ms(lambda: grads(run()), device)
            row["tflops"] = 3 * 4 * pairs * heads * dim * batch / (row["ms"] / 1e3) / 1e12
            row["status"] = "ok" if row.get("rel_err", 0.0) < TOLERANCE else "MISMATCH"
        except Exception as exc:
            row["status"] = f"error: {type(exc).__name__}: {exc}"[:300]
        rows.append(emit(row))
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


def load(name: str, device: torch.device) -> archlab.Model:
    spec = archlab.load_spec(name)
    torch.manual_seed(0)
    return archlab.build_model(spec, device=device, dtype=getattr(torch, spec.inference_dtype)).eval()


@torch.no_grad()
def same_choice(a: torch.Tensor, b: torch.Tensor, tolerance: float = 1e-2) -> bool:
    """Whether greedy decoding picks the same token from logits ``a`` and ``b`` [rows, V] in every
    row where ``a``'s top two stand apart by more than ``tolerance`` of its largest: a nearer tie
    either may win (bf16 rounds a logit by 4e-3 of it, and 100K random ones hold such ties), which
    is no mismatch of the paths; their logits are compared to the same tolerance beside it."""
    top = a.float().topk(2, dim=-1).values
    tied = top[:, 0] - top[:, 1] <= tolerance * a.float().abs().amax(-1)
    return bool(((a.argmax(-1) == b.argmax(-1)) | tied).all())


def graph_parity(device: torch.device, specs: list[str], context: int = 4093, steps: int = 8,
                 page_size: int | None = None, page_kernel: str = "torch") -> list[dict]:
    """Greedy decoding, eager over rows against CUDA-graph replay (over pages, with
    ``page_size``), from the same prompts. The steps cross position 4096."""
    rows = []
    for name in specs:
        model = load(name, device)
        row = {"spec": model.spec.name, "context": context, "steps": steps, "page_size": page_size,
               "page_kernel": page_kernel if page_size else None}
        try:
            eager, graphed = Engine(model), Engine(model, cuda_graph=True, page_size=page_size, page_kernel=page_kernel)
            prompt = [torch.randint(0, model.spec.vocab_size, (context,), device=device) for _ in range(2)]
            first = eager.new_cache(2, context + steps)
            logits = eager.prefill(prompt, first)
            second = graphed.new_cache(2, context + steps)
            graphed.prefill(prompt, second)
            worst, same = 0.0, True
            tokens = logits.argmax(-1)
            for i in range(steps):
                start = torch.full((2,), context + i, device=device)
                a, b = eager.decode(tokens[:, None], start, first), graphed.decode(tokens[:, None], start, second)
                worst = max(worst, relative_error(b, a))
                same &= same_choice(a, b)
                tokens = a.argmax(-1)
            second.check()
            row.update(logits_rel_err=worst, same_tokens=same, status="ok" if worst < 1e-2 and same else "MISMATCH")
        except TimeoutError:  # the section's limit: no row of its own, and none after it unbounded
            raise
        except Exception as exc:
            row["status"] = f"error: {type(exc).__name__}: {exc}"[:300]
        rows.append(emit(row))
        del model
        torch.cuda.empty_cache()
    return rows


def inference(device: torch.device, specs: list[str], lengths: list[int], batch: int, gen: int, budget_s: float,
              deadline: float, prefill_tokens: int, cuda_graph: bool, prefill_chunk: int,
              page_size: int | None = None, page_kernel: str = "torch") -> list[dict]:
    rows, paging = [], {"page_size": page_size, "page_kernel": page_kernel}  # every row says its layout, skipped ones too
    for name in specs:
        if time.monotonic() > deadline:  # before loading and warming up a model that would measure nothing
            rows.append(emit({"spec": Path(name).stem, "seq_len": lengths[0], **paging, "status": "skipped: out of time"}))
            continue
        model = load(name, device)
        bench(model, model.spec.name, 256, 2, 2, cuda_graph=cuda_graph, page_size=page_size, page_kernel=page_kernel)  # warm-up: kernels, tuning, allocator
        for n in lengths:
            if time.monotonic() > deadline:
                rows.append(emit({"spec": model.spec.name, "seq_len": n, **paging, "status": "skipped: out of time"}))
                break
            prefill_rows = batch
            while prefill_rows > 1 and prefill_rows * n > prefill_tokens:
                prefill_rows //= 2
            began = time.perf_counter()
            try:
                row = bench(model, model.spec.name, n, batch, gen, prefill_chunk, prefill_rows=prefill_rows,
                            cuda_graph=cuda_graph, page_size=page_size, page_kernel=page_kernel).as_dict()
            except torch.OutOfMemoryError:
                rows.append(emit({"spec": model.spec.name, "seq_len": n, "batch": batch, **paging, "status": "out of memory"}))
                torch.cuda.empty_cache()
                break
            rows.append(emit({**row, "prefill_chunk": prefill_chunk, "status": "ok", "seconds": time.perf_counter() - began}))
            if time.perf_counter() - began > budget_s:
                rows.append(emit({"spec": model.spec.name, "seq_len": "longer", **paging, "status": f"skipped: {n} took over {budget_s:.0f} s"}))
                break
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


class Measured(Exception):
    """Raised after a training section's last step: its figures are in, and the run's closing
    evaluation and checkpoint (15 GB at paper scale, with the optimizer) are no part of the check."""


def training(device: torch.device, spec_path: str, batch: int, seq_len: int, steps: int, overrides: list[str] = (),
             compile: bool = False, profile_steps: int = 0, micro_batch: int | None = None) -> dict:
    """Tokens/s and MFU of the trainer, past its first half of steps, its batch in passes of
    ``micro_batch`` sequences (all at once by default). With ``profile_steps``, the last that many
    steps run under the profiler, and the result says where their time went."""
    spec = archlab.load_spec(spec_path, overrides)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # this section's peak, not an earlier one's
    tokens = np.random.default_rng(0).integers(0, spec.vocab_size, 4_000_000).astype(np.uint32)
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    profiler = torch.profiler.profile(
        activities=activities, schedule=torch.profiler.schedule(wait=steps - profile_steps - 1, warmup=1, active=profile_steps)
    ) if profile_steps else nullcontext()
    with tempfile.TemporaryDirectory() as tmp, profiler:
        np.save(Path(tmp) / "tokens.npy", tokens)
        cfg = TrainConfig.model_validate({
            "steps": steps, "batch_size": batch, "micro_batch_size": micro_batch or batch, "seq_len": seq_len, "log_interval": 1,
            "eval_interval": 10_000, "checkpoint_interval": 10_000, "data": {"source": str(Path(tmp) / "tokens.npy")},
            "compile": compile,
        })
        records = []

        def on_step(done: int, record: dict) -> None:
            records.append(record)
            if profile_steps:
                profiler.step()
            if done == steps:
                raise Measured

        with suppress(Measured):
            Trainer(spec, cfg, Path(tmp) / "run", console).fit(steps, on_step=on_step)
    measured = records[len(records) // 2 :]  # past warm-up
    result = {
        "spec": spec.name,
        "overrides": list(overrides),
        "compile": compile,
        "tokens_per_step": batch * seq_len,
        "micro_batch": micro_batch or batch,
        "tok_s": float(np.median([r["tok_s"] for r in measured])),
        "mfu": float(np.median([r["mfu"] for r in measured])) if "mfu" in measured[0] else None,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "loss_first_last": [records[0]["loss"], records[-1]["loss"]],
    }
    if profile_steps:
        flops = Cost(spec).train_flops_per_token(seq_len) * batch * seq_len
        result.update(where_time_went(profiler, profile_steps, flops, device))
    return result


TRAINING = ("training", "training-flex", "training-fla", "training-compiled", "training-fla-compiled")
KINDS = {  # fragments of op (CPU) or kernel (CUDA) names -> what the time went to; first match wins
    "attention": ("attention", "attn", "flash", "fmha", "flex"),
    "matmul": ("mm", "matmul", "linear", "gemm", "xmma", "nvjet"),
}


def kind_of(op: str) -> str:
    name = op.removeprefix("aten::").lower()
    return next((kind for kind, parts in KINDS.items() if any(p in name for p in parts)), "other")


def where_time_went(profiler, steps: int, flops_per_step: int, device: torch.device) -> dict:
    """The time of each CUDA kernel (of each op, on the CPU) per profiled step, summed into
    matmuls, attention and the rest, the heaviest, and the MFU over that time alone."""
    cuda = device.type == "cuda"
    ms = {}
    for op in profiler.key_averages():  # on CUDA the kernels alone: an op's row repeats its kernels' time
        if (op.device_type == torch.autograd.DeviceType.CUDA) == cuda:
            spent = (op.self_device_time_total if cuda else op.self_cpu_time_total) / 1e3 / steps
            if spent > 0:
                ms[op.key] = ms.get(op.key, 0.0) + spent
    total = sum(ms.values())
    if not total:
        raise RuntimeError("the profiler recorded no kernel times")
    by_kind = {kind: sum(t for op, t in ms.items() if kind_of(op) == kind) for kind in (*KINDS, "other")}
    peak = peak_flops(torch.cuda.get_device_name(device)) if cuda else None
    return {
        "ms_per_step": total,
        "mfu_of_device_time": flops_per_step / (total / 1e3) / peak if peak else None,
        "share": {kind: t / total for kind, t in by_kind.items()},
        "top": sorted(ms.items(), key=lambda item: -item[1])[:15],
    }


def layout(row: dict) -> str:
    return "rows" if row.get("page_size") is None else f"pages of {row['page_size']}, {row['page_kernel']}"


CHAT = "Write the body of this function.\ndef double(x):\n\nAnd another.\n"  # the messages chat reads; the rest read nothing


def command_lines(tmp: Path, steps: int) -> list[tuple[str, list[str], Path | None]]:
    """The commands ``commands`` runs in ``tmp``, in order: (name, argv, the run it trains or None)."""
    run, tuned, examples, study = tmp / "run", tmp / "tuned", tmp / "functions.jsonl", tmp / "study.yaml"
    study.write_text(json.dumps({  # JSON is YAML
        "schema_version": 1, "name": "gpu-check", "baseline": "yoco", "seeds": [0], "lr": {"low": 0.003, "high": 0.003, "points": 1},
        "variants": {"yoco": {"spec": "yoco.yaml"}, "yoco-u": {"spec": "yoco-u.yaml"}},
        "scales": {"tiny": {"specs": str(ROOT / "specs" / "tiny"), "train": {
            "steps": steps, "eval_interval": steps // 2, "checkpoint_interval": steps, "data": {"max_bytes": 1_000_000}}}}}))
    yoco_u = str(ROOT / "specs" / "tiny" / "yoco-u.yaml")
    train = ["--steps", str(steps), "--set", f"eval_interval={steps // 2}", "--set", f"checkpoint_interval={steps // 2}",
             "--set", "data.max_bytes=1000000"]
    cli = [sys.executable, "-m", "archlab"]
    return [
        ("train", [*cli, "train", yoco_u, "--out", str(run), *train], run),
        ("torchrun", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "archlab", "train",
                      yoco_u, "--out", str(tmp / "ddp"), *train], tmp / "ddp"),
        ("examples", [sys.executable, str(ROOT / "docs" / "examples" / "stdlib_functions.py"), str(examples), "--skip-chars", "10000000",
                      "--chat"], None),
        ("fine-tune", [*cli, "train", str(run), "--init", str(run), "--data", str(examples), "--steps", str(steps // 2),
                       "--out", str(tuned), "--set", f"eval_interval={steps // 4}"], tuned),
        ("evaluate", [*cli, "evaluate", str(run), "--seq-len", "64", "128", "--last", "32"], None),
        ("evaluate examples", [*cli, "evaluate", str(tuned), "--seq-len", "64", "128", "--last", "16"], None),
        ("layers", [*cli, "layers", str(run)], None),
        ("niah", [*cli, "niah", str(run), "--seq-len", "512", "1024", "--depths", "2", "--sequences", "2"], None),
        ("generate", [*cli, "generate", str(run), "--prompt", "def ", "--max-new-tokens", "32"], None),
        ("generate paged", [*cli, "generate", str(run), "--prompt", "def ", "--max-new-tokens", "32", "--page-size", "16"], None),
        ("chat", [*cli, "chat", str(tuned), "--max-new-tokens", "32"], None),  # two messages, from CHAT
        ("curves", [*cli, "curves", str(run), str(tuned)], None),
        ("study", [*cli, "study", "run", str(study), "--out", str(tmp / "study")], None),
    ]


def commands(smoke: bool) -> list[dict]:
    """archlab's commands end to end, as a researcher runs them on this machine: pretrain a tiny
    YOCO-U (on one process and under torchrun), fine-tune it on conversations, score it, generate
    from it (over rows and over pages), chat with the fine-tuned run, and a study of two trials.
    Each row: the command, its exit status, seconds, the device its run trained on, and its last
    line of output."""
    with tempfile.TemporaryDirectory() as tmp:
        listed = command_lines(Path(tmp), 4 if smoke else 60)
        rows = []
        for name, command, trained in listed:
            began = time.perf_counter()
            done = subprocess.run(command, input=CHAT, capture_output=True, text=True, cwd=tmp)
            said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
            row = {"command": name, "exit": done.returncode, "seconds": time.perf_counter() - began, "last": said[-1][:160] if said else ""}
            if trained is not None and (trained / "environment.yaml").is_file():
                row["device"] = yaml.safe_load((trained / "environment.yaml").read_text())[-1].get("device", "?")  # its latest setting
            if done.returncode:
                console.print(f"{name} exited {done.returncode}:\n" + "\n".join(said[-20:]), markup=False, highlight=False)
            rows.append(emit(row))
    return rows


def report(results: dict) -> str:
    setting = results["environment"]
    lines = [f"# GPU check on {setting['device']}", "", *(f"- {name}: {value}" for name, value in setting.items() if name != "device")]
    if "parity" in results:
        lines += ["", f"## Kernel parity (relative error against the PyTorch backend, {results['parity_dtype']}; ok below {TOLERANCE})", "",
                  "| block | backend | forward | input grad | 16 decode steps | fwd+bwd ms torch | fwd+bwd ms kernel | status |",
                  "|---|---|---|---|---|---|---|---|"]
        cell = lambda r, k, f: format(r[k], f) if k in r else "-"  # noqa: E731
        lines += [f"| {r['block']} | {r['backend']} | {cell(r, 'forward_rel_err', '.1e')} | {r.get('grad') or cell(r, 'grad_rel_err', '.1e')} | "
                  f"{cell(r, 'decode_rel_err', '.1e')} | {cell(r, 'torch_ms', '.1f')} | {cell(r, 'kernel_ms', '.1f')} | {r['status']} |"
                  for r in results["parity"]]
    if "window" in results:
        lines += ["", "## The self-decoder's window attention alone, forward and backward", "",
                  "TFLOP/s count the pairs the windows need, the backward as twice the forward (FlashAttention's"
                  " own figures count it as 2.5 times, which reads 1.17x higher).", "",
                  "| path | rel err | ms | TFLOP/s of the needed pairs | status |", "|---|---|---|---|---|"]
        lines += [f"| {r['path']} | {format(r['rel_err'], '.1e') if 'rel_err' in r else '-'} | {format(r['ms'], '.2f') if 'ms' in r else '-'} | "
                  f"{format(r['tflops'], '.3g') if 'tflops' in r else '-'} | {r['status']} |" for r in results["window"]]
    graphed = [r for key in ("graphs", "paged") for r in results.get(key, [])]
    if graphed:
        lines += ["", "## Decoding from a captured CUDA graph against eager decoding over rows", "",
                  "| spec | graph's global K,V | context | steps | logits rel err | same tokens | status |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['spec']} | {layout(r)} | {r['context']} | "
                  f"{r['steps']} | {r.get('logits_rel_err', float('nan')):.1e} | {r.get('same_tokens', '-')} | {r['status']} |"
                  for r in graphed]
    for key, title in (("inference", "Inference"), ("inference_eager", "Inference, eager decoding (no CUDA graph)"),
                       ("inference_paged", "Inference, the global K,V in pages")):
        if key in results:
            lines += ["", f"## {title}", "", "| spec | seq_len | batch | prefill rows | prefill chunk | global K,V | prefill tok/s | decode tok/s"
                      " | KV MiB / seq | peak GiB over the weights | status |", "|---|---|---|---|---|---|---|---|---|---|---|"]
            figure = lambda r, k, f, scale=1: format(r[k] * scale, f) if k in r else "-"  # noqa: E731
            lines += [f"| {r['spec']} | {r['seq_len']} | {r.get('batch', '')} | {r.get('prefill_rows', '')} | {r.get('prefill_chunk', '')} | "
                      f"{layout(r)} | {figure(r, 'prefill_tok_s', ',.0f')} | {figure(r, 'decode_tok_s', ',.0f')} | "
                      f"{figure(r, 'kv_total_mb', ',.1f')} | {figure(r, 'peak_mb', ',.1f', 1 / 1024)} | {r['status']} |"
                      for r in results[key]]
    trained = [results[k] for k in TRAINING if k in results]
    if trained:
        precision = "fp32, the CPU's smoke run" if results.get("parity_dtype") == "float32" else "bf16 autocast"
        lines += ["", f"## Training ({precision})", "", "| spec | overrides | compiled | tokens/step | micro-batch | tokens/s | MFU | peak GiB | loss first -> last |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {t['spec']} | {' '.join(t['overrides']) or '-'} | {t['compile']} | {t['tokens_per_step']:,} | {t.get('micro_batch', '-')} | {t['tok_s']:,.0f} | "
                  f"{'n/a' if t['mfu'] is None else format(t['mfu'], '.1%')} | {t['peak_gib'] or 0:.1f} | "
                  f"{t['loss_first_last'][0]:.3f} -> {t['loss_first_last'][1]:.3f} |" for t in trained]
    if "training_profile" in results:
        prof = results["training_profile"]
        mfu = "n/a" if prof["mfu_of_device_time"] is None else format(prof["mfu_of_device_time"], ".1%")
        lines += ["", f"## Where a training step's time goes ({prof['spec']}, {prof['tokens_per_step']:,} tokens per step)", "",
                  f"{prof['ms_per_step']:,.1f} ms of op time per step (MFU over that time alone: {mfu}); "
                  + ", ".join(f"{kind} {share:.0%}" for kind, share in prof["share"].items()), "",
                  "| op or kernel | ms per step | kind |", "|---|---|---|"]
        lines += [f"| {op[:90]} | {t:,.2f} | {kind_of(op)} |" for op, t in prof["top"]]
    if "commands" in results:
        lines += ["", "## archlab's commands end to end (tiny specs)", "", "| command | exit | seconds | trained on | last line |", "|---|---|---|---|---|"]
        lines += [f"| {r['command']} | {r['exit']} | {r['seconds']:.1f} | {r.get('device', '-')} | {r['last'].replace('|', '/')} |"
                  for r in results["commands"]]
    for name, error in results.get("errors", {}).items():
        lines += ["", f"## {name}: failed", "", "```", error.strip()[-3000:], "```"]
    if "running" in results:
        lines += ["", f"## Cut short while running {results['running']}", "",
                  "The rows it measured before the check was killed, if any, are in running.jsonl beside this report (no such file: none)."]
    return "\n".join(lines) + "\n"


def token_counts(parser: argparse.ArgumentParser, option: str, text: str) -> list[int]:
    """Comma-separated token counts as ``archlab bench --seq-len`` reads them (8192, 8K); a bad one
    ends the check before it starts."""
    counts = []
    for item in text.split(","):
        try:
            counts.append(parse_length(item))
        except ValueError:
            parser.error(f"{option}: {item!r} is not a count of tokens (8192, 8K)")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, to check the script itself")
    parser.add_argument("--budget-s", type=float, default=60.0, help="stop a spec's lengths after one takes longer")
    parser.add_argument("--deadline-s", type=float, default=300.0, help="start no new length after this many seconds of an inference"
                        " section")
    parser.add_argument("--sections", default=SECTIONS)
    parser.add_argument("--blocks", default="", help="parity of these block types only (comma-separated)")
    parser.add_argument("--backends", default="", help="parity of these kernel backends only (comma-separated)")
    parser.add_argument("--specs", default="transformer,yoco,yoco-u,rins")
    parser.add_argument("--lengths", default="8192,32768,65536,131072,262144", help="prompt lengths, comma-separated (8192 or 8K)")
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--train-micro-batch", type=int, help="sequences per pass in training (the whole batch unless given;"
                        " 4 fits batch 8 x 2,048 in an H100's 80 GB, where 8 at once peaked at 93 GiB on the H200)")
    parser.add_argument("--train-seq-len", type=int, default=2048, help="tokens per sequence in training (the paper pretrains at 8,192)")
    parser.add_argument("--row-limit-s", type=int, default=150, help="give up on a parity row after this many seconds")
    parser.add_argument("--section-limit-s", type=int, default=420, help="give up on a section after this many seconds")
    parser.add_argument("--part", type=Path, help=argparse.SUPPRESS)  # run the one section named, write its outcome here
    parser.add_argument("--row", help=argparse.SUPPRESS)  # with --part: the parity row, as PARITY_INDEX:BACKEND
    parser.add_argument("--until", type=float, help=argparse.SUPPRESS)  # with --part: when the section's limit ends
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)  # with --part: where each row goes as it is measured
    args = parser.parse_args()
    began = time.monotonic()
    if not args.smoke and not torch.cuda.is_available():  # else tiny CPU sizes would be reported as the GPU's
        parser.error("no CUDA device is usable here (torch.cuda.is_available() is False); --smoke checks the script on the CPU")
    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    folder = ROOT / "specs" / ("tiny" if smoke else "paper")
    names = [str(folder / f"{n}.yaml") for n in args.specs.split(",")]
    batch, gen = (2, 4) if smoke else (32, 128)
    lengths = [256, 1024] if smoke else token_counts(parser, "--lengths", args.lengths)
    chunk = 64 if smoke else args.prefill_chunk
    yoco_u = str(folder / "yoco-u.yaml")
    train = dict(batch=4, seq_len=64, steps=6) if smoke else dict(batch=args.train_batch, seq_len=args.train_seq_len, steps=16)
    train["micro_batch"] = args.train_micro_batch
    flex = ["layout.self_decoder.blocks.0.backend=flex", "layout.cross_decoder.blocks.0.backend=flex"]
    fla_window = ["layout.self_decoder.blocks.0.backend=fla"]  # the cross-decoder's full causal attention stays on SDPA's flash kernel
    sections = {
        "parity": lambda: parity(device, torch.float32 if smoke else torch.bfloat16, 64 if smoke else 1024, 64 if smoke else 2048,
                                 args.row, args.row_limit_s),
        "window": lambda: window_kernels(device, torch.float32 if smoke else torch.bfloat16, yoco_u, train["batch"], train["seq_len"],
                                         args.row_limit_s),
        "graphs": lambda: graph_parity(device, names),
        "paged": lambda: [row for kernel in PAGE_KERNELS for row in graph_parity(device, [yoco_u], page_size=256, page_kernel=kernel)],
        # the deadline counts from the section's start: from the check's, the sections before it had spent it all
        "inference": lambda: inference(device, names, lengths, batch, gen, args.budget_s, time.monotonic() + args.deadline_s,
                                       512 if smoke else 65536, not smoke, chunk),
        "inference-paged": lambda: [row for kernel in PAGE_KERNELS for row in inference(
            device, [yoco_u], lengths, batch, gen, args.budget_s, time.monotonic() + args.deadline_s, 512 if smoke else 65536,
            not smoke, chunk, page_size=16 if smoke else 256, page_kernel=kernel)],
        "eager": lambda: inference(device, names, lengths[:1], batch, gen, args.budget_s, math.inf,  # one length: its section's limit bounds it
                                   512 if smoke else 65536, False, chunk),
        "training": lambda: training(device, yoco_u, **train),
        "training-flex": lambda: training(device, yoco_u, **train, overrides=flex),
        "training-fla": lambda: training(device, yoco_u, **train, overrides=fla_window),
        "training-compiled": lambda: training(device, yoco_u, **train, compile=True),
        "training-fla-compiled": lambda: training(device, yoco_u, **train, overrides=fla_window, compile=True),
        "training-profile": lambda: training(device, yoco_u, **{**train, "steps": 4}, profile_steps=2),
        "commands": lambda: commands(smoke),
    }
    for option, given, known in (("--sections", args.sections, sections), ("--blocks", args.blocks, {f["type"] for f, _ in PARITY}),
                                 ("--backends", args.backends, {b for _, backends in PARITY for b in backends}),
                                 ("--specs", args.specs, {p.stem for p in (ROOT / "specs" / "paper").glob("*.yaml")})):
        if unknown := set(filter(None, given.split(","))) - set(known):
            parser.error(f"{option}: unknown {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
    if not any(args.sections.split(",")):
        parser.error(f"--sections: none given; known: {', '.join(SECTIONS.split(','))}")
    if args.part:  # one section, in the process the whole check started for it
        global ROWS
        ROWS = args.rows
        try:  # the limit counts from the section's start, its imports and CUDA's included, as the kill does
            with time_limit(max(1, math.floor(args.until - time.monotonic()))):
                outcome = {"result": sections[args.sections]()}
        except Exception:
            outcome = {"error": traceback.format_exc()}
        args.part.write_text(json.dumps(outcome, default=str))
        if "error" in outcome:
            console.print(outcome["error"], markup=False, highlight=False)  # a traceback's [brackets] are not markup
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # unwinds run_apart: its section goes too
    results = {
        "environment": environment(device),  # on a GPU, with the kernel packages' versions
        "parity_dtype": "float32" if smoke else "bfloat16",
        "errors": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    measured = args.out / "running.jsonl"  # the running section's rows; left behind only by a check killed in it

    def write() -> None:
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
        (args.out / "gpu_check.md").write_text(report(results))

    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "section.json"
        for name in filter(None, args.sections.split(",")):
            if smoke and name in ("graphs", "paged", "training-flex", "training-fla", "training-compiled", "training-fla-compiled"):
                continue  # CUDA graphs and fla need CUDA; FlexAttention has no CPU backward; compiling is slow on 2 cores
            key = {"eager": "inference_eager", "inference-paged": "inference_paged", "training-profile": "training_profile"}.get(name, name)
            units = [(f"{name} ({row['block']}, {row['backend']})", ["--row", which], row)
                     for which, row in parity_rows(args.blocks, args.backends, device)] if name == "parity" else [(name, [], None)]
            for label, extra, row in units:
                if row and "status" in row:  # a parity row whose backend cannot run here
                    results.setdefault(key, []).append(row)
                    continue
                results["running"] = f"{label}, from {time.monotonic() - began:.0f} s into the check"
                console.rule(results["running"])
                write()
                limit = args.row_limit_s if name == "parity" else args.section_limit_s
                command = [sys.executable, __file__, *sys.argv[1:], "--sections", name, *extra]
                result, error = section_apart(command, limit, part, measured)
                if error:
                    results["errors"][label] = error
                if name == "parity" and result:
                    results.setdefault(key, []).extend(result)
                elif result:
                    results[key] = result
                del results["running"]
                write()
    print(report(results))
    print(f"total {time.monotonic() - began:.0f} s")
    if results["errors"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
