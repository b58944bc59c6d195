"""Sandboxed executions: how a harness or verifier process is isolated from other executions and the machine.

``config.rollout.sandbox`` names the backend: "none" (no isolation), "bwrap" (bubblewrap namespaces: a
read-only system, hidden run directory and $HOME, own PID namespace, loopback-only network with the proxy
bridged in, cgroup limits) or "docker" (a container per process from the task's Dockerfile). The executor
builds a ``Launch`` (argv, cwd and env with inside paths, mounts, network, limits), ``prepare`` turns it into
the argv/env/cwd it spawns (``Prepared``), and ``Prepared.cleanup()`` runs once the process group is gone.
Call ``check()`` once at start (it raises ``SandboxUnavailable`` with the command that fixes it) and
``close()`` at the end. docs/sandbox_backends.md has the layout and what each backend isolates.

Standard library only (no jax): the forwarder inside a sandbox is ``forward.py``, run as a plain script.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gyre_jax.rollout.sandbox.base import (
    EnvLaunch,
    Launch,
    Limits,
    Mount,
    NoneSandbox,
    Prepared,
    Sandbox,
    SandboxUnavailable,
)

SANDBOXES = ("none", "bwrap", "docker")

__all__ = [
    "SANDBOXES",
    "EnvLaunch",
    "Launch",
    "Limits",
    "Mount",
    "Prepared",
    "Sandbox",
    "SandboxUnavailable",
    "make_sandbox",
]


def make_sandbox(
    name: str,
    *,
    proxy_address: tuple[str, int] | None,
    hide: Sequence[Path] = (),
    state_dir: Path,
    visible: Sequence[str | Path] = (),
) -> Sandbox:
    """The sandbox backend ``name`` (one of SANDBOXES). ``proxy_address``: the proxy's (host, port) on the
    host (None: no proxy, e.g. an oracle check); ``hide``: host paths no sandboxed process may see (the
    run's workdir: records, other executions); ``state_dir``: a host directory for sockets and bookkeeping;
    ``visible``: host paths bwrap keeps visible, read-only, where it would show nothing (``rollout.
    sandbox_visible_paths``: a harness installed under /tmp or $HOME).
    Nothing is started here (the proxy bridge starts on the first "proxy" launch); call ``check()``."""
    if name == "none":
        return NoneSandbox()
    if name == "bwrap":
        from gyre_jax.rollout.sandbox.bwrap import BwrapSandbox

        return BwrapSandbox(proxy_address, hide, state_dir, keep=[Path(p) for p in visible])
    if name == "docker":
        from gyre_jax.rollout.sandbox.docker import DockerSandbox

        return DockerSandbox(proxy_address, hide, state_dir)
    raise ValueError(f"sandbox {name!r} is not one of {SANDBOXES}; set config.rollout.sandbox to one of them")
