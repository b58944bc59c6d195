"""``gyre_jax.disk``: the whole-or-nothing writes every durable file of a run goes through (the full-disk cases of
each writer are in tests/faults/test_disk_full.py)."""

from __future__ import annotations

import errno
import os

import pytest

from gyre_jax import disk
from gyre_jax.disk import DiskFull, append_whole, cut, publish_dir, replacing, write_whole


def test_replacing_renames_only_a_whole_file_and_leaves_the_old_one_on_an_error(tmp_path):
    path = tmp_path / "sub" / "a.json"
    write_whole(path, '{"v": 1}\n')  # the parent is made
    assert path.read_text() == '{"v": 1}\n'
    with pytest.raises(RuntimeError, match="producer failed"):
        with replacing(path, "wb") as f:
            f.write(b'{"v": 2, "half')
            raise RuntimeError("producer failed")
    assert path.read_text() == '{"v": 1}\n' and list(path.parent.iterdir()) == [path]  # no temporary left
    write_whole(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"


def test_a_full_disk_in_a_replace_is_disk_full_naming_the_file(tmp_path, monkeypatch):
    path = tmp_path / "results.jsonl"
    write_whole(path, "old\n")

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk.os, "fsync", fsync)
    with pytest.raises(DiskFull) as err:
        write_whole(path, "new\n")
    assert err.value.path == path and "disk full writing" in str(err.value)
    assert path.read_text() == "old\n" and list(tmp_path.iterdir()) == [path]


def test_append_at_cuts_a_torn_tail_first_and_an_error_cuts_back(tmp_path, monkeypatch):
    path = tmp_path / "queue.jsonl"
    append_whole(path, b"a\n")
    with open(path, "ab") as f:
        f.write(b"tor")  # a crash mid-append left this
    append_whole(path, b"b\n", at=2)
    assert path.read_bytes() == b"a\nb\n"
    real_write = os.write

    def half_then_full(fd, data):
        if len(data) > 2:
            return real_write(fd, bytes(data[:2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk.os, "write", half_then_full)
    with pytest.raises(DiskFull):
        append_whole(path, b"ccccc\n", at=4)
    assert path.read_bytes() == b"a\nb\n"  # nothing of the failed append is left


def test_the_torn_hook_runs_with_half_the_data_written(tmp_path):
    path = tmp_path / "queue.jsonl"
    seen = []
    append_whole(path, b"0123456789", torn=lambda: seen.append(path.read_bytes()))
    assert seen == [b"01234"] and path.read_bytes() == b"0123456789"


def test_cut_drops_the_tail(tmp_path):
    path = tmp_path / "q"
    path.write_bytes(b"abcdef")
    cut(path, 2)
    assert path.read_bytes() == b"ab"


def test_publish_dir_publishes_whole_keeps_an_earlier_publisher_and_nothing_on_an_error(tmp_path):
    root = tmp_path / "cache" / "abc"
    with publish_dir(root) as d:
        (d / "task").mkdir()
        (d / "task" / "f.txt").write_text("1")
        assert not root.exists()  # filled beside, not in place
    assert (root / "task" / "f.txt").read_text() == "1"
    with publish_dir(root) as d:  # the same content published again (e.g. two processes): the first one is kept
        (d / "task").mkdir()
        (d / "task" / "f.txt").write_text("1")
    assert (root / "task" / "f.txt").read_text() == "1"
    other = tmp_path / "cache" / "def"
    with pytest.raises(ValueError):
        with publish_dir(other) as d:
            (d / "x").write_text("partial")
            raise ValueError("line 3 is not JSON")
    assert not other.exists() and sorted(p.name for p in root.parent.iterdir()) == ["abc"]
