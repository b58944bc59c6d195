"""The discrete-event cluster simulator: cells, sessions, micro-steps and role switches, driven by the
same scheduling policy objects as the real controller (``gyre_jax.elastic.policies``).

The simulator is a driver in the sense of the policy interface: it keeps the facts (``ClusterState``),
sends the events (``started``, ``finished``, ``data_ready``, ``micro_step_done``, ``step_trained``,
``switched``) and carries out each ``Decision`` (role switches, dispatch). What it models:

- Serving: each serving cell holds ``slots`` sessions (replicas x slots per replica). A session's
  segment (a run of its model calls, see ``workload.py``) takes tool time + prefill time + decoded
  tokens x the decode step time of its cell at the moment the segment starts; the step time grows
  with the cell's batch (sessions weighted by the share of their time they spend in model calls) and
  with the context tokens that batch reads (``CostModel.serving``).
- Timeouts: a session still running ``timeout_s`` after it got its slot is ended there; its trajectory
  is what it produced so far.
- Evaluation and data: after a harness ends, the evaluator runs ``eval_s``; then the execution's
  micro-steps enter the queue (streaming), or, without streaming, the step's whole batch is processed
  once its last execution is evaluated.
- Training: cells in the TRAINING role claim micro-steps of ``micro_step_tokens`` worth of FLOPs for
  step ``version`` (the J_max-capped trajectory cost, ``trajectory_cost.py``) as they become ready;
  the core applies the optimizer step (plus a gradient reduction when satellites helped). Satellites
  pull the new weights after each step; serving cells pause for the weight sync.
- Switches: serving -> training and back take the configured times; sessions on a cell that leaves
  serving move (KV migration time) to the serving cell that stays longest, or wait for a slot.

Everything is seeded: the same config gives the same result, event for event.
"""

from __future__ import annotations

import heapq
import math
import time as _time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from gyre_jax.elastic.driver import Driver
from gyre_jax.elastic.events import (
    DataReady,
    Event,
    Finished,
    MicroStepDone,
    StepBegan,
    StepTrained,
    Switched,
    WeightsPulled,
)
from gyre_jax.elastic.policies import ADMISSION_ORDERS, Decision, SchedulingPolicy, make_policy
from gyre_jax.elastic.state import ClusterState, Role, Waterlevel, cluster_state
from gyre_jax.elastic.timeline import TimelineWriter
from gyre_jax.sim.cells import CellRoles
from gyre_jax.sim.cost_model import CostModel
from gyre_jax.sim.events import BATCH, BOUNDARY, EVAL, MICRO, OPT, PULL, SEG, SWITCH, EventQueue
from gyre_jax.sim.ledger import SimLedger
from gyre_jax.sim.partial import VersionBooks
from gyre_jax.sim.serving_model import ServingModel, execution_stats
from gyre_jax.sim.training_model import TrainingModel
from gyre_jax.sim.workload import SegmentPlan, StepPlans, WorkloadSpec, check_plans

SERVING, TRAINING, SWITCHING = Role.SERVING, Role.TRAINING, Role.SWITCHING
PLACEMENTS = ("last", "balanced")
STREAM_UNITS = ("execution", "group", "group_in_order")


class SimConfigError(ValueError):
    """A simulator setting is invalid; the message names it and what is allowed."""


@dataclass(frozen=True)
class SimConfig:
    workload: WorkloadSpec
    cost: CostModel
    accelerators: int
    cell_accelerators: int
    policy: str
    steps: int
    tasks_per_step: int
    group_size: int
    seed: int = 0
    policy_options: tuple[tuple[str, Any], ...] = ()
    max_branches: int | None = 5  # J_max; None: every branch
    streaming: bool = True
    segments: int = 8  # segments per execution (resolution of the serving model)
    train_work_scale: float = 1.0  # multiplies every execution's training work (e.g. a measured cap ratio)
    # where a new or moved session goes: "last" = the serving cell with a free slot that stays serving
    # longest (highest index); "balanced" = the serving cell with the fewest sessions (ties: lowest index),
    # what the real proxy's router does (least in flight)
    placement: str = "last"
    # a serving loop that runs prefills between decode steps stalls every decoding session while it prefills
    # another: a session decodes at step time x (1 + rho), rho = the rate at which the replica's other
    # sessions prefill (each one's prefill time / its segment time, summed): the prefill seconds that fall
    # into each second of its decoding
    prefill_interference: bool = False
    # what enters the micro-step queue at once when streaming: "execution" (each as it is evaluated),
    # "group" (a task's G executions once all are evaluated: the real controller's stream_order="arrival")
    # or "group_in_order" (whole groups in task order: stream_order="task", its default)
    stream_unit: str = "execution"
    # micro-batches the packer keeps open while a step's data streams in (the real packer fills up to
    # open_micro_batches at once and finishes the oldest only when a chunk fits none): the newest this
    # many micro-steps' worth of a step's data is claimable only once the step's data is complete
    pack_lookahead: int = 0
    # partial rollouts (APRIL / AReaL style): a step trains the first tasks_per_step groups to complete; the
    # groups still running at its end carry on across the weight update into a later step (their tokens keep
    # the version that produced them). Needs streaming by whole groups (stream_unit="group").
    partial_rollouts: bool = False
    # the per-token bound: an execution whose oldest token is more than this many versions behind the step it
    # trains in is dropped (no training work; its slot time is wasted), as the real ledger's rl.drop_staleness
    # does; -1: no bound
    drop_staleness: int = -1
    # the order a step's executions are dispatched in: "task" (task order) or "longest_first" (tasks predicted
    # longest by their duration history first, ``policies.DurationHistory``; needs tasks that recur:
    # workload.task_pool > 0)
    admission: str = "task"
    # group quorum: once this many of a group's G executions have ended (finished or timed out), the group is
    # complete and its other members are aborted: their sessions end at once, they train nothing, and their
    # slot time is wasted (GRPO/GSPO advantages over the members that ended); 0: the whole group (no aborts)
    group_quorum: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        a, c = self.accelerators, self.cell_accelerators
        r = self.cost.serving.replica_accelerators
        if a < 1 or c < 1 or a % c:
            raise SimConfigError(f"accelerators={a} must be a positive multiple of cell_accelerators={c}")
        if c % r:
            raise SimConfigError(
                f"cell_accelerators={c} must be a multiple of the serving replica size {r} "
                f"(cost.serving.replica_accelerators)"
            )
        if c < self.cost.training.min_cell_accelerators:
            raise SimConfigError(
                f"cell_accelerators={c} is below the {self.cost.training.min_cell_accelerators} "
                f"accelerators a training replica needs (cost.training.min_cell_accelerators)"
            )
        for key in ("steps", "tasks_per_step", "group_size", "segments"):
            if getattr(self, key) < 1:
                raise SimConfigError(f"{key}={getattr(self, key)} must be >= 1")
        if self.pack_lookahead < 0:
            raise SimConfigError(f"pack_lookahead={self.pack_lookahead} must be >= 0")
        if not self.train_work_scale > 0:
            raise SimConfigError(f"train_work_scale={self.train_work_scale} must be > 0")
        if self.stream_unit not in STREAM_UNITS:
            raise SimConfigError(f"stream_unit={self.stream_unit!r} must be one of {', '.join(STREAM_UNITS)}")
        if self.placement not in PLACEMENTS:
            raise SimConfigError(f"placement={self.placement!r} must be one of {', '.join(PLACEMENTS)}")
        if self.admission not in ADMISSION_ORDERS:
            raise SimConfigError(f"admission={self.admission!r} must be one of {', '.join(ADMISSION_ORDERS)}")
        if self.admission == "longest_first" and not self.workload.task_pool:
            raise SimConfigError(
                "admission='longest_first' predicts from each task's earlier executions: set workload.task_pool > 0 "
                "(tasks that recur)"
            )
        if self.drop_staleness < -1:
            raise SimConfigError(f"drop_staleness={self.drop_staleness} must be >= 0 (or -1: no bound)")
        if self.partial_rollouts and not (self.streaming and self.stream_unit == "group"):
            raise SimConfigError(
                f"partial_rollouts needs streaming=True and stream_unit='group' (a group is assigned to a step when it "
                f"completes; got streaming={self.streaming}, stream_unit={self.stream_unit!r})"
            )
        if self.drop_staleness >= 0 and not self.partial_rollouts:
            raise SimConfigError(
                f"drop_staleness={self.drop_staleness} applies to partial rollouts (partial_rollouts=True); without "
                f"them every execution trains within the dispatch bound eta"
            )
        if not 0 <= self.group_quorum <= self.group_size:
            raise SimConfigError(
                f"group_quorum={self.group_quorum} must be in 0 .. group_size={self.group_size} (0: the whole group)"
            )
        if self.partial_rollouts and self.policy == "colocated":
            raise SimConfigError("partial_rollouts: the colocated policy trains each batch whole; use async or elastic")
        if self.max_branches is not None and self.max_branches < 1:
            raise SimConfigError(f"max_branches={self.max_branches} must be >= 1 (or None for uncapped)")
        make_policy(self.policy, self.num_cells, **dict(self.policy_options))  # validates name and options

    @property
    def num_cells(self) -> int:
        return self.accelerators // self.cell_accelerators

    @property
    def batch_size(self) -> int:
        return self.tasks_per_step * self.group_size

    @property
    def cell_names(self) -> list[str]:
        """The cells' names in a timeline: ``cell0``, ``cell1``, ..."""
        return [f"cell{c}" for c in range(self.num_cells)]

    @property
    def pool_steps(self) -> int:
        """Batches of executions the run may dispatch: ``steps``, plus (partial rollouts) eta more, since groups
        that carry on into later steps leave room for later batches in the steps a run trains."""
        if not self.partial_rollouts:
            return self.steps
        return self.steps + int(dict(self.policy_options).get("dispatch_staleness", 1)) + 1

    @property
    def slots_per_cell(self) -> int:
        s = self.cost.serving
        return self.cell_accelerators // s.replica_accelerators * s.slots_per_replica

    def replace(self, **changes: Any) -> SimConfig:
        import dataclasses

        if "policy_options" in changes and isinstance(changes["policy_options"], dict):
            changes["policy_options"] = tuple(sorted(changes["policy_options"].items()))
        return dataclasses.replace(self, **changes)


@dataclass
class SimResult:
    """What one simulated run measured. Times in simulated seconds."""

    name: str
    policy: str
    policy_options: dict
    streaming: bool
    seed: int
    steps: int
    accelerators: int
    num_cells: int
    cell_accelerators: int
    batch_size: int
    max_branches: int | None
    makespan_s: float
    step_end_s: list[float]
    busy_fraction: float  # useful accelerator-time / all accelerator-time (the ideal is 1)
    serving_busy_fraction: float  # slot-occupied serving time, as a share of all accelerator-time
    training_busy_fraction: float  # micro-step + optimizer time, as a share of all accelerator-time
    role_fractions: dict[str, float]  # cell-time per role
    executions: dict[str, float]
    staleness: dict[str, float]
    switches: dict[str, int]
    training: dict[str, float] = field(default_factory=dict)  # FLOPs, micro-steps, seconds of the trained steps
    sim: dict[str, float] = field(default_factory=dict)  # wall seconds, events
    # per-token staleness of the trained executions (versions between the step and the version that produced
    # a token): "max" (oldest token), "mean" (token-weighted), "per_step" [[max, mean], ...]
    token_staleness: dict[str, Any] = field(default_factory=dict)
    # partial rollouts: groups carried into a later step, executions dropped beyond the bound, and the slot time
    # the dropped ones held (as a share of all accelerator-time; not counted as busy)
    partial: dict[str, float] = field(default_factory=dict)
    # where accelerator-time that is not busy went, as shares of all accelerator-time: serving slots empty (or
    # paused for a weight sync), training cells with nothing to compute, switches, dropped executions' slots,
    # slots of executions aborted by their group's quorum
    idle: dict[str, float] = field(default_factory=dict)
    # the busy fraction in steady state: between the ends of steps[0] - 1 and steps[1] (``VersionBooks.steady_busy``)
    steady: dict[str, Any] = field(default_factory=dict)
    partial_rollouts: bool = False
    drop_staleness: int = -1
    group_quorum: int = 0

    @property
    def step_time_s(self) -> float:
        return self.makespan_s / self.steps

    @property
    def ideal_makespan_s(self) -> float:
        """The makespan if every accelerator-second did the useful work this run did."""
        return self.makespan_s * self.busy_fraction

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["step_time_s"] = self.step_time_s
        out["ideal_makespan_s"] = self.ideal_makespan_s
        return out


def _config_fields(cfg: SimConfig) -> dict[str, Any]:
    """The ``SimResult`` fields that say which run it was."""
    return dict(
        name=cfg.name or cfg.workload.name,
        policy=cfg.policy,
        policy_options=dict(cfg.policy_options),
        streaming=cfg.streaming,
        seed=cfg.seed,
        steps=cfg.steps,
        accelerators=cfg.accelerators,
        num_cells=cfg.num_cells,
        cell_accelerators=cfg.cell_accelerators,
        batch_size=cfg.batch_size,
        max_branches=cfg.max_branches,
        partial_rollouts=cfg.partial_rollouts,
        drop_staleness=cfg.drop_staleness,
        group_quorum=cfg.group_quorum,
    )


class _WaterlevelSamples:
    """The waterlevel written to a timeline at most every ``interval_s``; a change that was not written is
    written (at its own time) before the next sample, so the curve is exact up to that resolution."""

    def __init__(self, timeline: TimelineWriter, interval_s: float):
        self.timeline, self.interval_s = timeline, interval_s
        self.last_t = -math.inf
        self.pending: tuple | None = None

    def sample(self, now: float, wl: Waterlevel) -> None:
        values = (wl.dispatched, wl.started, wl.finished)
        if now - self.last_t >= self.interval_s:
            if self.pending is not None and self.pending[0] > self.last_t:
                self.timeline.waterlevel(*self.pending)
            self.timeline.waterlevel(now, *values)
            self.last_t = now
            self.pending = None
        else:
            self.pending = (now, *values)

    def close(self, end: float, wl: Waterlevel) -> None:
        if self.pending is not None:
            self.timeline.waterlevel(*self.pending)
        self.timeline.waterlevel(end, wl.dispatched, wl.started, wl.finished)


class Simulator:
    """One simulated run. ``Simulator(config).run() -> SimResult``.

    ``timeline``: a ``TimelineWriter`` over the cells (``SimConfig.cell_names``) to record role changes,
    micro-steps, optimizer steps, the waterlevel (at most every ``counter_interval_s``) and, with
    ``trace_executions``, every execution. ``progress(version, time)`` is called after each optimizer step.
    ``plans`` replaces the sampled executions with given ones (one ``SegmentPlan`` per step; calibration
    replays a real run's executions this way). ``decisions_path``: a ``decisions.jsonl`` of every decision.

    The simulator is the policy's driver, as the real controller is: the same typed events
    (``elastic.events``), the same state builder (``elastic.state.cluster_state``) on its books (``ledger.py``,
    ``cells.py``) and the same ``Driver.replan``; each of its own timed events (``_on_*``) moves its parts:
    the event queue (``events.py``), the sessions on serving cells (``serving_model.py``), the micro-step
    queue and training cells (``training_model.py``) and the executions' plans (``workload.StepPlans``).
    """

    def __init__(
        self,
        config: SimConfig,
        *,
        timeline: TimelineWriter | None = None,
        trace_executions: bool = False,
        counter_interval_s: float = 60.0,
        progress: Callable[[int, float], None] | None = None,
        plans: list[SegmentPlan] | None = None,
        decisions_path: str | None = None,
    ):
        self.cfg = config
        self.given_plans = check_plans(config, plans)
        self.policy: SchedulingPolicy = make_policy(config.policy, config.num_cells, **dict(config.policy_options))
        self.timeline = timeline
        if timeline is not None and len(timeline.cell_names) != config.num_cells:
            raise SimConfigError(f"the timeline has {len(timeline.cell_names)} cells, the config {config.num_cells}")
        self.trace_executions = trace_executions and timeline is not None
        self.counter_interval_s = counter_interval_s
        self.progress = progress
        self.decisions_path = decisions_path

    @property
    def now(self) -> float:
        """Simulated seconds: the time of the event being handled."""
        return self.clock.now

    # == setup ====================================================================================
    def _setup(self) -> None:
        cfg = self.cfg
        k = self.k = cfg.num_cells
        self.n = cfg.batch_size
        self.clock = EventQueue()
        self.events = 0
        self.done = False
        self.step_plans = StepPlans(cfg, self.given_plans)
        self.cells = CellRoles(self.policy.initial_roles(), cfg.policy, cfg.slots_per_cell)
        self.serving = ServingModel(cfg, self.clock, self.cells.role, self.step_plans.plans)
        self.driver = Driver(self.policy, self.decisions_path)
        self.ledger = SimLedger(
            cfg.steps,
            self.n,
            group_size=cfg.group_size,
            pool_steps=cfg.pool_steps,
            drop_bound=None if cfg.drop_staleness < 0 else cfg.drop_staleness,
            quorum=cfg.group_quorum,
        )
        self.training = TrainingModel(
            cfg, self.clock, self.cells, self.step_plans.plans, self.timeline, step_of=self.ledger.step_of
        )
        self.versions = VersionBooks(cfg, self.ledger, self.serving, self.training)
        # the books tests and tools read
        self.wl, self.fin_count, self.staleness = self.ledger.wl, self.ledger.fin_count, self.ledger.staleness
        self.total_work, self.exec_work = self.training.total_work, self.training.exec_work
        self._samples = None if self.timeline is None else _WaterlevelSamples(self.timeline, self.counter_interval_s)
        if self.timeline is not None:
            for c in range(k):
                self.timeline.role(0.0, c, self.cells.role[c], reason="start")

    # == the loop =================================================================================
    def run(self) -> SimResult:
        t_wall = _time.perf_counter()
        self._setup()
        try:
            self._replan(StepBegan(0, 0.0, executions=self.n))
            clock, pop = self.clock, heapq.heappop
            heap, tok = clock.heap, self.serving.tok
            handlers = {
                EVAL: self._on_eval,
                BATCH: self._on_batch_ready,
                MICRO: self._on_micro_done,
                OPT: self._on_optimizer_done,
                SWITCH: self._on_switch_done,
                PULL: self._on_pull_done,
                BOUNDARY: self._on_boundary_done,
            }
            segment_end = self.serving.segment_end  # most events are segment ends: the hot path
            while heap and not self.done:
                t, _, kind, x, y = pop(heap)
                if kind == SEG:
                    if y != tok[x]:
                        continue  # cancelled: the session moved or paused
                    clock.now = t
                    self.events += 1
                    ended = segment_end(x)
                    if ended is not None:
                        self._on_harness_end(x, *ended)
                    continue
                clock.now = t
                self.events += 1
                handlers[kind](x, y)
            if not self.done:
                raise RuntimeError(
                    f"simulation stalled at t={clock.now:.0f}s after {self.ledger.version}/{self.cfg.steps} steps: "
                    f"policy {self.cfg.policy} left no cell able to make progress (roles {self.cells.text()})"
                )
        finally:
            self.driver.close()
        return self._result(_time.perf_counter() - t_wall)

    # == policy ===================================================================================
    def _replan(self, event: Event) -> None:
        """Tells the policy about the event and carries its decision out, until it dispatches nothing more."""
        self.driver.replan(event, self._observe, self._carry_out)

    def _observe(self) -> ClusterState:
        v = self.ledger.version
        return cluster_state(self.clock.now, v, self.cells, self.ledger, self.training.step_facts(v))

    def _carry_out(self, decision: Decision) -> int:
        """Begins the decision's switches and dispatch; returns the executions dispatched or started."""
        for c, want in self.cells.switches_to_begin(decision.roles):
            self._begin_switch(c, want)
        n = min(decision.dispatch, self.ledger.undispatched)
        if n > 0:
            self._dispatch(n)
        return n + self._start_waiting()

    def _train_then_replan(self, event: Event) -> None:
        """Training cells claim what is ready and a due optimizer step starts, then the policy decides."""
        self.training.claim(self.ledger.version)
        self.training.check_step(self.ledger.version)
        self._replan(event)

    # == executions ===============================================================================
    def _dispatch(self, count: int) -> None:
        for _ in range(count):
            i = self.ledger.dispatch()
            self.step_plans.get(i // self.n)
            self.wl.dispatched += 1
            if self.ledger.aborted[i]:  # its group reached its quorum before it was dispatched
                self.versions.end_aborted(i, had_slot=False)
            else:
                self.serving.enqueue(i)
        self._counter()

    def _start_waiting(self) -> int:
        """Gives free slots to waiting sessions; returns how many executions started."""
        started = self.serving.start_waiting()
        if started:
            self.wl.started += len(started)
            if self.trace_executions:
                for i, c in started:
                    self.timeline.execution_started(self.clock.now, self._eid(i), step=i // self.n, cell=c)
            self._counter()
        return len(started)

    def _eid(self, i: int) -> str:
        step, j = divmod(i, self.n)
        return f"s{step}-t{j // self.cfg.group_size}-g{j % self.cfg.group_size}"

    def _on_harness_end(self, i: int, status: str, tokens: float) -> None:
        """Execution ``i``'s last segment ended, or its time is up (``tokens``: its trajectory tokens)."""
        step, j = divmod(i, self.n)
        work = self.step_plans.work_for(tokens) if status == "timeout" else self.step_plans.work_full[step][j]
        self._finish(i, status, work)

    def _finish(self, i: int, status: str, work: float) -> None:
        """Execution ``i``'s harness ended (``work``: its training work): its evaluation starts."""
        c = self.serving.end(i)
        now = self.clock.now
        step, j = divmod(i, self.n)
        group_done = self.ledger.finished(i)
        self.training.exec_work[i] = work
        if self.trace_executions:
            self.timeline.execution_ended(now, self._eid(i), status, cell=c)
        p = self.step_plans.plans[step]
        delay = p.eval_s[j]
        if self.cfg.streaming:
            delay += float(p.tokens[j]) * self.cfg.cost.pipeline.processing_s_per_token
        self.clock.push(now + delay, EVAL, i)
        self.versions.ended(i, group_done)
        for a in self.ledger.quorum_reached(i):  # the group's quorum: its other members are aborted
            if self.versions.abort(a) and self.trace_executions:  # (a session's cell_of stays when it leaves)
                self.timeline.execution_ended(now, self._eid(a), "aborted", cell=self.serving.cell_of[a])
        self._counter()
        self._start_waiting()
        self._replan(Finished(self.ledger.step_of(i), now, execution_id=self._eid(i)))

    def _on_eval(self, i: int, _: int) -> None:
        if self.training.evaluated(i):
            self._train_then_replan(DataReady(self.ledger.version, self.clock.now, execution_id=self._eid(i)))

    def _on_batch_ready(self, step: int, _: int) -> None:
        self.training.batch_ready(step)
        self._train_then_replan(DataReady(self.ledger.version, self.clock.now))

    # == training =================================================================================
    def _on_micro_done(self, c: int, tok: int) -> None:
        self.training.micro_done(c, self.ledger.version)
        self._owed_switch(c)
        self._train_then_replan(MicroStepDone(self.ledger.version, self.clock.now, cell=c))

    def _on_optimizer_done(self, v: int, _: int) -> None:
        self.training.optimizer_done(v)
        now, version = self.clock.now, v + 1
        self.versions.step_trained(v)
        self.versions.step_ended(now, self.training.busy_s())
        self.ledger.trained(v, now)
        self.serving.version = version
        self.cells.wver[0] = version
        if self.progress is not None:
            self.progress(version, now)
        if version >= self.cfg.steps:
            self.done = True
            return
        self.training.start_boundary(version)
        self._owed_switch(0)
        self._replan(StepTrained(v, now))
        self._publish()
        self.training.claim(version)  # data of the new step that arrived while the last one trained
        self.training.check_step(version)

    def _publish(self) -> None:
        """New weights: serving cells pause for the sync; training satellites pull them."""
        sync = self.cfg.cost.switch.weight_sync_s
        for c in range(self.k):
            if self.cells.role[c] is SERVING:
                self.serving.pause(c, sync)
            elif self.cells.role[c] is TRAINING:
                self.training.pull(c, self.ledger.version, sync)

    def _on_boundary_done(self, v: int, _: int) -> None:
        self._train_then_replan(DataReady(self.ledger.version, self.clock.now))

    def _on_pull_done(self, c: int, _: int) -> None:
        self.training.pull_done(c, self.ledger.version)
        self._owed_switch(c)
        self._train_then_replan(WeightsPulled(self.ledger.version, self.clock.now, cell=c))

    # == switches =================================================================================
    def _owed_switch(self, c: int) -> None:
        """A cell that was busy when the policy asked it to switch does so now."""
        want = self.cells.take_pending(c)
        if want is not None:
            self._begin_switch(c, want)

    def _begin_switch(self, c: int, want: Role) -> None:
        now = self.clock.now
        sw = self.cfg.cost.switch
        if self.cells.begin_switch_at(c, want, now) is SERVING:
            # its sessions move; sessions of later steps yield their slots first
            moved, waited = self.serving.vacate(c, first_ahead=(self.ledger.version + 1) * self.n)
            self.cells.switch_count["migrations"] += moved
            self.cells.switch_count["waited"] += waited
            dur = sw.serving_to_training_s
        else:
            dur = sw.training_to_serving_s
        if self.timeline is not None:
            self.timeline.role(now, c, SWITCHING, reason="policy", to=want)
        self.cells.switch_tok[c] += 1
        self.clock.push(now + dur, SWITCH, c, self.cells.switch_tok[c])

    def _on_switch_done(self, c: int, _: int) -> None:
        now = self.clock.now
        want = self.cells.end_switch_at(c, now)
        if self.timeline is not None:
            self.timeline.role(now, c, want, reason="switched")
        sw = self.cfg.cost.switch
        seconds = sw.serving_to_training_s if want is TRAINING else sw.training_to_serving_s
        event = Switched(self.ledger.version, now, cell=c, seconds=seconds)
        if want is TRAINING:
            self.cells.wver[c] = self.ledger.version  # the switch includes loading the current weights
            self._train_then_replan(event)
        else:
            self.serving.reopen(c)
            self._start_waiting()
            self._replan(event)

    # == output ===================================================================================
    def _counter(self) -> None:
        if self._samples is not None:
            self._samples.sample(self.clock.now, self.wl)

    def _result(self, wall: float) -> SimResult:
        end = self.clock.now
        for c in range(self.k):
            self.cells.account(c, end)
            self.serving.touch(c)
        if self._samples is not None:
            self._samples.close(end, self.wl)
        return _result(self, end, wall)


def _result(sim: Simulator, end: float, wall: float) -> SimResult:
    """What run ``sim`` measured, its books closed at ``end``; ``wall``: seconds it took to simulate."""
    cell_time = sim.k * end
    serving_busy, training_busy = sim.serving.busy_s(), sim.training.busy_s()
    stale = np.asarray(sim.staleness) if sim.staleness else np.zeros(1)
    roles = sim.cells.fractions(cell_time)
    wasted_s = sim.versions.wasted_s()
    wasted = wasted_s / cell_time
    return SimResult(
        **_config_fields(sim.cfg),
        makespan_s=float(end),
        step_end_s=[float(t) for t in sim.ledger.step_end],
        busy_fraction=(serving_busy - wasted_s + training_busy) / cell_time,
        serving_busy_fraction=serving_busy / cell_time,
        training_busy_fraction=training_busy / cell_time,
        role_fractions=roles,
        executions=execution_stats(sim.serving),
        staleness={"mean": float(stale.mean()), "max": int(stale.max())},
        switches=dict(sim.cells.switch_count),
        training=sim.training.stats(),
        sim={"wall_s": wall, "events": sim.events},
        **sim.versions.result(cell_time),
        idle={
            "serving_empty": roles["serving"] - serving_busy / cell_time,
            "training_idle": roles["training"] - training_busy / cell_time,
            "switching": roles["switching"],
            "dropped_slots": wasted - sim.versions.aborted_s / cell_time,
            "aborted_slots": sim.versions.aborted_s / cell_time,
        },
    )


def simulate(config: SimConfig, **kwargs: Any) -> SimResult:
    """``Simulator(config, **kwargs).run()``."""
    return Simulator(config, **kwargs).run()
