"""What ``archlab build`` checks of a model small enough for the CPU: a finite forward and
backward pass, the analytic costs against the built model and its cache, and decoding token by
token against a full forward pass. The test suite checks the built-in blocks this way; these give
the author of a plugin block the same checks for theirs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from archlab.cost import Cost
from archlab.engine import Engine
from archlab.model import Model

CACHE_CONTEXTS = (1, 17)  # tokens: one, and a few past a typical tiny window
DECODE_TOLERANCE = 1e-4  # of the largest logit, in float32: the built-in blocks agree to about 1e-6


@dataclass
class CpuCheck:
    passes: str  # "fwd+bwd", or "fwd only (...)" where a kernel has no CPU backward
    finite: bool  # logits and gradients
    problems: list[str]  # of the costs and of decoding, looked for only when finite


def cpu_check(model: Model, n: int) -> CpuCheck:
    """A forward and backward pass over 2 x ``n`` random tokens; when finite, the cost formulas
    and decoding (over ``min(n, 48)`` tokens) checked too."""
    forward_only = [f"{block}: {backend}" for block, backend in model.untrainable_kernels("cpu")]
    tokens = torch.randint(0, model.spec.vocab_size, (2, n))
    with torch.set_grad_enabled(not forward_only):
        logits, aux = model(tokens, return_aux=True)
    if not forward_only:
        (logits.float().logsumexp(-1).mean() + aux).backward()
    passes = f"fwd only (no CPU backward for {', '.join(forward_only)})" if forward_only else "fwd+bwd"
    finite = bool(logits.isfinite().all()) and all(p.grad is None or p.grad.isfinite().all() for p in model.parameters())
    if not finite:
        return CpuCheck(passes, False, [])
    problems = cost_problems(model)
    error = decode_error(model, min(n, 48))
    if error > DECODE_TOLERANCE:
        problems.append(f"decoding token by token differs from a full forward pass by {error:.1e} of the largest logit"
                        " (does the module's forward read and update inp.state?)")
    return CpuCheck(passes, True, problems)


def cost_problems(model: Model) -> list[str]:
    """Where the spec's cost formulas disagree with the model: ``params`` with its parameters,
    ``state_bytes`` with the cache the engine makes."""
    cost, problems = Cost(model.spec), []
    built = sum(p.numel() for p in model.parameters())
    if cost.params_total != built:
        problems.append(f"params() sum to {cost.params_total:,}, the built model holds {built:,}")
    engine = Engine(model)
    for context in CACHE_CONTEXTS:
        analytic, held = cost.cache_bytes(context, _dtype_name(engine.dtype)), engine.new_cache(1, context).bytes_per_sequence()
        if analytic != held:
            problems.append(f"state_bytes() give {analytic.total:,} B per sequence at {context} tokens, the cache holds {held.total:,} B")
            break
    return problems


def decode_error(model: Model, length: int) -> float:
    """The largest difference between the logits of a full forward pass over ``length`` random
    tokens and those of prefilling the first half then decoding the rest token by token, as a
    fraction of the largest logit."""
    tokens = torch.randint(0, model.spec.vocab_size, (1, length))
    prompt = max(1, length // 2)
    engine = Engine(model.eval(), prefill_chunk=max(1, prompt // 2))  # two chunks: a chunk boundary is crossed
    with torch.no_grad():
        full = model(tokens)[0]
        cache = engine.new_cache(1, length)
        stepped = [engine.prefill([tokens[0, :prompt]], cache)[0]]
        for position in range(prompt, length):
            stepped.append(engine.decode(tokens[:, position : position + 1], torch.tensor([position]), cache)[0])
    return ((torch.stack(stepped) - full[prompt - 1 :]).abs().max() / full.abs().max().clamp(min=1e-30)).item()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
