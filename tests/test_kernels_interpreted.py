"""The Triton kernels of fla and mamba-ssm, run on the CPU by Triton's interpreter, against
archlab's PyTorch ops.

The kernels are the packages' own source, executed op by op in NumPy (conftest.py turns the
interpreter on before either is imported). This checks what needs no GPU: that archlab calls
every kernel it dispatches to with the right layouts, scales, states and adapters, forward and
backward, and that whole models with their blocks on a kernel backend train and decode as on
PyTorch. What it cannot check is the compiled kernels' arithmetic on a GPU
(``benchmarks/gpu_check.py``).

mamba-ssm cannot be installed here as it ships: its CUDA extensions need a CUDA toolkit.
``.ci/install`` installs its Python and Triton files alone, apart from the venv, and names the
folder in ``ARCHLAB_TEST_MAMBA_SSM``.
"""

import builtins
import contextlib
import dataclasses
import os
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import archlab
import archlab.ops.dispatch as dispatch
from archlab.engine import Engine
from conftest import ROOT

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter (TRITON_INTERPRET=1)"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton"),  # NumPy on the lanes a kernel masks out
]
PACKAGES = ("fla", "mamba_ssm")
KERNEL_OPS = sorted((backend, op) for backend, op in {*dispatch.KERNELS, *dispatch.ADAPTERS}  # those archlab calls
                    if backend in PACKAGES and ("torch", op) in dispatch.KERNELS)
FORWARD_ONLY = {  # no backward in the package; archlab only decodes with them
    ("fla", "fused_recurrent_gated_delta_rule"),
    ("mamba_ssm", "selective_state_update"),
}
F32 = dict(rtol=2e-4, atol=2e-5)  # two float32 computations in different orders


class LoopIndex(int):
    """A loop index that answers ``.to(dtype)``: compiled Triton makes loop indices tensors,
    and the kernels cast them, while the interpreter's are Python ints."""

    def to(self, dtype, **kwargs):
        return self


def loop_range(*args):
    return map(LoopIndex, builtins.range(*args))


def mamba_ssm_importable(monkeypatch) -> None:
    """The Triton half of mamba-ssm, importable: its folder on the path, a stand-in for the CUDA
    extension its package imports (Mamba1's scan, which archlab never calls), and the two CUDA
    queries its host code makes answered for the CPU."""
    folder = os.environ.get("ARCHLAB_TEST_MAMBA_SSM")
    if not folder or not Path(folder, "mamba_ssm").is_dir():
        pytest.skip("mamba-ssm's Triton files are not installed (ARCHLAB_TEST_MAMBA_SSM; .ci/install does it)")
    monkeypatch.syspath_prepend(folder)
    monkeypatch.setitem(sys.modules, "selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(multi_processor_count=1))


class LanguagePatchedOnce:
    """The interpreter's ``_patch_lang``, which a kernel calls around its run and a device function
    at each call: a call patches only modules of triton.language not yet patched in this kernel's
    run, and the kernel's restore undoes every patch of its run, the last first."""

    def __init__(self, patch):
        import triton.language as tl

        self.patch, self.languages, self.scopes, self.patched = patch, (tl, tl.core), [], set()

    def __call__(self, fn):
        langs = {id(value) for value in fn.__globals__.values() if any(value is lang for lang in self.languages)}
        if not self.scopes or not langs <= self.patched:
            self.scopes.append(self.patch(fn))
            self.patched |= langs
        return self

    def restore(self):
        while self.scopes:
            self.scopes.pop().restore()
        self.patched.clear()


@pytest.fixture
def interpreted(monkeypatch):
    """``load(backend)`` makes a package's kernels runnable here: loop indices as above, autotuning
    without timing (every config computes the same result and the interpreter has no timer, so
    the first is taken), and kernel backends allowed on the CPU. mamba-ssm leaves no trace."""
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    monkeypatch.setattr(Autotuner, "_bench", lambda self, *args, config, **meta: [0.0, 0.0, 0.0])
    monkeypatch.setattr(dispatch, "runs_on", lambda backend, device_type: True)
    # Two costs of the interpreter that change no result, together most of these tests' time.
    # Without debug it works out each integer op's overflow check and then drops it (compiled
    # Triton emits none):
    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=False))
    # and it patches triton.language afresh at every call of a device function (each exp in a
    # loop), though the kernel calling it has patched the language already.
    monkeypatch.setattr(interpreter, "_patch_lang", LanguagePatchedOnce(interpreter._patch_lang))

    def load(backend: str) -> None:
        if backend == "mamba_ssm":
            mamba_ssm_importable(monkeypatch)
        pytest.importorskip(backend)
        for package, op in KERNEL_OPS:
            if package == backend:
                dispatch.kernel(package, op)  # imports every kernel module before patching them
        for name, module in list(sys.modules.items()):
            if name.startswith(f"{backend}.ops"):
                monkeypatch.setattr(module, "range", loop_range, raising=False)

    yield load
    for name in [name for name in sys.modules if name.split(".")[0] == "mamba_ssm"]:
        del sys.modules[name]
    dispatch.installed.cache_clear()


def op_inputs(op: str, T: int = 37, B: int = 2, window: int | None = 16) -> dict:
    """Inputs in realistic ranges (l2-normalised keys, negative log-decays, sigmoid betas), with
    an initial state, asking for the final one; attention with GQA and a ``window``."""
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    if op == "causal_attention":
        return dict(q=r(B, 3 * T, 4, 32), k=r(B, 3 * T, 2, 32), v=r(B, 3 * T, 2, 32), positions=torch.arange(3 * T)[None],
                    window=window)
    if op == "mamba_chunk_scan_combined":
        h, p, n = 4, 8, 16
        return dict(x=r(B, T, h, p), dt=r(B, T, h) - 1, A=-torch.exp(r(h)), B=r(B, T, 2, n), C=r(B, T, 2, n), chunk_size=16,
                    D=r(h), z=r(B, T, h, p), dt_bias=r(h) * 0.5, initial_states=r(B, h, p, n), dt_softplus=True,
                    return_final_states=True)
    if op == "selective_state_update":
        h, p, n = 4, 8, 16
        return dict(state=r(B, h, p, n), x=r(B, h, p), dt=r(B, h), A=-torch.exp(r(h)), B=r(B, 2, n), C=r(B, 2, n), D=r(h),
                    z=r(B, h, p), dt_bias=r(h), dt_softplus=True)
    T = 1 if op.startswith("fused_recurrent") else T  # the recurrent kernels decode one token at a time
    H, K, V = 2, 16, 16
    inputs = dict(q=r(B, T, H, K), k=F.normalize(r(B, T, H, K), dim=-1), v=r(B, T, H, V), initial_state=r(B, H, K, V),
                  output_final_state=True)
    if "gated_delta" in op:
        inputs.update(g=F.logsigmoid(r(B, T, H)), beta=torch.sigmoid(r(B, T, H)))
    elif "simple_gla" in op:
        inputs["g"] = F.logsigmoid(r(B, T, H))
    return inputs


def run_op(backend: str, op: str, inputs: dict, backward: bool):
    """Outputs, and the gradients of every float input under one fixed weighting of them."""
    floats = {k for k, v in inputs.items() if torch.is_tensor(v) and v.is_floating_point()}
    leaves = {k: v.clone().requires_grad_(backward) if k in floats else v for k, v in inputs.items()}
    out = dispatch.kernel(backend, op)(**leaves)
    out = [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None]
    if not backward:
        return out, {}
    gen = torch.Generator().manual_seed(1)
    sum(t.float().mul(torch.randn(t.shape, generator=gen)).sum() for t in out).backward()
    return out, {k: leaves[k].grad for k in floats}


def assert_same_as_torch(backend: str, op: str, inputs: dict) -> None:
    backward = (backend, op) not in FORWARD_ONLY
    out, grads = run_op(backend, op, inputs, backward)
    ref_out, ref_grads = run_op("torch", op, inputs, backward)
    assert len(out) == len(ref_out) == (1 if op == "causal_attention" else 2)  # the output (and the final state)
    for a, b in zip(out, ref_out):
        torch.testing.assert_close(a.float(), b.float(), **F32)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert grads[name] is not None and ref_grads[name] is not None, name
        torch.testing.assert_close(grads[name], ref_grads[name], **F32, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("backend, op", KERNEL_OPS, ids=[f"{b}-{op}" for b, op in KERNEL_OPS])
def test_every_kernel_equals_archlabs_op(interpreted, backend, op):
    interpreted(backend)
    assert_same_as_torch(backend, op, op_inputs(op))


@pytest.mark.parametrize("window", [None, 1, 40])
def test_fla_attention_with_any_window_equals_the_torch_path(interpreted, window):
    """fla's attention (``backend: fla`` of attention, swa and cross_attention) over 111 positions
    with no window (full causal), one of a position, or one across several of its blocks."""
    interpreted("fla")
    assert_same_as_torch("fla", "causal_attention", op_inputs("causal_attention", window=window))


MODELS = [  # tiny spec, kernel backend, the overrides that put every block with such a kernel on it
    ("yoco-u", "fla", ["layout.self_decoder.blocks.0.backend=fla", "layout.cross_decoder.blocks=[{type: cross_attention, backend: fla}]"]),
    ("yoco-u-gdn", "fla", ["layout.self_decoder.blocks.0.backend=fla"]),
    ("yoco-u-retnet", "fla", ["layout.self_decoder.blocks.0.backend=fla"]),
    ("yoco-u-mamba2", "fla", ["layout.self_decoder.blocks.0.backend=fla"]),
    ("yoco-u-mamba2", "mamba_ssm", ["layout.self_decoder.blocks.0.backend=mamba_ssm"]),
]


def tiny_with(name: str, overrides: list[str]) -> archlab.Model:
    path = ROOT / "specs" / "tiny" / f"{name}.yaml"
    spec = archlab.load_spec(path, overrides)
    torch.manual_seed(0)
    return archlab.build_model(spec)


@pytest.mark.parametrize("name, backend, overrides", MODELS, ids=[f"{name}-{backend}" for name, backend, _ in MODELS])
def test_models_on_kernels_train_and_decode_as_on_torch(interpreted, name, backend, overrides):
    """The blocks' own calls: a training step's loss and every gradient, then greedy decoding
    (prefill chunks and recurrent steps) of two prompts of different lengths."""
    interpreted(backend)
    reference, model = tiny_with(name, []), tiny_with(name, overrides)
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, reference.spec.vocab_size, (2, 33))
    losses = [m(tokens[:, :-1], targets=tokens[:, 1:]) for m in (model, reference)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(*losses, **F32)
    for (param, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, ref.grad, **F32, msg=lambda m: f"{param}: {m}")
    prompts = [tokens[0, :19], tokens[1, :7]]  # the first prefilled in two chunks
    with torch.no_grad():
        runs = [Engine(m, prefill_chunk=16).generate(prompts, 3, keep_logits=True) for m in (model, reference)]
    assert runs[0].tokens == runs[1].tokens
    for logits, ref_logits in zip(runs[0].logits, runs[1].logits):
        torch.testing.assert_close(logits, ref_logits, **F32)
