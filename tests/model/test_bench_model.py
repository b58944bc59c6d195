"""The model benchmark runs end to end (smoke suite on CPU, through the GPU script) and writes its JSON.
Asserts structure and self-consistency only: never wall-clock speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from timelimits import scaled

REPO = Path(__file__).resolve().parent.parent.parent


def test_gpu_script_smoke_suite_runs_on_cpu_and_writes_json(tmp_path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), JAX_PLATFORMS="cpu", PYTHON=sys.executable)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_model_bench.sh", "--smoke", "--only", "tiny_moe", "--steps", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(600),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "model_smoke.json").read_text())
    assert report["suite"] == "smoke" and report["platform"] == "cpu" and report["peak"]["flops_per_s"] > 0
    (row,) = report["results"]
    assert row["name"] == "tiny_moe" and "error" not in row
    assert row["active_params"] < row["params"]  # MoE: only top-k experts count towards the FLOPs
    tokens = row["batch"] * row["seq_len"]
    assert abs(row["tokens_per_s"] - tokens / row["step_s"]) < 1e-6 * row["tokens_per_s"]
    assert abs(row["mfu"] - row["model_flops_per_s"] / report["peak"]["flops_per_s"]) < 1e-9
    assert row["loss"] > 0
    assert "tiny_moe" in proc.stdout and "MFU" in proc.stdout  # the printed table


def test_gpu_checks_smoke_run_writes_every_decode_and_training_row(tmp_path) -> None:
    """benchmarks/gpu_checks.py (the lent GPU's decode and training-step checks) in its smoke form on this CPU."""
    out = tmp_path / "gpu_checks.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "benchmarks/gpu_checks.py", str(out), "--smoke"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=scaled(600))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert not [r for r in rows if "error" in r], rows
    decode = [r for r in rows if r["what"].startswith("decode")]
    assert sorted((r["batch"], r["decode_steps"]) for r in decode) == [(1, 1), (1, 8), (2, 1), (2, 8)]
    for r in decode:  # SMOKE: 8 new tokens per row
        assert abs(r["tokens_per_s"] - r["batch"] * 8 / r["median_s"]) < 1e-6 * r["tokens_per_s"]
    train = [r for r in rows if r["what"].startswith("train step [2, 32]")]
    assert len(train) == 2 and all(r["model_tflops_per_s"] > 0 and r["best_s"] <= r["median_s"] for r in train)
