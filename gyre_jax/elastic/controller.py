"""The cell controller: runs RL steps on cells that switch between serving rollouts and training.

One controller drives all three scheduling policies (``policies.py``: colocated, async, elastic); the
policy object decides, the controller carries out. It owns:

- **Cells** (``CellRuntime``): each is a real submesh with a serving loop (engine + continuous batching,
  behind the router) and a ``GradWorker`` (jitted gradient micro-steps on the same devices). Cell 0 is
  the *core*: its worker is the ``Learner``'s, and the core holds the authoritative params and the only
  optimizer state. A cell's role is SERVING, TRAINING or SWITCHING.
- **Executions**: dispatched in task order (d), started when a serving slot is free (p), finished when
  the harness ends and the evaluator scored it (f). ``cells.sessions_per_cell`` slots per serving cell.
- **Data**: when a task's group of G executions has all finished, its advantages are normalized (after
  the staleness bound drops stale ones), the group is appended to the durable execution queue and the
  Grain pipeline packs micro-batches from it, which go straight into the step's ``MicroStepQueue``
  (streaming: training starts before the step's last execution ends). Groups of later steps (dispatched
  ahead, within the staleness bound) wait in memory until their step is the one training.
- **Training**: every cell whose role is TRAINING claims micro-steps of the current step from the queue
  (satellites first pull a weight snapshot of the core's params onto their own submesh, device to
  device); gradients go to the core's ordered accumulator; when the step's queue is done the core
  applies AdamW once. Weights stay fixed within a step. The new weights go to every serving cell.
- **Switches** (each in its own thread, both directions timed): serving -> training: the router stops
  sending the cell new calls, the cell's sessions (KV included, requests in flight too) are exported and
  imported into the serving cell that stays longest, the session pins move with them, and a satellite
  pulls the training snapshot. Training -> serving: the cell finishes its micro-step, gets the current
  weights in the serving layout, and the router sends it calls again. A harness never sees a switch.

Threads: the *driver* (the caller of ``run``) owns every fact (roles, counters, steps) and is the only
one that calls the policy; workers, executions and switches post events to it. Every decision is
logged with its event and state (``decisions.jsonl``), so a policy can be replayed alone on the same
sequence and must decide the same (``tests/elastic/test_controller.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import queue as queue_lib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from gyre_jax.elastic.cells import Cell
from gyre_jax.elastic.policies import ClusterState, Decision, Event, Role, SchedulingPolicy, Waterlevel
from gyre_jax.elastic.remote import move_sessions
from gyre_jax.elastic.timeline import TimelineWriter
from gyre_jax.rl.accumulator import GradAccumulator
from gyre_jax.rl.advantages import group_advantages
from gyre_jax.rl.learner import Learner, TrainState
from gyre_jax.rl.micro_step import GradWorker
from gyre_jax.rl.microstep_queue import MicroStepQueue, QueueAborted
from gyre_jax.rollout.executor import ExecutionResult, ExecutionSpec, Executor
from gyre_jax.serving.loop import ServingLoop

log = logging.getLogger("gyre_jax.controller")

STREAM_ORDERS = ("task", "arrival")


@dataclass
class CellRuntime:
    """One cell's runtime: its serving loop and gradient worker, and the role facts the driver keeps."""

    cell: Cell
    loop: ServingLoop
    serving_shardings: Any  # params pytree of NamedSharding: the serving layout on this cell
    worker: GradWorker  # the training layout on this cell (the core's is the Learner's worker)
    role: Role = Role.SERVING
    target: Role | None = None  # the role a SWITCHING cell moves to
    busy: bool = False  # computing a micro-step (written by its worker thread)
    # training side, used by the cell's worker thread
    gate: threading.Event = field(default_factory=threading.Event)  # set while the cell may claim micro-steps
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while claiming/computing one micro-step
    snapshot: Any = None
    snapshot_version: int = -1
    # accounting (seconds)
    train_s: float = 0.0
    switch_s: float = 0.0
    switches: int = 0
    micro_steps: int = 0

    @property
    def index(self) -> int:
        return self.cell.index

    @property
    def remote(self) -> bool:
        """The cell runs on another process (``remote.RemoteLoop`` / ``RemoteWorker`` stand in for it)."""
        return bool(getattr(self.loop, "remote", False))

    def serving_params(self, params):
        """``params`` (the core's) for ``loop.update_params``: a local cell gets them on its serving layout
        (device to device); a remote loop moves them itself (a cross-process program with its process)."""
        if self.remote:
            return params
        return jax.device_put(params, self.serving_shardings, may_alias=False)

    @property
    def name(self) -> str:
        return self.cell.name


@dataclass
class StepRun:
    """Step ``step``'s executions and data, as the driver tracks them."""

    step: int
    specs: list[ExecutionSpec]
    group_order: list[str]  # group ids in task order
    members: dict[str, list[str]]  # group id -> execution ids
    dispatched: int = 0
    finished: int = 0
    processed: int = 0  # executions appended to the execution queue
    results: dict[str, ExecutionResult] = field(default_factory=dict)
    fed_groups: set[str] = field(default_factory=set)
    completed_groups: list[str] = field(default_factory=list)  # in completion order
    staleness: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)  # model calls (TITO records) per execution
    dropped_stale: int = 0
    skipped_groups: int = 0
    pipeline_stats: collections.Counter = field(default_factory=collections.Counter)
    pipeline_excluded: list = field(default_factory=list)
    t_first_dispatch: float | None = None
    t_last_finish: float | None = None


@dataclass
class ControllerConfig:
    """What the controller needs from the run config (``RunConfig.controller_config()`` derives it)."""

    tasks_per_step: int
    group_size: int
    sessions_per_cell: int
    max_staleness: int  # the drop bound, config.rl.drop_staleness (-1: no bound)
    micro_steps_per_step: int  # slots per step's queue (0: derived from the data bound)
    max_branches: int
    stream_order: str = "task"
    claim_timeout_s: float = 0.05
    tick_s: float = 1.0  # a "tick" event after this long without one (time-based rules, e.g. idle_before_return_s)

    @property
    def batch_size(self) -> int:
        return self.tasks_per_step * self.group_size


class Controller:
    """Runs RL steps ``[start, end)`` under ``policy`` (see the module docstring).

    ``make_specs(step)``: the step's executions in task order (the callee also sets aside leftovers of an
    interrupted attempt). ``on_step(step, state, metrics, results, pipeline_state)``: called by the driver
    right after a step's optimizer update, before any later step's data enters the pipeline
    (``pipeline_state`` is the checkpointable pipeline state at that boundary).
    """

    def __init__(
        self,
        *,
        cfg: ControllerConfig,
        cells: list[CellRuntime],
        learner: Learner,
        state: TrainState,
        policy: SchedulingPolicy,
        router,
        executor: Executor,
        records,
        pipeline,
        make_specs: Callable[[int], list[ExecutionSpec]],
        on_step: Callable[..., None],
        timeline: TimelineWriter,
        stop: threading.Event,
        decisions_path: Path | None = None,
        measurements_path: Path | None = None,
        rl_kind: str = "rl",
    ):
        if policy.num_cells != len(cells):
            raise ValueError(f"the policy has {policy.num_cells} cells but the controller {len(cells)}")
        self.cfg = cfg
        self.cells = cells
        self.learner = learner
        self.state = state
        self.policy = policy
        self.router = router
        self.executor = executor
        self.records = records
        self.pipeline = pipeline
        self.make_specs = make_specs
        self.on_step = on_step
        self.timeline = timeline
        self.stop = stop
        self.rl_kind = rl_kind
        self._events: queue_lib.Queue = queue_lib.Queue()
        self._state_lock = threading.Lock()  # self.state is read by snapshots and replaced by the optimizer step
        self._decisions = open(decisions_path, "a", encoding="utf-8") if decisions_path is not None else None
        self._closing = threading.Event()
        self._workers: list[threading.Thread] = []
        self._switch_threads: list[threading.Thread] = []
        self.boundary_pipeline_state = pipeline.get_state()
        self.measurements_path = measurements_path
        m = learner.model_cfg
        self._flops_per_token = 6.0 * m.num_params  # forward + backward, the simulator's training cost formula
        self._flops_per_token_pair = 6.0 * m.num_layers * m.num_heads * m.head_dim
        self.measurements: dict[str, Any] = {
            "source": "gyre_jax controller",
            "cell_accelerators": len(cells[0].cell.devices),
            "micro_steps": [],
            "optimizer_steps": [],
            "serving_to_training": [],
            "training_to_serving": [],
            "weight_syncs": [],
        }

    # == public ====================================================================================
    def run(self, start: int, end: int) -> int:
        """Trains steps ``start .. end - 1``; returns the next step to train (``end`` unless stopped)."""
        n = self.cfg.batch_size
        self.version = start  # the step that trains next
        self.start, self.end = start, end
        self.wl = Waterlevel()
        self.steps: dict[int, StepRun] = {}
        self.waiting: collections.deque[tuple[int, ExecutionSpec]] = collections.deque()
        self.running = 0
        self._dispatch_ptr = 0  # executions dispatched since start
        self._total = (end - start) * n
        self._t_step = time.time()
        self._idle_mark = self._cell_marks()
        self._new_step_queue()
        self._it = iter(self.pipeline)
        self._closing.clear()
        for c in self.cells:
            th = threading.Thread(target=self._worker, args=(c,), name=f"train-{c.name}", daemon=True)
            th.start()
            self._workers.append(th)
        now = time.time()
        initial = self.policy.initial_roles()
        self._decide(Event("step_began", start, now, executions_in_step=n), Decision(roles=initial, dispatch=0))
        self._plan(Event("step_began", start, now, executions_in_step=n))
        try:
            while self.version < end and not self.stop.is_set():
                try:
                    kind, payload = self._events.get(timeout=self.cfg.tick_s)
                except queue_lib.Empty:
                    kind, payload = "tick", {}
                if kind == "error":
                    raise RuntimeError(payload["message"])
                event = self._handle(kind, payload)
                self._maybe_train()
                if self.version >= end:
                    break
                self._plan(event)
                self._start_waiting()
        finally:
            self._shutdown()
        return self.version

    # == driver: facts and events =================================================================
    def _post(self, kind: str, **payload) -> None:
        self._events.put((kind, payload))

    def _handle(self, kind: str, p: dict) -> Event:
        now = time.time()
        if kind == "finished":
            r: ExecutionResult = p["result"]
            step = p["step"]
            run = self.steps[step]
            run.results[r.execution_id] = r
            run.finished += 1
            run.t_last_finish = now
            self.wl.finished += 1
            self.running -= 1
            self.timeline.execution_ended(now, r.execution_id, r.status, step=step, reward=r.reward)
            self.timeline.waterlevel(now, self.wl.dispatched, self.wl.started, self.wl.finished)
            group = r.group_id
            if all(e in run.results for e in run.members[group]):
                run.completed_groups.append(group)
                if step == self.version:
                    self._feed(run)
            return Event("finished", step, now, execution_id=r.execution_id)
        if kind == "micro_step_done":
            c = self.cells[p["cell"]]
            c.micro_steps += 1
            c.train_s += p["t_end"] - p["t_start"]
            self.timeline.micro_step(p["t_start"], p["t_end"], c.index, p["step"], slot=p["slot"], work=p["flops"])
            self.measurements["micro_steps"].append([p["flops"], p["t_end"] - p["t_start"]])
            return Event("micro_step_done", p["step"], now, cell=c.index)
        if kind == "switched":
            c = self.cells[p["cell"]]
            c.role, c.target = p["to"], None
            c.switch_s += p["duration"]
            c.switches += 1
            key = "serving_to_training" if c.role is Role.TRAINING else "training_to_serving"
            self.measurements[key].append(p["duration"])
            self.timeline.role(now, c.index, c.role, reason=f"switched in {p['duration']:.3f}s")
            log.info("%s: %s (switch took %.3fs)", c.name, c.role.value, p["duration"])
            return Event("switched", self.version, now, cell=c.index)
        return Event("tick", self.version, now)

    def _cluster_state(self, now: float) -> ClusterState:
        run = self.steps.get(self.version)
        counts = self._mq.counts()
        due = sum(r.dispatched - r.finished for s, r in self.steps.items() if s <= self.version)
        return ClusterState(
            time=now,
            roles=[c.role for c in self.cells],
            capacity=[self.cfg.sessions_per_cell] * len(self.cells),
            waterlevel=Waterlevel(self.wl.dispatched, self.wl.started, self.wl.finished),
            targets=[c.target for c in self.cells],
            busy=[c.busy for c in self.cells],
            version=self.version,
            batch_size=self.cfg.batch_size,
            step_dispatched=run.dispatched if run else 0,
            step_finished=run.finished if run else 0,
            step_processed=run.processed if run else 0,
            ready=counts["ready"],
            in_flight=counts["claimed"],
            undispatched=self._total - self._dispatch_ptr,
            due_outstanding=due,
            held=0,
        )

    def _plan(self, event: Event) -> None:
        state = self._cluster_state(event.time)
        decision = self.policy.plan(event, state)
        self._decide(event, decision, state)

    def _decide(self, event: Event, decision: Decision, state: ClusterState | None = None) -> None:
        if self._decisions is not None and state is not None:
            self._decisions.write(
                json.dumps(
                    {
                        "event": dataclasses.asdict(event),
                        "state": _state_dict(state),
                        "roles": [r.value for r in decision.roles],
                        "dispatch": decision.dispatch,
                    }
                )
                + "\n"
            )
        moving = [
            (c, want)
            for c, want in zip(self.cells, decision.roles)
            if c.role is not Role.SWITCHING and want is not c.role
        ]
        now = time.time()
        for c, want in moving:  # every role is set first, so a leaving cell's sessions go to a cell that stays
            c.role, c.target = Role.SWITCHING, want
            self.timeline.role(now, c.index, Role.SWITCHING, reason=event.kind, to=want)
        for c, want in moving:
            self._start_switch(c, want)
        for _ in range(decision.dispatch):
            self._dispatch_one()

    # == executions ===============================================================================
    def _step_run(self, step: int) -> StepRun:
        run = self.steps.get(step)
        if run is None:
            specs = self.make_specs(step)
            if len(specs) != self.cfg.batch_size:
                raise ValueError(f"step {step} has {len(specs)} executions; expected {self.cfg.batch_size}")
            members: dict[str, list[str]] = {}
            for s in specs:
                members.setdefault(s.group_id, []).append(s.execution_id)
            run = StepRun(step=step, specs=specs, group_order=list(members), members=members)
            self.steps[step] = run
        return run

    def _dispatch_one(self) -> None:
        if self._dispatch_ptr >= self._total:
            return
        n = self.cfg.batch_size
        step = self.start + self._dispatch_ptr // n
        run = self._step_run(step)
        spec = run.specs[self._dispatch_ptr % n]
        self._dispatch_ptr += 1
        run.dispatched += 1
        run.t_first_dispatch = run.t_first_dispatch or time.time()
        self.wl.dispatched += 1
        self.waiting.append((step, spec))

    def _serving_slots(self) -> int:
        return sum(self.cfg.sessions_per_cell for c in self.cells if c.role is Role.SERVING)

    def _start_waiting(self) -> None:
        while self.waiting and self.running < self._serving_slots() and not self.stop.is_set():
            step, spec = self.waiting.popleft()
            self.running += 1
            self.wl.started += 1
            now = time.time()
            self.timeline.execution_started(now, spec.execution_id, step=step)
            self.timeline.waterlevel(now, self.wl.dispatched, self.wl.started, self.wl.finished)
            self.executor.submit(spec, lambda r, s=step: self._post("finished", result=r, step=s))

    # == data: groups -> execution queue -> pipeline -> micro-step queue ============================
    def _new_step_queue(self) -> None:
        n = self.cfg.batch_size
        slots = self.cfg.micro_steps_per_step or max(1, n * self.cfg.max_branches)
        self._mq = MicroStepQueue(slots)
        self._acc = GradAccumulator(self.learner.param_shardings, slots, ordered=self.learner.ordered_accumulation)
        self._mq_step = self.version
        self._mq_closed = False
        self._t_train0: float | None = None

    def _feed(self, run: StepRun) -> None:
        """Appends the step's completed groups (in task order, or arrival order) and moves what the pipeline
        packs into the micro-step queue."""
        if self.cfg.stream_order == "task":
            ready = []
            for g in run.group_order:
                if g in run.fed_groups:
                    continue
                if g not in run.completed_groups:
                    break
                ready.append(g)
        else:
            ready = [g for g in run.completed_groups if g not in run.fed_groups]
        version = int(self.state.step)
        for g in ready:
            run.fed_groups.add(g)
            last = len(run.fed_groups) == len(run.group_order)
            entries, untrained = self._group_entries(run, g, version)
            self.pipeline.enqueue(run.step, entries, normalizer=self.cfg.batch_size, last=last, untrained=untrained)
            run.processed += len(entries)
        while True:
            try:
                item = next(self._it)
            except StopIteration:
                break
            run.pipeline_stats.update(item.stats)
            run.pipeline_excluded.extend(item.excluded)
            if item.packed is not None:
                mb = item.packed.micro_batch
                run.pipeline_stats["tokens_computed"] += mb.num_tokens
                run.pipeline_stats["tokens_trained"] += mb.num_target_tokens
                run.pipeline_stats["micro_batches"] += 1
                self._mq.put(mb)
                if self._t_train0 is None:
                    self._t_train0 = time.time()
            if item.end_of_step:
                self._mq.close()
                self._mq_closed = True

    def _group_entries(self, run: StepRun, group: str, version: int) -> tuple[list[tuple[str, float]], set[str]]:
        eids = run.members[group]
        rewards, dropped = {}, set()
        for eid in eids:
            r = run.results[eid]
            rewards[eid] = None if r.excluded else r.reward
            records = self.records.read(eid)
            run.calls[eid] = len(records)
            versions = [v for rec in records for v in rec.policy_versions]
            if versions:
                run.staleness[eid] = version - min(versions)
                if self.cfg.max_staleness >= 0 and run.staleness[eid] > self.cfg.max_staleness:
                    dropped.add(eid)
        run.dropped_stale += len(dropped)
        adv = group_advantages(rewards, {e: group for e in eids}, dropped=dropped)
        run.skipped_groups += adv.skipped_groups
        untrained = {e for e in eids if e not in adv.advantages}
        return [(e, adv.advantages.get(e, 0.0)) for e in eids], untrained

    # == training =================================================================================
    def _worker(self, c: CellRuntime) -> None:
        """Claims micro-steps of the current step while the cell's role is TRAINING."""
        while not self._closing.is_set():
            if not c.gate.wait(timeout=0.1):
                continue
            with c.lock:
                if not c.gate.is_set():
                    continue
                mq, acc, step = self._mq, self._acc, self._mq_step
                try:
                    params = self._params_for(c, step)
                    claim = mq.claim(c.worker.name, timeout=self.cfg.claim_timeout_s)
                except (TimeoutError, QueueAborted):
                    continue
                if claim is None:  # the step is done: wait for the next one
                    time.sleep(self.cfg.claim_timeout_s)
                    continue
                c.busy = True
                flops = self._micro_step_flops(claim.batch)
                t0 = time.time()
                try:
                    grads, aux = c.worker.micro_step(params, claim.batch, self.rl_kind)
                    jax.block_until_ready(grads)  # time the work, not its dispatch
                    acc.add(claim.index, grads, aux)
                    mq.complete(claim)
                except BaseException as e:  # noqa: BLE001 - the micro-step goes back to the queue
                    try:
                        mq.release(claim)
                    except (QueueAborted, ValueError):
                        pass
                    log.exception("%s: micro-step %d failed", c.name, claim.index)
                    self._post("error", message=f"{c.name}: micro-step {claim.index} of step {step} failed: {e!r}")
                    c.busy = False
                    return
                c.busy = False
                self._post(
                    "micro_step_done",
                    cell=c.index,
                    step=step,
                    slot=claim.index,
                    t_start=t0,
                    t_end=time.time(),
                    flops=flops,
                )

    def _micro_step_flops(self, mb) -> float:
        """Model FLOPs of a micro-batch (forward + backward): 6 x params per token plus causal attention,
        6 x layers x attention dim per (token, earlier token) pair within each packed sequence."""
        seg = np.asarray(mb.segment_ids)
        tokens = float(np.count_nonzero(seg))
        pairs = 0.0
        for row in seg:
            _, counts = np.unique(row[row != 0], return_counts=True)
            pairs += float(np.sum(counts.astype(np.float64) ** 2)) / 2
        return self._flops_per_token * tokens + self._flops_per_token_pair * pairs

    def _params_for(self, c: CellRuntime, step: int):
        """The weights of ``step`` on the cell's training layout (the core: its own; a satellite: its snapshot)."""
        if c.index == 0:
            return self.state.params
        if c.snapshot_version != step:
            with self._state_lock:
                c.snapshot = c.worker.snapshot(self.state.params)
                c.snapshot_version = step
        return c.snapshot

    def _maybe_train(self) -> None:
        """The core's optimizer step once every micro-step of the current step is done."""
        if self.version >= self.end or not self._mq_closed or not self._mq.done:
            return
        step = self.version
        run = self.steps[step]
        t0 = time.time()
        if self._mq.filled():
            with self._state_lock:
                self.state, metrics = self.learner.finish_step(
                    self.state, self._mq, self._acc, self.rl_kind, t0=time.perf_counter()
                )
            for c in self.cells:  # satellites re-snapshot for the next step
                c.snapshot = None
        else:
            log.warning(
                "step %d: nothing to train on (every execution excluded, stale or in a skipped group); "
                "no optimizer step",
                step,
            )
            metrics = {"optimizer_skipped": 1}
        t1 = time.time()
        version = int(self.state.step)
        self.timeline.optimizer_step(t0, t1, 0, step, version)
        self.measurements["optimizer_steps"].append(t1 - t0)
        self._publish(version)
        self.measurements["weight_syncs"].append(time.time() - t1)
        self.version += 1
        metrics.update(self._step_metrics(run, t1))
        results = [run.results[s.execution_id] for s in run.specs]
        self.boundary_pipeline_state = self.pipeline.get_state()
        self.on_step(step, self.state, metrics, results, self.boundary_pipeline_state)
        del self.steps[step]
        if self.version < self.end:
            self._new_step_queue()
            nxt = self.steps.get(self.version)
            if nxt is not None and nxt.completed_groups:
                self._feed(nxt)
        self._plan(Event("step_trained", step, time.time()))

    def _publish(self, version: int) -> None:
        """The new weights to every serving cell (device to device, onto its serving layout)."""
        for c in self.cells:
            if c.role is Role.SERVING or c.target is Role.SERVING:
                with self._state_lock:
                    params = c.serving_params(self.state.params)
                c.loop.update_params(params, version)

    def _step_metrics(self, run: StepRun, now: float) -> dict[str, Any]:
        marks, prev_marks = self._cell_marks(), self._idle_mark
        wall = max(now - self._t_step, 1e-9)
        per_cell = {}
        for c in self.cells:
            prev, cur = self._idle_mark[c.index], marks[c.index]
            busy = (cur["serve_busy"] - prev["serve_busy"]) + (cur["train"] - prev["train"])
            switching = cur["switch"] - prev["switch"]
            per_cell[f"idle_fraction/{c.name}"] = max(0.0, 1.0 - (busy + switching) / wall)
            per_cell[f"micro_steps/{c.name}"] = cur["micro_steps"] - prev["micro_steps"]
        self._idle_mark, self._t_step = marks, now
        stale = list(run.staleness.values())
        stats = dict(run.pipeline_stats)
        return {
            "step_s": wall,
            "calls_per_execution": float(np.mean(list(run.calls.values()))) if run.calls else 0.0,
            "staleness_mean": float(np.mean(stale)) if stale else 0.0,
            "staleness_max": int(max(stale)) if stale else 0,
            "dropped_stale": run.dropped_stale,
            "skipped_groups": run.skipped_groups,
            "executions_excluded_by_pipeline": len(run.pipeline_excluded),
            "tokens_computed": stats.get("tokens_computed", 0),
            "tokens_trained": stats.get("tokens_trained", 0),
            "micro_batches": stats.get("micro_batches", 0),
            "branches_selected": stats.get("selected", 0),
            "idle_fraction": float(np.mean([v for k, v in per_cell.items() if k.startswith("idle")])),
            "switch_s": sum(m["switch"] - p["switch"] for m, p in zip(marks, prev_marks)),
            "rollout_first_to_last_s": (run.t_last_finish or now) - (run.t_first_dispatch or now),
            **per_cell,
        }

    def _cell_marks(self) -> list[dict[str, float]]:
        return [
            {"serve_busy": c.loop.stats.busy_s, "train": c.train_s, "switch": c.switch_s, "micro_steps": c.micro_steps}
            for c in self.cells
        ]

    # == switches =================================================================================
    def _start_switch(self, c: CellRuntime, to: Role) -> None:
        if to is Role.SERVING:
            c.gate.clear()
        target = self._migration_target(c) if to is Role.TRAINING else None
        th = threading.Thread(
            target=self._switch, args=(c, to, target, int(self.state.step)), name=f"switch-{c.name}", daemon=True
        )
        th.start()
        self._switch_threads = [t for t in self._switch_threads if t.is_alive()] + [th]

    def _migration_target(self, leaving: CellRuntime) -> CellRuntime | None:
        """The serving cell that stays longest: cells leave in index order, so the highest-index one."""
        staying = [
            c
            for c in self.cells
            if c is not leaving and (c.role is Role.SERVING and c.target is None or c.target is Role.SERVING)
        ]
        return staying[-1] if staying else None

    def _switch(self, c: CellRuntime, to: Role, target: CellRuntime | None, version: int) -> None:
        t0 = time.perf_counter()
        try:
            if to is Role.TRAINING:
                self.router.drain(c.name, cancel_in_flight=target is None)
                if target is not None:  # KV included, also when either cell is on another process
                    states = move_sessions(c.loop, target.loop, c.index, target.index)
                    if states:
                        for s in states:
                            if s.session_id is not None:
                                self.router.repin(s.session_id, target.name)
                        log.info(
                            "%s -> %s: moved %d sessions (%d requests in flight)",
                            c.name,
                            target.name,
                            len(states),
                            sum(s.request is not None for s in states),
                        )
                if c.index != 0:  # the satellite's training snapshot, in its training layout
                    with self._state_lock:
                        c.snapshot = c.worker.snapshot(self.state.params)
                        c.snapshot_version = self.version
                    jax.block_until_ready(c.snapshot)
                c.gate.set()
            else:
                with c.lock:  # the micro-step in progress finishes first
                    pass
                with self._state_lock:
                    version = int(self.state.step)
                    if c.loop.policy_version != version:
                        params = c.serving_params(self.state.params)
                        c.loop.update_params(params, version)
                self.router.undrain(c.name)
        except BaseException as e:  # noqa: BLE001 - reported to the driver, which stops the run
            log.exception("%s: switch to %s failed", c.name, to.value)
            self._post("error", message=f"{c.name}: switch to {to.value} failed: {e!r}")
            return
        self._post("switched", cell=c.index, to=to, duration=time.perf_counter() - t0)

    # == shutdown =================================================================================
    def _shutdown(self) -> None:
        """Every cell back to serving with the current weights (eval and the next segment start there)."""
        self._closing.set()
        for th in self._switch_threads:
            th.join(timeout=60)
        for th in self._workers:
            th.join(timeout=60)
        self._workers.clear()
        self._switch_threads.clear()
        now = time.time()
        version = int(self.state.step)
        for c in self.cells:
            c.gate.clear()
            if c.role is not Role.SERVING or c.loop.policy_version != version:
                with self._state_lock:
                    c.loop.update_params(c.serving_params(self.state.params), version)
            if c.role is not Role.SERVING:
                c.role, c.target = Role.SERVING, None
                self.timeline.role(now, c.index, Role.SERVING, reason="end of segment")
            self.router.undrain(c.name)
        self._mq.abort("the run segment ended")
        while True:  # events of this segment (e.g. the joined switches') must not reach the next one
            try:
                self._events.get_nowait()
            except queue_lib.Empty:
                break
        if self._decisions is not None:
            self._decisions.flush()
        self.timeline.flush()
        if self.measurements_path is not None:
            self.write_measurements(self.measurements_path)

    def write_measurements(self, path: Path) -> None:
        """The run's measured costs in the simulator's format (``gyre_jax.sim.cost_model.fit_cost_model``):
        serving loop iterations split into decode steps and prefills, micro-steps (FLOPs, seconds), optimizer
        steps, switches by direction and weight syncs."""
        decode, prefill = [], []
        for c in self.cells:
            for batch, context, prefilled, seconds in list(c.loop.step_log):
                (prefill if prefilled else decode).append((batch, context, prefilled, seconds))
        out = dict(self.measurements)
        out["decode_steps"] = [[b, ctx, s] for b, ctx, _, s in decode if b > 0]
        # a prefill iteration also stepped the decoding batch: take the decode estimate off its time
        if len(out["decode_steps"]) >= 3:
            d = np.asarray(out["decode_steps"], dtype=np.float64)
            x = np.stack([np.ones(len(d)), d[:, 0], d[:, 1]], axis=1)
            coef, *_ = np.linalg.lstsq(x, d[:, 2], rcond=None)
        else:
            coef = np.zeros(3)
        out["prefills"] = [
            [n, ctx + n, max(1e-6, s - (float(coef @ [1.0, b, ctx]) if b else 0.0))] for b, ctx, n, s in prefill
        ]
        path.write_text(json.dumps(out) + "\n", encoding="utf-8")

    def close(self) -> None:
        if self._decisions is not None:
            self._decisions.close()
            self._decisions = None


def _state_dict(state: ClusterState) -> dict[str, Any]:
    d = dataclasses.asdict(state)
    d["roles"] = [r.value for r in state.roles]
    d["targets"] = [None if t is None else t.value for t in (state.targets or [])]
    return d


def state_from_dict(d: dict[str, Any]) -> ClusterState:
    """A ``ClusterState`` back from a ``decisions.jsonl`` line (for replaying a policy alone)."""
    d = dict(d)
    d["roles"] = [Role(r) for r in d["roles"]]
    d["targets"] = [None if t is None else Role(t) for t in d["targets"]] or None
    d["waterlevel"] = Waterlevel(**d["waterlevel"])
    return ClusterState(**d)
