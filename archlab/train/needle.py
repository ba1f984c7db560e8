"""Needle in a haystack: can a trained run find one fact in a long prompt (the paper's Table 4,
which reports RULER's single-needle tasks; ``archlab niah``)?

A probe hides "One of the special magic numbers for {key} is: {value}." at a depth of a haystack,
then asks for the key's number in RULER's words, ending on the answer's prefix so a base model can
complete it. The haystack is RULER's: a line of noise repeated (S-NIAH-1), or text, the run's
held-out split or another corpus (as S-NIAH-2 uses essays). It is as long as fits in the length
with the tokens to generate (text wraps round to its first line where it runs out). A probe is
found if the greedy continuation contains the value (RULER's string match), not inside a longer
number. The answer's tokens after the prompt (a space and the value) are also
scored, for a graded measure where a small model finds nothing: their summed loss over the value's
digits (comparable across tokenizers; a uniform guess at each digit is ln(10) = 2.30), and how
much lower it is than after the same prompt whose needle holds another number. That gain is what
reading the needle is worth; 0 is a model that does not use it.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import re
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

import torch

from archlab.cache import check_cache_room
from archlab.engine import Engine
from archlab.files import save_figure_whole
from archlab.memory import Watched, check_room
from archlab.table import Decimals
from archlab.train.data import encode, load_tokenizer
from archlab.train.checkpoint import tokenizer_of
from archlab.train.config import SYNTHETIC, load_config
from archlab.train.evaluate import EvaluationError, Loaded, continuation_scores, scorable

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic numbers for {key} is: {value}."
PROMPT = ("A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about the"
          " number afterwards.\n{context}\nWhat is the special magic number for {key} mentioned in the provided text? The special"
          " magic number for {key} mentioned in the provided text is")
ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen", "lively", "mellow",
              "narrow", "odd", "plain", "quiet", "rapid", "shy", "tidy")
NOUNS = ("anchor", "basket", "candle", "donkey", "engine", "feather", "garden", "harbor", "island", "jacket", "kettle", "ladder",
         "meadow", "needle", "orchard", "pepper", "quarry", "ribbon", "saddle", "tunnel")
DIGITS = 7


def depths(count: int) -> list[float]:
    """``count`` depths in percent, the centres of equal parts of the haystack (as RULER places them)."""
    return [100 * (i + 0.5) / count for i in range(count)]


@dataclass(frozen=True)
class Probe:
    length: int  # the budget: prompt and generated tokens
    depth: float  # percent of the haystack before the needle
    key: str
    value: str
    prompt: list[int]
    control: list[int]  # the prompt with another number in the needle
    answer: list[int]  # the value's tokens, encoded on their own after a space: what the prompt should go on with
    placed: float  # percent of the haystack's tokens before the needle: near ``depth``, as near as whole lines come


class Haystack:
    """Lines to hide the needle among: RULER's noise repeated, or the lines of a text (``what``)."""

    def __init__(self, lines: list[str], what: str | None = None):
        self.lines, self.what = lines, what

    @classmethod
    def noise(cls) -> Haystack:
        return cls([NOISE])

    @classmethod
    def text(cls, text: str, what: str) -> Haystack:
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            raise EvaluationError(f"{what} has no text to hide a needle in")
        return cls(lines, what)

    def lines_from(self, start: int, count: int) -> list[str]:
        """``count`` lines from line ``start`` on, round again from the first where they run out."""
        return [self.lines[(start + i) % len(self.lines)] for i in range(count)]


class Probes:
    """Probes of a length and depth, each the longest haystack that fits, drawn from ``seed``."""

    def __init__(self, haystack: Haystack, tokenizer, new_tokens: int, seed: int):
        self.haystack, self.tokenizer, self.new_tokens, self.rng = haystack, tokenizer, new_tokens, random.Random(seed)
        self.sizes: dict[str, int] = {}  # tokens of each haystack line, and its newline
        self.wrapped = False  # said once: a probe whose text haystack ran out of lines

    def encode(self, text: str) -> list[int]:
        return encode(self.tokenizer, [text], "the needle test's text")[0].ids

    def place(self, lines: list[str], depth: float) -> tuple[int, float]:
        """Where among ``lines`` the needle goes, and the percent of their tokens before it: the
        line boundary nearest ``depth`` percent of their tokens. Counting lines instead put it
        before the one line of noise that fits in 512 tokens at every depth, and lines of text
        are of all lengths."""
        for line in lines:
            if line not in self.sizes:
                self.sizes[line] = len(self.encode(line)) + 1
        before = list(itertools.accumulate((self.sizes[line] for line in lines), initial=0))
        at = min(range(len(lines) + 1), key=lambda i: abs(before[i] - before[-1] * depth / 100))
        return at, 100 * before[at] / before[-1] if lines else 0.0

    def draw(self, length: int, depth: float) -> Probe:
        key = f"{self.rng.choice(ADJECTIVES)}-{self.rng.choice(NOUNS)}"
        value = self._number()
        start = self.rng.randrange(len(self.haystack.lines))

        @functools.lru_cache(maxsize=4)  # the longest that fits, among the last asked, is not encoded again for the probe
        def prompt(count: int, hidden: str = value) -> list[int]:
            lines = self.haystack.lines_from(start, count)
            lines.insert(self.place(lines, depth)[0], NEEDLE.format(key=key, value=hidden))
            return self.encode(PROMPT.format(context="\n".join(lines), key=key))

        budget = length - self.new_tokens
        if (least := len(prompt(0))) > budget:
            raise EvaluationError(f"--seq-len {length:,}: the question and the needle alone take {least:,} tokens, and"
                                  f" {self.new_tokens} more {'is' if self.new_tokens == 1 else 'are'} generated; give a longer length")
        answer = self.encode(f" {value}")
        if len(answer) > self.new_tokens:  # no continuation could hold it
            raise EvaluationError(f"--new-tokens {self.new_tokens}: the answer {value!r} takes {len(answer)} tokens of the run's"
                                  f" tokenizer after the prompt; generate {len(answer)} or more ({len(answer) + 4}, with room for a"
                                  " few words before it)")
        fits = longest(lambda count: len(prompt(count)), budget)
        if self.haystack.what and fits > len(self.haystack.lines) and not self.wrapped:
            self.wrapped = True
            warnings.warn(f"the haystack ({self.haystack.what}) runs out of lines within {length:,} tokens: its {len(self.haystack.lines):,}"
                          " lines are read again from the first, so part of it repeats an earlier part; give --data with more text",
                          stacklevel=2)
        other = value
        while other == value:
            other = self._number()
        return Probe(length, depth, key, value, prompt(fits), prompt(fits, other), answer,
                     self.place(self.haystack.lines_from(start, fits), depth)[1])

    def _number(self) -> str:
        return str(self.rng.randint(10 ** (DIGITS - 1), 10**DIGITS - 1))


def longest(size: Callable[[int], int], budget: int) -> int:
    """The most lines whose prompt's ``size`` in tokens (growing with the lines, and within the
    budget at none) is within ``budget``. Guesses on the line through the last two sizes come within a line or so; from
    the last, steps of 1, 2, 4... lines bracket the answer and halving the bracket finds it: a few
    encodings of a long prompt, where doubling from one line took two for each doubling."""
    size = functools.cache(size)  # the bracket's ends are asked for again
    fits, over, last, guess = 0, math.inf, (0, size(0)), 16  # size(fits) <= budget < size(over)
    for _ in range(8):  # each guess on the line through the last two sizes
        taken = size(guess)
        fits, over = (max(fits, guess), over) if taken <= budget else (fits, min(over, guess))
        (count, counted), last = last, (guess, taken)
        per_line = max((taken - counted) / (guess - count), 1e-3)  # tokens a line takes, between the two
        guess = max(1, guess + math.floor((budget - taken) / per_line))
        if not fits < guess < over:
            break
    if guess <= fits or (guess < over and size(guess) <= budget):  # the answer is at the guess or past it
        fits, step = max(fits, guess), 1
        while fits + step < over and size(fits + step) <= budget:
            fits, step = fits + step, step * 2
        over = min(over, fits + step)
    else:  # short of it
        over, step = min(over, guess), 1
        while over - step > fits and size(over - step) > budget:
            over, step = over - step, step * 2
        fits = max(fits, over - step)
    while over - fits > 1:
        middle = (fits + over) // 2
        fits, over = (middle, over) if size(middle) <= budget else (fits, middle)
    return fits


@dataclass
class Found:
    probe: Probe
    continuation: str
    answer_loss: float  # summed over the answer's tokens
    control_loss: float  # the same, after the control prompt

    @property
    def loss_per_digit(self) -> float:
        return self.answer_loss / len(self.probe.value)

    @property
    def gain_per_digit(self) -> float:
        return (self.control_loss - self.answer_loss) / len(self.probe.value)

    @property
    def hit(self) -> bool:
        return re.search(rf"(?<!\d){self.probe.value}(?!\d)", self.continuation) is not None


def search(loaded: Loaded, tokenizer, probes: list[Probe], new_tokens: int, batch: int, device: torch.device) -> list[Found]:
    """Each probe's greedy continuation (through the engine, with its cache) and the loss of its
    answer's tokens after the prompt and after the control prompt, ``batch`` probes at a time;
    the memory of a batch with a longer prompt than any before is watched (``archlab.memory``)."""
    model, autocast = loaded.on(device)
    engine = Engine(model)
    found, longest = [], 0
    with torch.no_grad(), autocast:
        for first in range(0, len(probes), batch):
            some = probes[first : first + batch]
            prompt = max(len(p.prompt) for p in some)
            with Watched(device, "its caches and activations") if prompt > longest else nullcontext():
                generated = engine.generate([torch.tensor(p.prompt, device=device) for p in some], new_tokens).tokens
                losses = [continuation_scores(model, [p.prompt + p.answer for p in some], [len(p.answer) for p in some], device),
                          continuation_scores(model, [p.control + p.answer for p in some], [len(p.answer) for p in some], device)]
            longest = max(longest, prompt)
            for probe, tokens, (answer, *_), (control, *_) in zip(some, generated, *losses, strict=True):
                found.append(Found(probe, tokenizer.decode(tokens), answer, control))
    return found


def probeable(run: Path) -> None:
    """Refuse, before anything is loaded, a path that is not a run with a tokenizer: a needle in a
    haystack is text."""
    scorable(run)
    if tokenizer_of(run) is None:
        raise _textless(run, load_config(str(run / "config.yaml")).data.source in SYNTHETIC)


def _textless(run: Path, recall: bool) -> EvaluationError:
    return EvaluationError(f"{run} trained on {'a recall task' if recall else 'token ids'} and has no tokenizer: a needle in a"
                           " haystack is text")


def niah(run: Path, lengths: list[int], depth_count: int, sequences: int, device: torch.device, haystack: str = "noise",
         data: str | None = None, batch: int = 8, new_tokens: int = 16, seed: int = 0,
         say: Callable[[str], None] | None = None) -> list[Found]:
    """``sequences`` probes of the run's latest checkpoint at each length and each of
    ``depth_count`` depths, in a haystack of ``noise`` or of ``text`` (its held-out split, or all
    of ``data``); ``say`` is told before text is tokenized."""
    loaded = Loaded.of(run, data, say)
    if loaded.tokenizer is None:
        raise _textless(run, loaded.recall)
    if loaded.recall:  # read as a file of that name, which was then not found
        raise EvaluationError(f"--data {data}: a recall task is token ids, and a haystack is text; give a text file or folder, stdlib"
                              " or hf:NAME")
    _check_room(loaded.model, lengths, depth_count * sequences, batch, new_tokens, device)
    tokenizer = load_tokenizer(str(loaded.tokenizer), loaded.model.spec.vocab_size)
    if haystack == "noise":
        hay = Haystack.noise()
    else:
        tokens, _, what = loaded.stream()
        hay = Haystack.text(tokenizer.decode(tokens.tolist()), what)
    drawn = Probes(hay, tokenizer, new_tokens, seed)
    probes = [drawn.draw(n, d) for n in lengths for d in depths(depth_count) for _ in range(sequences)]
    return search(loaded, tokenizer, probes, new_tokens, batch, device)


DRAWING_BYTES_PER_TOKEN = 400  # at the peak of drawing a probe: its text, the tokenizer's encoding, the ids (365 and 398 measured at 256K and 1M)
HELD_BYTES_PER_TOKEN = 2 * 36  # a drawn probe's prompt and control prompt: lists of Python ints (a pointer and an int each)


def _check_room(model, lengths: list[int], per_length: int, batch: int, new_tokens: int, device: torch.device) -> None:
    """Refuse (``NoRoom``) probes that would not fit before any is drawn: every probe is drawn
    before any is searched, for minutes at tens of millions of tokens, and only then was the
    cache of the longest found too large, or memory filled as they were drawn."""
    check_room(DRAWING_BYTES_PER_TOKEN * max(lengths) + HELD_BYTES_PER_TOKEN * per_length * sum(lengths), "cpu",
               "the probes' prompts")
    check_cache_room(model, min(batch, per_length * len(lengths)), max(lengths) + new_tokens, next(model.parameters()).dtype, device)


def _cells(found: list[Found]) -> dict[tuple[int, float], list[Found]]:
    """The probes of each (length, depth asked)."""
    cells: dict[tuple[int, float], list[Found]] = {}
    for f in found:
        cells.setdefault((f.probe.length, f.probe.depth), []).append(f)
    return cells


def rows(run: str, found: list[Found]) -> list[dict]:
    """A row per length and depth: the share of probes found, and their answer's loss a digit."""
    return [{"run": run, "length": length, "depth %": Decimals(depth, 1), "placed %": Decimals(fmean(f.probe.placed for f in some), 1),
             "probes": len(some),
             "found": Decimals(fmean(f.hit for f in some), 4), "loss/digit": Decimals(fmean(f.loss_per_digit for f in some), 4),
             "gain/digit": Decimals(fmean(f.gain_per_digit for f in some), 4)}
            for (length, depth), some in _cells(found).items()]


MISPLACED_BY = 10.0  # points of depth between the needle's place and the depth asked that misplaced() reports


def misplaced(found: list[Found]) -> list[tuple[int, float, float]]:
    """(length, depth asked, depth placed) where the needle sits more than ``MISPLACED_BY`` percent
    from the depth asked, on average: a haystack of few lines, at a short length, has few places to put it."""
    placed = {cell: fmean(f.probe.placed for f in some) for cell, some in _cells(found).items()}
    return [(length, depth, at) for (length, depth), at in placed.items() if abs(at - depth) > MISPLACED_BY]


def summary(run: str, found: list[Found]) -> str:
    """A run's probes found, the answer's loss and the gain from the needle, over all its probes."""
    loss, gain = fmean(f.loss_per_digit for f in found), round(fmean(f.gain_per_digit for f in found), 4) + 0.0  # not -0.0000
    return (f"{run}: {sum(f.hit for f in found)} of {len(found)} probes found; the answer's loss {loss:.4f} a digit (a uniform"
            f" guess at each is {math.log(10):.4f}); reading the needle gains {gain:+.4f} a digit")


def plot(runs: dict[str, list[Found]], path: Path) -> None:
    """A heat map per run of the share of probes found at each length (across) and depth (down),
    each cell also giving the gain from reading the needle, a digit."""
    from matplotlib.figure import Figure

    columns = min(3, len(runs))
    lines_of_panels = math.ceil(len(runs) / columns)
    fig = Figure(figsize=(1.5 + 4.5 * columns, 0.5 + 3.7 * lines_of_panels), layout="constrained")
    panels = fig.subplots(lines_of_panels, columns, squeeze=False)
    for ax in panels.flat[len(runs) :]:
        ax.set_visible(False)
    for ax, (run, found) in zip(panels.flat, runs.items()):
        lengths = sorted({f.probe.length for f in found})
        depth_list = sorted({f.probe.depth for f in found})
        cells = [[[f for f in found if f.probe.length == n and f.probe.depth == d] for n in lengths] for d in depth_list]
        image = ax.imshow([[fmean(f.hit for f in cell) for cell in line] for line in cells], vmin=0, vmax=1, cmap="RdYlGn",
                          aspect="auto")
        for i, line in enumerate(cells):
            for j, cell in enumerate(line):
                share, gain = Decimals(fmean(f.hit for f in cell), 2), Decimals(fmean(f.gain_per_digit for f in cell), 2)
                ax.text(j, i, f"{share:.2f}\ngain {gain:.2f}/digit", ha="center", va="center", fontsize=7,
                        color="white" if share < 0.25 else "black")  # white on the map's darkest reds
        ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths])
        ax.set_yticks(range(len(depth_list)), [f"{d:.0f}%" for d in depth_list])
        ax.set_xlabel("length (tokens)")
        ax.set_title(run, fontsize=9)
    for ax in panels[:, 0]:
        ax.set_ylabel("needle depth")
    fig.colorbar(image, ax=panels.flat[: len(runs)], label="share of probes found")
    save_figure_whole(fig, path, dpi=110)
