"""What ``archlab build`` checks of a model small enough for the CPU: a finite forward and
backward pass, the analytic costs against the built model and its cache, and decoding a batch
of prompts of different lengths token by token against full forward passes. The test suite
checks the built-in blocks this way; these give the author of a plugin block the same checks
for theirs."""

from __future__ import annotations

import copy
import inspect
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from archlab.cache import GROWTH_CONTEXTS, Cache, growing
from archlab.cost import Cost, formula
from archlab.engine import Engine
from archlab.memory import ACTIVATIONS, Watched, check_room, out_of_memory
from archlab.model import Model
from archlab.ops.dispatch import BackendError
from archlab.registry import RegistryError, named, raised, said
from archlab.table import first_few

CACHE_CONTEXTS = (1, 17, 4097)  # tokens: one, a few past a typical tiny window, and past most windows
DECODE_LENGTH = 24  # tokens, at least: prompts of 12, 12 and 9 in chunks of 4, then 12 decoding steps
DECODE_TOLERANCE = 1e-4  # of the largest logit, in float32: the built-in blocks agree to about 1e-6
SHAPE_CHECK_LENGTH = 16  # tokens in training's forward pass before its first step: shapes alone, so a few


@dataclass
class CpuCheck:
    passes: str  # "fwd+bwd", or "fwd only (...)" where a kernel has no CPU backward
    finite: bool  # logits and gradients (False where the forward pass could not finish)
    problems: list[str]  # of the costs and of decoding, looked for only when finite; else where nan or inf first came, or why the pass could not finish


def cpu_check(model: Model, n: int) -> CpuCheck:
    """A forward and backward pass over 2 x ``n`` random tokens; when finite, the cost formulas,
    decoding (three sequences of ``min(n, 48)`` tokens, 24 at least) and a forward pass in the
    spec's inference dtype checked too. Every block's
    output shape is checked throughout (``shapes_checked``)."""
    forward_only = [f"{block}: {backend}" for block, backend in model.untrainable_kernels("cpu")]
    passes = f"fwd only (no CPU backward for {', '.join(forward_only)})" if forward_only else "fwd+bwd"
    # made and filled before any op is watched: 2^30 tokens and their embeddings passed every allocation and were killed filling them
    check_room(2 * n * (torch.long.itemsize + model.spec.d_model * model.embed.weight.element_size()), "cpu", "its tokens and their embeddings")
    tokens = torch.randint(0, model.spec.vocab_size, (2, n))
    try:
        with shapes_checked(model), Watched("cpu", "its activations and gradients"):
            with torch.set_grad_enabled(not forward_only):
                logits, aux = model(tokens, return_aux=True)
            if not forward_only:
                (logits.float().logsumexp(-1).mean() + aux).backward()
    except RegistryError as exc:  # a block's output of another shape, or its forward raised
        return CpuCheck(passes, False, [str(exc)])
    if not logits.isfinite().all():
        return CpuCheck(passes, False, [f"the forward pass gives nan or inf: first {first_non_finite(model, tokens)}"])
    if broken := [name for name, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]:
        return CpuCheck(passes, False, [f"the forward pass is finite, the gradients of {len(broken)} parameter(s) are not:"
                                        f" {first_few(broken, 3)}"])
    problems = flops_problems(model)
    try:
        with shapes_checked(model):
            problems += cost_problems(model) + decode_problems(model, max(min(n, 48), DECODE_LENGTH)) + inference_dtype_problems(model)
    except RegistryError as exc:  # a module's state the cache cannot hold, a formula that raises, an output's shape
        problems.append(str(exc))
    except Exception as exc:  # a block's new_state that raises
        problems.append(f"making the cache raised {said(exc)} (blocks: {_blocks(model)})")
    return CpuCheck(passes, True, problems)


def first_non_finite(model: Model, tokens: torch.Tensor) -> str:
    """Where a forward pass over ``tokens`` first gives nan or inf: the first module to finish with
    them in its output (a module finishes after those it calls, so this is the innermost), named
    as ``model.named_modules`` names it."""
    found: list[str] = []

    def hook(name: str):
        def check(module, args, output):
            leaves = [t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if not found and not all(t.isfinite().all() for t in leaves):
                found.append(f"out of {name} ({type(module).__name__})")
        return check

    handles = [module.register_forward_hook(hook(name)) for name, module in model.named_modules() if name]
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else "out of the model's own arithmetic, not a module's output"


@contextmanager
def shapes_checked(model: Model) -> Iterator[None]:
    """Each block's forward must give back a tensor of its input's shape: one that does not is named
    as it returns, with both shapes, where the residual add after it would fail naming neither (or
    broadcast without a word). A forward that raises is named too, with the line of its module's
    file that it raised from, where a traceback would show the plugin's code to someone who only
    wrote a spec."""
    running: list = [None]  # the block whose forward has begun and not yet returned, with its module (blocks do not nest)

    def begin(block):
        def enter(module, args):
            running[0] = block, module
        return enter

    def hook(block):
        def check(module, args, output):
            running[0] = None
            x = args[0]
            if not (isinstance(output, torch.Tensor) and output.shape == x.shape):
                got = list(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
                raise RegistryError(f"{named(block)}: its forward returned {got} for an x of {list(x.shape)}; a block's"
                                    " forward gives back the shape of its x, [rows, n, d_model]")
            if torch.promote_types(x.dtype, output.dtype) != x.dtype and not torch.is_autocast_enabled(x.device.type):
                # wider than x (float32 for a bfloat16 x): the residual add would widen the stream, and the next layer's
                # matmul against weights in x's dtype fail; a narrower one (a forward under its own autocast) is widened back
                raise RegistryError(f"{named(block)}: its forward returned {_dtype_name(output.dtype)} for an x of"
                                    f" {_dtype_name(x.dtype)}; a block's forward gives back x's dtype (or a narrower one),"
                                    " the one the layers after it compute in")
        return check

    handles = [handle for i, layer in enumerate(model.layers) for handle in (
        layer.mixer.register_forward_pre_hook(begin(model.spec.block_at(i))),
        layer.mixer.register_forward_hook(hook(model.spec.block_at(i))))]
    try:
        yield
    except (RegistryError, BackendError):  # said already
        raise
    except Exception as exc:
        if running[0] is None or out_of_memory(exc):  # not in a block's forward, or not its code's fault: said as such
            raise
        block, module = running[0]
        raise RegistryError(raised(block, "forward", exc) + _raised_at(type(module), exc)) from exc
    finally:
        for handle in handles:
            handle.remove()


def _raised_at(module_class: type, exc: BaseException) -> str:
    """Where in the file defining ``module_class`` an exception was last on its way: the line that
    raised it, or called what did."""
    try:
        source = inspect.getsourcefile(module_class)
    except (OSError, TypeError):  # defined where no file holds it (a notebook's cell, a built-in)
        return ""
    lines = [frame.f_lineno for frame, _ in traceback.walk_tb(exc.__traceback__) if frame.f_code.co_filename == source]
    return f" (at {Path(source).name}:{lines[-1]})" if lines else ""


def first_forward(model: Model) -> None:
    """A forward pass over one short sequence, every block's output shape (and dtype) checked: what a first
    training step would find, found before it writes anything. Compiled layers run it eagerly, so
    that no graph is compiled for its shape. Its activations are watched (``Watched``): a spec's
    sizes can make even a few tokens' too large."""
    device = next(model.parameters()).device
    tokens = torch.zeros(1, SHAPE_CHECK_LENGTH, dtype=torch.long, device=device)
    with shapes_checked(model), torch.no_grad(), torch.compiler.set_stance("force_eager"), Watched(device, ACTIVATIONS):
        model(tokens)


def _blocks(model: Model) -> str:
    return ", ".join(dict.fromkeys(model.spec.block_at(i).type for i in range(model.spec.n_layers)))


def decode_problems(model: Model, length: int) -> list[str]:
    """What decoding prompts of different lengths shows: an error, or logits other than full
    forward passes' (see ``decode_error``)."""
    blocks = _blocks(model)
    try:
        error, replaced = decode_error(model, length)
    except RegistryError:
        raise
    except Exception as exc:  # a plugin's forward that breaks on a batch of rows: said with the blocks it may be
        return [f"decoding prompts of different lengths raised {said(exc)} (blocks: {blocks})"]
    if replaced:
        return [f"decoding replaced {', '.join(replaced)} in inp.state with other tensors rather than updating them in place"
                " (copy_, or an op's out=): decoding from a CUDA graph reads and writes the tensors new_state made"]
    if error <= DECODE_TOLERANCE:
        return []
    shared = sorted({model.spec.block_at(layer).type for seg in model.plan.segments if seg.share_kv for layer in seg.layers
                     if model.spec.block_at(layer).shares_kv})
    also = (f"; in a loop with kv_cache: shared, every iteration of {', '.join(shared)} is handed the one state of the first:"
            " a block that keeps more there than its K,V (a conv's last inputs) cannot share it, and sets shares_kv false"
            if shared else "")
    return [f"decoding prompts of different lengths token by token differs from full forward passes by {error:.1e} of"
            f" the largest logit (blocks: {blocks}; does each module's forward read and update inp.state, each row at its"
            f" own inp.positions?{also})"]


def inference_dtype_problems(model: Model) -> list[str]:
    """What a forward pass in the spec's ``inference_dtype`` shows, where it is not the model's (a
    copy's, cast): a block whose output is not in it, or that breaks in it."""
    dtype = getattr(torch, model.spec.inference_dtype)
    if next(model.parameters()).dtype == dtype:
        return []
    try:
        first_forward(copy.deepcopy(model).to(dtype))
    except RegistryError as exc:
        return [str(exc)]
    except Exception as exc:  # a plugin's op with no kernel for the dtype, say
        return [f"a forward pass in {model.spec.inference_dtype}, the spec's inference_dtype, raised {said(exc)} (blocks: {_blocks(model)})"]
    return []


def flops_problems(model: Model) -> list[str]:
    """Each block's ``flops()`` over a sequence and a decoding step (and an iteration reusing an
    earlier one's K,V, where it may), each asked for: the cost table may ask for only some of them."""
    spec, problems = model.spec, {}
    for layer in range(spec.n_layers):
        block, ctx = spec.block_at(layer), spec.build_context(model.plan.half_of(layer))
        for n, start, reuse_kv in ((17, 0, False), (1, 16, False), *([(17, 0, True)] if block.shares_kv else [])):
            try:
                formula(block, "flops", ctx, n, start, reuse_kv)
            except RegistryError as exc:
                problems.setdefault(block.type, f"{exc} (at n={n}, start={start}, reuse_kv={reuse_kv})")
    return list(problems.values())


def cost_problems(model: Model) -> list[str]:
    """Where the spec's cost formulas disagree with the model: ``params`` with its parameters,
    ``state_bytes`` with the cache the engine makes, in the model's dtype and the spec's
    inference dtype (a block may keep some state in the one and some in float32), and
    ``grows_kv_cache`` with how its state grows (``growth_problems``)."""
    cost, problems, split = Cost(model.spec), params_problems(model), []
    dtypes = dict.fromkeys([_dtype_name(next(model.parameters()).dtype), model.spec.inference_dtype])
    for dtype, context in ((dtype, context) for dtype in dtypes for context in CACHE_CONTEXTS):
        analytic, held = cost.cache_bytes(context, dtype), Cache(model, 1, context, getattr(torch, dtype)).bytes_per_sequence()
        at = f"{context:,} token{'s' * (context != 1)}"
        if analytic.total != held.total:
            problems.append(f"state_bytes() give {analytic.total:,} B per sequence at {at} in {dtype}, the cache"
                            f" holds {held.total:,} B (is each tensor of new_state counted, at its size for this context"
                            " (a window caps it) and in the dtype it is given?)")
            break
        if analytic != held and not split:
            split.append(f"state_bytes() count {analytic.global_:,} B per sequence at {at} as growing with the"
                         f" context and {analytic.local:,} B as not; the cache's tensors that grow hold {held.global_:,} B, the"
                         f" others {held.local:,} B (a block whose state both grows and does not gives state_bytes() as"
                         " archlab.block.CacheBytes(global_, local): the bytes of the tensors that grow, then of the others)")
    # after the cache is made (each state a dict of row-first tensors); a wrong flag is what splits the bytes wrongly then
    return problems + (growth_problems(model) or split)


def params_problems(model: Model) -> list[str]:
    """Where the blocks' ``params()`` do not sum to the built model's parameters (costs, FLOPs and
    MFU are worked out from the formulas)."""
    counted, built = Cost(model.spec).params_total, sum(p.numel() for p in model.parameters())
    return [f"params() sum to {counted:,}, the built model holds {built:,}"] if counted != built else []


def growth_problems(model: Model) -> list[str]:
    """Blocks whose state grows with the context where ``grows_kv_cache`` says it does not, or whose
    state holds nothing that grows where it says it does (a window's ring): the flag says whether a
    loop over the block keeps a growing cache, and, where ``state_bytes`` gives one number, whether
    costs count it global or local. A state may both grow and not (attention with a short conv)."""
    problems = {}
    for i, layer in enumerate(model.layers):
        block = model.spec.block_at(i)
        tensors = growing(layer.mixer, torch.float32)
        grows = sorted(name for name, grown in tensors.items() if grown)
        if block.type in problems or bool(grows) == block.grows_kv_cache or not tensors:
            continue
        said = f"its state's {', '.join(grows)} grows" if grows else f"no tensor of its state ({', '.join(tensors)}) grows"
        problems[block.type] = (f"{named(block)}: grows_kv_cache is {block.grows_kv_cache}, but {said} with the context (from"
                                f" {GROWTH_CONTEXTS[0]:,} to {GROWTH_CONTEXTS[1]:,} tokens)")
    return list(problems.values())


def decode_error(model: Model, length: int) -> tuple[float, list[str]]:
    """The largest difference between the logits of full forward passes over three sequences of
    ``length`` random tokens and those of prefilling prompts of two lengths (in chunks, so that
    a chunk boundary is crossed; the two of one length together) then decoding all rows together
    token by token, each at its own position, as a fraction of the largest logit. Rows of
    different lengths find a state that is not row-first, or a forward that reads one row's
    positions for all; two prefilled together, a chunk that reads one row's state for both. Also
    the state tensors that decoding replaced rather than updated in place."""
    prompts = torch.tensor([length // 2, length // 2, length // 2 - 3])
    rows = torch.arange(len(prompts))
    tokens = torch.randint(0, model.spec.vocab_size, (len(prompts), length))
    engine = Engine(model.eval(), prefill_chunk=max(2, length // 6))
    with torch.no_grad():
        full = model(tokens)
        cache = engine.new_cache(len(prompts), length)
        made = {(key, name): tensor for key, state in cache.layers.items() for name, tensor in state.items()}
        stepped = [engine.prefill([tokens[row, :p] for row, p in zip(rows, prompts)], cache)]
        wanted = [full[rows, prompts - 1]]
        for step in range(length - int(prompts.max())):
            positions = prompts + step
            stepped.append(engine.decode(tokens[rows, positions][:, None], positions, cache))
            wanted.append(full[rows, positions])
    replaced = sorted({f"{model.spec.block_at(key[2]).type}'s {name}" for (key, name), tensor in made.items()
                       if cache.layers[key][name] is not tensor})
    return ((torch.stack(stepped) - torch.stack(wanted)).abs().max() / full.abs().max().clamp(min=1e-30)).item(), replaced


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
