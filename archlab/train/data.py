"""Training data: a real corpus tokenized once into the run directory, examples for fine-tuning
(prompt/response pairs or conversations), or a synthetic recall task.

Every batch is a pure function of (seed, split, step): sampling needs no state, so resuming at
step s replays exactly the batches an uninterrupted run would have drawn, and the processes of a
distributed run each take their slice of the same global batch.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import sysconfig
import tokenize
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from archlab.files import locked, make_folder, path_kind, regular, write_text_whole, write_whole
from archlab.loss import IGNORE
from archlab.table import first_few
from archlab.train.config import NAMED_SOURCES, SYNTHETIC, Data, absolute, anchored_source, holds_examples, holds_token_ids, tokenized

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".csv", ".html", ".tex", ".c", ".h", ".js", ".yaml", ".yml"}
SPLITS = {"train": 0, "val": 1}


class DataError(Exception):
    """Unusable training data, said in words."""


@dataclass
class Batch:
    inputs: torch.Tensor  # [B, T] token ids
    targets: torch.Tensor  # [B, T] next tokens
    mask: torch.Tensor | None = None  # [B, T] bool: positions that count (a task's answers, an example's response)

    def counted_targets(self) -> torch.Tensor:
        """The targets as the loss takes them: those of positions that do not count are IGNORE."""
        return self.targets if self.mask is None else self.targets.masked_fill(~self.mask, IGNORE)


def tokens_fingerprint(train: np.ndarray, val: np.ndarray, *masks: np.ndarray) -> str:
    """The splits' lengths and a hash of 64 evenly spaced pieces of each (and of their masks), so
    that a corpus cut short or replaced is not trained on in silence (hashing every token would
    take minutes at every start of a large run)."""
    digest = hashlib.blake2b(digest_size=16)
    for tokens in (train, val, *masks):
        piece = max(1, min(1024, len(tokens) // 64))
        for i in range(64):  # from the first piece to the last, in whole numbers
            start = i * (len(tokens) - piece) // 63
            digest.update(np.ascontiguousarray(tokens[start : start + piece], dtype=np.uint32).tobytes())
    return f"{len(train)}+{len(val)} tokens, {digest.hexdigest()}"


def _global_batch_rng(seed: int, split: str, step: int, batch: int, world: int) -> np.random.Generator:
    """The generator of one global batch: every process draws the whole batch and keeps its rows."""
    if batch % world:
        raise DataError(f"the batch of {batch} sequences does not split evenly over {world} processes")
    return np.random.default_rng([seed, SPLITS[split], step])


def _own_rows(rows: Sequence, rank: int, world: int) -> Sequence:
    """This process's rows of a global batch drawn whole: the rank-th of ``world`` equal shares."""
    return rows[rank * len(rows) // world : (rank + 1) * len(rows) // world]


class CacheError(DataError):
    """A data cache's tokenized corpus at fault, not the data, which may be fine: the message says
    what to do with the cache."""


class OtherCorpus(CacheError):
    """A data cache holding a corpus tokenized from other data, or with other settings."""


class ShortSplit(DataError):
    """A split with fewer tokens than one sequence needs: ``have`` tokens in the ``split`` split of ``describe``."""

    def __init__(self, split: str, have: int, seq_len: int, describe: str):
        super().__init__(f"sequence length {seq_len} needs at least {seq_len + 1} tokens, but the {split} split of {describe}"
                         f" has {have}; use a shorter seq_len or more data")
        self.split, self.have, self.describe = split, have, describe


class TokenSource:
    """Train and validation token arrays, sampled at random offsets; with ``masks`` (a bool array
    beside each split's tokens), only the tokens marked count: the responses of fine-tuning
    examples, whose accuracy is then reported too."""

    def __init__(self, train: np.ndarray, val: np.ndarray, seq_len: int, seed: int, describe: str,
                 masks: dict[str, np.ndarray] | None = None):
        for name, tokens in (("training", train), ("validation", val)):
            if len(tokens) < seq_len + 1:
                raise ShortSplit(name, len(tokens), seq_len, describe)
        self.splits, self.seq_len, self.seed, self.describe = {"train": train, "val": val}, seq_len, seed, describe
        self.masks = masks
        self.reports_accuracy = masks is not None  # of the counted tokens; where every next token counts, loss says it all

    @functools.cached_property
    def fingerprint(self) -> str:
        """What a checkpoint records and a resume compares (``tokens_fingerprint``)."""
        return tokens_fingerprint(self.splits["train"], self.splits["val"], *(self.masks or {}).values())

    def uncounted_share(self) -> float:
        """The share of the training windows ``batch`` draws from in which no target counts: with
        prompts longer than ``seq_len``, many fall inside them."""
        if self.masks is None:
            return 0.0
        counted = np.concatenate([[0], np.cumsum(self.masks["train"], dtype=np.int64)])  # counted targets before each position
        n = self.seq_len
        return float(np.mean(counted[n + 1 :] == counted[1 : len(counted) - n]))  # a window from s counts targets s+1..s+n

    def batch(self, split: str, step: int, batch: int, rank: int = 0, world: int = 1) -> Batch:
        tokens = self.splits[split]
        rng = _global_batch_rng(self.seed, split, step, batch, world)
        starts = rng.integers(0, len(tokens) - self.seq_len, size=batch)
        mine = _own_rows(starts, rank, world)
        rows = torch.from_numpy(np.stack([np.asarray(tokens[s : s + self.seq_len + 1], dtype=np.int64) for s in mine]))
        if self.masks is None:
            return Batch(rows[:, :-1], rows[:, 1:])
        counted = torch.from_numpy(np.stack([self.masks[split][s + 1 : s + self.seq_len + 1] for s in mine]))
        return Batch(rows[:, :-1], rows[:, 1:], counted)


class RecallTask:
    """Synthetic probes of what a mixer can retrieve; only the answer positions count.

    - ``mqar`` (multi-query associative recall, as in Zoology): key-value pairs, then the keys
      again in random order among blanks; each key must be answered with its value.
    - ``copy`` (selective copying): tokens scattered among blanks, then a marker; the tokens must
      be repeated in order.
    """

    reports_accuracy = True  # of the answers: the share recalled is the task's measure

    def __init__(self, kind: str, vocab_size: int, seq_len: int, seed: int):
        if vocab_size < 16:
            raise DataError(f"synthetic task {kind!r} needs a vocabulary of at least 16, the spec has {vocab_size}")
        if seq_len < 16:
            raise DataError(f"synthetic task {kind!r} needs seq_len >= 16, got {seq_len}")
        self.kind, self.vocab, self.seq_len, self.seed = kind, vocab_size, seq_len, seed
        self.describe = f"the synthetic {kind} task"
        self.fingerprint = self.describe  # drawn from the config, which a resume keeps, but for the task's name there

    def uncounted_share(self) -> float:
        return 0.0  # every sequence asks for its answers

    def batch(self, split: str, step: int, batch: int, rank: int = 0, world: int = 1) -> Batch:
        rng = _global_batch_rng(self.seed, split, step, batch, world)
        rows = [self._mqar(rng) if self.kind == "mqar" else self._copy(rng) for _ in range(batch)]
        rows = _own_rows(rows, rank, world)
        seq = torch.tensor(np.stack([r[0] for r in rows]), dtype=torch.long)
        answer = torch.tensor(np.stack([r[1] for r in rows]), dtype=torch.bool)
        return Batch(seq[:, :-1], seq[:, 1:], answer[:, 1:])

    def _mqar(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        n, half = self.seq_len + 1, (self.vocab - 1) // 2
        pairs = max(1, min(half, n // 8))
        keys = rng.choice(np.arange(1, half + 1), pairs, replace=False)
        values = rng.choice(np.arange(half + 1, 2 * half + 1), pairs)
        seq, answer = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
        seq[: 2 * pairs : 2], seq[1 : 2 * pairs : 2] = keys, values
        slots = 2 * pairs + 2 * rng.choice((n - 2 * pairs) // 2, pairs, replace=False)  # query at a slot, answer after
        order = rng.permutation(pairs)
        seq[slots], seq[slots + 1], answer[slots + 1] = keys[order], values[order], True
        return seq, answer

    def _copy(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        n = self.seq_len + 1
        count = max(1, n // 8)
        marker = self.vocab - 1
        tokens = rng.integers(1, marker, count)
        seq, answer = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
        spots = np.sort(rng.choice(n - count - 1, count, replace=False))
        seq[spots], seq[n - count - 1] = tokens, marker
        seq[n - count :], answer[n - count :] = tokens, True
        return seq, answer


# --- corpora --------------------------------------------------------------------------------


STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The files of the ``stdlib`` corpus, in the order it reads them."""
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    found = []
    for folder, subfolders, _ in os.walk(STDLIB):  # as rglob walks: symbolic links to folders are not followed
        subfolders[:] = [name for name in subfolders if name not in skip]  # never walked: site-packages can hold 10x the stdlib
        found += Path(folder).glob("*.py")
    return sorted(found)


def read_texts(source: str, max_bytes: int, text_field: str = "text") -> list[str]:
    """Documents of a text corpus, in a fixed order, up to ``max_bytes`` characters in all, each
    file read only as far as they go. Files that are not UTF-8 text (a byte that is not UTF-8, a
    NUL byte, or unreadable) are left out by name: in a notice where other files hold text, in the
    error where none does."""
    looked_for = ""  # which files of a folder are read, said when none held text
    root = None  # a folder's files are named from it
    unreadable: list[tuple[str, str]] = []  # (folder, why) of those a folder's walk could not list
    if source == "stdlib":
        files, root = stdlib_files(), STDLIB
    elif source.startswith("hf:"):
        return _hf_texts(source[3:], max_bytes, text_field)
    else:
        path = Path(source)
        files = _text_files(path, unreadable) if path.is_dir() else [regular_file(source, or_folder=True)]
        looked_for = (f"; a folder's files ending in {', '.join(sorted(TEXT_SUFFIXES))}, outside hidden folders such as .git"
                      f" or .venv" if path.is_dir() else "")
        root = path if path.is_dir() else None
    texts, total, left_out = [], 0, []
    for number, file in enumerate(files, 1):
        room = max_bytes - total
        try:
            text = _read_text(file, room + 1)  # one more, to know whether the limit cut it
        except _NotText as why:
            left_out.append(f"{file.relative_to(root) if root else file} ({why})")
            continue
        if len(text) > room or (len(text) == room and _any_text(files[number:])):
            _say_cut(source, max_bytes)
            text = text[:room]
        if text.strip():
            texts.append(text)
            total += len(text)
        if total >= max_bytes:
            break
    said = [_left_out_said(left_out)] * bool(left_out) + [_unlisted_said(unreadable, root)] * bool(unreadable)
    if not texts:
        raise DataError(f"data source {source!r} holds no text (looked at {len(files)} file(s){looked_for})" + "".join(f"; {s}" for s in said))
    if said:
        warnings.warn(f"data source {source!r}: {'; '.join(said)}", stacklevel=2)
    return texts


def regular_file(source: str, or_folder: bool = False) -> Path:
    """The file a data source names, refused in words where it is none: missing, a folder, a link
    to nothing (or in a loop), or a FIFO or device, whose reading would block or never end."""
    path = Path(source)
    kind = path_kind(path)
    if kind == "file":
        return path
    why = {"folder": "a folder, not a file", "other": "not a regular file" + " or folder" * or_folder + " (a FIFO, a device or a socket)",
           "dangling": "a symbolic link to nothing, or in a loop"}.get(kind, "no such file" + " or folder" * or_folder)
    raise DataError(f"data source {source!r}: {why}")


def _unlisted_said(unreadable: list[tuple[str, str]], root: Path | None) -> str:
    """The folders of a text folder that could not be listed, named (the first few) and counted."""
    names = [f"{folder if root is None or Path(folder) == root else os.path.relpath(folder, root)} ({why})" for folder, why in unreadable]
    return f"could not list {len(names)} folder(s), whose files are left out: {first_few(names, NAMED)}"


def reads_files_in(source: str, folder: Path) -> bool:
    """Whether ``read_texts(source)`` would read files written into ``folder``: one inside the
    source's folder, outside its hidden folders."""
    if source in NAMED_SOURCES or source.startswith("hf:") or not Path(source).is_dir():  # a named source is never a folder's files
        return False
    target = folder.resolve()
    for root, _ in _walked(Path(source)):  # a folder linked from the source's is read too
        try:
            inside = target.relative_to(os.path.realpath(root))
        except ValueError:
            continue
        if not any(part.startswith(".") for part in inside.parts):
            return True
    return False


NAMED = 5  # files left out that a message names; the rest are counted


class _NotText(Exception):
    """Why a file of a text corpus is left out, said after its name."""


def _read_text(file: Path, wanted: int) -> str:
    """The first ``wanted`` characters of a UTF-8 text file, as ``read_text()[:wanted]`` gives
    them, read no further (a file larger than memory, an endless stream such as /dev/zero)."""
    try:
        with open(file, encoding="utf-8-sig") as f:  # a byte-order mark, which some editors write, is no text
            text = f.read(wanted)
    except UnicodeDecodeError as exc:
        raise _NotText(f"not UTF-8: byte 0x{exc.object[exc.start]:02x}") from None
    except OSError as exc:
        raise _NotText(f"unreadable: {exc.strerror or exc}") from None
    if "\0" in text:
        raise _NotText("NUL bytes: binary, not text")
    return text


def _any_text(files: list[Path]) -> bool:
    """Whether any of ``files`` holds text: those a corpus's budget, filled, leaves unread."""
    for file in files:
        with contextlib.suppress(_NotText):
            if _read_text(file, 1):
                return True
    return False


def _left_out_said(left_out: list[str]) -> str:
    """The files read_texts left out, named (the first few) and counted."""
    convert = "; convert text in another encoding to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
    return f"left out {len(left_out)} file(s) that are not UTF-8 text: {first_few(left_out, NAMED)}" + (
        convert if any("(not UTF-8:" in said for said in left_out) else "")


def _say_cut(source: str, max_bytes: int) -> None:
    """A notice that ``data.max_bytes`` left part of a corpus unread: a run trains on what it read,
    epoch after epoch, not on the corpus it was given."""
    warnings.warn(f"data source {source!r} is read as far as data.max_bytes ({max_bytes:,} characters) and no further;"
                  " raise data.max_bytes to train on the rest", stacklevel=3)


def _text_files(folder: Path, unreadable: list[tuple[str, str]]) -> list[Path]:
    """The text files of a folder and the folders it reads (``_walked``); folders it cannot list
    are added to ``unreadable``, with why."""
    found = [Path(root, name) for root, names in _walked(folder, unreadable) for name in names]
    return sorted(file for file in found if file.suffix.lower() in TEXT_SUFFIXES and file.is_file())


def _walked(folder: Path, unreadable: list[tuple[str, str]] | None = None) -> Iterator[tuple[str, list[str]]]:
    """(folder, its file names) of a folder and every subfolder but hidden ones (.git, .venv:
    tooling, not the corpus), linked ones too (which ``Path.rglob`` skips), each real folder once;
    one it cannot list is added to ``unreadable``, with why."""
    seen = set()
    said = None if unreadable is None else (lambda exc: unreadable.append((exc.filename, exc.strerror or str(exc))))
    for root, folders, names in os.walk(folder, followlinks=True, onerror=said):
        real = os.path.realpath(root)
        if real in seen:  # a link back up the tree, or a second link to one folder
            folders[:] = []
            continue
        seen.add(real)
        folders[:] = sorted(name for name in folders if not name.startswith("."))  # a folder linked twice: read where first in order
        yield root, names


def _hf_texts(name: str, max_bytes: int, field: str) -> list[str]:
    """The texts of a Hugging Face dataset's split, streamed (never downloaded whole) up to
    ``max_bytes`` characters, cut there as a corpus of files is."""
    try:
        import datasets
    except ImportError:
        raise DataError("hf: sources need the `datasets` package (pip install datasets)") from None
    dataset, _, split = name.partition(":")
    try:
        stream = datasets.load_dataset(dataset, split=split or "train", streaming=True)
        texts, total = [], 0
        for number, row in enumerate(stream, 1):
            if field not in row:
                raise DataError(f"Hugging Face dataset {dataset!r}: row {number} has no field {field!r} (it has {', '.join(map(repr, row))});"
                                " set data.hf_text_field")
            if row[field] is None:  # no text, rather than the text "None"
                continue
            if not isinstance(row[field], str):
                raise DataError(f"Hugging Face dataset {dataset!r}: row {number}'s {field!r} is a {type(row[field]).__name__}, not text;"
                                " set data.hf_text_field to a field of text")
            if not row[field].strip():
                continue
            if total + len(row[field]) > max_bytes or total == max_bytes:  # as a file is cut: there, and only if text is left
                _say_cut(f"hf:{name}", max_bytes)
                texts += [row[field][: max_bytes - total]] if total < max_bytes else []
                break
            texts.append(row[field])
            total += len(row[field])
    except DataError:
        raise
    except Exception as exc:  # network, a missing dataset: both end the same way
        raise DataError(f"could not stream Hugging Face dataset {dataset!r}: {str(exc) or type(exc).__name__}") from None
    if not texts:
        raise DataError(f"Hugging Face dataset {dataset!r} (split {split or 'train'!r}) holds no text in its field {field!r}"
                        " (every row's is empty or null); set data.hf_text_field to a field of text")
    return texts


END = "\n"  # ends each prompt/response example's response: the run's BPE has no special tokens
# Ends each message of a conversation, before a newline: a reply of many lines (code, paragraphs)
# ends here, not at its first newline, as no message may hold it.
MESSAGE_END = "<|end|>"
HEADERS = {"system": "System: ", "user": "User: ", "assistant": "Assistant: "}  # a message's role, as its text begins


def holds_pairs(source: str) -> bool:
    """Whether a file of examples holds prompt/response pairs alone, which teach a response after
    a bare prompt, ended by a newline, and no conversation's turns (a line naming "messages")."""
    try:
        with open(source, encoding="utf-8-sig", errors="replace") as f:
            return not any('"messages"' in line for line in f)
    except OSError:
        return False  # gone since: nothing to say of it


def _first_line_not_utf8(file: Path) -> tuple[int, int] | None:
    """The number of a file's first line that does not decode as UTF-8, and its first bad byte."""
    with open(file, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                return number, line[exc.start]
    return None


TRAINING_EXAMPLES = (2, "training and validation need at least one each")  # the fewest examples a use takes, and why
SCORED_EXAMPLES = (1, "there is nothing to score")


def read_examples(source: str, max_bytes: int, fewest: tuple[int, str] = TRAINING_EXAMPLES) -> list[list[tuple[str, bool]]]:
    """The examples of a ``.jsonl`` file, one JSON object a line, in order, up to ``max_bytes``
    characters of their text: each as its pieces of text, with whether their tokens count (see
    ``_example``). Blank lines (and a byte-order mark) are skipped, anything else wrong is named by
    its line; fewer examples than ``fewest`` asks are refused with its reason."""
    try:
        lines = regular_file(source).open(encoding="utf-8-sig")
    except OSError as exc:
        raise DataError(f"data source {source!r}: {exc.strerror or exc}") from None
    examples, total, cut = [], 0, False
    with lines:
        try:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                if total >= max_bytes:  # an example left unread; blank lines after the last are none
                    cut = True
                    break
                try:
                    value = json.loads(line)
                except ValueError as exc:
                    raise DataError(f"line {number} of {source!r} is not JSON ({exc})") from None
                except RecursionError:
                    raise DataError(f"line {number} of {source!r} is not an example: its JSON nests too deeply") from None
                pieces, chars = _example(value, f"line {number} of {source!r}", line)
                examples.append(pieces)
                total += chars
        except UnicodeDecodeError as exc:  # met reading ahead: the line is found again byte by byte
            number, byte = _first_line_not_utf8(Path(source)) or ("?", exc.object[exc.start])
            raise DataError(f"line {number} of {source!r} is not UTF-8 text (byte 0x{byte:02x}); convert the file to UTF-8") from None
    if cut:
        _say_cut(source, max_bytes)
    if len(examples) < fewest[0]:
        within = f" within data.max_bytes ({max_bytes:,} characters)" if cut else ""
        raise DataError(f"data source {source!r} holds {len(examples)} example(s){within}; {fewest[1]}")
    if not any(text.strip() for pieces in examples for text, counts in pieces if counts and text not in (END, MESSAGE_END + "\n")):
        warnings.warn(f"data source {source!r}: every response (or assistant message) is empty; a run on it learns only to end a"
                      " reply at once", stacklevel=2)
    return examples


def _example(value: object, where: str, line: str) -> tuple[list[tuple[str, bool]], int]:
    """One line's example as pieces of text, each with whether its tokens count, and how many
    characters of text it gives. A prompt/response pair is its prompt, then its response and
    ``END``; a conversation (``"messages"``, as chat datasets give them) is each message's role
    header, then its content and its end, where an assistant's content and end count
    (``_conversation``)."""
    if isinstance(value, dict) and "messages" in value:
        pieces, chars = _conversation(value["messages"], where)
    elif isinstance(value, dict) and all(isinstance(value.get(key), str) for key in ("prompt", "response")):
        pieces, chars = [(value["prompt"], False), (value["response"], True), (END, True)], len(value["prompt"]) + len(value["response"])
    else:
        raise DataError(f'{where} is not an example: each line is a JSON object with "prompt" and "response" strings, or with'
                        f' "messages", it has {line.strip()[:80]}')
    for text, _ in pieces:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # JSON may escape half of a UTF-16 pair, which is no character
            raise DataError(f"{where} holds {json.dumps(exc.object[exc.start])}, half of a UTF-16 surrogate pair, which is not text") from None
    return pieces, chars


def _conversation(messages: object, where: str) -> tuple[list[tuple[str, bool]], int]:
    """A conversation's pieces (``_message_pieces``) and its characters, refused if nothing in it counts."""
    pieces = _message_pieces(messages, where)
    if not any(counts for _, counts in pieces):
        raise DataError(f'{where} has no assistant message to train on (none, or each with "weight": 0)')
    return pieces, sum(len(message["content"]) for message in messages)


def _message_pieces(messages: object, where: str) -> list[tuple[str, bool]]:
    """Each message's role header, content and end (``MESSAGE_END`` and a newline). An assistant's
    content and end count, but where it has ``"weight": 0``: as in OpenAI's fine-tuning format, a
    turn given as context alone."""
    if not (isinstance(messages, list) and messages):
        raise DataError(f'{where}: "messages" is a list of {{"role", "content"}} objects, it has {json.dumps(messages)[:80]}')
    pieces = []
    for index, message in enumerate(messages, 1):  # counted from 1, as the lines are
        if not (isinstance(message, dict) and message.get("role") in HEADERS and isinstance(message.get("content"), str)):
            raise DataError(f'{where}: message {index} is not a {{"role": {" | ".join(map(json.dumps, HEADERS))},'
                            f' "content": string}} object, it is {json.dumps(message)[:80]}')
        weight = message.get("weight", 1)
        if weight not in (0, 1) or isinstance(weight, bool) or (message["role"] != "assistant" and "weight" in message):
            raise DataError(f'{where}: message {index} has "weight": {json.dumps(message["weight"])}; an assistant\'s message may'
                            " have a weight of 0 (context, not trained on) or 1")
        if MESSAGE_END in message["content"]:
            raise DataError(f"{where}: message {index} holds {MESSAGE_END}, which ends a message where the model reads it (and,"
                            " in training, learns to end one there); take it out of the content")
        counts = message["role"] == "assistant" and weight == 1
        pieces += [(HEADERS[message["role"]], False), (message["content"], counts), (MESSAGE_END + "\n", counts)]
    return pieces


def reply_prompt(messages: list[dict], tokenizer) -> list[int]:
    """The tokens a reply to ``messages`` follows: the conversation as training tokenizes it, piece
    by piece (not as one text, whose tokens may span a header and its content), and the assistant's
    header."""
    pieces = [*_message_pieces(messages, "the conversation"), (HEADERS["assistant"], False)]
    return _example_tokens([pieces], tokenizer, "the conversation")[0][0].tolist()


def _example_tokens(examples: list[list[tuple[str, bool]]], tokenizer, what: str = "the examples") -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each example's tokens, its pieces tokenized one by one (a token never spans two), and which
    of them count."""
    encoded = iter(encode(tokenizer, [text for pieces in examples for text, _ in pieces], what))
    ids, counted = [], []
    for pieces in examples:
        tokens = [(next(encoded).ids, counts) for _, counts in pieces]
        ids.append(np.asarray([token for piece, _ in tokens for token in piece], dtype=np.uint32))
        counted.append(np.asarray([counts for piece, counts in tokens for _ in piece], dtype=bool))
    return ids, counted


def _examples(cfg: Data, vocab_size: int, seq_len: int, seed: int, data_dir: Path, resume: bool) -> TokenSource:
    """Fine-tuning examples as a token stream, packed one after another, where their responses (or
    assistant messages) and the ends after them count (see ``_example``). The last
    ``val_fraction`` of the examples are held out. Tokenized at every start (examples are few),
    with ``cfg.tokenizer``, the run's own on a resume, or a BPE trained on them, which is written
    into ``data_dir`` for ``generate``."""
    examples = read_examples(cfg.source, cfg.max_bytes)
    own = data_dir / "tokenizer.json"
    kept = resume and own.is_file()  # a resume keeps the tokenizer its run generates with
    if kept or cfg.tokenizer:
        tokenizer = load_tokenizer(str(own) if kept else cfg.tokenizer, vocab_size)
    else:
        tokenizer = train_tokenizer([text for pieces in examples for text, _ in pieces], vocab_size)  # each piece as it is tokenized
    ids, counted = _example_tokens(examples, tokenizer)
    cut = len(examples) - max(1, round(len(examples) * cfg.val_fraction))
    if not kept:
        make_folder(data_dir)
        write_text_whole(own, tokenizer.to_str(pretty=True))
    return TokenSource(np.concatenate(ids[:cut]), np.concatenate(ids[cut:]), seq_len, seed,
                       f"{len(examples):,} examples of {cfg.source!r}",
                       masks={"train": np.concatenate(counted[:cut]), "val": np.concatenate(counted[cut:])})


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE of ``vocab_size`` tokens (the 256 bytes, then learned merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256:
        raise DataError(f"a byte-level tokenizer needs a vocabulary of at least 256; the spec has {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[], show_progress=False
    )
    tokenizer.train_from_iterator((piece for text in texts for piece in _training_pieces(text)), trainer)
    return tokenizer


LONGEST_WORD = 1000  # characters of a run without whitespace (or of whitespace) that BPE training takes at once


def _training_pieces(text: str):
    """``text`` in pieces for BPE training, cut only inside runs of more than LONGEST_WORD
    characters without whitespace (DNA, base64) or of whitespace alone (padding): such a run is
    one pre-token, whose training takes time quadratic in its length (hours for 5 MB of spaces, and
    signals wait for it). Text without such runs stays one piece, so BPE trains on it exactly as
    on the whole text."""
    start = 0
    long_run = rf"\S{{{LONGEST_WORD}}}(?=\S)|\s{{{LONGEST_WORD}}}(?=\s)"  # one match per LONGEST_WORD characters of a run
    for run in re.finditer(long_run, text):
        yield text[start:run.end()]
        start = run.end()
    yield text[start:]


def read_tokenizer(path: str):
    """A tokenizer.json without its post-processor. archlab joins what it trains on and prompts
    with from pieces tokenized apart (a prompt and its response, a header and a message, a
    document and the next), so a template's special tokens, such as the start token ``<s>`` that
    Llama's adds to every encoding, would land inside them, where the loss counts them."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(path)
    tokenizer.post_processor = None
    return tokenizer


def _tokenizer_file(path: str) -> Path:
    """The tokenizer file ``path`` names; a DataError where there is none."""
    if not Path(path).is_file():
        raise DataError(f"tokenizer {path!r}: {'not a file' if Path(path).exists() else 'no such file'}")
    return Path(path)


def load_tokenizer(path: str, vocab_size: int):
    _tokenizer_file(path)
    try:
        tokenizer = read_tokenizer(path)
    except Exception as exc:
        raise DataError(f"tokenizer {path!r} could not be read: {exc}") from None
    if tokenizer.get_vocab_size() == 0:  # every text would encode to nothing, said of the text
        raise DataError(f"tokenizer {path!r} has no tokens")
    if tokenizer.get_vocab_size() > vocab_size:
        raise DataError(f"tokenizer {path!r} has {tokenizer.get_vocab_size()} tokens; the spec's vocab_size is {vocab_size}")
    token, largest = max(tokenizer.get_vocab().items(), key=lambda item: item[1], default=("", -1))
    if largest >= vocab_size:  # ids may leave gaps, so a count within the vocabulary is not enough
        raise DataError(f"tokenizer {path!r} gives {token!r} the id {largest}, past the spec's vocab_size {vocab_size}")
    return tokenizer


NPY_MAGIC = b"\x93NUMPY"  # how every .npy file begins
NPY_UNREADABLE = (ValueError, EOFError, tokenize.TokenError, SyntaxError)  # what np.load raises for a damaged file: a garbled
# header's Python literal is tokenized (TokenError where it is cut short) and parsed (SyntaxError, as for a dtype such as ',u2')


class NoNumbers(ValueError):
    """A .npy file that holds no array of numbers: it is none at all (numpy would read it as a
    pickle), or one of Python objects."""


def _mapped_npy(path: Path) -> np.ndarray:
    """The array of a .npy file, mapped. numpy's word on a file that is not one, or holds Python
    objects, advises allow_pickle, which would run the file's code: each is said in its own words."""
    with open(path, "rb") as f:
        if f.read(len(NPY_MAGIC)) != NPY_MAGIC:
            raise NoNumbers("is not a NumPy .npy file (it does not begin as one does)")
    try:
        return np.load(path, mmap_mode="r")
    except ValueError as exc:
        if "allow_pickle" in str(exc) or "Python objects" in str(exc):
            raise NoNumbers("holds Python objects, not token ids") from None
        raise


def _token_file(path: Path, cfg: Data, vocab_size: int) -> np.ndarray:
    try:
        tokens = _mapped_npy(path) if path.suffix.lower() == ".npy" else np.memmap(path, dtype=cfg.token_dtype, mode="r")
    except NoNumbers as exc:
        raise DataError(f"token file {str(path)!r} {exc}; save token ids with numpy.save, or give raw ids a .bin name") from None
    except (*NPY_UNREADABLE, OSError) as exc:
        raise DataError(f"token file {str(path)!r} could not be read: {exc}") from None
    raw = path.suffix.lower() != ".npy"  # its ids' width is data.token_dtype's word, not the file's
    if raw and tokens.ndim == 1 and len(tokens) % 2 == 0 and (halves := _high_halves(tokens)):
        wider, advice = {"uint16": ("uint32", "if it holds uint32 ids, set data.token_dtype: uint32; 64-bit ids: "),
                         "uint32": ("64-bit", "")}[cfg.token_dtype]
        raise DataError(f"token file {str(path)!r} read as {cfg.token_dtype} holds ids below 16 alone at its odd positions (at most"
                        f" {halves[0]}) and up to {halves[1]} at its even ones, as the high halves of {wider} ids read as"
                        f" {cfg.token_dtype} do; {advice}save them with numpy.save as .npy, which records their width")
    problem = _not_token_ids(tokens, vocab_size)
    if problem:
        hint = f" (read as {cfg.token_dtype}: is that the width it was written in? data.token_dtype)" if raw and ">=" in problem else ""
        raise DataError(f"token file {str(path)!r} {problem}{hint}")
    return tokens


def _not_token_ids(tokens: np.ndarray, vocab_size: int) -> str | None:
    """What keeps an array from being token ids of this vocabulary (said after its name), or None."""
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        return f"must hold a 1-D array of integers, has {tokens.dtype} {tokens.shape}"
    if len(tokens) and int(tokens.max()) >= vocab_size:
        return f"has token id {int(tokens.max())} >= vocab_size {vocab_size}"
    if len(tokens) and int(tokens.min()) < 0:
        return f"has token id {int(tokens.min())}; ids start at 0"
    return None


HALVES_SAMPLE = 1 << 20  # the ids at a token file's start that _high_halves looks at


def _high_halves(tokens: np.ndarray) -> tuple[int, int] | None:
    """The largest id at the odd and at the even positions of the file's start, where the odd ones
    look like the high halves of ids twice as wide (little-endian): all below 16 (0 and 1 for a
    vocabulary under 2**17 read at half width), and far below the even ones. Text's ids are spread
    alike over both."""
    start = np.asarray(tokens[:HALVES_SAMPLE])
    if len(start) < 64:
        return None
    odd, even = int(start[1::2].max()), int(start[0::2].max())
    return (odd, even) if odd < 16 and even > 16 * odd else None


CORPUS_FILES = ("train.npy", "val.npy", "corpus.json")  # a tokenized corpus, in data_dir / "data"


def _made_from(cfg: Data, vocab_size: int, text: str | None) -> dict:
    """What decides a tokenized corpus's tokens: the same answer reads back the same tokens. The
    text's fingerprint (``_text_fingerprint``) tells a source's files edited since apart."""
    return {**cfg.model_dump(mode="json", exclude={"cache", "token_dtype"}), "vocab_size": vocab_size, "text": text}


def _text_fingerprint(texts: list[str], tokenizer: str | None) -> str:
    """Of the text read from a source, and of the tokenizer file given to encode it (one replaced
    at the same path encodes it otherwise)."""
    digest = hashlib.blake2b(digest_size=16)
    for text in texts:
        digest.update(text.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
    if tokenizer:
        digest.update(_tokenizer_file(tokenizer).read_bytes())
    return digest.hexdigest()


def _drop_other_corpus(cfg: Data, vocab_size: int, data_dir: Path, replace: bool, text: str | None) -> None:
    """A tokenized corpus made from other data would be read back in place of this data: replace
    it where ``replace`` allows (the run's own folder, on a fresh start), refuse otherwise. Its
    text is compared where ``text`` gives its fingerprint now and the corpus recorded one (a
    resume reads back the tokens it trained on, whatever its files hold now)."""
    cache = data_dir / "data"
    if path_kind(cache / "corpus.json") is None:
        return  # none yet, or tokenized before corpora said what they were made from
    try:
        made_from = json.loads(regular(cache / "corpus.json").read_text())
    except (ValueError, RecursionError):  # not JSON, or JSON nested past Python's limit: no record of what it was made from
        made_from = None
    except OSError as exc:  # a FIFO, a folder or a link to nothing in its place
        raise _damaged_corpus(cache, f"its corpus.json {exc.strerror}") from None
    try:  # paths an older run recorded relative mean what they meant from here
        made_from |= {"source": anchored_source(made_from["source"]), "tokenizer": absolute(made_from["tokenizer"])}
    except (TypeError, KeyError, AttributeError):
        pass  # not a record of this shape: told apart below
    wanted = _made_from(cfg, vocab_size, text)
    if isinstance(made_from, dict):
        made_from.pop("tokens", None)  # the tokens' fingerprint, which _read_corpus checks
    if isinstance(made_from, dict) and text is None:  # tokens read back: where their text and tokenizer are now is no matter
        for key in ("source", "tokenizer"):  # (a corpus moved): the trainer checks the tokens against its checkpoint's
            wanted[key] = made_from.get(key)
    if isinstance(made_from, dict) and (text is None or made_from.get("text") is None):  # nothing to compare the text with
        wanted["text"] = made_from.get("text")
    elif isinstance(made_from, dict):  # the fingerprint holds the tokenizer's bytes: one copied elsewhere is the same
        made_from.pop("tokenizer", None)
        wanted.pop("tokenizer")
    if made_from == wanted:
        return
    if not replace:
        if not isinstance(made_from, dict):  # a record gone bad says nothing of the data
            raise _damaged_corpus(cache, "its corpus.json does not read as a record of what it was made from")
        differ = [key for key in wanted if made_from.get(key) != wanted[key]]
        made = ("tokenized with " + ", ".join(f"{key} {made_from.get(key)!r}" for key in differ if key != "text")
                if differ != ["text"] else f"tokenized from the text {cfg.source!r} held before it changed (or data.tokenizer's file did)")
        raise OtherCorpus(f"{cache} holds a corpus {made}, not this data's; give this data another data.cache"
                        f" (a study: another --out, since its trials so far trained on that corpus, and it refuses another), or"
                        f" remove {cache} to tokenize again")
    remove_corpus(data_dir)


def remove_corpus(data_dir: Path, tokenizer: bool = True) -> None:
    """The tokenized corpus in ``data_dir`` (and its tokenizer) gone: the next start tokenizes again."""
    for name in CORPUS_FILES:
        (data_dir / "data" / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # a folder holding more, or none
        (data_dir / "data").rmdir()
    if tokenizer:
        (data_dir / "tokenizer.json").unlink(missing_ok=True)


def remove_advice(data_dir: Path, source: str) -> str:
    """What to remove besides putting data back, where a corpus tokenized from other text is there
    and ``source`` is text read into it (a recall task or a file of token ids or examples is not)."""
    cache = data_dir / "data"
    cached = tokenized(source) and not holds_examples(source)
    return f" (and remove {cache}, tokenized from other text, to tokenize it again)" if cached and cache.is_dir() else ""


def undo_tokenizing(data_dir: Path) -> Callable[[], None]:
    """What undoes the tokenizing a start is about to do into ``data_dir``: it removes the corpus
    that was not there, and puts the tokenizer back as it was (none, or the bytes it held). A start
    refused once it knows its tokens (another corpus than its checkpoint's) then leaves the folder
    as it found it, so that the data put back tokenizes again, rather than being refused as other
    text than the corpus there."""
    corpus, tokenizer = (data_dir / "data" / "train.npy").is_file(), data_dir / "tokenizer.json"
    held = tokenizer.read_bytes() if tokenizer.is_file() else None

    def undo() -> None:
        if not corpus:
            remove_corpus(data_dir, tokenizer=held is None)
        if held is not None and (not tokenizer.is_file() or tokenizer.read_bytes() != held):
            write_whole(tokenizer, lambda f: f.write(held))

    return undo


DataSource = TokenSource | RecallTask  # what a trainer draws batches from


def encode(tokenizer, texts: list[str], what: str) -> list:
    """``tokenizer.encode_batch(texts)``, where a tokenizer that cannot encode a text (a word-level
    one without an unknown token, meeting a word it lacks) is a DataError naming ``what``: the
    tokenizers library raises a bare Exception."""
    try:
        return tokenizer.encode_batch(texts)
    except Exception as exc:
        raise DataError(f"the tokenizer cannot encode {what}: {exc}") from None


UNKNOWN_SAID = 0.01  # the share of a text's tokens past which a tokenizer's unknown token is said: it does not cover the text


def _encoded(source: str, texts: list[str], tokenizer) -> np.ndarray:
    """The token ids of ``texts``. A tokenizer whose unknown token stands for much of them (a
    word-level one from other text) is said: the characters it stands for are lost to training."""
    ids = np.concatenate([np.asarray(e.ids, dtype=np.uint32) for e in encode(tokenizer, texts, f"data source {source!r}")])
    if len(ids) == 0:
        raise DataError(f"data source {source!r} tokenized to nothing")
    unknown = getattr(tokenizer.model, "unk_token", None)
    unknown_id = tokenizer.token_to_id(unknown) if unknown else None
    if unknown_id is not None and (share := float(np.mean(ids == unknown_id))) > UNKNOWN_SAID:
        warnings.warn(f"{share:.1%} of the tokens of data source {source!r} are the tokenizer's unknown token {unknown!r}: it does"
                      " not cover this text, whose characters that token stands for are lost to training", stacklevel=2)
    return ids


def tokens_of(cfg: Data, vocab_size: int, tokenizer: Path | None,
              say: Callable[[str], None] | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Every token of ``cfg.source``, split off nothing and written nowhere (a corpus to evaluate
    on): a token file's ids, or text (or examples) tokenized with ``tokenizer`` (a run's own); and
    which of them count (of examples, their responses; None: every one). ``say`` is told, as
    ``prepare``'s is, before text is tokenized."""
    if holds_token_ids(cfg.source):
        return _token_file(regular_file(cfg.source), cfg, vocab_size), None
    if tokenizer is None:
        raise DataError(f"data source {cfg.source!r} is text, and the run has no tokenizer to read it with (it trained on"
                        " token ids or a recall task); give a token file")
    read = load_tokenizer(str(tokenizer), vocab_size)
    if holds_examples(cfg.source):  # the examples as a run trained on them reads them
        ids, counted = _example_tokens(read_examples(cfg.source, cfg.max_bytes, SCORED_EXAMPLES), read)
        return np.concatenate(ids), np.concatenate(counted)
    texts = read_texts(cfg.source, cfg.max_bytes, cfg.hf_text_field)
    if say is not None:
        say(f"tokenizing data source {cfg.source!r} ({sum(map(len, texts)):,} characters) with the run's tokenizer {tokenizer}")
    return _encoded(cfg.source, texts, read), None


def prepare(cfg: Data, vocab_size: int, seq_len: int, seed: int, data_dir: Path, replace: bool = False, resume: bool = False,
            say: Callable[[str], None] | None = None) -> DataSource:
    """Build the data source, tokenizing a corpus into ``data_dir/data`` (and its tokenizer into
    ``data_dir``) the first time; a resumed run reads those files back, so it trains on exactly
    the same tokens (where they are gone, it tokenizes again with the run's tokenizer, and the
    trainer compares the tokens with its checkpoint's). A corpus there made from other data is
    replaced if ``replace``, else refused. ``say`` is told, in a line, when a corpus is about to
    be tokenized: the default ``stdlib`` takes 6 to 20 s on two CPU cores, which would pass without a word."""
    if cfg.source in SYNTHETIC:
        return RecallTask(cfg.source, vocab_size, seq_len, seed)
    if holds_examples(cfg.source):
        return _examples(cfg, vocab_size, seq_len, seed, data_dir, resume)
    if holds_token_ids(cfg.source):
        tokens = _token_file(regular_file(cfg.source), cfg, vocab_size)
        cut = int(len(tokens) * (1 - cfg.val_fraction))
        return TokenSource(tokens[:cut], tokens[cut:], seq_len, seed, repr(cfg.source))
    cache = data_dir / "data"
    if resume and (cache / "train.npy").is_file():  # the tokens it trained on, whatever the source holds now
        texts, text = None, None
    else:
        texts = read_texts(cfg.source, cfg.max_bytes, cfg.hf_text_field)
        text = _text_fingerprint(texts, cfg.tokenizer)
    foreign = cfg.cache and not (data_dir / CORPUS_LOCK).exists() and path_kind(data_dir / "tokenizer.json")
    if foreign and not (cache / "train.npy").is_file():  # a folder of one's own, given as data.cache
        raise CacheError(f"{data_dir} holds a tokenizer.json that no run tokenizing there wrote (no {CORPUS_LOCK} beside it), which"
                         " tokenizing would replace: give another data.cache (a study: another --out), or that file as data.tokenizer")
    with _corpus_lock(data_dir) if cfg.cache else contextlib.nullcontext():
        _drop_other_corpus(cfg, vocab_size, data_dir, replace, text)  # on a resume (replace never), leaves train.npy as it found it
        if texts is not None and not (cache / "train.npy").is_file():
            _tokenize_corpus(cfg, vocab_size, data_dir, texts, text, resume, say)
        train, val = _read_corpus(cache, vocab_size)
        _check_tokenizer(data_dir, vocab_size, f"the tokenized corpus in {cache} was made with it; put it back, or remove it"
                                               f" and {cache} to tokenize again")
    return TokenSource(train, val, seq_len, seed, repr(cfg.source))


# Beside a shared data.cache: one run at a time checks, tokenizes and reads back the corpus there.
# Each file is written whole, but two runs tokenizing other corpora at once left a set of files
# from both, and either run could read the other's tokens or tokenizer back.
CORPUS_LOCK = ".corpus.lock"


@contextlib.contextmanager
def _corpus_lock(data_dir: Path) -> Iterator[None]:
    """The shared cache ``data_dir``'s lock (made, with the folder, if need be), held while the body runs."""
    try:
        make_folder(data_dir)
    except NotADirectoryError as exc:  # a file, a FIFO or a link to nothing in its place
        raise DataError(f"data.cache {str(data_dir)!r}: {exc.strerror}") from None
    try:
        handle = open(regular(data_dir / CORPUS_LOCK), "ab")  # a FIFO there would wait for a reader
    except OSError as exc:
        raise DataError(f"data.cache {str(data_dir)!r}: its lock file {CORPUS_LOCK} cannot be made: {exc.strerror}") from None
    with handle, locked(handle):
        yield


def _tokenize_corpus(cfg: Data, vocab_size: int, data_dir: Path, texts: list[str], text: str, resume: bool,
                     say: Callable[[str], None] | None) -> None:
    """Tokenize ``texts`` into ``data_dir/data``, with ``cfg.tokenizer``, the run's own on a
    resume, or a BPE trained on them, written into ``data_dir``; ``corpus.json`` records what
    the tokens were made from (``text``: the texts' fingerprint) and the tokens' fingerprint."""
    cache, own = data_dir / "data", data_dir / "tokenizer.json"
    kept = resume and own.is_file()  # a resume keeps the tokenizer its run generates with
    trains = not (cfg.tokenizer or kept)
    if say is not None:
        say(f"tokenizing data source {cfg.source!r} ({sum(map(len, texts)):,} characters"
            f"{f', with a BPE of {vocab_size:,} tokens trained on it first' if trains else ''}) into {cache}")
    if cfg.tokenizer:
        tokenizer = load_tokenizer(cfg.tokenizer, vocab_size)
    elif kept:
        try:
            tokenizer = load_tokenizer(str(own), vocab_size)
        except DataError as exc:
            raise DataError(f"{exc}; put it back, or remove it to train one again from the text (the resume then checks"
                            " the tokens against its checkpoint)") from None
    else:
        tokenizer = train_tokenizer(texts, vocab_size)
    ids = _encoded(cfg.source, texts, tokenizer)
    cut = int(len(ids) * (1 - cfg.val_fraction))
    make_folder(cache)
    # each file whole: a kill leaves none half-written, and a run that has one mapped keeps it
    write_text_whole(own, tokenizer.to_str(pretty=True))
    write_whole(cache / "val.npy", lambda f: np.save(f, ids[cut:]))
    tokens = tokens_fingerprint(ids[:cut], ids[cut:])
    write_text_whole(cache / "corpus.json", json.dumps({**_made_from(cfg, vocab_size, text), "tokens": tokens}, indent=2))
    write_whole(cache / "train.npy", lambda f: np.save(f, ids[:cut]))  # last: its presence marks the cache complete


def _damaged_corpus(cache: Path, why: str) -> CacheError:
    return CacheError(f"the tokenized corpus in {cache} is damaged ({why}); remove {cache} to tokenize it again")


def _read_corpus(cache: Path, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The train and val tokens of a tokenized corpus, mapped from its files, checked to be token
    ids of this vocabulary (ids past it would stop the first step) and the tokens its corpus.json
    records the fingerprint of: a run sharing the cache would train on tokens changed since, and a
    split cut short would be blamed on the data, as too short for a sequence."""
    splits = []
    for split in ("train", "val"):
        try:
            tokens = _mapped_npy(regular(cache / f"{split}.npy"))
        except (*NPY_UNREADABLE, OSError) as exc:
            raise _damaged_corpus(cache, f"its {split}.npy {exc}" if isinstance(exc, NoNumbers) else f"{type(exc).__name__}: {exc}") from None
        if problem := _not_token_ids(tokens, vocab_size):
            raise _damaged_corpus(cache, f"its {split}.npy {problem}")
        splits.append(tokens)
    recorded = _recorded_tokens(cache)
    if recorded is not None and recorded != (now := tokens_fingerprint(*splits)):
        raise _damaged_corpus(cache, f"its train.npy and val.npy are not the tokens tokenized there: its corpus.json records"
                                     f" {recorded}; they hold {now}")
    return splits[0], splits[1]


def _recorded_tokens(cache: Path) -> str | None:
    """The tokens' fingerprint the cache's corpus.json records; none where it records none (a
    corpus tokenized before it did; a record gone bad is refused before the corpus is read)."""
    try:
        tokens = json.loads(regular(cache / "corpus.json").read_text()).get("tokens")
    except (OSError, ValueError, RecursionError, AttributeError):
        return None
    return tokens if isinstance(tokens, str) else None


def _check_tokenizer(data_dir: Path, vocab_size: int, recover: str) -> None:
    """The tokenizer.json a tokenized corpus was made with, which ``generate`` reads the run's text
    with: a run that trained on without it would finish, and then not generate."""
    try:
        load_tokenizer(str(data_dir / "tokenizer.json"), vocab_size)
    except DataError as exc:
        raise DataError(f"the {exc}; {recover}") from None
