"""What ``archlab build`` checks of a model small enough for the CPU: a finite forward and
backward pass, the analytic costs against the built model and its cache, and decoding a batch
of two prompts token by token against full forward passes. The test suite checks the built-in blocks this way; these give
the author of a plugin block the same checks for theirs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from archlab.block import FLOP_KINDS, Flops
from archlab.cache import Cache
from archlab.cost import Cost
from archlab.engine import Engine
from archlab.model import Model
from archlab.registry import RegistryError

CACHE_CONTEXTS = (1, 17)  # tokens: one, and a few past a typical tiny window
DECODE_LENGTH = 24  # tokens, at least: prompts of 12 and 9 in chunks of 4, then 12 decoding steps
DECODE_TOLERANCE = 1e-4  # of the largest logit, in float32: the built-in blocks agree to about 1e-6


@dataclass
class CpuCheck:
    passes: str  # "fwd+bwd", or "fwd only (...)" where a kernel has no CPU backward
    finite: bool  # logits and gradients
    problems: list[str]  # of the costs and of decoding, looked for only when finite


def cpu_check(model: Model, n: int) -> CpuCheck:
    """A forward and backward pass over 2 x ``n`` random tokens; when finite, the cost formulas
    and decoding (two sequences of ``min(n, 48)`` tokens, 24 at least) checked too."""
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
    problems = flops_problems(model)
    try:
        problems += cost_problems(model) + decode_problems(model, max(min(n, 48), DECODE_LENGTH))
    except RegistryError as exc:  # a module's state the cache cannot hold
        problems.append(str(exc))
    return CpuCheck(passes, True, problems)


def decode_problems(model: Model, length: int) -> list[str]:
    """What decoding two prompts of different lengths shows: an error, or logits other than a
    full forward pass's (see ``decode_error``)."""
    blocks = ", ".join(dict.fromkeys(model.spec.block_at(i).type for i in range(model.spec.n_layers)))
    try:
        error = decode_error(model, length)
    except RegistryError:
        raise
    except Exception as exc:  # a plugin's forward that breaks on a batch of rows: said with the blocks it may be
        return [f"decoding two prompts of different lengths raised {type(exc).__name__}: {exc} (blocks: {blocks})"]
    if error <= DECODE_TOLERANCE:
        return []
    return [f"decoding two prompts of different lengths token by token differs from a full forward pass by {error:.1e} of"
            f" the largest logit (blocks: {blocks}; does each module's forward read and update inp.state, each row at its"
            " own inp.positions?)"]


def flops_problems(model: Model) -> list[str]:
    """Each block's ``flops()`` over a sequence and a decoding step: a ``Flops`` of the named
    kinds, in whole non-negative counts (else the cost table fails, or miscounts, later)."""
    spec, problems = model.spec, {}
    for layer in range(spec.n_layers):
        block, ctx = spec.block_at(layer), spec.build_context(model.plan.half_of(layer))
        for n, start in ((17, 0), (1, 16)):
            try:
                counted = block.flops(ctx, n, start, False)
            except Exception as exc:
                problems.setdefault(block.type, f"{block.type}: flops(ctx, n={n}, start={start}) raised {type(exc).__name__}: {exc}")
                continue
            if not (isinstance(counted, Flops) and counted.keys() <= FLOP_KINDS.keys()
                    and all(isinstance(v, int) and v >= 0 for v in counted.values())):
                problems.setdefault(block.type, f"{block.type}: flops() must return a Flops (a Counter) of kinds"
                                                f" {sorted(FLOP_KINDS)} to whole counts of 0 or more, got {counted!r}")
    return list(problems.values())


def cost_problems(model: Model) -> list[str]:
    """Where the spec's cost formulas disagree with the model: ``params`` with its parameters,
    ``state_bytes`` with the cache the engine makes, in the model's dtype and the spec's
    inference dtype (a block may keep some state in the one and some in float32)."""
    cost, problems = Cost(model.spec), []
    built = sum(p.numel() for p in model.parameters())
    if cost.params_total != built:
        problems.append(f"params() sum to {cost.params_total:,}, the built model holds {built:,}")
    dtypes = dict.fromkeys([_dtype_name(next(model.parameters()).dtype), model.spec.inference_dtype])
    for dtype, context in ((dtype, context) for dtype in dtypes for context in CACHE_CONTEXTS):
        analytic, held = cost.cache_bytes(context, dtype), Cache(model, 1, context, getattr(torch, dtype)).bytes_per_sequence()
        if analytic != held:
            problems.append(f"state_bytes() give {analytic.total:,} B per sequence at {context} tokens in {dtype}, the cache"
                            f" holds {held.total:,} B")
            break
    return problems


def decode_error(model: Model, length: int) -> float:
    """The largest difference between the logits of full forward passes over two sequences of
    ``length`` random tokens and those of prefilling prompts of two lengths (in chunks, so that
    a chunk boundary is crossed) then decoding both rows together token by token, each at its
    own position, as a fraction of the largest logit. Two rows of different lengths find a
    state that is not batch-first, or a forward that reads one row's positions for all."""
    tokens = torch.randint(0, model.spec.vocab_size, (2, length))
    prompts = torch.tensor([length // 2, length // 2 - 3])
    engine = Engine(model.eval(), prefill_chunk=max(2, length // 6))
    rows = torch.arange(2)
    with torch.no_grad():
        full = model(tokens)
        cache = engine.new_cache(2, length)
        stepped = [engine.prefill([tokens[row, :p] for row, p in zip(rows, prompts)], cache)]
        wanted = [full[rows, prompts - 1]]
        for step in range(length - int(prompts.max())):
            positions = prompts + step
            stepped.append(engine.decode(tokens[rows, positions][:, None], positions, cache))
            wanted.append(full[rows, positions])
    return ((torch.stack(stepped) - torch.stack(wanted)).abs().max() / full.abs().max().clamp(min=1e-30)).item()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
