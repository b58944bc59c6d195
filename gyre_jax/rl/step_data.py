"""What one RL step trains on: executions -> (branches, advantages, sequence weights) and their metrics.

The order is: measure staleness and drop executions over the bound; normalize advantages within each
task's group over the executions that remain (excluded and dropped ones leave their group; groups with
fewer than 2 left are skipped); then give every branch of a trained execution the weight
``1 / (executions trained * branches of its execution)``, so each execution counts once however much
it branched. Pure Python.

``score_executions`` is the first two stages (staleness, then advantages) over any execution parts that
know their trainable tokens' versions: the run calls it on each task group's TITO records as the group
completes; ``assemble_rl_step`` calls it on selected branches and adds the weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gyre_jax.rl.advantages import GroupAdvantages, group_advantages
from gyre_jax.rl.staleness import StalenessReport, VersionedTokens, measure_staleness
from gyre_jax.trajectory.branches import Branch


def _valid(reward) -> bool:
    return reward is not None and math.isfinite(reward)


@dataclass
class RLStepData:
    """Parallel per-branch lists (``branches[i]`` has ``advantages[i]`` and ``seq_weights[i]``) + metrics."""

    branches: list[Branch] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    seq_weights: list[float] = field(default_factory=list)
    execution_ids: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def score_executions(
    rewards: Mapping[str, float | None],
    groups: Mapping[str, str],
    parts_by_execution: Mapping[str, Sequence[VersionedTokens]],
    current_version: int,
    max_staleness: int | None = None,
) -> tuple[GroupAdvantages, StalenessReport]:
    """Staleness over the executions with a valid reward (``parts_by_execution``: their branches or records),
    those over ``max_staleness`` dropped; then group-normalized advantages over what remains.

    rewards: execution id -> reward (None = excluded); groups: execution id -> group (task) id."""
    scored = [e for e in groups if e in parts_by_execution and _valid(rewards.get(e))]
    report = measure_staleness({e: parts_by_execution[e] for e in scored}, current_version, max_staleness)
    return group_advantages(dict(rewards), dict(groups), dropped=report.dropped), report


def assemble_rl_step(
    rewards: Mapping[str, float | None],
    groups: Mapping[str, str],
    branches_by_execution: Mapping[str, Sequence[Branch]],
    current_version: int,
    max_staleness: int | None = None,
    normalize: bool = True,
) -> RLStepData:
    """rewards: execution id -> reward (None = excluded); groups: execution id -> group (task) id;
    branches_by_execution: the selected (J_max-capped) branches of each execution; current_version: the
    learner's policy version. ``normalize=False`` leaves out the ``1 / executions`` factor (weights
    ``1 / branches``), for a streamed step that learns the count at its end and passes it to the learner as
    ``grad_scale``.

    Metrics: ``skipped_groups``, ``group_excluded`` (no valid reward), ``stale_dropped``,
    ``staleness_mean``, ``staleness_max`` (over the executions with a valid reward, dropped ones
    included), ``executions_trained``, ``sequences``.
    """
    adv, report = score_executions(rewards, groups, branches_by_execution, current_version, max_staleness)
    per_exec = [(eid, list(branches_by_execution.get(eid, ()))) for eid in groups if eid in adv.advantages]
    per_exec = [(eid, [b for b in chosen if b.num_trainable > 0]) for eid, chosen in per_exec]
    per_exec = [(eid, chosen) for eid, chosen in per_exec if chosen]
    out = RLStepData()
    num_exec = len(per_exec)
    for eid, chosen in per_exec:
        w = 1.0 / (len(chosen) * (num_exec if normalize else 1))
        for b in chosen:
            out.branches.append(b)
            out.advantages.append(adv.advantages[eid])
            out.seq_weights.append(w)
            out.execution_ids.append(eid)
    out.metrics = {
        "skipped_groups": adv.skipped_groups,
        "group_excluded": adv.excluded,
        **report.metrics(),
        "executions_trained": num_exec,
        "sequences": len(out.branches),
    }
    return out
