"""Harness processes: each runs in its own process group, is waited for under a wall-clock limit, and its
whole group is killed when it ends (the harness itself on timeout or cancel, whatever children it left
after a normal exit). ``cancel`` kills every running group and is sticky: nothing starts afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

POLL_S = 0.05
GROUP_FILE = "harness.pgid"  # in the log directory: "<pgid> <start time>" of the running harness's group


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()[19].decode()


def kill_leftover_group(log_dir: Path) -> bool:
    """SIGKILLs the harness process group recorded in ``log_dir`` (``GROUP_FILE``) if it still runs: a harness
    whose executor was SIGKILLed keeps running otherwise, and could write into the rerun of its execution.
    A recorded leader pid now held by another process (another start time) is left alone. True if killed."""
    try:
        pgid, started = (log_dir / GROUP_FILE).read_text().split()
    except (OSError, ValueError):
        return False
    now = _start_time(int(pgid))
    if (now is not None and now != started) or not group_alive(int(pgid)):
        return False  # a pid not in use cannot be a new group's id: the group, if any, is the harness's
    try:
        os.killpg(int(pgid), signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def kill_group(pgid: int, grace_s: float, proc: subprocess.Popen | None = None) -> None:
    """SIGTERM the process group, wait up to ``grace_s`` for it to empty, then SIGKILL what is left.

    ``proc`` (the group leader, our child) is reaped while waiting, so it does not linger as a zombie.
    """
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc is not None:
            proc.poll()
        if not group_alive(pgid):
            return
        time.sleep(0.02)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. Zombies do not count: an orphan of the group (e.g. a
    sandbox's init, reparented when the sandbox exits) waits for the machine's init to reap it, which may be
    never in a container, and ``killpg(pgid, 0)`` still reports it."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True  # no /proc: trust killpg
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


class ProcessGroups:
    """The harness process groups running now (by execution id), and the sticky cancel flag."""

    def __init__(self, kill_grace_s: float):
        self.kill_grace_s = kill_grace_s
        self._lock = threading.Lock()  # cancel and start are atomic with respect to each other
        self._cancelled = threading.Event()
        self._running: dict[str, subprocess.Popen] = {}

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """SIGTERM to every running group now (``run`` then kills what is left after the grace); sticky."""
        with self._lock:
            self._cancelled.set()
            procs = list(self._running.values())
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def run(
        self,
        name: str,
        cmd: Sequence[str],
        cwd: Path,
        env: Mapping[str, str],
        log_dir: Path,
        timeout_s: float,
    ) -> tuple[str, int | None, float, bool]:
        """Runs ``cmd`` in its own process group to its end (stdout/stderr to ``log_dir/harness.*``); returns
        (status "finished" | "timeout" | "crashed", returncode, duration_s, cancelled)."""
        start = time.monotonic()
        with open(log_dir / "harness.stdout", "wb") as out, open(log_dir / "harness.stderr", "wb") as err:
            with self._lock:
                if self._cancelled.is_set():
                    return "crashed", None, 0.0, True
                try:
                    proc = subprocess.Popen(
                        cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
                    )
                except OSError as exc:
                    err.write(f"executor: failed to start harness {list(cmd)!r}: {exc}\n".encode())
                    return "crashed", None, time.monotonic() - start, False
                self._running[name] = proc
                (log_dir / GROUP_FILE).write_text(f"{proc.pid} {_start_time(proc.pid)}\n")
            try:
                timed_out = self._wait(proc, start + timeout_s)
                # Kill the whole group: on timeout/cancel the harness itself, after a normal exit
                # whatever children it left behind.
                kill_group(proc.pid, self.kill_grace_s, proc)
                returncode = proc.wait()
                duration = time.monotonic() - start
            finally:
                with self._lock:
                    self._running.pop(name, None)
        if self._cancelled.is_set() and not timed_out:
            # Cancelled while the harness ran (or in the same instant it ended): never scored.
            return "crashed", returncode, duration, True
        if timed_out:
            with open(log_dir / "harness.stderr", "ab") as err:
                err.write(f"executor: harness killed after timeout_s={timeout_s}\n".encode())
            return "timeout", returncode, duration, False
        return ("finished" if returncode == 0 else "crashed"), returncode, duration, False

    def _wait(self, proc: subprocess.Popen, deadline: float) -> bool:
        """Waits for ``proc`` to exit, for the deadline or for a cancel; True if the deadline passed."""
        while proc.poll() is None:
            if self._cancelled.is_set():
                return False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            try:
                proc.wait(timeout=min(POLL_S, remaining))
            except subprocess.TimeoutExpired:
                pass
        return False
