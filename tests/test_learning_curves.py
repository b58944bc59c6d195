"""experiments/learning_curves.py on synthetic run directories (no training): its statistics, JSON and PNG."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "experiments" / "learning_curves.py"


def _module():
    spec = importlib.util.spec_from_file_location("learning_curves", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _write_run(
    workdir: Path, train: list[float], evals: dict, per_exec: dict | None = None, extra: dict | None = None
) -> None:
    """A run directory as gyre_jax.train writes it: metrics.jsonl (+ results/eval_<step>.jsonl, config.json).
    ``extra``: per-step learner metrics, {key: [value per step]}."""
    workdir.mkdir(parents=True)
    lines = [{"step": -1, "phase": "warm_start", "warm_start_loss": 0.1}]
    for (split, step), value in sorted(evals.items(), key=lambda kv: kv[0][1]):
        lines.append({"step": step, "phase": "eval", "eval_split": split, "eval_reward_mean": value})
    for s, r in enumerate(train):
        lines.append({"step": s, "phase": "train", "reward_mean": r, "pass_rate": 0.0})
        lines[-1].update({key: values[s] for key, values in (extra or {}).items()})
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (workdir / "config.json").write_text(json.dumps({"eval": {"split": "both"}}))
    if per_exec:
        (workdir / "results").mkdir()
        for step in sorted({s for _, s in per_exec}):
            rows = [
                {"execution_id": f"eval{step:06d}-{split}-{i}", "reward": r, "excluded": False, "eval_split": split}
                for (split, s), rewards in per_exec.items()
                if s == step
                for i, r in enumerate(rewards)
            ]
            (workdir / "results" / f"eval_{step:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_bootstrap_interval_of_a_mean():
    lc = _module()
    rng = np.random.default_rng(0)
    assert lc.bootstrap_mean_interval(np.full(5, 0.25), rng, 500) == (0.25, 0.25, 0.25)
    values = rng.normal(1.0, 1.0, size=400)
    mean, low, high = lc.bootstrap_mean_interval(values, rng, 4000)
    se = values.std() / np.sqrt(values.size)  # the normal-theory interval is mean +- 1.96 se
    assert mean == pytest.approx(values.mean())
    assert low == pytest.approx(mean - 1.96 * se, abs=0.3 * se) and high == pytest.approx(
        mean + 1.96 * se, abs=0.3 * se
    )


def test_load_sampler_records_the_load_average_over_a_block(monkeypatch):
    import itertools

    lc = _module()
    values = itertools.chain([1.5, 3.0, 2.5], itertools.repeat(0.5))  # what os.getloadavg()[0] reads, in order
    monkeypatch.setattr(lc.os, "getloadavg", lambda: (next(values), 0.0, 0.0))
    with lc.LoadSampler(period_s=0.01) as sampler:
        while len(sampler.samples) < 3:  # the sampling thread's first three reads
            pass
    x = sampler.samples  # then 0.5 until stopped, and once more at the end of the block
    assert x[:3] == [1.5, 3.0, 2.5] and x[3:] == [0.5] * (len(x) - 3) and len(x) >= 4
    assert sampler.summary() == {
        "start": 1.5, "end": 0.5, "mean": pytest.approx(sum(x) / len(x)), "max": 3.0, "samples": len(x),
        "cpus": lc.os.cpu_count(),
    }  # fmt: skip


def test_curves_and_gains_from_synthetic_runs(tmp_path):
    """Three seeds: training reward rising 0.2 -> 0.8, a clear gain on the training tasks and none held out."""
    lc = _module()
    rng = np.random.default_rng(1)
    runs = []
    for seed in range(3):
        train = list(np.linspace(0.2, 0.8, 10) + 0.01 * seed)
        per_exec = {
            ("train", 0): rng.uniform(0.3, 0.5, 32),
            ("train", 10): rng.uniform(0.7, 0.9, 32),
            ("heldout", 0): rng.uniform(0.0, 1.0, 32),
            ("heldout", 10): rng.uniform(0.0, 1.0, 32),
        }
        evals = {k: float(v.mean()) for k, v in per_exec.items()}
        _write_run(tmp_path / "runs" / f"seed{seed}", train, evals, per_exec)
        runs.append(lc.read_run(tmp_path / "runs" / f"seed{seed}", seed))
    curve = lc.curves(runs, n_boot=2000)
    assert curve["steps"] == list(range(10)) and curve["seeds"] == [3] * 10
    assert curve["mean"][0] == pytest.approx(0.21) and curve["mean"][-1] == pytest.approx(0.81)
    assert curve["low"][0] == pytest.approx(0.2) and curve["high"][0] == pytest.approx(0.22)
    gains = lc.eval_gains(runs, n_boot=2000)
    train, held = gains["train"], gains["heldout"]
    assert train["method"] == held["method"] == "seeds+executions"
    assert train["gain"]["excludes_zero"] and 0.3 < train["gain"]["low"] < train["gain"]["mean"] < train["gain"]["high"]
    assert not held["gain"]["excludes_zero"] and held["gain"]["low"] < 0 < held["gain"]["high"]
    assert train["gain"]["mean"] == pytest.approx(np.mean(train["gain_per_seed"]))
    # Without the per-execution results the interval is over seeds only: narrower here (3 close seeds).
    for r in runs:
        r.eval_rewards.clear()
    seeds_only = lc.eval_gains(runs, n_boot=2000)["train"]
    assert seeds_only["method"] == "seeds"
    assert seeds_only["gain"]["high"] - seeds_only["gain"]["low"] < train["gain"]["high"] - train["gain"]["low"]


def test_script_analyzes_runs_writes_json_and_png(tmp_path):
    for seed, (before, after) in enumerate([(0.4, 0.7), (0.5, 0.8), (0.45, 0.75)]):
        evals = {("train", 0): before, ("train", 4): after, ("heldout", 0): before, ("heldout", 4): before + 0.1}
        _write_run(tmp_path / "runs" / f"seed{seed}", [0.3, 0.4, 0.5, 0.6], evals)
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--analyze-only",
            "--runs-dir",
            str(tmp_path / "runs"),
            "--out",
            str(out),
            "--seeds",
            "3",
            "--bootstrap",
            "500",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads((out / "learning_curves.json").read_text())
    assert result["seeds"] == [0, 1, 2] and result["train_reward"]["mean"] == pytest.approx([0.3, 0.4, 0.5, 0.6])
    assert result["eval"]["train"]["gain"]["mean"] == pytest.approx(0.3)
    assert result["eval"]["heldout"]["gain"] == pytest.approx(
        {"mean": 0.1, "low": 0.1, "high": 0.1, "excludes_zero": True}
    )
    assert (out / "learning_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "train tasks: before 0.450  after 0.750  gain +0.300" in proc.stdout
    assert result["wall_s"] == {}  # nothing was run here, and nothing was recorded before

    # Seeds run by an earlier invocation (another session) keep the wall time, load and overrides it recorded.
    result["wall_s"] = {"0": 3000.0, "1": 3100.0, "2": 3200.0}
    result["load_avg_1min"] = {s: {"mean": 2.0, "max": 3.0, "cpus": 2} for s in ("0", "1", "2")}
    result["overrides"] = ["--config.model.lora.rank=16"]
    (out / "learning_curves.json").write_text(json.dumps(result))
    subprocess.run(proc.args, capture_output=True, text=True, check=True)
    again = json.loads((out / "learning_curves.json").read_text())
    assert again["wall_s"] == result["wall_s"] and again["load_avg_1min"] == result["load_avg_1min"]
    assert again["overrides"] == ["--config.model.lora.rank=16"]


def test_a_seed_whose_run_directory_is_gone_still_counts_from_the_earlier_result(tmp_path):
    """Seeds run in different sessions add up: the JSON keeps each seed's curves and per-execution evaluation
    rewards, so an analysis of seed 1 alone (--first-seed 1) after seed 0's directory was deleted gives the same
    two-seed result, and says where seed 0 came from."""
    for seed, (before, after) in enumerate([(0.25, 0.5), (0.5, 0.75)]):
        evals = {("train", 0): before, ("train", 2): after, ("heldout", 0): before, ("heldout", 2): after}
        per_exec = {key: [1.0] * int(v * 4) + [0.0] * (4 - int(v * 4)) for key, v in evals.items()}
        _write_run(tmp_path / "runs" / f"seed{seed}", [0.1, 0.2], evals, per_exec, {"grad_norm": [1.0, 2.0]})
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--analyze-only", "--runs-dir", str(tmp_path / "runs"), "--out", str(out),
           "--bootstrap", "300"]  # fmt: skip
    subprocess.run([*cmd, "--seeds", "2"], capture_output=True, text=True, check=True)
    both = json.loads((out / "learning_curves.json").read_text())
    assert both["seeds"] == [0, 1] and both["runs"]["0"]["eval_rewards"]["train/2"] == [1.0, 1.0, 0.0, 0.0]

    for f in sorted((tmp_path / "runs" / "seed0").rglob("*"), reverse=True):
        f.rmdir() if f.is_dir() else f.unlink()
    (tmp_path / "runs" / "seed0").rmdir()
    proc = subprocess.run([*cmd, "--first-seed", "1", "--seeds", "1"], capture_output=True, text=True, check=True)
    again = json.loads((out / "learning_curves.json").read_text())
    assert "seed 0: its run directory is not here; read from the earlier learning_curves.json" in proc.stdout
    assert "seed 1: read from" in proc.stdout
    assert again["seeds"] == [0, 1]
    for key in ("eval", "eval_curves", "train_reward", "train_metrics", "runs"):
        assert again[key] == both[key], key
    assert again["eval"]["train"]["gain"]["mean"] == pytest.approx(0.25)


def test_script_without_runs_says_what_to_do(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--analyze-only", "--runs-dir", str(tmp_path), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "run without --analyze-only first" in proc.stderr


def test_compare_losses_tabulates_each_loss_with_its_learner_curves(tmp_path):
    """experiments/compare_losses.py --analyze-only over synthetic runs of three losses: the table, the JSON the
    notebook reads (gains, reward / grad-norm / clip-fraction curves per loss) and the PNG."""
    gains = {"gspo": 0.3, "gspo_token": 0.2, "grpo": 0.1}
    for i, (loss, gain) in enumerate(gains.items()):
        for seed in range(2):
            evals = {("train", 0): 0.4, ("train", 3): 0.4 + gain, ("heldout", 0): 0.5, ("heldout", 3): 0.5}
            extra = {"grad_norm": [1.0 + i, 2.0 + i, 3.0 + i], "clip_fraction": [0.0, 0.1 * (i + 1), 0.2]}
            _write_run(tmp_path / "root" / loss / f"seed{seed}", [0.1, 0.2, 0.3 + seed * 0.1], evals, extra=extra)
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "experiments" / "compare_losses.py"), "--analyze-only", "--seeds", "2"]
    cmd += ["--runs-root", str(tmp_path / "root"), "--out", str(out), "--bootstrap", "300"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result = json.loads((out / "compare_losses.json").read_text())
    rows = {row["loss"]: row for row in result["rows"]}
    assert list(rows) == ["gspo", "gspo_token", "grpo"] and result["losses"]["grpo"][0] == "--config.rl.loss=grpo"
    for i, (loss, gain) in enumerate(gains.items()):
        row = rows[loss]
        assert row["seeds"] == [0, 1] and row["eval"]["train"]["gain"]["mean"] == pytest.approx(gain)
        assert row["eval"]["heldout"]["gain"]["mean"] == pytest.approx(0.0)
        assert row["curves"]["grad_norm"]["mean"] == pytest.approx([1.0 + i, 2.0 + i, 3.0 + i])
        assert row["curves"]["clip_fraction"]["mean"] == pytest.approx([0.0, 0.1 * (i + 1), 0.2])
        assert row["curves"]["reward_mean"]["mean"] == pytest.approx([0.1, 0.2, 0.35])
        assert row["grad_norm_last10"] == pytest.approx(2.0 + i)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("| grpo |"))
    assert "0.400 -> 0.500 (+0.100" in line and "| 0.217 | 4.000 | 0.1667 |" in line
    assert (out / "compare_losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every loss's learning_curves.json carries the learner curves too
    per_loss = json.loads((out / "grpo" / "learning_curves.json").read_text())
    assert per_loss["train_metrics"]["grad_norm"]["mean"] == pytest.approx([3.0, 4.0, 5.0])


def test_eval_curves_and_table_per_split_and_step(tmp_path):
    """Evaluations after steps 0, 2 and 4 (eval.every_steps = 2): per split, the mean over seeds at each step, and
    the markdown table's rows; the training pass rate is its own curve."""
    lc = _module()
    evals = [
        {("train", 0): 0.2, ("heldout", 0): 0.1, ("train", 2): 0.4, ("heldout", 2): 0.2, ("train", 4): 0.6},
        {("train", 0): 0.4, ("heldout", 0): 0.3, ("train", 2): 0.4, ("heldout", 2): 0.4, ("train", 4): 0.8},
    ]
    for k, ev in enumerate(evals):
        _write_run(tmp_path / f"seed{k}", [0.1, 0.2, 0.3, 0.4], ev)
    runs = [lc.read_run(tmp_path / f"seed{k}", k) for k in range(2)]
    curves = lc.eval_curves(runs, n_boot=200)
    assert curves["train"]["steps"] == [0, 2, 4] and curves["heldout"]["steps"] == [0, 2]
    assert np.allclose(curves["train"]["mean"], [0.3, 0.4, 0.7]) and np.allclose(curves["heldout"]["mean"], [0.2, 0.3])
    assert curves["train"]["seeds"] == [2, 2, 2]
    assert all(
        lo <= m <= hi for m, lo, hi in zip(curves["train"]["mean"], curves["train"]["low"], curves["train"]["high"])
    )
    rows = lc.table(curves, lc.eval_gains(runs, n_boot=200)).splitlines()
    assert rows[0] == "| after RL steps | train tasks | heldout tasks |"
    assert rows[2].startswith("| 0 | 0.300 [") and rows[4].startswith("| 4 | 0.700 [") and rows[4].endswith("|  |")
    assert any(r.startswith("| gain, train | +0.400 [") for r in rows)
    assert lc.curves(runs, n_boot=200, key="pass_rate")["mean"] == [0.0, 0.0, 0.0, 0.0]


def test_a_seeds_time_is_split_into_its_evaluations_and_rl_steps(tmp_path):
    lc = _module()
    workdir = tmp_path / "seed0"
    _write_run(workdir, [0.1, 0.2, 0.3], {("train", 0): 0.1, ("train", 3): 0.4})
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # the seconds gyre_jax.train records: each evaluation's and each RL step's
        if m["phase"] == "eval":
            m["eval_s"] = 600.0 if m["step"] == 0 else 300.0
        elif m["phase"] == "train":
            m["step_s"] = 60.0 * (m["step"] + 1)
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    run = lc.read_run(workdir, 0)
    assert run.durations == {"eval/0": 600.0, "eval/3": 300.0, "rl_step/0": 60.0, "rl_step/1": 120.0,
                             "rl_step/2": 180.0, "rl_steps": 360.0}  # fmt: skip
    again = lc.SeedRun.from_record(0, json.loads(json.dumps(run.to_record())))  # a seed kept only in the JSON
    assert again.durations == run.durations
    assert lc.time_lines([again], {0: 1290.0}) == [
        "seed 0: 21.5 min (evaluation after 0 steps 10.0 min, 3 RL steps 6.0 min, evaluation after 3 steps 5.0 min)"
    ]
    assert lc.time_lines([lc.read_run(workdir, 1)], {}) == [
        "seed 1: wall time not recorded (evaluation after 0 steps 10.0 min, 3 RL steps 6.0 min, evaluation after 3 "
        "steps 5.0 min)"
    ]
