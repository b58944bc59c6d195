"""``benchmarks/bench_multiprocess.py --smoke``: it runs (2 processes x 4 CPU devices) and its JSON adds up.

Nothing here is about speed: only the structure of the results and the arithmetic between the numbers
(ratios are quotients of the reported medians, MB/s is bytes / seconds, medians are the medians of the
reported samples).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from timelimits import scaled

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "bench_multiprocess.py"
# name -> (across processes?, destination devices, moves the whole params?)
VARIANTS = {
    "transfer_p2p_4to4_cross": (True, 4, True),
    "transfer_p2p_2to2_cross": (True, 2, True),
    "transfer_program_4to4_cross": (True, 4, True),
    "device_put_2to2_local": (False, 2, True),
    "transfer_p2p_4to4_cross_4B": (True, 4, False),
}

pytestmark = pytest.mark.slow


def _tiny_param_bytes() -> int:
    import jax

    from gyre_jax.model.config import TINY
    from gyre_jax.model.sharding import abstract_model

    _, abstract = abstract_model(TINY)
    return int(sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract)))


def test_smoke_run_writes_consistent_results(tmp_path):
    out = tmp_path / "multiprocess.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    limit = scaled(150)  # the benchmark's own bound on its 2 processes (a hang guard)
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--out", str(out), "--timeout", f"{limit:.0f}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=limit + scaled(50),
        check=False,
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )
    assert "| payload |" in proc.stdout and "| move |" in proc.stdout  # the markdown tables
    res = json.loads(out.read_text())
    assert res["smoke"] is True and res["processes"] == 2 and res["devices_per_process"] == 4

    # Channel round trips vs queue.Queue.
    assert set(res["channel"]) == {"small", "large"}
    for name, c in res["channel"].items():
        assert c["pickled_bytes"] > 0 and 0 < c["gzip6_bytes"] and c["gzip6_ms"] > 0
        for side in ("channel", "kv_channel", "queue"):
            s = c[side]
            assert s["n"] >= 1 and 0 < s["median_ms"] <= s["p90_ms"], (name, side, s)
        samples = c["channel_times_ms"]
        assert len(samples) == c["channel"]["n"] == c["queue"]["n"]
        assert c["channel"]["median_ms"] == pytest.approx(float(np.median(samples)), rel=1e-9)
        assert c["channel"]["p90_ms"] == pytest.approx(float(np.percentile(samples, 90)), rel=1e-9)
        assert c["median_ratio"] == pytest.approx(c["channel"]["median_ms"] / c["queue"]["median_ms"], rel=1e-9)
        assert c["p90_ratio"] == pytest.approx(c["channel"]["p90_ms"] / c["queue"]["p90_ms"], rel=1e-9)
        assert c["kv_median_ratio"] == pytest.approx(c["kv_channel"]["median_ms"] / c["queue"]["median_ms"], rel=1e-9)
    assert 8_000 < res["channel"]["small"]["pickled_bytes"] < 20_000  # 2,000 token ids
    assert 150_000 < res["channel"]["large"]["pickled_bytes"] < 300_000  # ~200 KB of arrays

    # Weights across processes.
    w = res["weights"]
    assert w["param_bytes"] == _tiny_param_bytes()
    assert list(w["variants"]) == list(VARIANTS)
    for name, (cross, dest_devices, whole) in VARIANTS.items():
        v = w["variants"][name]
        assert v["cross_process"] is cross and v["timed_on_process"] == (1 if cross else 0)
        assert ("leader_median_s" in v) is cross and v.get("leader_median_s", 1.0) > 0
        assert v["bytes"] == (w["param_bytes"] if whole else 4)
        # every destination device holds a part or a copy of every array
        assert v["bytes"] <= v["dest_device_bytes"] <= dest_devices * v["bytes"]
        assert len(v["times_s"]) == w["repeats"]
        assert v["median_s"] == pytest.approx(float(np.median(v["times_s"])), rel=1e-9)
        assert 0 < v["median_s"] <= v["p90_s"]
        assert v["mb_per_s"] == pytest.approx(v["bytes"] / v["median_s"] / 1e6, rel=1e-9)
        base = w["variants"]["device_put_2to2_local"]["median_s"]
        assert v["median_over_device_put_2to2"] == pytest.approx(v["median_s"] / base, rel=1e-9)
    v = w["variants"]
    assert w["p2p_4to4_over_p2p_2to2"] == pytest.approx(
        v["transfer_p2p_4to4_cross"]["median_s"] / v["transfer_p2p_2to2_cross"]["median_s"], rel=1e-9
    )
    assert w["program_4to4_over_p2p_4to4"] == pytest.approx(
        v["transfer_program_4to4_cross"]["median_s"] / v["transfer_p2p_4to4_cross"]["median_s"], rel=1e-9
    )
