"""Group-normalized advantages (GRPO/GSPO style) over the executions of each task."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class GroupAdvantages:
    advantages: dict[str, float]  # execution id -> advantage, only for executions that train
    skipped_groups: int  # groups with fewer than 2 valid executions
    excluded: int  # executions left out of their group (evaluator failure)


def group_advantages(
    rewards: dict[str, float | None], groups: dict[str, str], eps: float = 1e-6
) -> GroupAdvantages:
    """A_i = (r_i - mean_g) / (std_g + eps) within each group g of valid executions.

    ``rewards`` maps execution id -> reward (None = excluded: it leaves its group, which is renormalized
    over the rest); ``groups`` maps execution id -> group id. A group with fewer than 2 valid
    executions cannot be normalized: it is skipped and counted.
    """
    by_group: dict[str, list[str]] = {}
    excluded = 0
    for eid, group in groups.items():
        if rewards.get(eid) is None:
            excluded += 1
            continue
        by_group.setdefault(group, []).append(eid)
    advantages: dict[str, float] = {}
    skipped = 0
    for group in sorted(set(groups.values())):
        members = by_group.get(group, [])
        if len(members) < 2:
            skipped += 1
            continue
        r = np.asarray([rewards[e] for e in members], dtype=np.float64)
        a = (r - r.mean()) / (r.std() + eps)
        advantages.update({e: float(x) for e, x in zip(members, a)})
    return GroupAdvantages(advantages=advantages, skipped_groups=skipped, excluded=excluded)
