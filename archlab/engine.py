"""Prefill and decode with the cache the architecture calls for.

Prefill feeds all prompt tokens but the last, chunk by chunk, through the model's prefill steps
only: in YOCO the self-decoder (every loop iteration) and the global K,V projection, and the
cross-decoder only where a later step reads what it leaves (a looped cross-decoder that projects a
K,V per iteration). The last prompt token is then the first decoding step through the whole model.
Prompts of different lengths are prefilled in groups of equal length; decoding runs them together,
each row at its own position.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from archlab.block import whole_number
from archlab.cache import Cache
from archlab.kv import PAGE_KERNELS, CacheFull, pages_for
from archlab.model import Model
from archlab.train.config import SEED_LIMIT


def _token_id(value) -> bool:
    """A whole number a long tensor holds; one past the vocabulary never matches, and is allowed."""
    return whole_number(value) and 0 <= value < 2**63


def _scalar(value):
    """A 0-d tensor or array as its number (a common way to carry a hyperparameter); else the value."""
    return value.item() if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0 else value


def _real(value) -> bool:
    """A number (Python's or numpy's, whole or not), not a bool nor text."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. ``temperature == 0`` (or ``top_k == 1``) is greedy. A seed
    seeds one generator for the whole batch, so a prompt's sampled tokens depend on the other
    prompts beside it and on its row."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_tokens: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("temperature", "top_k", "top_p", "seed"):
            object.__setattr__(self, name, _scalar(getattr(self, name)))
        if not (_real(self.temperature) and 0 <= self.temperature < math.inf):  # nan too
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k is not None and not (whole_number(self.top_k) and self.top_k >= 1):
            raise ValueError(f"top_k must be a whole number >= 1, got {self.top_k!r}")
        if self.top_p is not None and not (_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (whole_number(self.seed) and 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be a whole number from 0 to 2**63 - 1, got {self.seed!r}")
        stops = self.stop_tokens.tolist() if isinstance(self.stop_tokens, (torch.Tensor, np.ndarray)) else self.stop_tokens
        if not (isinstance(stops, Sequence) and not isinstance(stops, str)) or not all(map(_token_id, stops)):
            raise ValueError(f"stop_tokens must be a sequence of token ids, whole numbers from 0, got {self.stop_tokens!r}")
        # as Python ints, which torch takes where a numpy integer is refused
        object.__setattr__(self, "seed", None if self.seed is None else int(self.seed))
        object.__setattr__(self, "stop_tokens", tuple(map(int, stops)))

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Next tokens [B] from logits [B, V]. Non-finite logits raise nothing here: the engine
        names them, at the host read it makes anyway."""
        if self.temperature == 0 or self.top_k == 1:
            return logits.argmax(dim=-1)
        # torch.multinomial's draw for one sample (argmax of p / q, q ~ Exp(1)), the same tokens
        # from the same generator, without its host read to check p or its error on a nan
        probs = self.drawn_from(logits).softmax(dim=-1)
        return (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(dim=-1)

    def drawn_from(self, logits: torch.Tensor) -> torch.Tensor:
        """The float32 logits [B, V] a token is drawn from: tempered, with those top-k and top-p
        leave out at -inf."""
        # Less each row's max first, and at most 1 / float32's smallest normal (its division may be
        # a multiplication by the reciprocal): the rest then go to -inf at worst, never the max to
        # inf or nan, however small the temperature.
        logits = logits.float()
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(self.temperature, torch.finfo(torch.float32).tiny)
        if self.top_k is not None:  # by rank: the tokens tied with the k-th are not all kept
            kept = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1)
            logits = torch.full_like(logits, float("-inf")).scatter(-1, kept.indices, kept.values)
        if self.top_p is not None and self.top_p < 1:  # 1 keeps every token
            ordered, order = logits.sort(dim=-1, descending=True)
            # in float64: float32's running sum over a large vocabulary reaches 1 thousands of tokens
            # before its end (11 to 14 thousand of 100,352 random logits), and its rounding moves any cut
            probs = ordered.double().softmax(dim=-1)
            drop_sorted = probs.cumsum(dim=-1) - probs >= self.top_p  # the mass before it already reaches p
            logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
        return logits


def check_capturable(model: Model) -> None:
    """A module a CUDA graph cannot capture says why as ``not_capturable`` (MoE: it picks its
    experts on the host); a model holding one is refused a graph, on any device."""
    why = sorted({f"{type(m).__name__} {m.not_capturable}" for m in model.modules() if getattr(m, "not_capturable", None)})
    if why:
        raise ValueError(f"cuda_graph: {model.spec.name} cannot decode from a CUDA graph: its {'; its '.join(why)}; "
                         "decode without cuda_graph")


@dataclass
class Generation:
    """What ``generate`` returns: new tokens per sequence (cut after a stop token), the logits of
    every step if asked for (a [B, V] per step), and the cache holding the whole sequences."""

    tokens: list[list[int]]
    cache: Cache
    logits: list[torch.Tensor] = field(default_factory=list)


class CapturedDecode:
    """The whole-model decoding step captured once as a CUDA graph and replayed: one launch per
    token instead of one per kernel, which is what an eager decode step of small matrices is
    bound by. Every tensor the step touches is preallocated (the cache is, at its capacity), so
    the graph replays onto the same memory with new tokens and positions.

    Capturing runs the step eagerly first (to load kernels and tune them), on the real inputs;
    the states that a repeated step would change are restored after, so nothing is counted twice.
    """

    def __init__(self, engine: Engine, cache: Cache, tokens: torch.Tensor, start: torch.Tensor):
        self.cache, self.tokens, self.start = cache, tokens.clone(), start.clone()
        marked = cache.mark()
        side = torch.cuda.Stream(engine.device)
        side.wait_stream(torch.cuda.current_stream(engine.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                engine.feed(self.tokens, self.start, cache, full=True)
                cache.rewind(marked)
        torch.cuda.current_stream(engine.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = engine.feed(self.tokens, self.start, cache, full=True)

    def __call__(self, tokens: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.start.copy_(start)
        self.graph.replay()
        return self.logits.clone()  # the graph's output buffer is overwritten by the next replay


class Engine:
    def __init__(self, model: Model, prefill_chunk: int = 2048, cuda_graph: bool = False, page_size: int | None = None,
                 page_kernel: str = "torch"):
        """``cuda_graph``: replay decoding steps from a captured CUDA graph (CUDA models only).
        ``page_size``: keep the global K,V in pages of that many positions, handed out as the
        sequences grow (YOCO layouts; the paper's serving stack uses 256), and decode over them
        with ``page_kernel``: ``torch`` or ``flex`` (``archlab.kv``)."""
        prefill_chunk, page_size = _scalar(prefill_chunk), _scalar(page_size)
        if not (whole_number(prefill_chunk) and prefill_chunk >= 1):
            raise ValueError(f"prefill_chunk must be a whole number >= 1, got {prefill_chunk!r}")
        if page_size is not None and not (whole_number(page_size) and page_size >= 1):
            raise ValueError(f"page_size must be a whole number >= 1, got {page_size!r}")
        if page_kernel not in PAGE_KERNELS:
            raise ValueError(f"page_kernel must be one of {', '.join(PAGE_KERNELS)}, got {page_kernel!r}")
        if page_size is not None and model.global_kv is None:
            warnings.warn(f"{model.spec.name}: only a YOCO layout's global K,V is kept in pages; page_size={page_size} is ignored",
                          stacklevel=2)
            page_size = None
        self.model, self.prefill_chunk, self.page_size, self.page_kernel = model, prefill_chunk, page_size, page_kernel
        first = next(model.parameters())
        self.dtype, self.device = first.dtype, first.device
        model.choose_kernels()  # a kernel that cannot run here fails now, not mid-generation
        if cuda_graph:
            check_capturable(model)
        if cuda_graph and self.device.type != "cuda":
            raise ValueError(f"cuda_graph needs a model on a CUDA device; this one is on {self.device}")
        self.cuda_graph = cuda_graph
        self._captured: CapturedDecode | None = None

    def new_cache(self, sequences: int, capacity: int, pages: int | None = None) -> Cache:
        """A cache for ``sequences`` of up to ``capacity`` positions; paged, it holds ``pages``
        pages (by default enough for each sequence to reach the capacity)."""
        now = next(self.model.parameters())
        if (now.dtype, now.device) != (self.dtype, self.device):  # its kernels (and any captured graph) were chosen for those
            raise ValueError(f"the model moved to {now.dtype} on {now.device} after this Engine was made for {self.dtype} on"
                             f" {self.device}; make a new Engine for it")
        return Cache(self.model, sequences, capacity, self.dtype, self.device, self.page_size, pages, self.page_kernel)

    def cache_for(self, lengths: Sequence[int], max_new_tokens: int) -> Cache:
        """A cache for prompts of these lengths and their new tokens; paged, only the pages they need."""
        ends = [n + max_new_tokens for n in lengths]
        pages = self.model.streams * pages_for(ends, self.page_size) if self.page_size else None
        return self.new_cache(len(lengths), max(ends), pages)

    def _positions(self, start: torch.Tensor, n: int) -> torch.Tensor:
        return self.model.streams_of(start[:, None] + torch.arange(n, device=self.device))

    @torch.no_grad()
    def feed(self, tokens: torch.Tensor, start: torch.Tensor, cache: Cache, full: bool) -> torch.Tensor | None:
        """Run tokens [B, n] at positions start[b]..start[b]+n-1 into the cache: through the whole
        model (``full``; returns the last position's logits [B, V]) or only the prefill steps."""
        x = self.model.embed_streams(tokens)
        steps = self.model.plan.steps if full else self.model.plan.prefill_steps
        positions = self._positions(start, tokens.shape[1])
        cache.reserve(positions[:, -1] + 1, tokens.shape[1])
        cache.fresh = False
        x = self.model.run(x, positions, steps, cache)
        return self.model.logits(x[:, -1:])[:, -1] if full else None

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, start: torch.Tensor, cache: Cache) -> torch.Tensor:
        """One token per sequence (tokens [B, 1] at positions start [B]) through the whole model;
        returns the logits [B, V]. ``start[b]`` must be the position after the last one fed to
        sequence b: the cache keeps no count of its own to check it against (reading one would
        cost a device sync a step), and a token fed after a gap attends over the skipped
        positions as whatever they hold. With ``cuda_graph`` the step is captured on first use
        per cache and replayed after."""
        if not self.cuda_graph:
            return self.feed(tokens, start, cache, full=True)
        if self._captured is None or self._captured.cache is not cache:
            self._captured = None  # frees the previous graph's memory before capturing anew
            self._captured = CapturedDecode(self, cache, tokens, start)
        return self._captured(tokens, start)

    def check_prompts(self, prompts: Sequence) -> list[torch.Tensor]:
        """Prompts as 1-D token tensors (lists of ids are taken too), each at least one token long
        and inside the vocabulary, or a ValueError that says which is not."""
        if isinstance(prompts, (str, bytes)):
            raise ValueError(f"prompts are token ids, not text ({prompts[:20]!r}): encode text with the run's tokenizer first"
                             " (load_trained gives its tokenizer.json)")
        if not isinstance(prompts, (Sequence, torch.Tensor, np.ndarray)):
            if not isinstance(prompts, Iterable):
                raise ValueError(f"prompts must be a list of prompts (or a 2-D tensor of them), got {type(prompts).__name__}")
            prompts = list(prompts)  # a generator of prompts (or a dict's values), read once, here
        if not len(prompts):
            raise ValueError("no prompts given; pass a list of at least one")
        vocab = self.model.spec.vocab_size
        checked = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, (str, bytes)):
                raise ValueError(f"prompt {i} is text ({prompt[:20]!r}), not token ids: encode text with the run's tokenizer"
                                 " first (load_trained gives its tokenizer.json)")
            try:
                ids = torch.as_tensor(prompt)
            except (TypeError, ValueError, RuntimeError, OverflowError) as exc:  # None, a nested list, an id past int64
                raise ValueError(f"prompt {i} must be a 1-D sequence of token ids, whole numbers from 0 ({exc})") from None
            if ids.ndim != 1:
                raise ValueError(f"prompt {i} must be a 1-D sequence of token ids, got shape {list(ids.shape)}"
                                 + (" (one prompt goes in a list: [ids])" if ids.ndim == 0 else ""))
            if not len(ids):
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
                raise ValueError(f"prompt {i} must hold integer token ids, got {ids.dtype}")
            ids = ids.long()
            low, high = int(ids.min()), int(ids.max())  # as Python ints: compared in uint8, 256 is 0
            if low < 0 or high >= vocab:
                raise ValueError(f"prompt {i} holds token id {high if high >= vocab else low}, "
                                 f"outside the vocabulary of {vocab} (0..{vocab - 1})")
            checked.append(ids)
        return checked

    def _check_call(self, prompts: Sequence, max_new_tokens: int, sampling: Sampling) -> list[torch.Tensor]:
        """The arguments ``generate`` and ``stream`` share, checked at the call (``stream`` is a
        generator's maker), before a cache is sized by them."""
        if self.device.type == "meta":  # an engine there sizes caches (new_cache), and computes nothing
            raise ValueError(f"{self.model.spec.name} is on the meta device, which holds shapes and no weights; build it on a"
                             " device that computes (build_model(spec), or load_trained(run)) to generate")
        prompts = self.check_prompts(prompts)
        if not (whole_number(max_new_tokens) and max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a Sampling (Sampling(temperature=..., top_k=...)), got {type(sampling).__name__}")
        return prompts

    def check_cache(self, cache: Cache, prompts: list[torch.Tensor], new_tokens: int = 0, held: int = 0) -> None:
        """A cache the caller made must hold a sequence per prompt (a ValueError) and room for the
        longest with its new tokens, and paged, pages for them all (``CacheFull``): said before
        anything runs, where each would otherwise surface mid-run, as a shape or index error or
        as pages running out with tokens already given out. Tokens it is said to hold already
        (``held``) must have been fed, with at least one token of each prompt after them."""
        if cache.sequences != len(prompts):
            raise ValueError(f"the cache's sequences ({cache.sequences}) must be one per prompt ({len(prompts)}); "
                             f"make it with new_cache({len(prompts)}, ...)")
        if held and cache.fresh:
            raise ValueError(f"held={held}, but nothing has been fed into this cache yet")
        shortest, longest = min(map(len, prompts)), max(map(len, prompts))
        if not (whole_number(held) and 0 <= held < shortest):
            raise ValueError(f"held must be a whole number from 0 to one less than the shortest prompt"
                             f" ({shortest} tokens), got {held!r}")
        need = longest + new_tokens
        if need > cache.capacity:
            new = f" + {new_tokens} new" if new_tokens else ""
            raise CacheFull(f"the longest prompt ({longest} tokens{new}) needs {need} positions, past the cache's "
                            f"capacity of {cache.capacity}; make the cache with capacity {need} or more")
        if cache.page_table is not None:
            if cache.page_table.ran_out():
                raise CacheFull("this cache ran out of room in an earlier use and some of its positions point at no page;"
                                " make a new one (new_cache or cache_for)")
            ends = self.model.streams_of(torch.tensor([len(p) + new_tokens for p in prompts]))
            pages = cache.page_table.needed(ends)
            if pages > cache.page_table.pages:
                new = f" and their {new_tokens} new tokens each" if new_tokens else ""
                raise CacheFull(f"the prompts{new} need {pages} K,V pages of {cache.page_table.page_size} positions; the cache has"
                                f" {cache.page_table.pages}: make it with pages={pages} or more")

    def prefill(self, prompts: Sequence[torch.Tensor], cache: Cache, held: int = 0) -> torch.Tensor:
        """Fill the cache with the prompts (1-D token tensors); returns the logits [B, V] that
        predict each prompt's next token. ``held``: the cache holds each prompt's first ``held``
        tokens already, and nothing after them (a conversation's earlier turns, ``Cache.rewind``
        to where they ended): only the rest are fed."""
        prompts = self.check_prompts(prompts)
        self.check_cache(cache, prompts, held=held)
        return self._prefill(prompts, cache, held)

    @torch.no_grad()
    def _prefill(self, prompts: list[torch.Tensor], cache: Cache, held: int = 0) -> torch.Tensor:
        if not held and not cache.fresh:  # a cache used before starts its sequences afresh
            cache.start_over()
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        for length in lengths.unique().tolist():
            group = (lengths == length).nonzero()[:, 0]
            sub = cache if len(group) == len(prompts) else cache.take(group)
            ids = torch.stack([prompts[i] for i in group.tolist()]).to(self.device)
            for start in range(held, length - 1, self.prefill_chunk):
                chunk = ids[:, start : min(start + self.prefill_chunk, length - 1)]
                self.feed(chunk, torch.full((len(group),), start, device=self.device), sub, full=False)
            if sub is not cache:
                cache.put(group, sub)
        last = torch.stack([p[-1] for p in prompts]).to(self.device)[:, None]
        logits = self.feed(last, lengths - 1, cache, full=True)
        cache.check()
        return logits

    def stream(
        self,
        prompts: Sequence[torch.Tensor],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        cache: Cache | None = None,
        held: int = 0,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yield (tokens [B], logits [B, V], stopped [B]) once per new token; ``stopped``: the row
        met a stop token before this one, so this one is to be ignored (rows keep decoding until
        every row has stopped; the stop token itself is the row's last). At the
        end the last tokens are written into the cache too, so it holds every token. A ``cache``
        given is checked here, at the call; it may hold the prompts' first ``held`` tokens
        already (``prefill``)."""
        prompts = self._check_call(prompts, max_new_tokens, sampling)
        if cache is not None:
            self.check_cache(cache, prompts, max_new_tokens, held)
        elif held:
            raise ValueError(f"held={held} needs the cache that holds them")
        return self._stream(prompts, max_new_tokens, sampling, cache, held)

    @torch.no_grad()
    def _stream(self, prompts: list[torch.Tensor], max_new_tokens: int, sampling: Sampling, cache: Cache | None, held: int = 0):
        cache = cache or self.cache_for([len(p) for p in prompts], max_new_tokens)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        generator = torch.Generator(self.device).manual_seed(sampling.seed) if sampling.seed is not None else None
        stops = torch.tensor(sampling.stop_tokens, dtype=torch.long, device=self.device)
        finished = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        logits = self._prefill(prompts, cache, held)
        for i in range(max_new_tokens):
            tokens = sampling.choose(logits, generator)
            done_before = finished.clone()
            finished |= torch.isin(tokens, stops)
            # the step's one host read, which also says whether the logits were all finite
            all_done, finite = torch.stack([finished.all(), logits.isfinite().all()]).tolist()
            if not finite:
                rows = (~logits.isfinite().all(dim=-1)).nonzero()[:, 0].tolist()
                raise FloatingPointError(f"the model produced non-finite logits (nan or inf) for new token {i} "
                                         f"of prompt(s) {', '.join(map(str, rows))}")
            yield tokens, logits, done_before
            if all_done or i == max_new_tokens - 1:  # the last token only needs writing into the cache
                self.feed(tokens[:, None], lengths + i, cache, full=False)
                cache.check()
                return
            logits = self.decode(tokens[:, None], lengths + i, cache)
            cache.check()

    def generate(
        self,
        prompts: Sequence[torch.Tensor] | torch.Tensor,
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        keep_logits: bool = False,
    ) -> Generation:
        prompts = self._check_call(prompts, max_new_tokens, sampling)
        cache = self.cache_for([len(p) for p in prompts], max_new_tokens)
        out: list[list[int]] = [[] for _ in prompts]
        kept = []
        for tokens, logits, done in self._stream(prompts, max_new_tokens, sampling, cache):
            for row, token in enumerate(tokens.tolist()):
                if not done[row]:
                    out[row].append(token)
            if keep_logits:
                kept.append(logits)
        return Generation(out, cache, kept)


def generate(
    model: Model,
    input_ids: torch.Tensor | Sequence[torch.Tensor | Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_tokens: Sequence[int] = (),
    prefill_chunk: int = 2048,
    page_size: int | None = None,
) -> Generation:
    """Generate up to ``max_new_tokens`` for each prompt (rows of a 2-D tensor, or 1-D tensors or
    lists of token ids, of different lengths). Greedy unless a temperature is given."""
    sampling = Sampling(temperature, top_k, top_p, seed, stop_tokens)
    return Engine(model, prefill_chunk, page_size=page_size).generate(input_ids, max_new_tokens, sampling)
