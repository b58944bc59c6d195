"""Harness processes: each runs in its own process group, is waited for under a wall-clock limit, and its
whole group is killed when it ends (the harness itself on timeout or cancel, whatever children it left
after a normal exit). ``cancel`` kills every running group and is sticky: nothing starts afterwards.

Escapes (``rollout.sandbox=none``; bwrap's PID namespace already ends with the sandbox): a harness process
that leaves its group (``setsid``, a double fork) is still found and killed. Every harness gets
``MARK_ENV=<a random token of this launch>`` in its environment, which its descendants inherit; when the
harness ends, every process whose environment holds the token is killed (SIGTERM, SIGKILL after the grace)
and reaped. The trainer is made a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``) so that orphaned
descendants are reparented to it rather than to init, and it can reap them. A process that wipes its own
environment (``env -i``) before escaping is not found: only a sandbox with its own PID namespace stops that.

A workspace over ``max_workspace_bytes`` (disk blocks used, summed over its files; checked every
``SIZE_CHECK_S``) gets its harness killed at once (status "crashed", ``killed_reason`` "workspace_full"), so a
runaway writer cannot fill the run's disk; between two checks it can still write ``SIZE_CHECK_S`` worth.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

logger = logging.getLogger(__name__)
POLL_S = 0.05
SIZE_CHECK_S = 0.5  # how often a workspace's size is measured when it has a cap
MARK_ENV = "GYRE_EXECUTION_MARK"  # in every harness's environment: a random token of its launch
PR_SET_CHILD_SUBREAPER = 36
GROUP_FILE = "harness.pgid"  # in the log directory: "<pgid> <start time>" of the running harness's group


def become_subreaper() -> bool:
    """Makes this process the reaper of its orphaned descendants (Linux only); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _read_stat(pid: int | str) -> bytes | None:
    """``/proc/<pid>/stat``, or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read()
    except OSError:
        return None


def _proc_stat(pid: str) -> tuple[bytes, int, int, int] | None:
    """(state, ppid, pgrp, session) of ``/proc/<pid>``, or None if it is gone."""
    stat = _read_stat(pid)
    if stat is None:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp session ...
    return fields[0], int(fields[1]), int(fields[2]), int(fields[3])


def marked_processes(mark: str) -> list[int]:
    """The live (not zombie) processes of one harness launch: those whose environment holds ``MARK_ENV=mark``.
    Only processes of this user (or all, as root) can be read."""
    needle = f"{MARK_ENV}={mark}".encode()
    found, me = [], os.getpid()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        stat = _proc_stat(entry)
        if stat is None or stat[0] == b"Z":
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue  # another user's process, or gone
        if needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


def sweep(mark: str, grace_s: float, exclude: int | None = None, rounds: int = 20) -> list[int]:
    """Kills every live process of the launch ``mark`` (SIGTERM, then SIGKILL after ``grace_s`` to what is
    left; again while new ones appear, up to ``rounds`` times) and reaps those that are our children, and our
    zombie children of the launch's process group or session (``exclude``: the launch's leader, whose pid is
    that group's and session's id; its ``Popen`` reaps it). Returns the pids killed."""
    killed: set[int] = set()
    sig = signal.SIGTERM
    for _ in range(rounds):
        live = marked_processes(mark)
        if not live:
            break
        for pid in live:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        killed.update(live)
        if sig == signal.SIGTERM:
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and marked_processes(mark):
                _reap(killed, exclude)
                time.sleep(0.02)
        sig = signal.SIGKILL
        _reap(killed, exclude)
    _reap(killed, exclude, within_s=max(grace_s, 1.0))
    if exclude is not None:
        _reap(set(_zombie_children(exclude)), exclude)
    return sorted(killed)


def kill_strays() -> list[int]:
    """Kills (SIGKILL) and reaps the strays of this subreaper, with everything below them: its children that are
    in a session of their own and carry no launch mark (``MARK_ENV``) in their environment. A harness or
    verifier this process started carries its mark; a process that detached from one (``setsid``, a double
    fork) was reparented here, and if it also cleared its environment (``env -i``) ``sweep`` cannot find it.
    Returns the pids killed (the strays themselves)."""
    me, my_session = os.getpid(), os.getsid(0)
    needle = f"{MARK_ENV}=".encode()
    parents: dict[int, list[int]] = {}
    strays = []
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        stat = _proc_stat(entry)
        if stat is None or stat[0] == b"Z":
            continue
        parents.setdefault(stat[1], []).append(int(entry))
        if stat[1] != me or stat[3] == my_session:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if not any(var.startswith(needle) for var in environ.split(b"\0")):
            strays.append(int(entry))
    victims, stack = [], list(strays)
    while stack:
        pid = stack.pop()
        victims.append(pid)
        stack += parents.get(pid, [])
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap(set(strays), None, within_s=1.0 if strays else 0.0)
    return strays


def _zombie_children(leader: int) -> list[int]:
    """Our zombie children in the process group or session ``leader`` (orphans of a launch, reparented to this
    subreaper after they died: their environment can no longer be read)."""
    me, found = os.getpid(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        stat = _proc_stat(entry) if entry.isdigit() else None
        if stat is not None and stat[0] == b"Z" and stat[1] == me and leader in (stat[2], stat[3]):
            found.append(int(entry))
    return found


def _reap(pids: set[int], exclude: int | None, within_s: float = 0.0) -> None:
    """``waitpid`` (no hang) on each of ``pids`` that is our child (reparented to this subreaper). With
    ``within_s`` > 0, keeps trying for up to that long while any of them still exists: a process sent SIGKILL
    a moment ago may not have died yet, and one whose parent is dying may not have been reparented to us yet
    (under load either takes a while; reaped once, it never lingers as our zombie)."""
    pending = {pid for pid in pids if pid != exclude}
    deadline = time.monotonic() + within_s
    while True:
        for pid in sorted(pending):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    pending.discard(pid)
            except ChildProcessError:
                if _read_stat(pid) is None:
                    pending.discard(pid)  # gone (someone else reaped it)
            except OSError as exc:
                if exc.errno != errno.ECHILD:
                    raise
        if not pending or time.monotonic() >= deadline:
            return
        time.sleep(0.01)


def disk_usage(root: Path, stop_at: int | None = None) -> int:
    """Bytes of disk blocks used by the files under ``root`` (links not followed); stops counting past
    ``stop_at``."""
    total, stack = 0, [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += st.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(Path(entry.path))
        except OSError:
            continue
        if stop_at is not None and total > stop_at:
            break
    return total


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22); None if it is gone."""
    stat = _read_stat(pid)
    if stat is None:
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
        stat = _proc_stat(entry) if entry.isdigit() else None
        if stat is not None and stat[2] == pgid and stat[0] != b"Z":
            return True
    return False


class Ended(NamedTuple):
    """How a harness run ended: status "finished" | "timeout" | "crashed", its exit status (None if it never
    started), seconds from spawn to exit or kill, whether a cancel ended it, and why the executor killed it
    before it exited on its own (None | "timeout" | "workspace_full")."""

    status: str
    returncode: int | None
    duration_s: float
    cancelled: bool
    killed_reason: str | None = None


class ProcessGroups:
    """The harness process groups running now (by execution id), and the sticky cancel flag."""

    def __init__(self, kill_grace_s: float, subreaper: bool = True):
        """``subreaper``: make this process the reaper of escaped descendants (reaped by ``sweep``); not for
        sandboxes with their own PID namespace, whose helper processes would otherwise linger here as zombies."""
        self.kill_grace_s = kill_grace_s
        self.subreaper = subreaper and become_subreaper()
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
        workspace: Path | None = None,
        max_workspace_bytes: int | None = None,
        keep_daemons: bool = False,
    ) -> Ended:
        """Runs ``cmd`` in its own process group to its end (stdout/stderr to ``log_dir/harness.*``), then kills
        what is left of it, escaped descendants included (module docstring); ``workspace`` is measured against
        ``max_workspace_bytes`` while it runs. ``keep_daemons``: after ``cmd`` exits on its own, what it left running
        is not killed (its sandbox ends it: ``Prepared.keeps_daemons``); a timeout, cancel or full workspace still
        kills the group."""
        start, mark = time.monotonic(), secrets.token_hex(12)
        with open(log_dir / "harness.stdout", "wb") as out, open(log_dir / "harness.stderr", "wb") as err:
            with self._lock:
                if self._cancelled.is_set():
                    return Ended("crashed", None, 0.0, True)
                try:
                    proc = subprocess.Popen(cmd, cwd=cwd, env={**env, MARK_ENV: mark}, stdin=subprocess.DEVNULL,
                                            stdout=out, stderr=err, start_new_session=True)  # fmt: skip
                except OSError as exc:
                    err.write(f"executor: failed to start harness {list(cmd)!r}: {exc}\n".encode())
                    return Ended("crashed", None, time.monotonic() - start, False)
                self._running[name] = proc
                (log_dir / GROUP_FILE).write_text(f"{proc.pid} {_start_time(proc.pid)}\n")
            try:
                limit = (workspace, max_workspace_bytes) if workspace is not None and max_workspace_bytes else None
                killed = self._wait(proc, start + timeout_s, limit)
                # Kill the whole group: on timeout/cancel the harness itself, after a normal exit whatever
                # children it left behind (unless its sandbox keeps them: ``keep_daemons``); then whatever left
                # the group.
                keep = keep_daemons and killed is None and not self._cancelled.is_set()
                if not keep:
                    kill_group(proc.pid, self.kill_grace_s, proc)
                returncode = proc.wait()
                duration = time.monotonic() - start
                escaped = [] if keep else sweep(mark, self.kill_grace_s, exclude=proc.pid)
            finally:
                with self._lock:
                    self._running.pop(name, None)
        return self._ended(killed, returncode, duration, escaped, log_dir, timeout_s, max_workspace_bytes)

    def _ended(self, killed, returncode, duration, escaped, log_dir, timeout_s, max_bytes) -> Ended:
        notes = []
        if escaped:
            logger.warning("killed %d process(es) that left their harness's process group: %s", len(escaped), escaped)
            notes.append(f"executor: killed {len(escaped)} process(es) that left the harness's process group")
        if killed == "timeout":
            notes.append(f"executor: harness killed after timeout_s={timeout_s}")
        elif killed == "workspace_full":
            notes.append(f"executor: harness killed: its workspace grew over {max_bytes} bytes")
        if notes:
            with open(log_dir / "harness.stderr", "ab") as err:
                err.write("".join(n + "\n" for n in notes).encode())
        if self._cancelled.is_set() and killed is None:
            # Cancelled while the harness ran (or in the same instant it ended): never scored.
            return Ended("crashed", returncode, duration, True)
        if killed == "timeout":
            return Ended("timeout", returncode, duration, False, killed)
        if killed is not None:
            return Ended("crashed", returncode, duration, False, killed)
        return Ended("finished" if returncode == 0 else "crashed", returncode, duration, False)

    def _wait(self, proc: subprocess.Popen, deadline: float, limit: tuple[Path, int] | None) -> str | None:
        """Waits for ``proc`` to exit, for the deadline, a cancel or its workspace to pass its size ``limit``;
        returns why it must be killed: "timeout", "workspace_full" or None (it exited, or a cancel)."""
        next_check = time.monotonic()
        while proc.poll() is None:
            if self._cancelled.is_set():
                return None
            now = time.monotonic()
            if limit is not None and now >= next_check:
                next_check = now + SIZE_CHECK_S
                if disk_usage(limit[0], stop_at=limit[1]) > limit[1]:
                    return "workspace_full"
            remaining = deadline - now
            if remaining <= 0:
                return "timeout"
            try:
                proc.wait(timeout=min(POLL_S, remaining))
            except subprocess.TimeoutExpired:
                pass
        return None
