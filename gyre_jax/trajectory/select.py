"""Capped branch selection (J_max) and the de-duplicated assignment of training targets.

Targets are the pairs ``(tokens[t], tokens[t + 1])`` of a branch: position ``t`` predicts token
``t + 1`` from ``tokens[0..t]``. Two branches *share* target ``t`` when their first ``t + 2`` tokens
are equal (same context, same next token): it is one node of the execution's prefix tree and its
log-prob is the same number in both.

Selection, per execution (deterministic given ``rng``):

1. Candidates are visited by label priority ``main > main-summary > subagent > subagent-summary >
   auxiliary``; within a label in a seeded random order (``rng``; appearance order when ``rng`` is None).
   With ``auxiliary="exclude"`` branches of harness utility calls are never candidates.
2. A candidate is selected if it has a trainable target that no branch selected before it trains
   (policy-generated there and shared); branches that would add nothing are skipped, so they cost
   no compute. Selection stops at ``max_branches`` (J_max; None = uncapped).

De-duplication rule: a trainable target shared by several selected branches is trained exactly
once, in the *first selected* (highest-priority) branch that contains it as a policy-generated
token; its behaviour log-prob, temperature and version are taken from that branch. Branch ``j``'s
sequence (for GSPO's per-sequence ratio) is the set of targets assigned to it.

Weights: each selected branch of an execution gets ``1 / J`` of the execution's weight (J = number
selected), so the loss is averaged within each execution first; the execution weight (``1 / N``
for N executions in the optimizer step) then averages across executions.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from gyre_jax.trajectory.branches import AUXILIARY_LABEL, PRIORITY, Branch, BranchArrays, common_prefix_len


def execution_rng(seed: int, execution_id: str) -> np.random.Generator:
    """The selection RNG of one execution: a function of the run seed and the execution id only."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(execution_id.encode("utf-8"))])


@dataclass
class Selection:
    """An execution's selected branches, in selection (= assignment priority) order.

    ``arrays[j]``: branch j as arrays ([L_j]); ``assigned[j]``: [L_j - 1] bool, target ``t`` of branch
    j (token ``t + 1``) is trained in sequence j; ``lcp``: [J, J] int common-prefix lengths of the
    selected branches' tokens; ``num_branches``: branches the execution had in all.
    """

    execution_id: str
    branches: list[Branch]
    arrays: list[BranchArrays]
    assigned: list[np.ndarray]
    lcp: np.ndarray
    num_branches: int

    @property
    def num_selected(self) -> int:
        return len(self.branches)

    @property
    def branch_weights(self) -> np.ndarray:
        """[J] float: within-execution weights (uniform, summing to 1)."""
        j = len(self.branches)
        return np.full((j,), 1.0 / j if j else 0.0, np.float64)

    @property
    def num_targets(self) -> int:
        """Trainable targets after de-duplication."""
        return int(sum(a.sum() for a in self.assigned))

    def owners(self, k: int) -> np.ndarray:
        """[L_k - 1] int32: which selected branch trains each target on branch k's path (-1: none)."""
        out = np.full((len(self.arrays[k].tokens) - 1,), -1, np.int32)
        for o, assigned in enumerate(self.assigned):
            m = len(out) if o == k else max(int(self.lcp[o, k]) - 1, 0)
            m = min(m, len(assigned))
            out[:m][assigned[:m]] = o
        return out


AUXILIARY_POLICIES = ("lowest", "exclude")  # what selection does with "auxiliary" branches


def candidate_order(branches: list[Branch], rng: np.random.Generator | None, auxiliary: str = "lowest") -> list[int]:
    """Branch indices by label priority; within a label shuffled by ``rng`` (appearance order without one).

    ``auxiliary``: "lowest" (auxiliary branches last) or "exclude" (left out).
    """
    if auxiliary not in AUXILIARY_POLICIES:
        raise ValueError(f"auxiliary={auxiliary!r} must be one of {AUXILIARY_POLICIES}")
    order: list[int] = []
    for label in PRIORITY:
        if label == AUXILIARY_LABEL and auxiliary == "exclude":
            continue
        tier = [i for i, b in enumerate(branches) if b.label == label]
        if rng is not None and len(tier) > 1:
            tier = [tier[i] for i in rng.permutation(len(tier))]
        order.extend(tier)
    unknown = {b.label for b in branches} - set(PRIORITY)
    if unknown:
        raise ValueError(f"branch labels {sorted(unknown)} are not among {PRIORITY}")
    return order


def select(
    execution_id: str,
    branches: list[Branch],
    max_branches: int | None,
    rng: np.random.Generator | None = None,
    auxiliary: str = "lowest",
) -> Selection:
    """Selects at most ``max_branches`` branches and assigns each trainable target to one of them.

    ``auxiliary``: "lowest" or "exclude", as in ``candidate_order``.
    """
    if max_branches is not None and max_branches < 1:
        raise ValueError(f"max_branches={max_branches} must be >= 1 (or None for uncapped)")
    chosen: list[Branch] = []
    arrays: list[BranchArrays] = []
    assigned: list[np.ndarray] = []
    for i in candidate_order(branches, rng, auxiliary):
        if max_branches is not None and len(chosen) >= max_branches:
            break
        a = branches[i].arrays()
        if len(a.tokens) < 2:
            continue
        new = a.trainable[1:].copy()  # [L - 1]: targets policy-generated on this branch
        for c in arrays:
            if not new.any():
                break
            m = common_prefix_len(a.tokens, c.tokens) - 1  # targets 0..m-1 are shared with c
            if m > 0:
                new[:m] &= ~c.trainable[1 : m + 1]  # ...and trained by c (or one before it) if c generated them
        if new.any():
            chosen.append(branches[i])
            arrays.append(a)
            assigned.append(new)
    j = len(chosen)
    lcp = np.zeros((j, j), np.int64)
    for x in range(j):
        lcp[x, x] = len(arrays[x].tokens)
        for y in range(x + 1, j):
            lcp[x, y] = lcp[y, x] = common_prefix_len(arrays[x].tokens, arrays[y].tokens)
    return Selection(
        execution_id=execution_id,
        branches=chosen,
        arrays=arrays,
        assigned=assigned,
        lcp=lcp,
        num_branches=len(branches),
    )
