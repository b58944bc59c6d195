"""The issue's end-to-end bar for real workloads: ``python -m gyre_jax.train --config configs/coding_cpu.py
--config.total_steps=2`` runs to the end: mini-swe-agent on the bundled pyrepo suite, each execution in its
own bwrap sandbox reaching the proxy through the bridge, verified by the task's hidden tests in a fresh
sandbox, recorded, scored, trained on by two GSPO steps and checkpointed."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from timelimits import scaled

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_coding_cpu_trains_two_steps_through_mini_swe_agent_in_bwrap(tmp_path):
    if shutil.which("bwrap") is None and os.geteuid() != 0:
        pytest.skip("bwrap is missing and this is not root: sudo apt-get install -y bubblewrap")
    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "gyre_jax.train", "--config", "configs/coding_cpu.py", "--config.total_steps=2",
           f"--config.workdir={workdir}"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=scaled(1200))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert f"done: 2 steps in {workdir}" in done.stdout

    results = [json.loads(line) for k in (0, 1) for line in (workdir / "results" / f"step_{k:06d}.jsonl").open()]
    assert len(results) == 2 * 2 * 2  # 2 steps x 2 tasks x group of 2
    suite = {p.name for p in (REPO / "suites" / "pyrepo").iterdir() if p.is_dir()}
    for r in results:
        assert not r["excluded"] and 0.0 <= r["reward"] <= 1.0, r  # verified by the task's own tests
        assert r["sandbox"]["backend"] == "bwrap" and r["sandbox"]["network"] == "proxy", r["sandbox"]
        exec_dir = workdir / "executions" / r["execution_id"]
        task = json.loads((exec_dir / "task.json").read_text())
        assert task["kind"] in suite and task["source"].endswith(f"suites/pyrepo/{task['kind']}")
        assert (exec_dir / "verifier" / "logs" / "verifier" / "reward.txt").is_file()
        assert (exec_dir / "harness" / "trajectory.json").is_file()  # mini-swe-agent ran to its end
        records = (workdir / "records" / f"{r['execution_id']}.jsonl").read_text().splitlines()
        assert records, f"{r['execution_id']}: mini-swe-agent made no model call through the sandbox's bridge"
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
    steps = [m for m in metrics if m.get("phase") == "train"]
    assert len(steps) == 2, steps
    for m in steps:  # a GSPO step on the executions' tokens (all rewards 0 from a random model: zero advantages)
        assert m["executions"] == 4 and m["executions_excluded_by_pipeline"] == 0, m
        assert m["micro_steps"] >= 1 and m["tokens_trained"] > 0 and math.isfinite(m["loss"]), m
    assert [m["policy_version"] for m in steps] == [1, 2]
    assert (workdir / "checkpoints" / "2").is_dir()


def test_preflight_stops_a_run_before_any_work_naming_what_to_install(tmp_path, monkeypatch):
    from gyre_jax import build
    from gyre_jax.config import load_config

    config = load_config(["--config", "configs/coding_cpu.py", f"--config.workdir={tmp_path / 'run'}"])
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(
        build.PreflightError, match=r"config.rollout.sandbox='bwrap' needs bubblewrap.*apt-get install -y bubblewrap"
    ):
        build.preflight(config)
    monkeypatch.undo()
    docker = load_config(["--config", "configs/coding_cpu.py", "--config.rollout.sandbox=docker"])
    with pytest.raises(build.PreflightError, match=r"^config.rollout.sandbox='docker' needs"):
        build.preflight(docker)  # this machine has no Docker daemon (docs/tasks.md)
    command = load_config(["--config", "configs/coding_cpu.py", "--config.rollout.harness=command",
                           "--config.rollout.harness_cmd=no-such-agent --task {task}"])  # fmt: skip
    with pytest.raises(build.PreflightError, match="no-such-agent"):
        build.preflight(command)
    assert not (tmp_path / "run").exists()
