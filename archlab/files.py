"""Files written whole: under a temporary name beside their place, then renamed into it.

A reader (another run sharing a corpus cache, or this run resumed after a kill) then finds the
old file or the new one, never part of one, and a reader that has the old one mapped keeps it.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

TEMPORARY = ".tmp-"
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no room: on the disk, in a quota, under a file size limit
REFUSED = (*FULL, errno.EROFS)  # writes the machine refuses, whatever is written


def make_folder(path: Path) -> None:
    """``path`` made a folder, with its parents. One that cannot be is named for what it is (mkdir
    says "File exists" of a link to nowhere, a FIFO or a device)."""
    if path.is_symlink() and not path.exists():
        raise NotADirectoryError(errno.ENOTDIR, f"a link to {os.readlink(path)}, which is not there", str(path))
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(path))
    path.mkdir(parents=True, exist_ok=True)


def path_kind(path: Path) -> str | None:
    """What ``path`` names: "file" (a regular one), "folder", "other" (a FIFO, a device, a socket,
    whose reading may block or never end), "dangling" (a link to nothing, or in a loop), or None."""
    if path.is_dir():
        return "folder"
    if path.is_file():
        return "file"
    if path.exists():
        return "other"
    return "dangling" if path.is_symlink() else None


def regular(path: Path) -> Path:
    """``path``, refused where it names no regular file: a folder, a link to nothing, or a FIFO or
    device, whose reading would wait for a writer or never end (safetensors, torch.load and
    read_text all open such a path as a file)."""
    kind = path_kind(path)
    if kind == "folder":
        raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", str(path))
    if kind == "other":
        raise OSError(errno.EINVAL, "is not a regular file (a FIFO, a device or a socket)", str(path))
    if kind == "dangling":
        raise FileNotFoundError(errno.ENOENT, "is a symbolic link to nothing, or in a loop", str(path))
    return path


@contextmanager
def locked(handle: BinaryIO) -> Iterator[None]:
    """An exclusive lock on the open file ``handle`` while the body runs: one process at a time."""
    fcntl.flock(handle, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)


def write_whole(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write(f)`` into a temporary file, made durable, then renamed to ``path``."""
    if path.name in ("", ".."):  # ".", "..", "/": a folder, with no name to put a temporary beside
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    tmp = path.with_name(f".{path.name}{TEMPORARY}{os.getpid()}")
    try:
        opened = open(tmp, "wb")
    except OSError as exc:  # a folder that cannot be written to
        raise _named(exc, path) from None
    try:
        with opened as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # a full disk, or its place taken (a folder where the file goes): said of the file meant
        raise _named(exc, path) from None
    finally:
        tmp.unlink(missing_ok=True)


class ShortWrite(OSError):
    """A write the disk cut short, that numpy reports with no errno: a full disk, most likely."""


def _named(exc: OSError, path: Path) -> OSError:
    """The error as of the file meant, not of its temporary, which the user never made. A write cut
    short that numpy reports with no errno ("190000 requested and 114656 written") says so."""
    if exc.errno is None:
        return ShortWrite(None, f"written in part ({exc}); is the disk full?", str(path))
    return type(exc)(exc.errno, exc.strerror, str(path))


def write_text_whole(path: Path, text: str) -> None:
    write_whole(path, lambda f: f.write(text.encode("utf-8")))


def save_figure_whole(fig, path: Path, dpi: int) -> None:
    """A matplotlib figure saved as a PNG, whole: a full disk leaves the plot that was there, not
    the first blocks of a new one."""
    write_whole(Path(path), lambda f: fig.savefig(f, format="png", dpi=dpi))


def written_as(name: str) -> str:
    """The file a name stands for: itself, or the file a killed ``write_whole`` was writing."""
    return name[1:].partition(TEMPORARY)[0] if name.startswith(".") and TEMPORARY in name else name
