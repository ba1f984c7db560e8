"""Training runs side by side: their metrics.jsonl read back as a table and as loss curves against
steps, tokens or training FLOPs (``archlab curves``)."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import statistics
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from archlab.block import whole_number
from archlab.cost import Cost
from archlab.environment import SettingsError, describe, read_settings, setting_lines, setting_of
from archlab.files import path_kind, regular, save_figure_whole
from archlab.table import Decimals
from archlab.train.checkpoint import RUN_SPEC


class RunError(Exception):
    """A run folder that cannot be read back, said in words."""


def _wrong_with(record: dict, before: dict | None) -> str | None:
    """What makes a record, which follows ``before`` (None: the first), one that training did not
    write: it logs a step past the one before, and finite numbers (a count of tokens not below 0,
    nor below the one before's)."""
    step, after = record["step"], before["step"] if before else 0
    if not whole_number(step) or step < 1:
        return f"its step {step!r:.60} is not a step"
    if step <= after:
        return f"its step {step} does not follow step {after}"
    for name, value in record.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            return f"its {name[:60]} {json.dumps(value)[:60]} is not a finite number"
    if record.get("tokens", 0) < 0:
        return f"its tokens {record['tokens']} are fewer than none"
    if before and record.get("tokens", math.inf) < before.get("tokens", 0):
        return f"its tokens {record['tokens']} are fewer than step {after}'s {before['tokens']}"
    return None


def read_metrics(file: Path) -> tuple[list[dict], list[str]]:
    """The records of a run's metrics.jsonl in order, and their lines as written. A last line that
    a kill cut short (no newline) is left out, as what came after the last record; any other line
    that is not a record training writes (steps in order, finite numbers) raises ``RunError``
    naming it and what is wrong with it."""
    text = regular(file).read_bytes().decode(errors="backslashreplace")  # bytes that are not UTF-8 read as \xff: no record
    lines = text.splitlines()
    records, kept = [], []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            wrong = _wrong_with(record, records[-1] if records else None) if "step" in record else "it logs no step"
        except (ValueError, TypeError):  # not JSON, or JSON but not an object
            wrong = ""
        except RecursionError:
            wrong = "its JSON nests too deeply"
        if wrong is not None:
            if number == len(lines) and not text.endswith("\n"):
                continue
            raise RunError(f"{file}, line {number}, is not a metrics record{f' ({wrong})' if wrong else ''}: {line[:60]}")
        records.append(record)
        kept.append(line)
    return records, kept


class Axis(str, Enum):
    step = "step"
    tokens = "tokens"
    flops = "flops"


@dataclass
class Run:
    label: str
    folder: Path
    records: list[dict]
    settings: list[dict]  # environment.yaml's

    @classmethod
    def read(cls, folder: Path, label: str) -> Run:
        file = folder / "metrics.jsonl"
        if not folder.is_dir():
            raise RunError(f"{folder} {'is not a folder' if folder.exists() else 'does not exist'}")
        if path_kind(file) is None:
            raise RunError(f"{folder} holds no metrics.jsonl: it is not a training run, or one that has logged no step yet")
        try:
            settings = read_settings(folder)
            records = read_metrics(file)[0]
        except SettingsError as exc:
            raise RunError(f"{exc}; mend or remove it") from None
        except OSError as exc:  # a FIFO, a folder or a link to nothing in the place of one of its files, or unreadable
            raise RunError(f"{exc.filename or file} {exc.strerror}") from None
        return cls(label, folder, records, settings)

    def setting(self) -> str:
        """What the run trained with; each setting from its step where a resume changed it."""
        if not self.settings:
            return "not recorded (trained before runs kept it)"
        if len(self.settings) == 1:
            return describe(setting_of(self.settings[0]))
        return "; then ".join(f"{describe(setting_of(s))} from step {s['from step']}" for s in self.settings)

    @functools.cached_property  # read from the run's files once, for both panels of a plot
    def flops_per_token(self) -> float:
        """Training FLOPs per token of the spec and sequence length the run trained: a sequence's
        exact FLOPs over its tokens, as the trainer's MFU and the budgets count them."""
        from archlab.spec import SpecError, load_spec
        from archlab.train.config import load_config

        files = [self.folder / RUN_SPEC, self.folder / "config.yaml"]
        if missing := [f.name for f in files if not f.is_file()]:
            raise RunError(f"{self.folder} lacks {' and '.join(missing)}, which training FLOPs are worked out from; plot"
                           " it against steps or tokens")
        try:
            seq_len = load_config(str(files[1])).seq_len
            return Cost(load_spec(files[0])).train_flops_per_sequence(seq_len) / seq_len
        except SpecError as exc:
            raise RunError(f"{exc.source} does not load: {exc.problems[0].loc}: {exc.problems[0].msg}") from None

    def x(self, records: list[dict], axis: Axis) -> list[float]:
        if axis is Axis.step:
            return [r["step"] for r in records]
        if (untold := next((r["step"] for r in records if "tokens" not in r), None)) is not None:
            raise RunError(f"{self.folder / 'metrics.jsonl'} logs no tokens at step {untold}; plot it against steps")
        per_token = self.flops_per_token if axis is Axis.flops else 1
        return [r["tokens"] * per_token for r in records]

    def row(self) -> dict:
        """The last logged step's losses, the best evaluation and the training speed."""
        last = self.records[-1] if self.records else {}
        evals = self.evaluations
        best = min(evals, key=lambda r: r["eval_loss"]) if evals else {}
        speeds = [r["tok_s"] for r in self.records if "tok_s" in r]
        row = {
            "run": self.label,
            "steps": last.get("step", 0),
            "tokens": last.get("tokens"),
            "loss": _decimals(last.get("loss")),
            "eval loss": _decimals(evals[-1]["eval_loss"] if evals else None),
            "best eval loss": _decimals(best.get("eval_loss")),
            "at step": best.get("step"),
            "tok/s": statistics.median(speeds) if speeds else None,
        }
        if any("eval_acc" in r for r in evals):
            row["eval acc"] = _decimals(evals[-1].get("eval_acc"))
        return row

    @property
    def evaluations(self) -> list[dict]:
        return [r for r in self.records if "eval_loss" in r]

    def against(self, baseline: Run) -> dict:
        """Columns comparing the run with ``baseline`` as the paper's Figure 2 does, on their
        evaluation losses joined by straight lines: the tokens at which the run first comes down to
        the baseline's best evaluation loss (and their share of the tokens the baseline took to get
        there, 1 for the baseline itself, whose curve may rise or stay flat after it), and the run's
        evaluation loss at the training FLOPs the baseline had spent by its last evaluation (and
        that less the baseline's last). Empty where the run does not reach it, or did not evaluate
        that far."""
        theirs = baseline.evaluations
        if not theirs:
            raise RunError(f"the baseline {baseline.folder} has logged no evaluation to compare with")
        mine = self.evaluations
        losses = [r["eval_loss"] for r in mine]
        their_losses = [r["eval_loss"] for r in theirs]
        target = min(their_losses)
        their_tokens = crossing(baseline.x(theirs, Axis.tokens), their_losses, target)
        their_flops = baseline.x(theirs[-1:], Axis.flops)[0]
        step_flops = self.x(mine[-1:], Axis.flops)[0] / mine[-1]["step"] if mine and mine[-1]["step"] else 0.0
        tokens, at = compared(self.x(mine, Axis.tokens), self.x(mine, Axis.flops), losses, target, their_flops, step_flops=step_flops) if mine else (None, None)
        return {
            "tokens to baseline loss": None if tokens is None else round(tokens),
            "share of baseline tokens": None if tokens is None else Decimals(tokens / their_tokens, 3),
            "loss at baseline FLOPs": _decimals(at),
            "vs baseline": None if at is None else _decimals(at - their_losses[-1]),
        }


def compared(tokens: list[float], flops: list[float], values: list[float], target: float, their_flops: float,
             higher_is_better: bool = False, step_flops: float = 0.0) -> tuple[float | None, float | None]:
    """The paper's Figure 2 comparisons of a curve (its values at these tokens and training FLOPs,
    joined by straight lines) with a baseline's value ``target``: the tokens at which it
    first reaches it, and its value at the training FLOPs the baseline spent. A curve that ends
    less than one of its training steps (``step_flops``) short of those is taken at its end: a
    budget of the baseline's FLOPs trains whole steps, so it almost always ends that short."""
    if flops and flops[-1] < their_flops < flops[-1] + step_flops:
        their_flops = flops[-1]
    sign = -1 if higher_is_better else 1  # reaching a higher accuracy is coming down to its negative
    return crossing(tokens, [sign * v for v in values], sign * target), value_at(flops, values, their_flops)


def crossing(xs: list[float], ys: list[float], target: float) -> float | None:
    """The first x at which the line through the points (xs, ys) comes down to ``target``: the
    first point's x if it is there already, None if it never gets there."""
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y <= target:
            if i == 0:
                return x
            return xs[i - 1] + (x - xs[i - 1]) * (ys[i - 1] - target) / (ys[i - 1] - y)
    return None


def value_at(xs: list[float], ys: list[float], x: float) -> float | None:
    """The line through the points (xs, ys) at ``x``; None outside them."""
    for i in range(1, len(xs)):
        if xs[i - 1] <= x <= xs[i]:
            return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[0] if len(xs) == 1 and x == xs[0] else None


def trained_with(runs: list[Run]) -> list[str]:
    """The setting the runs share, or each with its runs: speeds compare only within one."""
    by_setting: dict[str, list[str]] = {}
    for run in runs:
        by_setting.setdefault(run.setting(), []).append(run.label)
    return setting_lines(by_setting, "run")


def started_from(runs: list[Run]) -> list[str]:
    """A line for each run fine-tuned from another (``init``): its steps, tokens and FLOPs count
    from its own start, not the starting run's."""
    from archlab.spec import SpecError
    from archlab.train.config import load_config

    lines = []
    for run in runs:
        try:
            init = load_config(str(run.folder / "config.yaml")).init if (run.folder / "config.yaml").is_file() else None
        except SpecError:  # a config that does not read says nothing of where the run started
            init = None
        if init:
            lines.append(f"- {run.label} was fine-tuned from {init}: its steps, tokens and FLOPs count from there")
    return lines


def tokens_apart(folders: list[Path], names: list[str]) -> list[str]:
    """A line where the runs' losses are per token of different tokenizers (or of token ids, or a
    recall task's): side by side in one table or plot, such numbers do not compare."""
    by_tokens: dict[str, list[str]] = {}
    for folder, name in zip(folders, names):
        by_tokens.setdefault(_tokens_of(folder), []).append(name)
    if len(by_tokens) <= 1:
        return []
    return ["notice: the runs' losses are per token of different tokenizers or data, and do not compare as numbers: "
            + "; ".join(f"{what}: {', '.join(runs)}" for what, runs in by_tokens.items())]


def _tokens_of(folder: Path) -> str:
    """What a run's tokens are, in words: its tokenizer (by a hash of its file), or its data's ids."""
    from archlab.spec import SpecError
    from archlab.train.checkpoint import CheckpointError, tokenizer_of
    from archlab.train.config import SYNTHETIC, load_config

    try:
        tokenizer = tokenizer_of(folder)
        if tokenizer is not None:
            return f"tokenizer {hashlib.blake2b(regular(tokenizer).read_bytes(), digest_size=4).hexdigest()}"
        if not (folder / "config.yaml").is_file():
            return "tokens not known (no config.yaml)"
        source = load_config(str(folder / "config.yaml")).data.source
    except (CheckpointError, SpecError, OSError):  # OSError: a tokenizer.json that is a folder, a FIFO or a link to nothing
        return "a tokenizer not found"
    return f"the {source} task" if source in SYNTHETIC else f"the token ids of {source}"


def _decimals(value: float | None) -> Decimals | None:
    return None if value is None else Decimals(value, 4)


def labels(folders: list[Path]) -> list[str]:
    """Each run by its folder's name, or by its path where names repeat."""
    names = [folder.resolve().name for folder in folders]
    return [name if names.count(name) == 1 else str(folder) for name, folder in zip(names, folders)]


def plot(runs: list[Run], axis: Axis, path: Path, baseline: Run | None = None) -> None:
    """Training and evaluation loss against ``axis``, a line per run; with a baseline, a dotted
    line at its last evaluation loss."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.5))
    panels = fig.subplots(1, 2)
    for ax, (key, title) in zip(panels, [("loss", "training loss"), ("eval_loss", "evaluation loss")]):
        for run in runs:
            logged = [r for r in run.records if key in r]
            if logged:
                ax.plot(run.x(logged, axis), [r[key] for r in logged], marker="o" if key == "eval_loss" else None,
                        markersize=3, label=run.label)
        if key == "eval_loss" and baseline is not None and baseline.evaluations:
            ax.axhline(min(r["eval_loss"] for r in baseline.evaluations), color="grey", linestyle=":", linewidth=1,
                       label=f"{baseline.label}'s best")
        ax.set_xlabel({Axis.step: "step", Axis.tokens: "tokens", Axis.flops: "training FLOPs"}[axis])
        ax.set_ylabel("loss (nats per token)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if ax.lines:  # no run logged one yet: an empty panel, without matplotlib's warning of an empty legend
            ax.legend()
    fig.tight_layout()
    save_figure_whole(fig, path, dpi=110)
