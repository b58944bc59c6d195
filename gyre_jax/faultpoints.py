"""Named kill points for the fault suite: ``kill_point(name)`` SIGKILLs this process when told to.

``GYRE_KILL_AT=<name>:<n>[:<delay_s>]`` (read once, at the first call): the ``n``-th time (from 1) the point
``name`` is reached in this process, SIGKILL it, at once or ``delay_s`` seconds later from a background
thread (the process goes on meanwhile: e.g. ``checkpoint:2:0.05`` kills 50 ms into the second checkpoint
write). Unset (every normal run), a call costs one dict lookup. The points and where they sit:

    warm_start      each supervised warm-start step, before it runs            (build.warm_start)
    rollout         an execution's workspace is ready, its harness not started  (rollout.executor)
    record_torn     half of a TITO record's line is written and flushed         (proxy.records)
    record_write    a TITO record is durable, its HTTP response not yet sent     (proxy.records)
    queue_torn      half of a step's execution-queue entries are written         (trajectory.queue)
    pipeline        a step's executions were queued, before packing             (trajectory.pipeline)
    micro_step      a micro-step's gradients are about to be computed            (rl.micro_step)
    optimizer_step  before / after the optimizer update (hit twice per step)     (elastic.training)
    role_switch     a cell starts switching role                                 (elastic.switcher)
    results_written results/step_k.jsonl is durable, metrics/checkpoint not yet  (run)
    checkpoint      a checkpoint write starts (use a delay to land inside it)    (checkpoint)

No imports from gyre_jax: any layer may call it.
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "GYRE_KILL_AT"

_target: tuple[str, int, float] | None = None
_loaded = False
_counts: dict[str, int] = {}
_lock = threading.Lock()


def parse(spec: str) -> tuple[str, int, float] | None:
    """``"name:n[:delay_s]"`` -> ``(name, n, delay_s)``; ``""`` -> None. Raises ValueError saying the form."""
    if not spec:
        return None
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3) or not parts[0]:
            raise ValueError
        name, n, delay = parts[0], int(parts[1]), float(parts[2]) if len(parts) == 3 else 0.0
        if n < 1 or delay < 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{ENV}={spec!r}: expected <point name>:<n >= 1>[:<delay seconds >= 0>]") from None
    return name, n, delay


def _kill_now() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def armed(name: str) -> bool:
    """Whether ``GYRE_KILL_AT`` names point ``name`` (a torn-write point splits its write only then)."""
    global _target, _loaded
    if not _loaded:
        _target, _loaded = parse(os.environ.get(ENV, "")), True
    return _target is not None and _target[0] == name


def kill_point(name: str) -> None:
    """SIGKILLs this process if ``GYRE_KILL_AT`` names this point and this is its n-th visit (see module doc)."""
    if not armed(name):
        return
    _, n, delay = _target
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        hit = _counts[name] == n
    if not hit:
        return
    if delay <= 0:
        _kill_now()
    timer = threading.Timer(delay, _kill_now)
    timer.daemon = True
    timer.start()
