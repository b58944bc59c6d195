"""The trajectory cost model: an execution's branches and the forward-backward work they cost under a cap.

An execution of ``tokens`` trajectory tokens is split into branches the way the trajectory processor
(``gyre_jax.trajectory``) labels them:

- the main thread holds ``(1 - subagent_fraction) * tokens``; it runs in one context until the context
  window fills, then a context summary (compaction) starts a new branch that begins with
  ``summary_tokens``: branch 1 is ``main``, later ones are ``main-summary``;
- sub-agents hold the rest, in threads of about ``subagent_tokens`` each (``subagent`` branches).

J_max keeps at most ``cap`` branches by priority main > main-summary > subagent (then in order of
appearance), as ``select_branches`` does. A branch of l tokens costs ``flops_per_token * l +
flops_per_token_sq * l^2`` FLOPs (``TrainingCost.branch_flops``): attention makes long branches cost more
than their share of tokens. All functions work on numpy arrays of executions at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre_jax.sim.cost_model import TrainingCost


@dataclass(frozen=True)
class TrajectoryShape:
    context_window: int  # tokens; 0 = no compaction
    summary_tokens: int = 0
    initial_context: int = 0  # system prompt, tools, task: at the start of every main branch
    subagent_fraction: float = 0.0  # share of an execution's tokens produced by sub-agents
    subagent_tokens: float = 1.0  # typical length of one sub-agent thread

    def __post_init__(self) -> None:
        if self.context_window and self.context_window <= self.initial_context + self.summary_tokens:
            raise ValueError(
                f"context_window={self.context_window} must exceed initial_context + summary_tokens "
                f"({self.initial_context} + {self.summary_tokens}) for compaction to make progress"
            )
        if not 0.0 <= self.subagent_fraction < 1.0:
            raise ValueError(f"subagent_fraction={self.subagent_fraction} must be in [0, 1)")
        if self.subagent_tokens <= 0:
            raise ValueError(f"subagent_tokens={self.subagent_tokens} must be > 0")


@dataclass
class Branches:
    """Branch lengths of E executions, by class. ``main``: [E]; ``summary_full``: [E] count of full
    main-summary branches of length ``summary_len``; ``summary_last``: [E] length of the last, partial
    main-summary branch (0 if none); ``sub_count``: [E]; ``sub_len``: [E] length of each sub-agent branch."""

    main: np.ndarray
    summary_full: np.ndarray
    summary_len: float
    summary_last: np.ndarray
    sub_count: np.ndarray
    sub_len: np.ndarray

    @property
    def count(self) -> np.ndarray:
        return 1 + self.summary_full + (self.summary_last > 0) + self.sub_count


def branches(tokens: np.ndarray, shape: TrajectoryShape) -> Branches:
    """tokens: [E] trajectory tokens per execution -> its branches."""
    tokens = np.asarray(tokens, dtype=np.float64)
    sub_total = shape.subagent_fraction * tokens
    sub_count = np.where(sub_total > 0, np.maximum(1, np.rint(sub_total / shape.subagent_tokens)), 0)
    sub_len = np.where(sub_count > 0, sub_total / np.maximum(sub_count, 1), 0.0)
    main_total = tokens - sub_total
    w = float(shape.context_window)
    if w <= 0:
        zeros = np.zeros_like(tokens)
        return Branches(main_total, zeros, 0.0, zeros, sub_count, sub_len)
    main = np.minimum(main_total, w)
    rest = main_total - main  # new tokens after the first compaction
    room = w - shape.initial_context - shape.summary_tokens  # new tokens one summary branch holds
    full = np.floor(rest / room)
    last_new = rest - full * room
    summary_len = w
    summary_last = np.where(last_new > 0, shape.initial_context + shape.summary_tokens + last_new, 0.0)
    return Branches(main, full, summary_len, summary_last, sub_count, sub_len)


def capped_flops(b: Branches, cap: int | None, cost: TrainingCost) -> np.ndarray:
    """[E] forward-backward FLOPs of the at most ``cap`` branches kept per execution (None = all)."""
    big = np.inf if cap is None else float(cap)
    if cap is not None and cap < 1:
        raise ValueError(f"cap={cap} must be >= 1 (or None for uncapped)")
    slots = big - 1.0  # after the main branch
    n_full = np.minimum(b.summary_full, slots)
    slots = slots - n_full
    has_last = (b.summary_last > 0) & (slots >= 1)
    slots = slots - has_last
    n_sub = np.minimum(b.sub_count, np.maximum(slots, 0))
    return (
        cost.branch_flops(b.main)
        + n_full * cost.branch_flops(b.summary_len)
        + np.where(has_last, cost.branch_flops(b.summary_last), 0.0)
        + n_sub * cost.branch_flops(b.sub_len)
    )


def capped_tokens(b: Branches, cap: int | None) -> np.ndarray:
    """[E] tokens in the branches kept (each branch computed in full; shared prefixes are not counted twice
    only with tree packing, which this count leaves out)."""
    big = np.inf if cap is None else float(cap)
    slots = big - 1.0
    n_full = np.minimum(b.summary_full, slots)
    slots = slots - n_full
    has_last = (b.summary_last > 0) & (slots >= 1)
    slots = slots - has_last
    n_sub = np.minimum(b.sub_count, np.maximum(slots, 0))
    return b.main + n_full * b.summary_len + np.where(has_last, b.summary_last, 0.0) + n_sub * b.sub_len
