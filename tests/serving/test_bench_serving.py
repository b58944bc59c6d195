"""The serving benchmark runs end to end (smoke sizes, its own process) and writes its JSON and table.
Asserts structure and the token counts it reports, never wall-clock speed."""

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
def test_serving_benchmark_smoke_run_writes_its_report(tmp_path) -> None:
    out = tmp_path / "serving_smoke.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_serving.py", "--smoke", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(600),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] and report["platform"] == "cpu"
    for c in report["sizes"]["concurrency"]:
        row = report["throughput"][f"c{c}"]
        assert len(row["runs"]) == len(row["naive_runs"]) == report["sizes"]["repeats"]
        assert abs(row["vs_naive_best"] - max(row["runs"]) / max(row["naive_runs"])) < 1e-9
        assert len(row["multi_step_runs"]) == len(row["runs"])
        assert abs(row["multi_step_vs_loop_best"] - max(row["multi_step_runs"]) / max(row["runs"])) < 1e-9
        assert row["multi_step_programs"] < row["multi_step_steps"]  # programs of several steps did run
    for key in ("burst_start", "burst_start_paged"):  # the dense engine's and the paged one's
        burst = report[key]
        assert len(burst["together"]) == len(burst["one_per_call"]) == report["sizes"]["repeats"]
        assert burst["calls_together"] < burst["calls_one_per_call"] == burst["requests"]  # one call per prompt
    over = report["overhead"]
    assert abs(over["loop_vs_raw_best"] - min(over["runs_ms"]["loop"]) / min(over["runs_ms"]["raw"])) < 1e-9

    # the session numbers are token counts, exact: every turn's prompt = previous prompt + completion + new tokens
    sz, pc = report["sizes"], report["prefix_cache"]
    final = (
        sz["first_prompt"] + (sz["turns"] - 1) * (sz["turn_completion"] + sz["turn_new_tokens"]) + sz["turn_completion"]
    )
    prompts = [sz["first_prompt"] + t * (sz["turn_completion"] + sz["turn_new_tokens"]) for t in range(sz["turns"])]
    without, with_cache = pc["without_cache"], pc["with_cache"]
    assert without["final_context"] == with_cache["final_context"] == final
    assert without["prefill_tokens"] == sum(prompts)  # no cache: every turn prefills its whole prompt
    # with it: the first prompt, then per turn the new tokens and the previous completion's last token
    assert with_cache["prefill_tokens"] == sz["first_prompt"] + (sz["turns"] - 1) * (sz["turn_new_tokens"] + 1)
    assert with_cache["cache"]["hits"] == sz["turns"] - 1
    assert with_cache["prefill_over_final_context"] <= 1.2
    assert report["chunked_prefill"]["chunked"]["max_decode_pause_ms"] > 0
    assert "20-turn" not in proc.stdout and f"{sz['turns']}-turn session, with cache" in proc.stdout  # the table


def test_sampler_benchmark_smoke_run_compares_with_the_sorting_baseline(tmp_path) -> None:
    """``benchmarks/bench_sampler.py --smoke`` (in-process: one small shape): a row per setting, the baseline and
    the sampler timed in the same run, and both draw the same tokens from the same keys."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_sampler", REPO / "benchmarks" / "bench_sampler.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "sampler.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["setting"] for r in rows} == set(bench.SETTINGS)
    for r in rows:
        assert r["same_tokens"], r
        assert r["always_sorting_ms"] > 0 and r["sample_ms"] > 0 and r["speedup"] > 0
