"""CPU and memory limits for a sandboxed process: a cgroup it joins before exec, else CPU affinity.

``plan(limits)`` creates the cgroup(s) (v2 when /sys/fs/cgroup is a cgroup2 mount, else the v1 ``memory``
and ``cpu`` controllers) as children of this process's own cgroups, so a limit only ever tightens what the
executor already has, and returns an argv prefix that joins them (``sh -c 'echo $$ > .../cgroup.procs &&
exec "$@"'``) before the sandbox starts: the sandbox and everything in it are then inside. Without a
writable cgroup, cpus fall back to CPU affinity (a wrapper calling ``os.sched_setaffinity``) and memory is
not limited. What was and was not applied is recorded (``LimitPlan.applied``). ``remove(dirs)`` deletes the
cgroups once their processes are gone.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import shlex
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre_jax.rollout.sandbox.base import Limits, coerced_names

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
CFS_PERIOD_US = 100_000
# argv: CPU list, names to unset (the interpreter's own locale coercion, see base.coerced_names), command...
_AFFINITY = """import os, sys
env = {k: v for k, v in os.environ.items() if k not in sys.argv[2].split(",")}
os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(",")])
os.execve(sys.argv[3], sys.argv[3:], env)"""
_affinity_turn = itertools.count()  # spreads affinity-limited processes over the CPUs


@dataclass
class LimitPlan:
    """``prefix``: argv to put before the sandbox's own argv; ``dirs``: cgroups to remove afterwards;
    ``applied``: {"limits": "cgroup-v1" | "cgroup-v2" | "affinity" | "cgroup-v1+affinity" | "none",
    "not_applied": [str, ...], and "cgroups" / "cpu_list" when used}."""

    prefix: list[str] = field(default_factory=list)
    dirs: list[Path] = field(default_factory=list)
    applied: dict[str, Any] = field(default_factory=dict)


def _mounts() -> list[tuple[str, Path, str, set[str]]]:
    """(root, mount point, fstype, super options) of each mount in /proc/self/mountinfo."""
    out = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if len(parts) >= 5 and len(rparts) >= 3:
            out.append((parts[3], Path(parts[4]), rparts[0], set(rparts[2].split(","))))
    return out


def _own_cgroups() -> dict[str, str]:
    """Controller name -> this process's cgroup path (``""`` -> the cgroup v2 path)."""
    own: dict[str, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return own
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            own[name] = path
    return own


def _under(mount_root: str, mount_point: Path, path: str) -> Path:
    rel = os.path.relpath(path, mount_root) if path.startswith(mount_root) else path.lstrip("/")
    return mount_point / ("" if rel == "." else rel)


def cgroup_parents() -> tuple[str, dict[str, Path]]:
    """("cgroup-v2", {"memory": dir, "cpu": dir}) or ("cgroup-v1", {...}) or ("none", {}): the directories
    (this process's own cgroups) under which limited cgroups are created."""
    mounts, own = _mounts(), _own_cgroups()
    for root, point, fstype, _ in mounts:
        if point == CGROUP_ROOT and fstype == "cgroup2" and "" in own:
            parent = _under(root, point, own[""])
            return "cgroup-v2", {"memory": parent, "cpu": parent}
    parents = {}
    for controller in ("memory", "cpu"):
        for root, point, fstype, options in mounts:
            if fstype == "cgroup" and controller in options and controller in own:
                parents[controller] = _under(root, point, own[controller])
                break
    return ("cgroup-v1", parents) if parents else ("none", {})


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _make_v1(parents: dict[str, Path], limits: Limits, name: str, plan: LimitPlan) -> set[str]:
    """Creates the v1 memory/cpu cgroups; returns the limits applied ("memory_mb", "cpus")."""
    done = set()
    wanted = {"memory": limits.memory_mb, "cpu": limits.cpus}
    for controller, value in wanted.items():
        key = "memory_mb" if controller == "memory" else "cpus"
        if value is None:
            continue
        if controller not in parents:
            plan.applied["not_applied"].append(f"{key}: no cgroup v1 '{controller}' controller mounted")
            continue
        path = parents[controller] / name
        try:
            path.mkdir()
            plan.dirs.append(path)
            if controller == "memory":
                limit = str(value * 1024 * 1024)
                _write(path / "memory.limit_in_bytes", limit)
                if (path / "memory.memsw.limit_in_bytes").exists():  # no swapping past the limit either
                    _write(path / "memory.memsw.limit_in_bytes", limit)
            else:
                _write(path / "cpu.cfs_period_us", str(CFS_PERIOD_US))
                _write(path / "cpu.cfs_quota_us", str(max(1000, int(value * CFS_PERIOD_US))))
        except OSError as exc:
            plan.applied["not_applied"].append(f"{key}: no writable cgroup ({path}: {exc.strerror or exc})")
            if path in plan.dirs:
                plan.dirs.remove(path)
                remove([path])
            continue
        done.add(key)
    return done


def _make_v2(parent: Path, limits: Limits, name: str, plan: LimitPlan) -> set[str]:
    """Creates one v2 cgroup with memory.max / cpu.max; returns the limits applied."""
    path = parent / name
    try:
        path.mkdir()
    except OSError as exc:
        for key in ("memory_mb", "cpus"):
            if getattr(limits, key) is not None:
                plan.applied["not_applied"].append(f"{key}: no writable cgroup ({path}: {exc.strerror or exc})")
        return set()
    plan.dirs.append(path)
    done = set()
    settings = {
        "memory_mb": ("memory", [("memory.max", lambda v: str(v * 1024 * 1024)), ("memory.swap.max", lambda v: "0")]),
        "cpus": ("cpu", [("cpu.max", lambda v: f"{max(1000, int(v * CFS_PERIOD_US))} {CFS_PERIOD_US}")]),
    }
    for key, (controller, files) in settings.items():
        value = getattr(limits, key)
        if value is None:
            continue
        try:
            if not (path / files[0][0]).exists():  # the controller is not enabled for children yet
                _write(parent / "cgroup.subtree_control", f"+{controller}")
            for filename, render in files:
                if filename == files[0][0] or (path / filename).exists():
                    _write(path / filename, render(value))
        except OSError as exc:
            plan.applied["not_applied"].append(f"{key}: cgroup v2 '{controller}' not usable ({exc.strerror or exc})")
            continue
        done.add(key)
    return done


def _affinity(cpus: float, plan: LimitPlan, unset: list[str]) -> bool:
    """Restricts to ceil(cpus) of this process's CPUs (a wrapper before exec); False when that limits nothing."""
    allowed = sorted(os.sched_getaffinity(0))
    n = max(1, math.ceil(cpus))
    if n >= len(allowed):
        plan.applied["not_applied"].append(
            f"cpus: no writable cpu cgroup, and CPU affinity cannot limit {cpus} below the {len(allowed)} CPUs here"
        )
        return False
    start = next(_affinity_turn) * n
    chosen = sorted(allowed[(start + i) % len(allowed)] for i in range(n))
    plan.prefix += [sys.executable, "-I", "-S", "-c", _AFFINITY, ",".join(map(str, chosen)), ",".join(unset)]
    plan.applied["cpu_list"] = chosen
    return True


def plan(limits: Limits, env: dict[str, str], *, use_cgroups: bool = True) -> LimitPlan:
    """Creates what ``limits`` needs (see the module docstring); the caller runs ``prefix + argv`` with the
    environment ``env`` and calls ``remove(plan.dirs)`` when the process group is gone. ``use_cgroups=False``
    skips cgroups."""
    result = LimitPlan(applied={"limits": "none", "not_applied": []})
    if limits.cpus is None and limits.memory_mb is None:
        return result
    name = f"gyre-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    kind, parents = cgroup_parents() if use_cgroups else ("none", {})
    if kind == "cgroup-v2":
        done = _make_v2(parents["memory"], limits, name, result)
    elif kind == "cgroup-v1":
        done = _make_v1(parents, limits, name, result)
    else:
        done = set()
        result.applied["not_applied"] += [f"{key}: no writable cgroup on this machine" for key in ("memory_mb", "cpus")
                                           if getattr(limits, key) is not None]  # fmt: skip
    mechanisms = []
    if done:
        mechanisms.append(kind)
        result.applied["cgroups"] = [str(d) for d in result.dirs]
        procs = " && ".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}" for d in result.dirs)
        result.prefix += ["/bin/sh", "-c", procs + ' && exec "$@"', "sh"]
    else:
        remove(result.dirs)
        result.dirs = []
    if limits.cpus is not None and "cpus" not in done and _affinity(limits.cpus, result, coerced_names(env)):
        mechanisms.append("affinity")
    result.applied["limits"] = "+".join(mechanisms) or "none"
    return result


def remove(dirs: list[Path], wait_s: float = 2.0) -> None:
    """Removes the cgroups ``dirs`` (waiting up to ``wait_s`` for exiting processes to leave); logs failures."""
    deadline = time.monotonic() + wait_s
    for path in reversed(dirs):
        while True:
            try:
                path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    logger.warning("could not remove cgroup %s: %s", path, exc)
                    break
                time.sleep(0.02)
