"""How well trained runs use longer contexts: the loss on the last tokens of windows of the
held-out split (or of another corpus), given prefixes of several lengths (the paper's
last-512-token perplexity over 2K to 8K prefixes; ``archlab evaluate``).

Each window ends at the same token whatever its length, so every length scores the same tokens and
a lower loss at a longer length is the model's use of the context before them. A run on a recall
task is scored on fresh sequences of each length instead, at the answer positions alone.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from archlab.files import path_kind, save_figure_whole
from archlab.loss import IGNORE, scores
from archlab.memory import ACTIVATIONS, Watched
from archlab.model import Model
from archlab.spec import described
from archlab.table import Decimals
from archlab.train.checkpoint import info_of, latest_read, load_checkpoint, resolve, step_of
from archlab.train.config import SYNTHETIC, TrainConfig, changes_since_trained, holds_examples, load_config
from archlab.train.curves import RunError, read_metrics
from archlab.train.data import Batch, RecallTask, prepare, remove_advice, tokens_of, undo_tokenizing


class EvaluationError(Exception):
    """What cannot be evaluated as asked, said in words."""


def windows(tokens: np.ndarray, lengths: list[int], sequences: int, what: str = "the held-out split",
            counted: np.ndarray | None = None, last: int | None = None) -> dict[int, Batch]:
    """For each length L, ``sequences`` windows of L input tokens and their next tokens, ending at
    the same positions for every length: evenly spread over ``tokens`` as far as the longest allows
    (fewer where the split has fewer distinct places to end). With ``counted`` (beside the tokens:
    the responses of examples), the windows' targets count where it says; with ``last``, only
    among their last ``last`` targets, and a notice says where those overlap."""
    longest = max(lengths)
    if len(tokens) < longest + 1:
        raise EvaluationError(f"{what} has {len(tokens):,} tokens, fewer than the {longest + 1:,} a window of"
                              f" {longest:,} and its next token need; give lengths up to {len(tokens) - 1:,}")
    span = len(tokens) - 1 - longest  # from the first place a window's input may end to the last
    sequences = min(sequences, span + 1)  # past that, every place is taken: the same ends, without a loop over the rest
    ends = sorted({longest + i * span // max(1, sequences - 1) for i in range(sequences)})  # one past each window's input
    if last is not None:
        _say_overlap(ends, last, span, what, counted)
    found = {}
    for length in lengths:
        rows = torch.from_numpy(np.stack([np.asarray(tokens[end - length : end + 1], dtype=np.int64) for end in ends]))
        mask = None if counted is None else torch.from_numpy(np.stack([counted[end - length + 1 : end + 1] for end in ends]))
        if last is not None:
            in_last = torch.arange(length) >= length - last  # of each window's targets
            mask = in_last.repeat(len(ends), 1) if mask is None else mask & in_last
        found[length] = Batch(rows[:, :-1], rows[:, 1:], mask)
    return found


def _say_overlap(ends: list[int], last: int, span: int, what: str, counted: np.ndarray | None) -> None:
    """A notice where windows end closer together than ``last`` tokens: a token is then scored in
    more than one window (each time after another context), and "tokens scored" counts it each
    time. Of examples, only the tokens ``counted`` are scored."""
    weight = np.ones(ends[-1] + 1, dtype=bool) if counted is None else np.asarray(counted[: ends[-1] + 1], dtype=bool)
    covered = np.zeros_like(weight)  # the positions of the targets some window scores
    for end in ends:
        covered[end - last + 1 : end + 1] = True
    distinct, scored = int((covered & weight).sum()), sum(int(weight[end - last + 1 : end + 1].sum()) for end in ends)
    if distinct < scored:
        warnings.warn(f"the last {last:,} tokens of the {len(ends):,} windows overlap: the {scored:,} tokens they score are"
                      f" {distinct:,} distinct tokens of {what}; --sequences {span // last + 1:,} or fewer scores each once", stacklevel=3)


@dataclass
class Evaluated:
    length: int
    sequences: int
    scored: int  # tokens whose prediction counted, over all sequences
    loss: float
    accuracy: float | None  # of a recall task's answers, or of examples' responses

    def row(self, run: str) -> dict:
        row = {"run": run, "length": self.length, "sequences": self.sequences, "tokens scored": self.scored,
               "loss": Decimals(self.loss, 4), "ppl": math.exp(min(self.loss, 50.0))}
        if self.accuracy is not None:
            row["acc"] = Decimals(self.accuracy, 4)
        return row


def scorable(run: Path) -> None:
    """Refuse, before anything is loaded, a path that is not a run whose held-out data can be
    scored: a run's folder, holding the config.yaml that says what it held out."""
    resolve(run)
    if run.parent.name == "checkpoints":
        raise EvaluationError(f"{run} is a checkpoint; give its run's folder, {run.parents[1]}, whose config.yaml says how it"
                              " trained (its latest checkpoint is scored)")
    if path_kind(run / "config.yaml") is None:  # another kind of path is said as load_config reads it
        raise EvaluationError(f"{run} has no config.yaml, which says how it trained; restore it to score the run")


def _say_an_earlier_step(run: Path, used: Path) -> None:
    """A notice where the latest checkpoint, which is scored, is behind the steps the run's metrics
    logged (a run stopped between checkpoints, or still training): ``curves`` shows the last."""
    try:
        records, _ = read_metrics(run / "metrics.jsonl")
    except (OSError, RunError):  # none, or damaged: nothing to compare with
        return
    if records and records[-1]["step"] > step_of(used):
        warnings.warn(f"{run} is scored at its latest checkpoint, step {step_of(used):,}; its metrics go on to step"
                      f" {records[-1]['step']:,}", stacklevel=3)


SCORED_AS_TRAINED = ("seq_len", "precision", "seed")  # what scoring reads of a run's config, besides its data (checked by its fingerprint)


def _say_an_edited_config(file: Path, config: TrainConfig, used: Path, trained: object) -> None:
    """A notice where ``file`` (``config``) gives another length, precision or seed than checkpoint
    ``used`` trained with (``trained``, as its state.json records it; nothing to compare where it
    records none that reads): the run is scored as edited, which one may mean, or not."""
    if edited := described({key: pair for key, pair in changes_since_trained(trained, config).items() if key in SCORED_AS_TRAINED}):
        warnings.warn(f"{file} was edited since checkpoint {used} was saved ({', '.join(edited)}); the run is scored as edited",
                      stacklevel=3)


@dataclass
class Loaded:
    """A trained run ready to be scored: its latest model, the config it trained with, and the
    corpus to score it on (``data``, or None for its held-out split)."""

    run: Path
    model: Model
    config: TrainConfig
    tokenizer: Path | None
    data: str | None
    corpus: str | None  # the fingerprint of the tokens the checkpoint trained on (None: one from before they recorded it)
    say: Callable[[str], None] | None = None  # told before text is tokenized (the default stdlib takes 6 to 20 s)

    @classmethod
    def of(cls, run: Path, data: str | None = None, say: Callable[[str], None] | None = None) -> Loaded:
        scorable(run)

        def read(run_dir: Path, used: Path) -> tuple:  # the weights of one checkpoint, and what its state.json records
            _, model, used, tokenizer = load_checkpoint(run_dir, used, "score")
            return model, used, tokenizer, info_of(used, "score")

        model, used, tokenizer, info = latest_read(run, read)
        _say_an_earlier_step(run, used)
        config = load_config(str(run / "config.yaml"))
        _say_an_edited_config(run / "config.yaml", config, used, info.get("config"))
        return cls(run, model, config, tokenizer, data, info.get("corpus"), say)

    @property
    def source(self) -> str:
        return self.data or self.config.data.source

    @property
    def recall(self) -> bool:
        """Whether the sequences are a recall task's, scored at the answers alone."""
        return self.source in SYNTHETIC

    @property
    def answers(self) -> bool:
        """Whether only some tokens count (a recall task's answers, examples' responses), whose
        accuracy is then scored too, as training's evaluations do."""
        return self.recall or holds_examples(self.source)

    def sequences(self, lengths: list[int], sequences: int, last: int | None = None) -> dict[int, Batch]:
        """For each length, ``sequences`` windows of the held-out split (or of all of ``data``, read
        with the run's tokenizer) ending at the same tokens, counting their ``last`` targets (None:
        all); on a recall task, fresh sequences, counting their answers."""
        if self.recall:
            vocab, seed = self.model.spec.vocab_size, self.config.seed
            tasks = {n: RecallTask(self.source, vocab, n, seed) for n in lengths}
            named = tasks[lengths[0]]
            if self.data is None and self.corpus not in (None, named.fingerprint):  # config.yaml edited from text to a task
                raise EvaluationError(f"{named.describe} is not the data {self.run} trained on: its checkpoint records {self.corpus};"
                                      " put the run's data back, or give --data to score other data")
            return {n: task.batch("val", 0, sequences) for n, task in tasks.items()}
        tokens, counted, what = self.stream()
        return windows(tokens, lengths, sequences, what, counted, last)

    def stream(self) -> tuple[np.ndarray, np.ndarray | None, str]:
        """The held-out split's tokens (or all of ``data``'s, read with the run's tokenizer), which
        of them count (of examples, their responses; None: every one), and what they are, in words."""
        cfg, vocab = self.config, self.model.spec.vocab_size
        if self.data is None:
            data_dir = Path(cfg.data.cache or self.run)
            undo = undo_tokenizing(data_dir)
            held_out = prepare(cfg.data, vocab, 1, cfg.seed, data_dir, resume=True, say=self.say)
            if self.corpus not in (None, held_out.fingerprint):  # its held-out split would be other tokens, trained on, maybe
                undo()
                raise EvaluationError(f"{held_out.describe} is not the data {self.run} trained on: its checkpoint records"
                                      f" {self.corpus}, the data now gives {held_out.fingerprint}; put the run's data back{remove_advice(data_dir, cfg.data.source)} to"
                                      " score its held-out split, or give --data to score other text")
            return held_out.splits["val"], (held_out.masks or {}).get("val"), "the held-out split"
        return (*tokens_of(cfg.data.model_copy(update={"source": self.data}), vocab, self.tokenizer, self.say),
                f"data source {self.data!r}")

    def on(self, device: torch.device):
        """The model on ``device`` in eval mode, and the precision to score in, as the run's config trained
        it there (``precision``: bf16 autocast, fp32, or auto: bf16 on CUDA, fp32 on the CPU)."""
        return self.model.to(device).eval(), self.config.autocast(device)


def evaluate(run: Path, lengths: list[int], last: int, sequences: int, device: torch.device,
             data: str | None = None, batch: int = 8, say: Callable[[str], None] | None = None) -> list[Evaluated]:
    """The run's latest checkpoint scored at each length, ``batch`` windows at a time: on its
    held-out split (or all of ``data``, read with the run's tokenizer), the loss of the last
    ``last`` tokens of each window (of examples, the loss and accuracy of the responses among
    them); on a recall task, the loss and accuracy of the answers."""
    loaded = Loaded.of(run, data, say)
    if not loaded.recall and last > min(lengths):
        raise EvaluationError(f"--last {last:,} is longer than the shortest length, {min(lengths):,}: every length scores the same"
                              " last tokens")
    batches = loaded.sequences(lengths, sequences, last)
    model, autocast = loaded.on(device)
    found = []
    with torch.no_grad(), autocast:
        for length, windows in batches.items():
            totals = sum(_position_scores(model, windows.inputs[i : i + batch].to(device), windows.counted_targets()[i : i + batch].to(device),
                                          watched=i == 0) for i in range(0, len(windows.inputs), batch))
            lost, correct, counted = totals.tolist()
            if not counted:
                raise EvaluationError(f"no response token is among the last {last:,} of the {length:,}-token windows; give a longer"
                                      " --last (or more --sequences)")
            found.append(Evaluated(length, len(windows.inputs), int(counted), lost / counted,
                                   correct / counted if loaded.answers else None))
    return found


def _position_scores(model: Model, inputs: torch.Tensor, targets: torch.Tensor, watched: bool = False) -> torch.Tensor:
    """``loss.scores`` of the positions counted (targets not ``IGNORE``) alone: the head runs on
    the last tokens of a long window, not on all of it. ``watched``: its memory is watched
    (``archlab.memory.Watched``); the first batch of a length, which the others repeat."""
    counted = targets != IGNORE
    with Watched(inputs.device, ACTIVATIONS) if watched else nullcontext():
        return scores(model.hidden(inputs)[counted], model.head.weight, targets[counted])


def continuation_scores(model: Model, sequences: list[list[int]], scored: list[int], device: torch.device) -> list[list[float]]:
    """For each sequence of token ids, ``loss.scores`` of its last ``scored`` tokens, each given
    the tokens before it: the sequences in one forward pass, padded on the right, which a causal
    model's earlier positions do not see."""
    inputs = torch.zeros((len(sequences), max(map(len, sequences)) - 1), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        inputs[row, : len(sequence) - 1] = torch.tensor(sequence[:-1])
    hidden = model.hidden(inputs.to(device))
    return [scores(hidden[row, len(sequence) - 1 - n : len(sequence) - 1], model.head.weight,
                   torch.tensor(sequence[len(sequence) - n :], device=device)).tolist() for row, (sequence, n) in enumerate(zip(sequences, scored))]


def plot(rows: list[dict], path: Path) -> None:
    """Loss against context length, a line per run."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for run in dict.fromkeys(row["run"] for row in rows):
        mine = [row for row in rows if row["run"] == run]
        ax.plot([row["length"] for row in mine], [row["loss"] for row in mine], marker="o", label=run)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("loss of the scored tokens")
    ax.set_title("held-out loss against context length")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure_whole(fig, path, dpi=110)
