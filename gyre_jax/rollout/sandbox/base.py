"""The sandbox contract: what one sandboxed process is (``Launch``), what the executor then runs
(``Prepared``), and the ``Sandbox`` protocol every backend implements; plus the "none" backend.

Standard library only: this module is imported by the executor and must stay light (no jax, no numpy).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

NETWORKS = ("proxy", "none")
# Where the proxy's Unix socket is bound inside a bwrap or docker sandbox (the forwarder connects to it).
PROXY_SOCKET_INSIDE = "/run/gyre/proxy.sock"
# The directory holding the gyre_jax package; forward.py is run from it as a plain script.
REPO_ROOT = Path(__file__).resolve().parents[3]
FORWARD_SCRIPT = Path(__file__).resolve().with_name("forward.py")


class SandboxUnavailable(RuntimeError):
    """The chosen sandbox cannot run on this machine; the message says what is missing and how to fix it."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of a task (task.toml ``[environment]``); None = not limited."""

    cpus: float | None = None
    memory_mb: int | None = None
    allow_internet: bool = False  # the task needs the internet: bwrap then shares the host network

    def __post_init__(self) -> None:
        if self.cpus is not None and not (
            isinstance(self.cpus, (int, float)) and not isinstance(self.cpus, bool) and math.isfinite(self.cpus)
        ):
            raise ValueError(f"Limits.cpus={self.cpus!r} must be a positive number of CPUs or None")
        if self.cpus is not None and self.cpus <= 0:
            raise ValueError(f"Limits.cpus={self.cpus!r} must be a positive number of CPUs or None")
        if self.memory_mb is not None and (
            isinstance(self.memory_mb, bool) or not isinstance(self.memory_mb, int) or self.memory_mb < 1
        ):
            raise ValueError(f"Limits.memory_mb={self.memory_mb!r} must be a positive integer (MiB) or None")


@dataclass(frozen=True)
class Mount:
    """A host file or directory made visible at ``inside`` (an absolute path in the sandbox)."""

    host: Path
    inside: str
    writable: bool = False

    def __post_init__(self) -> None:
        if not PurePosixPath(self.inside).is_absolute():
            raise ValueError(f"Mount.inside={self.inside!r} must be an absolute path (e.g. '/app')")


@dataclass(frozen=True)
class EnvLaunch:
    """A launch inside a task's built environment (``environment.py``): every launch of one execution (its harness,
    then its verifier) runs in one *session* keyed by ``state`` (the execution's environment directory: its
    writable layer ``upper``, mount points), so files and the processes the agent left stay for the verifier, as in
    Harbor's container. ``lower``: the layer dirs (highest first) over the host's root; ``mounts``: the session's
    fixed mounts (every launch's ``Launch.mounts`` must be among them); ``internet``: the session shares the host
    network (Harbor's ``allow_internet`` / ``network_mode = "public"``) or has its own (loopback, the proxy
    bridged in); ``hide``: more host paths to cover; ``end``: this launch's ``cleanup`` ends the session (the
    verifier: every process of the session is then killed)."""

    state: Path
    lower: tuple[str, ...]
    mounts: tuple[Mount, ...]
    internet: bool
    keep_python: str = ""  # a host interpreter prefix the layers already hold (the forwarder runs with it)
    image_env: tuple[tuple[str, str], ...] = ()  # the image's variables: each launch gets those it does not set,
    # and the image's PATH first on its own
    hide: tuple[str, ...] = ()
    end: bool = False


@dataclass(frozen=True)
class Launch:
    """One process to run sandboxed. ``env`` is its whole environment (nothing else is inherited);
    ``network``: "proxy" (only the run's proxy is reachable) or "none" (loopback only)."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    mounts: tuple[Mount, ...]
    network: str
    limits: Limits = Limits()
    image_context: Path | None = None  # docker only: the task's environment/ dir holding a Dockerfile
    environment: EnvLaunch | None = None  # bwrap: run inside the task's built environment (session mode)

    def __post_init__(self) -> None:
        if not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ValueError(f"Launch.argv={self.argv!r} must be a non-empty list of strings")
        if self.network not in NETWORKS:
            raise ValueError(f"Launch.network={self.network!r} must be one of {NETWORKS}")
        if not PurePosixPath(self.cwd).is_absolute():
            raise ValueError(f"Launch.cwd={self.cwd!r} must be an absolute path")
        for mount in self.mounts:
            if not Path(mount.host).exists():
                raise ValueError(f"mount source {mount.host} does not exist on the host; create it before launching")
        if self.environment is not None:
            fixed = {(str(m.host), m.inside) for m in self.environment.mounts}
            extra = [m.inside for m in self.mounts if (str(m.host), m.inside) not in fixed]
            if extra:
                raise ValueError(f"Launch.mounts {extra} are not among its environment session's mounts")


@dataclass
class Prepared:
    """What the executor hands to its process-group runner: ``Popen(argv, env=env, cwd=cwd)``; ``applied``
    is recorded in the execution's result; ``cleanup()`` is called once after the process group is gone.
    ``keeps_daemons``: what the process leaves running when it exits on its own stays up (as in a container, where
    ``docker exec`` kills nothing) until the sandbox itself ends it (an environment session's end): the runner then
    ends the group only on a timeout, a cancel or a full workspace."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    applied: dict[str, Any]
    cleanup: Callable[[], None] = field(default=lambda: None)
    keeps_daemons: bool = False


class Sandbox(Protocol):
    """A backend: "none" | "bwrap" | "docker" (see docs/sandbox_backends.md)."""

    name: str
    maps_paths: bool  # False for "none": inside paths are the host paths (Mount.inside ignored)

    def check(self) -> None: ...

    def path(self, mount: Mount) -> str: ...

    def prepare(self, launch: Launch) -> Prepared: ...

    def close(self) -> None: ...


def requested_limits(limits: Limits) -> dict[str, Any]:
    """The limits a launch asked for, as recorded in ``Prepared.applied``."""
    return {"cpus": limits.cpus, "memory_mb": limits.memory_mb, "allow_internet": limits.allow_internet}


def host_cwd(launch: Launch, default: Path) -> Path:
    """The host directory for Popen's cwd: the mount seen at ``launch.cwd``, else ``default``."""
    for mount in launch.mounts:
        if mount.inside == launch.cwd and Path(mount.host).is_dir():
            return Path(mount.host)
    return default


class NoneSandbox:
    """No isolation at all: the process runs as the executor's own child, on the host's file system and
    network, with no limits. For trusted commands and machines without bwrap or docker."""

    name = "none"
    maps_paths = False

    def check(self) -> None:
        return None

    def path(self, mount: Mount) -> str:
        return str(mount.host)

    def prepare(self, launch: Launch) -> Prepared:
        """``launch`` as is; ``launch.cwd`` is a host path here (or a mount's inside path, mapped back)."""
        cwd = host_cwd(launch, Path(launch.cwd))
        not_applied = [f"{name}: sandbox='none' applies no limits" for name in ("cpus", "memory_mb")
                       if getattr(launch.limits, name) is not None]  # fmt: skip
        applied = {"backend": "none", "network": "host", **requested_limits(launch.limits), "limits": "none"}
        applied["not_applied"] = not_applied + [f"network={launch.network!r}: sandbox='none' shares the host network"]
        return Prepared(argv=list(launch.argv), env=dict(launch.env), cwd=cwd, applied=applied)

    def close(self) -> None:
        return None


def coerced_names(env: dict[str, str]) -> list[str]:
    """Variables a Python wrapper must drop before running the real command with ``env``: Python sets
    LC_CTYPE=C.UTF-8 at start under the C locale (PEP 538; -I ignores PYTHONCOERCECLOCALE)."""
    return [] if "LC_CTYPE" in env else ["LC_CTYPE"]


def short_socket_path(state_dir: Path, name: str) -> Path:
    """``state_dir/name`` when it fits a Unix socket address (107 bytes), else a fresh short directory in
    /tmp (the caller removes it)."""
    path = Path(state_dir) / name
    if len(os.fsencode(str(path))) <= 100:
        return path
    return Path(tempfile.mkdtemp(prefix="gyre-sb-")) / name
