"""A full disk: the one error every durable writer of a run raises when a write fails for lack of space.

``DiskFull`` (an ``OSError``) names the file and says what to do; ``train.main`` prints it as the run's last
line and exits 1. A writer that raises it has left nothing half-written that a reader would take as valid
(see docs/records.md: the record files and the queue are cut back to their last whole line, ``fsync_write``
replaces a file only whole, orbax finalizes a checkpoint only once it is complete).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

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


def write_whole(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` atomically and durably (a temporary file, fsynced, then renamed): a reader sees
    the old file or the whole new one. A full disk raises ``DiskFull`` (the temporary file is removed)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if is_disk_full(exc):
            raise DiskFull(path) from exc
        raise


def append_whole(path: Path, data: bytes, fsync: bool = True) -> None:
    """Appends ``data`` to ``path`` (created if missing), flushed and fsynced; all of it or nothing: on any
    write error the file is cut back to its size before, and a full disk raises ``DiskFull``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
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
