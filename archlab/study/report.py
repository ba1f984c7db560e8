"""The study's answer: a table per variant and two plots, from the Optuna storage alone (so a
study run across machines reports the same way)."""

from __future__ import annotations

import statistics
import warnings
from collections import Counter
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING

import optuna
from optuna.storages import RDBStorage
from optuna.trial import TrialState

from archlab.cost import Cost
from archlab.environment import describe, setting_lines
from archlab.files import save_figure_whole, write_text_whole
from archlab.study.definition import Study
from archlab.study.runner import (
    ACCURACY, INTERRUPTED, OWNER, PLOTS, STOPPED, STOPPED_BY, by_rate, chosen, latest, learning_rate, planned_as, refuse_foreign_files, refuse_other_study,
    settled, shown,
)
from archlab.table import MIB, Decimals, Format, render, si, tokens_label
from archlab.train.curves import compared

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _reported(study: Study, trials: list[optuna.trial.FrozenTrial]) -> dict[tuple, optuna.trial.FrozenTrial]:
    """The finished trial of each planned (variant, seed, lr slot): what the table and plots show."""
    planned = study.planned()
    return {key: t for key, t in settled(trials).items() if key in planned}


def all_failed(study: Study, trials: list[optuna.trial.FrozenTrial]) -> bool:
    """Whether every planned trial has finished and failed: a study with no result to report."""
    done = _reported(study, trials)
    return len(done) == len(study.planned()) and all(t.state == TrialState.FAIL for t in done.values())


def _curve(best: list[optuna.trial.FrozenTrial]) -> tuple[list[int], list[float]]:
    """The steps every trial evaluated at, and the mean of their evaluations there."""
    steps = sorted(set.intersection(*(set(t.intermediate_values) for t in best)))
    return steps, [statistics.mean(t.intermediate_values[s] for t in best) for s in steps]


def _against_baseline(curves: dict[str, tuple[list[int], list[float], float]], baseline: str, maximize: bool) -> dict[str, dict]:
    """The paper's Figure 2 comparisons of each variant's mean curve (steps, values, training
    FLOPs a step) with the baseline's, joined by straight lines: the tokens (all steps have as
    many) by which it first reaches the baseline's best value, over those the baseline took to
    first reach it (its own last value would put a curve that is flat or rises at its end below
    1 against itself), and its value at the training FLOPs the baseline spent, less the baseline's."""
    if baseline not in curves or not curves[baseline][0]:  # no step every chosen trial of the baseline evaluated at
        return {}
    their_steps, theirs, their_flops = curves[baseline]
    target = (max if maximize else min)(theirs)
    reached, at = {}, {}
    for variant, (steps, values, flops) in curves.items():  # steps stand for tokens: every step has as many
        reached[variant], at[variant] = compared(steps, [s * flops for s in steps], values, target, their_steps[-1] * their_flops,
                                                 maximize, flops)
    return {variant: {"share of baseline tokens": None if reached[variant] is None else reached[variant] / reached[baseline],
                      "vs baseline at its FLOPs": None if at[variant] is None else at[variant] - theirs[-1]} for variant in curves}


def _complete(done: dict[tuple, optuna.trial.FrozenTrial], variant: str) -> list[optuna.trial.FrozenTrial]:
    return [t for (v, _, _), t in done.items() if v == variant and t.state == TrialState.COMPLETE]


def summarize(study: Study, trials: list[optuna.trial.FrozenTrial]) -> list[dict]:
    """A row of figures per variant, as numbers (None where it has none), for CSV and JSON;
    ``readable`` makes them the markdown table's."""
    definition = study.definition
    maximize = definition.maximize
    done = _reported(study, trials)
    rows, means, curves = [], {}, {}
    scored = not maximize and any(ACCURACY in t.user_attrs for t in done.values())  # examples or a recall task, scored by loss
    metric = "accuracy" if maximize else "val loss"
    for variant, spec in study.specs.items():
        mine = [t for (v, _, _), t in done.items() if v == variant]
        complete = _complete(done, variant)
        cost = Cost(spec)
        steps = study.steps(variant)
        flops_per_step = cost.train_flops_per_sequence(study.config.seq_len) * study.config.batch_size
        row = {
            "variant": variant,
            "params": cost.params_total,
            "train FLOPs": flops_per_step * steps,
            f"KV MiB @ {tokens_label(definition.report_seq_len)}": cost.cache_bytes(definition.report_seq_len).total / MIB,
            "steps": steps,
            metric: None, "spread (sd)": None, "seeds": 0, "best lr": None,
            **({"best lr high": None} if definition.sampler == "tpe" else {}),
            **({ACCURACY: None} if scored else {}),
        }
        if complete:
            best = chosen(complete, maximize, definition.sampler)
            values, rates = [t.value for t in best], [learning_rate(t) for t in best]
            means[variant] = row[metric] = statistics.mean(values)
            row.update({"spread (sd)": statistics.stdev(values) if len(values) > 1 else None, "seeds": len(values), "best lr": min(rates)})
            if definition.sampler == "tpe":
                row["best lr high"] = max(rates)
            if scored:
                accuracies = [t.user_attrs.get(ACCURACY) for t in best]
                row[ACCURACY] = statistics.mean(accuracies) if None not in accuracies else None
            curves[variant] = (*_curve(best), flops_per_step)
        row["pruned"] = sum(t.state == TrialState.PRUNED for t in mine)
        row["failed"] = sum(t.state == TrialState.FAIL for t in mine)
        rows.append(row)
    against = _against_baseline(curves, definition.baseline, maximize)
    baseline = means.get(definition.baseline)
    for row in rows:
        mean = means.get(row["variant"])
        row["vs baseline"] = mean - baseline if baseline is not None and mean is not None else None
        row.update(against.get(row["variant"], {"share of baseline tokens": None, "vs baseline at its FLOPs": None}))
    return rows


def _rate_label(low: float, high: float) -> str:
    """A learning rate to two digits, or TPE's range of them."""
    return f"{low:.2g}" if f"{low:.2g}" == f"{high:.2g}" else f"{low:.2g}..{high:.2g}"


def readable(row: dict, maximize: bool) -> dict:
    """A row for people: SI prefixes for counts, four decimals for scores (losses differ in the
    third place), signs on differences, the learning rate (or TPE's range of them) to two digits,
    "-" where there is none."""
    def or_dash(value, how):
        return "-" if value is None else how(value)

    score = "accuracy" if maximize else "val loss"
    formats = {"params": si, "train FLOPs": si, score: lambda v: Decimals(v, 4), "spread (sd)": lambda v: Decimals(v, 4),
               "vs baseline": lambda v: f"{v:+.4f}", "share of baseline tokens": lambda v: Decimals(v, 3),
               "vs baseline at its FLOPs": lambda v: f"{v:+.4f}"}
    formats.update({column: lambda v: round(v, 2) for column in row if column.startswith("KV MiB")})
    if not maximize:
        formats[ACCURACY] = lambda v: f"{v:.1%}"
    out = {}
    for column, value in row.items():
        if column == "best lr":
            out[column] = or_dash(value, lambda low: _rate_label(low, row.get("best lr high", low)))
        elif column == "pruned":
            out["pruned/failed"] = f"{value}/{row['failed']}"
        elif column not in ("best lr high", "failed"):
            out[column] = or_dash(value, formats[column]) if column in formats else value
    return out


def passed_over(study: Study, trials: list[optuna.trial.FrozenTrial]) -> list[str]:
    """A notice for each grid rate that scores better than the one a variant is scored at, on fewer
    seeds completed: the rule that keeps the rates with the most seeds passes it over (a pruned or
    failed seed counts against its rate), and a reader should know how near it came."""
    if study.definition.sampler != "grid":
        return []
    maximize, done, lines = study.definition.maximize, _reported(study, trials), []
    for variant in study.specs:
        complete = _complete(done, variant)
        if not complete:
            continue
        best = chosen(complete, maximize, "grid")
        lr = f"{learning_rate(best[0]):.2g}"
        score = statistics.mean(t.value for t in best)
        for rate, of_rate in sorted(by_rate(complete).items()):
            mean = statistics.mean(t.value for t in of_rate)
            if len(of_rate) < len(best) and (mean > score if maximize else mean < score):
                lines.append(f"- notice: `{variant}` at lr {rate:.2g} scored {mean:.4f}, mean over {len(of_rate)} seed"
                             f"{'s' * (len(of_rate) > 1)}, better than the {score:.4f} over {len(best)} at its lr {lr} in the"
                             " table, which keeps the rates with the most seeds completed (its other seeds failed, were pruned or have not finished)")
    return lines


def starts(study: Study, trials: list[optuna.trial.FrozenTrial]) -> list[str]:
    """Where each fine-tuned variant's reported trials started: the checkpoints of the run it
    names, or the trials of the study it names and their learning rate."""
    lines = []
    for variant in filter(study.fine_tuned, study.definition.variants):
        started = [t.user_attrs["started_from"] for (v, _, _), t in _reported(study, trials).items()
                   if v == variant and "started_from" in t.user_attrs]
        if run := study.start_run(variant):
            used = ", ".join(sorted({Path(s["checkpoint"]).name for s in started}))
            lines.append(f"- `{variant}` is fine-tuned from the run {run[0]}" + (f" ({used})" if started else ""))
            continue
        pretraining, pretrained = study.pretraining[variant]
        numbers = ", ".join(str(n) for n in sorted({s["trial"] for s in started}))
        rates = ", ".join(f"{lr:.2g}" for lr in sorted({s["lr"] for s in started}))
        lines.append(f"- `{variant}` is fine-tuned from study `{pretraining.key}`'s `{pretrained}`: each seed from its trial of that seed"
                     f" at the learning rate its report chose" + (f" ({rates}; trials {numbers})" if started else ""))
    return lines


def stopped_by_its_worker(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether the trial's worker was stopped (Ctrl-C, SIGTERM) while training it: a retry's copy
    of the mark is its old worker's, until its new one clears it."""
    return STOPPED in trial.user_attrs and trial.user_attrs[STOPPED] == trial.user_attrs.get("worker")


FINISHED = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)


def _attempts(study: Study, trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """The latest attempt at each planned trial (a trial whose worker died counts as its retry)."""
    planned = study.planned()
    return [t for key, t in latest(trials).items() if key in planned]


def progress(study: Study, trials: list[optuna.trial.FrozenTrial], silent: Collection[int] = ()) -> str:
    """How far the study has got, counting each planned trial once, by its latest attempt (a trial
    whose worker died counts as its retry), so the header agrees with the table. ``silent``: the
    numbers of running trials that have sent no heartbeat for longer than the workers' grace period
    (``silent_trials``): their worker was killed (or is paused), and no live worker has failed them yet."""
    planned = study.planned()
    attempts = _attempts(study, trials)
    count = Counter(t.state.name.lower() for t in attempts)
    is_stopped = [t.state == TrialState.RUNNING and stopped_by_its_worker(t) for t in attempts]
    stopped = sum(is_stopped)
    gone = sum(t.state == TrialState.RUNNING and t.number in silent and not mark for t, mark in zip(attempts, is_stopped))
    finished = sum(t.state in FINISHED for t in attempts)
    waiting = len(planned) - finished - count["running"]  # queued, or not yet queued by any worker
    line = (f"- trials: {len(planned)} planned: {count['complete']} complete, {count['running'] - stopped - gone} running, {waiting} waiting,"
            f" {count['fail']} failed, {count['pruned']} pruned")
    if stopped:
        line += (f", {stopped} whose worker was stopped ({'they run' if stopped > 1 else 'it runs'} again once silent for the"
                 " --grace-period)")
    if gone:
        line += (f", {gone} whose worker has sent no heartbeat for over the --grace-period (killed, or paused; {'they run' if gone > 1 else 'it runs'}"
                 " again at the next `study run`, or under a worker still running)")
    if finished < len(planned):
        line += f"; **incomplete**: the table covers only the {finished} of {len(planned)} that have finished"
    lost = sum(len(t.system_attrs.get("retry_history", [])) for t in attempts)
    queued = sum(t.state == TrialState.WAITING and bool(t.system_attrs.get("retry_history")) for t in attempts)
    if lost and not queued:
        line += f"; {lost} lost their worker and ran again (see Failed trials)"
    elif lost:
        again = f"{lost - queued} ran again, " if lost > queued else ""
        line += f"; {lost} lost their worker (see Failed trials): {again}{queued} queued again and waiting"
    return line


def silent_trials(optuna_study: optuna.Study) -> set[int]:
    """The numbers of the study's running trials silent for longer than its workers' grace period
    (recorded as they join), as a worker would find them stale: the report reads the storage alone,
    and fails nothing."""
    storage, grace = optuna_study._storage, optuna_study.user_attrs.get("grace_period")
    storage = getattr(storage, "_backend", storage)  # optuna's cache in front of an RDBStorage
    if not isinstance(storage, RDBStorage) or storage.heartbeat_interval is None or not grace:
        return set()
    saved, storage.grace_period = storage.grace_period, grace
    try:
        stale = set(storage._get_stale_trial_ids(optuna_study._study_id))
    finally:
        storage.grace_period = saved
    return {t.number for t in optuna_study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if t._trial_id in stale}


def settings(study: Study, trials: list[optuna.trial.FrozenTrial]) -> list[str]:
    """What the reported trials trained with (the code, Python, PyTorch, device): one line when
    they agree, else each setting with its trials, since results repeat to the bit only within one."""
    by_setting: dict[str, list[str]] = {}
    for t in sorted(_reported(study, trials).values(), key=lambda t: t.number):
        kept = t.user_attrs.get("environment")
        described = describe(kept) if kept else "not recorded (trained before trials kept it)"
        by_setting.setdefault(described, []).append(str(t.number))
    return setting_lines(by_setting, "trial")


def failures(study: Study, trials: list[optuna.trial.FrozenTrial]) -> list[dict]:
    """Every failed attempt at a planned trial and why it failed; one whose worker died also says
    what became of its retry."""
    planned = study.planned()
    retry_of = {t.system_attrs["retry_history"][-1]: t for t in trials if t.system_attrs.get("retry_history")}
    shown = {t.number for t in latest(trials).values()} | retry_of.keys()  # not a trial failed as unplanned, since queued again
    rows = []
    for t in trials:
        if t.state != TrialState.FAIL or planned_as(t) not in planned or t.number not in shown:
            continue
        variant, seed, slot = planned_as(t)
        if "failure" in t.user_attrs:
            why = t.user_attrs["failure"].splitlines()[0][:200]
        else:  # failed by the heartbeat check, which records no reason
            last = f" after step {max(t.intermediate_values)}" if t.intermediate_values else " before its first evaluation"
            worker = f" {t.user_attrs['worker']}" if "worker" in t.user_attrs else ""
            stopped = f"was stopped ({t.user_attrs.get(STOPPED_BY) or INTERRUPTED})"
            why = f"its worker{worker} {stopped if stopped_by_its_worker(t) else 'stopped sending heartbeats'}{last}"
        grid = study.definition.sampler == "grid"  # a grid trial's lr is planned, though it died before recording it
        lr, retry = learning_rate(t) or (study.setup(variant, slot)["lr"] if grid else None), retry_of.get(t.number)
        rows.append({"trial": t.number, "variant": variant, "seed": seed, "lr": f"{lr:.2g}" if lr else "-", "why": why.replace("|", "\\|"),
                     "retried as": f"trial {retry.number}, {retry.state.name.lower()}" if retry else "-"})
    return rows


def draw(study: Study, trials: list[optuna.trial.FrozenTrial]) -> dict[str, Figure]:
    """Validation curves of each variant's best learning rate (mean over seeds): against steps,
    and against training FLOPs; by the name of the PNG each is saved as."""
    from matplotlib.figure import Figure

    maximize = study.definition.maximize
    done = _reported(study, trials)
    figures = {name: Figure(figsize=(7, 4.5)) for name in PLOTS}
    axes = {name: figure.subplots() for name, figure in figures.items()}
    for variant in study.specs:
        complete = _complete(done, variant)
        if not complete:
            continue
        best = chosen(complete, maximize, study.definition.sampler)
        steps, mean = _curve(best)
        per_step = best[0].user_attrs["flops_per_step"]
        axes["curves"].plot(steps, mean, marker="o", label=variant)
        axes["loss_vs_flops"].plot([s * per_step for s in steps], mean, marker="o", label=variant)
    label = "validation accuracy" if maximize else "validation loss"
    for name, ax in axes.items():
        ax.set_xlabel("training FLOPs" if name == "loss_vs_flops" else "step")
        ax.set_ylabel(label)
        ax.set_title(f"{study.name} ({study.scale}): {label}, best lr per variant, mean over seeds")
        ax.grid(True, alpha=0.3)
        if ax.lines:  # nothing completed yet: an empty plot, without matplotlib's warning of an empty legend
            ax.legend()
        figures[name].tight_layout()
    return {f"{name}.png": figure for name, figure in figures.items()}


def report(study: Study, optuna_study: optuna.Study, out: Path, storage: str, fmt: Format = Format.md,
           show: Callable[[str], object] = lambda text: None) -> str:
    """Write report.md and the plots into ``out``; return the markdown, or in CSV or JSON the
    variants' table alone, its figures as numbers. ``show`` is given that text before any file is
    written: a disk that refuses them leaves the report on screen."""
    trials = optuna_study.get_trials(deepcopy=False)
    refuse_foreign_files(out)
    refuse_other_study(out, study)
    plots = draw(study, trials)
    markdown, rows = _markdown(study, optuna_study, trials, plots, storage)
    text = markdown if fmt is Format.md else render(rows, fmt)
    finished = sum(t.state in FINISHED for t in _attempts(study, trials))
    if fmt is not Format.md and finished < len(study.planned()):  # markdown's header says so; CSV and JSON have none
        warnings.warn(f"study {study.key} is incomplete: the table covers only the {finished} of {len(study.planned())} planned"
                      " trials that have finished", stacklevel=2)
    show(text)
    out.mkdir(parents=True, exist_ok=True)  # a report of a study on a shared storage may go anywhere
    write_text_whole(out / OWNER, f"{study.key}\n")  # whole: a worker reporting beside this one reads it
    for name, figure in plots.items():
        save_figure_whole(figure, out / name, dpi=110)
    write_text_whole(out / "report.md", markdown)  # whole: a full disk leaves the last report, not part of this one
    return text


def _markdown(study: Study, optuna_study: optuna.Study, trials: list[optuna.trial.FrozenTrial], plots: Collection[str],
              storage: str) -> tuple[str, list[dict]]:
    """The report's markdown, and its table's rows."""
    definition = study.definition
    rows, failed = summarize(study, trials), failures(study, trials)
    accuracy = ("; accuracy: of the tokens scored (responses or answers) at the last evaluation, the mean over the seeds"
                if not definition.maximize and any(ACCURACY in row for row in rows) else "")
    text = [
        f"# Study `{study.name}` ({study.scale} scale)\n",
        *([f"{definition.question or definition.description}\n"] if definition.question or definition.description else []),
        f"- budget: {'equal steps' if definition.budget == 'steps' else 'equal training FLOPs (the baseline' + chr(39) + 's)'};"
        f" {study.config.batch_size} x {study.config.seq_len} tokens per step; data: {study.config.data.source};"
        f" seeds {definition.seeds}; lr {definition.sampler} of {definition.lr.points}"
        f" {('point' if definition.sampler == 'grid' else 'draw') + ('s' if definition.lr.points > 1 else '')}"
        f" over [{definition.lr.low:g}, {definition.lr.high:g}]; pruner: {definition.pruner}",
        *starts(study, trials),
        progress(study, trials, silent_trials(optuna_study)),
        *settings(study, trials),
        f"- storage `{(whole := shown(storage, relative=False))}` (open it with `optuna-dashboard {whole}`)",
        f"- baseline: `{definition.baseline}`; {'higher accuracy' if definition.maximize else 'lower val loss'} is better{accuracy}\n",
        render([readable(row, definition.maximize) for row in rows], Format.md),
        *passed_over(study, trials),
        *(["## Failed trials\n", render(failed, Format.md)] if failed else []),
        *(f"![{Path(name).stem}]({name})" for name in plots),
        "",
    ]
    return "\n".join(text), rows
