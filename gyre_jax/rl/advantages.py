"""Group-normalized advantages (GRPO/GSPO style) over the executions of each task."""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("gyre_jax.advantages")


@dataclass
class GroupAdvantages:
    advantages: dict[str, float]  # execution id -> advantage, only for executions that train
    skipped_groups: int  # groups with fewer than 2 valid executions
    excluded: int  # executions left out of their group (evaluator failure)
    dropped: int = 0  # executions left out of their group by the caller (e.g. too stale to train on)


def group_advantages(
    rewards: dict[str, float | None], groups: dict[str, str], eps: float = 1e-6, dropped: Collection[str] = ()
) -> GroupAdvantages:
    """A_i = (r_i - mean_g) / (std_g + eps) within each group g of valid executions.

    ``rewards`` maps execution id -> reward (None, or a non-finite value, = excluded: it leaves its
    group, which is renormalized over the rest); ``groups`` maps execution id -> group id. Executions in
    ``dropped`` (e.g. over the staleness bound) leave their group the same way but are counted in
    ``dropped``, not ``excluded``. A group with fewer than 2 valid executions cannot be normalized: it is
    skipped and counted.
    """
    by_group: dict[str, list[str]] = {}
    excluded = 0
    dropped_set = set(dropped)
    num_dropped = 0
    for eid, group in groups.items():
        reward = rewards.get(eid)
        if reward is None or not math.isfinite(reward):
            if reward is not None:
                log.warning("execution %s has a non-finite reward %r: excluded from its group", eid, reward)
            excluded += 1
            continue
        if eid in dropped_set:
            num_dropped += 1
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
    return GroupAdvantages(advantages=advantages, skipped_groups=skipped, excluded=excluded, dropped=num_dropped)
