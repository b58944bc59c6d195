"""``benchmarks/bench_lockstep.py``'s arithmetic on measured-cost records (the format ``cost_measurements.json``
has, docs/records.md): what it pools, which samples it drops as stalls, and the ratios it reports. Nothing here is
about speed; the benchmark's runs themselves are too long for CI (about 6 minutes)."""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_lockstep", REPO / "benchmarks" / "bench_lockstep.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _measurements(decode: list[tuple[int, float]], micro: list[float], moves=()) -> dict:
    return {
        "decode_steps": [[b, 100, s] for b, s in decode],
        "micro_steps": [[1e9, s] for s in micro],
        "optimizer_steps": [0.4],
        "serving_to_training": [0.002],
        "training_to_serving": [],
        "weight_syncs": [0.001],
        "session_moves": [[n, s] for n, s in moves],
    }


def test_stalls_are_dropped_like_the_simulators_calibration():
    times = [0.004] * 20 + [0.0045, 2.5]  # a 2.5 s compile among 4 ms steps
    assert bench.steady(times) == [0.004] * 20 + [0.0045]
    assert bench.steady([0.9, 0.95, 1.0]) == [0.9, 0.95, 1.0]  # under 1 s nothing is a stall
    assert bench.steady([]) == []


def test_samples_pool_runs_and_group_decode_steps_by_batch():
    a = _measurements([(8, 0.004), (8, 0.005), (1, 0.003), (8, 3.0)], [0.9, 1.1], moves=[(3, 0.2)])
    b = _measurements([(8, 0.006), (2, 0.0035)], [1.0])
    got = bench.samples([a, b])
    assert sorted(got["decode"]) == [0.003, 0.0035, 0.004, 0.005, 0.006]  # the 3 s stall left out
    assert got["decode_b8"] == [0.004, 0.005, 0.006] and got["decode_b1"] == [0.003] and got["decode_b2"] == [0.0035]
    assert got["micro_step"] == [0.9, 1.1, 1.0]
    assert got["optimizer_step"] == [0.4, 0.4] and got["to_training"] == [0.002, 0.002]
    assert got["to_serving"] == [] and got["session_move"] == [0.2]


def test_compare_reports_median_ratios_where_both_sides_have_enough_samples():
    base = {"decode": [0.004, 0.005, 0.006], "micro_step": [1.0, 1.2, 1.4], "to_serving": [0.1]}
    other = {"decode": [0.008, 0.010, 0.012, 0.020], "micro_step": [1.5, 1.5, 1.6], "to_serving": [0.3]}
    rows = bench.compare(base, other)
    assert set(rows) == {"decode", "micro_step"}  # to_serving: 1 sample a side
    assert rows["decode"]["ratio"] == pytest.approx(statistics.median(other["decode"]) / 0.005)
    assert rows["micro_step"]["baseline"]["n"] == 3 and rows["micro_step"]["measured"]["median_s"] == 1.5
    assert bench.compare(base, other, min_n=1)["to_serving"]["ratio"] == pytest.approx(3.0)
    assert "| decode | 3 | 5.00 | 4 |" in bench.table("t", "a", "b", rows)
