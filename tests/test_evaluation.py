"""``gyre_jax.evaluation``'s numbers: pass@k (the unbiased estimator), bootstrap intervals over tasks, a split's
summary with exclusions and the per-task table."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gyre_jax.evaluation import bootstrap_ci, pass_at_k, split_summary
from gyre_jax.rollout.executor import ExecutionResult


def _result(task: str, j: int, reward: float | None, kind: str | None = None, status: str = "finished"):
    return ExecutionResult(
        execution_id=f"eval-{task}-g{j}", task_id=task, group_id=f"eval-{task}", status=status, reward=reward,
        excluded=reward is None, exclusion_reason=None if reward is not None else "evaluator raised",
        returncode=0, duration_s=1.0, workspace="/tmp/x", exclusion_kind=kind,
    )  # fmt: skip


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    # 4 samples, 1 pass: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2, pass@4 = 1.
    assert pass_at_k([4], [1], 1) == {"value": 0.25, "tasks": 1}
    assert pass_at_k([4], [1], 2)["value"] == pytest.approx(0.5)
    assert pass_at_k([4], [1], 4)["value"] == pytest.approx(1.0)
    assert pass_at_k([4, 4], [0, 4], 2)["value"] == pytest.approx(0.5)
    assert pass_at_k([1, 3], [1, 0], 2) == {"value": 0.0, "tasks": 1}  # a task with fewer than k samples is left out
    assert pass_at_k([1], [1], 2) == {"value": None, "tasks": 0}
    with pytest.raises(ValueError, match="k >= 1"):
        pass_at_k([2], [1], 0)
    # Averaged over random draws, pass@k equals the chance that one of k samples drawn without replacement passes.
    rng = np.random.default_rng(0)
    draws = [rng.permutation([1, 0, 0, 1, 0, 0])[:3].max() for _ in range(20000)]
    assert pass_at_k([6], [2], 3)["value"] == pytest.approx(np.mean(draws), abs=0.01)


def test_bootstrap_interval_is_over_tasks_and_reproducible() -> None:
    groups = [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.5, 0.5]]
    lo, hi = bootstrap_ci(groups)
    assert lo <= np.mean([v for g in groups for v in g]) <= hi and 0.0 <= lo < hi <= 1.0
    assert bootstrap_ci(groups) == [lo, hi]  # a fixed seed: the same results, the same interval
    # Resampling tasks, not executions: two perfectly correlated samples per task give the interval of one.
    one = bootstrap_ci([[1.0], [0.0], [1.0], [0.0]])
    two = bootstrap_ci([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    assert one == pytest.approx(two)
    assert bootstrap_ci([[0.25, 0.75]]) is not None  # one task: over its executions
    assert bootstrap_ci([]) is None and bootstrap_ci([[], []]) is None
    assert bootstrap_ci([[1.0], [1.0]]) == [1.0, 1.0]


def test_split_summary_counts_exclusions_and_tasks() -> None:
    results = [
        _result("a", 0, 1.0), _result("a", 1, 0.5),
        _result("b", 0, None, "evaluator_timeout"), _result("b", 1, 0.0, status="timeout"),
        _result("c", 0, None, "setup_failed"), _result("c", 1, None, "evaluator_timeout"),
    ]  # fmt: skip
    s = split_summary(results, ks=(1, 2))
    assert (s["executions"], s["tasks"], s["scored"], s["excluded"], s["timeouts"]) == (6, 3, 3, 3, 1)
    assert s["pass_rate"] == pytest.approx(1 / 3) and s["reward_mean"] == pytest.approx(0.5)
    assert s["exclusions"] == {"evaluator_timeout": 2, "setup_failed": 1}
    assert s["pass_at_k"]["1"] == {"value": pytest.approx(0.25), "tasks": 2}  # a: 1/2, b: 0/1; c has none scored
    assert s["pass_at_k"]["2"] == {"value": 1.0, "tasks": 1}
    rows = {t["task_id"]: t for t in s["per_task"]}
    assert rows["a"] == {"task_id": "a", "samples": 2, "scored": 2, "passes": 1, "reward_mean": 0.75, "excluded": 0,
                         "timeouts": 0}  # fmt: skip
    assert rows["c"]["scored"] == 0 and math.isnan(rows["c"]["reward_mean"]) and rows["c"]["excluded"] == 2
    lo, hi = s["reward_mean_ci"]
    assert lo <= 0.5 <= hi
