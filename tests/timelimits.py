"""Time limits that scale with how loaded this machine is right now, so no test's verdict depends on the load.

A test's wall-clock bound is one of three kinds (docs/reliability.md, "Tests under load"):

- a **hang guard** (a future's ``result(timeout=...)``, a subprocess's ``timeout=``, a polling loop's deadline, a
  harness timeout in a run whose point is not the timeout): pass it through ``scaled(base)``, ``base`` being
  generous on an idle machine;
- a bound **whose expiry changes what the test checks** (a run's harness timing out leaves a step without
  executions): make it event-driven, or a generous scaled hang guard (``run_time_limits()`` for a run's config);
- a **test of timing itself** (a harness killed at its timeout, a peer declared dead after its heartbeat): the
  limit under test stays as small as the test needs, and the margins it asserts (how soon after the limit the
  effect must show) are ``scaled``. Anything that must outlive the limit (a harness that must hang) hangs for
  ``HANG_S`` (far past any scaled limit), never for a few seconds more than the limit.

``slow_factor()`` measures the slowdown: a fixed pure-Python workload's wall time over its CPU time (how long a
runnable thread waits for a core: 1.0 on an idle machine, ~10 at a load average of 20 on 2 cores), times its CPU
time over ``REFERENCE_CPU_S`` (a slower CPU than this 2-core machine's), the 1-minute load average per core, and the
floor ``GYRE_JAX_TEST_SLOW_FACTOR`` (an environment variable CI or a user can set on a machine known to be slow),
whichever is largest, at least 1 and at most ``MAX_FACTOR``. It is measured again when the last measurement is
older than ``REMEASURE_S``, since load comes and goes during a session. tests/conftest.py puts this directory on
``sys.path``, so test modules (and worker scripts started from tests/) import it as ``timelimits``.
"""

from __future__ import annotations

import os
import threading
import time

ENV = "GYRE_JAX_TEST_SLOW_FACTOR"
REFERENCE_CPU_S = 0.045  # the workload's CPU time on the 2-core development machine (0.041 s measured there)
WORKLOAD_ITERATIONS = 1_000_000
SAMPLES = 3
REMEASURE_S = 30.0
MAX_FACTOR = 30.0  # a bound on how long a real hang takes to be reported
HANG_S = 3600  # what a process that must outlive a (scaled) time limit sleeps

_lock = threading.Lock()
_last: tuple[float, float] | None = None  # (monotonic time measured, factor)


def _workload(n: int) -> int:
    x = 0
    for i in range(n):
        x += i * i
    return x


def measure() -> dict[str, float]:
    """One measurement: the workload's ``contention`` (wall / CPU, the median of ``SAMPLES``), ``speed`` (its CPU
    time / ``REFERENCE_CPU_S``), ``load_per_core`` (1-minute load average / cores), ``floor`` (the environment
    variable, 1 if unset) and ``factor`` (what ``slow_factor`` returns)."""
    ratios, cpus = [], []
    for _ in range(SAMPLES):
        w0, c0 = time.perf_counter(), time.process_time()
        _workload(WORKLOAD_ITERATIONS // SAMPLES)
        wall, cpu = time.perf_counter() - w0, max(time.process_time() - c0, 1e-4)
        ratios.append(wall / cpu)
        cpus.append(cpu)
    contention = sorted(ratios)[len(ratios) // 2]
    speed = max(1.0, sum(cpus) / REFERENCE_CPU_S)
    try:
        load_per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        load_per_core = 0.0
    raw = os.environ.get(ENV, "")
    try:
        floor = float(raw) if raw else 1.0
    except ValueError:
        raise ValueError(f"{ENV}={raw!r} must be a number (a floor on the tests' slow factor, e.g. 3)") from None
    factor = min(MAX_FACTOR, max(1.0, floor, contention * speed, load_per_core))
    return dict(contention=contention, speed=speed, load_per_core=load_per_core, floor=floor, factor=factor)


def slow_factor() -> float:
    """How many times slower than an idle development machine this one runs now (>= 1); measured at most every
    ``REMEASURE_S`` seconds."""
    global _last
    with _lock:
        now = time.monotonic()
        if _last is None or now - _last[0] > REMEASURE_S:
            _last = (now, measure()["factor"])
        return _last[1]


def scaled(base_s: float) -> float:
    """``base_s`` (a bound generous on an idle machine) times the current ``slow_factor()``."""
    return float(base_s) * slow_factor()


def run_time_limits(harness_s: float = 300.0, evaluator_s: float = 120.0) -> list[str]:
    """Config overrides for a test's run whose point is not a timeout: its harnesses' and evaluators' limits
    (``rollout.timeout_s``, default 60 s; ``rollout.evaluator_timeout_s``, 30 s) as scaled hang guards, so a
    loaded machine never turns a slow execution into a timed-out one (a step without micro-batches, an eval
    without its records). Append them to the run's ``--config`` arguments (the command line or ``load_config``)."""
    f = slow_factor()
    return [
        f"--config.rollout.timeout_s={harness_s * f:.0f}",
        f"--config.rollout.evaluator_timeout_s={evaluator_s * f:.0f}",
    ]
