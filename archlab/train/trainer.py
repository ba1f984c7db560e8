"""The training loop: AdamW, warmup + cosine, accumulation, clipping, eval, checkpoints, DDP.

Launched as one process, or by torchrun (``torchrun --nproc-per-node N -m archlab train ...``):
with WORLD_SIZE > 1 each process joins the group (gloo on CPU, NCCL on CUDA), takes its slice of
every global batch and DDP averages the gradients; rank 0 alone writes the run directory.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import json
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
import yaml
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from archlab.checks import first_forward, params_problems
from archlab.cost import Cost, peak_flops
from archlab.environment import SETTINGS_FILE, SettingsError, environment, read_settings, setting_of, write_settings
from archlab.ffn import MoE, MoEFFN
from archlab.files import REFUSED, make_folder, path_kind, write_text_whole, written_as
from archlab.loss import scores
from archlab.memory import Watched, check_room
from archlab.model import Model, build_model
from archlab.ops.dispatch import BackendError
from archlab.spec import ModelSpec, describe_differences, described, load_spec, spec_changes, spec_to_yaml
from archlab.table import first_few
from archlab.train import checkpoint
from archlab.train.config import Optimizer, TrainConfig, absolute, changes, changes_since_trained, divisor_below, kept_on_resume, load_config, resumable, tokenized
from archlab.train.curves import RunError, read_metrics
from archlab.train.data import (CORPUS_FILES, Batch, DataError, DataSource, ShortSplit, load_tokenizer, prepare, reads_files_in, remove_advice,
                                undo_tokenizing)


T = TypeVar("T")

# what a start may leave before its first checkpoint or line of metrics (a kill mid-save: checkpoints/.tmp-*)
START_FILES = {checkpoint.RUN_SPEC, "config.yaml", SETTINGS_FILE, "tokenizer.json", "data", "checkpoints"}
# those a start writes after SETTINGS_FILE: without it, they are someone's own (a config.yaml tuned by hand)
AFTER_SETTINGS = {checkpoint.RUN_SPEC, "config.yaml", "tokenizer.json"}


class TrainError(Exception):
    """Training cannot go on; the message says why and what was kept."""


class Unwritten(TrainError):
    """A checkpoint or metrics line the disk would not take (full, read-only): the machine's fault,
    not the run's, which a study's worker stops on rather than fail every trial after it."""


class Relayed(TrainError):
    """What stopped the first process, raised on the others (under torchrun), which the first one
    has already said."""


def micro_batch_size(cfg: TrainConfig, processes: int) -> int:
    """The micro-batch a run uses: the config's, or where it is left at its default, at most each
    process's share of the batch (so that the default config trains under torchrun)."""
    share = cfg.batch_size // processes
    return share if "micro_batch_size" not in cfg.model_fields_set and 0 < share < cfg.micro_batch_size else cfg.micro_batch_size


def launched_processes() -> int:
    """The processes torchrun launched for this run (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process is sent when its parent dies


def _stop_with_the_launcher() -> None:
    """Be sent SIGTERM, which stops training as Ctrl-C does, when torchrun's launcher dies. It
    starts its processes in a session of their own: a launcher killed outright (SIGKILL, the
    out-of-memory killer) would leave them training to the end, holding the run folder and the GPUs."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> World:
        size = launched_processes()
        world = cls(int(os.environ.get("RANK", "0")), size, int(os.environ.get("LOCAL_RANK", "0")))
        if size > 1:
            _stop_with_the_launcher()
        if size > 1 and not dist.is_initialized():
            if torch.cuda.is_available():  # NCCL's object collectives use the current device: each process its own
                torch.cuda.set_device(world.local_rank)
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        return world

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        return self.total(value) / self.size if self.size > 1 else value

    def total(self, value: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            value = value.clone()
            dist.all_reduce(value)
        return value

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def close(self) -> None:
        """Leave the process group, as torch.distributed asks before a process exits: left to the
        exit, gloo's teardown may abort a rank ("terminate called without an active exception").
        ``fit`` waits at a barrier first, so that no process leaves while another is still in a
        collective."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def from_main(self, work: Callable[[], T]) -> T | None:
        """``work``'s result on the first process, which alone writes the run directory, while the
        others wait (None on them). Its failure stops every process (the others with ``Relayed``),
        where they would otherwise wait at the next collective for one that has gone."""
        result, failure = None, None
        if self.main:
            try:
                result = work()
            except Exception as exc:  # raised again below, once the others know
                failure = exc
        if self.size > 1:
            said = [None if failure is None else str(failure)]
            dist.broadcast_object_list(said, src=0)
            if said[0] is not None and not self.main:
                raise Relayed(said[0])
        if failure is not None:
            raise failure
        return result


def lr_factor(step: int, total: int, cfg: TrainConfig) -> float:
    """The learning rate's factor for update ``step`` (from 0): linear warmup to 1 at the last warmup
    update, then cosine from 1 (again, at update ``warmup_steps``) toward ``min_lr_ratio``, which
    it reaches at update ``total``: one past the last, so the last is just above it. The shipped
    studies' results were trained on this schedule, to the bit."""
    warmup = cfg.schedule.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    floor = cfg.schedule.min_lr_ratio
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def status_line(record: dict) -> str:
    """What the console shows of a record: the step's numbers and its evaluation, if it had one."""
    parts = [f"loss {record['loss']:.3f}" if "loss" in record else "no token counted, no update", f"lr {record['lr']:.2e}"]
    parts += [f"{record['tok_s']:,.0f} tok/s"] if "tok_s" in record else []
    parts += [f"MFU {record['mfu']:.1%}"] if "mfu" in record else []
    parts += [f"eval {record['eval_loss']:.3f}"] if "eval_loss" in record else []
    parts += [f"acc {record['eval_acc']:.1%}"] if "eval_acc" in record else []
    return "  ".join(parts)


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    """A process's share of a batch, in passes of ``size`` sequences."""
    parts = (batch.inputs, batch.targets, batch.mask)
    return [Batch(*(t[i : i + size] if t is not None else None for t in parts)) for i in range(0, len(batch.inputs), size)]


def _param_groups(model: Model, optimizer: Optimizer) -> list[dict]:
    """Tensors of two or more dimensions decay (matrices, conv filters, prefixes); 1-D ones do not."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": params, **settings} for params, settings in zip((decay, rest), _group_settings(optimizer), strict=True)]


def _group_settings(optimizer: Optimizer) -> list[dict]:
    """The AdamW settings of each parameter group, in ``_param_groups``'s order."""
    shared = {"betas": optimizer.betas, "eps": optimizer.eps}
    return [{**shared, "weight_decay": optimizer.weight_decay}, {**shared, "weight_decay": 0.0}]


def _check_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state of each parameter it has stepped: both moments, of the parameter's shape and
    finite (the second not below 0), and one finite step count. ``load_state_dict`` checks only how
    many parameters each group has: the fused step read a moment of another shape out of bounds,
    one missing stopped the first step with a traceback, and a NaN one trained on."""
    for param, state in optimizer.state.items():
        for name in ("exp_avg", "exp_avg_sq"):
            value = state.get(name)
            if not isinstance(value, torch.Tensor) or value.shape != param.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"its {name} for a parameter of shape {tuple(param.shape)} is {shape}")
            if not value.isfinite().all() or (name == "exp_avg_sq" and (value < 0).any()):
                raise ValueError(f"its {name} for a parameter of shape {tuple(param.shape)} holds values no AdamW step makes")
        step = state.get("step")
        if not isinstance(step, torch.Tensor) or step.numel() != 1 or not step.isfinite().all() or step.item() < 0:
            raise ValueError(f"its step count for a parameter of shape {tuple(param.shape)} is {step!r:.60}")


def _kept(last_saved: Path | None, steps_done: int | None = None) -> str:
    """What a run that diverged after ``steps_done`` steps leaves to go on from, for its message."""
    if last_saved is None:
        return "no checkpoint had been written"
    if steps_done == checkpoint.step_of(last_saved):  # the step's loss and gradient come from the checkpoint's weights alone
        return (f"and it is the first step from {last_saved}, whose weights lead there at any learning rate: resume from"
                f" an earlier checkpoint, if one is kept (move {last_saved.name} out of checkpoints/)")
    return f"the last checkpoint saved is {last_saved} (to go on from it at a lower learning rate: --resume --set optimizer.lr=...)"


def _processes_splitting(n: int) -> str:
    """The numbers of processes over which ``n`` splits whole, in words: "1, 2 or 4 processes"."""
    divisors = [str(d) for d in range(1, n + 1) if n % d == 0]
    return "1 process" if n == 1 else f"{', '.join(divisors[:-1])} or {divisors[-1]} processes"


class Trainer:
    def __init__(self, spec: ModelSpec, cfg: TrainConfig, run_dir: Path, console: Console):
        self.spec, self.run_dir, self.console = spec, run_dir, console
        self.cfg = cfg.model_copy(update={"data": cfg.data.anchored(), "init": absolute(cfg.init)})  # as config.yaml records it
        self.world = World.from_env()
        self.device = torch.device(f"cuda:{self.world.local_rank}" if torch.cuda.is_available() else "cpu")
        self.autocast = cfg.autocast(self.device)
        per_process, micro = cfg.batch_size // self.world.size, micro_batch_size(cfg, self.world.size)
        if micro != cfg.micro_batch_size:  # the default, lowered
            self.cfg = self.cfg.model_copy(update={"micro_batch_size": micro})
        if cfg.batch_size % self.world.size:
            raise TrainError(f"batch_size {cfg.batch_size} does not split equally over {self.world.size} processes; give a multiple of"
                             f" {self.world.size} (a resumed run keeps its batch_size: resume it on {_processes_splitting(cfg.batch_size)})")
        if per_process % micro:
            moe = (f"; a resumed MoE run keeps its micro-batches, over each of which its balance loss is taken: resume it on"
                   f" {_processes_splitting(cfg.batch_size // micro)}" if isinstance(spec.ffn, MoE) and cfg.batch_size % micro == 0 else "")
            raise TrainError(f"batch_size {cfg.batch_size} gives each of {self.world.size} process(es) {per_process} sequences, not whole"
                             f" micro-batches of {micro}; set micro_batch_size to a divisor of {per_process}, such as"
                             f" {divisor_below(per_process, micro)}{moe}")
        self.accumulation = per_process // micro
        torch.manual_seed(cfg.seed)
        cost = Cost(spec)
        check_room(4 * cost.params_total * 4, self.device, "its float32 weights, gradients and AdamW's two moments")
        self.model = build_model(spec, device=self.device)
        self._refuse_untrainable_kernels()
        with self.autocast:  # as a step runs it, kernel choices and their notices included
            first_forward(self.model)  # a block's output of another shape, named before the run folder is touched
        if miscounted := params_problems(self.model):  # the FLOPs, MFU and a study's budgets would be off
            raise TrainError(f"{spec.name}: {miscounted[0]}; `archlab build` checks each block's cost formulas")
        if cfg.compile:
            self.model.compile_layers()
        self.optimizer = torch.optim.AdamW(
            _param_groups(self.model, cfg.optimizer),
            lr=cfg.optimizer.lr,
            fused=True,  # one kernel for the whole update, on the CPU as on CUDA
        )
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        self.flops_per_step = cost.train_flops_per_sequence(cfg.seq_len) * cfg.batch_size  # exact, as a --flops budget counts them
        peak = peak_flops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        self.peak = peak * self.world.size if peak else None
        self.moe_layers = [m for m in self.model.modules() if isinstance(m, MoEFFN)]
        blocks = tuple({type(spec.block_at(i)) for i in range(spec.n_layers)})
        self.environment = environment(self.device, self.world.size, blocks)  # environment.yaml keeps it, from the step it trains from
        self.recorded: TrainConfig | None = None  # a resumed run's config.yaml, as it was (_resume)
        self.resumed_corpus: str | None = None  # the fingerprint of the tokens it trained on (_resume)

    def _refuse_untrainable_kernels(self) -> None:
        """Choose every block's kernels now, so that one which cannot train here fails before the run
        directory is touched, not in the first backward pass."""
        device = self.device.type
        untrainable = self.model.untrainable_kernels(device)
        if untrainable:
            block, backend = untrainable[0]
            raise BackendError(f"{block}: backend {backend} has no backward pass on the {device.upper()}; train"
                               " with backend: torch or auto, or on a CUDA device")

    # -- the run directory --------------------------------------------------------------------

    def _start_fresh(self, steps: int) -> int:
        """Make the run directory; the step to start from, 0. A folder is a run once it holds a
        checkpoint or metrics; one where an attempt failed before either starts afresh."""
        if checkpoint.checkpoints(self.run_dir):
            raise TrainError(f"{self.run_dir} already holds a run; pass --resume to continue it, or choose a new --out")
        if path_kind(self.run_dir / "metrics.jsonl"):
            raise TrainError(f"{self.run_dir} holds the metrics of a run that saved no checkpoint; remove it to start"
                             " over, or choose a new --out")
        self._refuse_writing_into_the_data()  # first: a tokenizer given from --out is named as such
        self._refuse_another_runs_checkpoints()
        self._refuse_foreign_files()
        if self.cfg.init:
            self._start_from(self.cfg.init)
        self.world.barrier()  # every process has looked before the first one writes
        self.world.from_main(lambda: self._write_start(steps))
        return 0

    def _start_from(self, init: str) -> None:
        """Fine-tuning: the weights of the checkpoint ``init`` names (a run's latest), which this
        spec's model must fit; the optimizer and schedule start afresh. The config records the
        checkpoint folder itself, and text is read with that run's tokenizer, the one its
        embeddings learned."""
        def read(run_dir: Path, used: Path) -> tuple[Path, Path]:
            try:
                checkpoint.load_weights(used, self.model, "init")
            except checkpoint.WeightsDoNotFit as exc:
                raise checkpoint.WeightsDoNotFit(f"{exc}; fine-tuning needs a spec whose weights are those of the run it starts"
                                                 f" from, shape for shape ({run_dir / checkpoint.RUN_SPEC}, or a spec that extends it)") from None
            return run_dir, used

        run_dir, used = checkpoint.latest_read(init, read)  # of a run still training, its latest checkpoint whole
        data = self.cfg.data
        if tokenized(data.source):
            theirs = checkpoint.trained_tokenizer(run_dir, used, self.spec.vocab_size)
            if theirs is None:
                if data.tokenizer is None:
                    raise TrainError(f"{run_dir} trained on token ids or a recall task, with no tokenizer to read"
                                     f" {data.source!r} as its ids meant; give data.tokenizer, the one its ids came from")
            elif data.tokenizer is None:
                data = data.model_copy(update={"tokenizer": absolute(str(theirs))})
            elif load_tokenizer(data.tokenizer, self.spec.vocab_size).to_str() != load_tokenizer(str(theirs), self.spec.vocab_size).to_str():
                raise TrainError(f"data.tokenizer {data.tokenizer} is not the tokenizer of {run_dir} ({theirs}), whose"
                                 " weights this run starts from and which read its text; drop data.tokenizer to use that one")
        self.cfg = self.cfg.model_copy(update={"init": str(used), "data": data})
        differ = spec_changes(load_spec(run_dir / checkpoint.RUN_SPEC), self.spec)
        spec = f"; its spec differs from this one, whose weights it fits ({escape(differ)})" if differ else ""
        step = checkpoint.step_of(used)
        at = f" (step {step})" if step is not None else ""
        self._say(f"starting from the weights of {escape(str(used))}{at}; the optimizer and"
                  f" learning-rate schedule start afresh{spec}")

    def _write_start(self, steps: int) -> None:
        make_folder(self.run_dir)
        write_settings(self.run_dir, [{"from step": 0, **self.environment}])  # first: it marks the files after it as a run's
        write_text_whole(self.run_dir / checkpoint.RUN_SPEC, spec_to_yaml(self.spec))
        self._write_config(steps)

    def _resume(self, steps: int) -> int:
        """Load the latest checkpoint's weights, optimizer and RNG state; the step to go on from.
        The run's files are left as they are until its data is ready (``_continue_record``)."""
        found = checkpoint.checkpoints(self.run_dir)
        if not found:
            start_over = "" if path_kind(self.run_dir / "metrics.jsonl") else "; start it without --resume"
            raise TrainError(f"nothing to resume in {self.run_dir}: it has no checkpoint{start_over}")
        latest = found[-1]
        recorded = load_config(str(self.run_dir / "config.yaml"))
        self.recorded = recorded.model_copy(update={"data": recorded.data.anchored()})  # as self.cfg holds it
        refusal = kept_on_resume(list(changes(self.recorded, self.cfg)), moe=bool(self.moe_layers))
        if refusal:
            raise TrainError(refusal)
        trainer_state, info = checkpoint.load(latest, self.model)
        own = self.run_dir / "tokenizer.json"
        try:  # in the run's folder, one that does not load (or is gone) is said as the data is prepared, with how to train one again
            load_tokenizer(str(own), self.spec.vocab_size)
        except DataError as exc:
            if self.cfg.data.cache and own.exists():  # a copy of a shared cache's, which the data's checks do not read
                raise TrainError(f"{exc}; it is the run's copy of data.cache's tokenizer: remove it, and the resume copies the"
                                 " cache's again") from None
        else:
            checkpoint.check_tokenizer(latest, own)
        self._refuse_another_spec(latest, info.get("spec"))
        self._refuse_another_config(latest, info.get("config"), resumable(bool(self.moe_layers)))
        self.resumed_corpus = info.get("corpus")  # absent from checkpoints written before they recorded it
        try:
            self.optimizer.load_state_dict(trainer_state["optimizer"])
            _check_optimizer_state(self.optimizer)
            torch.set_rng_state(trainer_state["rng"])
        except (KeyError, ValueError, RuntimeError, TypeError, AttributeError) as exc:  # AttributeError: a state that is no mapping
            raise checkpoint.damaged(latest, f"unusable trainer state: {exc}") from None
        # the state holds the settings it was saved with; a resume may have --set others
        for group, settings in zip(self.optimizer.param_groups, _group_settings(self.cfg.optimizer), strict=True):
            group.update(settings)
        step = info["step"]
        if step > steps:
            raise TrainError(f"{latest} is at step {step}, past the {steps} steps asked; give --steps above {step} (or a --tokens"
                             " or --flops budget past it) to extend the run")
        self._say(f"resuming from {escape(str(latest))} (step {step})")
        return step

    def _refuse_another_spec(self, saved: Path, trained: object) -> None:
        """The spec a checkpoint trained is the run's. A spec.yaml edited since, whose weights still
        fit (another window, loop count or RoPE base), would train on as another model under the
        run's name."""
        if changed := checkpoint.changes_since_trained(trained, self.spec, saved / "state.json"):
            raise TrainError(f"checkpoint {saved} trained another spec than the run's spec.yaml ({changed}): put spec.yaml back"
                             f" as it was to resume, or start a new run from these weights with --init {saved}")

    def _refuse_another_config(self, saved: Path, trained: object, resumable: list[str]) -> None:
        """The settings a resume keeps are the checkpoint's (a ``--set`` of them is refused against
        config.yaml). A config.yaml edited since would train on as another experiment under the
        run's name. Its data is checked by the corpus's fingerprint instead, so that a corpus moved
        may be read where it now is; its init chose only the first weights. A checkpoint written
        before they recorded their config, or whose config this version no longer reads, has
        nothing to compare."""
        edited = described({key: pair for key, pair in changes_since_trained(trained, self.cfg).items()
                            if key.split(".")[0] not in (*resumable, "data", "init")})
        if edited:
            raise TrainError(f"{self.run_dir / 'config.yaml'} was edited since checkpoint {saved} was saved ({', '.join(edited)}): a"
                             " resumed run keeps these, which decide which tokens a step reads or how it computes them; put them"
                             " back as they were to resume")

    def _refuse_foreign_files(self) -> None:
        """A fresh run writes only its own files (and replaces those of an attempt that failed), so a
        folder holding anything else is someone's data, not a run to start in."""
        if not self.run_dir.is_dir():
            return
        corpus = self.run_dir / "data"
        mine = START_FILES if (self.run_dir / SETTINGS_FILE).is_file() else START_FILES - AFTER_SETTINGS
        foreign = [p for p in self.run_dir.iterdir() if written_as(p.name) not in mine]
        foreign += [p for p in corpus.iterdir() if written_as(p.name) not in CORPUS_FILES] if corpus.is_dir() else []
        foreign += [corpus] if path_kind(corpus) not in (None, "folder") else []  # where the run tokenizes its corpus
        if foreign:
            named = sorted(str(p.relative_to(self.run_dir)) for p in foreign)
            raise TrainError(f"{self.run_dir} holds files that are not a training run's ({first_few(named, 5)});"
                             " choose an empty or new --out")

    def _refuse_another_runs_checkpoints(self) -> None:
        """A run inside another run's checkpoints folder would be taken by that run for a checkpoint
        (a ``step-NNNNNNNN`` one its resume and ``generate`` call damaged) and removed with it when
        that run prunes its old checkpoints."""
        for folder in self.run_dir.resolve().parents:
            if folder.name == "checkpoints" and (folder.parent / checkpoint.RUN_SPEC).is_file():
                raise TrainError(f"--out {self.run_dir} is inside the checkpoints folder of the run {folder.parent}, which would take"
                                 " it for one of its checkpoints (and remove it with them); put it outside")

    def _refuse_writing_into_the_data(self) -> None:
        """The run writes its files (spec, config, tokenized corpus and the tokenizer that made it)
        into its folder and data folder: neither may hold the tokenizer it is given, which would be
        written over (its template dropped) or removed with a corpus it replaces, nor lie in the
        text folder it reads, whose corpus would take in those files."""
        data = self.cfg.data
        if data.tokenizer and Path(data.tokenizer).resolve() == (self.data_dir / "tokenizer.json").resolve():
            where = "data.cache" if data.cache else "--out"
            raise TrainError(f"data.tokenizer {data.tokenizer} is where the run writes the tokenizer it reads its text with,"
                             f" over what it holds; keep it outside {where}")
        for option, folder in (("--out", self.run_dir), ("data.cache", self.data_dir)):
            if reads_files_in(data.source, folder):
                raise TrainError(f"{option} {folder} is inside the text folder {data.source}: the files the run writes there"
                                 " would be read as training text; put it outside")

    def _continue_record(self, step: int, steps: int) -> None:
        """Resuming at ``step`` (on the first process): drop what metrics.jsonl logged after it, and record
        what the resume changed. Read before anything is written: a damaged line stops the resume with the file as it was."""
        try:
            settings = read_settings(self.run_dir)
        except SettingsError as exc:
            raise TrainError(f"{exc}; mend or remove it to resume") from None
        metrics = self.run_dir / "metrics.jsonl"
        if path_kind(metrics):
            try:
                records, lines = read_metrics(metrics)
            except RunError as exc:
                raise TrainError(f"{exc}; mend or remove it to resume") from None
            kept = "".join(line + "\n" for record, line in zip(records, lines) if record["step"] <= step)
            if kept.encode() != metrics.read_bytes():  # else left as it is: a finished run resumed with nothing to do writes nothing
                write_text_whole(metrics, kept)
        self._adopt_config(step, steps)
        if step < steps:  # a finished run resumed with nothing to do trains no step in this setting
            self._adopt_environment(step, settings)

    def _adopt_config(self, step: int, steps: int) -> None:
        """Resuming with a new total or ``--set`` values: say what changes, with the learning rate of
        the next step (the schedule is a function of the step and the total), and record them."""
        planned, now = self.recorded, self.cfg.model_copy(update={"steps": steps})
        changed = changes(planned, now)
        if not changed:
            return
        said = [f"the run's total goes from {old} to {new} steps, so its cosine decay now ends at step {new}" if key == "steps"
                else f"{key} goes from {old} to {new}" for key, (old, new) in changed.items()]
        before, after = (f"{cfg.optimizer.lr * lr_factor(step, cfg.steps, cfg):.2e}" for cfg in (planned, now))
        lr = f"the learning rate of step {step + 1}"
        said.append(f"{lr} is {after}, not {before}" if after != before else f"{lr} stays {after}")
        self._write_config(steps)  # first: a folder that cannot be written to stops the resume before it says so
        self._say(f"[yellow]notice[/]: {'; '.join(said)}; config.yaml records the new values")

    def _write_config(self, steps: int) -> None:
        config = self.cfg.model_copy(update={"steps": steps})  # the steps trained, whatever the config said
        write_text_whole(self.run_dir / "config.yaml", yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))

    def _adopt_environment(self, step: int, recorded: list[dict]) -> None:
        """Resuming at ``step`` in another setting than the steps before it (another commit, PyTorch,
        device...): say so, since the run may not repeat to the bit what an uninterrupted one gives,
        and record from which step it holds. Settings of steps the resume trains again are dropped."""
        before = [s for s in recorded if s["from step"] < step]
        last = setting_of(before[-1]) if before else None
        one = {"processes": "1"}  # recorded only above one (environment), said as such here rather than "(absent)"
        if last is not None and (differ := describe_differences({**one, **last}, {**one, **self.environment})):
            self._say(f"[yellow]notice[/]: the steps before this resume trained in another setting ({escape('; '.join(differ))});"
                      " its numbers may not repeat to the bit those of a run in a single setting. environment.yaml records each, from"
                      " the step it began at")
        kept = before if last == self.environment else [*before, {"from step": step, **self.environment}]
        if kept != recorded:
            write_settings(self.run_dir, kept)

    def _say(self, text: str) -> None:
        """A line on the console, from the first process only."""
        if self.world.main:
            self.console.print(text, highlight=False)

    def _log(self, record: dict) -> None:
        self.world.from_main(lambda: self._append_metrics(record))

    def _append_metrics(self, record: dict) -> None:
        try:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as exc:  # a full disk, say
            stop = Unwritten if exc.errno in REFUSED else TrainError
            raise stop(f"step {record['step']}'s metrics could not be written to {self.run_dir / 'metrics.jsonl'}"
                       f" ({exc.strerror or exc}); training stopped there, its checkpoints as they were") from None

    def _save(self, step: int, data: DataSource) -> Path:
        """The checkpoint of ``step``, with the fingerprint of the tokens it trained on; its folder, on every process."""

        def save():  # the trainer's state gathered by the process that writes it
            state = {"optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state()}
            info = {"tokens": step * self.tokens_per_step, "corpus": data.fingerprint, "spec": self.spec.model_dump(mode="json"),
                    "config": self.cfg.model_dump(mode="json")}
            if self._tokenizer_hash is not None:
                info[checkpoint.TOKENIZER_HASH] = self._tokenizer_hash
            checkpoint.save(self.run_dir, step, self.model, state, info, self.cfg.keep_checkpoints)

        self.world.from_main(save)
        return checkpoint.folder(self.run_dir, step)

    @functools.cached_property
    def _tokenizer_hash(self) -> str | None:
        """A hash of the run's own tokenizer.json, which reads its text back; hashed at the first
        save, once the data is ready, and not again: it does not change while the run trains."""
        own = self.run_dir / "tokenizer.json"
        return checkpoint.file_hash(own) if own.is_file() else None

    @property
    def data_dir(self) -> Path:
        """Where the tokenized corpus and its tokenizer go: ``data.cache``, or the run's own folder."""
        return Path(self.cfg.data.cache) if self.cfg.data.cache else self.run_dir

    def _prepare(self, resume: bool) -> DataSource:
        """The run's data, tokenized by the first process, then read by the others; a resume's must
        be what its checkpoint trained on."""
        data_dir = self.data_dir
        args = (self.cfg.data, self.spec.vocab_size, self.cfg.seq_len, self.cfg.seed, data_dir)

        def put_back() -> str:
            return f"put the run's data back{remove_advice(data_dir, self.cfg.data.source)} to resume"

        def first():
            undo = undo_tokenizing(data_dir)
            try:
                data = prepare(*args, replace=not (resume or self.cfg.data.cache), resume=resume,  # a fresh start may replace a failed attempt's corpus
                               say=lambda line: self._say(escape(line)))  # a source's name may read as markup
            except ShortSplit as exc:
                if self.resumed_corpus is None:  # a fresh start, or a checkpoint that recorded no corpus
                    raise
                undo()
                raise TrainError(f"{exc.describe} is not the data the run trained on: its {exc.split} split has {exc.have:,} tokens,"
                                 f" fewer than one of the run's {self.cfg.seq_len:,}-token sequences needs; {put_back()}") from None
            if self.resumed_corpus not in (None, data.fingerprint):
                undo()
                raise TrainError(f"{data.describe} is not the data the run trained on: its checkpoint records"
                                 f" {self.resumed_corpus}, the data now gives {data.fingerprint}; {put_back()}")
            shared, own = data_dir / "tokenizer.json", self.run_dir / "tokenizer.json"
            if data_dir != self.run_dir and shared.is_file() and not (resume and own.is_file()):
                write_text_whole(own, shared.read_text())  # the run's own: a shared cache's is replaced with its corpus
            return data

        data = self.world.from_main(first)
        return data if self.world.main else prepare(*args, resume=True)  # resume: with the tokenizer the first wrote

    # -- the loop -------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, data: DataSource) -> dict:
        self.model.eval()
        totals = torch.zeros(3, device=self.device)  # summed loss, correct, counted
        for i in range(self.cfg.eval_batches):
            batch = data.batch("val", i, self.cfg.batch_size, self.world.rank, self.world.size)
            for part in micro_batches(batch, self.cfg.micro_batch_size):  # no bigger than a training pass
                with self.autocast:
                    hidden = self.model.hidden(part.inputs.to(self.device)).flatten(0, 1)
                    totals += scores(hidden, self.model.head.weight, part.counted_targets().flatten().to(self.device))
        totals = self.world.mean(totals)
        self.model.train()
        if not totals[2]:  # a loss of 0/0 would read as a diverged run
            raise TrainError(f"the evaluation's {self.cfg.eval_batches} batches held no token that counts (the responses of"
                             f" {data.describe}); hold out more (data.val_fraction) or raise eval_batches")
        loss = (totals[0] / totals[2]).item()
        record = {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}
        if data.reports_accuracy:
            record["eval_acc"] = (totals[1] / totals[2]).item()
        return record

    def fit(self, steps: int, resume: bool = False, on_eval: Callable[[int, dict], None] | None = None,
            on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
        """Train to ``steps``; return the logged records. ``on_eval(step, record)`` sees every
        evaluation (a study reports it to its pruner, which may stop the run by raising);
        ``on_step(step, record)`` every training step as it ends, before any evaluation or
        checkpoint (a profiler's step marker, say)."""
        try:
            with self._sole_writer():
                records = self._fit(steps, resume, on_eval, on_step)
            self.world.barrier()  # every process past its last collective before one leaves the group (close)
            return records
        except BaseException as exc:
            if self.world.size > 1:  # the DDP wrapper, held by the frames it passed through, holds the process group
                traceback.clear_frames(exc.__traceback__)  # freed now, the group ends in close(), not at the exit
            raise
        finally:
            self.world.close()

    @contextmanager
    def _sole_writer(self):
        """One training at a time in a run folder (held by its first process): a second one, resuming
        a run thought dead, would interleave metrics and write the same checkpoints."""
        held = self.world.from_main(self._hold_folder)
        try:
            yield
        finally:
            if held is not None:
                folder, made = held
                os.close(folder)
                for new in made:  # a start refused before writing leaves no folder
                    if any(new.iterdir()):
                        break
                    new.rmdir()

    def _hold_folder(self) -> tuple[int, list[Path]]:
        """The run folder, locked (made if new, with the folders above it that it needs); the
        folders it made, innermost first."""
        made = []
        for folder in (self.run_dir, *self.run_dir.parents):
            if folder.exists():
                break
            made.append(folder)
        make_folder(self.run_dir)
        folder = os.open(self.run_dir, os.O_RDONLY)
        try:
            fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # let go by the system when the process ends
        except BlockingIOError:
            os.close(folder)
            raise TrainError(f"{self.run_dir} is in use by another training process; wait for it to end"
                             " (or stop it), or choose another --out") from None
        return folder, made

    def _fit(self, steps: int, resume: bool, on_eval, on_step) -> list[dict]:
        start = self._resume(steps) if resume else self._start_fresh(steps)
        if self.cfg.schedule.warmup_steps >= steps:
            self._say(f"[yellow]notice[/]: schedule.warmup_steps={self.cfg.schedule.warmup_steps} with {steps:,} step{'s' * (steps != 1)}: the whole"
                      " run is warm-up and the learning rate never decays; lower it with --set schedule.warmup_steps=N")
        data = self._prepare(resume)
        if (uncounted := data.uncounted_share()) >= 0.01:
            self._say(f"[yellow]notice[/]: {uncounted:.0%} of the training windows of {self.cfg.seq_len:,} tokens hold no token that"
                      " counts (they lie inside prompts): they teach nothing, and a step that draws only such windows makes no"
                      " update; a longer seq_len holds more of each example")
        if resume:
            self.world.from_main(lambda: self._continue_record(start, steps))
        model = self.model
        if self.world.size > 1:
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        unsettled = self.world.size > 2  # DDP's buckets, until _settle_buckets lays them out
        last_saved = checkpoint.checkpoints(self.run_dir)[-1] if resume else None
        records: list[dict] = []
        columns = [TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"), TimeRemainingColumn()]
        live = self.console.is_interactive  # a terminal; a log file gets a plain line per logged step instead
        with Progress(*columns, console=self.console, disable=not (live and self.world.main)) as progress:
            task = progress.add_task("train", total=steps, completed=start, status="")
            timed_steps, timed_seconds = 0, 0.0  # training steps since the last logged one, and their time
            watched = True  # until a step has run the model (one whose batch counts no token does not)
            for step in range(start, steps):
                began = time.perf_counter()
                with Watched(self.device, "its first step's activations, gradients and AdamW moments") if watched else nullcontext():
                    if unsettled:
                        self._settle_buckets(step, data, model)
                        unsettled = False
                    record = self._step(step, steps, data, model)  # the others take what the first did
                watched = watched and "loss" not in record
                bad = next((name for name in ("loss", "grad_norm") if not math.isfinite(record.get(name, 0.0))), None)
                if bad:
                    what = "loss" if bad == "loss" else "gradient norm"
                    initial = step == 0 and not self.cfg.init  # no update made yet: the spec's own initial weights
                    why = "; the spec's initial weights lead there: `archlab build` names where nan or inf first appear" if initial else ""
                    raise TrainError(f"{what} became {record[bad]} at step {step + 1}; training stopped before applying it,"
                                     f" {_kept(last_saved, step)}{why}")
                if "loss" in record:  # a step that counted no token did no work to time
                    timed_steps, timed_seconds = timed_steps + 1, timed_seconds + time.perf_counter() - began
                if timed_steps:
                    steps_per_s = timed_steps / timed_seconds  # evaluations and saves not counted
                    record["tok_s"] = self.tokens_per_step * steps_per_s
                    if self.peak:
                        record["mfu"] = self.flops_per_step * steps_per_s / self.peak
                done = step + 1
                if on_step is not None:
                    on_step(done, record)
                if done % self.cfg.eval_interval == 0 or done == steps:
                    record.update(self.evaluate(data))
                    if not math.isfinite(record["eval_loss"]):  # the step's update made the weights unusable
                        raise TrainError(f"evaluation loss became {record['eval_loss']} after step {done}; training stopped"
                                         f" before logging or saving it, {_kept(last_saved)}")
                if done % self.cfg.log_interval == 0 or "eval_loss" in record:
                    self._log(record)
                    records.append(record)
                    timed_steps, timed_seconds = 0, 0.0
                    if not live:
                        self._say(f"step {done}/{steps}  {status_line(record)}")
                if on_eval is not None and "eval_loss" in record:
                    on_eval(done, record)
                if done % self.cfg.checkpoint_interval == 0 or done == steps:
                    if broken := checkpoint.non_finite(self.model):  # a step past float range: finite loss, unusable weights
                        raise TrainError(f"weights became non-finite by step {done} ({first_few(broken, 3)}); training stopped"
                                         f" before saving them, {_kept(last_saved)}")
                    try:
                        last_saved = self._save(done, data)
                    except checkpoint.CheckpointError as exc:
                        kept = f"the last one saved, {last_saved}, is intact" if last_saved else "no checkpoint had been written"
                        stop = Unwritten if isinstance(exc, checkpoint.Unsaved) else TrainError
                        raise stop(f"{exc} Training stopped after step {done}; {kept}") from None
                progress.update(task, completed=done, status=status_line(record))
        return records

    def _settle_buckets(self, step: int, data: DataSource, model: torch.nn.Module) -> None:
        """DDP lays its gradient buckets out again after its first backward pass, in the order the
        gradients came. Three or more processes' sums follow the layout (two add a + b either way),
        so a resumed run's first step, in the first layout, would sum otherwise than the run it
        replays did at that step. A pass on the step's first micro-batch, its gradients thrown away,
        lays them out before any step, in a fresh run and a resumed one alike."""
        with self.autocast:
            loss, aux = self._forward(model, self._passes(step, data)[0])
            (loss + aux).backward()  # its gradients are thrown away, NaN ones too (a micro-batch that counts no token)
        self.optimizer.zero_grad(set_to_none=True)

    def _passes(self, step: int, data: DataSource) -> list[Batch]:
        """This process's share of the step's global batch, in its micro-batches."""
        return micro_batches(data.batch("train", step, self.cfg.batch_size, self.world.rank, self.world.size), self.cfg.micro_batch_size)

    def _forward(self, model: torch.nn.Module, part: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch's mean loss over its counted targets, and its MoE balance loss."""
        return model(part.inputs.to(self.device), return_aux=True, targets=part.counted_targets().to(self.device))

    def _token_weights(self, parts: list[Batch]) -> list[float] | None:
        """What each pass's mean loss is weighed by, so that a step's loss is the mean over every
        counted token of the global batch, however it is split into passes and processes: its
        share of those tokens times the number of passes. Where every pass counts as many tokens
        (text, recall tasks) each is exactly 1.0, leaving the loss bit for bit the plain mean;
        examples' responses fill passes unevenly. None where the global batch counts no token."""
        if all(part.mask is None for part in parts):
            return [1.0] * len(parts)
        counted = [int(part.mask.sum()) for part in parts]
        everywhere = int(self.world.total(torch.tensor(sum(counted), device=self.device)))
        return [c * len(parts) * self.world.size / everywhere for c in counted] if everywhere else None

    def _step(self, step: int, steps: int, data: DataSource, model: torch.nn.Module) -> dict:
        cfg = self.cfg
        lr = cfg.optimizer.lr * lr_factor(step, steps, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        parts = self._passes(step, data)
        weights = self._token_weights(parts)
        record = {"step": step + 1, "lr": lr, "tokens": (step + 1) * self.tokens_per_step}
        if weights is None:  # every window fell inside prompts: no loss to learn from, and AdamW would only decay the weights
            return record
        total, balance = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        for i, (part, weight) in enumerate(zip(parts, weights, strict=True)):
            sync = nullcontext() if i == self.accumulation - 1 or self.world.size == 1 else model.no_sync()
            with sync, self.autocast:
                loss, aux = self._forward(model, part)
                ((loss * weight + aux) / self.accumulation).backward()
            total += loss.detach() * weight / self.accumulation
            balance += aux.detach().float() / self.accumulation
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip or float("inf")).item()
        loss, balance = self.world.mean(torch.stack((total, balance))).tolist()
        if math.isfinite(loss) and math.isfinite(grad_norm):  # clipping leaves a NaN gradient NaN
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        record.update(loss=loss, grad_norm=grad_norm)
        if self.moe_layers:  # of the last micro-batch (a looped layer: its last pass); 1.0 is balance, E/top_k collapse
            record["moe_aux_loss"] = balance  # the balance loss the step trained on, weight included: summed over layers and passes, mean over micro-batches
            record["moe_max_load"] = max(float(m.last_load.max()) * m.last_load.numel() for m in self.moe_layers)
        return record
