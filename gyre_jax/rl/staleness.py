"""Staleness of trajectories: how many policy versions behind the learner their tokens were sampled.

Every trainable token carries the policy version that produced it (``TitoRecord.policy_versions`` ->
``Branch.versions``; a request in flight across a weight update has tokens of two versions). An
execution's staleness is the current policy version minus the version of its oldest trainable token,
read from anything that lists its trainable tokens' versions (``trainable_versions()``): its branches,
or its TITO records (every completion token; the run measures this way, before branch selection, so
a dropped execution never costs a pipeline pass). Executions over the drop bound (``max_staleness``,
the run's ``rl.drop_staleness``) leave their advantage group and are counted; mean and max staleness
are metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger("gyre_jax.staleness")


class VersionedTokens(Protocol):
    """A part of an execution that knows its trainable tokens' policy versions (``Branch``, ``TitoRecord``)."""

    execution_id: str

    def trainable_versions(self) -> Sequence[int]: ...


def oldest_version(parts: Sequence[VersionedTokens]) -> int | None:
    """Smallest policy version over the trainable tokens of ``parts``; None when there is no such token.

    Raises ValueError when a trainable token has no version (< 0): its staleness cannot be known."""
    oldest = None
    for part in parts:
        versions = part.trainable_versions()
        if not versions:
            continue
        low = min(versions)
        if low < 0:
            raise ValueError(f"execution {part.execution_id}: a trainable token has no policy version ({low})")
        oldest = low if oldest is None else min(oldest, low)
    return oldest


@dataclass
class StalenessReport:
    """Per-execution staleness and the executions over the bound (sorted ids)."""

    staleness: dict[str, int] = field(default_factory=dict)  # execution id -> current version - oldest token version
    dropped: list[str] = field(default_factory=list)  # over max_staleness, or of unknown version under a bound
    unknown: list[str] = field(default_factory=list)  # a trainable token without a version

    @property
    def mean(self) -> float:
        return sum(self.staleness.values()) / len(self.staleness) if self.staleness else 0.0

    @property
    def max(self) -> int:
        return max(self.staleness.values(), default=0)

    def metrics(self) -> dict[str, float]:
        """``staleness_mean`` / ``staleness_max`` over the executions measured (dropped ones included),
        ``stale_dropped``."""
        return {"staleness_mean": self.mean, "staleness_max": self.max, "stale_dropped": len(self.dropped)}


def measure_staleness(
    parts_by_execution: Mapping[str, Sequence[VersionedTokens]], current_version: int, max_staleness: int | None = None
) -> StalenessReport:
    """Staleness of each execution (over its trainable tokens, from its branches or its records; executions
    without any are not measured) and the ones to drop: staleness > ``max_staleness`` (None: no bound,
    nothing dropped), or, under a bound, a trainable token without a version."""
    if max_staleness is not None and max_staleness < 0:
        raise ValueError(f"max_staleness={max_staleness} must be >= 0 (or None for no bound)")
    report = StalenessReport()
    for eid in sorted(parts_by_execution):
        try:
            oldest = oldest_version(parts_by_execution[eid])
        except ValueError as e:
            report.unknown.append(eid)
            if max_staleness is not None:
                log.warning("%s: dropped (its staleness cannot be bounded)", e)
                report.dropped.append(eid)
            continue
        if oldest is None:
            continue
        s = current_version - oldest
        if s < 0:
            log.warning(
                "execution %s has tokens of policy version %d, newer than the learner's %d",
                eid,
                oldest,
                current_version,
            )
        report.staleness[eid] = s
        if max_staleness is not None and s > max_staleness:
            report.dropped.append(eid)
    if report.dropped:
        log.info(
            "dropped %d executions over the staleness bound %s (or of unknown version): %s",
            len(report.dropped),
            max_staleness,
            report.dropped[:8],
        )
    return report
