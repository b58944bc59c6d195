"""Whole-or-nothing writes, and the one error a full disk stops a run with. Every durable file the run writes
by hand goes through here (orbax writes the checkpoints; it finalizes one only once it is complete):

- ``replacing(path)`` / ``write_whole(path, data)``: a new version of a file, written beside it, fsynced, then
  renamed over it: a reader sees the old file or the whole new one (results, config.json, safetensors, ...);
- ``append_whole(path, data, at=...)``: an append that is all there or not at all: on any error the file is cut
  back (the TITO records, the execution queue, metrics);
- ``cut(path, size)``: drops a file's tail durably (the queue cut back to a saved pipeline state);
- ``publish_dir(path)``: a directory filled beside its final name, then renamed into place whole.

``DiskFull`` (an ``OSError``) names the file and says what to do; ``train.main`` prints it as the run's last
line and exits 1. A writer that raises it has left nothing half-written that a reader would take as valid
(see docs/records.md).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # no space left; quota exceeded


class DiskFull(OSError):
    """A write to ``path`` failed for lack of space; ``str(error)`` is the line to print."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        super().__init__(
            errno.ENOSPC, f"disk full writing {self.path}: free space and run the same command again to resume"
        )

    def __str__(self) -> str:
        return str(self.args[1])


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from (its cause or context chain), is a full disk."""
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, DiskFull) or (isinstance(exc, OSError) and exc.errno in FULL_ERRNOS):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


@contextmanager
def replacing(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """A file to write ``path``'s new content into (``mode`` "w" or "wb"): when the block ends it is flushed,
    fsynced and renamed over ``path``, so a reader sees the old file or the whole new one. On any error (in the
    block or in writing) the temporary file is removed and ``path`` is left as it was; a full disk raises
    ``DiskFull``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if is_disk_full(exc):
            raise DiskFull(path) from exc
        raise


def write_whole(path: str | os.PathLike, data: str | bytes) -> None:
    """Writes ``data`` to ``path`` atomically and durably (``replacing``): a reader sees the old file or the whole
    new one. A full disk raises ``DiskFull`` (the temporary file is removed)."""
    with replacing(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def append_whole(
    path: str | os.PathLike,
    data: bytes,
    fsync: bool = True,
    at: int | None = None,
    torn: Callable[[], None] | None = None,
) -> None:
    """Appends ``data`` to ``path`` (created if missing), flushed and fsynced; all of it or nothing: on any write
    error the file is cut back to its size before, and a full disk raises ``DiskFull``.

    ``at``: where the file's valid content ends; anything after it (a torn tail a crash left) is cut first, and the
    data goes there. ``torn``: the fault suite's hook, called once half of ``data`` is written (it kills the
    process there: a reader must then skip the torn tail)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if at is not None else os.O_APPEND), 0o644)
    try:
        start = os.fstat(fd).st_size if at is None else at
        try:
            if at is not None:
                os.ftruncate(fd, at)
                os.lseek(fd, at, os.SEEK_SET)
            view = memoryview(data)
            if torn is not None:
                view = _write(fd, view, len(data) // 2)
                torn()
            _write(fd, view, len(view))
            if fsync:
                os.fsync(fd)
        except OSError as exc:
            try:
                os.ftruncate(fd, start)  # a torn line is never left behind for a reader
            except OSError:
                pass
            if exc.errno in FULL_ERRNOS:
                raise DiskFull(path) from exc
            raise
    finally:
        os.close(fd)


def _write(fd: int, view: memoryview, n: int) -> memoryview:
    """Writes the first ``n`` bytes of ``view`` (a write may take less per call); returns the rest."""
    head, rest = view[:n], view[n:]
    while head:
        head = head[os.write(fd, head) :]
    return rest


def cut(path: str | os.PathLike, size: int) -> None:
    """Cuts ``path`` back to ``size`` bytes, durably (fsynced before it returns)."""
    with open(path, "r+b") as f:
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def publish_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A fresh directory beside ``path`` to fill; when the block ends it is renamed to ``path`` whole, so a reader
    never sees a partly written ``path``. If another writer published ``path`` first (same name, same content:
    e.g. a cache keyed by content), theirs is kept and this one removed. On an error nothing is published."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        yield tmp
        try:
            os.replace(tmp, path)
        except OSError:
            if not path.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # published meanwhile by another writer
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
