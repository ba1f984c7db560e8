"""Running a study on Optuna: plan every trial once, let any number of workers take them.

The first worker to arrive enqueues the planned trials (variant, seed, lr slot) under a lock (a
PostgreSQL advisory lock, or a file lock next to a local storage), skipping any already there.
A trial keeps its plan as fixed parameters, never suggested from the study's lists, so variants and
seeds may be added or removed later; a worker takes only the queued trials its definition plans.
Workers then claim waiting trials one at a time (Optuna moves a trial from WAITING to RUNNING for
exactly one of them; on SQLite, only under the same file lock) and train them, reporting each
evaluation so the pruner can stop a poor run.
A running trial sends heartbeats from the moment it is claimed; when a worker dies its trial goes
stale, is marked failed and re-queued by RetryHeartbeatStaleTrialCallback, twice; past that, by the
next worker to join. A worker leaves once nothing it plans is waiting and nothing is running.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import inspect
import os
import re
import socket
import sqlite3
import statistics
import threading
import time
import urllib.parse
import warnings
import zlib
from collections.abc import Callable, Collection
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import optuna
import sqlalchemy
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback, fail_stale_trials
from optuna.study import StudyDirection
from optuna.trial import TrialState
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from archlab.block import Problem
from archlab.files import REFUSED, ShortWrite, locked, make_folder, regular, write_text_whole, written_as
from archlab.interrupts import held_signals
from archlab.registry import said
from archlab.spec import SpecError, describe_differences
from archlab.study.definition import Study, as_recorded_now
from archlab.table import first_few
from archlab.train import checkpoint
from archlab.train.config import holds_examples
from archlab.train.data import CORPUS_LOCK, CacheError, DataError, prepare, read_examples, read_texts, reads_files_in, undo_tokenizing
from archlab.train.trainer import Trainer, Unwritten

if TYPE_CHECKING:
    from archlab.model import Model


MAX_RETRY = 2  # times a trial lost with its worker is queued again on its own
STARTS = "starts"  # the study's user attribute where join records each fine-tuned variant's starts, by seed
CORPUS = "corpus"  # the study's user attribute where join records the fingerprint of the corpus its trials share
PLOTS = ("curves", "loss_vs_flops")  # the report's plots, each NAME.png beside it
OWNER = ".study"  # in a study's folder: the study (NAME-SCALE) whose report, plots and corpus it holds
# What a study's folder holds: its SQLite storage (its lock and journals), the planning lock, the
# trials, a shared tokenized corpus (and its lock), the report with its plots, and whose they are
REPORT_FILES = {"report.md", *(f"{name}.png" for name in PLOTS)}
# beside a report: the study's mark (OWNER, written before it), its database, or its trials and planning lock (a folder from before OWNER)
MARKS = (OWNER, "optuna.db", "trials", ".plan.lock")
STUDY_FILES = {"optuna.db", "optuna.db.lock", "optuna.db-journal", "optuna.db-wal", "optuna.db-shm", ".plan.lock", "trials", "data",
               CORPUS_LOCK, "tokenizer.json", *REPORT_FILES, OWNER}
JOINED = "joined"  # a study's user attribute: when its last worker joined (time.time())
STOPPED = "stopped_worker"  # a trial's user attribute: the worker that was stopped (Ctrl-C, SIGTERM) while training it
STOPPED_BY = "stopped_by"  # and what stopped it
INTERRUPTED = "Ctrl-C or SIGTERM"  # what stopped it, where a mark recorded before STOPPED_BY was says nothing
NOT_PLANNED = "NotPlanned"  # how earlier versions failed a queued trial the study had stopped planning; queued again once planned


def heartbeat_interval(grace_period: int) -> int:
    """Beat often enough that a live trial is never taken for dead."""
    return max(1, min(5, grace_period // 3))


optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def default_dir(study: Study) -> Path:
    return Path("runs") / "studies" / study.key


def storage_url(out: Path, url: str | None) -> str:
    """The given storage, or a SQLite file in the study directory (one machine, no server). A
    server's URL whose user or password holds an @ is refused: the driver would take what follows
    it for the host, and print that piece of the password in its error."""
    if url is None:
        return sqlalchemy.engine.URL.create("sqlite", database=str((out / "optuna.db").resolve())).render_as_string()  # a ? in it quoted
    if url.partition("://")[2].split("/", 1)[0].count("@") > 1:
        raise StorageError(f"{shown(url)}: its user or password holds an @, which ends them in a URL; write it as %40")
    with contextlib.suppress(sqlalchemy.exc.ArgumentError):  # not a URL at all: opening it says what is wrong
        try:
            sqlalchemy.engine.make_url(url)  # it parses the port, as int() would say of one that is no number
        except ValueError:
            raise StorageError(f"{shown(url)}: its port is not a number") from None
    return url


class StorageError(Exception):
    """The study's storage cannot be opened, said in words."""


class NotThere(StorageError):
    """The storage holds no such study (or, on SQLite, no database yet)."""


class StudyChanged(StorageError):
    """The storage holds trials that trained under another definition of the study."""


def check_unchanged(study: Study, optuna_study: optuna.Study, starts: dict[str, dict[int, dict]] | None = None) -> None:
    """Refuse a storage whose trials trained under another definition (another spec, training
    config, learning rate or step count for the same variant, seed and lr slot): their results
    would be reported as this study's. Trials not yet started, and added variants or seeds, train
    under the definition as it stands and are fine. Trials recorded before setups were kept are
    checked by the learning rate and steps they kept. Given where each fine-tuned variant's seeds
    start now (``starts_of``), trials that started elsewhere are refused too: the study they start
    from has chosen another trial since, or the run they name has a newer checkpoint."""
    changed, planned, moved = [], study.planned(), False
    for key, trial in latest(optuna_study.get_trials(deepcopy=False)).items():
        if trial.state is TrialState.WAITING or key not in planned:
            continue
        kept = trial.user_attrs
        recorded = as_recorded_now(kept.get("setup", {name: kept[name] for name in ("lr", "steps") if name in kept}))
        current = study.setup(key[0], key[2])
        if trial.state is not TrialState.PRUNED:  # a trial the pruner let run (or that failed) ran as it would under any pruner
            recorded = {name: value for name, value in recorded.items() if name != "pruner"}
        differences = describe_differences(recorded, {name: current.get(name) for name in recorded})
        if "lr" in recorded and isinstance(recorded["lr"], list) != isinstance(current["lr"], list):  # grid <-> tpe
            differences = [f"lr {_lr_said(recorded['lr'])} -> {_lr_said(current['lr'])}",
                           *(d for d in differences if not d.startswith("lr"))]
        if trial.state is TrialState.PRUNED and "pruner" not in recorded and current["pruner"] == "none":  # recorded before pruners were
            differences.insert(0, "pruned, and the study now has pruner: none")
        was, now = kept.get("started_from"), (starts or {}).get(key[0], {}).get(key[1])
        if "init" in current and "init" not in recorded:  # a setup records init only where set: this trial trained from scratch
            init = current["init"]
            start = start_said(now) if now else init.get("run") or f"study {init['study']}'s {init['variant']} trials"
            differences.insert(0, f"trained from random weights, would now start from {start}")
        elif was and now and start_said(was) != start_said(now):
            differences.insert(0, f"started from {start_said(was)}, would now start from {start_said(now)}")
            moved = True
        elif was and now and was.get("weights", now.get("weights")) != now.get("weights"):  # recorded by both
            differences.insert(0, f"started from {start_said(was)}, whose weights have changed since")
            moved = True
        if differences:
            changed.append(f"  {key[0]} seed {key[1]} lr slot {key[2]}: {first_few(differences, 3, '; ')}")
    if changed:
        shown = changed[:5] + ([f"  ... and {len(changed) - 5} more trials"] if len(changed) > 5 else [])
        raise StudyChanged(
            f"the storage of {optuna_study.study_name} holds {len(changed)} trial{'s' * (len(changed) > 1)} that trained under another "
            "definition of the study:\n" + "\n".join(shown) + "\nput the definition back"
            + (" (and the studies or runs its variants start from)" if moved else "")
            + ", or run the study afresh with another --out (or --storage); the trials already there are kept"
        )


def check_corpus(optuna_study: optuna.Study, fingerprint: str | None, source: str, undo: Callable[[], None]) -> None:
    """Refuse a study whose trials trained on other tokens than its data gives now (its text was
    edited, and the tokenized corpus removed to tokenize it again): their results and those of the
    trials still to run would be compared as one study's. ``undo`` removes the corpus just tokenized
    (``undo_tokenizing``), so that the text put back tokenizes again. The first worker to tokenize
    records the corpus."""
    recorded = optuna_study.user_attrs.get(CORPUS)
    if fingerprint is None or recorded == fingerprint:
        return
    started = [t for t in optuna_study.get_trials(deepcopy=False) if t.state is not TrialState.WAITING]
    if recorded is not None and started:
        undo()
        raise StudyChanged(
            f"the {len(started)} trial{'s' * (len(started) > 1)} of {optuna_study.study_name} run so far trained on another corpus"
            f" than {source!r} gives now (its text changed since): the storage records {recorded}, the data now gives"
            f" {fingerprint}; put the text back, or run the study afresh with another --out (or --storage); the trials already"
            " there are kept")
    optuna_study.set_user_attr(CORPUS, fingerprint)


def _lr_said(lr: float | list[float]) -> str:
    """A setup's learning rate: a grid's point, or the range a TPE draw is taken from."""
    return f"drawn over [{lr[0]:g}, {lr[1]:g}] (tpe)" if isinstance(lr, list) else f"{lr:g} (a grid point)"


def shown(url: str, relative: bool = True) -> str:
    """A storage URL as messages print it: without its password (even one the URL parser would
    misread), and a SQLite file under the working folder by its relative path (as one would type
    it there), unless ``relative`` is false (a report read from anywhere)."""
    database = _sqlite_database(url)
    if database is not None and database not in IN_MEMORY:
        if not relative:
            return url
        path = Path(database)
        return url.replace(database, str(path.relative_to(Path.cwd())), 1) if path.is_relative_to(Path.cwd()) else url
    return re.sub(r"(:/+[^:/@]*:).*@", r"\1***@", url)  # user:password@ -> user:***@, to the last @


STORAGE_ERRORS = (optuna.exceptions.StorageInternalError, sqlalchemy.exc.SQLAlchemyError)  # the database's, not a trial's


def _in_words(exc: BaseException) -> str:
    """A storage error as the database driver said it, on one line: optuna's StorageInternalError
    wraps SQLAlchemy's (its cause), which wraps the driver's (its ``orig``, without the SQL and a
    link), e.g. "permission denied for table version_info" under optuna's "invalid data in the commit"."""
    while True:
        if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.orig is not None:
            exc = exc.orig
        elif isinstance(exc, optuna.exceptions.StorageInternalError) and exc.__cause__ is not None:
            exc = exc.__cause__
        else:
            return " ".join(str(exc).split())


def _unopenable(url: str, exc: Exception) -> StorageError:
    if isinstance(exc, ImportError):  # archlab[postgres] was the advice for postgresql+psycopg2 too, which it does not install
        return StorageError(f"no database driver for {url.split(':')[0]} (no module {exc.name}); archlab[postgres] installs psycopg,"
                            " which postgresql:// and postgresql+psycopg:// URLs use: pip install 'archlab[postgres]'")
    if isinstance(exc, sqlalchemy.exc.NoSuchModuleError) and url.startswith("postgres:"):
        return StorageError(f"{shown(url)}: a PostgreSQL URL begins postgresql://")
    return StorageError(f"cannot open the study storage {shown(url)}: {_in_words(exc)}")


class WholeCallsStorage(RDBStorage):
    """optuna's storage, each of whose calls runs to its end before a Ctrl-C or SIGTERM is raised.
    One raised inside a call can leave its SQLAlchemy session open (optuna closes it on an Exception,
    which a KeyboardInterrupt is not), its connection holding SQLite's lock: the worker's last write,
    marking its trial as stopped, then waited out the busy timeout, a minute, before it could exit."""


def _whole(method: Callable) -> Callable:
    @functools.wraps(method)
    def whole(*args, **kwargs):
        with held_signals():
            return method(*args, **kwargs)
    return whole


for _name, _method in vars(RDBStorage).items():  # the private ones too: optuna's cache in front calls some
    if inspect.isfunction(_method) and not _name.startswith("__"):
        setattr(WholeCallsStorage, _name, _whole(_method))


def refuse_no_file_to_be(url: str, create: bool = True) -> None:
    """A SQLite storage naming a folder, or (to be ``create``d) a file in a folder that is not
    there, refused in words: SQLite says "unable to open database file", and a first worker says
    it only once it has tokenized the corpus."""
    database = _sqlite_database(url)
    if database in (None, *IN_MEMORY):
        return
    if Path(database).is_dir():
        raise StorageError(f"{shown(url)} names a folder, {database}, not a SQLite database file")
    if create and not Path(database).parent.is_dir():
        uri = " (a file: URI is read as one with uri=true in the URL)" if database.startswith("file:") else ""
        raise StorageError(f"{shown(url)}: there is no folder {Path(database).parent} to hold its database; make it first{uri}")


def open_study(study: Study, url: str, grace_period: int = 60, create: bool = True) -> optuna.Study:
    """The study in the storage at ``url``; created there if ``create``, else it must be there
    already (a report of a study that never ran, or was renamed, would be an empty one)."""
    database = _sqlite_database(url)
    refuse_no_file_to_be(url, create)
    if not create and database not in (None, *IN_MEMORY) and not Path(database).is_file():  # opening it would make an empty one
        raise NotThere(f"no SQLite database {database}; give the --storage the study ran with")
    if not create and database not in IN_MEMORY and not _holds_studies(url, database):  # opening it writes Optuna's tables
        raise NotThere(f"{shown(url) if database is None else 'SQLite database ' + database} holds no Optuna studies (it has no"
                       " studies table); give the --storage the study ran with")
    if database in IN_MEMORY:
        raise StorageError(f"{shown(url)} is an in-memory database: the study would end with this process, and no other worker"
                           " could join it; give a file (sqlite:///path/optuna.db), or leave --storage out")
    made = database not in (None, *IN_MEMORY) and not Path(database).exists()
    try:
        storage = WholeCallsStorage(
            url,
            heartbeat_interval=heartbeat_interval(grace_period),
            grace_period=grace_period,
            heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY),
            engine_kwargs={"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None,
        )
    except Exception as exc:  # no driver, unreachable server, bad URL, wrong credentials, a full disk
        if made and Path(database).exists() and not Path(database).stat().st_size:  # SQLite's empty file, tables never written
            Path(database).unlink()
        raise _unopenable(url, exc) from None
    name = study.key
    with _readable(f"a study in {shown(url)}"):  # its studies' attributes are read with their names
        held = optuna.get_all_study_names(storage)
    if not create and name not in held:
        raise NotThere(f"no study {name} in {shown(url)}; it holds {', '.join(held) or 'none'} (was the study renamed, or run at another --scale?)")
    first_evals = 2 * study.config.eval_interval  # steps: a trial is judged from its second evaluation on
    pruners = {
        "none": optuna.pruners.NopPruner(),
        "median": SameVariantAndSeed(lambda: optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=first_evals)),
        "hyperband": SameVariantAndSeed(lambda: VariantHyperband(min_resource=study.config.eval_interval)),
    }
    direction = "maximize" if study.definition.maximize else "minimize"
    settings = dict(study_name=name, storage=storage, pruner=pruners[study.definition.pruner],
                    sampler=optuna.samplers.TPESampler(seed=0))  # the sampler: replaced per trial where it draws (_train)
    # one there is loaded without create_study's write, which a read-only database (a report's) refuses
    opened = optuna.create_study(direction=direction, load_if_exists=True, **settings) if create else optuna.load_study(**settings)
    with _readable(f"study {name} in {shown(url)}"):
        kept = opened.direction.name.lower()
    if kept != direction:  # kept from its creation: pruners, TPE and the dashboard read it
        raise StorageError(f"study {name} in {shown(url)} was created to {kept} its metric, and its"
                           f" metric is now {study.definition.metric}, which it would {direction}; a study keeps the direction"
                           " of its metric: give this one another name (and another --out, where one was given)")
    check_records(opened, url)
    return opened


def _holds_studies(url: str, database: str | None) -> bool:
    """Whether the storage at ``url`` (the SQLite file ``database``, or a server's database where
    None), read without a write, holds Optuna's table of studies. A SQLite file that cannot be read
    is left for opening the storage to say what it is; a server that cannot be reached is said
    now, not waited on a second time."""
    if database is not None:
        try:
            with contextlib.closing(sqlite3.connect(f"{Path(database).resolve().as_uri()}?mode=ro", uri=True)) as read:
                return read.execute("select 1 from sqlite_master where type = 'table' and name = 'studies'").fetchone() is not None
        except sqlite3.Error:
            return True
    try:
        engine = sqlalchemy.create_engine(url)
        try:
            return sqlalchemy.inspect(engine).has_table("studies")
        finally:
            engine.dispose()
    except Exception as exc:  # no driver, a server that cannot be reached, a URL that does not parse
        raise _unopenable(url, exc) from None


class SameVariantAndSeed(optuna.pruners.BasePruner):
    """A pruner that weighs a trial against the trials of its own variant and seed only, its other
    learning rates: architectures' loss curves differ, and a median over all of them would cut
    every trial of the worse ones; pooled over seeds, a rate's trial would be cut by its own twin on
    a luckier seed, and the report would score the variant at a rate that kept more seeds, its worst.
    Each (variant, seed) has a pruner of its own, made by ``make``: Hyperband sizes its brackets by
    the steps of the first run it sees finish, and an equal-FLOPs budget gives variants different steps."""

    def __init__(self, make: Callable[[], optuna.pruners.BasePruner]):
        self.make, self.pruners = make, {}

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        variant, seed, _ = planned_as(trial)
        if (variant, seed) not in self.pruners:
            self.pruners[variant, seed] = self.make()
        return self.pruners[variant, seed].prune(_TrialsOf(study, variant, seed), trial)


class SameVariantSampler(optuna.samplers.BaseSampler):
    """A sampler that learns from the trials of the drawing trial's own variant only, over all its
    seeds (``SameVariantAndSeed`` narrows the pruner to one seed too): one architecture's best
    learning rate says little of another's, and pooled, the best variant's would draw every
    variant's trials to it."""

    def __init__(self, sampler: optuna.samplers.BaseSampler):
        self.sampler = sampler

    def infer_relative_search_space(self, study, trial):
        return self.sampler.infer_relative_search_space(_TrialsOf.of(study, trial), trial)

    def sample_relative(self, study, trial, search_space):
        return self.sampler.sample_relative(_TrialsOf.of(study, trial), trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self.sampler.sample_independent(_TrialsOf.of(study, trial), trial, param_name, param_distribution)


class _TrialsOf:
    """A study seen through the trials of one variant, or of one variant and seed (by the pruners,
    and by TPE, which reads them through ``_get_trials``)."""

    def __init__(self, study: optuna.Study, variant: str, seed: int | None = None):
        self._study, self.variant, self.seed = study, variant, seed

    @classmethod
    def of(cls, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> _TrialsOf:
        """The study seen through the trials of ``trial``'s variant."""
        return cls(study, planned_as(trial)[0])

    def get_trials(self, deepcopy: bool = True, states=None) -> list[optuna.trial.FrozenTrial]:
        return self._of_variant(self._study.get_trials(deepcopy=deepcopy, states=states))

    def _get_trials(self, deepcopy: bool = True, states=None, use_cache: bool = False) -> list[optuna.trial.FrozenTrial]:
        return self._of_variant(self._study._get_trials(deepcopy=deepcopy, states=states, use_cache=use_cache))

    def _of_variant(self, trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
        return [t for t in trials if planned_as(t)[0] == self.variant and self.seed in (None, planned_as(t)[1])]

    def __getattr__(self, name: str):
        return getattr(self._study, name)


class VariantHyperband(optuna.pruners.HyperbandPruner):
    """Hyperband under ``SameVariantAndSeed``: its brackets read their trials from the storage, past
    the one variant and seed's view they are given, so each bracket is seen through that view again."""

    def _create_bracket_study(self, study: _TrialsOf, bracket_id: int) -> _TrialsOf:
        return _TrialsOf(super()._create_bracket_study(study, bracket_id), study.variant, study.seed)


@contextmanager
def planning_lock(url: str, out: Path, key: str):
    """One worker at a time plans the study and prepares its data."""
    if url.startswith("postgresql"):
        try:
            engine = sqlalchemy.create_engine(url)
            conn = engine.connect()
        except Exception as exc:  # no driver, unreachable server, a URL that does not parse (a port that is no number)
            raise _unopenable(url, exc) from None
        lock = zlib.crc32(key.encode()) & 0x7FFFFFFF
        with conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": lock})
            try:
                yield
            finally:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": lock})
                conn.commit()
        engine.dispose()
        return
    with storage_lock(url, out):
        yield


@contextmanager
def storage_lock(url: str, out: Path):
    """One process at a time among the workers of a SQLite storage, however many study folders
    they write to (a lock file beside the database), or of a study folder for other storages."""
    make_folder(out)
    beside_database = _beside_sqlite(url)
    lock = beside_database or out / ".plan.lock"
    try:
        handle = open(regular(lock), "w")  # a FIFO there would wait for a reader
    except OSError as exc:
        beside = f" beside the database of {url}" if beside_database else ""
        raise StorageError(f"the workers' lock file {lock}{beside} cannot be made: {exc.strerror}") from None
    with handle, locked(handle):
        yield


IN_MEMORY = ("", ":memory:")  # what a SQLite URL without a file names


def _sqlite_url(url: str) -> sqlalchemy.engine.URL | None:
    """A SQLite URL parsed; None for other storages and for a URL that does not parse (opening the
    storage then says what is wrong)."""
    if not url.startswith("sqlite"):
        return None
    try:
        return sqlalchemy.engine.make_url(url)
    except sqlalchemy.exc.ArgumentError:
        return None


def _sqlite_uri(parsed: sqlalchemy.engine.URL) -> bool:
    """Whether SQLite reads the URL's database as a URI (``file:path``): where uri is true, as
    SQLAlchemy reads it (true, 1, yes, on)."""
    return sqlalchemy.util.asbool(parsed.query.get("uri", False))


def _sqlite_database(url: str) -> str | None:
    """The database a SQLite URL names: a file's path, or one of IN_MEMORY; None as ``_sqlite_url``.
    Of a URI (``_sqlite_uri``), the path in it."""
    parsed = _sqlite_url(url)
    if parsed is None:
        return None
    database = parsed.database or ""
    if not _sqlite_uri(parsed) or not database.startswith("file:"):
        return database
    path = urllib.parse.urlsplit(database).path
    return "" if parsed.query.get("mode") == "memory" or path == ":memory:" else path


def refuse_read_only(url: str) -> None:
    """A SQLite URI opened read-only, refused to a run, which records its trials there: each
    write failed, and was said as a lost storage."""
    if (parsed := _sqlite_url(url)) is not None and _sqlite_uri(parsed) and parsed.query.get("mode") == "ro":
        raise StorageError(f"{shown(url)} opens its database read-only (mode=ro), and a study run records its trials there; drop"
                           " mode=ro to run the study (a report reads the database as it is)")


def _beside_sqlite(url: str) -> Path | None:
    """A lock file beside a SQLite database file, where its folder exists (else opening the
    storage says what is wrong)."""
    database = _sqlite_database(url)
    if database is None or database in IN_MEMORY or not Path(database).parent.is_dir():
        return None
    return Path(f"{database}.lock")


def join(study: Study, out: Path, url: str, grace_period: int, say: Callable[[str], None] | None = None) -> optuna.Study:
    """Open the study, plan its trials and prepare its data, one worker at a time (the first one
    also creates the storage's tables). Where each fine-tuned variant's seeds start is looked up
    here and recorded for the trials: a pretraining study that chooses another trial while they
    run, or a run that gains a checkpoint, moves none of them (the next worker to join refuses).
    Everything that may refuse the run comes before the study is created and its trials queued:
    a refused run leaves no empty study behind for ``report`` to show. ``say`` is told before a
    corpus is tokenized."""
    refuse_read_only(url)
    with planning_lock(url, out, study.key):
        refuse_other_study(out, study)
        try:
            optuna_study = open_study(study, url, grace_period, create=False)
        except NotThere:  # the first worker: created below, once nothing has refused the run
            refuse_no_file_to_be(url)
            optuna_study = None
            refuse_earlier_trials(out, study.key, url)
        agreed = optuna_study and optuna_study.user_attrs.get("grace_period")  # the running workers'
        if agreed not in (None, grace_period) and _workers_alive(optuna_study, agreed):
            raise StorageError(f"this study's workers use --grace-period {agreed}; a worker judging their heartbeats by"
                               f" {grace_period} s would take over trials that are alive, or wait on the dead; give --grace-period"
                               f" {agreed} (another may be given once no trial is running and no worker has joined for {agreed} s;"
                               f" a worker given {agreed} takes over a stopped worker's trial once it has been silent that long)")
        # a trial whose starting run is missing would fail; the study stops now instead. Weights are
        # loaded to check them only where a trial is still to train from them: a finished study runs on
        to_run = _to_run(study, optuna_study)
        starts = {variant: starts_of(study, variant, url, {seed for v, seed, _ in to_run if v == variant})
                  for variant in study.definition.variants if study.fine_tuned(variant)}
        if optuna_study:
            check_unchanged(study, optuna_study, starts)
        cfg = study.config
        undo = undo_tokenizing(out)
        fingerprint = _read_data(study, out, say)
        optuna_study = optuna_study or open_study(study, url, grace_period)
        check_corpus(optuna_study, fingerprint, cfg.data.source, undo)
        write_text_whole(out / OWNER, f"{study.key}\n")  # whole: another worker reads it unlocked, as it reports
        recorded = optuna_study.user_attrs.get(STARTS, {})  # kept for the variants and seeds of workers on another definition
        for variant, by_seed in starts.items():
            recorded[variant] = {**recorded.get(variant, {}), **{str(seed): start for seed, start in by_seed.items()}}  # JSON's keys are text
        optuna_study.set_user_attr(STARTS, recorded)
        fail_stale_trials(optuna_study)  # a trial lost past its retries is still running until failed, and so not seen as lost
        queued = latest(optuna_study.get_trials())  # copies: the retry callback below appends to what it is given
        for params in study.plan():
            earlier = queued.get(tuple(params.values()))
            if _queued_again(earlier):
                optuna_study.enqueue_trial(params, user_attrs=params)  # user attrs: shown by optuna-dashboard
            elif _lost_for_good(earlier):  # a new run tries again, as a retry, so that the report follows it
                RetryHeartbeatStaleTrialCallback()(optuna_study, earlier)
        optuna_study.set_user_attr("grace_period", grace_period)  # each worker beats and judges staleness by its own
        optuna_study.set_user_attr(JOINED, time.time())
    return optuna_study


def _queued_again(trial: optuna.trial.FrozenTrial | None) -> bool:
    """Whether a planned trial is queued as a worker joins: it has no attempt yet, or earlier
    versions failed it as not planned."""
    return trial is None or trial.user_attrs.get("failure", "").startswith(NOT_PLANNED)


def _to_run(study: Study, optuna_study: optuna.Study | None) -> set[tuple]:
    """The planned (variant, seed, slot) a worker may still train, as ``join`` leaves them: all of a
    new study's; of a stored one, those it queues (again) or retries, and those waiting or running
    (one whose worker died is failed and retried as a worker joins)."""
    if optuna_study is None:
        return study.planned()
    trials = latest(optuna_study.get_trials(deepcopy=False))
    return {key for key in study.planned() if _queued_again(t := trials.get(key)) or _lost_for_good(t)
            or t.state in (TrialState.WAITING, TrialState.RUNNING)}


def _workers_alive(optuna_study: optuna.Study, grace_period: int) -> bool:
    """Whether a worker may be alive: one trains a trial, or one joined within the grace period and
    may not have taken its first trial yet (as a trial is alive for that long after its last beat)."""
    trials = optuna_study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING))
    joined = optuna_study.user_attrs.get(JOINED, 0)
    return any(t.state == TrialState.RUNNING for t in trials) or bool(trials) and time.time() - joined < grace_period


def refuse_earlier_trials(out: Path, key: str, url: str) -> None:
    """A study not in its storage, whose trials' folder in ``out`` holds trials already: the storage
    lost them (its database dropped and made again, its SQLite file removed). Trials are numbered
    from 0 again, each into the folder of the earlier trial of its number, which already holds a run:
    every trial would fail, and a failed trial is not run again."""
    folder = trials_folder(out, key, url)
    held = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if held:
        raise StorageError(f"{shown(url)} holds no study {key}, but {folder} holds {len(held)} trial{'s' * (len(held) > 1)} of it"
                           f" ({first_few(held, 3)}) from a storage of that URL: was its database"
                           " dropped or made again? Give the study another --out to run it afresh, or move that folder away")


def _read_data(study: Study, out: Path, say: Callable[[str], None] | None) -> str | None:
    """Read the study's data, so that data that does not read stops the study before any trial:
    tokenize the corpus its trials share into ``out`` (its fingerprint), or read the examples or
    text each trial tokenizes itself (None)."""
    cfg = study.config
    try:
        if study.shares_corpus:  # tokenize the corpus once for this worker's trials
            vocab = next(iter(study.specs.values())).vocab_size
            shared = cfg.data.model_copy(update={"cache": str(out.resolve())})  # as its trials read it, under the cache's lock
            return prepare(shared, vocab, cfg.seq_len, cfg.seed, out, say=say).fingerprint
        if holds_examples(cfg.data.source):  # each trial tokenizes them, with its starting run's tokenizer
            read_examples(cfg.data.source, cfg.data.max_bytes)
        else:
            read_texts(cfg.data.source, cfg.data.max_bytes, cfg.data.hf_text_field)
        return None
    except CacheError:  # the corpus tokenized in --out, not the data: its message says what to do
        raise
    except DataError as exc:
        if study.data_given:
            raise DataError(f"{exc} (given with --data)") from None
        raise DataError(f"{exc}; study {study.name} reads it at scale {study.scale} (scales.{study.scale}.train.data in {study.source},"
                        " whose question may say how to make it); give other data with --data") from None


def refuse_other_study(out: Path, study: Study) -> None:
    """A folder holds one study's report, plots and corpus: another study's would overwrite them,
    and its corpus would be refused by the first study's next run. A folder from before the
    ``OWNER`` file is its own SQLite storage's studies'."""
    owner = (out / OWNER).read_text().strip() if (out / OWNER).is_file() else None
    if owner is None and (out / "optuna.db").is_file():
        with contextlib.suppress(*STORAGE_ERRORS, ValueError, LookupError):  # a damaged storage is said where it is opened
            held = optuna.get_all_study_names(storage_url(out, None))
            owner = None if study.key in held else ", ".join(held) or None
    if owner not in (None, study.key):
        raise StorageError(f"--out {out} holds study {owner}; give this study its own --out")


def starts_of(study: Study, variant: str, url: str, loaded: Collection[int]) -> dict[int, dict]:
    """Where each seed of a fine-tuned variant (its ``init``, or the scale's) starts from: its run
    (``check_start``), or the trial of the same seed at the learning rate its report chose of the
    study it names (the study, the trial's number and learning rate), and the checkpoint. That study is looked for in this one's
    storage (a server shared by studies), then in its own default folder. The weights of the
    ``loaded`` seeds (those with trials still to train) are loaded, to refuse those that do not."""
    seeds = study.definition.seeds
    if started := study.start_run(variant):
        return dict.fromkeys(seeds, check_start(study, variant, *started, bool(loaded)))
    pretraining, pretrained = study.pretraining[variant]
    stored, where = _stored(pretraining, url, variant)
    check_unchanged(pretraining, stored)  # its trials answer its definition as it stands
    planned = pretraining.planned()
    complete = [t for key, t in settled(stored.get_trials(deepcopy=False)).items()
                if key in planned and key[0] == pretrained and t.state == TrialState.COMPLETE]
    best = chosen(complete, pretraining.definition.maximize, pretraining.definition.sampler) if complete else []
    by_seed = {planned_as(t)[1]: t for t in best}
    if (seed := next((seed for seed in seeds if seed not in by_seed), None)) is not None:
        raise StorageError(
            f"variant {variant} seed {seed} starts from study {pretraining.key}'s {pretrained} trial of seed {seed} at its"
            f" chosen learning rate, and {shown(where)} holds none completed (its completed seeds there:"
            f" {sorted(by_seed) or 'none'}); finish that study first, with seeds {seeds}")
    starts, model = {}, _start_model(study, variant) if loaded else None  # built once, each seed's weights loaded in turn
    for seed in seeds:
        trial = by_seed[seed]
        folder = trial.user_attrs.get("run") or trial_folder(  # the folder of a trial recorded before trials kept it
            trials_folder(default_dir(pretraining), stored.study_name, where), trial.number, planned_as(trial))
        try:
            starts[seed] = {"study": pretraining.key, "trial": trial.number, "lr": learning_rate(trial),
                            "checkpoint": str(_loaded_start(model if seed in loaded else None, folder, "trial"))}
        except checkpoint.CheckpointError as exc:
            raise StorageError(f"variant {variant} seed {seed} starts from trial {trial.number} of {pretraining.key}: {exc}") from None
    return starts


def check_start(study: Study, variant: str, run: str, field: str, load: bool) -> dict:
    """The start of the trials of ``variant`` from ``run``: the run, its checkpoint they start from
    (its latest, or one named) and the hash of its weights, where recorded (a run trained again in
    place has a checkpoint of the same name). Refused at the study's ``field`` where it is not
    there or, if ``load`` (a trial is still to train from it), where its weights do not load into
    the variant's model (another model's, damaged, not finite): every trial would fail on it."""
    try:
        used = _loaded_start(_start_model(study, variant) if load else None, run, "start")
        weights = checkpoint.info_of(used, "start").get(checkpoint.HASHED["model.safetensors"])
        return {"run": os.path.abspath(run), "checkpoint": str(used), **({"weights": weights} if isinstance(weights, str) else {})}
    except checkpoint.CheckpointError as exc:
        named = "" if field.startswith(f"variants.{variant}.") else f"variant {variant}: "  # a field every variant shares
        raise SpecError(str(study.source), [Problem(field, f"{named}{exc}")]) from None


def _start_model(study: Study, variant: str) -> Model | None:
    """A model of ``variant`` to load the weights its trials start from into; None where it is not
    in this machine's memory: its trials load them where they train."""
    from archlab.memory import NoRoom
    from archlab.model import build_model

    try:
        return build_model(study.specs[variant])
    except NoRoom:
        return None


def _loaded_start(model: Model | None, run: str | Path, use: str) -> Path:
    """The checkpoint of ``run`` that trials start from, its weights loaded into ``model`` (none
    where None); a CheckpointError where they do not load (``use``: what for, as
    ``checkpoint.damaged`` takes it)."""
    used = checkpoint.resolve(run)[1]
    if model is not None:
        checkpoint.load_weights(used, model, use)
    return used


def start_said(start: dict) -> str:
    """Where a trial started (an entry of ``starts_of``), in words that tell two starts apart."""
    if "study" in start:
        return f"study {start['study']}'s trial {start['trial']} (lr {start['lr']:g})"
    return f"{start['run']} at {Path(start['checkpoint']).name}"


def _stored(pretraining: Study, url: str, variant: str) -> tuple[optuna.Study, str]:
    """A study another starts from, and the storage it is in: ``url``, else its default folder's."""
    own = storage_url(default_dir(pretraining), None)
    unopened = []  # a storage that does not open (damaged, unreachable) is said as such, not as one without the study
    for where in dict.fromkeys((url, own)):
        try:
            return open_study(pretraining, where, create=False), where
        except NotThere:
            continue
        except StorageError as exc:
            unopened.append(exc)
    if unopened:
        raise StorageError(f"variant {variant} starts from the trials of study {pretraining.key}: {unopened[0]}")
    raise StorageError(f"variant {variant} starts from the trials of study {pretraining.key}, which is neither in {shown(url)} nor in"
                       f" {shown(own)}; run it first (archlab study run {pretraining.source} --scale {pretraining.scale}), on this"
                       " --storage or in its default folder")


def _lost_for_good(trial: optuna.trial.FrozenTrial) -> bool:
    """A trial failed with its worker (it recorded no reason) after its automatic retries. One
    still to be retried is left to RetryHeartbeatStaleTrialCallback, which may not have run yet."""
    return (trial.state == TrialState.FAIL and "failure" not in trial.user_attrs
            and len(trial.system_attrs.get("retry_history", [])) >= MAX_RETRY)


def claim(optuna_study: optuna.Study, url: str, out: Path, planned: Collection[tuple] | None = None) -> int | None:
    """Fail the trials of dead workers (queued again), then take a waiting trial (None when none is
    waiting), one of those ``planned`` if given: a worker still on an older definition of the study
    leaves the trials a newer one queued to the workers that plan them. A trial beats before it is
    taken: a running trial that never beat is never found stale, so a worker dying between taking a
    trial and its first beat would leave it running for ever. Optuna makes a take one worker's with SELECT ... FOR UPDATE, which SQLite ignores: there
    both steps hold the storage's lock."""
    storage = optuna_study._storage
    with nullcontext() if url.startswith("postgresql") else storage_lock(url, out):
        fail_stale_trials(optuna_study)
        for waiting in storage.get_all_trials(optuna_study._study_id, deepcopy=False, states=(TrialState.WAITING,)):
            if planned is not None and planned_as(waiting) not in planned:
                continue
            storage.record_heartbeat(waiting._trial_id)  # a beat on a waiting trial is not looked at
            try:
                if storage.set_trial_state_values(waiting._trial_id, state=TrialState.RUNNING):
                    return waiting._trial_id
            except UpdateFinishedTrialError:  # failed meanwhile by another worker
                continue
    return None


ACCURACY = "accuracy"  # a trial's last evaluation's accuracy, where its metric is the loss


def trials_folder(out: Path, study_name: str, url: str) -> Path:
    """Where a study's trials train: numbered from 0 in each study and storage, so each pair has a
    folder of its own (a study run afresh with another storage, or two sharing an --out, would
    otherwise meet the folders of the first)."""
    storage = hashlib.blake2b(url.encode(), digest_size=4).hexdigest()
    return out / "trials" / f"{study_name}-{storage}"


def trial_folder(trials: Path, number: int, key: tuple) -> Path:
    """Where trial ``number``, planned as (variant, seed, lr slot), trains."""
    variant, seed, slot = key
    return trials / f"{number:04d}-{variant}-s{seed}-lr{slot}"


def _train(study: Study, trial: optuna.Trial, key: tuple, out: Path, url: str) -> float:
    """Train a claimed trial as planned (variant, seed, lr slot); its final metric. The plan is
    read from the trial, not suggested from the study's lists, so that those lists may change."""
    definition, (variant, seed, slot) = study.definition, key
    setup = study.setup(variant, slot)
    if definition.sampler == "grid":
        lr = setup["lr"]
        trial.set_user_attr("lr", lr)
    else:  # seeded by the trial: every worker and every resume would otherwise repeat one sampler's draws
        trial.study.sampler = SameVariantSampler(optuna.samplers.TPESampler(seed=trial.number))
        lr = trial.suggest_float("lr", definition.lr.low, definition.lr.high, log=True)
    spec, cfg, steps = study.specs[variant], study.config, setup["steps"]
    start = trial.study.user_attrs[STARTS][variant][str(seed)] if study.fine_tuned(variant) else None
    if start:
        trial.set_user_attr("started_from", start)  # for the report
    cfg = cfg.model_copy(
        update={
            "seed": seed,
            "optimizer": cfg.optimizer.model_copy(update={"lr": lr}),
            "data": cfg.data.model_copy(update={"cache": str(out.resolve()) if study.shares_corpus else None}),
            **({"init": start["checkpoint"]} if start else {}),
        }
    )
    trial.set_user_attr("steps", steps)
    trial.set_user_attr("setup", setup)  # what it trained as (check_unchanged)
    metric = definition.record_key

    def on_eval(step: int, record: dict) -> None:  # a metric that is not a number stops the trainer, with why
        trial.report(record[metric], step)
        if step < steps and trial.should_prune():  # at the last step there is nothing left to save: the trial is complete
            raise optuna.TrialPruned(f"pruned at step {step}")

    folder = trial_folder(trials_folder(out, trial.study.study_name, url), trial.number, key)
    trial.set_user_attr("run", str(folder.resolve()))  # for the studies that start from it
    trainer = Trainer(spec, cfg, folder, Console(quiet=True))
    trial.set_user_attr("flops_per_step", trainer.flops_per_step)
    trial.set_user_attr("environment", trainer.environment)
    final = trainer.fit(steps, on_eval=on_eval)[-1]
    if metric != "eval_acc" and final.get("eval_acc") is not None:  # scored on responses or answers: the report gives it beside the loss
        trial.set_user_attr(ACCURACY, final["eval_acc"])
    return final[metric]


def _outcome(study: Study, trial: optuna.Trial, key: tuple, out: Path, url: str) -> tuple[float | None, TrialState, str | None]:
    """How a trial ended: its value, state and, if it failed, why (a failure is a result too)."""
    try:
        return _train(study, trial, key, out, url), TrialState.COMPLETE, None
    except optuna.TrialPruned:
        return None, TrialState.PRUNED, None
    except (UpdateFinishedTrialError, *STORAGE_ERRORS):  # not this worker's trial any more, or no storage to record it in (run_trial)
        raise
    except Exception as exc:
        if refused_by_the_machine(exc):  # every trial after it would fail the same way (run_trial)
            raise
        return None, TrialState.FAIL, f"{type(exc).__name__}: {exc}"


def refused_by_the_machine(exc: Exception) -> bool:
    """Whether a trial stopped because the disk would not take its files (full, read-only)."""
    return isinstance(exc, (Unwritten, ShortWrite)) or isinstance(exc, OSError) and exc.errno in REFUSED


def run_trial(study: Study, optuna_study: optuna.Study, trial_id: int, out: Path, url: str) -> bool:
    """Train a claimed trial and record how it ended. False when it was no longer this worker's to
    record: another worker failed it as stale (this one sent no heartbeat for longer than the grace
    period, e.g. while paused) and queued it again."""
    trial = optuna.Trial(optuna_study, trial_id)
    try:
        claimed = optuna_study._storage.get_trial(trial_id)
        key = planned_as(claimed)
        worker = f"{socket.gethostname()}:{os.getpid()}"
        trial.set_user_attr("worker", worker)  # named even if it dies before training
        if claimed.user_attrs.get(STOPPED):  # a retry's copy of the mark: a worker of the same name and pid is not stopped
            trial.set_user_attr(STOPPED, None)
            trial.set_user_attr(STOPPED_BY, None)
        with heartbeat(trial_id, optuna_study._storage):
            try:
                value, state, failure = _outcome(study, trial, key, out, url)
                if failure:
                    trial.set_user_attr("failure", failure)
                optuna_study.tell(trial, value, state=state, skip_if_finished=True)
            except UpdateFinishedTrialError:
                return False
            except KeyboardInterrupt:  # its worker stops: the report counts the trial as that, not as running
                _mark_stopped(trial, worker, INTERRUPTED)
                raise
            except (Unwritten, OSError) as exc:  # nor is it failed for its disk's
                _mark_stopped(trial, worker, "its disk would not take the trial's files")
                raise StorageError(f"trial {trial.number} stopped: {exc}. This worker stops too, rather than fail the trials after it;"
                                   " that trial runs again once it has sent no heartbeat for --grace-period and a worker can write its"
                                   " files") from None
        return optuna_study._storage.get_trial(trial_id).state == state
    except STORAGE_ERRORS as exc:  # a trial is not failed for its storage's fault: it goes stale, and runs again
        raise StorageError(f"lost the study storage {shown(url)} while trial {trial.number} trained: {_in_words(exc)}; that trial"
                           " runs again once it has sent no heartbeat for --grace-period and a worker reaches the storage") from None


def _mark_stopped(trial: optuna.Trial, worker: str, why: str) -> None:
    """Mark the trial as its worker's, stopped by ``why``: the report counts it as that, not as running.
    A retry copies the mark, but is another worker's. The stop is what to say, not a storage error."""
    with contextlib.suppress(*STORAGE_ERRORS):
        trial.set_user_attr(STOPPED_BY, why)
        trial.set_user_attr(STOPPED, worker)


@contextmanager
def heartbeat(trial_id: int, storage: RDBStorage):
    """A trial's heartbeat while it trains, as optuna's, but one that a storage error does not end
    with a thread's traceback: a beat that fails is missed (the trial's own writes say whether the
    storage is gone)."""
    stop = threading.Event()

    def beat() -> None:
        while True:
            with contextlib.suppress(*STORAGE_ERRORS):  # a beat missed
                storage.record_heartbeat(trial_id)
            if stop.wait(storage.get_heartbeat_interval()):
                return

    thread = threading.Thread(target=beat, name=f"heartbeat of trial {trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class _Records(BaseModel):
    """Records archlab keeps in a study's storage, as it writes them. A field that is absent until
    recorded defaults to None without being Optional: a null written in its place is refused."""
    model_config = ConfigDict(strict=True)


class _Planned(_Records):
    """A trial's plan: its fixed params (or params)."""
    variant: str
    seed: int
    slot: Annotated[int, Field(ge=0)]


class _RunStart(_Records):
    model_config = ConfigDict(extra="forbid")
    run: str
    checkpoint: str
    weights: str = None  # a hash of its weights, recorded since runs trained again in place were told apart


class _StudyStart(_Records):
    model_config = ConfigDict(extra="forbid")
    study: str
    trial: int
    lr: Positive
    checkpoint: str


# a start records its study (and trial) or its run: validated as the one it says it is, so that an error names its own fields
_Start = Annotated[Annotated[_StudyStart, Tag("study")] | Annotated[_RunStart, Tag("run")],
                  Discriminator(lambda start: "study" if isinstance(start, dict) and "study" in start else "run")]


class _TrialAttrs(_Records):
    """A trial's user attributes that archlab reads (optuna-dashboard's copies of its plan are not)."""
    lr: Positive = None
    steps: Annotated[int, Field(ge=1)] = None
    setup: dict = None
    environment: dict[str, str] = None
    started_from: _Start = None
    run: str = None
    flops_per_step: Positive = None
    accuracy: Annotated[float, Field(ge=0, le=1)] = Field(None, alias=ACCURACY)
    failure: str = None
    worker: str = None
    stopped: str | None = Field(None, alias=STOPPED)  # cleared with None when a retry's new worker takes it
    stopped_by: str | None = Field(None, alias=STOPPED_BY)


class _TrialSystem(_Records):
    """A trial's system attributes: its plan, where enqueued, and the trials it retries (Optuna's)."""
    fixed_params: _Planned = None
    retry_history: list[int] = None


Loss = Annotated[float, Field(ge=0, allow_inf_nan=False)]  # the trainer stops on one that is not finite, before reporting it
Share = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]


class _Loss(_Records):
    """A completed trial's value and evaluations, by step, where the metric is the held-out loss."""
    value: Loss = None
    intermediate_values: dict[int, Loss]


class _Accuracy(_Records):
    """A completed trial's value and evaluations, by step, where the metric is the accuracy."""
    value: Share = None
    intermediate_values: dict[int, Share]


class _Curve(_Records):
    """Another trial's evaluations, by step: numbers (not required finite: earlier versions of the
    trainer reported a loss that was not before stopping the trial)."""
    intermediate_values: dict[int, float]


class _StudyAttrs(_Records):
    corpus: str = Field(None, alias=CORPUS)
    starts: dict[str, dict[str, _Start]] = Field(None, alias=STARTS)
    grace_period: Annotated[int, Field(ge=1)] = None
    joined: Annotated[float, Field(allow_inf_nan=False)] = Field(None, alias=JOINED)


@contextmanager
def _readable(where: str):
    """Records Optuna cannot read itself (JSON that does not parse, a state it has no name for, a
    study with no direction) said as damage to ``where``, not as a traceback."""
    try:
        yield
    except (ValueError, LookupError, AssertionError) as exc:
        why = ("a trial's value or intermediate value disagrees with its type (a finite one that is empty, or an infinite one"
               " that holds a number)") if isinstance(exc, AssertionError) else said(exc)
        raise StorageError(f"{where} is damaged: Optuna cannot read its records ({why}); restore the database from a copy, or"
                           " run the study afresh with another --out (or --storage)") from None


def check_records(optuna_study: optuna.Study, url: str) -> None:
    """Refuse a storage whose records are not as archlab writes them (the database edited by hand,
    or by another program): they came out as tracebacks deep in a report or a worker, or as figures
    that are not (a learning rate of -1 in the table, a plot of text)."""
    where = f"study {optuna_study.study_name} in {shown(url)}"
    with _readable(where):
        kept, trials = optuna_study.user_attrs, optuna_study.get_trials(deepcopy=False)
    found = [f"the study's user attribute {p}" for p in _invalid(_StudyAttrs, kept)]
    numbers = collections.Counter(t.number for t in trials)  # Optuna numbers a new trial by the count: a gap gives two one number
    found += [f"trial {n} is missing (trials are numbered from 0 as they are made)" for n in range(len(trials)) if n not in numbers]
    found += [f"trial {n} is there {count} times" for n, count in sorted(numbers.items()) if count > 1]
    for t in trials:
        problems = [*(f"user attribute {p}" for p in _invalid(_TrialAttrs, t.user_attrs)),
                    *(f"system attribute {p}" for p in _invalid(_TrialSystem, t.system_attrs))]
        if "fixed_params" not in t.system_attrs:
            problems += [f"param {p}" for p in _invalid(_Planned, t.params)]
        if t.state == TrialState.COMPLETE:  # what the report reads of every completed trial
            problems += [f"complete, with no {what}" for what, value in (("value", t.value), ("learning rate", learning_rate(t)),
                                                                         ("flops_per_step", t.user_attrs.get("flops_per_step"))) if value is None]
            scored = {"intermediate_values": t.intermediate_values, **({"value": t.value} if t.value is not None else {})}
            problems += _invalid(_Accuracy if optuna_study.direction == StudyDirection.MAXIMIZE else _Loss, scored)
        else:
            problems += _invalid(_Curve, {"intermediate_values": t.intermediate_values})
        found += [f"trial {t.number}: {p}" for p in problems]
    if found:
        raise StorageError(f"{where} holds records archlab did not write (was the database edited?): {first_few(found, 3, '; ')};"
                           " restore the database from a copy, or run the study afresh with another --out (or --storage)")


def _invalid(model: type[_Records], records: dict[str, Any]) -> list[str]:
    """What is wrong with ``records`` as ``model`` reads them, each as "NAME: what (got VALUE)"."""
    try:
        model.model_validate(records)
    except ValidationError as exc:
        return [f"{'.'.join(map(str, e['loc']))}: {e['msg'][0].lower()}{e['msg'][1:].split(' or instance of')[0]}"
                + ("" if e["type"] == "missing" else f" (got {e['input']!r})") for e in exc.errors()]
    return []


def planned_as(trial: optuna.trial.FrozenTrial) -> tuple:
    """The (variant, seed, lr slot) a trial was planned as, known before it runs."""
    fixed = trial.system_attrs.get("fixed_params", trial.params)
    return fixed["variant"], fixed["seed"], fixed["slot"]


def latest(trials: list[optuna.trial.FrozenTrial]) -> dict[tuple, optuna.trial.FrozenTrial]:
    """The latest attempt at each planned (variant, seed, slot), in whatever state: a trial that
    went stale gives way to its retry."""
    retried = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
    return {planned_as(t): t for t in trials if t.number not in retried}


def settled(trials: list[optuna.trial.FrozenTrial]) -> dict[tuple, optuna.trial.FrozenTrial]:
    """The finished trial of each planned (variant, seed, slot)."""
    return {key: t for key, t in latest(trials).items() if t.state.is_finished()}


def learning_rate(trial: optuna.trial.FrozenTrial) -> float | None:
    """A trial's learning rate: its grid point, or the value TPE sampled (None before it runs)."""
    return trial.user_attrs.get("lr", trial.params.get("lr"))


def chosen(trials: list[optuna.trial.FrozenTrial], maximize: bool, sampler: str) -> list[optuna.trial.FrozenTrial]:
    """The completed trials a variant's score is the mean of. On a grid:
    of the learning rates with the most seeds completed (a seed that failed or was pruned counts
    against its rate, not for it), the one whose seeds score best on average. Under TPE, where
    every draw differs: each seed's best draw (the best of as many draws for every variant, so
    alike in its optimism)."""
    choose = max if maximize else min
    if sampler == "tpe":
        by_seed: dict[int, list] = {}
        for t in trials:
            by_seed.setdefault(planned_as(t)[1], []).append(t)
        return [choose(draws, key=lambda t: t.value) for draws in by_seed.values()]
    by_lr = by_rate(trials)
    sign = 1 if maximize else -1
    return by_lr[max(by_lr, key=lambda k: (len(by_lr[k]), sign * statistics.mean(t.value for t in by_lr[k])))]


def by_rate(trials: list[optuna.trial.FrozenTrial]) -> dict[float, list[optuna.trial.FrozenTrial]]:
    """Grid trials by their learning rate."""
    by_lr: dict[float, list] = {}
    for t in trials:
        by_lr.setdefault(learning_rate(t), []).append(t)
    return by_lr


def refuse_foreign_files(out: Path) -> None:
    """A study writes only its own files into its folder (its report and plots over those there),
    so a folder holding anything else is someone's: a run, notes, another tool's. A report or plot
    is a study's only beside one of ``MARKS``."""
    ours = STUDY_FILES if any((out / name).exists() for name in MARKS) else STUDY_FILES - REPORT_FILES
    foreign = sorted(p.name for p in out.iterdir() if written_as(p.name) not in ours) if out.is_dir() else []
    if foreign:
        raise StorageError(f"--out {out} holds files that are not a study's ({first_few(foreign, 5)}),"
                           " which its report and plots could overwrite; choose an empty or new --out")


def work(study: Study, out: Path, url: str | None, console: Console, grace_period: int = 60) -> optuna.Study:
    """Be one worker of the study until every planned trial has finished."""
    refuse_foreign_files(out)
    if reads_files_in(study.config.data.source, out):
        raise StorageError(f"--out {out} is inside the text folder {study.config.data.source} the study trains on: its trials' files"
                           " would be read as training text; put it outside")
    url = storage_url(out, url)
    make_folder(out)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _once(warnings.showwarning)
            return _work(study, out, url, console, grace_period)
    except STORAGE_ERRORS as exc:  # the server gone between trials, say
        raise StorageError(f"lost the study storage {shown(url)}: {_in_words(exc)}; finished trials are kept there, and a"
                           " `study run` once it is back goes on") from None


def _once(show: Callable) -> Callable:
    """``warnings.showwarning`` saying each notice once: every trial reads the same data (a corpus
    cut short by data.max_bytes was said by each). Python's own "once" forgets what it said
    whenever the warning filters change, as they do while a trial trains."""
    said = set()

    def show_once(message, *args, **kwargs) -> None:
        if str(message) not in said:
            said.add(str(message))
            show(message, *args, **kwargs)

    return show_once


def _work(study: Study, out: Path, url: str, console: Console, grace_period: int) -> optuna.Study:
    optuna_study = join(study, out, url, grace_period, lambda line: console.print(line, highlight=False, markup=False))
    planned = study.planned()
    columns = [TextColumn(f"[bold]{optuna_study.study_name}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[now]}"), TimeElapsedColumn()]
    live = console.is_interactive  # a terminal; a log file gets a plain line per trial instead
    with Progress(*columns, console=console, disable=not live) as progress:
        task = progress.add_task("study", total=len(planned), now="")
        waiting = False  # said once a wait begins
        while True:
            trial_id = claim(optuna_study, url, out, planned)
            progress.update(task, completed=len(settled(optuna_study.get_trials(deepcopy=False))))
            if trial_id is None:
                unfinished = optuna_study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING))
                if not any(t.state == TrialState.RUNNING or planned_as(t) in planned for t in unfinished):
                    break
                if not live and not waiting:  # a log's reader would see nothing for as long as it waits
                    console.print(f"waiting for {len(unfinished)} trial(s) of other workers (one whose worker is gone is taken"
                                  f" over once silent for --grace-period, {grace_period} s)", highlight=False, markup=False)
                waiting = True
                progress.update(task, now="waiting for other workers' trials")
                time.sleep(heartbeat_interval(grace_period))
                continue
            waiting = False
            trial = optuna_study._storage.get_trial(trial_id)
            now = "{} seed {} lr slot {}".format(*planned_as(trial))
            progress.update(task, now=now)
            if not run_trial(study, optuna_study, trial_id, out, url):
                console.print(f"trial {trial.number} ({now}) was taken over: this worker sent no heartbeat for over {grace_period} s"
                              " (paused?), so another failed it and queued it again; going on", highlight=False, markup=False)
            elif not live:
                outcome = _outcome_said(optuna_study._storage.get_trial(trial_id), study.definition.metric)
                console.print(f"trial {trial.number} ({now}): {outcome}", highlight=False, markup=False)  # a failure may quote [paths]
    return optuna_study


def _outcome_said(trial: optuna.trial.FrozenTrial, metric: str) -> str:
    """How a finished trial ended, for a log's line: its state, its metric, and why it failed."""
    outcome = trial.state.name.lower()
    if trial.state == TrialState.PRUNED and trial.last_step is not None:  # its value is where it was cut, not a result
        outcome += f" at step {trial.last_step} ({metric} {trial.intermediate_values[trial.last_step]:.4f} there)"
    elif trial.value is not None:
        outcome += f", {metric} {trial.value:.4f}"
    return outcome + (f" ({trial.user_attrs['failure'].splitlines()[0]})" if "failure" in trial.user_attrs else "")
