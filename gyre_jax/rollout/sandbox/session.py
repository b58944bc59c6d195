"""Environment sessions of the bwrap backend: one long-lived sandbox per execution in a task's built environment,
into which its harness and then its verifier are launched, as Harbor runs both in one container.

A session starts with the execution's first launch (``Sessions.prepare``): a private mount namespace mounts the
layers (``environment.mount_argv``: the task's layers over the host's root, the execution's own writable upper
layer on top) and execs bwrap with the merged tree as ``/`` (writable), its own ``/proc``, ``/dev``, ``/run``,
PID / IPC / UTS namespaces, the host network or its own (``EnvLaunch.internet``), the hidden paths covered, the
session's fixed mounts, and a keeper (``sleep``) as its command. Each launch is then
``nsenter`` into the keeper's namespaces and root, ``setpriv`` limited to Docker's default capabilities (no
``CAP_SYS_ADMIN``: mounts cannot be changed, hidden paths stay hidden), without the executor's launch mark (so a
process the harness leaves running stays up until the session ends, as in a container). The launch whose
``EnvLaunch.end`` is set (the verifier) ends the session in its ``cleanup``: the keeper is killed, which ends every
process of the PID namespace and with it the mounts. ``close`` ends any session still running.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from gyre_jax.rollout.sandbox import limits as limits_mod
from gyre_jax.rollout.sandbox.base import (
    FORWARD_SCRIPT,
    PROXY_SOCKET_INSIDE,
    Launch,
    Prepared,
    SandboxUnavailable,
    coerced_names,
    requested_limits,
)
from gyre_jax.rollout.sandbox.environment import DOCKER_CAPS, cache_dir, mount_argv

logger = logging.getLogger(__name__)
MARK_ENV = "GYRE_EXECUTION_MARK"  # process_group's launch mark: left out inside a session (daemons stay up)
KEEPER_START_S = 30.0


@dataclass
class Session:
    """One running environment session: the keeper's process and its PID as the host sees it."""

    state: Path
    proc: subprocess.Popen
    pid: int
    internet: bool
    bridged: bool
    plan: limits_mod.LimitPlan
    thread: threading.Thread
    applied: dict = field(default_factory=dict)
    launches: int = 0


def _bwrap_view(launch: Launch, merged: Path, hide: list[Path], bridge_socket: Path | None) -> list[str]:
    env = launch.environment
    args = ["--bind", str(merged), "/", "--dev", "/dev", "--tmpfs", "/dev/shm", "--proc", "/proc",
            "--ro-bind", "/sys", "/sys", "--tmpfs", "/run"]  # fmt: skip
    covered = sorted({os.path.realpath(p) for p in [*hide, *env.hide, cache_dir()]})
    for path in covered:
        if path != "/" and (merged / path.lstrip("/")).exists():
            args += ["--tmpfs", path] if (merged / path.lstrip("/")).is_dir() else ["--ro-bind", "/dev/null", path]
    if bridge_socket is not None:
        base = os.path.realpath(sys.base_prefix)
        if env.keep_python != base:  # the forwarder runs with this interpreter: show it read-only
            args += ["--ro-bind", base, base]
        if os.path.realpath(sys.prefix) != base:
            args += ["--ro-bind", sys.prefix, sys.prefix]
        args += ["--ro-bind", str(FORWARD_SCRIPT), str(FORWARD_SCRIPT)]
        args += ["--dir", "/run/gyre", "--bind", str(bridge_socket), PROXY_SOCKET_INSIDE]
    for mount in sorted(env.mounts, key=lambda m: len(Path(m.inside).parts)):
        args += ["--bind" if mount.writable else "--ro-bind", str(mount.host), mount.inside]
    return args


def launch_env(launch: Launch) -> dict[str, str]:
    """``launch.env`` over the image's variables, with the image's PATH entries first."""
    image = dict(launch.environment.image_env)
    env = {**image, **launch.env}
    if "PATH" in image:
        own = [p for p in launch.env.get("PATH", "").split(":") if p and p not in image["PATH"].split(":")]
        env["PATH"] = ":".join([image["PATH"], *own])
    return env


class Sessions:
    """The environment sessions of one ``BwrapSandbox`` (thread-safe), keyed by ``EnvLaunch.state``."""

    def __init__(self, hide: list[Path], bridge, use_cgroups: bool) -> None:
        self.hide = hide
        self.bridge = bridge  # bridge.LazyBridge of the sandbox
        self.use_cgroups = use_cgroups
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._starting: dict[str, threading.Lock] = {}

    def prepare(self, launch: Launch) -> Prepared:
        """The argv that runs ``launch`` inside its session (started first if needed), and the record."""
        for tool in ("nsenter", "unshare", "bwrap"):
            if shutil.which(tool) is None:
                raise SandboxUnavailable(f"an environment session needs `{tool}` on PATH (util-linux / bubblewrap)")
        session = self._session(launch)
        env = launch.environment
        inner = list(launch.argv)
        if launch.network == "proxy" and session.bridged:
            forward = [sys.executable, "-I", "-S", str(FORWARD_SCRIPT), "--port", str(self.bridge.port),
                       "--socket", PROXY_SOCKET_INSIDE, *(f"--unset={n}" for n in coerced_names(launch.env))]  # fmt: skip
            inner = [*forward, "--", *inner]
        caps = ",".join(["-all", *(f"+{c}" for c in DOCKER_CAPS)])
        argv = ["nsenter", "-t", str(session.pid), "-m", "-u", "-i", "-n", "-p", "-r", "-w", "--",
                "/usr/bin/setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "--",
                "/usr/bin/env", "-C", launch.cwd, "-u", MARK_ENV, *inner]  # fmt: skip
        network = "host" if session.internet else ("proxy" if launch.network == "proxy" and session.bridged else "none")
        applied = {"backend": "bwrap", "network": network, **requested_limits(launch.limits), **session.plan.applied,
                   "environment": "session", "session_launch": session.launches}  # fmt: skip
        session.launches += 1
        cleanup = (lambda: self.end(env.state)) if env.end else (lambda: None)
        return Prepared(argv=[*session.plan.prefix, *argv], env=launch_env(launch), cwd=env.state, applied=applied,
                        cleanup=cleanup, keeps_daemons=True)  # fmt: skip

    def _session(self, launch: Launch) -> Session:
        key = str(launch.environment.state)
        with self._lock:
            if key in self._sessions:
                return self._sessions[key]
            start_lock = self._starting.setdefault(key, threading.Lock())
        with start_lock:
            with self._lock:
                if key in self._sessions:
                    return self._sessions[key]
            session = self._start(launch)
            with self._lock:
                self._sessions[key] = session
            return session

    def _start(self, launch: Launch) -> Session:
        env = launch.environment
        state = Path(env.state)
        for name in ("upper", "work", "mnt", "merged"):
            (state / name).mkdir(parents=True, exist_ok=True)
        bridged = not env.internet and self.bridge.proxy_address is not None
        socket = self.bridge.socket_path() if bridged else None
        view = _bwrap_view(launch, state / "merged", self.hide, socket)
        net = [] if env.internet else ["--unshare-net"]
        read_fd, write_fd = os.pipe()  # bwrap's --info-fd: the keeper's PID
        ready_r, ready_w = os.pipe()  # the keeper's first word: its namespaces and root are complete
        bwrap = ["bwrap", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent", *net, *view,
                 "--cap-drop", "ALL", "--info-fd", str(write_fd), "--chdir", "/", "--", "/bin/sh", "-c",
                 f"echo ready > /proc/self/fd/{ready_w}; exec sleep infinity"]  # fmt: skip
        argv = mount_argv(state / "mnt", list(env.lower), state / "upper", state / "work", state / "merged")
        plan = limits_mod.plan(launch.limits, {}, use_cgroups=self.use_cgroups)
        started: dict = {}
        ready = threading.Event()
        log = open(state / "session.log", "ab")  # noqa: SIM115 - the keeper writes into it until it ends

        def keep() -> None:  # the keeper's parent thread: bwrap's --die-with-parent follows it
            try:
                started["proc"] = subprocess.Popen([*argv, *bwrap], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                                   pass_fds=(write_fd, ready_w), start_new_session=True)  # fmt: skip
            except OSError as exc:
                started["error"] = exc
            finally:
                ready.set()
            if "proc" in started:
                started["proc"].wait()
            log.close()

        thread = threading.Thread(target=keep, name=f"gyre-env-{state.name}", daemon=True)
        thread.start()
        ready.wait()
        os.close(write_fd)
        os.close(ready_w)
        try:
            if "error" in started:
                raise SandboxUnavailable(f"environment session could not start: {started['error']}")
            pid = self._read_pid(read_fd, started["proc"], state)
            self._wait_ready(ready_r, started["proc"], state)
        finally:
            os.close(read_fd)
            os.close(ready_r)
        applied = {"layers": list(env.lower), "internet": env.internet}
        return Session(state, started["proc"], pid, env.internet, bridged, plan, thread, applied)

    @staticmethod
    def _read_pid(fd: int, proc: subprocess.Popen, state: Path) -> int:
        data, deadline = b"", time.monotonic() + KEEPER_START_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                chunk = os.read(fd, 4096)
                data += chunk
                try:
                    return int(json.loads(data)["child-pid"])
                except (ValueError, KeyError):
                    if not chunk:
                        break
            elif proc.poll() is not None:
                break
        proc.kill()
        tail = (state / "session.log").read_bytes()[-800:].decode(errors="replace").strip()
        raise SandboxUnavailable(f"environment session did not start (mounting the layers or bwrap failed): {tail}")

    @staticmethod
    def _wait_ready(fd: int, proc: subprocess.Popen, state: Path) -> None:
        """Until the keeper says it runs (bwrap tells its PID before the root is complete: nsenter waits)."""
        deadline = time.monotonic() + KEEPER_START_S
        while time.monotonic() < deadline:
            if select.select([fd], [], [], 0.2)[0]:
                if os.read(fd, 64).startswith(b"ready"):
                    return
                break
            if proc.poll() is not None:
                break
        proc.kill()
        tail = (state / "session.log").read_bytes()[-800:].decode(errors="replace").strip()
        raise SandboxUnavailable(f"environment session did not become ready: {tail}")

    def end(self, state: Path) -> None:
        """Ends the session of ``state``: every process in it is killed, its mounts go with its namespace."""
        with self._lock:
            session = self._sessions.pop(str(state), None)
        if session is None:
            return
        try:
            os.killpg(session.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            session.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            logger.warning("environment session %s did not end within 30 s of SIGKILL", state)
        session.thread.join(timeout=5)
        limits_mod.remove(session.plan.dirs)

    def close(self) -> None:
        with self._lock:
            states = list(self._sessions)
        for state in states:
            self.end(Path(state))
