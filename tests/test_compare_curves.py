"""experiments/compare_curves.py on synthetic learning-curve results (no training): each result's gains as
learning_curves.py computes them, the difference of the gains with its interval, and refusing results that are not
comparable."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent


def _module(name: str):
    sys.path.insert(0, str(REPO / "experiments"))
    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _result(directory: Path, before: float, after: float, last_step: int = 10, seeds: int = 3, n: int = 40) -> None:
    """A learning_curves.json whose seeds pass ``before`` of the evaluation executions before RL and ``after`` of
    them after ``last_step`` steps, on both splits (0/1 rewards, each seed slightly different)."""
    runs = {}
    for s in range(seeds):
        record = {"train_reward": {str(i): 0.1 * s for i in range(last_step)}, "evals": {}, "eval_rewards": {}}
        for split in ("train", "heldout"):
            for step, rate in ((0, before), (last_step, after)):
                k = int(round(rate * n)) + (s - 1) * (0 < rate < 1)  # seeds differ by one execution
                rewards = [1.0] * k + [0.0] * (n - k)
                record["evals"][f"{split}/{step}"] = float(np.mean(rewards))
                record["eval_rewards"][f"{split}/{step}"] = rewards
        runs[str(s)] = record
    directory.mkdir(parents=True)
    result = {"config": "configs/x.py", "overrides": [], "wall_s": {str(s): 600.0 * (s + 1) for s in range(seeds)},
              "runs": runs}  # fmt: skip
    (directory / "learning_curves.json").write_text(json.dumps(result))


def test_the_difference_of_two_gains_and_each_gain_as_learning_curves_computes_it(tmp_path):
    cc, lc = _module("compare_curves"), _module("learning_curves")
    _result(tmp_path / "lora", before=0.2, after=0.7)
    _result(tmp_path / "full", before=0.2, after=0.2)
    _result(tmp_path / "same", before=0.2, after=0.7)
    assert cc.main([str(tmp_path / "lora"), str(tmp_path / "full"), "--labels", "LoRA", "full",
                    "--out", str(tmp_path / "out"), "--bootstrap", "2000"]) == 0  # fmt: skip
    record = json.loads((tmp_path / "out" / "compare.json").read_text())
    runs = [cc.load(tmp_path / name)[1] for name in ("lora", "full")]
    for split in ("train", "heldout"):
        row = record["eval"][split]
        for i, rs in enumerate(runs):  # each result's own gain: the numbers of its learning_curves table
            assert row["results"][i] == json.loads(json.dumps(lc.eval_gains(rs, 2000)[split]))
        assert row["results"][0]["gain"]["mean"] == pytest.approx(0.5)
        assert row["results"][1]["gain"]["mean"] == pytest.approx(0.0)
        d = row["difference"]
        assert d["mean"] == pytest.approx(0.5) and 0.25 < d["low"] < 0.5 < d["high"] < 0.75 and d["excludes_zero"]
    table = (tmp_path / "out" / "compare.md").read_text()
    assert "| LoRA - full | | | heldout | | +0.500 [" in table and "| LoRA | 3 | 10, 20, 30 | train |" in table
    assert (tmp_path / "out" / "compare.png").stat().st_size > 0
    # a result against one with the same gains: the difference's interval holds 0
    assert cc.main([str(tmp_path / "lora"), str(tmp_path / "same"), "--out", str(tmp_path / "out2")]) == 0
    d = json.loads((tmp_path / "out2" / "compare.json").read_text())["eval"]["train"]["difference"]
    assert d["mean"] == pytest.approx(0.0) and d["low"] < 0 < d["high"] and not d["excludes_zero"]


def test_results_of_different_protocols_are_refused(tmp_path):
    cc = _module("compare_curves")
    _result(tmp_path / "ten", before=0.2, after=0.5, last_step=10)
    _result(tmp_path / "eight", before=0.2, after=0.5, last_step=8)
    with pytest.raises(SystemExit, match="after 10 RL steps, eight after 8"):
        cc.main([str(tmp_path / "ten"), str(tmp_path / "eight"), "--out", str(tmp_path / "out")])
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "learning_curves.json").write_text(json.dumps({"config": "x", "eval": {}}))
    with pytest.raises(SystemExit, match="keeps no per-seed runs"):
        cc.main([str(tmp_path / "ten"), str(tmp_path / "old")])
    with pytest.raises(SystemExit, match="does not exist"):
        cc.main([str(tmp_path / "ten"), str(tmp_path / "missing")])
