"""Checkpoints that survive a kill at any moment and load without running pickled code.

A checkpoint is a folder such as ``checkpoints/step-00000100`` holding ``model.safetensors`` (weights),
``trainer.pt`` (optimizer and RNG state; tensors, numbers and lists only, loaded with
``weights_only=True``) and ``state.json``, which records a hash of each of the other two: bytes
changed on the disk that still read as numbers are found before training goes on from them. It
is written under a temporary name and renamed into place, so a folder with the final name is
always complete; older ones beyond ``keep`` are removed only after a newer one is in place, and
renamed out of the way before their files are deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model

from archlab.block import whole_number
from archlab.files import FULL, REFUSED, path_kind, regular
from archlab.memory import NoRoom
from archlab.table import first_few

if TYPE_CHECKING:
    from archlab.spec import ModelSpec


T = TypeVar("T")

RUN_SPEC = "spec.yaml"  # a run's copy of the spec it trains, beside its checkpoints
NAME = re.compile(r"step-(\d{8,})")  # a checkpoint folder's name; anything else there is left alone
LISTINGS = 10  # listings of a run's checkpoints, and reads of its latest, that a training run writing it may cut short


class CheckpointError(Exception):
    """A checkpoint that cannot be used, said in words."""


class Unsaved(CheckpointError):
    """A checkpoint the disk would not take (full, over quota, read-only): the machine's fault, not the run's."""


class WeightsDoNotFit(CheckpointError):
    """A checkpoint whose weights are another model's (other names, shapes or dtypes)."""


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first: folders named as ``save`` names them, and nothing else
    (a copy a user put beside them is neither resumed from nor removed). A listing that met one
    removed as it was read (a training run writing the folder replaced it) is read again: it may
    have missed the checkpoint that replaced it. A checkpoint's name held by no folder (a file, a
    link to nothing) is refused: passed over, the one before it was resumed, and saving over it failed."""
    root = run_dir / "checkpoints"
    for _ in range(LISTINGS):
        named = [p for p in root.iterdir() if NAME.fullmatch(p.name)] if root.is_dir() else []
        found = [p for p in named if p.is_dir()]
        if all(p in found or os.path.lexists(p) for p in named):
            break
    if odd := sorted(p for p in named if p not in found and os.path.lexists(p)):
        raise CheckpointError(f"{odd[0]} is named as a checkpoint but is no folder (a file, or a link to nothing); move it out of"
                              f" {root}")
    return sorted(found, key=step_of)


def latest_read(path: str | Path, read: Callable[[Path, Path], T]) -> T:
    """``read(run folder, checkpoint)`` of the checkpoint ``path`` names (``resolve``). A run that
    trains as it is read removes older checkpoints as it saves (``keep_checkpoints``): a latest one
    removed while it was read is followed by the one that replaced it, and one named as a folder is
    said to be removed, not damaged."""
    named = Path(path).parent.name == "checkpoints"
    for _ in range(LISTINGS):
        run_dir, used = resolve(path)
        try:
            return read(run_dir, used)
        except (CheckpointError, OSError):
            if used.exists():  # the checkpoint itself, unreadable
                raise
        if named:
            raise CheckpointError(f"checkpoint {used} was removed as it was read (a training run writing {run_dir} keeps"
                                  f" its latest checkpoints only, keep_checkpoints); give the run's folder, {run_dir}, to read"
                                  " its latest") from None
    raise CheckpointError(f"the latest checkpoint of {run_dir} was removed as it was read, {LISTINGS} times: a training run"
                          " writing it saves faster than it can be read; read it once that run ends, or give it a larger"
                          " checkpoint_interval") from None


def step_of(path: Path) -> int | None:
    """The step a checkpoint folder's name gives; None for a folder ``save`` did not name (a copy)."""
    named = NAME.fullmatch(path.name)
    return int(named[1]) if named else None


def folder(run_dir: Path, step: int) -> Path:
    """Where ``save`` puts the checkpoint of ``step``."""
    return run_dir / "checkpoints" / f"step-{step:08d}"


def save(run_dir: Path, step: int, model: torch.nn.Module, trainer_state: dict, info: dict, keep: int) -> Path:
    """Write the checkpoint of ``step``; one that cannot be written (a full disk) is a
    CheckpointError, and the checkpoints before it stay as they were."""
    final = folder(run_dir, step)
    tmp = final.with_name(f".tmp-{final.name}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(trainer_state, tmp / "trainer.pt")
        info = {"step": step, **info, **{key: file_hash(tmp / name) for name, key in HASHED.items()}}
        (tmp / "state.json").write_text(json.dumps(info, indent=2))
        shutil.copymode(tmp / "state.json", tmp / "model.safetensors")  # safetensors writes 0600; the rest follow the umask
        for file in tmp.iterdir():  # make the bytes durable before the rename publishes them
            with open(file, "rb") as f:
                os.fsync(f.fileno())
    except (OSError, RuntimeError, SafetensorError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        # torch.save and safetensors report a short write in their own words ("unexpected pos ...")
        full = not isinstance(exc, OSError) or exc.errno in FULL
        error = Unsaved if full or exc.errno in REFUSED else CheckpointError
        raise error(f"the checkpoint of step {step} could not be written in {final.parent} ({type(exc).__name__}:"
                    f" {str(exc).strip()[:200]}){'; is the disk full?' if full else ''}") from None
    for stale in final.parent.glob(f"{REMOVED}*"):  # removals a kill stopped midway
        shutil.rmtree(stale, ignore_errors=True)
    if final.exists():  # the step saved again, by a resume from before it
        _remove(final)
    os.replace(tmp, final)
    for old in checkpoints(run_dir)[:-keep]:
        _remove(old)
    return final


REMOVED = ".tmp-removed-"


def _remove(checkpoint: Path) -> None:
    """Delete a checkpoint folder so that a kill at any moment leaves it whole or no longer a
    checkpoint: renamed first, out of ``checkpoints``' sight, then deleted file by file."""
    doomed = checkpoint.with_name(REMOVED + checkpoint.name)
    os.replace(checkpoint, doomed)
    shutil.rmtree(doomed)


def _stored_form(f, name: str) -> tuple[torch.dtype, list[int]]:
    """A saved tensor's dtype and shape, from an empty slice of it: its data is not read."""
    piece = f.get_slice(name)
    shape = piece.get_shape()
    return (piece[:0] if shape else f.get_tensor(name)).dtype, shape


def _some(names: list[str], sep: str = ", ") -> str:
    """Up to three of ``names``, and how many more."""
    return first_few(sorted(names), 3, sep) or "none"


def _load_weights(path: Path, model: torch.nn.Module) -> None:
    expected = {name: (t.dtype, list(t.shape)) for name, t in model.state_dict().items()}
    open(regular(path / "model.safetensors"), "rb").close()  # safetensors says a file this user may not read is missing
    with safe_open(path / "model.safetensors", "pt") as f:  # loading would convert another dtype silently
        saved = {name: _stored_form(f, name) for name in f.keys() if name in expected}
    for index, kind in enumerate(("dtype", "shape")):
        wrong = [f"{name}: {form[index]}, not {expected[name][index]}" for name, form in saved.items() if form[index] != expected[name][index]]
        if wrong:
            raise WeightsDoNotFit(f"checkpoint {path} does not fit this model (weights of another {kind}: {_some(wrong, '; ')})")
    missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    if missing or unexpected:
        raise WeightsDoNotFit(
            f"checkpoint {path} does not fit this model (missing: {_some(missing)}; unexpected: {_some(unexpected)})"
        )


HASHED = {"model.safetensors": "weights_blake2b", "trainer.pt": "trainer_blake2b"}  # file: its hash's key in state.json


def file_hash(file: Path) -> str:
    """A hash of ``file``, byte for byte."""
    with open(regular(file), "rb") as read:
        return hashlib.file_digest(read, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


def _check_hash(path: Path, info: dict, name: str, use: str = "resume") -> None:
    """A CheckpointError if checkpoint ``path``'s file ``name`` is not the bytes its state.json
    (``info``) recorded; a checkpoint saved before that hash was recorded is taken as it is."""
    recorded = info.get(HASHED[name])
    if recorded is not None and recorded != file_hash(path / name):
        raise damaged(path, f"its {name} is not the file saved with it: a hash of its bytes differs", use)


def damaged(path: Path, why: str, use: str = "resume") -> CheckpointError:
    """A damaged checkpoint, with what is left to go on from: the one before it, where a run keeps
    one. ``use``: what it was read for (``resume``, ``init``, ``score``, a study's ``trial`` to start
    from, or a use that names the checkpoint, such as ``generate`` or a study's ``start``), which
    says how."""
    said = f"checkpoint {path} is damaged ({why})"
    if use == "trial":  # a pretraining study's trial, whose last checkpoint holds the weights it was scored by
        return CheckpointError(f"{said}; the trial's weights are its last checkpoint's: put it back, or run that study afresh")
    step = step_of(path)  # None: a copy under another name, whose checkpoint before it is not known
    earlier = [kept for kept in checkpoints(path.parent.parent) if step_of(kept) < step] if step is not None else []
    if earlier:
        advice = {"resume": "; remove it to resume from the one before", "score": "; remove it to score the one before",
                  "init": f"; give --init the one before it, {earlier[-1]}",
                  "start": f"; put it back as it was (the study's trials already trained started from it), or, in a study that has"
                           f" trained none from it, name the one before it, {earlier[-1]}"}
        return CheckpointError(said + advice.get(use, f"; give the one before it, {earlier[-1]}"))
    if use == "resume" and step is not None:
        return CheckpointError(f"{said}, and no checkpoint before it is kept: train the run again into a new --out (or remove"
                               " this one's checkpoints and metrics.jsonl)")
    return CheckpointError(said)


def unreadable(path: Path, exc: Exception, use: str = "resume") -> CheckpointError:
    """Why checkpoint ``path`` could not be read (``exc``): a file this user may not read is said as
    such, not as damage, whose advice (remove the checkpoint) would lose it."""
    if isinstance(exc, PermissionError):
        return CheckpointError(f"checkpoint {path} cannot be read by this user: {exc.filename or path}: {exc.strerror}; give the"
                               " user read permission (or run as the files' owner)")
    return damaged(path, f"{type(exc).__name__}: {exc}", use)


def info_of(path: Path, use: str = "resume") -> dict:
    """What checkpoint ``path``'s state.json records (its step, the corpus it trained on...); one
    that does not read as a mapping is a damaged checkpoint."""
    try:
        info = json.loads(regular(path / "state.json").read_text())
    except (OSError, ValueError) as exc:
        raise unreadable(path, exc, use) from None
    except RecursionError:  # JSON nested past Python's limit
        raise damaged(path, "its state.json nests too deeply to read", use) from None
    if not isinstance(info, dict):
        raise damaged(path, f"its state.json is not a mapping: {str(info)[:60]}", use)
    return info


def load(path: Path, model: torch.nn.Module) -> tuple[dict, dict]:
    """Load weights into ``model``; return (trainer state, info). Any damage is a CheckpointError."""
    info = load_weights(path, model, "resume")
    try:
        trainer_state = torch.load(regular(path / "trainer.pt"), weights_only=True)
    except PermissionError as exc:
        raise unreadable(path, exc) from None
    except Exception as exc:  # the unpickler meets damage as any of a dozen errors (KeyError, IndexError, struct.error...)
        # named, not quoted: torch's text runs to a dozen lines and suggests weights_only=False,
        # which would run whatever code a damaged or planted file holds
        said = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise damaged(path, f"trainer.pt does not load: {said}") from None
    _check_hash(path, info, "trainer.pt")  # bytes changed among the optimizer's moments load as numbers
    return trainer_state, info


def non_finite(model: torch.nn.Module) -> list[str]:
    """The names of the model's floating-point tensors holding a NaN or an infinity."""
    return [name for name, t in model.state_dict().items() if t.is_floating_point() and not t.isfinite().all()]


RESTORE_SPEC = 'restore the spec it trained (each checkpoint\'s state.json records it, under "spec")'  # a run's spec.yaml gone


def resolve(path: str | Path) -> tuple[Path, Path]:
    """(run folder, checkpoint folder) of a run directory (its latest checkpoint) or of one of its
    checkpoint folders."""
    path = Path(path)
    named = path.parent.name == "checkpoints"
    if named:
        run_dir, found = path.parents[1], [path]
    else:
        run_dir, found = path, checkpoints(path)  # whole folders; one removed since it was listed is met as it is read (latest_read)
    if not found or named and not path.is_dir():
        raise CheckpointError(f"{path} is not a training run with a checkpoint (expected spec.yaml and checkpoints/step-*)")
    if not (spec := run_dir / RUN_SPEC).is_file():
        try:
            regular(spec)  # which names a folder, a FIFO or a dangling link as such
            why = "is gone"
        except OSError as exc:
            why = exc.strerror
        raise CheckpointError(f"{run_dir} holds checkpoints, but its {RUN_SPEC} {why}; {RESTORE_SPEC}")
    return run_dir, found[-1]


def load_weights(path: Path, model: torch.nn.Module, use: str = "generate") -> dict:
    """The weights of checkpoint ``path`` into ``model``, which they must fit, shape for shape, and
    finite (resumed, a run would train on from NaN; generating, print garbage and succeed), and
    the bytes its state.json records a hash of (a run would go on from, or a score be of, weights
    changed on the disk in silence); return what that state.json records. ``use``: what for (as
    ``damaged`` takes it)."""
    try:
        _load_weights(path, model)  # first: a file that is no safetensors at all is said as such
        info = info_of(path, use)  # none: a copy cut short, or another's weights under its name
        step = info.get("step")
        if not whole_number(step) or step < 0:
            raise damaged(path, f"state.json gives no step count: {str(info)[:60]}", use)
        if step_of(path) not in (None, step):  # None: a copy under another name
            raise damaged(path, f"its state.json is at step {step}", use)
        _check_hash(path, info, "model.safetensors", use)
    except (SafetensorError, OSError, RuntimeError, ValueError, KeyError) as exc:
        raise unreadable(path, exc, use) from None
    if broken := non_finite(model):
        raise damaged(path, f"non-finite weights: {first_few(broken, 3)}", use)
    return info


def load_trained(path: str | Path):
    """(spec, model with the latest weights in eval mode, the checkpoint used, tokenizer.json or
    None) of a run directory or one of its checkpoint folders."""
    return latest_read(path, load_checkpoint)


def load_checkpoint(run_dir: Path, used: Path, use: str = "generate"):
    """``load_trained`` of checkpoint ``used`` of the run ``run_dir``, as ``latest_read`` reads it;
    ``use``: what for, as ``damaged`` takes it."""
    from archlab.model import build_model
    from archlab.spec import load_spec

    spec = load_spec(run_dir / RUN_SPEC)
    try:
        model = build_model(spec)
    except NoRoom as exc:
        raise CheckpointError(f"{spec.name}, the model of {run_dir}, does not fit in memory here ({exc})") from None
    load_weights(used, model, use)
    _say_an_edited_spec(run_dir / RUN_SPEC, spec, used)
    return spec, model.eval(), used, trained_tokenizer(run_dir, used, spec.vocab_size)


def _say_an_edited_spec(file: Path, spec: ModelSpec, used: Path) -> None:
    """A notice where ``file`` (``spec``) is not the spec checkpoint ``used`` trained, but its weights
    still fit (another window, loop count or RoPE base): the edited spec is what runs, as one may
    mean (a longer window at inference), or not."""
    if changed := changes_since_trained(recorded(used).get("spec"), spec, used / "state.json"):
        warnings.warn(f"{file} is not the spec checkpoint {used} trained ({changed}); it runs as edited", stacklevel=3)


def changes_since_trained(trained: object, spec: ModelSpec, state: Path) -> str | None:
    """How ``spec`` differs from ``trained``, the spec a checkpoint's ``state`` records, in at most
    five changes; None where they are equal, or where the checkpoint records none (written before
    they did) or one this version of archlab no longer reads, which leave nothing to compare."""
    from archlab.spec import SpecError, spec_changes, validate_spec

    try:
        trained_spec = validate_spec(trained, str(state)) if isinstance(trained, dict) else None
    except (SpecError, RecursionError):
        return None
    if trained_spec is None:
        return None
    return spec_changes(trained_spec, spec) or None


def recorded(used: Path) -> dict:
    """What checkpoint ``used``'s state.json records, for what reads it only to compare: empty where
    it does not read as a mapping (a checkpoint that loads needs no more of it)."""
    try:
        info = json.loads(regular(used / "state.json").read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested past Python's limit
        return {}
    return info if isinstance(info, dict) else {}


def _recorded_source(run_dir: Path) -> str | None:
    """The data source the latest checkpoint of ``run_dir`` records training on; None where it
    records none that reads."""
    try:
        source = recorded(checkpoints(run_dir)[-1])["config"]["data"]["source"]
    except (IndexError, KeyError, TypeError):
        return None
    return source if isinstance(source, str) else None


TOKENIZER_HASH = "tokenizer_blake2b"  # in state.json: a hash of the run's tokenizer.json as it trained


def trained_tokenizer(run_dir: Path, used: Path, vocab_size: int) -> Path | None:
    """``tokenizer_of(run_dir)``, refused where it does not load, and where it is not the file
    checkpoint ``used`` trained with (another run's reads the run's ids as other text, in silence)."""
    from archlab.train.data import DataError, load_tokenizer

    tokenizer = tokenizer_of(run_dir)
    if tokenizer is not None:
        try:
            load_tokenizer(str(tokenizer), vocab_size)  # damage said as such, before the hash that damage changes
        except DataError as exc:
            raise CheckpointError(str(exc)) from None
        check_tokenizer(used, tokenizer)
    return tokenizer


def check_tokenizer(used: Path, tokenizer: Path) -> None:
    """A CheckpointError where ``tokenizer`` is not the file checkpoint ``used`` records training with."""
    wanted = recorded(used).get(TOKENIZER_HASH)
    if wanted is not None and wanted != file_hash(tokenizer):
        raise CheckpointError(f"{tokenizer} is not the tokenizer checkpoint {used} trained with (a hash of its bytes differs);"
                              " put back the run's own")


def tokenizer_of(run_dir: Path) -> Path | None:
    """A run's tokenizer.json: in the run itself (a run on a shared ``data.cache`` keeps a copy,
    since the cache's is replaced with its corpus), else in that cache (a run from before they
    kept one). A run on token ids or on a recall task has none; one on text that cannot be found is
    an error, since byte tokens in its place would print garbage. A config that does not validate
    is a SpecError."""
    from archlab.train.config import load_config, tokenized

    if path_kind(run_dir / "tokenizer.json") is not None:  # a folder or a FIFO there is said as it is read
        return run_dir / "tokenizer.json"
    config = run_dir / "config.yaml"
    if path_kind(config) is None:  # its latest checkpoint's record of the config says whether it read text
        source = _recorded_source(run_dir)
        if source is not None and tokenized(source):
            raise CheckpointError(f"the run's tokenizer is not at {run_dir / 'tokenizer.json'}, and its config.yaml is gone"
                                  f" too (it trained on the text of {source}): restore the run's tokenizer.json")
        return None
    data = load_config(str(config)).data
    tokenizer = Path(data.cache or run_dir) / "tokenizer.json"
    if tokenizer.is_file():
        return tokenizer
    if not tokenized(data.source):
        return None  # a run on token ids or a recall task has none
    where = f", where data.cache in {config} points (a relative folder is read from the current one)" if data.cache else ""
    raise CheckpointError(f"the run's tokenizer is not at {tokenizer}{where}")
