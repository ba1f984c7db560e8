"""Kernel dispatch, tested where the kernels cannot run: choices, fallbacks and messages."""

import warnings
from pathlib import Path

import pytest
import torch

import archlab
import archlab.ops.dispatch as dispatch
from archlab.block import BuildContext, MixerInput
from archlab.ops.attention import ATTENTION_AUTO, ATTENTION_KERNELS, band_block_mask
from archlab.ops.dispatch import BackendError, Kernels, choose, kernel
from archlab.ops.ssd import selective_state_update
from blocks.attention import AttentionSpec
from blocks.swa import SlidingWindowSpec
from conftest import ROOT, parsed


@pytest.fixture
def packages(monkeypatch):
    """Pretend which kernel packages are installed."""
    present: set[str] = set()
    monkeypatch.setattr(dispatch, "installed", lambda backend: backend in ("torch", "flex") or backend in present)
    dispatch._notice.cache_clear()
    return present


def test_auto_uses_the_torch_ops_on_the_cpu_without_a_notice(packages):
    packages.add("fla")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose("gdn", "auto", ("fla",), "cpu") == "torch"


def test_auto_takes_an_installed_kernel_on_cuda(packages):
    packages.add("fla")
    assert choose("gdn", "auto", ("fla",), "cuda") == "fla"
    with pytest.warns(UserWarning, match=r"mamba2: no CUDA kernel package installed \(mamba-ssm\)"):
        assert choose("mamba2", "auto", ("mamba_ssm", "fla"), "cuda", auto=("mamba_ssm",)) == "torch"  # fla only when named
    assert choose("mamba2", "fla", ("mamba_ssm", "fla"), "cuda", auto=("mamba_ssm",)) == "fla"
    packages.add("mamba_ssm")
    assert choose("mamba2", "auto", ("mamba_ssm", "fla"), "cuda", auto=("mamba_ssm",)) == "mamba_ssm"
    with pytest.warns(UserWarning, match=r"swa: no CUDA kernel package installed \(flash-attn\)"):
        assert choose("swa", "auto", ATTENTION_KERNELS, "cuda", ATTENTION_AUTO) == "torch"  # fla and flex only when named
    assert choose("swa", "fla", ATTENTION_KERNELS, "cuda", ATTENTION_AUTO) == "fla"


def test_auto_falls_back_on_cuda_with_a_notice(packages):
    with pytest.warns(UserWarning, match=r"gdn: no CUDA kernel package installed \(flash-linear-attention\)"):
        assert choose("gdn", "auto", ("fla",), "cuda") == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per block, not on every forward
        assert choose("gdn", "auto", ("fla",), "cuda") == "torch"


def test_a_named_backend_that_cannot_run_is_a_clear_error(packages):
    with pytest.raises(BackendError, match=r"needs the mamba-ssm package \(mamba_ssm\), which is not installed"):
        choose("mamba2", "mamba_ssm", ("mamba_ssm",), "cuda")
    packages.add("fla")
    with pytest.raises(BackendError, match="runs on CUDA devices only; this model is on cpu"):
        choose("gdn", "fla", ("fla",), "cpu")
    with pytest.raises(BackendError, match="has no kernel for this block"):
        choose("gdn", "flash_attn", ("fla",), "cuda")
    assert choose("swa", "flex", ("flash_attn", "flex"), "cpu") == "flex"  # FlexAttention runs anywhere


def test_a_backend_a_block_does_not_have_is_a_spec_error(tmp_path):
    text = (ROOT / "specs/tiny/yoco-u-gdn.yaml").read_text().replace("chunk_size: 16}", "chunk_size: 16, backend: flash_attn}")
    (tmp_path / "s.yaml").write_text(f"extends: {ROOT / 'specs/tiny/yoco-u-gdn.yaml'}\n" + text.split("\n", 1)[1])
    with pytest.raises(archlab.SpecError, match="backend.*'auto', 'torch' or 'fla'"):
        archlab.load_spec(tmp_path / "s.yaml")


def _chunk_spec(tmp_path, block: str) -> Path:
    """A tiny YOCO-U spec whose self-decoder is ``block`` (YAML flow mapping)."""
    (tmp_path / "s.yaml").write_text(f"extends: {ROOT / 'specs/tiny/yoco-u.yaml'}\nlayout: {{self_decoder: {{blocks: [{block}]}}}}\n")
    return tmp_path / "s.yaml"


@pytest.mark.parametrize(("block", "op"), [("gdn, n_heads: 4", "chunk_gated_delta_rule"), ("retnet, n_heads: 4", "chunk_retention"),
                                           ("retnet, n_heads: 4, gated: true", "chunk_simple_gla")])
def test_a_chunk_size_fla_cannot_take_is_refused_where_fla_is_named(tmp_path, block, op):
    """fla's own entry check says which sizes its kernel takes (on the CPU an accepted one gets as
    far as launching, which fails for want of a GPU), and Triton says the smallest matrix product
    its kernels may do over a chunk in bf16: a spec naming fla is refused the others; auto and torch
    take any size (auto runs such an op on PyTorch, below)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import min_dot_size
    import triton.language as tl

    smallest = min_dot_size(GPUTarget("cuda", 90, 32))(tl.bfloat16, tl.bfloat16)[2]  # an H100's
    fla_op = kernel("fla", op)
    q, g = torch.randn(1, 8, 2, 4), -torch.rand(1, 8, 2)
    gates = {"chunk_gated_delta_rule": dict(g=g, beta=torch.rand(1, 8, 2)), "chunk_simple_gla": dict(g=g)}.get(op, {})
    for size in (1, 3, 8, 16, 24, 32, 48, 64, 96, 128, 256, 384):
        try:
            fla_op(q, q, q, **gates, chunk_size=size)
        except ValueError as exc:
            assert "chunk_size" in str(exc)
            refused = True
        except RuntimeError:  # accepted, then no GPU to launch on
            refused = size < smallest
        for backend in ("auto", "fla", "torch"):
            path = _chunk_spec(tmp_path, f"{{type: {block}, chunk_size: {size}, backend: {backend}}}")
            if refused and backend == "fla":
                with pytest.raises(archlab.SpecError, match=rf"chunk_size: fla's {op} runs chunk sizes of .*, not {size};"
                                                            " choose such a size, or set backend: auto or torch"):
                    archlab.load_spec(path)
            else:
                archlab.load_spec(path)
        assert (dispatch.chunk_size_refused("fla", op, size) is not None) == refused, size


def test_mamba2_through_fla_takes_the_chunk_sizes_of_simple_gla(tmp_path):
    block = "{type: mamba2, d_state: 16, head_dim: 16, chunk_size: %d, backend: %s}"
    for backend in ("auto", "torch", "mamba_ssm"):  # auto takes mamba-ssm only, which takes any size
        archlab.load_spec(_chunk_spec(tmp_path, block % (48, backend)))
    for size in (48, 8):
        with pytest.raises(archlab.SpecError, match=f"fla's mamba_chunk_scan_combined runs chunk sizes of a power of 2 from 16, not {size}"):
            archlab.load_spec(_chunk_spec(tmp_path, block % (size, "fla")))


def test_auto_runs_an_op_at_a_chunk_size_fla_cannot_take_on_pytorch(packages, monkeypatch):
    """A run trained on the CPU at such a size still loads and runs where auto would take fla."""
    packages.add("fla")
    dispatch._fallback_notice.cache_clear()
    ops = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")
    cuda = type("Device", (), {"type": "cuda"})()
    with pytest.warns(UserWarning, match=r"gdn: chunk_gated_delta_rule runs on the PyTorch implementation: fla's chunk_gated_delta_rule"
                                         r" runs chunk sizes of 16, 32 or 64, not 8"):
        chosen = Kernels("gdn", "auto", ("fla",), ops, chunk_size=8)(cuda)
    assert chosen["chunk_gated_delta_rule"].__module__ == "archlab.ops.gated_delta_rule"
    assert chosen["fused_recurrent_gated_delta_rule"].__module__.startswith("fla.")  # no chunks: fla's kernel stays
    assert Kernels("gdn", "auto", ("fla",), ops, chunk_size=64)(cuda)["chunk_gated_delta_rule"].__module__.startswith("fla.")
    with pytest.raises(BackendError, match="backend 'fla' cannot run chunk_gated_delta_rule here: fla's chunk_gated_delta_rule runs"):
        Kernels("gdn", "fla", ("fla",), ops, chunk_size=8)(cuda)


def test_flash_attn_leaves_dtypes_it_cannot_run_to_the_pytorch_op():
    """flash-attn refuses all but fp16 and bf16 ("FlashAttention only support fp16 and bf16 data
    type"): a float32 model (or fp32 training) on auto or flash_attn attends through SDPA instead."""
    called = []

    def flash_attn_func(q, k, v, causal, window_size):
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
        called.append(q.dtype)
        return q

    attend = dispatch._causal_from_flash_attn(flash_attn_func)
    q, k, v = torch.randn(2, 9, 4, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    positions = torch.arange(9).expand(2, 9)
    dispatch._dtype_notice.cache_clear()
    with pytest.warns(UserWarning, match=r"flash_attn runs fp16 and bf16 only; attention in torch.float32 runs on the PyTorch"):
        out = attend(q, k, v, positions, 4)
    assert called == []
    torch.testing.assert_close(out, kernel("torch", "causal_attention")(q, k, v, positions, 4), rtol=0, atol=0)
    attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), positions, 4)
    assert called == [torch.bfloat16]


@pytest.mark.parametrize("window", [None, 1, 4])
def test_flash_attn_is_given_the_window_as_the_keys_left_of_the_query(window):
    """flash-attn's window_size is (keys left of the query, keys right of it), -1 for no limit: a
    stand-in with that definition, spelled out mask by mask, attends as the PyTorch op does over
    the last ``window`` positions (the query's own included), in bf16 as flash-attn runs."""
    def flash_attn_func(q, k, v, causal, window_size):
        left, right = window_size
        i, j = torch.arange(q.shape[1])[:, None], torch.arange(k.shape[1])[None]
        seen = (j <= i) & ((j <= i + right) | (right < 0)) & ((j >= i - left) | (left < 0))
        k, v = (t.repeat_interleave(q.shape[2] // t.shape[2], dim=2).double() for t in (k, v))
        scores = torch.einsum("bihd,bjhd->bhij", q.double(), k) * q.shape[-1] ** -0.5
        weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        return torch.einsum("bhij,bjhd->bihd", weights, v).to(q.dtype)

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, h, 8, generator=gen).bfloat16() for h in (4, 2, 2))
    positions = torch.arange(9).expand(2, 9)
    out = dispatch._causal_from_flash_attn(flash_attn_func)(q, k, v, positions, window)
    reference = kernel("torch", "causal_attention")(q.float(), k.float(), v.float(), positions, window)
    torch.testing.assert_close(out.float(), reference, rtol=0, atol=2e-2)


def test_auto_leaves_flex_to_a_spec_that_names_it(packages):
    """A block offering FlexAttention without its own ``auto`` list: auto takes its first installed
    kernel package but never flex (installed everywhere), which runs only where it is named."""
    with pytest.warns(UserWarning, match=r"gla: no CUDA kernel package installed \(none\)"):
        assert choose("gla", "auto", ("flex",), "cuda") == "torch"
    packages.add("fla")
    assert choose("gla", "auto", ("flex", "fla"), "cuda") == "fla"
    assert choose("gla", "flex", ("flex", "fla"), "cuda") == "flex"


def test_the_cli_names_a_missing_kernel_package(tmp_path, packages):
    import subprocess
    import sys

    spec = tmp_path / "m.yaml"
    spec.write_text(f"extends: {ROOT / 'specs/tiny/yoco-u-mamba2.yaml'}\n"
                    "layout: {self_decoder: {blocks: [{type: mamba2, d_state: 16, head_dim: 16, chunk_size: 16, backend: mamba_ssm}]}}\n")
    result = subprocess.run([sys.executable, "-m", "archlab", "build", str(spec)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2
    assert "mamba2: backend 'mamba_ssm' needs the mamba-ssm package" in result.stderr and "Traceback" not in result.stderr


def test_every_torch_op_and_installed_kernel_resolves():
    for backend, op in {*dispatch.KERNELS, *dispatch.ADAPTERS}:
        if backend == "torch" or dispatch.installed(backend):
            assert callable(kernel(backend, op)), (backend, op)
    assert dispatch.installed("fla")  # the test extra brings it, so the fla rows above were resolved


def test_blocks_resolve_once_per_device(packages):
    kernels = Kernels("gdn", "auto", ("fla",), ("chunk_gated_delta_rule",))
    first = kernels(torch.device("cpu"))
    assert first is kernels(torch.device("cpu"))
    assert first["chunk_gated_delta_rule"].__module__ == "archlab.ops.gated_delta_rule"


def test_a_plugin_block_dispatches_its_own_ops(packages):
    """Ops that are not archlab's come from the block's own table, by the same choice of backend."""
    def chunk_gla(q, k, v, g):  # a plugin's PyTorch op
        return q

    table = {("torch", "chunk_gla"): chunk_gla, ("fla", "chunk_gla"): "fla.ops.gla:chunk_gla"}
    assert Kernels("gla", "auto", ("fla",), ("chunk_gla",), table=table)(torch.device("cpu"))["chunk_gla"] is chunk_gla
    packages.add("fla")
    named = Kernels("gla", "fla", ("fla",), ("chunk_gla",), table=table)
    with pytest.raises(BackendError, match="runs on CUDA devices only; this model is on cpu"):
        named(torch.device("cpu"))
    from fla.ops.gla import chunk_gla as fla_chunk_gla

    assert named._resolve(named.backend("cuda"), "chunk_gla") is fla_chunk_gla  # what a CUDA device would run
    with pytest.raises(BackendError, match="gla: no function for chunk_gla on torch; a block's kernel table names each of its ops"):
        Kernels("gla", "auto", ("fla",), ("chunk_gla",), table={("fla", "chunk_gla"): "fla.ops.gla:chunk_gla"})


def test_mamba_state_update_adapter_matches_the_functional_op():
    """mamba-ssm's kernel writes the state in place and wants per-dim tensors; the adapter
    gives it that and returns (out, state) like archlab's op. Checked with an in-place stand-in."""

    def in_place(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
        assert dt.shape == x.shape and A.shape == state.shape[1:] and D.shape == x.shape[1:] == dt_bias.shape
        out, new = selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)
        state.copy_(new)
        return out

    b, h, p, n = 2, 4, 8, 16
    state, x = torch.randn(b, h, p, n), torch.randn(b, h, p)
    dt, A, B, C = torch.randn(b, h), -torch.rand(h), torch.randn(b, 1, n), torch.randn(b, 1, n)
    D, dt_bias = torch.randn(h), torch.randn(h)
    adapted = dispatch._functional_state_update(in_place)
    out, new = adapted(state, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True)
    ref_out, ref_new = selective_state_update(state, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(new, ref_new)


@pytest.mark.parametrize("spec", [AttentionSpec(type="attention", n_heads=4, n_kv_heads=2), SlidingWindowSpec(type="swa", window=7, n_heads=4, n_kv_heads=2)])
def test_flex_attention_backend_equals_the_torch_path(spec):
    ctx = BuildContext(d_model=32, rope_theta=10_000.0)
    torch.manual_seed(0)
    reference = spec.build(ctx)
    flex = spec.model_copy(update={"backend": "flex"}).build(ctx)
    flex.load_state_dict(reference.state_dict())
    x = torch.randn(2, 50, 32)
    causal = MixerInput(torch.arange(50)[None], causal=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        torch.testing.assert_close(flex(x, causal), reference(x, causal), rtol=1e-5, atol=1e-5)
        hits = band_block_mask.cache_info().hits
        flex(x, causal)
    assert band_block_mask.cache_info().hits == hits + 1  # a second pass reuses the block mask


def test_the_cross_decoders_training_pass_runs_its_chosen_kernel():
    """cross_attention's ``backend`` picks the kernel of its whole-sequence (training) attention,
    flash_attn, fla or flex on a GPU: a training pass must go through it, once per cross-decoder
    layer, not through the masked attention over K,V rows that decoding uses, which gives the
    same numbers at the speed and memory the backend was named to avoid. Decoding reads the
    cache instead, never the whole-sequence kernel."""
    from archlab.engine import Engine

    spec = archlab.load_spec(ROOT / "specs/tiny/yoco.yaml")
    model = archlab.build_model(spec)
    cross = [layer.mixer for layer in model.layers[spec.layout.self_decoder.n_layers :]]
    calls = []
    for chosen in {id(t): t for t in (m.kernels(torch.device("cpu")) for m in cross)}.values():  # blocks may share one choice
        op = chosen["causal_attention"]
        chosen["causal_attention"] = lambda *args, op=op: calls.append(args[0].shape) or op(*args)
    tokens = torch.randint(0, spec.vocab_size, (2, 10))
    with torch.no_grad():
        model(tokens[:, :-1], targets=tokens[:, 1:])
        assert len(calls) == len(cross) == 2
        calls.clear()
        Engine(model).generate([tokens[0]], 3)
    assert calls == []


def test_the_gpu_check_script_runs_in_smoke_mode(tmp_path, monkeypatch):
    """The script a lent GPU runs, end to end on the CPU at tiny sizes, so it is ready when one is."""
    import json
    import subprocess
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import SECTIONS

    sections = [name for name in SECTIONS.split(",") if name != "commands"]  # a dozen commands (76 s here), each tested on its own
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke", "--out", str(tmp_path), "--sections", ",".join(sections)],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {r["status"] for r in report["parity"] if r["backend"] == "flex"} == {"ok"}
    assert "parity (swa, flex)" in result.stderr and "parity (attention, flex)" in result.stderr  # a process each
    assert [r["spec"] for r in report["inference"] if r["status"] == "ok"][:2] == ["transformer", "transformer"]
    assert report["training"]["tok_s"] > 0
    assert report["environment"]["torch"] == torch.__version__ and report["environment"]["device"].startswith("CPU (")
    assert all("decode_rel_err" not in r for r in report["parity"] if r["block"] in ("swa", "attention"))  # SDPA on both sides
    assert [r["status"] for r in report["window"]] == ["ok"] * 4 and report["window"][0]["rel_err"] == 0  # its own reference
    assert {r["spec"] for r in report["inference_paged"] if r["status"] == "ok"} == {"yoco-u"}
    assert sum(report["training_profile"]["share"].values()) == pytest.approx(1.0)
    assert report["training_profile"]["share"]["matmul"] > 0



def test_the_gpu_checks_commands_are_given_as_archlab_reads_them(monkeypatch, tmp_path):
    """The smoke test leaves out the ``commands`` section (a dozen processes); its command lines
    are parsed here as archlab parses its own, without running any: every option one the command
    has, with the values the parser checks (``evaluate --lengths`` was the first try's)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import command_lines

    listed = [(name, argv[argv.index("archlab") + 1 :]) for name, argv, _ in command_lines(tmp_path, 4) if "archlab" in argv]
    assert [name for name, _ in listed] == ["train", "torchrun", "fine-tune", "evaluate", "evaluate examples", "layers", "niah",
                                            "generate", "generate paged", "chat", "curves", "study"]
    for name, args in listed:
        try:
            command = parsed(args)
        except Exception as exc:  # click's usage errors, with what was wrong
            pytest.fail(f"{name}: {exc}")
        assert command.name == (args[1] if args[0] == "study" else args[0]), name  # the command meant, not a group


def test_the_gpu_check_refuses_unknown_names_before_it_starts(monkeypatch, capsys, tmp_path):
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import main

    for option, name in (("--sections", "traning"), ("--blocks", "mamba"), ("--specs", "yocou")):
        monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--smoke", "--out", str(tmp_path / "out"), option, name])
        with pytest.raises(SystemExit) as exited:
            main()
        stderr = capsys.readouterr().err
        assert exited.value.code == 2 and f"{option}: unknown {name}; known: " in stderr, stderr
    for given, said in ((["--smoke", "--sections", ","], "--sections: none given; known: parity,"),
                        ([], "no CUDA device is usable here"),  # it measured tiny CPU sizes and reported them as the GPU's
                        (["--lengths", "8K,8X"], "--lengths: '8X' is not a count of tokens (8192, 8K)")):
        monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--out", str(tmp_path / "out"), *given])
        monkeypatch.setattr("torch.cuda.is_available", lambda: "--lengths" in given)
        with pytest.raises(SystemExit) as exited:
            main()
        stderr = capsys.readouterr().err
        assert exited.value.code == 2 and said in stderr, stderr
    assert not (tmp_path / "out").exists()
    from gpu_check import token_counts

    assert token_counts(None, "--lengths", "8K,32768,1M") == [8192, 32768, 2**20]  # as archlab bench --seq-len reads them


def test_the_gpu_checks_training_stops_before_the_runs_evaluation_and_checkpoint(monkeypatch):
    """At paper scale the run's closing checkpoint is 15 GB (weights and AdamW state), written
    once per training section; its closing evaluation recompiles a compiled model."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import training

    from archlab.train.trainer import Trainer

    def refused(*args, **kwargs):
        raise AssertionError("not part of the check")

    monkeypatch.setattr(Trainer, "evaluate", refused)
    monkeypatch.setattr(Trainer, "_save", refused)
    result = training(torch.device("cpu"), str(ROOT / "specs" / "tiny" / "yoco-u.yaml"), 2, 32, 4)
    assert result["tok_s"] > 0 and len(result["loss_first_last"]) == 2


def test_the_gpu_checks_report_shows_no_figures_for_rows_that_have_none():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import report

    rows = [{"spec": "yoco-u", "seq_len": 8192, "batch": 32, "prefill_rows": 8, "prefill_chunk": 2048, "prefill_tok_s": 1e5,
             "decode_tok_s": 3e3, "kv_total_mb": 46.3, "peak_mb": 2765.0, "status": "ok"},
            {"spec": "yoco-u", "seq_len": 131072, "batch": 32, "status": "out of memory"}]
    text = report({"environment": {"device": "NVIDIA H200", "torch": "x", "triton": "y"}, "inference": rows,
                   "inference_paged": [{"spec": "yoco-u", "seq_len": 8192, "page_size": 256, "page_kernel": "flex", "status": "skipped: out of time"}]})
    assert "| yoco-u | 8192 |  |  |  | pages of 256, flex | - | - | - | - | skipped: out of time |" in text
    assert "| yoco-u | 8192 | 32 | 8 | 2048 | rows | 100,000 | 3,000 | 46.3 | 2.7 | ok |" in text
    assert text.startswith("# GPU check on NVIDIA H200\n\n- torch: x\n- triton: y\n")
    assert "| yoco-u | 131072 | 32 |  |  | rows | - | - | - | - | out of memory |" in text


def test_the_gpu_checks_decoding_parity_takes_a_near_tie_for_either_token(monkeypatch):
    """Two paths' bf16 logits over 100K random ones may swap a near-tie: not a mismatch; a token
    chosen otherwise where the top two stand apart is."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import same_choice

    a = torch.tensor([[1.0, 3.0, 2.999], [0.0, 5.0, 1.0]])
    assert same_choice(a, a + torch.tensor([[0.0, 0.0, 0.002], [0.0, 0.0, 0.0]]))  # row 0's top two swap, within the difference
    assert not same_choice(a, a + torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 4.5]]))  # row 1's 5.0 against 1.0 does not


def test_the_gpu_checks_time_limits_nest():
    """A section's limit holds around its rows' shorter ones, and a row cannot outlast it."""
    import sys
    import time

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import time_limit

    def spin():
        while True:
            sum(range(100))

    began = time.monotonic()
    with pytest.raises(TimeoutError, match="within 2 s"):
        with time_limit(2):
            with pytest.raises(TimeoutError, match="within 1 s"):
                with time_limit(1):
                    spin()
            spin()
    assert 1.9 < time.monotonic() - began < 3
    with pytest.raises(TimeoutError, match="within 1 s"):
        with time_limit(1):
            with time_limit(60):
                spin()


def test_the_gpu_check_kills_a_section_its_alarm_cannot_stop(tmp_path):
    """A section hung where SIGALRM cannot reach (here: one that ignores it) is killed at its
    limit, with what it started, and the check goes on; a section that ends is left to end."""
    import sys
    import time
    from pathlib import Path

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import run_apart

    started = tmp_path / "started"
    hung = ("import signal, subprocess, sys, time; signal.signal(signal.SIGALRM, signal.SIG_IGN); signal.alarm(1);"
            f" child = subprocess.Popen(['sleep', '600']); open({str(started)!r}, 'w').write(str(child.pid)); time.sleep(600)")
    began = time.monotonic()
    assert run_apart([sys.executable, "-c", hung], 5) == "killed after 5 s: hung where the section's own limit could not stop it"
    assert time.monotonic() - began < 30
    stat = Path(f"/proc/{started.read_text()}/stat")

    def running() -> bool:  # a killed process is gone, or a zombie until its new parent reaps it
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(), "the section's own child outlived it"
    assert run_apart([sys.executable, "-c", "pass"], 60) is None
    assert run_apart([sys.executable, "-c", "raise SystemExit(3)"], 60) == "exited with status 3"


def test_the_gpu_check_keeps_the_rows_a_section_measured_before_it_was_cut_short(tmp_path, monkeypatch):
    """A section that fails, or hangs past its limit and is killed, hands over the rows it wrote as
    it measured them (less a line the kill cut), and its error; the rows file goes."""
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_check

    monkeypatch.setattr(gpu_check, "KILL_GRACE_S", 1)
    part, rows = tmp_path / "part.json", tmp_path / "running.jsonl"
    measures = ("import json, signal, sys, time; rows = open(sys.argv[sys.argv.index('--rows') + 1], 'a', buffering=1);"
                " [rows.write(json.dumps({'row': i}) + '\\n') for i in (1, 2)]; rows.write('{\"row\": 3');")
    failed = gpu_check.section_apart([sys.executable, "-c", measures + " raise SystemExit(1)"], 60, part, rows)
    assert failed == ([{"row": 1}, {"row": 2}], "exited with status 1")
    hung = gpu_check.section_apart([sys.executable, "-c", measures + " signal.signal(signal.SIGALRM, signal.SIG_IGN); time.sleep(600)"],
                                   1, part, rows)
    assert hung == ([{"row": 1}, {"row": 2}], "killed after 2 s: hung where the section's own limit could not stop it")
    assert not rows.exists()
    ok = gpu_check.section_apart([sys.executable, "-c", "import json, sys; open(sys.argv[sys.argv.index('--part') + 1], 'w')"
                                  ".write(json.dumps({'result': {'tok_s': 1.0}}))"], 60, part, rows)
    assert ok == ({"tok_s": 1.0}, None)


def test_the_gpu_checks_parity_measures_the_forward_where_fla_refuses_the_backward(monkeypatch):
    """On Hopper with Triton 3.4 to 3.7.1, fla refuses its gated kernels' backward (#640) and
    archlab refuses the backend: parity then still measures their forward and decoding."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import PARITY, backward_refused, block_label

    from archlab.spec import block_specs

    def refused(fields: dict) -> bool:
        block = block_specs()[fields["type"]].model_validate({**fields, "backend": "fla"})
        return backward_refused(block.build(BuildContext(d_model=64, rope_theta=1e4)).kernels)

    monkeypatch.setattr(dispatch, "fla_refuses_gated_backward", lambda: True)
    assert {block_label(fields): refused(fields) for fields, _ in PARITY} == {
        "gdn": True, "retnet": False, "retnet gated": True, "mamba2": True, "swa": False, "attention": False}
    monkeypatch.setattr(dispatch, "fla_refuses_gated_backward", lambda: False)
    assert not any(refused(fields) for fields, _ in PARITY)


def test_a_known_kernel_bug_falls_back_or_is_refused(packages, monkeypatch):
    """fla refuses its gated backward on Hopper with some Triton versions: auto then takes the
    PyTorch op for the gated ops only (with a notice); a spec that insists on fla is told why."""
    monkeypatch.setattr(dispatch, "fla_refuses_gated_backward", lambda: True)
    monkeypatch.setattr(dispatch, "choose", lambda *args: "fla")
    dispatch._fallback_notice.cache_clear()
    ops = ("chunk_simple_gla", "chunk_retention")
    with pytest.warns(UserWarning, match=r"retnet: chunk_simple_gla runs on the PyTorch implementation: .*fla #640"):
        chosen = Kernels("retnet", "auto", ("fla",), ops)(torch.device("cpu"))
    assert chosen["chunk_simple_gla"].__module__ == "archlab.ops.retention"
    assert chosen["chunk_retention"].__module__.startswith("fla.")  # ungated: fla's kernel stays
    with pytest.raises(BackendError, match="backend 'fla' cannot run chunk_gated_delta_rule here: .*upgrade Triton to >= 3.7.1"):
        Kernels("gdn", "fla", ("fla",), ("chunk_gated_delta_rule",))(torch.device("cpu"))
    monkeypatch.setattr(dispatch, "fla_refuses_gated_backward", lambda: False)
    assert Kernels("gdn", "fla", ("fla",), ("chunk_gated_delta_rule",))(torch.device("cpu"))["chunk_gated_delta_rule"].__module__.startswith("fla.")


def test_a_plugin_naming_an_fla_kernel_gets_its_fallbacks(monkeypatch):
    """By another of fla's modules or as the function itself; a function of the plugin's own that
    calls fla's is the plugin's, and nothing is known of it."""
    import fla.ops.simple_gla as simple_gla

    def own_scan(*args, **kwargs):
        return simple_gla.chunk_simple_gla(*args, **kwargs)

    monkeypatch.setattr(dispatch, "choose", lambda *args: "fla")
    cpu = torch.device("cpu")
    for named in ("fla.ops.simple_gla.chunk:chunk_simple_gla", simple_gla.chunk_simple_gla):
        table = {("torch", "scan"): own_scan, ("fla", "scan"): named}
        monkeypatch.setattr(dispatch, "fla_refuses_gated_backward", lambda: False)
        with pytest.raises(BackendError, match="backend 'fla' cannot run scan here: fla's scan runs chunk sizes of a power of 2 from 16, not 48"):
            Kernels("gla", "fla", ("fla",), ("scan",), table=table, chunk_size=48)(cpu)
        assert Kernels("gla", "fla", ("fla",), ("scan",), table=table, chunk_size=64)(cpu)["scan"] is simple_gla.chunk_simple_gla
        monkeypatch.setattr(dispatch, "fla_refuses_gated_backward", lambda: True)
        dispatch._fallback_notice.cache_clear()
        with pytest.warns(UserWarning, match=r"gla: scan runs on the PyTorch implementation: .*fla #640"):
            assert Kernels("gla", "auto", ("fla",), ("scan",), table=table, chunk_size=64)(cpu)["scan"] is own_scan
    assert dispatch.cannot_run("fla", "scan", 48, {("fla", "scan"): own_scan}) is None


@pytest.mark.parametrize(("hopper", "above_3_4_0", "above_3_7_1", "tilelang", "refused"), [
    (True, True, False, False, True), (False, True, False, False, False), (True, False, False, False, False),
    (True, True, True, False, False), (True, True, False, True, False)])
def test_fla_refuses_its_gated_backward_on_hopper_with_triton_from_3_4_0_to_3_7_1_without_tilelang(
        monkeypatch, hopper, above_3_4_0, above_3_7_1, tilelang, refused):
    """fla #640: only Hopper GPUs with Triton >= 3.4.0 and < 3.7.1 and no tilelang; fla's flags pretended."""
    import importlib.util

    import fla.utils

    for flag, value in (("IS_NVIDIA_HOPPER", hopper), ("TRITON_ABOVE_3_4_0", above_3_4_0), ("TRITON_ABOVE_3_7_1", above_3_7_1)):
        monkeypatch.setattr(fla.utils, flag, value)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (object() if tilelang else None) if name == "tilelang"
                        else find_spec(name, *args))
    dispatch.fla_refuses_gated_backward.cache_clear()
    try:
        assert dispatch.fla_refuses_gated_backward() is refused
    finally:
        dispatch.fla_refuses_gated_backward.cache_clear()


def test_fla_is_asked_about_its_gated_backward():
    dispatch.fla_refuses_gated_backward.cache_clear()
    assert dispatch.fla_refuses_gated_backward() is False  # no Hopper GPU here
