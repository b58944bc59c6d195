"""Evaluating a policy on a suite's splits: the one function the run's evaluations (before the first RL step, after
the last, every N) and ``python -m gyre_jax.evaluate`` both call, and the numbers reported from its results.

``run_evaluation(specs_by_split, executor, title)`` runs every split's executions at once (the executor's
parallelism), with progress (``gyre_jax.progress``: counts, rate, time left, the running reward), and returns an
``Evaluation``: each split's results in plan order. From it:

- ``metrics(split)``: the run's metrics line for a split (``phase`` "eval"; the keys of docs/records.md), with the
  95% intervals of the pass rate and mean reward;
- ``report(ks)``: the whole evaluation as JSON: per split the pass rate and mean reward with 95% intervals, a
  per-task table, pass@k for each k in ``ks``, and the exclusions by reason.

Statistics (pure functions, ``split_summary``): the scored executions are the ones not excluded (an execution an
evaluator could not score is excluded, never counted as a failure); a pass is a reward >= 1.0. Intervals are
percentile bootstraps over tasks (each resample draws tasks with replacement and keeps all their samples, since
samples of one task are correlated; 2000 resamples, a fixed seed: the same results give the same interval), over
executions when there is one task. pass@k is the unbiased estimator of Chen et al. (2021),
``1 - C(n - c, k) / C(n, k)`` for a task with n scored samples of which c pass, averaged over the tasks with
n >= k.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gyre_jax.progress import Progress
from gyre_jax.rollout.executor import ExecutionResult, ExecutionSpec, Executor

PASS_THRESHOLD = 1.0  # a reward at or above it is a pass
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


@dataclass
class Evaluation:
    """One evaluation: each split's results in the plan's order, and how long it took."""

    results: dict[str, list[ExecutionResult]]
    seconds: float

    def results_jsonl(self) -> str:
        """Every split's results, one JSON object per line with its ``eval_split`` (``results/eval_<k>.jsonl``)."""
        return "".join(
            json.dumps(dict(r.to_dict(), eval_split=split)) + "\n" for split, rs in self.results.items() for r in rs
        )

    def metrics(self, split: str) -> dict[str, Any]:
        """The split's metrics line (``eval_metrics``) with its intervals and the evaluation's wall time."""
        m = eval_metrics(self.results[split], split)
        s = split_summary(self.results[split], ks=())
        m.update(
            eval_pass_rate_ci=s["pass_rate_ci"], eval_reward_ci=s["reward_mean_ci"], eval_s=self.seconds,
            eval_exclusions=s["exclusions"],
        )  # fmt: skip
        return m

    def report(self, ks: Sequence[int] = (1,)) -> dict[str, Any]:
        """The whole evaluation as JSON (see the module docstring)."""
        return {
            "seconds": self.seconds,
            "splits": {split: split_summary(rs, ks) for split, rs in self.results.items()},
        }


def run_evaluation(
    specs_by_split: dict[str, list[ExecutionSpec]],
    executor: Executor,
    title: str,
    progress_mode: str | None = None,
) -> Evaluation:
    """Runs every split's executions at once; returns their results per split, in plan order. Progress
    (``title``): executions done of all splits, rate, time left and the running mean reward."""
    t0 = time.time()
    specs = [s for split_specs in specs_by_split.values() for s in split_specs]
    rewards: list[float] = []
    with Progress(title, total=len(specs), unit="executions", mode=progress_mode) as progress:

        def done(result: ExecutionResult) -> None:  # the executor never calls it concurrently
            if result.reward is not None:
                rewards.append(result.reward)
            excluded = progress.n + 1 - len(rewards)
            detail = f"reward {np.mean(rewards):.3f}" if rewards else ""
            progress.update(1, detail=f"{detail}  excluded {excluded}" if excluded else detail)

        results = iter(executor.run(specs, on_done=done))
    by_split = {split: [next(results) for _ in split_specs] for split, split_specs in specs_by_split.items()}
    return Evaluation(by_split, time.time() - t0)


def eval_metrics(results: list[ExecutionResult], split: str) -> dict[str, Any]:
    """One evaluation split's metrics line (``phase`` "eval"): mean reward and pass rate over the executions that
    were scored, and how many were excluded or timed out."""
    valid = [r.reward for r in results if not r.excluded]
    return {
        "phase": "eval",
        "eval_split": split,
        "eval_reward_mean": float(np.mean(valid)) if valid else float("nan"),
        "eval_pass_rate": float(np.mean([v >= PASS_THRESHOLD for v in valid])) if valid else float("nan"),
        "eval_executions": len(results),
        "eval_excluded": sum(r.excluded for r in results),
        "eval_timeouts": sum(r.status == "timeout" for r in results),
    }


# -- statistics (pure) ---------------------------------------------------------------------------------------
def split_summary(results: Sequence[ExecutionResult], ks: Sequence[int] = (1,)) -> dict[str, Any]:
    """A split's numbers: executions, scored, excluded; pass rate and mean reward of the scored ones with 95%
    intervals; pass@k for each k; exclusions by reason; one row per task (in first-seen order)."""
    by_task: dict[str, list[ExecutionResult]] = defaultdict(list)
    for r in results:
        by_task[r.task_id].append(r)
    scored = [[r.reward for r in rs if r.reward is not None] for rs in by_task.values()]
    flat = [v for vs in scored for v in vs]
    passes = [[float(v >= PASS_THRESHOLD) for v in vs] for vs in scored]
    exclusions = Counter(r.exclusion_kind or "other" for r in results if r.excluded)
    tasks = []
    for (task_id, rs), vs in zip(by_task.items(), scored):
        tasks.append({
            "task_id": task_id, "samples": len(rs), "scored": len(vs), "passes": sum(v >= PASS_THRESHOLD for v in vs),
            "reward_mean": _mean(vs), "excluded": len(rs) - len(vs), "timeouts": sum(r.status == "timeout" for r in rs),
        })  # fmt: skip
    return {
        "executions": len(results),
        "tasks": len(by_task),
        "scored": len(flat),
        "excluded": len(results) - len(flat),
        "timeouts": sum(r.status == "timeout" for r in results),
        "pass_rate": _mean([p for ps in passes for p in ps]),
        "pass_rate_ci": bootstrap_ci(passes),
        "reward_mean": _mean(flat),
        "reward_mean_ci": bootstrap_ci(scored),
        "pass_at_k": {str(k): pass_at_k([len(vs) for vs in scored], [int(sum(p)) for p in passes], k) for k in ks},
        "exclusions": dict(exclusions.most_common()),
        "per_task": tasks,
    }


def pass_at_k(n: Sequence[int], c: Sequence[int], k: int) -> dict[str, Any]:
    """pass@k over tasks with ``n[i]`` scored samples of which ``c[i]`` pass: the mean of ``1 - C(n-c, k) /
    C(n, k)`` over the tasks with n >= k (``value`` None when there is none), and how many tasks it averages."""
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got {k}")
    values = [1.0 - math.comb(ni - ci, k) / math.comb(ni, k) for ni, ci in zip(n, c) if ni >= k]
    return {"value": float(np.mean(values)) if values else None, "tasks": len(values)}


def bootstrap_ci(groups: Sequence[Sequence[float]], level: float = 0.95) -> list[float] | None:
    """The ``level`` percentile-bootstrap interval of the mean of all values, resampling ``groups`` (tasks) with
    replacement; with one group, its values. None when there are no values."""
    groups = [list(g) for g in groups if len(g)]
    if not groups:
        return None
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    if len(groups) == 1:
        values = np.asarray(groups[0], np.float64)
        draws = rng.integers(0, len(values), size=(BOOTSTRAP_RESAMPLES, len(values)))
        means = values[draws].mean(axis=1)
    else:
        sums = np.asarray([sum(g) for g in groups], np.float64)
        counts = np.asarray([len(g) for g in groups], np.float64)
        draws = rng.integers(0, len(groups), size=(BOOTSTRAP_RESAMPLES, len(groups)))
        means = sums[draws].sum(axis=1) / counts[draws].sum(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else float("nan")
