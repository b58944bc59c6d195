"""benchmarks/bench_trajectory.py runs end to end (smoke suite, as a script) and writes a self-consistent JSON.
Asserts structure and the benchmark's own cross-checks only: never wall-clock speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from timelimits import scaled

REPO = Path(__file__).resolve().parent.parent.parent


def test_smoke_suite_runs_and_writes_json(tmp_path) -> None:
    out = tmp_path / "trajectory_smoke.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_trajectory.py", "--suite", "smoke", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(600),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    t = report["training"]
    names = [v["name"] for v in t["variants"]]
    assert names == ["uncapped", "J=5", "J=3", "J=1", "J=5 tree", "uncapped tree"]
    assert all(t["checks"].values()), t["checks"]  # tree and plain layouts of one selection train the same thing
    by = {v["name"]: v for v in t["variants"]}
    base = by["uncapped"]
    for v in t["variants"]:
        assert abs(v["fb_tokens_vs_uncapped"] - v["fb_tokens"] / base["fb_tokens"]) < 1e-12
        assert abs(v["step_time_vs_uncapped"] - v["step_cpu_s"] / base["step_cpu_s"]) < 1e-12
        assert abs(v["step_wall_vs_uncapped"] - v["step_s"] / base["step_s"]) < 1e-12
        assert v["selected"] <= v["branches"] and v["trained_targets"] <= v["fb_tokens"] <= v["padded_tokens"]
    # Capping and sharing only ever remove work.
    assert by["J=1"]["fb_tokens"] <= by["J=3"]["fb_tokens"] <= by["J=5"]["fb_tokens"] <= base["fb_tokens"]
    assert (
        by["J=5 tree"]["fb_tokens"] <= by["J=5"]["fb_tokens"] and by["uncapped tree"]["fb_tokens"] <= base["fb_tokens"]
    )
    assert by["J=5"]["reference_vs_uncapped"] == 0.748 and by["J=1"]["reference_vs_uncapped"] == 0.414
    p = report["pipeline"]
    assert [r["executions"] for r in p["runs"]] == [4, 8]
    assert all(r["trained"] == r["executions"] and r["executions_per_s"] > 0 for r in p["runs"])
    assert p["memory_flat"] and max(r["peak_heap_vs_smallest"] for r in p["runs"]) < 1.5
    assert "uncapped tree" in proc.stdout and "memory flat: True" in proc.stdout  # the printed tables
