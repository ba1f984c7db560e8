"""Files written whole: readers see the old file or the new one, never part of one."""

import os
import stat

import numpy as np
import pytest

from archlab.files import TEMPORARY, save_figure_whole, write_whole, written_as


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


def test_a_write_stopped_by_ctrl_c_or_a_bad_value_keeps_the_old_file_and_no_temporary(tmp_path):
    """Not only a full disk stops a write: Ctrl-C during a long save, or a value the writer cannot
    encode, must leave the run folder as it was, with no ``.NAME.tmp-NNNN`` beside the file."""
    path = tmp_path / "config.yaml"
    path.write_text("old")
    for stop in (KeyboardInterrupt(), ValueError("cannot encode")):
        def fail(f, stop=stop):
            f.write(b"part of it")
            raise stop

        with pytest.raises(type(stop)):
            write_whole(path, fail)
        assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["config.yaml"], stop


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


def test_a_file_whose_place_is_taken_by_a_folder_is_named_not_its_temporary(tmp_path):
    """A run folder edited by hand (``data/train.npy`` made a folder) fails the rename, not the
    open: the error names the file meant, which is what is in the way, not ``.train.npy.tmp-NNNN``,
    a file the user never made and cannot find afterwards."""
    path = tmp_path / "train.npy"
    path.mkdir()
    with pytest.raises(IsADirectoryError) as raised:
        write_whole(path, lambda f: np.save(f, np.arange(10)))
    assert raised.value.filename == str(path) and TEMPORARY not in str(raised.value), raised.value
    assert [p.name for p in tmp_path.iterdir()] == ["train.npy"]  # no temporary left behind


def test_a_temporary_is_named_for_its_file_and_on_the_disk_before_it_is_renamed(tmp_path, monkeypatch):
    """A run killed mid-write leaves the temporary behind, which a resume takes for its own file
    only if ``written_as`` reads its name back; and the bytes are flushed from Python's buffer and
    fsynced before the rename makes them the file (else a crash could leave the name on an empty file)."""
    path, seen, synced = tmp_path / "corpus.json", [], []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append((os.fstat(fd).st_size, path.exists())), fsync(fd)))

    def write(f):
        seen.extend(p.name for p in tmp_path.iterdir())
        f.write(b"0123456789")

    write_whole(path, write)
    assert len(seen) == 1 and seen[0] != "corpus.json" and written_as(seen[0]) == "corpus.json", seen
    assert synced == [(10, False)] and path.read_bytes() == b"0123456789"


def test_a_file_written_whole_has_the_permissions_a_plain_write_gives(tmp_path):
    """Readable by the group and others as the umask allows, as ``open(path, "w")`` makes it: a
    temporary made by ``tempfile.mkstemp`` (mode 0600) would keep a shared corpus cache from the
    others who share it."""
    umask = os.umask(0o022)
    try:
        write_whole(tmp_path / "train.npy", lambda f: f.write(b"ids"))
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "train.npy").stat().st_mode) == 0o644


def test_a_full_disk_names_the_file_it_stopped(tmp_path):
    """A write that runs out of room says which file: a bare "No space left on device" (the
    write's own error, which names no file) left a user of a run folder to guess what filled."""
    import errno

    path = tmp_path / "tokenizer.json"
    path.write_text("old")

    def full(f):
        f.write(b"part of it")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as raised:
        write_whole(path, full)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(path), raised.value
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]


def test_a_short_write_numpy_reports_without_an_errno_names_the_file_and_a_full_disk(tmp_path):
    """``np.save`` onto a full disk raises a bare ``OSError("190000 requested and 114656 written")``,
    no errno, no file: the error names the file and asks whether the disk is full."""
    path = tmp_path / "train.npy"

    def short(f):
        f.write(b"\x93NUMPY")
        raise OSError("190000 requested and 114656 written")  # as numpy's tofile says it

    with pytest.raises(OSError) as raised:
        write_whole(path, short)
    assert raised.value.filename == str(path), raised.value
    assert "114656 written" in raised.value.strerror and "disk full" in raised.value.strerror, raised.value
    assert list(tmp_path.iterdir()) == []


def test_a_figure_saved_whole_is_a_png_at_the_dpi_given_and_a_failed_save_keeps_the_last_one(tmp_path):
    import errno

    from matplotlib.figure import Figure

    path = tmp_path / "curves.png"
    fig = Figure(figsize=(2, 1))
    save_figure_whole(fig, path, dpi=50)
    saved = path.read_bytes()
    assert saved[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(saved[16:20], "big"), int.from_bytes(saved[20:24], "big")) == (100, 50)  # IHDR: width, height

    def cut_short(f, **kwargs):  # a disk that fills midway
        f.write(b"\x89PNG part of it")
        raise OSError(errno.ENOSPC, "No space left on device")

    fig.savefig = cut_short
    with pytest.raises(OSError) as raised:
        save_figure_whole(fig, path, dpi=50)
    assert raised.value.filename == str(path) and path.read_bytes() == saved and [p.name for p in tmp_path.iterdir()] == ["curves.png"]


def test_a_plot_leaves_the_callers_matplotlib_as_it_was(tmp_path):
    """A plot is a figure of its own (evaluate's, here, as the six plots are drawn alike): it sets no
    backend (a notebook calling one had its backend switched to Agg for good) and leaves no figure
    open in pyplot."""
    import matplotlib
    import matplotlib.pyplot as plt

    from archlab.train.evaluate import plot

    before = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        plot([{"run": "a", "length": 16, "loss": 2.0}, {"run": "a", "length": 32, "loss": 1.5}], tmp_path / "lengths.png")
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == []
    finally:
        matplotlib.use(before)
    assert (tmp_path / "lengths.png").read_bytes().startswith(b"\x89PNG")
