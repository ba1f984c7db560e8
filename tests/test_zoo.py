"""Every shipped spec validates; every tiny spec builds, runs forward and backward, and is causal."""

import json
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

import archlab
from conftest import PAPER, ROOT, TINY, ids

SEQ = 40  # longer than the tiny window (16) and the tiny chunk sizes (16)


def test_zoo_is_complete():
    names = {p.stem for p in TINY}
    expected = {
        "transformer", "yoco", "yoco-u", "universal-transformer", "rins", "parscale", "upper-loop",
        "upper-loop-no-shared-kv", "deeper", "yoco-u-swa", "yoco-u-retnet", "yoco-u-mamba2",
        "yoco-u-gdn", "yoco-u-moe",
    }
    assert names == expected
    assert {p.stem for p in PAPER} == expected


@pytest.mark.parametrize("path", TINY + PAPER, ids=ids(TINY + PAPER))
def test_spec_validates_and_round_trips(path):
    spec = archlab.load_spec(path)
    again = archlab.validate_spec(spec.model_dump(mode="json"), "round-trip")
    assert again == spec
    for _, half in spec.halves:  # nothing downstream can change a validated spec's layers
        assert isinstance(half.blocks, tuple)
        with pytest.raises(ValidationError):
            half.n_layers = 1


FIRST_USE = """
import json, sys
from archlab.spec import Half, ModelSpec, load_yaml
data = load_yaml(sys.argv[2])
if sys.argv[1] == "init":
    half = ModelSpec(**data).layout.self_decoder
elif sys.argv[1] == "validate":
    half = ModelSpec.model_validate(data).layout.self_decoder
else:
    half = Half.model_validate(data["layout"]["self_decoder"])
print(json.dumps(half.model_dump(mode="json")))
"""


@pytest.mark.parametrize("first_use", ["init", "validate", "half"])
def test_a_spec_model_made_directly_knows_the_installed_blocks(first_use):
    """``ModelSpec(**data)``, ``model_validate`` or a half's, first in a process: its ``Block`` was
    bound to the installed plugins only by ``load_spec`` and ``validate_spec``, and pydantic said
    the model was not fully defined."""
    path = ROOT / "specs" / "tiny" / "yoco-u-gdn.yaml"
    done = subprocess.run([sys.executable, "-c", FIRST_USE, first_use, str(path)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == archlab.load_spec(path).layout.self_decoder.model_dump(mode="json")


@pytest.mark.parametrize("path", PAPER, ids=ids(PAPER))
def test_paper_spec_shape(path):
    spec = archlab.load_spec(path)
    assert spec.inference_dtype == "bfloat16"
    if spec.name != "deeper":
        assert spec.d_model == 2048 and spec.n_layers == 20
        assert [h.n_layers for _, h in spec.halves] in ([10, 10], [20])
    if spec.layout.type == "yoco":
        kv = spec.layout.global_kv
        assert (kv.n_kv_heads, kv.head_dim) == ((4, 128) if spec.name != "deeper" else (4, 112))
        assert spec.layout.self_decoder.blocks[0].type != "swa" or spec.layout.self_decoder.blocks[0].window == 512
    model = archlab.build_model(spec, device="meta")
    assert sum(p.numel() for p in model.parameters()) > 1_000_000_000


def test_a_sliding_window_given_no_size_is_the_papers():
    """The paper's self-decoders attend over windows of 512 (keys i-511..i); a spec that leaves the
    window out gets it, and a window of one key more or less changes every cost and result."""
    from blocks.swa import SlidingWindowSpec

    assert SlidingWindowSpec(type="swa").window == SlidingWindowSpec(type="swa").window_size() == 512


@pytest.mark.parametrize("path", TINY, ids=ids(TINY))
def test_tiny_forward_backward_finite(path):
    spec = archlab.load_spec(path)
    model = archlab.build_model(spec)
    params = sum(p.numel() for p in model.parameters())
    assert 100_000 <= params <= 1_000_000, "tiny specs are a few hundred thousand parameters"
    tokens = torch.randint(0, spec.vocab_size, (2, SEQ))
    logits, aux = model(tokens, return_aux=True)
    assert logits.shape == (2, SEQ, spec.vocab_size)
    assert logits.isfinite().all()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()) + aux
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert p.grad.isfinite().all(), name
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("path", TINY, ids=ids(TINY))
def test_tiny_causal(path):
    """Changing token t changes no logit before t, and does change logits from t on."""
    spec = archlab.load_spec(path)
    model = archlab.build_model(spec).double()
    tokens = torch.randint(0, spec.vocab_size, (1, SEQ))
    with torch.no_grad():
        base = model(tokens)
        for t in (0, 17, SEQ - 1):
            changed = tokens.clone()
            changed[0, t] = (changed[0, t] + 1) % spec.vocab_size
            out = model(changed)
            torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
            assert (out[:, t] - base[:, t]).abs().max() > 1e-6


@pytest.mark.parametrize("name", ["yoco-u-moe", "parscale"])
def test_init_std_reaches_every_weight_matrix(name):
    """MoE experts and ParScale's prefix K,V are drawn by their own modules; they drew at 0.02
    whatever the spec's init_std said."""
    spec = archlab.load_spec(ROOT / "specs" / "tiny" / f"{name}.yaml", ["init_std=0.5"])
    torch.manual_seed(0)
    model = archlab.build_model(spec)
    drawn = {n: p for n, p in model.named_parameters() if p.dim() >= 2 and p.numel() >= 1000}
    assert any("gate_up" in n or "prefix_k" in n for n in drawn)
    for n, p in drawn.items():
        assert p.std().item() == pytest.approx(0.5, rel=0.15), n


def test_parscale_mixes_streams_as_its_reference_code():
    """As ParScale's published Qwen2 code: the final norm on each stream, then softmax weights from
    an MLP (Linear, SiLU, Linear) of all streams, smoothed towards uniform, and the weighted sum
    is what the head reads (no norm after)."""
    spec = archlab.load_spec(ROOT / "specs" / "tiny" / "parscale.yaml")
    torch.manual_seed(0)
    model = archlab.build_model(spec, dtype=torch.float64)
    for weight in model.stream_mix.parameters():
        torch.nn.init.normal_(weight, std=0.3)  # biases start at zero, which would hide them
    tokens = torch.randint(0, spec.vocab_size, (2, 24))
    hidden = model.run(model.embed_streams(tokens), torch.arange(24)[None], model.plan.steps, causal=True)
    streams = model.norm(hidden).view(2, spec.parscale.streams, 24, spec.d_model).unbind(1)
    first, _, second = model.stream_mix.weigh
    scores = second(torch.nn.functional.silu(first(torch.cat(streams, dim=-1))))
    smoothing = spec.parscale.smoothing
    weights = scores.softmax(-1) * (1 - smoothing) + smoothing / len(streams)
    expected = model.head(sum(weights[..., p, None] * stream for p, stream in enumerate(streams)))
    assert smoothing == 0.01  # ParScale's default
    torch.testing.assert_close(model(tokens), expected, rtol=0, atol=1e-12)
