"""Downstream tasks through lm-evaluation-harness (the paper's Table 2 averages such tasks;
``archlab downstream``).

A trained run is wrapped as the harness's language model: its latest checkpoint and its own
tokenizer, scored in bfloat16 on a GPU as it trained. The run's byte-level BPE has no special
tokens, and training concatenates documents as they are, so a newline stands where the harness
wants an end-of-text token (before an empty context, and before each document's first token).
Contexts longer than ``max_length`` (by default the length the run trained on) keep their last
tokens: as many as leave room for what a request generates. Generation is greedy, through the
inference engine and its cache. A continuation longer than ``max_length``, or a request to
generate as many tokens, is refused (lm-evaluation-harness's own models assert it).
"""

from __future__ import annotations

import logging
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from archlab.engine import Engine
from archlab.memory import ACTIVATIONS, Watched
from archlab.table import Decimals
from archlab.train.data import encode, load_tokenizer
from archlab.train.evaluate import EvaluationError, Loaded, continuation_scores

TARGET_PAST_CHOICES = "Label index was not in within range"  # the start of the harness's warning (lm_eval.api.task)


class ArchlabLM(TemplateLM):
    """A trained run as lm-evaluation-harness's language model."""

    def __init__(self, loaded: Loaded, device: torch.device, batch: int = 8, max_length: int | None = None):
        super().__init__()
        if loaded.tokenizer is None:
            raise EvaluationError(f"{loaded.run} trained on {'a recall task' if loaded.recall else 'token ids'} and has no"
                                  " tokenizer: downstream tasks are text")
        self.tokenizer = load_tokenizer(str(loaded.tokenizer), loaded.model.spec.vocab_size)
        self.model, self.autocast = loaded.on(device)
        self._device, self.batch = device, batch
        self.max_length = max_length or loaded.config.seq_len
        self.newline = encode(self.tokenizer, ["\n"], "a newline")[0].ids[0]

    @property
    def eot_token_id(self) -> int:
        return self.newline

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return encode(self.tokenizer, [string], "a task's text")[0].ids

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """The harness's, except for an empty context: the end-of-text newline stands before the
        whole continuation, every token of which is scored. (The harness takes a continuation's
        first token as the context where it is the end-of-text token, as it is of a continuation
        beginning with a newline here: one of its tokens would go unscored.)"""
        pairs = [request.args for request in requests]
        return self._loglikelihood_tokens(
            [((context, continuation), *(([self.newline], self.tok_encode(continuation)) if context == ""
                                         else self._encode_pair(context, continuation)))
             for context, continuation in pairs], disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """For each (_, context, continuation) of token ids: the log-probability of the
        continuation after the context (its last ``max_length`` tokens), and whether greedy
        decoding would give it. Requests run ``batch`` at a time, longest first, padded on the
        right, where a causal model's earlier positions do not see the padding; the first batch,
        the longest, has its memory watched (``archlab.memory``)."""
        pairs = [(context, continuation) for _, context, continuation in requests]
        if (longest := max((len(continuation) for _, continuation in pairs), default=0)) > self.max_length:
            raise EvaluationError(f"a task's continuation of {longest:,} tokens is longer than the {self.max_length:,} the model"
                                  " reads (--max-length): only its last tokens could be scored; give a larger --max-length")
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        found: dict[int, tuple[float, bool]] = {}
        with torch.no_grad(), self.autocast:
            for first in range(0, len(order), self.batch):
                some = order[first : first + self.batch]
                wholes = [(pairs[i][0] + pairs[i][1])[-(self.max_length + 1) :] for i in some]
                scored = [len(pairs[i][1]) for i in some]
                with Watched(self._device, ACTIVATIONS) if first == 0 else nullcontext():
                    scores = continuation_scores(self.model, wholes, scored, self._device)
                for i, (lost, correct, counted) in zip(some, scores):
                    found[i] = (-lost, correct == counted)
        return [found[i] for i in range(len(pairs))]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's whole log-probability, in windows of ``max_length`` tokens that each
        predict tokens the ones before have not (the harness's rolling windows)."""
        totals = []
        for (text,) in (request.args for request in requests):
            windows = [make_disjoint_window(w) for w in
                       get_rolling_token_windows(self.tok_encode(text), self.newline, self.max_length, context_len=1)]
            totals.append(sum(logprob for logprob, _ in self._loglikelihood_tokens([(None, *w) for w in windows])))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first of each request's ``until`` strings, each after
        the last ``max_length`` less its ``max_gen_toks`` tokens of its context."""
        engine, out = Engine(self.model), []
        # as the harness's own models read them: max_gen_toks or an alias of it (max_new_tokens, ...), 256 if none
        try:
            requests = [(context, normalize_gen_kwargs(kwargs)) for context, kwargs in (request.args for request in requests)]
        except (TypeError, ValueError) as exc:  # int("abc") of max_gen_toks, float() of a temperature
            raise EvaluationError(f"a task's generation_kwargs cannot be read ({exc}): max_gen_toks (or max_new_tokens) is a whole"
                                  " number of tokens, temperature a number") from None
        if (fewest := min((kwargs["max_gen_toks"] for _, kwargs in requests), default=0)) < 0:
            raise EvaluationError(f"a task asks for {fewest:,} new tokens (max_gen_toks); give 0 or more")
        if any(kwargs["do_sample"] for _, kwargs in requests):
            warnings.warn("archlab generates greedily for downstream tasks; the tasks' sampling settings are ignored", stacklevel=2)
        with torch.no_grad(), self.autocast:
            for first in range(0, len(requests), self.batch):
                some = requests[first : first + self.batch]
                wanted = [kwargs["max_gen_toks"] for _, kwargs in some]
                if max(wanted) == 0:  # nothing to generate: each continuation is empty
                    out.extend("" for _ in some)
                    continue
                if max(wanted) >= self.max_length:
                    raise EvaluationError(f"a task asks for {max(wanted):,} new tokens, and the model reads {self.max_length:,}"
                                          " (--max-length): no context would be left before them; give a larger --max-length")
                prompts = [torch.tensor((self.tok_encode(context) or [self.newline])[-(self.max_length - new) :],
                                        device=self._device) for (context, _), new in zip(some, wanted)]  # an empty context: the end-of-text newline
                for (_, kwargs), new, tokens in zip(some, wanted, engine.generate(prompts, max(wanted)).tokens):
                    text = self.tokenizer.decode(tokens[:new])
                    stops = kwargs.get("until") or []
                    for stop in [stops] if isinstance(stops, str) else stops:
                        text = text.split(stop)[0]
                    out.append(text)
        return out


def task_manager(names: list[str], include_path: Path | None) -> TaskManager:
    """The harness's tasks, and those in ``include_path``, indexing the harness's own (seconds)
    only where a name is not in ``include_path``; a ValueError names the tasks found in neither,
    with the files of ``include_path`` the harness skipped and why (its debug log is all it says)."""
    skipped: list[str] = []

    def note(record: logging.LogRecord) -> None:  # its skips of files of ours
        if record.msg == "Skip %s (%s)" and include_path and Path(record.args[0]).resolve().is_relative_to(include_path.resolve()):
            skipped.append(f"{record.args[0]} ({' '.join(str(record.args[1]).split())})")

    with _overheard("lm_eval.tasks._index", note):
        own = TaskManager(include_path=str(include_path), include_defaults=False) if include_path else None
        manager = own if own and all(name in own.all_tasks for name in names) else TaskManager(include_path=include_path and str(include_path))
    if unknown := [name for name in names if name not in manager.all_tasks]:
        where = f" or {include_path}" if include_path else ""
        unread = f", where lm-evaluation-harness skipped {'; '.join(dict.fromkeys(skipped))}" if skipped else ""
        raise ValueError(f"no task {', '.join(map(repr, unknown))} in lm-evaluation-harness{where}{unread}")
    return manager


@contextmanager
def targets_among_choices(names: list[str]) -> Iterator[None]:
    """Refuses, once the harness is done, tasks with a document whose target is not among its
    choices (an index past them, or a text none of them is): the harness only warns, and scores
    the document as answered wrong."""
    misfits: list[str] = []

    def note(record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith(TARGET_PAST_CHOICES):
            misfits.append(" ".join(record.getMessage().partition("Sample:")[2].split()))

    with _overheard("lm_eval.api.task", note):
        yield
    if misfits:
        raise EvaluationError(f"{', '.join(names)}: {len(misfits):,} of the documents scored have a target that is not among"
                              f" their choices, such as {misfits[0][:300]}; mend the task's doc_to_target or doc_to_choice")


@contextmanager
def _overheard(logger: str, note: Callable[[logging.LogRecord], None]) -> Iterator[None]:
    """Every record of the harness's ``logger`` given to ``note``, whatever its level, while only
    those the logger would have shown reach its handlers: some things the harness says only below
    the level it shows."""
    log = logging.getLogger(logger)
    shown, level = log.getEffectiveLevel(), log.level

    def heard(record: logging.LogRecord) -> bool:
        note(record)
        return record.levelno >= shown

    log.addFilter(heard)
    log.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        log.removeFilter(heard)
        log.setLevel(level)


def raised_by_model(exc: BaseException) -> bool:
    """Whether ``exc`` came up through ``ArchlabLM`` (archlab scoring or generating), rather than
    from the harness's own handling of its tasks."""
    return any(frame.f_code.co_filename == __file__ for frame, _ in traceback.walk_tb(exc.__traceback__))


def _scores(results: dict) -> list[tuple[str, str, float, float | None]]:
    """(task, metric, value, standard error) for each task and metric of lm-evaluation-harness's results."""
    found = []
    for task, reported in results["results"].items():
        for key, value in reported.items():
            metric, comma, filtered = key.partition(",")  # "acc,none": a metric and its filter; "alias", "sample_len": no metric
            if not comma or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = reported.get(f"{metric}_stderr,{filtered}")
            found.append((task, metric, value, stderr if isinstance(stderr, (int, float)) else None))
    return found


def metrics(run: str, results: dict) -> list[dict]:
    """A row per task and metric of lm-evaluation-harness's results, with its standard error."""
    return [{"run": run, "task": task, "metric": metric, "value": Decimals(value, 4),
             "stderr": None if stderr is None else Decimals(stderr, 4)} for task, metric, value, stderr in _scores(results)]


def average(run: str, results: dict, tasks: list[str], preferred: list[str]) -> tuple[dict | None, list[str]]:
    """The run's ``tasks`` (the names asked for: a group by its own aggregate, not its members
    again) averaged as the paper's Table 2 does, each by the first metric of ``preferred`` it
    reports: a row, or None where fewer than two tasks report one; and the tasks left out."""
    taken: dict[str, tuple[int, float]] = {}
    for task, metric, value, _ in _scores(results):
        if task in tasks and metric in preferred and preferred.index(metric) < taken.get(task, (len(preferred), 0.0))[0]:
            taken[task] = (preferred.index(metric), value)
    left_out = [task for task in tasks if task not in taken]
    if len(taken) < 2:
        return None, left_out
    mean = sum(value for _, value in taken.values()) / len(taken)
    return {"run": run, "task": f"average of {len(taken)}", "metric": ", else ".join(preferred), "value": Decimals(mean, 4),
            "stderr": None}, left_out
