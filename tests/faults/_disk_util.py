"""Helpers of the "disk" fault tests (harness escape, disk full, evaluator faults): a registry standing in for
the proxy, tasks, an executor on real subprocess harnesses, process checks, and a small real file system."""

from __future__ import annotations

import contextlib
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

BASE_URL = "http://127.0.0.1:1/v1"


def load(name: str):
    """Another module of tests/faults by file name (tests run with --import-mode=importlib)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    args = dict(model_name="tiny", timeout_s=10.0, max_parallel=2, temperature=1.0, max_tokens=64,
                harness_cmd=[sys.executable, "-c", harness, "{task}"], kill_grace_s=0.3, evaluator_timeout_s=5.0,
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
    deadline = time.monotonic() + within_s
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
