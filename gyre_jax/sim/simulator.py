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

import collections
import heapq
import itertools
import math
import time as _time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from gyre_jax.elastic.policies import ClusterState, Event, Role, SchedulingPolicy, Waterlevel, make_policy
from gyre_jax.elastic.timeline import TimelineWriter
from gyre_jax.sim.cost_model import CostModel
from gyre_jax.sim.trajectory_cost import branches, capped_flops
from gyre_jax.sim.workload import SegmentPlan, WorkloadSpec, sample_step

SERVING, TRAINING, SWITCHING = Role.SERVING, Role.TRAINING, Role.SWITCHING
_SEG, _EVAL, _BATCH, _MICRO, _OPT, _SWITCH, _PULL, _BOUNDARY = range(8)
_EPS = 1e-6
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


class Simulator:
    """One simulated run. ``Simulator(config).run() -> SimResult``.

    ``timeline``: a ``TimelineWriter`` over the cells (``cell_names()``) to record role changes,
    micro-steps, optimizer steps, the waterlevel (at most every ``counter_interval_s``) and, with
    ``trace_executions``, every execution. ``progress(version, time)`` is called after each optimizer step.
    ``plans`` replaces the sampled executions with given ones (one ``SegmentPlan`` per step; calibration
    replays a real run's executions this way).
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
    ):
        self.cfg = config
        if plans is not None:
            if len(plans) != config.steps or any(p.size != config.batch_size for p in plans):
                raise SimConfigError(
                    f"plans: expected {config.steps} steps of {config.batch_size} executions, got "
                    f"{[p.size for p in plans]}"
                )
        self.given_plans = plans
        self.policy: SchedulingPolicy = make_policy(config.policy, config.num_cells, **dict(config.policy_options))
        self.timeline = timeline
        if timeline is not None and len(timeline.cell_names) != config.num_cells:
            raise SimConfigError(f"the timeline has {len(timeline.cell_names)} cells, the config {config.num_cells}")
        self.trace_executions = trace_executions and timeline is not None
        self.counter_interval_s = counter_interval_s
        self.progress = progress

    def cell_names(self) -> list[str]:
        return [f"cell{c}" for c in range(self.cfg.num_cells)]

    # == setup ====================================================================================
    def _setup(self) -> None:
        cfg, cost = self.cfg, self.cfg.cost
        k = cfg.num_cells
        self.k = k
        self.n = cfg.batch_size
        self.total = cfg.steps * self.n
        self.slots = cfg.slots_per_cell
        self.replicas = cfg.cell_accelerators // cost.serving.replica_accelerators
        self.rate = cost.training.cell_flops(cfg.cell_accelerators)
        self.micro_flops = cost.training.micro_step_flops
        sv = cost.serving  # decode step = base + per_seq * B / replicas + per_token * X / replicas (B, X per cell)
        self.dec_base = sv.decode_base_s
        self.dec_seq = sv.decode_per_seq_s / self.replicas
        self.dec_ctx = sv.decode_per_context_token_s / self.replicas
        self.now = 0.0
        self.heap: list = []
        self.seq = itertools.count()
        self.events = 0
        self.done = False

        roles = self.policy.initial_roles()
        self.role: list[Role] = list(roles)
        self.target: list[Role | None] = [None] * k
        self.busy = [False] * k
        self.pending_switch: list[Role | None] = [None] * k
        self.any_pending = False
        self.resident = [0] * k
        self.load_b = [0.0] * k
        self.load_x = [0.0] * k
        self.load_p = [0.0] * k  # sum of the resident sessions' prefill shares (prefill_interference)
        self.sessions: list[set[int]] = [set() for _ in range(k)]
        self.wver = [0] * k  # weight version held by a training cell
        self.switch_tok = [0] * k
        self.micro_work = [0.0] * k
        self.micro_t0 = [0.0] * k
        # accounting
        self.role_since = [0.0] * k
        self.role_time = [dict.fromkeys(("serving", "training", "switching"), 0.0) for _ in range(k)]
        self.occ_area = [0.0] * k
        self.occ_last = [0.0] * k
        self.pause_area = [0.0] * k
        self.micro_time = [0.0] * k
        self.opt_time = 0.0
        self.micro_count = 0
        self.warm = [False] * k  # the cell has run a micro-step (its gradient step is compiled)
        self.opt_warm = False
        self.switch_count = {"serving_to_training": 0, "training_to_serving": 0, "migrations": 0, "waited": 0}

        # executions (global index i: step i // n, position i % n)
        e = self.total
        self.plans: dict[int, SegmentPlan] = {}
        self.work_full: dict[int, list[float]] = {}
        self.cell_of = [-1] * e
        self.start_t = [0.0] * e
        self.dispatch_t = [0.0] * e
        self.dispatch_ver = [0] * e
        self.seg = [0] * e
        self.seg_t0 = [0.0] * e
        self.seg_full = [0.0] * e
        self.seg_end = [0.0] * e
        self.tok = [0] * e
        self.timed = [False] * e
        self.duty = [0.0] * e
        self.pduty = [0.0] * e  # share of the current segment spent prefilling
        self.ctx = [0.0] * e
        self.deadline = [0.0] * e
        self.held_frac: dict[int, float] = {}  # session -> share of its segment still to run
        self.held_t: dict[int, float] = {}  # session -> when it lost its slot (its timeout clock stops)
        self.exec_work = [0.0] * e
        self.durations: list[float] = []
        self.tokens_done: list[float] = []  # trajectory tokens of each ended execution
        self.waits: list[float] = []
        self.timeouts = 0
        self.next_exec = 0
        self.queue: collections.deque[int] = collections.deque()
        self.no_free_slot = False
        self.held: list[int] = []  # heap: the oldest step's sessions get a slot first

        # per step
        s = cfg.steps
        self.disp_count = [0] * s
        self.fin_count = [0] * s
        self.eval_count = [0] * s
        self.queued_count = [0] * s  # executions whose micro-steps are in the queue
        self.group_evals: dict[tuple[int, int], int] = {}  # (step, task) -> executions evaluated (stream_unit)
        self.group_next = [0] * s  # the next task whose group enters the queue (stream_unit="group_in_order")
        self.ready_work = [0.0] * s
        self.total_work = [0.0] * s
        self.in_flight = [0] * s
        self.sat_used = [False] * s
        self.version = 0
        self.due_out = 0  # executions of steps <= version dispatched and not finished
        self.opt_running = False
        self.boundary_until = 0.0  # no micro-step is claimed before (pipeline.step_boundary_s after a step)
        self.step_end: list[float] = []
        self.staleness: list[int] = []

        self.wl = Waterlevel()
        self.state = ClusterState(
            time=0.0,
            roles=self.role,
            capacity=[self.slots] * k,
            waterlevel=self.wl,
            targets=self.target,
            busy=self.busy,
            batch_size=self.n,
        )
        self._counter_t = -math.inf
        self._counter_pending: tuple | None = None
        tl = self.timeline
        if tl is not None:
            for c in range(k):
                tl.role(0.0, c, self.role[c], reason="start")

    # == the loop =================================================================================
    def run(self) -> SimResult:
        t_wall = _time.perf_counter()
        self._setup()
        self._replan("tick", None)
        heap, pop = self.heap, heapq.heappop
        handlers = {
            _SEG: self._on_segment_end,
            _EVAL: self._on_eval,
            _BATCH: self._on_batch_ready,
            _MICRO: self._on_micro_done,
            _OPT: self._on_optimizer_done,
            _SWITCH: self._on_switch_done,
            _PULL: self._on_pull_done,
            _BOUNDARY: self._on_boundary_done,
        }
        seg_handler = self._on_segment_end
        tok = self.tok
        while heap and not self.done:
            t, _, kind, x, y = pop(heap)
            if kind == _SEG:
                if y != tok[x]:
                    continue
                self.now = t
                self.events += 1
                seg_handler(x)
                continue
            self.now = t
            self.events += 1
            handlers[kind](x, y)
        if not self.done:
            raise RuntimeError(
                f"simulation stalled at t={self.now:.0f}s after {self.version}/{self.cfg.steps} steps: "
                f"policy {self.cfg.policy} left no cell able to make progress (roles {self._roles_text()})"
            )
        return self._result(_time.perf_counter() - t_wall)

    def _push(self, t: float, kind: int, x: int, y: int = 0) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, x, y))

    def _roles_text(self) -> str:
        return " ".join(f"{c}:{r.value[:5]}" for c, r in enumerate(self.role))

    # == policy ===================================================================================
    def _ready_micro_steps(self, v: int) -> int:
        if v >= self.cfg.steps:
            return 0
        w = self.ready_work[v]
        complete = self.queued_count[v] == self.n
        if not complete:
            w -= self.cfg.pack_lookahead * self.micro_flops  # still in the packer's open micro-batches
        if w <= _EPS:
            return 0
        full = int(w // self.micro_flops)
        rest = w - full * self.micro_flops
        return full + (1 if complete and rest > _EPS else 0)

    def _replan(self, kind: str, execution: int | None, cell: int | None = None) -> None:
        st = self.state
        for _ in range(16):
            v = self.version
            st.time = self.now
            st.version = v
            st.undispatched = self.total - self.next_exec
            st.due_outstanding = self.due_out
            st.held = len(self.held)
            if v < self.cfg.steps:
                st.step_dispatched = self.disp_count[v]
                st.step_finished = self.fin_count[v]
                st.step_processed = self.queued_count[v]
                st.ready = self._ready_micro_steps(v)
                st.in_flight = self.in_flight[v]
            else:
                st.step_dispatched = st.step_finished = st.step_processed = st.ready = st.in_flight = 0
            event = Event(
                kind,
                min(v, self.cfg.steps - 1),
                self.now,
                execution_id=None if execution is None else str(execution),
                cell=cell,
            )
            decision = self.policy.plan(event, st)
            self._apply_roles(decision.roles)
            n = min(decision.dispatch, self.total - self.next_exec)
            if n > 0:
                self._dispatch(n)
            started = self._start_waiting()
            if not n and not started:
                return
            kind, execution, cell = "started", None, None

    def _apply_roles(self, wanted: list[Role]) -> None:
        if len(wanted) != self.k:
            raise RuntimeError(f"policy {self.cfg.policy} returned {len(wanted)} roles for {self.k} cells")
        role, busy, pending = self.role, self.busy, self.pending_switch
        if wanted == role and not self.any_pending:
            return
        self.any_pending = False
        for c in range(self.k):
            want, cur = wanted[c], role[c]
            if cur is SWITCHING:
                continue
            if want is cur:
                pending[c] = None
                continue
            if want is not SERVING and want is not TRAINING:
                raise RuntimeError(
                    f"policy {self.cfg.policy} asked cell {c} for role {want!r} (SERVING or TRAINING only)"
                )
            if busy[c]:
                pending[c] = want  # finishes its micro-step / weight pull first
                self.any_pending = True
                continue
            self._begin_switch(c, want)

    # == executions ===============================================================================
    def _plan(self, step: int) -> SegmentPlan:
        plan = self.plans.get(step)
        if plan is None:
            cfg = self.cfg
            if self.given_plans is not None:
                plan = self.given_plans[step]
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

    def _work_for(self, tokens: float) -> float:
        b = branches(np.array([tokens]), self.cfg.workload.trajectory_shape())
        return float(capped_flops(b, self.cfg.max_branches, self.cfg.cost.training)[0]) * self.cfg.train_work_scale

    def _dispatch(self, count: int) -> None:
        for _ in range(count):
            i = self.next_exec
            self.next_exec += 1
            step = i // self.n
            self._plan(step)
            self.disp_count[step] += 1
            if step <= self.version:
                self.due_out += 1
            self.dispatch_t[i] = self.now
            self.dispatch_ver[i] = self.version
            self.queue.append(i)
        self.wl.dispatched += count
        self._counter()

    def _best_cell(self, exclude: int = -1) -> int:
        """Where a session goes: the serving cell with a free slot that stays serving longest (the highest
        index: cells leave in index order), so cells next in line to leave hold few sessions; with
        ``placement="balanced"`` the serving cell with the fewest sessions."""
        role, resident, slots = self.role, self.resident, self.slots
        if self.cfg.placement == "balanced":
            best = -1
            for c in range(self.k):
                if (
                    role[c] is SERVING
                    and c != exclude
                    and resident[c] < slots
                    and (best < 0 or resident[c] < resident[best])
                ):
                    best = c
            return best
        for c in range(self.k - 1, -1, -1):
            if role[c] is SERVING and c != exclude and resident[c] < slots:
                return c
        return -1

    def _start_waiting(self) -> int:
        """Gives free slots to moved sessions and dispatched executions, the oldest step first."""
        started = 0
        if self.no_free_slot:
            return 0
        while self.held or self.queue:
            c = self._best_cell()
            if c < 0:
                self.no_free_slot = True  # until a slot frees or a cell starts serving
                break
            if self.held and (not self.queue or self.held[0] < self.queue[0]):
                i = heapq.heappop(self.held)
                frac = self.held_frac.pop(i)
                self.deadline[i] += self.now - self.held_t.pop(i)
                self._attach(i, c, frac, self.cfg.cost.switch.kv_migration_s_per_token * self.ctx[i])
                continue
            i = self.queue.popleft()
            self.start_t[i] = self.now
            self.deadline[i] = self.now + self.cfg.workload.timeout_s
            self.waits.append(self.now - self.dispatch_t[i])
            self.seg[i] = 0
            self.wl.started += 1
            started += 1
            if self.trace_executions:
                self.timeline.execution_started(self.now, self._eid(i), step=i // self.n, cell=c)
            self._attach(i, c, 1.0, 0.0)
        if started:
            self._counter()
        return started

    def _eid(self, i: int) -> str:
        step, j = divmod(i, self.n)
        return f"s{step}-t{j // self.cfg.group_size}-g{j % self.cfg.group_size}"

    def _touch(self, c: int) -> None:
        self.occ_area[c] += self.resident[c] * (self.now - self.occ_last[c])
        self.occ_last[c] = self.now

    def _attach(self, i: int, c: int, frac: float, delay: float) -> None:
        self._touch(c)
        self.cell_of[i] = c
        self.resident[c] += 1
        self.sessions[c].add(i)
        self._begin_segment(i, frac, delay)

    def _detach(self, i: int) -> float:
        """Takes session i off its cell; returns the share of its current segment still to run."""
        c = self.cell_of[i]
        self._touch(c)
        d = self.duty[i]
        self.load_b[c] -= d
        self.load_x[c] -= d * self.ctx[i]
        self.load_p[c] -= self.pduty[i]
        self.resident[c] -= 1
        self.sessions[c].discard(i)
        self.no_free_slot = False
        if self.resident[c] == 0:
            self.load_b[c] = self.load_x[c] = self.load_p[c] = 0.0
        self.tok[i] += 1
        full = self.seg_full[i]
        return max(0.0, self.seg_end[i] - max(self.now, self.seg_t0[i])) / full if full > 0 else 0.0

    def _begin_segment(self, i: int, frac: float, delay: float) -> None:
        step, j = divmod(i, self.n)
        p = self.plans[step]
        k = p.offset[j] + self.seg[i]
        c = self.cell_of[i]
        ctx = p.ctx[k]
        load_b, load_x = self.load_b, self.load_x
        step_s = self.dec_base + self.dec_seq * (load_b[c] + 1.0) + self.dec_ctx * (load_x[c] + ctx)
        if self.cfg.prefill_interference:
            step_s *= 1.0 + max(0.0, self.load_p[c] / self.replicas)
        prefill = p.prefill_s[k]
        model_s = prefill + p.gen[k] * step_s
        dur = p.tool_s[k] + model_s
        duty = model_s / dur if dur > 0 else 0.0
        self.duty[i] = duty
        pduty = prefill / dur if dur > 0 else 0.0
        self.pduty[i] = pduty
        self.load_p[c] += pduty
        self.ctx[i] = ctx
        load_b[c] += duty
        load_x[c] += duty * ctx
        t0 = self.now + delay
        end = t0 + frac * dur
        self.seg_t0[i] = t0
        self.seg_full[i] = dur
        self.seg_end[i] = end
        tok = self.tok[i] + 1
        self.tok[i] = tok
        deadline = self.deadline[i]
        timed = end >= deadline
        self.timed[i] = timed
        heapq.heappush(self.heap, (deadline if timed else end, next(self.seq), _SEG, i, tok))

    def _on_segment_end(self, i: int) -> None:
        c = self.cell_of[i]
        d = self.duty[i]
        self.load_b[c] -= d
        self.load_x[c] -= d * self.ctx[i]
        self.load_p[c] -= self.pduty[i]
        step, j = divmod(i, self.n)
        p = self.plans[step]
        k = p.offset[j] + self.seg[i]
        if self.timed[i]:
            prev = p.tokens_end[k - 1] if self.seg[i] > 0 else float(self.cfg.workload.initial_context)
            full = self.seg_full[i]
            done = 1.0 - (self.seg_end[i] - self.now) / full if full > 0 else 1.0
            tokens = prev + (p.tokens_end[k] - prev) * min(max(done, 0.0), 1.0)
            self.timeouts += 1
            self.tokens_done.append(tokens)
            self._finish(i, "timeout", self._work_for(tokens))
            return
        self.seg[i] += 1
        if self.seg[i] >= p.count[j]:
            self.tokens_done.append(float(p.tokens[j]))
            self._finish(i, "finished", self.work_full[step][j])
            return
        self._begin_segment(i, 1.0, 0.0)

    def _finish(self, i: int, status: str, work: float) -> None:
        c = self.cell_of[i]
        self._touch(c)
        self.resident[c] -= 1
        self.sessions[c].discard(i)
        self.no_free_slot = False
        if self.resident[c] == 0:
            self.load_b[c] = self.load_x[c] = self.load_p[c] = 0.0
        self.tok[i] += 1
        step, j = divmod(i, self.n)
        self.fin_count[step] += 1
        if step <= self.version:
            self.due_out -= 1
        self.wl.finished += 1
        self.durations.append(self.now - self.start_t[i])
        self.exec_work[i] = work
        if self.trace_executions:
            self.timeline.execution_ended(self.now, self._eid(i), status, cell=c)
        p = self.plans[step]
        delay = p.eval_s[j]
        if self.cfg.streaming:
            delay += float(p.tokens[j]) * self.cfg.cost.pipeline.processing_s_per_token
        self._push(self.now + delay, _EVAL, i)
        self._counter()
        self._start_waiting()
        self._replan("finished", i)

    def _on_eval(self, i: int, _: int) -> None:
        step = i // self.n
        self.eval_count[step] += 1
        self.total_work[step] += self.exec_work[i]
        if self.cfg.streaming:
            if not self._stream(i, step):
                return
        elif self.eval_count[step] == self.n:
            tokens = float(np.sum(self.plans[step].tokens))
            pipe = self.cfg.cost.pipeline
            self._push(self.now + tokens * pipe.processing_s_per_token / pipe.workers, _BATCH, step)
            return
        else:
            return
        self._claim()
        self._check_step()
        self._replan("data_ready", i)

    def _stream(self, i: int, step: int) -> bool:
        """Puts what execution i's evaluation completes into the micro-step queue (``stream_unit``); False if
        nothing entered it."""
        unit = self.cfg.stream_unit
        if unit == "execution":
            self.queued_count[step] += 1
            self.ready_work[step] += self.exec_work[i]
            return True
        g = self.cfg.group_size
        task = (i % self.n) // g
        done = self.group_evals.get((step, task), 0) + 1
        self.group_evals[(step, task)] = done
        if unit == "group":
            if done < g:
                return False
            self._queue_group(step, task)
            return True
        released = False
        while self.group_evals.get((step, self.group_next[step]), 0) == g:
            self._queue_group(step, self.group_next[step])
            self.group_next[step] += 1
            released = True
        return released

    def _queue_group(self, step: int, task: int) -> None:
        g = self.cfg.group_size
        first = step * self.n + task * g
        self.queued_count[step] += g
        self.ready_work[step] += sum(self.exec_work[first : first + g])

    def _on_batch_ready(self, step: int, _: int) -> None:
        self.queued_count[step] = self.n
        self.ready_work[step] = self.total_work[step]
        self._claim()
        self._check_step()
        self._replan("data_ready", None)

    # == training =================================================================================
    def _claim(self) -> None:
        v = self.version
        if v >= self.cfg.steps or self.opt_running or self.now < self.boundary_until:
            return
        ready = self.ready_work[v]
        if ready <= _EPS:
            return
        complete = self.queued_count[v] == self.n
        m = self.micro_flops
        held = 0.0 if complete else self.cfg.pack_lookahead * m  # in the packer's open micro-batches
        tr = self.cfg.cost.training
        role, busy, pending, wver = self.role, self.busy, self.pending_switch, self.wver
        for c in range(self.k):
            if role[c] is not TRAINING or busy[c] or pending[c] is not None or wver[c] != v:
                continue
            if ready - held < m - _EPS and not complete:
                break
            w = min(m, ready)
            ready -= w
            busy[c] = True
            self.micro_work[c] = w
            self.micro_t0[c] = self.now
            self.in_flight[v] += 1
            if c != 0:
                self.sat_used[v] = True
            self.switch_tok[c] += 1
            compile_s = 0.0 if self.warm[c] else tr.warmup_micro_step_s
            self.warm[c] = True
            self._push(self.now + tr.micro_step_overhead_s + w / self.rate + compile_s, _MICRO, c, self.switch_tok[c])
            if ready <= _EPS:
                ready = 0.0
                break
        self.ready_work[v] = ready

    def _on_micro_done(self, c: int, tok: int) -> None:
        v = self.version
        self.busy[c] = False
        self.in_flight[v] -= 1
        self.micro_count += 1
        self.micro_time[c] += self.now - self.micro_t0[c]
        if self.timeline is not None:
            self.timeline.micro_step(self.micro_t0[c], self.now, c, v, flops=self.micro_work[c])
        if self.pending_switch[c] is not None:
            want = self.pending_switch[c]
            self.pending_switch[c] = None
            self._begin_switch(c, want)
        self._claim()
        self._check_step()
        self._replan("micro_step_done", None, c)

    def _check_step(self) -> None:
        v = self.version
        if (
            v >= self.cfg.steps
            or self.opt_running
            or self.queued_count[v] < self.n
            or self.ready_work[v] > _EPS
            or self.in_flight[v]
        ):
            return
        if self.role[0] is not TRAINING or self.busy[0]:
            return  # the core applies the optimizer step once it is training and free
        tr = self.cfg.cost.training
        dur = tr.optimizer_step_s + (tr.grad_reduce_s if self.sat_used[v] else 0.0)
        if not self.opt_warm:
            dur += tr.warmup_optimizer_step_s
            self.opt_warm = True
        self.opt_running = True
        self.busy[0] = True
        self.micro_t0[0] = self.now
        self._push(self.now + dur, _OPT, v)

    def _on_optimizer_done(self, v: int, _: int) -> None:
        self.opt_running = False
        self.busy[0] = False
        self.opt_time += self.now - self.micro_t0[0]
        if self.timeline is not None:
            self.timeline.optimizer_step(self.micro_t0[0], self.now, 0, v, v + 1)
        for i in range(v * self.n, (v + 1) * self.n):
            self.staleness.append(v - self.dispatch_ver[i])
        self.version = v + 1
        self.wver[0] = self.version
        if self.version < self.cfg.steps:
            self.due_out += self.disp_count[self.version] - self.fin_count[self.version]
        self.step_end.append(self.now)
        if self.progress is not None:
            self.progress(self.version, self.now)
        if self.version >= self.cfg.steps:
            self.done = True
            return
        boundary = self.cfg.cost.pipeline.step_boundary_s
        if boundary > 0:
            self.boundary_until = self.now + boundary
            self._push(self.boundary_until, _BOUNDARY, self.version)
        if self.pending_switch[0] is not None:
            want = self.pending_switch[0]
            self.pending_switch[0] = None
            self._begin_switch(0, want)
        self._replan("step_trained", None)
        self._publish()
        self._claim()  # data of the new step that arrived while the last one trained
        self._check_step()

    def _publish(self) -> None:
        """New weights: serving cells pause for the sync; training satellites pull them."""
        sync = self.cfg.cost.switch.weight_sync_s
        for c in range(self.k):
            if self.role[c] is SERVING:
                if sync > 0 and self.sessions[c]:
                    self.pause_area[c] += self.resident[c] * sync
                    for i in sorted(self.sessions[c]):
                        frac = self._detach(i)
                        self._attach(i, c, frac, sync)
            elif self.role[c] is TRAINING and c != 0 and not self.busy[c] and self.wver[c] != self.version:
                self.busy[c] = True
                self.switch_tok[c] += 1
                self._push(self.now + sync, _PULL, c, self.switch_tok[c])

    def _on_boundary_done(self, v: int, _: int) -> None:
        self._claim()
        self._check_step()
        self._replan("data_ready", None)

    def _on_pull_done(self, c: int, _: int) -> None:
        self.busy[c] = False
        self.wver[c] = self.version
        if self.pending_switch[c] is not None:
            want = self.pending_switch[c]
            self.pending_switch[c] = None
            self._begin_switch(c, want)
        self._claim()
        self._check_step()
        self._replan("micro_step_done", None, c)

    # == switches =================================================================================
    def _account_role(self, c: int) -> None:
        name = self.role[c].value
        self.role_time[c][name] += self.now - self.role_since[c]
        self.role_since[c] = self.now

    def _begin_switch(self, c: int, want: Role) -> None:
        old = self.role[c]
        self._account_role(c)
        self.role[c] = SWITCHING
        self.target[c] = want
        sw = self.cfg.cost.switch
        if old is SERVING:
            self.switch_count["serving_to_training"] += 1
            first_ahead = (self.version + 1) * self.n  # sessions of later steps yield their slots first
            for i in sorted(self.sessions[c]):
                frac = self._detach(i)
                dest = self._best_cell(exclude=c)
                if dest < 0 and i < first_ahead:
                    dest = self._evict_ahead(first_ahead)
                if dest < 0:
                    self._hold(i, frac)
                else:
                    self.switch_count["migrations"] += 1
                    self._attach(i, dest, frac, sw.kv_migration_s_per_token * self.ctx[i])
            dur = sw.serving_to_training_s
        else:
            self.switch_count["training_to_serving"] += 1
            dur = sw.training_to_serving_s
        if self.timeline is not None:
            self.timeline.role(self.now, c, SWITCHING, reason="policy", to=want)
        self.switch_tok[c] += 1
        self._push(self.now + dur, _SWITCH, c, self.switch_tok[c])

    def _hold(self, i: int, frac: float) -> None:
        heapq.heappush(self.held, i)
        self.held_frac[i] = frac
        self.held_t[i] = self.now
        self.switch_count["waited"] += 1

    def _evict_ahead(self, first_ahead: int) -> int:
        """Frees a slot for a due session: the youngest session of a later step, on a serving cell, waits."""
        victim = -1
        for c in range(self.k):
            if self.role[c] is SERVING and self.sessions[c]:
                youngest = max(self.sessions[c])
                if youngest >= first_ahead and youngest > victim:
                    victim = youngest
        if victim < 0:
            return -1
        dest = self.cell_of[victim]
        self._hold(victim, self._detach(victim))
        return dest

    def _on_switch_done(self, c: int, _: int) -> None:
        self._account_role(c)
        want = self.target[c]
        self.role[c] = want
        self.target[c] = None
        if self.timeline is not None:
            self.timeline.role(self.now, c, want, reason="switched")
        if want is TRAINING:
            self.wver[c] = self.version  # the switch includes loading the current weights
            self._claim()
            self._check_step()
        else:
            self.occ_last[c] = self.now
            self.no_free_slot = False
            self._start_waiting()
        self._replan("switched", None, c)

    # == output ===================================================================================
    def _counter(self) -> None:
        """Waterlevel samples at most every ``counter_interval_s``; a change that was not written is written
        (at its own time) before the next sample, so the curve is exact up to that resolution."""
        if self.timeline is None:
            return
        wl = self.wl
        values = (wl.dispatched, wl.started, wl.finished)
        if self.now - self._counter_t >= self.counter_interval_s:
            if self._counter_pending is not None and self._counter_pending[0] > self._counter_t:
                self.timeline.waterlevel(*self._counter_pending)
            self.timeline.waterlevel(self.now, *values)
            self._counter_t = self.now
            self._counter_pending = None
        else:
            self._counter_pending = (self.now, *values)

    def _result(self, wall: float) -> SimResult:
        cfg, k, end = self.cfg, self.k, self.now
        for c in range(k):
            self._account_role(c)
            self._touch(c)
        if self.timeline is not None:
            if self._counter_pending is not None:
                self.timeline.waterlevel(*self._counter_pending)
            wl = self.wl
            self.timeline.waterlevel(end, wl.dispatched, wl.started, wl.finished)
        cell_time = k * end
        serving_busy = sum(max(0.0, self.occ_area[c] - self.pause_area[c]) / self.slots for c in range(k))
        training_busy = sum(self.micro_time) + self.opt_time
        roles = {
            name: float(sum(self.role_time[c][name] for c in range(k)) / cell_time)
            for name in ("serving", "training", "switching")
        }
        d = np.asarray(self.durations) if self.durations else np.zeros(1)
        waits = np.asarray(self.waits) if self.waits else np.zeros(1)
        stale = np.asarray(self.staleness) if self.staleness else np.zeros(1)
        return SimResult(
            name=cfg.name or cfg.workload.name,
            policy=cfg.policy,
            policy_options=dict(cfg.policy_options),
            streaming=cfg.streaming,
            seed=cfg.seed,
            steps=cfg.steps,
            accelerators=cfg.accelerators,
            num_cells=k,
            cell_accelerators=cfg.cell_accelerators,
            batch_size=self.n,
            max_branches=cfg.max_branches,
            makespan_s=float(end),
            step_end_s=[float(t) for t in self.step_end],
            busy_fraction=(serving_busy + training_busy) / cell_time,
            serving_busy_fraction=serving_busy / cell_time,
            training_busy_fraction=training_busy / cell_time,
            role_fractions=roles,
            executions={
                "ended": len(self.durations),
                "timeout_fraction": self.timeouts / max(1, len(self.durations)),
                "duration_mean_s": float(d.mean()),
                "duration_p50_s": float(np.percentile(d, 50)),
                "duration_p90_s": float(np.percentile(d, 90)),
                "duration_max_s": float(d.max()),
                "wait_mean_s": float(waits.mean()),
                "tokens_mean": float(np.mean(self.tokens_done)) if self.tokens_done else 0.0,
            },
            staleness={"mean": float(stale.mean()), "max": int(stale.max())},
            switches=dict(self.switch_count),
            training={
                "flops": float(sum(self.total_work[: cfg.steps])),
                "micro_steps": self.micro_count,
                "micro_step_cell_s": float(sum(self.micro_time)),
                "optimizer_s": self.opt_time,
            },
            sim={"wall_s": wall, "events": self.events},
        )


def simulate(config: SimConfig, **kwargs: Any) -> SimResult:
    """``Simulator(config, **kwargs).run()``."""
    return Simulator(config, **kwargs).run()
