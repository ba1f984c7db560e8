"""Downstream tasks through lm-evaluation-harness (the paper's Table 2 averages such tasks;
``archlab downstream``).

A trained run is wrapped as the harness's language model: its latest checkpoint and its own
tokenizer, scored in bfloat16 on a GPU as it trained. The run's byte-level BPE has no special
tokens, and training concatenates documents as they are, so a newline stands where the harness
wants an end-of-text token (before an empty context, and before each document's first token).
Contexts longer than ``max_length`` (by default the length the run trained on) keep their last
tokens. Generation is greedy, through the inference engine and its cache.
"""

from __future__ import annotations

import warnings

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from archlab.engine import Engine
from archlab.loss import scores
from archlab.table import Decimals
from archlab.train.data import load_tokenizer
from archlab.train.evaluate import EvaluationError, Loaded


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
        self.newline = self.tokenizer.encode("\n").ids[0]

    @property
    def eot_token_id(self) -> int:
        return self.newline

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string).ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """For each (_, context, continuation) of token ids: the log-probability of the
        continuation after the context (its last ``max_length`` tokens), and whether greedy
        decoding would give it. Requests run ``batch`` at a time, longest first, padded on the
        right, where a causal model's earlier positions do not see the padding."""
        pairs = [(context, continuation) for _, context, continuation in requests]
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        found: dict[int, tuple[float, bool]] = {}
        with torch.no_grad(), self.autocast:
            for first in range(0, len(order), self.batch):
                some = order[first : first + self.batch]
                wholes = [(pairs[i][0] + pairs[i][1])[-(self.max_length + 1) :] for i in some]
                longest = max(len(w) for w in wholes) - 1
                inputs = torch.full((len(some), longest), self.newline, dtype=torch.long)
                for row, whole in enumerate(wholes):
                    inputs[row, : len(whole) - 1] = torch.tensor(whole[:-1])
                hidden = self.model.hidden(inputs.to(self._device))
                for row, (i, whole) in enumerate(zip(some, wholes)):
                    ends = len(whole) - 1
                    n = min(len(pairs[i][1]), ends)  # a continuation longer than the model reads: its last tokens
                    targets = torch.tensor(whole[-n:], device=hidden.device)
                    lost, correct, counted = scores(hidden[row, ends - n : ends], self.model.head.weight, targets).tolist()
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
        """Greedy continuations, cut at the first of each request's ``until`` strings."""
        engine, out = Engine(self.model), []
        if any(request.args[1].get("do_sample") or request.args[1].get("temperature", 0) > 0 for request in requests):
            warnings.warn("archlab generates greedily for downstream tasks; the tasks' sampling settings are ignored", stacklevel=2)
        with torch.no_grad(), self.autocast:
            for first in range(0, len(requests), self.batch):
                some = [request.args for request in requests[first : first + self.batch]]
                new = max(kwargs.get("max_gen_toks", 256) for _, kwargs in some)
                prompts = [torch.tensor((self.tok_encode(context) or [self.newline])[-max(1, self.max_length - new) :],
                                        device=self._device) for context, _ in some]  # an empty context: the end-of-text newline
                for (_, kwargs), tokens in zip(some, engine.generate(prompts, new).tokens):
                    text = self.tokenizer.decode(tokens[: kwargs.get("max_gen_toks", 256)])
                    stops = kwargs.get("until") or []
                    for stop in [stops] if isinstance(stops, str) else stops:
                        text = text.split(stop)[0]
                    out.append(text)
        return out


def metrics(run: str, results: dict) -> list[dict]:
    """A row per task and metric of lm-evaluation-harness's results, with its standard error."""
    rows = []
    for task, found in results["results"].items():
        for key, value in found.items():
            metric, comma, filtered = key.partition(",")  # "acc,none": a metric and its filter; "alias", "sample_len": no metric
            if not comma or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = found.get(f"{metric}_stderr,{filtered}")
            rows.append({"run": run, "task": task, "metric": metric, "value": Decimals(value, 4),
                         "stderr": Decimals(stderr, 4) if isinstance(stderr, (int, float)) else None})
    return rows
