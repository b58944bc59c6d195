"""Helpers of the "disk" fault tests (harness escape, disk full, evaluator faults): a registry standing in for
the proxy, tasks, an executor on real subprocess harnesses, process checks, and a small real file system."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from gyre_jax.rollout.executor import Executor
from gyre_jax.rollout.tasks import ANSWER_FILE, INPUT_FILE, Task

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a benchmark loads this file by its path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timelimits import scaled  # noqa: E402  (tests/timelimits.py: hang guards scaled to the machine's load)

BASE_URL = "http://127.0.0.1:1/v1"


class FakeRegistry:
    """Hands out a key per execution; remembers opens and closes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, str]] = []

    def open_execution(self, execution_id: str) -> str:
        with self.lock:
            self.events.append(("open", execution_id))
        return f"key-{execution_id}"

    def close_execution(self, execution_id: str) -> None:
        with self.lock:
            self.events.append(("close", execution_id))


def make_task(mode: str, task_id: str = "t0", text: str = "qkzmt") -> Task:
    """A task whose instruction is the stand-in harness's mode; scored by the answer file (upper-cased input)."""
    return Task(
        task_id=task_id, kind="upper", system="", instruction=mode, files={INPUT_FILE: text},
        expected={ANSWER_FILE: text.upper()}, tools=[], max_turns=1, tool_latency_median_s=0.0, tool_latency_sigma=0.0,
    )  # fmt: skip


def make_executor(root: Path, harness: str, tag: str, **kw) -> Executor:
    """An executor running ``python -c harness {task}`` with ``FAULT_TAG=tag`` in the harness's environment."""
    args = dict(model_name="tiny", timeout_s=scaled(10.0), max_parallel=2, temperature=1.0, max_tokens=64,
                harness_cmd=[sys.executable, "-c", harness, "{task}"], kill_grace_s=0.3, evaluator_timeout_s=scaled(5.0),
                extra_env={"FAULT_TAG": tag})  # fmt: skip
    args.update(kw)
    return Executor(FakeRegistry(), BASE_URL, root, **args)


def new_tag() -> str:
    return uuid.uuid4().hex


def tagged_alive(tag: str) -> list[int]:
    """Pids of live (not zombie) processes whose environment holds ``FAULT_TAG=tag``."""
    needle, found = f"FAULT_TAG={tag}".encode(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if stat[stat.rfind(b")") + 2 :].split()[0] not in (b"Z", b"X") and needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def exists(pid: int) -> bool:
    """True while ``pid`` is in the process table at all (a zombie not yet reaped counts)."""
    return Path(f"/proc/{pid}").exists()


def wait_for(predicate, within_s: float = 5.0) -> bool:
    """Polls ``predicate`` until it holds (True) or ``within_s`` (scaled to the machine's load) passes (False)."""
    deadline = time.monotonic() + scaled(within_s)
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@contextlib.contextmanager
def small_fs(path: Path, size: str = "1m") -> Iterator[bool]:
    """A real tmpfs of ``size`` mounted on ``path`` (True), or False where mounting is refused (not root, no
    CAP_SYS_ADMIN); unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0  # fmt: skip
    )
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path) -> Path:
    """Fills the file system of directory ``path`` with one file (returned; delete it to free the space)."""
    hog = path / "hog.bin"
    fd = os.open(hog, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for n in (65536, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * n)
            except OSError:
                continue
    finally:
        os.close(fd)
    return hog


def _fd_under(fd: int, root: Path) -> bool:
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    return target.startswith(str(root) + os.sep)


class TmpfsDisk:
    """A real small tmpfs at ``root``: ``fill()`` takes all its free space, ``free()`` gives it back."""

    kind = "tmpfs"

    def __init__(self, root: Path) -> None:
        self.root = root
        self._hog: Path | None = None

    def fill(self) -> None:
        self._hog = fill(self.root)

    def free(self) -> None:
        if self._hog is not None:
            self._hog.unlink()
            self._hog = None


class InjectedDisk:
    """Where mounting is refused: while "full", ``os.write`` and ``os.fsync`` of a file under ``root`` fail with
    ENOSPC (after ``os.write`` wrote half of what it was given, as a real full disk does)."""

    kind = "inject"

    def __init__(self, root: Path, monkeypatch) -> None:
        self.root = root
        self.full = False
        real_write, real_fsync = os.write, os.fsync

        def write(fd, data):
            if self.full and _fd_under(fd, root):
                if len(data) > 1 and not getattr(self, "_half", False):
                    self._half = True
                    return real_write(fd, memoryview(data)[: len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(fd, data)

        def fsync(fd):
            if self.full and _fd_under(fd, root):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_fsync(fd)

        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "fsync", fsync)

    def fill(self) -> None:
        self.full, self._half = True, False

    def free(self) -> None:
        self.full = False


def load_path(path: Path):
    """A Python file as a module (e.g. another directory's conftest, for its helpers)."""
    name = f"_loaded_{path.parent.name}_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
