"""Timing shared by the benchmarks (``from benchmarks.timing import median_ms``, the repo root on sys.path)."""

from __future__ import annotations

import statistics
import time

import jax


def median_ms(fn, args, reps: int) -> float:
    """Median wall time in ms of ``fn(*args)`` (blocked until ready) over ``reps`` calls, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
