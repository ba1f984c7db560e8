"""A block's own code that fails (its check, a cost formula, a forward giving back another shape)
is named with the block and its plugin in one line, not shown as a traceback through archlab. The
built-in sliding-window block stands in for a plugin, broken in this process alone (a plugin
installed from another package is tested in test_cli.py, in processes of their own)."""

import re
import types

import pytest
import torch
from torch import nn

import archlab
from archlab.block import CacheBytes, Flops
from archlab.cost import Cost
from archlab.registry import block_specs, plugin
from conftest import ROOT
from test_study import mini

SPEC = ROOT / "specs" / "tiny" / "yoco.yaml"  # its self-decoder is sliding-window attention


@pytest.fixture
def swa():
    return block_specs()["swa"]


def test_a_check_that_raises_is_a_problem_of_the_spec(cli, monkeypatch, swa):
    def check(self, ctx, problems):
        raise ValueError("no window fits")

    monkeypatch.setattr(swa, "check", check)
    code, _, stderr = cli("validate", SPEC)
    assert code == 1
    assert f"layout.self_decoder.blocks[0]: block 'swa' ({plugin(swa)}): its check raised ValueError: no window fits" in stderr


def test_a_cost_formula_that_raises_is_named(cli, monkeypatch, swa):
    """``cost`` goes on with the specs it can cost; a command that needs the formula to go on stops."""
    monkeypatch.setattr(swa, "params", lambda self, ctx: 1 // 0)
    said = f"block 'swa' ({plugin(swa)}): its params() raised ZeroDivisionError: integer division or modulo by zero"
    code, out, stderr = cli("cost", SPEC, ROOT / "specs" / "tiny" / "transformer.yaml", "--seq-len", "1K")
    assert code == 1 and f"error: yoco: {said}" in stderr
    assert "| transformer |" in out and "| yoco |" not in out
    code, out, stderr = cli("build", SPEC, ROOT / "specs" / "tiny" / "transformer.yaml")  # the other specs still checked
    assert code == 1 and f"error: yoco: {said}" in stderr and " not built" in out and " transformer " in out, stderr
    code, _, stderr = cli("generate", SPEC, "--prompt", "a", "--max-new-tokens", "1")
    assert code == 2 and f"error: {said}" in stderr, stderr


@pytest.mark.parametrize(("formula", "value", "wanted"), [
    ("flops", lambda self, ctx, n, start=0, reuse_kv=False: 2 * n, "a Flops (a Counter) of kinds"),  # a traceback in the sum
    ("params", lambda self, ctx: -1, "a whole number of 0 or more"),  # a table of negative parameters
    ("state_bytes", lambda self, ctx, context, kv_bytes: 1.5 * context, "a whole number of 0 or more"),
    ("flops", lambda self, ctx, n, start=0, reuse_kv=False: Flops(matmul=1.5 * n),  # equal-flops steps of 9.0, a study's TypeError
     "a Flops (a Counter) of kinds"),
])
def test_a_cost_formula_that_gives_back_something_else_is_named(cli, monkeypatch, swa, formula, value, wanted):
    monkeypatch.setattr(swa, formula, value)
    code, out, stderr = cli("cost", SPEC, ROOT / "specs" / "tiny" / "transformer.yaml", "--seq-len", "1K")
    assert code == 1 and f"error: yoco: block 'swa' ({plugin(swa)}): its {formula}() returned " in stderr, stderr
    assert f", where {wanted}" in stderr and "| transformer |" in out and "| yoco |" not in out


def test_a_forward_of_another_shape_is_named_and_training_writes_nothing(cli, monkeypatch, swa, tmp_path):
    """It failed in the residual add after it, naming neither the block nor the shapes; training
    failed there in its first step, after writing the run's files, and generate and bench on
    their first prompt."""
    built = swa.build

    def build(self, ctx):
        module = built(self, ctx)
        forward = module.forward
        module.forward = lambda x, inp: forward(x, inp)[..., 1:]
        return module

    monkeypatch.setattr(swa, "build", build)
    said = f"block 'swa' ({plugin(swa)}): its forward returned [{{}}, 63] for an x of [{{}}, 64]"
    code, out, stderr = cli("build", SPEC)
    assert code == 1 and f"error: yoco: {said.format('2, 64', '2, 64')}" in stderr and "1 problem(s)" in out
    run = tmp_path / "runs" / "a"
    code, _, stderr = cli("train", SPEC, "--out", run, "--steps", "1")
    assert code == 2 and f"error: {said.format('1, 16', '1, 16')}" in stderr
    assert not run.parent.exists()
    for command in (["generate", SPEC, "--max-new-tokens", "1"], ["bench", SPEC, "--seq-len", "8", "--gen", "1"]):
        code, _, stderr = cli(*command)
        assert code == 2 and f"error: {said.format('1, 16', '1, 16')}" in stderr, command
    study = mini(tmp_path, variants={"yoco": {"spec": "yoco.yaml"}}, lr={"low": 0.003, "high": 0.003, "points": 1})
    code, _, stderr = cli("study", "run", study, "--data", "mqar", "--out", tmp_path / "study")  # a trial records why it failed
    assert code == 1 and f"RegistryError: {said.format('1, 16', '1, 16')}" in (tmp_path / "study" / "report.md").read_text(), stderr
    assert not list((tmp_path / "study" / "trials").glob("*/*"))


def test_a_forward_that_raises_is_named_with_its_line(cli, monkeypatch, swa, tmp_path):
    """It gave a traceback through archlab's model in every command; training's first step had
    written the run's files before it."""
    built = swa.build

    def build(self, ctx):
        module = built(self, ctx)
        module.forward = types.MethodType(lambda mixer, x, inp: type(mixer).forward(mixer, x[..., 1:], inp), module)
        return module

    monkeypatch.setattr(swa, "build", build)
    source = (ROOT / "blocks" / "attention.py").read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if "self.qkv_proj(x)" in text)  # where the narrower x first fails
    said = re.compile(rf"block 'swa' \({re.escape(plugin(swa))}\): its forward raised RuntimeError: mat1 and mat2 shapes cannot be"
                      rf" multiplied \(\d+x63 and 64x\d+\) \(at attention\.py:{line}\)")
    code, out, stderr = cli("build", SPEC)
    assert code == 1 and said.search(" ".join(stderr.split())) and "1 problem(s)" in out and "Traceback" not in stderr, stderr
    run = tmp_path / "runs" / "a"
    for command in (["train", SPEC, "--out", run, "--steps", "1"], ["generate", SPEC, "--max-new-tokens", "1"],
                    ["bench", SPEC, "--seq-len", "8", "--gen", "1"]):
        code, _, stderr = cli(*command)
        assert code == 2 and said.search(" ".join(stderr.split())) and "Traceback" not in stderr, (command, stderr)
    assert not run.parent.exists()


def test_a_forward_in_another_dtype_is_named(cli, monkeypatch, swa, tmp_path):
    """Returned in float32 from a bfloat16 x, it passed build's float32 checks and then failed in
    the next layer's matmul, in a traceback, wherever the spec ran in its bfloat16 inference dtype."""
    built = swa.build

    def build(self, ctx):
        module = built(self, ctx)
        module.forward = types.MethodType(lambda mixer, x, inp: type(mixer).forward(mixer, x, inp).float(), module)  # bound to a copy too
        return module

    monkeypatch.setattr(swa, "build", build)
    spec = tmp_path / "yoco-bf16.yaml"
    spec.write_text(f"extends: {SPEC}\nname: yoco-bf16\ninference_dtype: bfloat16\n")
    said = f"block 'swa' ({plugin(swa)}): its forward returned float32 for an x of bfloat16; a block's forward gives back x's dtype"
    code, out, stderr = cli("build", spec)
    assert code == 1 and f"error: yoco-bf16: {said}" in stderr and "1 problem(s)" in out, stderr
    for command in (["generate", spec, "--max-new-tokens", "1"], ["bench", spec, "--seq-len", "8", "--gen", "1"]):
        code, _, stderr = cli(*command)
        assert code == 2 and f"error: {said}" in stderr, (command, stderr)
    assert cli("build", SPEC)[0] == 0  # in float32, its inference dtype, the same forward is what the layers after it take


def test_a_forward_narrower_than_its_x_is_widened_back(cli, monkeypatch, swa, tmp_path):
    """As one under its own autocast gives: the residual add widens it, the layers after compute in x's dtype."""
    built = swa.build

    def build(self, ctx):
        module = built(self, ctx)
        module.forward = types.MethodType(lambda mixer, x, inp: type(mixer).forward(mixer, x, inp).bfloat16(), module)
        return module

    monkeypatch.setattr(swa, "build", build)
    code, out, stderr = cli("build", SPEC)
    assert code == 0 and "its forward returned" not in stderr, stderr
    windowed = tmp_path / "yoco-w5000.yaml"  # a ring of 5,000 rows is not full at 4,096 tokens, and does not grow
    windowed.write_text(SPEC.read_text().replace("window: 16", "window: 5000"))
    monkeypatch.undo()
    code, out, stderr = cli("build", windowed)
    assert code == 0, stderr


@pytest.mark.parametrize(("change", "said"), [
    # a window's cache that forgets the window: equal to the cache up to the window (64), over it past
    # (two layers' 2,097,664 B of K,V rows for 4,097 tokens where their rings hold 32,768, beside the global 1,048,832)
    ("state_bytes", "state_bytes() give 3,146,496 B per sequence at 4,097 tokens in float32, the cache holds 1,081,600 B"),
    # a ring of the window's size flagged as growing: a prefill would leave an earlier prompt's keys in it
    ("grows_kv_cache", "grows_kv_cache is True, but no tensor of its state (k, v) grows with the context (from 1,048,576 to 2,097,152 tokens)"),
])
def test_cache_formulas_and_flags_are_checked_past_the_window(cli, monkeypatch, swa, change, said, tmp_path):
    spec = tmp_path / "yoco-w64.yaml"
    spec.write_text(SPEC.read_text().replace("window: 16", "window: 64"))
    if change == "state_bytes":
        sized = swa.state_bytes
        monkeypatch.setattr(swa, "state_bytes", lambda self, ctx, context, kv_bytes:
                            sized(self.model_copy(update={"window": 10**9}), ctx, context, kv_bytes))
    else:
        monkeypatch.setattr(swa, "grows_kv_cache", True)
    code, out, stderr = cli("build", spec)
    assert code == 1 and said in " ".join(stderr.split()) and "1 problem(s)" in out, stderr


def test_a_growing_state_not_flagged_is_named(cli, monkeypatch):
    """Counted as local by the costs, and copied whole by chat's mark and rewind."""
    monkeypatch.setattr(block_specs()["attention"], "grows_kv_cache", False)
    code, _, stderr = cli("build", ROOT / "specs" / "tiny" / "transformer.yaml")
    assert code == 1 and "grows_kv_cache is False, but its state's k, v grows with the context" in " ".join(stderr.split()), stderr


def test_training_refuses_a_params_formula_the_model_does_not_hold(cli, monkeypatch, swa, tmp_path):
    """Its FLOPs, MFU and a study's equal-FLOPs budgets are worked out from the formulas."""
    counted = swa.params
    monkeypatch.setattr(swa, "params", lambda self, ctx: counted(self, ctx) + 1)
    run = tmp_path / "runs" / "a"
    code, _, stderr = cli("train", SPEC, "--out", run, "--steps", "1", "--data", "mqar")
    assert code == 1 and "error: yoco: params() sum to 225,922, the built model holds 225,920; `archlab build` checks" in stderr, stderr
    assert not run.parent.exists()


class ShortConvThen(nn.Module):
    """A causal depthwise conv over a block's last inputs, then the block's own mixer: a state that
    does not grow (those inputs) beside one that does (the mixer's K,V), as attention with a
    short conv keeps."""

    def __init__(self, mixer: nn.Module, d_model: int, width: int = 4):
        super().__init__()
        self.mixer, self.conv = mixer, nn.Conv1d(d_model, d_model, width, groups=d_model, bias=False)

    def new_state(self, batch, capacity, dtype):
        inputs = torch.zeros(batch, self.conv.in_channels, self.conv.kernel_size[0] - 1, dtype=dtype)
        return {**self.mixer.new_state(batch, capacity, dtype), "inputs": inputs}

    def forward(self, x, inp):
        past = inp.state["inputs"] if inp.state is not None else x.new_zeros(x.shape[0], x.shape[2], self.conv.kernel_size[0] - 1)
        inputs = torch.cat([past.to(x.dtype), x.transpose(1, 2)], dim=2)
        if inp.state is not None:
            past.copy_(inputs[:, :, -past.shape[2]:])
        return self.mixer(self.conv(inputs).transpose(1, 2), inp)


@pytest.fixture
def short_conv_attention(monkeypatch):
    """The built-in attention block with a short conv before it, as a plugin would give it; its
    state_bytes() as given (``split``: the conv's inputs counted apart, as the cache holds them)."""
    attention = block_specs()["attention"]
    built, counted, sized = attention.build, attention.params, attention.state_bytes
    monkeypatch.setattr(attention, "build", lambda self, ctx: ShortConvThen(built(self, ctx), ctx.d_model))
    monkeypatch.setattr(attention, "params", lambda self, ctx: counted(self, ctx) + 4 * ctx.d_model)

    def state_bytes(self, ctx, context, kv_bytes):
        return CacheBytes(sized(self, ctx, context, kv_bytes), 3 * ctx.d_model * kv_bytes)

    monkeypatch.setattr(attention, "state_bytes", state_bytes)
    return attention


def test_a_block_whose_state_partly_grows_keeps_and_costs_each_part_as_it_is(cli, short_conv_attention, monkeypatch):
    """It was refused: a growing block's state grew in all its tensors or none. The cache tells the
    tensors apart by their sizes, and resets and rewinds the conv's inputs alone: kept as the K,V
    are, a prompt's last inputs were carried into the next prompt's first tokens."""
    spec_file = ROOT / "specs" / "tiny" / "transformer.yaml"
    code, out, stderr = cli("build", spec_file)
    assert code == 0 and " ok " in out, out + stderr
    spec = archlab.load_spec(spec_file)
    torch.manual_seed(0)
    model = archlab.build_model(spec).eval()
    engine = archlab.Engine(model)
    held = engine.new_cache(2, 40).bytes_per_sequence()
    assert held == Cost(spec).cache_bytes(40, "float32") and held.local == spec.n_layers * 3 * spec.d_model * 4
    first, second = [[5, 6, 7, 8, 9, 10], [11, 12, 13]], [[20, 21, 22, 23], [24, 25, 26, 27, 28]]
    cache = engine.new_cache(2, 40)
    list(engine.stream(first, 8, cache=cache))  # a cache used, then reused for other prompts
    reused = [logits for _, logits, _ in engine.stream(second, 8, cache=cache)]
    fresh = [logits for _, logits, _ in engine.stream(second, 8)]
    assert max((a - b).abs().max().item() for a, b in zip(reused, fresh)) < 1e-5
    marked = cache.mark()  # as chat marks a prompt and rewinds to it
    assert len(marked) == spec.n_layers and all(t.shape == (2, spec.d_model, 3) for t in marked)
    tokens, positions = torch.tensor([[1], [2]]), torch.tensor([len(p) + 8 for p in second])
    stepped = engine.decode(tokens, positions, cache)
    cache.rewind(marked)
    assert torch.equal(engine.decode(tokens, positions, cache), stepped)
    split = short_conv_attention.state_bytes  # given as one number, the costs count it all as the flag says
    monkeypatch.setattr(short_conv_attention, "state_bytes", lambda self, *args: split(self, *args).total)
    code, out, stderr = cli("build", spec_file)
    said = " ".join(stderr.split())
    assert code == 1 and re.search(r"state_bytes\(\) count [\d,]+ B per sequence at 1 token as growing with the context and 0 B as"
                                   rf" not; the cache's tensors that grow hold [\d,]+ B, the others {spec.n_layers * 3 * spec.d_model * 4:,} B \(a block whose state both"
                                   r" grows and does not gives state_bytes\(\) as archlab.block.CacheBytes\(global_, local\): the bytes of"
                                   r" the tensors that grow, then of the others\)", said), said


def test_a_block_keeping_more_than_its_kv_in_a_shared_loop_is_told_why_it_decodes_otherwise(cli, short_conv_attention, tmp_path):
    """Every iteration of a loop with kv_cache: shared is handed the first's state: the K,V it may
    share, and the conv's last inputs, which it may not. build asked only whether the forward reads
    and updates inp.state, which it does."""
    spec = tmp_path / "looped.yaml"
    spec.write_text(f"extends: {ROOT / 'specs' / 'tiny' / 'transformer.yaml'}\nname: looped\n"
                    "loop: {position: all, times: 2, kv_cache: shared}\n")
    code, _, stderr = cli("build", spec)
    said = " ".join(stderr.split())
    assert code == 1 and "decoding prompts of different lengths token by token differs from full forward passes" in said, said
    assert ("in a loop with kv_cache: shared, every iteration of attention is handed the one state of the first: a block that keeps"
            " more there than its K,V (a conv's last inputs) cannot share it, and sets shares_kv false") in said, said
    spec.write_text(spec.read_text().replace("kv_cache: shared", "kv_cache: per_iteration"))  # a state for each iteration
    code, _, stderr = cli("build", spec)
    assert code == 0, stderr


def test_a_state_replaced_rather_than_updated_in_place_is_named(cli, short_conv_attention, monkeypatch):
    """It decoded right on the CPU, where the cache reads its dict again at every step; a CUDA graph
    replays on the tensors new_state made."""
    class Replacing(ShortConvThen):
        def forward(self, x, inp):
            if inp.state is not None:
                inp.state["inputs"] = inp.state["inputs"].clone()
            return super().forward(x, inp)

    built = short_conv_attention.build
    monkeypatch.setattr(short_conv_attention, "build", lambda self, ctx: Replacing(built(self, ctx).mixer, ctx.d_model))
    code, _, stderr = cli("build", ROOT / "specs" / "tiny" / "transformer.yaml")
    assert code == 1 and ("decoding replaced attention's inputs in inp.state with other tensors rather than updating them in place"
                          " (copy_, or an op's out=)") in " ".join(stderr.split()), stderr


def test_a_growing_block_with_a_context_limit_of_its_own_still_generates(monkeypatch):
    """The cache asks each growing block for a state of 2,097,152 positions (on the meta device) to
    tell its tensors apart; one that refuses so many has its whole state taken as growing."""
    attention = block_specs()["attention"]
    built = attention.build

    def build(self, ctx):
        module = built(self, ctx)
        made = module.new_state

        def new_state(batch, capacity, dtype):
            if capacity > 100_000:
                raise ValueError(f"this block holds at most 100,000 positions, not {capacity:,}")
            return made(batch, capacity, dtype)

        module.new_state = new_state
        return module

    monkeypatch.setattr(attention, "build", build)
    model = archlab.build_model(archlab.load_spec(ROOT / "specs" / "tiny" / "transformer.yaml"))
    assert len(archlab.generate(model, [[1, 2, 3]], 2).tokens[0]) == 2


def test_a_forward_whose_module_no_file_holds_is_named_without_its_line():
    """A block defined in a notebook's cell: looking up the file raised in place of the block's own error."""
    from archlab.checks import _raised_at

    cell = type("Cell", (nn.Module,), {"__module__": "cell_of_a_notebook"})
    try:
        raise ValueError("the block's own error")
    except ValueError as exc:
        assert _raised_at(cell, exc) == ""


def test_builds_decoding_check_measures_its_error_against_the_largest_logit():
    """``build`` compares decoding with full passes relative to the largest logit: the same model
    with its logits scaled by 1e4 (its head's weights) shows the same small error, where an
    absolute one would grow 1e4-fold and call a correct cache wrong."""
    from archlab.checks import DECODE_TOLERANCE, decode_error

    model = archlab.build_model(archlab.load_spec(ROOT / "specs" / "tiny" / "yoco-u.yaml"))
    torch.manual_seed(0)
    plain, _ = decode_error(model, 24)
    with torch.no_grad():
        model.head.weight.mul_(1e4)
    torch.manual_seed(0)
    scaled, _ = decode_error(model, 24)
    assert plain <= DECODE_TOLERANCE / 10 and scaled <= DECODE_TOLERANCE / 10, (plain, scaled)
