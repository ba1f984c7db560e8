"""Files written whole: readers see the old file or the new one, never part of one."""

import numpy as np
import pytest

from archlab.files import TEMPORARY, write_whole, written_as


def test_a_file_written_whole_leaves_its_readers_the_old_one(tmp_path):
    path = tmp_path / "train.npy"
    np.save(path, np.arange(100_000))
    mapped = np.load(path, mmap_mode="r")  # another run reading a shared corpus cache
    write_whole(path, lambda f: np.save(f, np.arange(10)))
    assert int(mapped.sum()) == sum(range(100_000))  # saved in place, the file would shrink under it: a bus error
    assert np.load(path).tolist() == list(range(10))


def test_a_failed_write_keeps_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "corpus.json"
    path.write_text("old")

    def fail(f):
        f.write(b"part of it")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_whole(path, fail)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.json"]


def test_a_killed_writes_temporary_names_its_file():
    assert written_as(".train.npy.tmp-4242") == "train.npy"
    assert written_as("train.npy") == "train.npy"
    assert written_as(".hidden") == ".hidden"


def test_a_file_that_cannot_be_written_is_named_not_its_temporary(tmp_path):
    """The error names the file meant: its temporary name (``.config.yaml.tmp-NNNN``) told a
    user of a read-only run folder nothing they had asked for."""
    (tmp_path / "run").write_text("a file where a folder was meant")
    path = tmp_path / "run" / "config.yaml"
    with pytest.raises(NotADirectoryError) as raised:
        write_whole(path, lambda f: f.write(b"steps: 6\n"))
    assert raised.value.filename == str(path) and TEMPORARY not in str(raised.value), raised.value
