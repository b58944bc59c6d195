"""A harness installed outside the system paths, under bwrap, through ``python -m gyre_jax.train`` as a user runs it.

Simon Willison's ``llm`` (the ``llm`` preset, pinned by requirements-llm.txt) is installed in a virtual environment
under /tmp, which the bwrap sandbox replaces by an empty tmpfs for every execution. Without
``rollout.sandbox_visible_paths`` the run is refused at start, before any work, with one line naming the path and
the value to set; with it, the preflight runs ``llm --version`` inside the sandbox and the run's executions call
the model through the proxy from inside bwrap.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).resolve().with_name("requirements-llm.txt")
TINY = ["--config", "configs/tiny_cpu.py", "--config.total_steps=1", "--config.warm_start.steps=0",
        "--config.rollout.tasks_per_step=1", "--config.rl.group_size=2", "--config.eval.samples_per_task=0",
        "--config.metrics.progress_bar=false", "--config.model.num_layers=1", "--config.model.embed_dim=32",
        "--config.model.mlp_dim=64", "--config.model.head_dim=8", "--config.rollout.sandbox=bwrap",
        "--config.rollout.harness=llm"]  # fmt: skip


@pytest.fixture(scope="module")
def llm_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``llm`` at the pinned versions in a fresh venv under /tmp (uv: seconds)."""
    if shutil.which("bwrap") is None:
        if os.geteuid() == 0:
            pytest.fail("bwrap is not installed; CI installs it: apt-get install -y bubblewrap")
        pytest.skip("bwrap is not installed and this is not root (install: sudo apt-get install -y bubblewrap)")
    venv = tmp_path_factory.mktemp("llm") / "venv"
    assert str(venv).startswith("/tmp/"), venv  # what bwrap hides: its own empty /tmp per execution
    uv = [sys.executable, "-m", "uv"]
    for cmd in ([*uv, "venv", "-q", "--python", sys.executable, str(venv)],
                [*uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "-r", str(REQUIREMENTS)]):  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"building llm's venv failed: {cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return venv


def _train(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-m", "gyre_jax.train", *TINY, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip


@pytest.mark.slow
def test_a_harness_in_a_tmp_venv_is_refused_at_start_naming_its_path_and_runs_when_declared(llm_venv, tmp_path):
    llm = llm_venv / "bin" / "llm"
    cmd = f"--config.rollout.harness_cmd={llm} prompt -m gyre --no-log {{task.instruction}}"
    refused = _train(f"--config.workdir={tmp_path / 'refused'}", cmd)
    assert refused.returncode == 2, refused.stderr[-3000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: harness 'llm': {llm} is not visible inside the bwrap sandbox"), last
    assert f"--config.rollout.sandbox_visible_paths='(\"{llm_venv}\",)'" in last and "Traceback" not in refused.stderr
    assert not (tmp_path / "refused" / "checkpoints").exists()  # refused before any work

    workdir = tmp_path / "run"
    proc = _train(f"--config.workdir={workdir}", cmd, f"--config.rollout.sandbox_visible_paths=('{llm_venv}',)")
    assert proc.returncode == 0 and "done: 1 steps" in proc.stdout, proc.stderr[-3000:]
    results = [json.loads(x) for x in (workdir / "results" / "step_000000.jsonl").read_text().splitlines()]
    for r in results:  # llm ran inside bwrap and made its one call through the bridged proxy
        assert (r["status"], r["returncode"], r["model_calls"], r["sandbox"]["backend"]) == ("finished", 0, 1, "bwrap")
        assert r["refused_calls"] == {"context": 0, "admission": 0, "bad_request": 0}
        assert (workdir / "records" / f"{r['execution_id']}.jsonl").stat().st_size > 0
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("step 1/1")]
    assert "crashed 0  refused 0" in line, line
