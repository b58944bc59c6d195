"""The run summary script reads a real metrics file layout and computes windowed means."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_summarize_run(tmp_path):
    lines = [
        {"step": -1, "phase": "warm_start", "warm_start_loss": 0.1},
        {
            "step": 0,
            "phase": "eval",
            "eval_split": "train",
            "eval_reward_mean": 0.5,
            "eval_pass_rate": 0.25,
            "eval_executions": 8,
        },
    ]
    lines += [{"step": i, "phase": "train", "reward_mean": i / 10, "pass_rate": 0.0, "step_s": 2.0} for i in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    proc = subprocess.run(
        [sys.executable, str(REPO / "experiments" / "summarize_run.py"), str(tmp_path), "--window", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4
    assert [w["steps"] for w in summary["train_windows"]] == ["1-2", "3-4"]
    assert abs(summary["train_windows"][1]["reward_mean"] - 0.25) < 1e-9
    assert summary["evals"][0]["reward_mean"] == 0.5
    assert "0.500" in proc.stdout


def test_summarize_run_without_metrics_says_what_to_pass(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "experiments" / "summarize_run.py"), str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode != 0 and "metrics.jsonl" in proc.stderr
