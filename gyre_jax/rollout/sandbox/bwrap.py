"""The "bwrap" backend: each process in its own bubblewrap sandbox (Debian's ``bubblewrap``).

What the process sees: a read-only view of the host system (``system_binds``: every top-level entry of ``/``
bound read-only on bwrap's own root tmpfs, which is then remounted read-only), its own ``/proc``, ``/dev``,
``/tmp`` and ``/run`` (the host's daemon sockets stay out), an empty tmpfs over each ``hide`` path and over
``$HOME`` (the run's records, other executions, keys), the interpreter and this checkout bound back
read-only when they lie under a hidden path (``hide_args``), then the launch's mounts (``mount_args``). No
capabilities (``--cap-drop ALL`` as root: the system stays read-only and hidden paths hidden). Its own PID,
IPC and UTS namespaces and ``--die-with-parent``: killing the bwrap process (the executor kills the process
group) ends everything inside, daemons included. Network "none": its own network namespace (loopback
only); "proxy": the same, plus the proxy reachable at the same 127.0.0.1:PORT through
``bridge.ProxyBridge`` (host) and ``forward.py`` (inside); with ``Limits.allow_internet`` the host network
is shared instead. Limits through ``limits.plan``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from gyre_jax.rollout.sandbox import limits as limits_mod
from gyre_jax.rollout.sandbox.base import (
    FORWARD_SCRIPT,
    PROXY_SOCKET_INSIDE,
    REPO_ROOT,
    Launch,
    Mount,
    Prepared,
    SandboxUnavailable,
    coerced_names,
    host_cwd,
    requested_limits,
)
from gyre_jax.rollout.sandbox.bridge import LazyBridge
from gyre_jax.rollout.sandbox.environment import Builds
from gyre_jax.rollout.sandbox.session import Sessions

INSTALL_HINT = "apt-get install -y bubblewrap"
NAMESPACES = ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent"]
# As root, bwrap leaves the process its capabilities: CAP_SYS_ADMIN could remount the read-only system
# read-write or unmount the tmpfs over a hidden path. Without a user namespace, drop them all.
DROP_CAPS = ["--cap-drop", "ALL"]
# The sandbox's own /proc, /dev, /tmp and /run. /run holds the host's daemons' sockets (docker, dbus, ...): a
# read-only bind does not stop connect(), so it is an empty tmpfs, less the resolver files (DNS with
# allow_internet on systemd-resolved hosts, where /etc/resolv.conf links into /run/systemd/resolve).
_OWN = {"/proc": ["--proc", "/proc"], "/dev": ["--dev", "/dev"], "/tmp": ["--tmpfs", "/tmp"],
        "/run": ["--tmpfs", "/run", "--ro-bind-try", "/run/systemd/resolve", "/run/systemd/resolve"]}  # fmt: skip


# The sandbox's own empty tmpfs directories: an interpreter or checkout under one (a CI clone in /tmp) is
# bound back read-only like one under a hidden path.
_OWN_TMPFS = ("/tmp", "/run")


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def system_binds(targets: Sequence[str], directory: Path = Path("/")) -> list[str]:
    """bwrap args binding every entry of ``directory`` read-only at the same path (symlinks recreated),
    except /proc, /dev, /tmp, /run (the sandbox's own, see ``_OWN``). A directory that holds one of
    ``targets`` (inside paths the sandbox mounts on) is recreated and its entries bound one by one, so the
    mount point can be made. E.g. on a merged-/usr system the list starts
    ``["--symlink", "usr/bin", "/bin", "--ro-bind-try", "/boot", "/boot", ...]``.
    """
    args: list[str] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return args
    for name in names:
        path = directory / name
        key = str(path)
        if key in _OWN:
            args += _OWN[key]
        elif path.is_symlink():
            args += ["--symlink", os.readlink(path), key]
        elif path.is_dir() and any(_inside(t, key) and t != key for t in targets):
            args += ["--dir", key, *system_binds(targets, path)]
        else:
            args += ["--ro-bind-try", key, key]
    return args


def hide_args(hide: Sequence[Path], keep: Sequence[Path]) -> list[str]:
    """bwrap args putting an empty tmpfs over each ``hide`` path that the sandbox would otherwise see, then
    binding back read-only each ``keep`` path that lies under one or under the sandbox's own /tmp and /run
    (e.g. an interpreter under $HOME, a checkout and its venv in /tmp), then hiding again what a kept path
    brought back (a run directory inside a checkout under $HOME or /tmp)."""
    every = [p for p in sorted({os.path.realpath(p) for p in hide}) if os.path.exists(p) and p != "/"]
    hidden = [p for p in every if not any(_inside(p, own) for own in _OWN)]  # under /tmp, /run: gone already
    empty = [*hidden, *_OWN_TMPFS]  # what the sandbox shows empty: a kept path under one is bound back
    kept = [p for p in sorted({os.path.realpath(p) for p in keep})
            if os.path.exists(p) and any(_inside(p, h) and p != h for h in empty)]  # fmt: skip

    def cover(path: str) -> list[str]:
        return ["--tmpfs", path] if os.path.isdir(path) else ["--ro-bind", "/dev/null", path]

    args = [arg for path in hidden for arg in cover(path)]
    args += [arg for path in kept for arg in ("--ro-bind", path, path)]
    return args + [arg for h in every if any(_inside(h, k) for k in kept) for arg in cover(h)]


def mount_args(mounts: Sequence[Mount]) -> list[str]:
    """bwrap args for the launch's mounts, parents before nested ones."""
    args: list[str] = []
    for mount in sorted(mounts, key=lambda m: len(Path(m.inside).parts)):
        args += ["--bind" if mount.writable else "--ro-bind", str(mount.host), mount.inside]
    return args


class BwrapSandbox:
    """See the module docstring. ``keep``: host paths to show read-only even under a hidden path (besides this
    interpreter's prefixes and this checkout); ``use_cgroups=False`` forces the no-cgroup fallbacks."""

    name = "bwrap"
    maps_paths = True

    def __init__(
        self,
        proxy_address: tuple[str, int] | None,
        hide: Sequence[Path],
        state_dir: Path,
        *,
        keep: Sequence[Path] = (),
        use_cgroups: bool = True,
    ) -> None:
        self.proxy_address = proxy_address
        self.hide = [Path(p) for p in hide] + [Path.home()]
        self.keep = [Path(sys.prefix), Path(sys.base_prefix), REPO_ROOT, *(Path(p) for p in keep)]
        self.state_dir = Path(state_dir)
        self.use_cgroups = use_cgroups
        self._bridge = LazyBridge(proxy_address, self.state_dir)
        self._sessions = Sessions(self.hide, self._bridge, use_cgroups)
        self.builds = Builds()  # the task environments' layers, built on first use (environment.py)

    def check(self) -> None:
        """Raises SandboxUnavailable when bwrap is missing or cannot create the namespaces it needs."""
        exe = shutil.which("bwrap")
        if exe is None:
            raise SandboxUnavailable(
                f"config.rollout.sandbox='bwrap' needs bubblewrap: `bwrap` is not on PATH; install it: "
                f"{INSTALL_HINT} (or use sandbox='none')"
            )
        trial = [exe, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
                 "--unshare-net", *NAMESPACES, "true"]  # fmt: skip
        try:
            done = subprocess.run(trial, capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
            problem = done.stderr.strip().splitlines()[0] if done.returncode else None
        except (OSError, subprocess.TimeoutExpired) as exc:
            problem = str(exc)
        if problem is not None:
            raise SandboxUnavailable(
                f"config.rollout.sandbox='bwrap': {exe} cannot create its namespaces here: {problem or 'failed'}; "
                "allow user namespaces (sudo sysctl -w kernel.unprivileged_userns_clone=1 and "
                "sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0) or run as root, or use sandbox='none'"
            )

    def path(self, mount: Mount) -> str:
        return mount.inside

    def prepare(self, launch: Launch) -> Prepared:
        """The bwrap argv for ``launch`` (see the module docstring), limits applied, and the record. A launch in a
        task's built environment (``Launch.environment``) runs in its execution's session (``session.py``)."""
        if launch.environment is not None:
            return self._sessions.prepare(launch)
        share_host = launch.network == "proxy" and launch.limits.allow_internet
        bridged = launch.network == "proxy" and not share_host
        port = str(self._bridge.port) if bridged else None  # (raises first when there is no proxy address)
        exe = shutil.which("bwrap")
        if exe is None:
            raise SandboxUnavailable(f"`bwrap` is not on PATH; install it: {INSTALL_HINT}")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        inner = list(launch.argv)
        net = [] if share_host else ["--unshare-net"]
        extra_binds: list[str] = []
        if bridged:
            extra_binds = ["--bind", str(self._bridge.socket_path()), PROXY_SOCKET_INSIDE]
            forward = [sys.executable, "-I", "-S", str(FORWARD_SCRIPT), "--port", port, "--socket", PROXY_SOCKET_INSIDE]
            forward += [f"--unset={name}" for name in coerced_names(launch.env)]
            inner = [*forward, "--", *inner]
        targets = [m.inside for m in launch.mounts] + ([PROXY_SOCKET_INSIDE] if extra_binds else [])
        caps = DROP_CAPS if os.geteuid() == 0 else []  # unprivileged bwrap gives the process no capabilities
        view = [*system_binds(targets), *hide_args(self.hide, self.keep), *mount_args(launch.mounts), *extra_binds]
        argv = [exe, *NAMESPACES, *caps, *net, *view, "--remount-ro", "/", "--chdir", launch.cwd, "--", *inner]
        plan = limits_mod.plan(launch.limits, launch.env, use_cgroups=self.use_cgroups)
        applied = {"backend": "bwrap", "network": "host" if share_host else launch.network,
                   **requested_limits(launch.limits), **plan.applied}  # fmt: skip
        return Prepared(
            argv=[*plan.prefix, *argv],
            env=dict(launch.env),
            cwd=host_cwd(launch, self.state_dir),
            applied=applied,
            cleanup=lambda: limits_mod.remove(plan.dirs),
        )

    def close(self) -> None:
        """Ends the environment sessions still running and stops the proxy bridge (idempotent)."""
        self._sessions.close()
        self._bridge.close()
