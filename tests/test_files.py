"""Files written whole: readers see the old file or the new one, never part of one."""

import numpy as np
import pytest

from archlab.files import write_whole, written_as


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
