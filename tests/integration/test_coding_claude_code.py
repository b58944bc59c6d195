"""``python -m gyre_jax.train --config configs/coding_claude_code.py --config.total_steps=2``: the Claude Code CLI
(npm, pinned), unmodified, on the bundled pyrepo suite in bwrap sandboxes, through the proxy's Anthropic
Messages API; runs to the end with records, verifier rewards, two GSPO steps and a checkpoint. Without the CLI
on PATH the same command stops before any work with the install line."""

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

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def train(workdir: Path, path: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gyre_jax.train", "--config", "configs/coding_claude_code.py",
           "--config.total_steps=2", f"--config.workdir={workdir}", *extra]  # fmt: skip
    env = {**os.environ, "PATH": path}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=scaled(1500), env=env)


def test_without_the_cli_the_run_stops_at_start_naming_the_install_command(tmp_path):
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "claude").exists())
    done = train(tmp_path / "run", path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "npm install -g @anthropic-ai/claude-code@2.1.332" in done.stderr
    assert not (tmp_path / "run" / "executions").exists()  # nothing started


def test_coding_claude_code_trains_two_steps(tmp_path, npm_bins):
    if shutil.which("bwrap") is None and os.geteuid() != 0:
        pytest.skip("bwrap is missing and this is not root: sudo apt-get install -y bubblewrap")
    workdir = tmp_path / "run"
    path = f"{npm_bins['claude'].parent}{os.pathsep}{os.environ['PATH']}"
    done = train(workdir, path, "--config.eval.samples_per_task=0")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert f"done: 2 steps in {workdir}" in done.stdout
    results = [json.loads(line) for k in (0, 1) for line in (workdir / "results" / f"step_{k:06d}.jsonl").open()]
    assert len(results) == 8
    for r in results:
        assert not r["excluded"] and 0.0 <= r["reward"] <= 1.0, r
        assert r["sandbox"]["backend"] == "bwrap" and r["sandbox"]["network"] == "proxy"
        records = [json.loads(x) for x in (workdir / "records" / f"{r['execution_id']}.jsonl").open()]
        assert records and all(x["api"] == "messages" for x in records), r["execution_id"]
        stdout = (workdir / "executions" / r["execution_id"] / "harness.stdout").read_text()
        events = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
        assert events and events[-1]["type"] == "result", stdout[-2000:]  # Claude Code reached its own end
    steps = [m for m in map(json.loads, (workdir / "metrics.jsonl").open()) if m.get("phase") == "train"]
    assert [m["policy_version"] for m in steps] == [1, 2]
    assert all(m["micro_steps"] >= 1 and m["tokens_trained"] > 0 and math.isfinite(m["loss"]) for m in steps)
    assert (workdir / "checkpoints" / "2").is_dir()
