"""Analytic costs against the built model, torch's FLOP counter, the engine's cache and the paper."""

import json
import re

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import archlab
import archlab.kv
import blocks.attention
from archlab.bench import device_name
from archlab.block import FLOP_KINDS, MixerInput
from archlab.cost import Cost, equal_flops_steps, peak_flops
from archlab.engine import Engine
from conftest import PAPER, ROOT, TINY, ids, tiny_model

MIB = 2**20


def paper(name):
    return archlab.load_spec(ROOT / "specs" / "paper" / f"{name}.yaml")


@pytest.mark.parametrize("path", TINY + PAPER, ids=ids(TINY + PAPER))
def test_analytic_params_equal_the_built_model(path):
    spec = archlab.load_spec(path)
    model = archlab.build_model(spec, device="meta")
    assert Cost(spec).params_total == sum(p.numel() for p in model.parameters())


def test_active_params_are_what_one_token_touches():
    """Route one token through an MoE model: the weights it gives a gradient are the active ones."""
    spec = archlab.load_spec(ROOT / "specs/tiny/yoco-u-moe.yaml")
    data = spec.model_dump(mode="json")
    data["loop"]["times"] = 1  # one pass, so each MoE layer routes the token once
    spec = archlab.validate_spec(data)
    model = archlab.build_model(spec)
    logits, _ = model(torch.tensor([[7]]), return_aux=True)
    logits.sum().backward()
    touched = 0
    for name, p in model.named_parameters():
        if name.endswith(("ffn.gate_up", "ffn.down")):  # [experts, ...]: count the experts used
            touched += int((p.grad.flatten(1).abs().sum(1) > 0).sum()) * p[0].numel()
        else:
            touched += p.numel()
    cost = Cost(spec)
    assert touched == cost.params_active < cost.params_total


COUNTED_IN_TRAINING = ("matmul", "mixer", "conv")  # SDPA on the CPU and solve_triangular have no FLOP formula in torch
# The analytic counts and torch's counter agree exactly on every tiny spec (integers, no rounding,
# MoE included: each routed token is one expert's matmul whatever the routing), so the checks
# below are exact: a tolerance would hide a dropped or tripled small term (a block's conv is ~1% of the total).


@pytest.mark.parametrize("path", TINY, ids=ids(TINY))
def test_forward_flops_match_torch_flop_counter(path):
    spec = archlab.load_spec(path)
    model = archlab.build_model(spec)
    n = 40  # crosses the window (16) and the chunk sizes (16)
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, spec.vocab_size, (2, n)), return_aux=True)
    analytic = Cost(spec).forward_flops(n)
    expected = 2 * sum(analytic[kind] for kind in COUNTED_IN_TRAINING)
    assert counter.get_total_flops() == expected


def test_forward_flops_of_a_loop_that_shares_k_v():
    """Iterations after the first project queries only: the analytic count says so, and so does torch."""
    rins = archlab.load_spec(ROOT / "specs/tiny/rins.yaml")
    data = rins.model_dump(mode="json")
    data["loop"]["kv_cache"] = "shared"
    shared = archlab.validate_spec(data)
    with FlopCounterMode(display=False) as counter:
        archlab.build_model(shared)(torch.randint(0, 256, (2, 40)))
    analytic = Cost(shared).forward_flops(40)
    assert counter.get_total_flops() == 2 * sum(analytic[k] for k in COUNTED_IN_TRAINING)
    assert analytic["matmul"] < Cost(rins).forward_flops(40)["matmul"]


def einsum_attend(q, k, v, mask):
    """Attention as two einsums that torch's FLOP counter sees (the CPU SDPA kernel it does not)."""
    repeat = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    scores = torch.einsum("bnhd,bmhd->bhnm", q, k) / q.shape[-1] ** 0.5
    if mask is None:  # plain causal
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    return torch.einsum("bhnm,bmhd->bnhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)



def test_several_shared_experts_are_counted_as_built_and_as_run():
    """The shipped MoE specs have one shared expert, so a shared FFN built as wide as one expert
    whatever ``n_shared`` said agreed with every other test; two must be twice the width."""
    data = archlab.load_spec(ROOT / "specs/tiny/yoco-u-moe.yaml").model_dump(mode="json")
    data["ffn"]["n_shared"] = 2
    spec = archlab.validate_spec(data)
    model = archlab.build_model(spec)
    assert model.layers[0].ffn.shared.down.in_features == 2 * spec.ffn.expert_hidden
    assert Cost(spec).params_total == sum(p.numel() for p in model.parameters())
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, spec.vocab_size, (2, 40)), return_aux=True)
    assert counter.get_total_flops() == 2 * sum(Cost(spec).forward_flops(40)[kind] for kind in COUNTED_IN_TRAINING)


@pytest.mark.parametrize("path", TINY, ids=ids(TINY))
@pytest.mark.parametrize("context", [5, 30])
def test_decode_flops_match_torch_flop_counter(path, context, monkeypatch):
    """A decoding step reads exactly the keys it may see, so attention is counted too; the
    recurrent state updates are elementwise and stay out of both sides."""
    monkeypatch.setattr(blocks.attention, "attend", einsum_attend)
    monkeypatch.setattr(archlab.kv, "attend", einsum_attend)  # the cross-decoder reads its K,V through it
    spec = archlab.load_spec(path)
    model = archlab.build_model(spec).eval()
    engine = Engine(model)
    cache = engine.new_cache(1, context)
    with torch.no_grad():
        if context > 1:
            engine.prefill([torch.randint(0, spec.vocab_size, (context - 1,))], cache)
        with FlopCounterMode(display=False) as counter:
            engine.feed(torch.tensor([[3]]), torch.tensor([context - 1]), cache, full=True)
    analytic = Cost(spec).decode_flops(context)
    expected = sum(v for kind, v in analytic.items() if kind != "state_update")
    assert analytic["attention"] > 0
    assert counter.get_total_flops() == expected


@pytest.mark.parametrize("name", ["transformer", "yoco", "rins", "parscale", "upper-loop-no-shared-kv"])
def test_forward_attention_is_the_sum_of_decode_steps(name):
    cost = Cost(archlab.load_spec(ROOT / "specs/tiny" / f"{name}.yaml"))
    n = 45
    assert cost.forward_flops(n)["attention"] == sum(cost.decode_flops(c)["attention"] for c in range(1, n + 1))


def test_attention_pairs_are_the_pairs_counted_one_by_one():
    """A query at position p sees the keys k with 0 <= p - k < W. The closed form's constant term
    for a window (the pairs of the first W positions) cancels in a span that starts past the
    window and in a sum of decoding steps, so the other tests cannot see it: here every (query,
    key) pair is counted, for spans that start before, at and past the window."""
    from archlab.ops.attention import attention_pairs

    for window in (None, 1, 4, 16):
        for start in (0, 3, 4, 5, 16, 17, 40):
            for n in (1, 2, 5, 16, 17, 33):
                counted = sum(1 for q in range(start, start + n) for k in range(q + 1) if window is None or q - k < window)
                assert attention_pairs(n, start, window) == counted, (window, start, n)


@pytest.mark.parametrize("path", TINY, ids=ids(TINY))
def test_cache_bytes_equal_the_engine(path):
    spec = archlab.load_spec(path)
    model = archlab.build_model(spec).eval()
    engine, cost = Engine(model), Cost(spec)
    for context in (1, 7, 16, 17, 40, 300):
        assert engine.new_cache(2, context).bytes_per_sequence() == cost.cache_bytes(context)
    generated = engine.generate([torch.randint(0, 256, (20,))], 12).cache  # 32 tokens held
    assert generated.bytes_per_sequence() == cost.cache_bytes(32)


@pytest.mark.parametrize("name", ["yoco-u-gdn", "yoco-u-mamba2", "yoco-u-retnet"])
def test_a_float64_reference_model_is_costed_and_checked_as_built(name):
    """Recurrent states are kept float32 or wider: in float64, twice the 4 bytes each that the
    formulas had fixed, and ``build``'s check of a float64 model said that making the cache raised
    (there was no float64 in the cost's dtypes), skipping its decoding checks."""
    from archlab.checks import cpu_check

    model = tiny_model(name)[1].double().eval()
    cache = Engine(model).new_cache(1, 40)
    assert {t.dtype for state in cache.layers.values() for t in state.values() if t.is_floating_point()} == {torch.float64}
    assert cache.bytes_per_sequence() == Cost(model.spec).cache_bytes(40, "float64")
    check = cpu_check(model, 16)
    assert check.finite and check.problems == [], check.problems


def test_complexity_classes_of_the_paper():
    n = 16 * 1024
    yoco, yoco_u, transformer = Cost(paper("yoco")), Cost(paper("yoco-u")), Cost(paper("transformer"))
    ut, rins = Cost(paper("universal-transformer")), Cost(paper("rins"))

    def total(flops):
        return sum(flops.values())

    # prefill: linear for yoco-u (equal increments), quadratic for the transformer
    f = [total(yoco_u.prefill_flops(k * n)) for k in (1, 2, 4)]
    assert f[2] - f[1] == 2 * (f[1] - f[0])
    g = [total(transformer.prefill_flops(k * n)) for k in (1, 2, 4)]
    assert g[2] - g[1] > 3 * (g[1] - g[0])
    # global cache O(N) with no T factor; the local part carries T
    for k in (1, 4):
        assert yoco_u.cache_bytes(k * n).global_ == yoco.cache_bytes(k * n).global_ == k * yoco.cache_bytes(n).global_
        assert yoco_u.cache_bytes(k * n).local == 3 * yoco.cache_bytes(k * n).local
    # looped transformers carry their loop factor in the cache
    assert ut.cache_bytes(n).total == 2 * transformer.cache_bytes(n).total
    assert rins.cache_bytes(n).total == (3 * 10 + 10) * transformer.cache_bytes(n).total // 20
    # decode: the self-decoder's part does not grow with the context
    per_step = [total(yoco_u.decode_flops(k * n)) for k in (1, 2, 4)]
    assert per_step[2] - per_step[1] == 2 * (per_step[1] - per_step[0])  # only the cross-decoder's reads grow


@pytest.mark.parametrize(
    "name,mib",
    [
        ("transformer", {16: 640, 64: 2560, 256: 10240}),
        ("yoco", {256: 522}),
        ("yoco-u", {16: 62, 64: 158, 256: 542}),
        ("rins", {16: 1280, 64: 5120, 256: 20480}),
    ],
)
def test_kv_memory_matches_the_paper(name, mib):
    cost = Cost(paper(name))
    for k, expected in mib.items():
        assert cost.cache_bytes(k * 1024).total / MIB == expected


def test_equal_flops_steps():
    yoco, yoco_u = paper("yoco"), paper("yoco-u")
    steps = equal_flops_steps(yoco_u, 20_000, yoco, 8192)
    ref = 20_000 * Cost(yoco_u).train_flops_per_token(8192)
    per_step = Cost(yoco).train_flops_per_token(8192)
    assert steps * per_step <= ref < (steps + 1) * per_step
    assert steps > 20_000
    assert equal_flops_steps(yoco, 1234, yoco, 8192) == 1234
    looped, shared = (archlab.load_spec(ROOT / "specs" / "tiny" / f"{name}.yaml") for name in ("upper-loop-no-shared-kv", "yoco-u"))
    steps = equal_flops_steps(looped, 123_457, shared, 129)  # per-token figures, each rounded down, gave one step more
    per_looped, per_shared = (sum(Cost(spec).forward_flops(129).values()) for spec in (looped, shared))
    assert steps * per_shared <= 123_457 * per_looped < (steps + 1) * per_shared


@pytest.mark.parametrize(("threads", "named"), [(1, "CPU (1 thread)"), (2, "CPU (2 threads)")])
def test_a_cpu_is_named_with_its_threads(monkeypatch, threads, named):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert device_name(torch.device("cpu")) == named


def test_peak_flops_by_device_name():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989.4e12
    assert peak_flops("NVIDIA H100 NVL") == peak_flops("NVIDIA H200 NVL") == 835.5e12  # the NVL cards run slower
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("AMD Instinct MI300X") == 1307.4e12
    with pytest.warns(UserWarning, match="no peak FLOP/s known"):
        assert peak_flops("Some Future Accelerator") is None


@pytest.mark.parametrize("order", [1, -1], ids=["as listed", "reversed"])
def test_peak_flops_takes_the_longest_name_matched_in_any_order_of_the_table(monkeypatch, order):
    """A name holds every shorter key it extends ("NVIDIA H100 PCIe" holds "H100", "NVIDIA GH200"
    holds "H200"): the longest match is the card's, wherever the table lists it, and neither the
    first match nor the last in alphabetical order ("H200" > "GH200"). Names match in any case."""
    table = {"H100 PCIe": 1.0, "H100": 2.0, "GH200": 3.0, "H200": 4.0}
    monkeypatch.setattr("archlab.cost.PEAK_FLOPS", dict(list(table.items())[::order]))
    assert peak_flops("NVIDIA H100 PCIe") == 1.0
    assert peak_flops("NVIDIA H100 80GB HBM3") == 2.0
    assert peak_flops("NVIDIA GH200 480GB") == 3.0
    assert peak_flops("NVIDIA H200") == 4.0
    assert peak_flops("nvidia h100 pcie") == 1.0


def test_cost_docs_are_up_to_date():
    from archlab.cost import cost_doc

    page = ROOT / "docs" / "costs.md"
    specs = [(spec.name, spec) for spec in map(archlab.load_spec, PAPER)]
    lengths = [16 * 1024, 64 * 1024, 256 * 1024]
    command = "archlab cost specs/paper --seq-len 16K 64K 256K --doc docs/costs.md"
    assert page.read_text() == cost_doc(specs, lengths, command), "run: " + command


def test_tiny_model_costs_run():
    spec, model = tiny_model("yoco-u")
    row = Cost(spec).row(1024)
    cache = Engine(model).new_cache(1, 1024)
    states = (*cache.global_kv.values(), *cache.layers.values())
    held = sum(t.numel() * t.element_size() for state in states for t in state.values())
    global_kv = 1024 * 2 * 2 * 16 * 4  # rows x (K, V) x kv heads x head dim x fp32, written once
    rings = 3 * 2 * (16 * 2 * 2 * 16 * 4)  # T x self-decoder layers x a window ring of 16 rows
    assert (row.kv_global_bytes, row.kv_local_bytes) == (global_kv, rings)
    assert row.kv_total_bytes == held == global_kv + rings  # every tensor the engine allocates
    assert row.prefill_flops > row.decode_flops > 0


def test_the_readable_table_keeps_a_small_cache_visible():
    """A tiny spec's window cache is tens of KiB: the table shows it, not a rounded 0."""
    from archlab.cost import readable
    from archlab.table import Format, render

    row = Cost(archlab.load_spec(ROOT / "specs" / "tiny" / "yoco-u.yaml")).row(2048)
    cells = dict(zip(*(line.strip("|").split(" | ") for line in render([readable(row)], Format.md).splitlines()[::2])))
    assert 0 < row.kv_local_bytes < 2**20 / 20
    assert float(cells["KV local MiB"]) == pytest.approx(row.kv_local_bytes / 2**20, rel=1e-2)


def test_a_name_holding_a_pipe_keeps_its_markdown_row_whole(tmp_path, cli):
    """A run folder or spec named x|y gave its row an extra column in every markdown table."""
    from archlab.table import Format, render

    rows = [{"spec": "a|b", "note|s": None, "params": 3}]
    table = render(rows, Format.md)
    assert table.splitlines()[0] == "| spec | note\\|s | params |" and table.splitlines()[2] == "| a\\|b | - | 3 |"
    assert {len(re.split(r"(?<!\\)\|", line)) for line in table.splitlines()} == {5}  # four unescaped pipes on each line
    assert "a|b" in render(rows, Format.csv) and json.loads(render(rows, Format.json))[0]["spec"] == "a|b"  # escaped in markdown alone
    spec = tmp_path / "piped.yaml"
    spec.write_text(f"extends: {ROOT / 'specs/tiny/yoco-u.yaml'}\nname: 'x|y'\n")
    code, out, stderr = cli("cost", spec, "--seq-len", "64")
    assert code in (0, None) and "| x\\|y |" in out, stderr


@pytest.mark.parametrize(
    "value, text",
    [(0, "0"), (4, "4.00"), (9.4e9, "9.40G"), (63e9, "63.0G"), (263e12, "263T"), (999.9, "1.00K"), (1.294e9, "1.29G"),
     (1.45e18, "1.45E"), (-1.294e9, "-1.29G"), (7.68e25, "76.8Y"), (999.96e24, "1.00e+27"), (5.12e48, "5.12e+48")],
)
def test_si_keeps_three_digits(value, text):
    """Every figure in a column carries three digits, and rounding up moves to the next prefix;
    past the last prefix the exponent is written out, not 7.68e+07E."""
    from archlab.table import si

    assert si(value) == text


def test_a_cost_past_the_integers_a_float_holds_shows_no_made_up_digits():
    from archlab.table import Format, render

    said = render([{"KV MiB": 2.0**53 - 1}, {"KV MiB": 24414062499999997952.0}], Format.md).splitlines()[2:]
    assert said == ["| 9,007,199,254,740,991.0 |", "| 2.44e+19 |"]  # not 24,414,062,499,999,997,952.0


def test_a_table_has_every_column_any_row_has_in_each_format():
    """Rows that differ in their columns (a bench row with a page size beside one without) make one
    table of every column, in the order first met: a row lacking one shows "-" in markdown, an empty
    cell in CSV and null in JSON. Negative figures read as positive ones do (commas past 10, the
    exponent past 2**53), and integers take commas."""
    import json

    from archlab.table import Format, render

    rows = [{"spec": "a", "tok/s": 12345.6, "gain": -12345.6}, {"spec": "b", "page": 1234567, "gain": -(2.0**60)}]
    assert render(rows, Format.md) == ("| spec | tok/s | gain | page |\n|---|---|---|---|\n"
                                       "| a | 12,345.6 | -12,345.6 | - |\n| b | - | -1.15e+18 | 1,234,567 |\n")
    assert render(rows, Format.csv) == f"spec,tok/s,gain,page\na,12345.6,-12345.6,\nb,,{-(2.0**60)!r},1234567\n"
    said = render(rows, Format.json)
    assert said.endswith("}\n]\n") and json.loads(said) == [{"spec": "a", "tok/s": 12345.6, "gain": -12345.6, "page": None},
                                                          {"spec": "b", "tok/s": None, "gain": -(2.0**60), "page": 1234567}]


class StateSizedWork(TorchDispatchMode):
    """Elementwise work on whole recurrent states: one FLOP per element of each product, sum,
    difference or exponential at least a state in size (a reduction counts its input)."""

    ELEMENTWISE = {torch.ops.aten.mul, torch.ops.aten.add, torch.ops.aten.sub, torch.ops.aten.exp, torch.ops.aten.sum}

    def __init__(self, state_size: int):
        super().__init__()
        self.state_size, self.flops = state_size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket in self.ELEMENTWISE:
            touched = args[0] if func._overloadpacket is torch.ops.aten.sum else out
            if isinstance(touched, torch.Tensor) and touched.numel() >= self.state_size:
                self.flops += touched.numel()
        return out


@pytest.mark.parametrize(
    "name, recurrent_key, other_keys",  # the keys of each block's new_state (blocks/*.py)
    [
        ("yoco-u-retnet", "S", set()),
        ("yoco-u-gdn", "S", {"q_conv", "k_conv", "v_conv"}),
        ("yoco-u-mamba2", "ssm", {"conv"}),
    ],
    ids=["yoco-u-retnet", "yoco-u-gdn", "yoco-u-mamba2"],
)
def test_state_update_flops_are_the_work_of_a_decoding_step(name, recurrent_key, other_keys):
    """The analytic state update of one token (beside its conv tail) is the elementwise work the
    recurrent step does on its state: RetNet's was counted as 4 passes over it where it makes 5."""
    spec = archlab.load_spec(ROOT / "specs/tiny" / f"{name}.yaml")
    block, ctx = spec.block_at(0), spec.build_context(0)
    mixer = block.build(ctx).eval()
    state = mixer.new_state(1, 8, torch.float32)
    assert set(state) == {recurrent_key} | other_keys
    recurrent = state[recurrent_key].numel()
    # every other state (the conv tails) is smaller, so the counter's size threshold leaves their updates out
    assert all(state[key].numel() < recurrent for key in other_keys), {key: t.numel() for key, t in state.items()}
    x = torch.randn(1, 1, spec.d_model)
    counter = StateSizedWork(recurrent)
    with torch.no_grad(), counter:
        mixer(x, MixerInput(positions=torch.tensor([[3]]), state=state))
    conv = block.flops(ctx, 2).get("conv", 0) // 2
    assert counter.flops == block.flops(ctx, 1)["state_update"] - conv


@pytest.mark.parametrize("path", TINY, ids=ids(TINY))
def test_every_flop_kind_is_a_named_one(path):
    """A kind misspelt in a block's formula would be summed unnoticed under a name of its own."""
    cost = Cost(archlab.load_spec(path))
    for kinds in (cost.forward_flops(40), cost.prefill_flops(40), cost.decode_flops(40)):
        assert set(kinds) <= FLOP_KINDS.keys()


def test_a_cost_asked_at_a_length_that_is_not_one_names_it():
    """A negative or fractional length reached a block's formula, which was then blamed for its answer."""
    cost = Cost(archlab.load_spec(ROOT / "specs" / "tiny" / "yoco-u.yaml"))
    for ask, said in ((lambda: cost.row(-5), "seq_len must be a whole number of tokens >= 1, got -5"),
                      (lambda: cost.row(2.5), "seq_len must be a whole number of tokens >= 1, got 2.5"),
                      (lambda: cost.row("2K"), "seq_len must be a whole number of tokens >= 1, got '2K'"),
                      (lambda: cost.cache_bytes(-10), "context must be a whole number of tokens >= 0, got -10"),
                      (lambda: cost.decode_flops(0), "context must be a whole number of tokens >= 1, got 0"),
                      (lambda: cost.prefill_flops(0), "n must be a whole number of tokens >= 1, got 0"),
                      (lambda: cost.cache_bytes(10, "bf16"), "dtype must be one of float32, bfloat16, float16, float64, got 'bf16'")):
        with pytest.raises(ValueError, match=re.escape(said)):
            ask()
    assert cost.row(np.int64(64)) == cost.row(64) and cost.cache_bytes(0).global_ == 0


def test_flops_budget_buys_no_step_more_than_its_flops():
    """`train --flops` divides by whole sequences' FLOPs, as equal-flops does: the per-token figure,
    rounded down (at seq_len 1000, yoco-u-gdn's 3 x forward is not a multiple of 1000), bought
    282,697 steps of 2e16 FLOPs where 282,696 spend no more than the budget."""
    from rich.console import Console

    from archlab.cli import _budget_steps
    from archlab.train.config import load_config

    spec = archlab.load_spec(ROOT / "specs" / "tiny" / "yoco-u-gdn.yaml")
    cfg = load_config(None, ["seq_len=1000", "batch_size=16"])
    per_step = 3 * sum(Cost(spec).forward_flops(1000).values()) * 16
    assert per_step % (16 * 1000)  # the per-token figure is rounded here
    budget = 2e16
    steps = _budget_steps(spec, cfg, None, None, budget, Console(quiet=True))
    assert steps * per_step <= budget < (steps + 1) * per_step
    assert steps == 282_696


def test_tied_embeddings_are_counted_once_as_the_model_holds_them():
    """Every shipped spec unties its head, so a tied one counted as two tables agreed with every
    other test; the model holds one (``parameters()`` yields a shared tensor once)."""
    spec = archlab.load_spec(ROOT / "specs/tiny/transformer.yaml", ["tie_embeddings=true"])
    model = archlab.build_model(spec, device="meta")
    untied = Cost(archlab.load_spec(ROOT / "specs/tiny/transformer.yaml"))
    assert Cost(spec).params_total == sum(p.numel() for p in model.parameters())
    assert untied.params_total - Cost(spec).params_total == spec.vocab_size * spec.d_model


@pytest.mark.parametrize("name", ["transformer", "yoco", "upper-loop", "rins", "parscale"])
def test_prefill_matmul_flops_match_torch_flop_counter(name, monkeypatch):
    """A prompt's prefill runs the prefill steps over all its tokens but the last, without the head,
    then the last token through the whole model: its matmuls counted by torch on the engine's own
    prefill (the decode test counts only the step after it). Attention is left out: the prefill's
    einsums compute every (query, key) pair of a chunk and mask the rest."""
    monkeypatch.setattr(blocks.attention, "attend", einsum_attend)
    monkeypatch.setattr(archlab.kv, "attend", einsum_attend)
    spec = archlab.load_spec(ROOT / "specs/tiny" / f"{name}.yaml")
    engine = Engine(archlab.build_model(spec).eval())
    n = 23
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        engine.prefill([torch.randint(0, spec.vocab_size, (n,))], engine.new_cache(1, n))
    counted = counter.get_flop_counts()["Global"]
    matmuls = sum(v for op, v in counted.items() if op in (torch.ops.aten.mm, torch.ops.aten.addmm))
    assert matmuls == Cost(spec).prefill_flops(n)["matmul"] > 0


def test_parscale_keeps_a_window_ring_per_stream():
    """The shipped ParScale spec holds only full attention, so the local part of its cache was
    never multiplied by its streams in any test: with window attention, every stream keeps its own ring."""
    data = archlab.load_spec(ROOT / "specs/tiny/parscale.yaml").model_dump(mode="json")
    data["layout"]["layers"]["blocks"] = [{"type": "swa", "window": 8, "n_heads": 4, "n_kv_heads": 2},
                                          {"type": "attention", "n_heads": 4, "n_kv_heads": 2}]
    spec = archlab.validate_spec(data)
    engine, cost = Engine(archlab.build_model(spec).eval()), Cost(spec)
    for context in (3, 20):
        held = engine.new_cache(1, context).bytes_per_sequence()
        assert held == cost.cache_bytes(context) and held.local > 0
    plain = data | {"parscale": None}
    assert cost.cache_bytes(20).local == 2 * Cost(archlab.validate_spec(plain)).cache_bytes(20).local
