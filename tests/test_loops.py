"""Loops share weights: parameter counts, gradients from every iteration, cache sharing."""

from dataclasses import replace

import pytest
import torch

import archlab
from conftest import ROOT, TINY, ids

LOOPED = [p for p in TINY if archlab.load_spec(p).loop.position != "none"]


def with_loop(spec, **loop):
    data = spec.model_dump(mode="json")
    data["loop"].update(loop)
    return archlab.validate_spec(data, "override")


def test_looped_specs_cover_every_position():
    assert {archlab.load_spec(p).loop.position for p in LOOPED} == {"lower", "upper", "prefix", "all"}


@pytest.mark.parametrize("path", LOOPED, ids=ids(LOOPED))
def test_loop_adds_no_parameters(path):
    spec = archlab.load_spec(path)
    twin = with_loop(spec, times=1)
    looped, single = archlab.build_model(spec, device="meta"), archlab.build_model(twin, device="meta")
    assert spec.loop.times > 1
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(looped) == count(single)
    assert [n for n, _ in looped.named_parameters()] == [n for n, _ in single.named_parameters()]


def test_t1_twin_of_yoco_u_is_yoco():
    yoco_u = archlab.load_spec(ROOT / "specs/tiny/yoco-u.yaml")
    yoco = archlab.build_model(archlab.load_spec(ROOT / "specs/tiny/yoco.yaml"))
    twin = archlab.build_model(with_loop(yoco_u, times=1))
    twin.load_state_dict(yoco.state_dict())
    tokens = torch.randint(0, 256, (2, 30))
    torch.testing.assert_close(twin(tokens), yoco(tokens), rtol=0, atol=0)


@pytest.mark.parametrize(
    "path, loop",  # and attention and window loops sharing their own K,V (kv_memo), which no tiny spec has
    [(p, {}) for p in LOOPED] + [(ROOT / "specs/tiny/rins.yaml", {"kv_cache": "shared"}),
                                 (ROOT / "specs/tiny/yoco-u.yaml", {"kv_cache": "shared"})],
    ids=ids(LOOPED) + ["tiny/rins-shared-kv", "tiny/yoco-u-shared-window-kv"],
)
def test_gradients_reach_shared_weights_from_every_iteration(path, loop):
    """Per application of a looped layer, recompute its weight-gradient contribution from the
    captured input and output gradient; each is nonzero and together they sum to the tied grad."""
    spec = with_loop(archlab.load_spec(path), **loop) if loop else archlab.load_spec(path)
    model = archlab.build_model(spec).double()
    start, end = spec.loop_range()
    layer = model.layers[start]
    calls = []

    def capture(module, args, output):
        x, inp, _ = args
        calls.append({"x": x, "inp": inp})
        output.register_hook(lambda g, c=calls[-1]: c.setdefault("grad", g))

    handle = layer.register_forward_hook(capture)
    tokens = torch.randint(0, spec.vocab_size, (2, 24))
    logits, aux = model(tokens, return_aux=True)
    (logits.square().mean() + aux).backward()
    handle.remove()

    assert len(calls) == spec.loop.times
    weights = [p for p in layer.parameters()]
    total = [torch.zeros_like(w) for w in weights]
    for i, call in enumerate(calls):
        x, inp = call["x"].detach().requires_grad_(), call["inp"]
        # the global K,V (shared or not) is projected outside the layer: a constant here
        kv = inp.global_kv and tuple(t.detach() for t in inp.global_kv)
        memo = None
        if inp.kv_memo and i > 0:
            # K,V shared from the first iteration: rebuild them from that iteration's input, so this
            # application's gradient through them to the layer's norm and K,V projection is counted here
            memo, first = {}, calls[0]
            layer(first["x"].detach(), replace(first["inp"], global_kv=kv, kv_memo=memo), [])
        aux_losses = []  # MoE's balance loss reaches the router directly, not through the output
        out = layer(x, replace(inp, global_kv=kv, kv_memo=memo), aux_losses)
        objective = (out * call["grad"]).sum() + sum(aux_losses)
        contribution = torch.autograd.grad(objective, weights, allow_unused=True)
        mixer_weight = dict(zip([n for n, _ in layer.named_parameters()], contribution))
        first_proj = next(n for n in mixer_weight if n.startswith("mixer.") and mixer_weight[n] is not None)
        assert mixer_weight[first_proj].abs().sum() > 0, "an iteration sent no gradient to the mixer"
        assert mixer_weight["ffn_norm.weight"].abs().sum() > 0
        total = [t + (c if c is not None else 0) for t, c in zip(total, contribution)]
    for w, t in zip(weights, total):
        torch.testing.assert_close(w.grad, t, rtol=1e-9, atol=1e-12)


def count_calls(module):
    calls = []
    module.register_forward_hook(lambda *a: calls.append(1))
    return calls


def test_upper_loop_shares_one_global_kv_or_projects_one_per_iteration():
    shared = archlab.load_spec(ROOT / "specs/tiny/upper-loop.yaml")
    own = archlab.load_spec(ROOT / "specs/tiny/upper-loop-no-shared-kv.yaml")
    tokens = torch.randint(0, 256, (2, 20))
    models = {}
    for spec in (shared, own):
        model = archlab.build_model(spec)
        calls = count_calls(model.global_kv)
        models[spec.name] = (model, model(tokens))
        assert len(calls) == (1 if spec.loop.kv_cache == "shared" else spec.loop.times)
    # same weights, different cache rule -> different function
    (m_shared, out_shared), (m_own, _) = models.values()
    m_own.load_state_dict(m_shared.state_dict())
    assert not torch.allclose(m_own(tokens), out_shared)


def test_shared_kv_in_an_attention_loop_writes_k_v_once():
    rins = archlab.load_spec(ROOT / "specs/tiny/rins.yaml")
    tokens = torch.randint(0, 256, (1, 20))
    outs, weights = [], None
    for kv_cache in ("per_iteration", "shared"):
        spec = with_loop(rins, kv_cache=kv_cache)
        model = archlab.build_model(spec)
        if weights is None:
            weights = model.state_dict()
        else:  # same weights: a difference can only come from the cache rule
            model.load_state_dict(weights)
        qkv_calls = count_calls(model.layers[0].mixer.qkv_proj)  # later shared iterations project q alone
        outs.append(model(tokens))
        assert len(qkv_calls) == (3 if kv_cache == "per_iteration" else 1)
    assert not torch.allclose(*outs)


def test_a_window_attention_loop_may_share_its_k_v():
    """Over window attention alone, ``kv_cache`` is a choice: left out or ``per_iteration``, each
    iteration keeps its own window; ``shared``, the first iteration's window K,V serve all T, in the
    forward pass and in a cache of one window per layer, and decoding gives what a recompute does."""
    from archlab.cost import Cost
    from archlab.engine import Engine
    from test_engine import recompute_greedy

    base = archlab.load_spec(ROOT / "specs/tiny/yoco-u.yaml")
    shared, own = with_loop(base, kv_cache="shared"), with_loop(base, kv_cache="per_iteration")
    assert Cost(own).cache_bytes(64) == Cost(base).cache_bytes(64)
    assert Cost(own).cache_bytes(64).local == base.loop.times * Cost(shared).cache_bytes(64).local > 0
    tokens = torch.randint(0, base.vocab_size, (1, 40))  # longer than the window (16)
    outs, weights = [], archlab.build_model(own, dtype=torch.float64).state_dict()
    for spec in (own, shared):
        model = archlab.build_model(spec, dtype=torch.float64).eval()
        model.load_state_dict(weights)  # same weights: a difference can only come from the cache rule
        qkv_calls = count_calls(model.layers[0].mixer.qkv_proj)
        outs.append(model(tokens))
        assert len(qkv_calls) == (1 if spec is shared else spec.loop.times)
    assert not torch.allclose(*outs)
    prompts = [tokens[0, :37], tokens[0, :21]]
    generated = Engine(model, prefill_chunk=8).generate(prompts, 6, keep_logits=True)
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            expected_tokens, expected_logits = recompute_greedy(model, prompt, 6)
            assert generated.tokens[row] == expected_tokens
            for step, expected in enumerate(expected_logits):
                torch.testing.assert_close(generated.logits[step][row], expected, rtol=1e-9, atol=1e-10)


def test_a_cross_decoder_layer_after_a_loop_that_projects_per_iteration_reads_the_one_global_kv():
    """Walked by hand: a loop over part of the cross-decoder projects a K,V from its own input at
    each iteration after the first; the layer after the loop is a new segment and reads the global
    K,V the self-decoder's output gave, not the last iteration's. (The shipped upper loops cover
    the whole cross-decoder, so no layer followed one.)"""
    from archlab.block import MixerInput

    data = archlab.load_spec(ROOT / "specs/tiny/yoco.yaml").model_dump(mode="json")
    data["loop"] = {"position": "range", "start": 2, "end": 3, "times": 3, "kv_cache": "per_iteration"}
    spec = archlab.validate_spec(data)
    assert spec.layout.self_decoder.n_layers == 2 and spec.n_layers == 4
    model = archlab.build_model(spec, dtype=torch.float64)
    tokens = torch.randint(0, spec.vocab_size, (2, 20))
    positions, aux = torch.arange(20)[None], []
    with torch.no_grad():
        x = model.embed(tokens)
        for i in (0, 1):
            x = model.layers[i](x, MixerInput(positions), aux)
        global_kv = kv = model.global_kv(x, positions)
        for t in range(3):
            kv = global_kv if t == 0 else model.global_kv(x, positions)
            x = model.layers[2](x, MixerInput(positions, global_kv=kv), aux)
        x = model.layers[3](x, MixerInput(positions, global_kv=global_kv), aux)
        torch.testing.assert_close(model(tokens), model.head(model.norm(x)), rtol=1e-10, atol=1e-12)


def test_a_loop_inside_the_cross_decoder_projects_the_global_kv_once_then_once_per_later_iteration():
    """The cross-decoder cut in three segments by a loop over its middle layer: the global K,V is
    projected once, before its first segment, and again only at the loop's iterations after the
    first; the segments after the first begin on that one K,V, so a projection before them would be
    work (and cache) thrown away. Written out step by step, and counted as the model runs."""
    from archlab.plan import Step

    data = archlab.load_spec(ROOT / "specs/tiny/yoco.yaml").model_dump(mode="json")
    data["layout"]["cross_decoder"]["n_layers"] = 3
    data["loop"] = {"position": "range", "start": 3, "end": 4, "times": 3, "kv_cache": "per_iteration"}
    spec = archlab.validate_spec(data)
    assert spec.layout.self_decoder.n_layers == 2 and spec.n_layers == 5
    model = archlab.build_model(spec)
    assert [(seg.half, seg.start, seg.end, seg.times) for seg in model.plan.segments] == [(0, 0, 2, 1), (1, 2, 3, 1), (1, 3, 4, 3), (1, 4, 5, 1)]
    assert model.plan.steps == (Step(0, 0), Step(1, 0, project=True), Step(1, 0), Step(2, 0), Step(2, 1, project=True), Step(2, 1),
                                Step(2, 2, project=True), Step(2, 2), Step(3, 0))
    calls = count_calls(model.global_kv)
    model(torch.randint(0, spec.vocab_size, (1, 8)))
    assert len(calls) == 3


def test_a_shared_kv_loop_keeps_a_state_per_iteration_for_its_recurrent_layers():
    """``kv_cache: shared`` shares the K,V of the loop's attention layers alone: a Gated DeltaNet
    layer in the same loop still keeps one state per iteration in the cache, and
    decoding gives what a recompute does. (No shipped spec mixes the two in one shared loop.)"""
    from archlab.engine import Engine
    from test_engine import recompute_greedy

    data = archlab.load_spec(ROOT / "specs/tiny/yoco-u.yaml").model_dump(mode="json")
    data["layout"]["self_decoder"]["blocks"] = [data["layout"]["self_decoder"]["blocks"][0], {"type": "gdn", "n_heads": 4, "chunk_size": 16}]
    data["loop"]["kv_cache"] = "shared"
    spec = archlab.validate_spec(data)
    assert [spec.block_at(i).type for i in range(2)] == ["swa", "gdn"] and spec.loop.times == 3
    model = archlab.build_model(spec, dtype=torch.float64).eval()
    engine = Engine(model, prefill_chunk=8)
    cache = engine.new_cache(1, 64)
    gdn_states = [key for key in cache.layers if key[2] == 1]
    assert sorted(iteration for _, iteration, _ in gdn_states) == [0, 1, 2]
    assert sorted(iteration for _, iteration, layer in cache.layers if layer == 0) == [0]  # the window K,V, once
    prompt = torch.randint(0, spec.vocab_size, (37,))
    generated = engine.generate([prompt], 6, keep_logits=True)
    with torch.no_grad():
        expected_tokens, expected_logits = recompute_greedy(model, prompt, 6)
    assert generated.tokens[0] == expected_tokens
    for step, expected in enumerate(expected_logits):
        torch.testing.assert_close(generated.logits[step][0], expected, rtol=1e-9, atol=1e-10)
