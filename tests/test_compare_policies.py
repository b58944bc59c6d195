"""experiments/compare_policies_cpu.py's multi-seed statistics on synthetic run directories (no training)."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "experiments" / "compare_policies_cpu.py"


def _module():
    spec = importlib.util.spec_from_file_location("compare_policies_cpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _write_run(workdir: Path, step_s: list[float], idle: list[float]) -> None:
    """A run directory as gyre_jax.train writes it (the files the comparison reads)."""
    workdir.mkdir(parents=True)
    lines = [{"step": -1, "phase": "warm_start", "warm_start_loss": 0.1}]
    for s, (t, f) in enumerate(zip(step_s, idle)):
        lines.append(
            {
                "step": s,
                "phase": "train",
                "step_s": t,
                "idle_fraction": f,
                "idle_fraction/cell0": f,
                "idle_fraction/cell1": f,
                "micro_steps/cell0": 2,
                "micro_steps/cell1": 1,
                "staleness_mean": 0.5,
                "reward_mean": 0.4,
            }
        )
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (workdir / "cost_measurements.json").write_text(
        json.dumps({"serving_to_training": [0.1, 0.3], "training_to_serving": [0.02], "weight_syncs": []})
    )


def test_paired_speedups_and_intervals_over_seeds(tmp_path):
    m = _module()
    rng = np.random.default_rng(0)
    runs = []
    for seed in range(3):
        base = 10.0 + 2.0 * seed  # seeds differ a lot; each policy's steps are noisy around its seed's level
        for policy, factor in (("colocated", 1.0), ("elastic", 0.5)):
            steps = [30.0] + list(base * factor * (1 + 0.05 * rng.standard_normal(8)))
            workdir = tmp_path / f"seed{seed}" / policy
            _write_run(workdir, steps, [0.4 if policy == "colocated" else 0.2] * len(steps))
            assert m.complete(workdir, 9) and not m.complete(workdir, 10)
            runs.append(m.read_policy_run(policy, seed, workdir, None))
    summary = m.summarize(runs, n_boot=2000)
    col, ela = summary["colocated"], summary["elastic"]
    # the first step (compilation) is left out; means are over seeds of each seed's mean
    assert col["step_s"]["mean"] == pytest.approx(np.mean([np.mean(r["step_s"][1:]) for r in runs[::2]]))
    assert col["step_s"]["low"] < col["step_s"]["mean"] < col["step_s"]["high"]
    # seed-to-seed spread (10, 12, 14) shows in the step-time interval ...
    assert col["step_s"]["high"] - col["step_s"]["low"] > 2.0
    # ... but not in the paired speedup: each seed's elastic steps are half its colocated ones
    sp = ela["speedup_vs_colocated"]
    assert sp["mean"] == pytest.approx(2.0, rel=0.05) and sp["low"] < 2.0 < sp["high"]
    assert sp["high"] - sp["low"] < 0.3 and all(r == pytest.approx(2.0, rel=0.12) for r in sp["per_seed"])
    assert col["speedup_vs_colocated"]["mean"] == pytest.approx(1.0)
    assert ela["idle_fraction"]["mean"] == pytest.approx(0.2) and col["idle_fraction"]["mean"] == pytest.approx(0.4)
    assert ela["serving_to_training_s"] == pytest.approx(0.2)
    text = m.table(summary)
    assert "| elastic |" in text and "2.0" in text


def test_policies_must_cover_the_same_seeds_and_runs_need_a_second_step(tmp_path):
    m = _module()
    _write_run(tmp_path / "a", [30.0, 10.0, 11.0], [0.3] * 3)
    _write_run(tmp_path / "b", [30.0, 10.0], [0.3] * 2)
    _write_run(tmp_path / "c", [30.0], [0.3])
    runs = [
        m.read_policy_run("colocated", 0, tmp_path / "a", None),
        m.read_policy_run("colocated", 1, tmp_path / "b", None),
        m.read_policy_run("elastic", 0, tmp_path / "a", None),
    ]
    with pytest.raises(SystemExit, match="policy elastic ran seeds"):
        m.summarize(runs, n_boot=100)
    with pytest.raises(SystemExit, match="needs --steps >= 2"):
        m.read_policy_run("colocated", 0, tmp_path / "c", None)
    with pytest.raises(SystemExit):
        m.main(["--steps", "1", "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit):
        m.main(["--policies", "colocated,fifo", "--out", str(tmp_path / "out")])
