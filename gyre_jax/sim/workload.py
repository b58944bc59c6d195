"""Workloads: what an execution does (model calls, tokens, tool and environment time, timeouts), sampled
per step from a seeded spec, or replayed from a real run's TITO records.

An execution is a sequence of calls. Call t prefills the ``obs`` tokens appended since the previous call
(tool output, messages) onto the session's context, decodes ``gen`` tokens, then waits ``tool`` seconds
for the tool / environment. The context grows by obs + gen per call; when it would pass the context
window, the harness compacts it (a summary call that decodes ``summary_tokens``) and continues from the
initial context plus the summary. The simulator does not follow single calls: it groups each
execution's calls into at most ``segments`` segments and times a segment from its sums and the load of
the cell serving it when the segment starts (``SegmentPlan``).

Executions of step k are sampled from ``numpy.random.default_rng([seed, k])``, so every policy simulated
with the same seed sees exactly the same executions (common random numbers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from gyre_jax.sim.cost_model import ServingCost
from gyre_jax.sim.trajectory_cost import TrajectoryShape, branches, capped_flops

if TYPE_CHECKING:
    from gyre_jax.sim.simulator import SimConfig


@dataclass(frozen=True)
class Dist:
    """Log-normal with the given median and sigma (sigma 0: constant), clipped to [lo, hi]."""

    median: float
    sigma: float = 0.0
    lo: float = 0.0
    hi: float = math.inf

    def __post_init__(self) -> None:
        if self.median < 0 or self.sigma < 0 or self.lo > self.hi:
            raise ValueError(f"bad distribution {self}: median and sigma must be >= 0 and lo <= hi")

    def sample(self, rng: np.random.Generator, size) -> np.ndarray:
        if self.sigma == 0:
            x = np.full(size, float(self.median))
        else:
            x = self.median * np.exp(self.sigma * rng.standard_normal(size))
        return np.clip(x, self.lo, self.hi)

    @property
    def mean(self) -> float:
        """Mean of the unclipped log-normal."""
        return self.median * math.exp(self.sigma**2 / 2)


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload preset; ``configs/sim_*.py`` say where each number comes from."""

    name: str
    turns: Dist  # model calls per execution (rounded, >= 1)
    task_sigma: float  # per-task difficulty: the turns of a task's G executions share a log-normal factor
    gen_tokens: Dist  # decoded tokens per call
    obs_tokens: Dist  # tokens appended to the context per call besides the decoded ones
    initial_context: int  # system prompt + tools + task
    tool_s: Dist  # tool / environment seconds after each call
    setup_s: Dist  # environment start before the first call
    eval_s: Dist  # evaluator seconds after the harness ends (tests on the workspace)
    timeout_s: float  # harness wall-clock limit (from the moment the session gets a slot)
    context_window: int = 0  # compaction threshold in tokens (0: never)
    summary_tokens: int = 0
    subagent_fraction: float = 0.0  # trajectory shape for training cost (trajectory_cost.py)
    subagent_tokens: float = 1.0
    # tasks in the dataset: step k's task t is task (k x tasks + t) mod task_pool, with one difficulty factor per
    # task for the whole run, so a task's earlier executions predict its later ones; 0: every step's tasks are new
    task_pool: int = 0

    def __post_init__(self) -> None:
        if self.task_pool < 0:
            raise ValueError(f"workload {self.name}: task_pool={self.task_pool} must be >= 0 (0: new tasks each step)")
        if self.timeout_s <= 0:
            raise ValueError(f"workload {self.name}: timeout_s={self.timeout_s} must be > 0")
        if self.task_sigma < 0:
            raise ValueError(f"workload {self.name}: task_sigma={self.task_sigma} must be >= 0")
        self.trajectory_shape()  # validates the context window / summary / sub-agent numbers

    def trajectory_shape(self) -> TrajectoryShape:
        return TrajectoryShape(
            context_window=self.context_window,
            summary_tokens=self.summary_tokens,
            initial_context=self.initial_context,
            subagent_fraction=self.subagent_fraction,
            subagent_tokens=self.subagent_tokens,
        )


@dataclass
class SegmentPlan:
    """The executions of one step, each cut into segments. Flat per-segment arrays; execution j owns
    segments ``offset[j] .. offset[j] + count[j] - 1``.

    Per segment: ``tool_s`` (tool + environment seconds), ``prefill_s`` (prefill seconds, load-free),
    ``gen`` (decoded tokens), ``ctx`` (mean context of the session while decoding, tokens),
    ``tokens_end`` (trajectory tokens when the segment ends). Per execution: ``turns``, ``tokens``
    (trajectory tokens at the end), ``eval_s``, ``compactions``.
    """

    offset: list[int]
    count: list[int]
    tool_s: list[float]
    prefill_s: list[float]
    gen: list[float]
    ctx: list[float]
    tokens_end: list[float]
    turns: np.ndarray
    tokens: np.ndarray
    eval_s: list[float]
    compactions: np.ndarray

    @property
    def size(self) -> int:
        return len(self.count)


def task_ids(spec: WorkloadSpec, step: int, tasks: int) -> np.ndarray:
    """Dataset ids of step ``step``'s ``tasks`` tasks [tasks]: ``(step x tasks + t) mod task_pool`` (with no pool,
    every task of the run is new: its id is ``step x tasks + t``)."""
    ids = step * tasks + np.arange(tasks)
    return ids % spec.task_pool if spec.task_pool else ids


def sample_turns(
    spec: WorkloadSpec, rng: np.random.Generator, tasks: int, group_size: int, task_z: np.ndarray | None = None
) -> list[np.ndarray]:
    """Per-call arrays for tasks x group_size executions: (turns [E], obs [C], gen [C], tool [C], setup [E]).
    ``task_z`` [tasks]: the tasks' standard-normal difficulty draws (a task pool's); None: drawn from ``rng``."""
    n = tasks * group_size
    z = rng.standard_normal(tasks) if spec.task_sigma else None  # drawn either way: the other draws stay the same
    if task_z is not None:
        z = task_z
    factor = np.repeat(np.exp(spec.task_sigma * z), group_size) if spec.task_sigma else 1.0
    turns = np.maximum(1, np.rint(np.clip(spec.turns.sample(rng, n) * factor, spec.turns.lo, spec.turns.hi))).astype(
        np.int64
    )
    calls = int(turns.sum())
    return [
        turns,
        spec.obs_tokens.sample(rng, calls),
        spec.gen_tokens.sample(rng, calls),
        spec.tool_s.sample(rng, calls),
        spec.setup_s.sample(rng, n),
    ]


def _compaction(
    grown_before: np.ndarray, added: np.ndarray, obs: np.ndarray, gen: np.ndarray, spec: WorkloadSpec
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Context compaction per call, all [C]: (context tokens before the call, tokens it generates with the
    summary that follows a compaction, tokens it prefills anew, whether it fills the window).

    grown_before: tokens the execution added before the call; added: tokens the call adds (obs + gen)."""
    l0 = float(spec.initial_context)
    w = float(spec.context_window)
    if w <= 0:
        return l0 + grown_before, gen.copy(), obs.copy(), np.zeros(len(gen), dtype=bool)
    first_room = w - l0  # tokens added before the first compaction
    room = w - l0 - spec.summary_tokens  # tokens added between later compactions

    def cycle(g):  # how many compactions happened once g tokens were added
        return np.where(g < first_room, 0.0, 1.0 + np.floor(np.maximum(g - first_room, 0.0) / room))

    k_before = cycle(grown_before)
    ctx_before = np.where(
        k_before == 0,
        l0 + grown_before,
        l0 + spec.summary_tokens + np.mod(np.maximum(grown_before - first_room, 0.0), room),
    )
    compacted = cycle(grown_before + added) > k_before  # this call fills the window: a summary call follows
    gen_total = gen + compacted * spec.summary_tokens
    new_prefill = obs + compacted * (l0 + spec.summary_tokens)  # the compacted context, re-rendered
    return ctx_before, gen_total, new_prefill, compacted


def _segment_bounds(
    turns: np.ndarray, starts: np.ndarray, exec_of_call: np.ndarray, segments: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Execution j's calls split into min(turns_j, segments) near-equal runs: (segments per execution [E],
    first segment of each execution [E], first call of each segment [S])."""
    seg_count = np.minimum(turns, segments)
    call_in_exec = np.arange(len(exec_of_call)) - starts[exec_of_call]
    seg_in_exec = (call_in_exec * seg_count[exec_of_call]) // turns[exec_of_call]
    seg_offset = np.concatenate([[0], np.cumsum(seg_count)[:-1]])
    seg_id = seg_offset[exec_of_call] + seg_in_exec  # [C] nondecreasing
    bounds = np.flatnonzero(np.diff(seg_id, prepend=-1))
    assert len(bounds) == int(seg_count.sum())
    return seg_count, seg_offset, bounds


def build_plan(
    turns: np.ndarray,
    obs: np.ndarray,
    gen: np.ndarray,
    tool: np.ndarray,
    setup: np.ndarray,
    eval_s: np.ndarray,
    spec: WorkloadSpec,
    serving: ServingCost,
    segments: int,
) -> SegmentPlan:
    """Per-call arrays (concatenated over executions in order) -> segments.

    turns, setup, eval_s: [E]; obs, gen, tool: [C] with C = turns.sum().
    """
    if segments < 1:
        raise ValueError(f"segments={segments} must be >= 1")
    e = len(turns)
    starts = np.concatenate([[0], np.cumsum(turns)[:-1]])  # [E] first call of each execution
    added = obs + gen  # [C]
    exec_of_call = np.repeat(np.arange(e), turns)
    cum = np.cumsum(added)
    grown_before = cum - added - (cum - added)[starts][exec_of_call]  # [C] tokens added before this call
    ctx_before, gen_total, new_prefill, compacted = _compaction(grown_before, added, obs, gen, spec)
    prefill = serving.prefill_s(new_prefill, ctx_before)
    decode_ctx = ctx_before + obs + gen / 2.0  # mean context while this call decodes
    tool = tool.copy()
    tool[starts] += setup  # environment start before the first call

    seg_count, seg_offset, bounds = _segment_bounds(turns, starts, exec_of_call, segments)
    seg_gen = np.add.reduceat(gen_total, bounds)
    traj = float(spec.initial_context) + grown_before + added  # trajectory tokens after each call (all branches)
    last_call = np.concatenate([bounds[1:], [len(gen)]]) - 1
    return SegmentPlan(
        offset=seg_offset.tolist(),
        count=seg_count.tolist(),
        tool_s=np.add.reduceat(tool, bounds).tolist(),
        prefill_s=np.add.reduceat(prefill, bounds).tolist(),
        gen=seg_gen.tolist(),
        ctx=(np.add.reduceat(gen_total * decode_ctx, bounds) / np.maximum(seg_gen, 1e-9)).tolist(),
        tokens_end=traj[last_call].tolist(),
        turns=turns,
        tokens=traj[starts + turns - 1],
        eval_s=eval_s.tolist(),
        compactions=np.bincount(exec_of_call, weights=compacted.astype(np.float64), minlength=e),
    )


def sample_step(
    spec: WorkloadSpec, serving: ServingCost, *, step: int, tasks: int, group_size: int, seed: int, segments: int
) -> SegmentPlan:
    """The executions of RL step ``step`` (tasks x group_size), from ``default_rng([seed, step])``."""
    rng = np.random.default_rng([seed, step])
    task_z = None
    if spec.task_pool:
        task_z = np.random.default_rng([seed, 2**31 - 1]).standard_normal(spec.task_pool)[task_ids(spec, step, tasks)]
    turns, obs, gen, tool, setup = sample_turns(spec, rng, tasks, group_size, task_z)
    eval_s = spec.eval_s.sample(rng, len(turns))
    return build_plan(turns, obs, gen, tool, setup, eval_s, spec, serving, segments)


def check_plans(config: SimConfig, plans: list[SegmentPlan] | None) -> list[SegmentPlan] | None:
    """``plans`` if they are one per step of ``config``, each of its batch size (None: none given)."""
    if plans is not None and (len(plans) != config.steps or any(p.size != config.batch_size for p in plans)):
        raise ValueError(
            f"plans: expected {config.steps} steps of {config.batch_size} executions, got {[p.size for p in plans]}"
        )
    return plans


class StepPlans:
    """A run's executions, step by step: each step's ``SegmentPlan`` (sampled on first use, or given: one per
    step, e.g. a real run's replayed) and each execution's training work (its J_max-capped FLOPs x
    ``train_work_scale``, ``trajectory_cost.py``). ``config`` is the run's ``SimConfig``."""

    def __init__(self, config: SimConfig, given: list[SegmentPlan] | None = None):
        self.config = config
        self.given = given
        self.plans: dict[int, SegmentPlan] = {}
        self.work_full: dict[int, list[float]] = {}  # step -> work of each of its executions, ended normally

    def get(self, step: int) -> SegmentPlan:
        plan = self.plans.get(step)
        if plan is None:
            cfg = self.config
            if self.given is not None:
                plan = self.given[step]
            else:
                plan = sample_step(
                    cfg.workload,
                    cfg.cost.serving,
                    step=step,
                    tasks=cfg.tasks_per_step,
                    group_size=cfg.group_size,
                    seed=cfg.seed,
                    segments=cfg.segments,
                )
            self.plans[step] = plan
            b = branches(plan.tokens, cfg.workload.trajectory_shape())
            self.work_full[step] = (
                capped_flops(b, cfg.max_branches, cfg.cost.training) * cfg.train_work_scale
            ).tolist()
        return plan

    def work_for(self, tokens: float) -> float:
        """The training work of an execution cut short at ``tokens`` trajectory tokens (a timeout)."""
        cfg = self.config
        b = branches(np.array([tokens]), cfg.workload.trajectory_shape())
        return float(capped_flops(b, cfg.max_branches, cfg.cost.training)[0]) * cfg.train_work_scale


# -- replay of a real run ----------------------------------------------------------------------------
@dataclass
class RecordedExecution:
    """One execution of a real run, as its TITO records show it: per call the new prompt tokens (not
    reused from the previous call), the decoded tokens and the gap until the next call (tool time)."""

    execution_id: str
    obs: list[float]
    gen: list[float]
    tool_s: list[float]
    eval_s: float = 0.0


def recorded_execution(
    records: Sequence, eval_s: float = 0.0, setup_s: float = 0.0, teardown_s: float = 0.0
) -> RecordedExecution:
    """From ``TitoRecord``s of one execution (any order): obs = prompt tokens not reused from the previous
    call, gen = completion tokens, tool = time from one call's end to the next call's start.

    ``setup_s`` (harness start until its first call) is added before the first call, ``teardown_s`` (its last
    call's end until the harness exits) after the last one; ``eval_s`` is the evaluator's time after that."""
    if not records:
        raise ValueError("an execution needs at least one record to replay")
    recs = sorted(records, key=lambda r: r.call_index)
    obs = [float(len(r.prompt_ids) - r.reused_prefix_len) for r in recs]
    gen = [float(len(r.completion_ids)) for r in recs]
    tool = [max(0.0, recs[i + 1].t_start - recs[i].t_end) for i in range(len(recs) - 1)] + [0.0]
    tool[0] += setup_s
    tool[-1] += teardown_s
    return RecordedExecution(execution_id=recs[0].execution_id, obs=obs, gen=gen, tool_s=tool, eval_s=eval_s)


def replay_plan(
    executions: Sequence[RecordedExecution], spec: WorkloadSpec, serving: ServingCost, segments: int
) -> SegmentPlan:
    """A SegmentPlan of recorded executions (one step), for calibration against the run they came from."""
    turns = np.array([len(x.gen) for x in executions], dtype=np.int64)

    def cat(key: str) -> np.ndarray:  # per-call values of every execution, concatenated in order
        return np.concatenate([np.asarray(getattr(x, key), dtype=np.float64) for x in executions])

    return build_plan(
        turns,
        cat("obs"),
        cat("gen"),
        cat("tool_s"),
        np.zeros(len(executions)),
        np.array([x.eval_s for x in executions]),
        spec,
        serving,
        segments,
    )
