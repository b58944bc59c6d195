"""``benchmarks/bench_proxy.py --smoke`` runs end to end (its own process, the real engine, loop, router and proxy)
and writes a self-consistent report. Asserts structure and token counts, never wall-clock speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from timelimits import scaled

REPO = Path(__file__).resolve().parent.parent.parent


@pytest.mark.slow
def test_proxy_benchmark_smoke_run_writes_its_report(tmp_path) -> None:
    out = tmp_path / "proxy_smoke.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "benchmarks/bench_proxy.py", "--smoke", "--out", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=scaled(600))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] and [r["api"] for r in report["results"]] == ["chat", "completions", "messages", "responses"]
    tokens, repeats = report["sizes"]["tokens"], report["sizes"]["repeats"]
    for row in report["results"]:
        assert len(row["runs"]) == repeats and row["completion_tokens"] == [tokens] * repeats  # ran to the cap
        for run in row["runs"]:
            assert 0 < run["first_delta_s"] <= run["total_s"] and run["ratio"] == run["first_delta_s"] / run["total_s"]
            assert 1 <= run["text_events"] <= tokens
    assert "first/total" in proc.stdout and "no end-of-turn ids" in proc.stdout
