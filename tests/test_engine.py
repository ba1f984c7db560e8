"""The engine decodes exactly what a full recompute decodes, and its cache is laid out as the
architecture says: one global K,V written once, local state per (iteration, layer)."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import archlab
from archlab.cache import CacheBytes
from archlab.engine import Engine, Sampling
from archlab.kv import CacheFull
from conftest import TINY, ids, tiny_model

PROMPT_LENGTHS = (37, 21, 37)  # ragged, and longer than the tiny window (16)


def prompts_for(spec, lengths=PROMPT_LENGTHS):
    return [torch.randint(0, spec.vocab_size, (n,)) for n in lengths]


def recompute_greedy(model, prompt, steps):
    """Greedy decoding that runs the full forward pass over the whole sequence at every step."""
    seq, tokens, logits = prompt.clone(), [], []
    for _ in range(steps):
        last = model(seq[None])[0, -1]
        tokens.append(int(last.argmax()))
        logits.append(last)
        seq = torch.cat([seq, last.argmax()[None]])
    return tokens, logits


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.float64, 1e-10)], ids=["float32", "float64"])
@pytest.mark.parametrize("path", TINY, ids=ids(TINY))
def test_cached_greedy_equals_full_recompute(path, dtype, tolerance):
    """In float64 nothing is rounded to float32 on either path (states, gates, rotations, router
    scores), so the two agree to float64's own arithmetic."""
    spec = archlab.load_spec(path)
    model = archlab.build_model(spec, dtype=dtype).eval()
    prompts = prompts_for(spec)
    steps = 6
    gen = Engine(model, prefill_chunk=8).generate(prompts, steps, keep_logits=True)
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            tokens, logits = recompute_greedy(model, prompt, steps)
            assert gen.tokens[row] == tokens
            for step, expected in enumerate(logits):
                torch.testing.assert_close(gen.logits[step][row], expected, rtol=5 * tolerance, atol=tolerance)


@pytest.mark.parametrize("path", TINY, ids=ids(TINY))
def test_chunked_prefill_equals_one_shot(path):
    spec = archlab.load_spec(path)
    model = archlab.build_model(spec).eval()
    prompts = prompts_for(spec, (45, 45))
    results = []
    for chunk in (1, 7, 16, 4096):
        engine = Engine(model, prefill_chunk=chunk)
        cache = engine.new_cache(2, 50)
        results.append((engine.prefill(prompts, cache), cache))
    logits, cache = results[-1]
    for other_logits, other in results[:-1]:
        torch.testing.assert_close(other_logits, logits, rtol=1e-4, atol=2e-5)
        for mine, theirs in zip(cache._states(), other._states()):
            for name in mine:
                torch.testing.assert_close(theirs[name], mine[name], rtol=1e-4, atol=2e-5)


def test_global_cache_is_written_once_whatever_t():
    yoco_spec, yoco = tiny_model("yoco")
    yoco_u_spec, yoco_u = tiny_model("yoco-u")
    prompts, new = prompts_for(yoco_spec, (30, 19)), 7
    caches = {}
    for spec, model in ((yoco_spec, yoco), (yoco_u_spec, yoco_u)):
        gen = Engine(model.eval()).generate(prompts, new)
        caches[spec.name] = gen.cache
        assert len(gen.cache.global_kv) == 1
        (global_kv,) = gen.cache.global_kv.values()
        written = global_kv["k"].abs().sum(dim=(2, 3)) > 0  # [B, rows]
        assert written.sum(dim=1).tolist() == [30 + new, 19 + new]  # prompt + generated, whatever T is
    a, b = caches["yoco"].bytes_per_sequence(), caches["yoco-u"].bytes_per_sequence()
    assert a.global_ == b.global_ > 0
    assert b.local == yoco_u_spec.loop.times * a.local > 0
    assert len(caches["yoco-u"].layers) == yoco_u_spec.loop.times * len(caches["yoco"].layers)


def test_cache_layout_follows_the_architecture():
    layouts = {}
    for name in ("transformer", "universal-transformer", "rins", "parscale", "upper-loop", "upper-loop-no-shared-kv"):
        spec, model = tiny_model(name)
        cache = Engine(model).new_cache(sequences=1, capacity=100)
        layouts[name] = (len(cache.global_kv), len(cache.layers), cache.bytes_per_sequence())
    per_layer = 100 * 2 * 2 * 16 * 4  # rows x (K, V) x kv heads x head dim x fp32
    # no global K,V, a state per layer, and bytes: 4 layers' full-attention K,V, all growing, nothing local
    assert layouts["transformer"] == (0, 4, CacheBytes(global_=4 * per_layer, local=0))
    assert layouts["universal-transformer"][2].global_ == 2 * 4 * per_layer  # a KV cache per (pass, layer)
    assert layouts["rins"][2].global_ == (3 * 2 + 2) * per_layer
    assert layouts["parscale"][2].global_ == 2 * 4 * per_layer  # the P streams' caches
    assert layouts["upper-loop"][0] == 1 and layouts["upper-loop-no-shared-kv"][0] == 3


def test_256k_token_prompt_on_the_cpu():
    """Prefill works chunk by chunk: the only O(N) memory is the global K,V (64 MiB here)."""
    spec, model = tiny_model("yoco-u")
    engine = Engine(model.eval(), prefill_chunk=4096)
    n = 256 * 1024
    cache = engine.new_cache(1, n)
    logits = engine.prefill([torch.randint(0, 256, (n,))], cache)
    assert logits.isfinite().all()
    (global_kv,) = cache.global_kv.values()
    assert global_kv["k"].shape[1] == n and global_kv["k"][0, -1].abs().sum() > 0
    assert {s["k"].shape[1] for s in cache.layers.values()} == {16}  # rings of W rows whatever N is
    assert cache.bytes_per_sequence().local == 3 * 2 * (2 * 16 * 2 * 16 * 4)  # T x layers x ring


def test_sampling_is_seeded_and_respects_top_k_and_stop_tokens():
    spec, model = tiny_model("yoco-u")
    prompts = prompts_for(spec, (12, 12))
    engine = Engine(model.eval())
    first = engine.generate(prompts, 10, Sampling(temperature=1.0, top_k=5, seed=3), keep_logits=True)
    again = engine.generate(prompts, 10, Sampling(temperature=1.0, top_k=5, seed=3))
    other = engine.generate(prompts, 10, Sampling(temperature=1.0, top_k=5, seed=4))
    assert first.tokens == again.tokens != other.tokens
    numpy_ints = engine.generate(prompts, 10, Sampling(temperature=1.0, top_k=np.int64(5), seed=np.int64(3)))
    assert numpy_ints.tokens == first.tokens
    for step, logits in enumerate(first.logits):
        for row in range(2):
            allowed = set(logits[row].topk(5).indices.tolist())
            assert first.tokens[row][step] in allowed
    stop = first.tokens[0][2]
    stopped = engine.generate(prompts, 10, Sampling(temperature=1.0, top_k=5, seed=3, stop_tokens=(stop,)))
    assert stopped.tokens[0] == first.tokens[0][: first.tokens[0].index(stop) + 1]


def test_top_p_cuts_a_large_vocabulary_where_its_mass_reaches_p():
    """Against the mass summed in float64 by numpy: float32's running sum reaches 1 before the
    end of 100,352 tokens, and left some 12,000 out at top_p 1."""
    logits = torch.randn(3, 100_352, generator=torch.Generator().manual_seed(0)) * 3
    assert Sampling(temperature=1.0, top_p=1.0).drawn_from(logits).isfinite().all()
    for p in (0.999, 0.9, 0.5):
        kept = Sampling(temperature=1.0, top_p=p).drawn_from(logits).isfinite().numpy()
        for row, keep in zip(logits.double().numpy(), kept, strict=True):
            probs = np.exp(row - row.max())
            probs /= probs.sum()
            order = np.argsort(-probs, kind="stable")
            wanted = np.zeros_like(keep)
            wanted[order[np.cumsum(probs[order]) - probs[order] < p]] = True
            assert (keep == wanted).all(), (p, int((keep != wanted).sum()))


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {int(Sampling(temperature=1.0, top_p=0.7, seed=s).choose(logits, torch.Generator().manual_seed(s))) for s in range(200)}
    assert seen == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the nucleus is the top two


def test_bad_sampling_arguments_are_named():
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1.0, top_p=1.5)
    for value in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=f"temperature must be a finite number >= 0, got {value}"):
            Sampling(temperature=value)
    for value in (2.5, True, 0):
        with pytest.raises(ValueError, match=f"top_k must be a whole number >= 1, got {value}"):
            Sampling(temperature=1.0, top_k=value)
    for stops in (10, [10, 2.5], "\n", [-1], [2**63]):
        with pytest.raises(ValueError, match=re.escape(f"stop_tokens must be a sequence of token ids, whole numbers from 0, got {stops!r}")):
            Sampling(stop_tokens=stops)
    for stops in ([10, 11], torch.tensor([10, 11]), np.array([10, 11])):  # as prompts may be (tensors were refused)
        assert Sampling(stop_tokens=stops).stop_tokens == (10, 11)
    for name, value in (("temperature", "1"), ("temperature", None), ("top_p", "0.5")):  # a TypeError from a comparison
        with pytest.raises(ValueError, match=re.escape(f"{name} must be a")):
            Sampling(**{name: value})
    for seed in (2.5, -1, 2**64):
        with pytest.raises(ValueError, match=f"seed must be a whole number from 0 to 2\\*\\*63 - 1, got {seed}"):
            Sampling(temperature=1.0, seed=seed)


def test_a_tiny_temperature_samples_the_top_token_and_never_nan():
    """logits / 1e-39 overflowed to inf, and softmax's inf - inf made the row nan."""
    logits = torch.tensor([[5.0, 20.0, -1.0, 15.0], [30.0, -2.0, 1.0, 0.0]])
    for temperature in (1e-39, 1e-300, 5e-324):
        for seed in range(5):
            chosen = Sampling(temperature=temperature).choose(logits, torch.Generator().manual_seed(seed))
            assert chosen.tolist() == [1, 0], temperature


def test_sampling_draws_what_torch_multinomial_draws():
    """The draw is multinomial's own for one sample (argmax of p / Exp(1)), without its host read."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    for seed in range(10):
        got = Sampling(temperature=0.7).choose(logits, torch.Generator().manual_seed(seed))
        expected = torch.multinomial((logits / 0.7).softmax(-1), 1, generator=torch.Generator().manual_seed(seed))[:, 0]
        assert got.tolist() == expected.tolist()


def test_top_k_keeps_k_tokens_by_rank_not_every_tie():
    """Ties with the k-th are common in bfloat16: top_k=1 is greedy, and top_k=2 draws from two."""
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0, 3.0]])
    seen = {int(Sampling(temperature=1.0, top_k=2).choose(logits, torch.Generator().manual_seed(s))) for s in range(100)}
    assert len(seen) == 2 and seen <= {1, 2, 4}
    ones = {int(Sampling(temperature=5.0, top_k=1).choose(logits, torch.Generator().manual_seed(s))) for s in range(50)}
    assert ones == {int(logits.argmax())}


def test_prompts_may_be_lists_and_bad_ones_are_named():
    _, model = tiny_model("yoco-u")
    lists = archlab.generate(model, [[5, 6, 7], [8]], 3).tokens
    assert lists == archlab.generate(model, [torch.tensor([5, 6, 7]), torch.tensor([8])], 3).tokens
    for prompts, message in (([5, 6], "one prompt goes in a list"), ([[5], [256]], "prompt 1 holds token id 256, outside the vocabulary of 256"),
                             ([[5], []], "prompt 1 is empty"), ([[0.5]], "integer token ids"),
                             ([[True, False]], "integer token ids, got torch.bool"),
                             ([torch.tensor([-3], dtype=torch.int8)], "prompt 0 holds token id -3, outside")):
        with pytest.raises(ValueError, match=message):
            archlab.generate(model, prompts, 2)
    # compared in int64, not in uint8 where 256 wraps to 0 and 100 passed for out of range
    assert archlab.generate(model, [torch.tensor([3, 100], dtype=torch.uint8)], 2).tokens == archlab.generate(model, [[3, 100]], 2).tokens
    for count in (0, -5, 2.5, True):  # named at the call, before a cache is sized by it
        with pytest.raises(ValueError, match=f"max_new_tokens must be a whole number >= 1, got {count}"):
            archlab.generate(model, [[5]], count)
        with pytest.raises(ValueError, match=f"max_new_tokens must be a whole number >= 1, got {count}"):
            archlab.Engine(model).stream([[5]], count)
    with pytest.raises(ValueError, match="no prompts given"):
        archlab.generate(model, [], 2)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got nan"):
        archlab.generate(model, [[5]], 2, temperature=float("nan"))
    with pytest.raises(ValueError, match="stop_tokens must be a sequence of token ids, whole numbers from 0, got 10"):
        archlab.generate(model, [[5]], 2, stop_tokens=10)
    # each raised from inside torch or Python, naming no argument
    for prompts, message in ((["hello"], "prompt 0 is text ('hello'), not token ids: encode text with the run's tokenizer"),
                             ("hello", "prompts are token ids, not text ('hello')"), (5, "prompts must be a list of prompts"),
                             ([[1, None]], "prompt 0 must be a 1-D sequence of token ids, whole numbers from 0"),
                             ([[1, 2**70]], "prompt 0 must be a 1-D sequence of token ids"), ([[1, [2]]], "prompt 0 must be a 1-D sequence")):
        with pytest.raises(ValueError, match=re.escape(message)):
            archlab.generate(model, prompts, 2)
    assert archlab.generate(model, (p for p in [[5, 6, 7], [8]]), 3).tokens == lists  # a generator of prompts, read once
    for option, value in (("page_size", 2.5), ("prefill_chunk", 1.5)):
        with pytest.raises(ValueError, match=f"{option} must be a whole number >= 1, got {value}"):
            archlab.generate(model, [[5]], 2, **{option: value})
    on_meta = archlab.build_model(model.spec, device="meta")
    with pytest.raises(ValueError, match="yoco-u is on the meta device, which holds shapes and no weights"):
        archlab.generate(on_meta, [[5]], 2)
    assert archlab.Engine(on_meta).new_cache(2, 64).bytes_per_sequence().total > 0  # sizing a cache there is what it is for
    assert Sampling(temperature=torch.tensor(0.5), top_p=np.float32(0.5)) == Sampling(temperature=0.5, top_p=0.5)
    # 0-d tensors as options, and a dict's values as prompts, were taken before these checks: still taken
    assert archlab.generate(model, {"a": [5, 6, 7], "b": [8]}.values(), 3, prefill_chunk=torch.tensor(2)).tokens == lists


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0, seed=0), Sampling(temperature=1.0, top_k=3, seed=0)],
                         ids=["greedy", "sampled", "top-k"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_are_named_before_their_token(sampling, bad):
    """Not the nan's token, taken for the max by argmax, nor multinomial's error: the row and the
    step, before the step's tokens are given out."""
    _, model = tiny_model("yoco-u")
    calls = []

    def spoil(module, args, out):  # the second step's logits (new token 1), of row 1
        calls.append(1)
        if len(calls) == 2:
            out[1, -1, 7] = bad
        return out

    model.head.register_forward_hook(spoil)
    given = []
    with pytest.raises(FloatingPointError, match=r"the model produced non-finite logits \(nan or inf\) for new token 1 of prompt\(s\) 1$"):
        for tokens, _, _ in Engine(model.eval()).stream([[5, 6, 7], [8, 9]], 4, sampling):
            given.append(tokens)
    assert len(given) == 1


@pytest.mark.parametrize("name, page_size", [("yoco-u", None), ("yoco-u", 8), ("transformer", None),
                                             ("yoco-u-mamba2", None), ("parscale", None)])
@torch.no_grad()
def test_a_cache_filled_from_a_few_sequences_decodes_like_them(name, page_size):
    """What the benchmark does at long context: prefill 2 prompts, copy their cache into a batch
    of 6 and decode all. Every copy must continue exactly as its original does."""
    spec, model = tiny_model(name)
    engine = Engine(model.eval(), page_size=page_size)
    prompts = prompts_for(spec, (29, 29))
    small = engine.new_cache(2, 40)
    logits = engine.prefill(prompts, small)
    big = engine.new_cache(6, 40)
    big.fill_from(small)
    tokens = logits.argmax(-1)
    start = torch.full((2,), 29)
    expected = engine.feed(tokens[:, None], start, small, full=True)
    got = engine.feed(tokens.repeat(3)[:, None], start.repeat(3), big, full=True)
    torch.testing.assert_close(got, expected.repeat(3, 1), rtol=1e-5, atol=1e-5)  # batch-size-dependent BLAS blocking
    with pytest.raises(ValueError, match="do not tile"):
        engine.new_cache(5, 40).fill_from(small)


def test_stepping_by_hand_builds_no_autograd_graph():
    """``feed`` and ``decode`` called directly, with gradients on: the cache is written in place,
    so a graph would chain every step to the last and grow with each token."""
    spec, model = tiny_model("yoco")
    engine = Engine(model.eval())
    cache = engine.new_cache(1, 20)
    engine.prefill(prompts_for(spec, (8,)), cache)
    assert torch.is_grad_enabled()
    logits = engine.decode(torch.tensor([[1]]), torch.tensor([8]), cache)
    fed = engine.feed(torch.tensor([[2, 3]]), torch.tensor([9]), cache, full=True)
    (pool,) = cache.global_kv.values()
    assert not logits.requires_grad and not fed.requires_grad and pool["k"].grad_fn is None


@pytest.mark.parametrize("name, page_size", [("transformer", None), ("yoco", None), ("yoco", 4), ("yoco-u-gdn", None),
                                             ("yoco-u-mamba2", None)])
def test_a_cache_given_that_does_not_fit_the_prompts_is_refused_before_it_runs(name, page_size):
    """Too few positions or the wrong number of sequences is said at the call, and the cache is
    left as it was made (all zeros), instead of a shape or index error from inside the model."""
    spec, model = tiny_model(name)
    engine = Engine(model.eval(), page_size=page_size)
    prompt = prompts_for(spec, (30,))
    cases = [
        (lambda cache: engine.prefill(prompt, cache), (1, 10), CacheFull,
         r"the longest prompt \(30 tokens\) needs 30 positions, past the cache's capacity of 10; make the cache with capacity 30 or more"),
        (lambda cache: engine.stream(prompt, 5, cache=cache), (1, 20), CacheFull,
         r"the longest prompt \(30 tokens \+ 5 new\) needs 35 positions, past the cache's capacity of 20; .* capacity 35 or more"),
        (lambda cache: engine.stream(prompt, 3, cache=cache), (2, 40), ValueError,
         r"the cache's sequences \(2\) must be one per prompt \(1\); make it with new_cache\(1, ...\)"),
        (lambda cache: engine.prefill(prompt * 3, cache), (2, 40), ValueError, r"sequences \(2\) must be one per prompt \(3\)"),
    ]
    if page_size:  # 30 + 5 tokens in pages of 4 need 9 pages; the cache has 8
        cases.append((lambda cache: engine.stream(prompt, 5, cache=cache), (1, 40, 8), CacheFull,
                      r"the prompts and their 5 new tokens each need 9 K,V pages of 4 positions; the cache has 8: .* pages=9 or more"))
    for call, shape, error, message in cases:
        cache = engine.new_cache(*shape)
        with pytest.raises(error, match=message):
            call(cache)
        assert all(not t.any() for state in cache._states() for t in state.values())


@pytest.mark.parametrize("name", ["yoco-u-gdn", "yoco-u-retnet", "yoco-u-mamba2", "yoco-u"])
@pytest.mark.parametrize("page_size", [None, 8])
def test_a_cache_used_before_starts_its_sequences_afresh(name, page_size):
    """A second prompt prefilled into a cache that decoded another decodes as in a new cache: the
    recurrent states left behind would otherwise carry on silently (attention hides its old rows
    by position, so only recurrent self-decoders showed it)."""
    spec, model = tiny_model(name)
    engine = Engine(model.to(torch.float64).eval(), page_size=page_size)
    first, second = prompts_for(spec, (30,)), prompts_for(spec, (20,))
    cache = engine.new_cache(1, 40)
    list(engine.stream(first, 5, cache=cache))
    reused = [logits for _, logits, _ in engine.stream(second, 3, cache=cache)]
    fresh = [logits for _, logits, _ in engine.stream(second, 3)]
    for got, expected in zip(reused, fresh):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("page_size", [None, 8])
@pytest.mark.parametrize("path", TINY, ids=ids(TINY))
def test_a_conversation_continues_from_its_cache_as_a_fresh_prefill_of_all_of_it(path, page_size):
    """A second turn rewinds the cache to where the first prompt ended (decoding ran past it) and
    feeds only what follows: its reply decodes as one from the whole conversation fed afresh."""
    spec = archlab.load_spec(path)
    model = archlab.build_model(spec, dtype=torch.float64).eval()
    engine = Engine(model, prefill_chunk=8, page_size=None if spec.layout.type != "yoco" else page_size)
    first, second = prompts_for(spec, (21, 19))
    cache = engine.new_cache(1, 70)
    turn = engine.stream([first], 6, cache=cache)
    _, logits, _ = next(turn)
    marked = cache.mark()  # at the first new token: the cache holds the prompt alone
    replied = [int(logits.argmax())] + [int(tokens[0]) for tokens, _, _ in turn]
    cache.rewind(marked)
    whole = torch.cat([first, torch.tensor(replied[:4]), second])  # the reply as the next prompt has it, cut short
    continued = [logits for _, logits, _ in engine.stream([whole], 4, cache=cache, held=len(first))]
    fresh = [logits for _, logits, _ in engine.stream([whole], 4)]
    for got, expected in zip(continued, fresh, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="held must be a whole number from 0 to one less than the shortest prompt"):
        engine.stream([first], 1, cache=cache, held=len(first))
    with pytest.raises(ValueError, match="nothing has been fed into this cache yet"):
        engine.stream([whole], 1, cache=engine.new_cache(1, 70), held=3)


class RunningMax(torch.nn.Module):
    """A mixer whose empty state is not zeros: the running maximum of its input, from -inf."""

    def __init__(self, d_model):
        super().__init__()
        self.proj = torch.nn.Linear(d_model, d_model, bias=False, dtype=torch.float64)

    def new_state(self, batch, capacity, dtype):
        return {"max": torch.full((batch, self.proj.in_features), float("-inf"), dtype=dtype)}

    def forward(self, x, inp):
        if inp.state is not None:
            x = torch.cat([inp.state["max"][:, None], x], 1)
        peak = x.cummax(1).values[:, -inp.positions.shape[-1]:]
        if inp.state is not None:
            inp.state["max"].copy_(peak[:, -1])
        return self.proj(peak)


def test_a_state_that_starts_other_than_zero_starts_as_new_state_made_it():
    """A cache starts over as its layers' new_state made it, not at zeros: a fresh cache is left
    as made, and one used before is put back."""
    spec, model = tiny_model("yoco")
    model = model.to(torch.float64).eval()
    model.layers[0].mixer = RunningMax(spec.d_model)
    engine = Engine(model)
    first, second = prompts_for(spec, (12,)), prompts_for(spec, (9,))
    with torch.no_grad():
        expected = model(second[0][None])[0, -1]
    cache = engine.new_cache(1, 20)
    for prompt in (first, second):  # the second prefill reuses the cache the first one filled
        logits = engine.prefill(prompt, cache)
    torch.testing.assert_close(logits[0], expected, rtol=0, atol=1e-12)


def test_generate_refuses_a_prompt_of_no_tokens(cli):
    """Not a silent token 0: a run's tokenizer has no beginning-of-text token to start from."""
    code, out, stderr = cli("generate", "specs/tiny/yoco-u.yaml", "--prompt", "", "--max-new-tokens", "2")
    assert code == 2 and "--prompt '' encodes to no tokens; give text to start from" in stderr, stderr
    assert out == ""


def test_cuda_graphs_need_a_cuda_model():
    _, model = tiny_model("yoco-u")
    with pytest.raises(ValueError, match="cuda_graph needs a model on a CUDA device; this one is on cpu"):
        Engine(model, cuda_graph=True)


def test_cuda_graphs_refuse_a_module_that_says_it_cannot_be_captured():
    """A module whose forward pass reads the device from the host (MoE picks its experts there)
    says so as ``not_capturable``, and a graph is refused at the engine, on any device."""

    class HostRouted(torch.nn.Module):
        not_capturable = "picks its experts on the host"

    _, model = tiny_model("yoco-u")
    model.layers[0].add_module("router", HostRouted())
    with pytest.raises(ValueError, match="cuda_graph: yoco-u cannot decode from a CUDA graph: its HostRouted picks its experts "
                                         "on the host; decode without cuda_graph"):
        Engine(model, cuda_graph=True)
    Engine(model)  # eager decoding is fine
    _, moe = tiny_model("yoco-u-moe")
    with pytest.raises(ValueError, match="its MoEFFN picks its experts on the host, each step; decode without cuda_graph"):
        Engine(moe, cuda_graph=True)


@pytest.mark.parametrize("name, kinds", [("transformer", set()), ("yoco", {"k", "v"}), ("yoco-u-mamba2", {"conv", "ssm"}),
                                         ("yoco-u-gdn", {"q_conv", "k_conv", "v_conv", "S"})])
def test_the_states_a_graph_capture_restores(name, kinds):
    """Capturing a decoding step runs it more than once: the states it restores afterwards are the
    ones a repeat would change (windows, recurrent and conv states), never a growing K,V."""
    _, model = tiny_model(name)
    cache = Engine(model).new_cache(2, 40)
    local = cache.local_tensors()
    assert {n for s in cache.layers.values() for n, t in s.items() if any(t is u for u in local)} == kinds
    growing = [*cache.global_kv.values(), *(s for key, s in cache.layers.items() if cache._grows[key])]
    assert not any(t is u for s in growing for t in s.values() for u in local)


def test_cpu_peak_memory_covers_the_cache_after_larger_runs():
    """The CPU's peak is the resident set's rise; memory freed by an earlier run must not hide
    this run's allocations (without handing it back, yoco-u at 32K read 6.8 MB for an 8 MB cache).
    In a process of its own, as the bench command runs: inside the whole suite, pages earlier
    tests left resident hid most of it (2.5 MB)."""
    code = textwrap.dedent("""
        from archlab.bench import bench
        from conftest import tiny_model

        spec, model = tiny_model("yoco-u")
        for n in (2048, 8192, 32768):
            row = bench(model.eval(), spec.name, n, 1, 4)
            assert row.peak_mb >= row.kv_global_mb + row.kv_local_mb, (n, row.peak_mb, row.kv_global_mb + row.kv_local_mb)
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr


def test_paging_a_model_without_a_global_kv_is_a_notice_not_a_silence():
    _, model = tiny_model("transformer")
    with pytest.warns(UserWarning, match="only a YOCO layout's global K,V is kept in pages; page_size=8 is ignored"):
        engine = Engine(model, page_size=8)
    assert engine.page_size is None


@pytest.mark.parametrize("path", TINY, ids=ids(TINY))
@torch.no_grad()
def test_decoding_past_a_contiguous_cache_is_named_and_spares_the_other_rows(path):
    """Decoding by hand at position 25 of a cache of 20 was an IndexError (on CUDA a device-side
    assert, which ends the process). The row that overran is named by ``check``; the row beside it
    decodes as it would alone; and a cache prefilled afresh after is not refused."""
    spec = archlab.load_spec(path)
    engine = Engine(archlab.build_model(spec).eval())
    prompts = prompts_for(spec, (10, 10))
    cache, alone = engine.new_cache(2, 20), engine.new_cache(1, 20)
    engine.prefill(prompts, cache)
    engine.prefill(prompts[1:], alone)
    logits = engine.decode(torch.tensor([[1], [2]]), torch.tensor([25, 10]), cache)
    with pytest.raises(CacheFull, match="a sequence went past the cache's capacity of 20 positions"):
        cache.check()
    torch.testing.assert_close(logits[1:], engine.decode(torch.tensor([[2]]), torch.tensor([10]), alone), rtol=1e-5, atol=1e-5)
    again = [tokens.tolist() for tokens, _, _ in engine.stream(prompts, 5, cache=cache)]
    assert again == [tokens.tolist() for tokens, _, _ in engine.stream(prompts, 5)]


def test_an_engine_refuses_a_model_moved_since_and_sampling_that_is_not_one():
    """Its dtype and device are the model's when it was made (its kernels were chosen for them):
    a model cast after stopped in SDPA on mismatched dtypes."""
    _, model = tiny_model("yoco-u")
    engine = Engine(model)
    model.double()
    with pytest.raises(ValueError, match="the model moved to torch.float64 on cpu after this Engine was made for torch.float32 on cpu"):
        engine.generate([[1, 2, 3]], 2)
    with pytest.raises(TypeError, match="sampling must be a Sampling"):
        Engine(model).generate([[1, 2, 3]], 2, {"temperature": 1.0})
    assert len(Engine(model).generate([[1, 2, 3]], 2).tokens[0]) == 2


@pytest.mark.parametrize("page_size", [None, 4])
def test_a_cache_one_position_short_is_refused_and_one_just_long_enough_is_not(page_size):
    """The capacity check at its edge: 30 prompt tokens and 5 new ones need 35 positions."""
    spec, model = tiny_model("yoco")
    engine = Engine(model.eval(), page_size=page_size)
    prompt = prompts_for(spec, (30,))
    with pytest.raises(CacheFull, match="needs 35 positions, past the cache's capacity of 34"):
        engine.stream(prompt, 5, cache=engine.new_cache(1, 34))
    assert len(list(engine.stream(prompt, 5, cache=engine.new_cache(1, 35)))) == 5


def test_generation_ends_once_every_row_has_stopped_and_keeps_logits_only_when_asked():
    """Rows that stopped are not decoded further: a stop token each row's first greedy token
    matches ends the generation after one step, with that one step's logits."""
    spec, model = tiny_model("yoco-u")
    engine = Engine(model.eval())
    prompts = prompts_for(spec, (12, 9))
    free = engine.generate(prompts, 6)
    assert free.logits == [] and all(len(tokens) == 6 for tokens in free.tokens)
    firsts = tuple({tokens[0] for tokens in free.tokens})
    stopped = engine.generate(prompts, 6, Sampling(stop_tokens=firsts), keep_logits=True)
    assert stopped.tokens == [tokens[:1] for tokens in free.tokens] and len(stopped.logits) == 1
    assert len(list(engine.stream(prompts, 6, Sampling(stop_tokens=firsts)))) == 1


def test_bench_divides_the_tokens_it_timed_by_the_time_they_took(monkeypatch):
    """A clock that moves one second per timed prefill and per decoding step: the prefill's rate is
    the prefilled rows' tokens a second, the decode's the whole batch's a step; the untimed
    warm-up calls before each clock read are not counted."""
    import time
    import types

    import archlab.bench as bench_module

    now = [0.0]

    def ticking(method):
        def timed(*args, **kwargs):
            now[0] += 1
            return method(*args, **kwargs)
        return timed

    monkeypatch.setattr(Engine, "prefill", ticking(Engine.prefill))
    monkeypatch.setattr(Engine, "decode", ticking(Engine.decode))
    monkeypatch.setattr(bench_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0], sleep=time.sleep))
    spec, model = tiny_model("yoco-u")
    row = bench_module.bench(model.eval(), spec.name, seq_len=20, batch=4, gen=3, prefill_rows=2)
    assert (row.prefill_tok_s, row.decode_tok_s) == (2 * 20, 4 * 3 / 3)


@pytest.mark.parametrize("name", ["yoco-u-gdn", "yoco-u-retnet", "yoco-u-mamba2"])
def test_bfloat16_decoding_stays_within_rounding_of_a_bfloat16_recompute(name):
    """The recurrent states are kept in float32 in a bfloat16 model: the engine's logits are then
    within a couple of bfloat16 steps (2**-8 of logits under 1) of a full pass over the same tokens.
    States kept in bfloat16 drifted 1.5e-2 (RetNet) to 2.6e-2 (Gated DeltaNet) from it."""
    spec, model = tiny_model(name)
    model = model.bfloat16().eval()
    prompts = prompts_for(spec, (40, 23))
    gen = Engine(model, prefill_chunk=8).generate(prompts, 16, keep_logits=True)
    assert gen.logits[0].dtype == torch.bfloat16
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            full = model(torch.cat([prompt, torch.tensor(gen.tokens[row][:-1])])[None])[0, len(prompt) - 1 :]
            got = torch.stack([logits[row] for logits in gen.logits])
            assert (got.float() - full.float()).abs().max() <= 1e-2


def test_rows_of_a_batch_stop_at_their_own_stop_tokens_and_the_rest_decode_on_unchanged():
    """Against the generation without stops, each row cut after its first stop token: one row
    stops at its first new token, one later, one never; the rows still going get the same tokens
    and logits, and ``stream`` flags a row stopped from the token after its stop."""
    spec, model = tiny_model("yoco-u")
    engine = Engine(model.eval())
    prompts = prompts_for(spec, (12, 5, 9))
    sampling = Sampling(temperature=1.0, seed=1)
    free = engine.generate(prompts, 8, sampling, keep_logits=True)
    first, later, never = free.tokens
    stops = (first[0], later[4])
    assert stops[0] not in later[:4] + never and stops[1] not in later[:4] + never  # the case this test is about
    wanted = [tokens[: next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))] for tokens in free.tokens]
    assert [len(tokens) for tokens in wanted] == [1, 5, 8]
    stopped = engine.generate(prompts, 8, Sampling(temperature=1.0, seed=1, stop_tokens=stops), keep_logits=True)
    assert stopped.tokens == wanted
    for step, logits in enumerate(stopped.logits):
        going = [row for row, tokens in enumerate(wanted) if step < len(tokens)]
        assert torch.equal(logits[going], free.logits[step][going])
    flags = [done.tolist() for _, _, done in engine.stream(prompts, 8, Sampling(temperature=1.0, seed=1, stop_tokens=stops))]
    assert flags == [[step >= len(tokens) for tokens in wanted] for step in range(8)]


@pytest.mark.parametrize("name", ["yoco", "yoco-u", "upper-loop-no-shared-kv"])
def test_a_prefill_runs_the_cross_decoder_on_the_last_prompt_token_alone_unless_it_projects_kvs(name):
    """YOCO's prefill stops at the global K,V projection: the cross-decoder keeps no state, so only
    the last prompt token, whose logits give the first new token, goes through it (the paper's
    prefill speed-up). A looped cross-decoder that projects a K,V per iteration runs its
    iterations up to the last projection on the whole prompt too, as they leave K,V behind."""
    spec, model = tiny_model(name)
    model.eval()
    prompt = torch.randint(0, spec.vocab_size, (33,), generator=torch.Generator().manual_seed(0))

    def tokens_through_each_half(run) -> dict[int, int]:
        fed = {0: 0, 1: 0}

        def count(half):
            return lambda module, args, output: fed.__setitem__(half, fed[half] + args[0].shape[1])

        hooks = [module.register_forward_hook(count(model.plan.half_of(i))) for i, module in enumerate(model.layers)]
        try:
            with torch.no_grad():
                run()
        finally:
            for hook in hooks:
                hook.remove()
        return fed

    whole = tokens_through_each_half(lambda: model(prompt[None]))  # every layer application sees the 33 tokens
    prefilled = tokens_through_each_half(lambda: next(Engine(model).stream([prompt], 1)))
    assert prefilled[0] == whole[0]
    applications = whole[1] // 33
    if name == "upper-loop-no-shared-kv":
        assert applications < prefilled[1] < whole[1]  # its iterations before the last projection saw the whole prompt
    else:
        assert prefilled[1] == applications  # the last token alone, once per application


def test_prompts_of_different_lengths_are_checked_against_the_longest_and_the_shortest():
    """A batch of prompts shares one cache: it needs room for the longest of them, and tokens said
    to be held already must leave at least one token of the shortest to feed. Measured on the wrong
    prompt, a cache too small would fail inside the model and a ``held`` past a short prompt would
    feed it nothing; both are refused at the call, naming the prompt they are measured against."""
    spec, model = tiny_model("yoco")
    engine = Engine(model.eval())
    long, short = prompts_for(spec, (30, 10))
    for prompts in ([long, short], [short, long]):
        with pytest.raises(CacheFull, match=r"the longest prompt \(30 tokens\) needs 30 positions, past the cache's capacity of 20"):
            engine.prefill(prompts, engine.new_cache(2, 20))
        cache = engine.new_cache(2, 40)
        engine.prefill(prompts, cache)
        with pytest.raises(ValueError, match=r"one less than the shortest prompt \(10 tokens\), got 10"):
            engine.prefill(prompts, cache, held=10)
