"""The cell controller: runs RL steps on cells that switch between serving rollouts and training.

One controller drives all three scheduling policies (``policies.py``: colocated, async, elastic); the
policy object decides, the controller carries out. It is the driver thread that owns every fact (cell
roles, the step being trained) and composes four parts:

- ``driver.Driver``: typed events (``events.py``) in from the workers' threads, the policy's decision out
  (``Driver.replan``, as in the simulator), each logged to ``decisions.jsonl``; the policy's state is built
  by ``state.cluster_state`` from the controller's ``state.Cells``, the ledger's books and the training
  queue's counts, the simulator's builder;
- ``ledger.RolloutLedger``: executions dispatched, started and finished (the waterlevel), each task group
  scored by the ``rl/`` functions on its records as it completes and streamed through the trajectory
  pipeline into the step's micro-step queue;
- ``training.CellTraining``: the train state, the training cells running the learner's claim loop, the
  optimizer step on the core and the publishing of each new policy;
- ``switcher.Switcher``: timed role switches with session (KV) migration.

Cells are ``runtime.CellHandle``s: the controller never asks where one runs. It also keeps the measured
costs of the run (``CostLog``; ``sim.calibrate.write_measurements`` turns them into the simulator's
calibration input).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gyre_jax.elastic.driver import Driver, Failure
from gyre_jax.elastic.events import Event, Finished, MicroStepDone, StepBegan, StepTrained, Switched, Tick
from gyre_jax.elastic.ledger import RolloutLedger, StepRun
from gyre_jax.elastic.policies import Decision, SchedulingPolicy
from gyre_jax.elastic.state import Cells, ClusterState, Role, TrainingFacts, cluster_state
from gyre_jax.elastic.switcher import Switcher
from gyre_jax.elastic.timeline import TimelineWriter
from gyre_jax.elastic.training import CellTraining
from gyre_jax.trajectory.pipeline import left_out_counts

log = logging.getLogger("gyre_jax.controller")


@dataclass(frozen=True)
class ControllerConfig:
    """The step's shape and the controller's timing (``RunConfig.controller_config()`` derives it).
    ``micro_steps_per_step`` 0: as many slots as the step's data can fill (executions x J_max)."""

    tasks_per_step: int
    group_size: int
    sessions_per_cell: int
    max_branches: int
    micro_steps_per_step: int = 0
    tick_s: float = 1.0  # a "tick" event after this long without one (time-based rules, e.g. idle_before_return_s)

    @property
    def batch_size(self) -> int:
        return self.tasks_per_step * self.group_size

    @property
    def micro_step_slots(self) -> int:
        return self.micro_steps_per_step or max(1, self.batch_size * self.max_branches)


@dataclass
class CostLog:
    """The run's measured costs (seconds; micro-steps as ``[FLOPs, seconds]``), by kind."""

    cell_accelerators: int
    micro_steps: list[list[float]] = field(default_factory=list)
    optimizer_steps: list[float] = field(default_factory=list)
    serving_to_training: list[float] = field(default_factory=list)
    training_to_serving: list[float] = field(default_factory=list)
    weight_syncs: list[float] = field(default_factory=list)
    session_moves: list[list[float]] = field(default_factory=list)  # [sessions, seconds] per switch that moved any


OnStep = Callable[[int, dict[str, Any], list, dict[str, Any]], None]


class Controller:
    """Runs RL steps ``[start, end)`` under ``policy`` (see the module docstring).

    ``run``'s ``on_step(step, metrics, results, pipeline_state)`` is called right after a step's optimizer
    update (``training.state`` holds the new policy), before any later step's data enters the pipeline;
    ``pipeline_state`` is the checkpointable pipeline state at that boundary."""

    def __init__(
        self,
        cfg: ControllerConfig,
        *,
        training: CellTraining,
        ledger: RolloutLedger,
        policy: SchedulingPolicy,
        router,
        timeline: TimelineWriter,
        stop: threading.Event,
        decisions_path=None,
        on_decision=None,
    ):
        if policy.num_cells != len(training.cells):
            raise ValueError(f"the policy has {policy.num_cells} cells but the controller {len(training.cells)}")
        self.cfg = cfg
        self.training = training
        self.ledger = ledger
        self.policy = policy
        self.router = router
        self.timeline = timeline
        self.stop = stop
        self.driver = Driver(policy, decisions_path, cfg.tick_s, on_decision)  # on_decision: the live view
        self.switcher = Switcher(router, training, self._switched, self.report_error)
        training.on_micro_step = self._micro_step_done
        training.on_error = self.report_error
        self.handles = [c.handle for c in training.cells]
        k = len(self.handles)
        self.cells = Cells([Role.SERVING] * k, [cfg.sessions_per_cell] * k, owner=f"policy {policy.name}")
        self.switch_s = [0.0] * k  # seconds each cell spent switching
        self.costs = CostLog(cell_accelerators=len(self.handles[0].cell.devices))
        self.version = 0  # the step that trains next (optimizer steps applied)
        self.end = 0  # the segment's end: steps ``version .. end - 1`` are left to train
        self.on_step: OnStep | None = None
        self._closed = False  # the current step's micro-step queue has all its data
        self._t_step = 0.0  # when the current step began (its metrics' wall time)
        self._marks: list[dict[str, float]] = []  # the cells' counters then (``_cell_marks``)

    def report_error(self, message: str) -> None:
        """Thread-safe: stops the run with ``message`` (a failed micro-step, switch or follower process)."""
        self.driver.post(Failure(message))

    # == the segment ===============================================================================
    def run(self, start: int, end: int, on_step: OnStep) -> int:
        """Trains steps ``start .. end - 1``; returns the next step to train (``end`` unless stopped)."""
        self.version, self.end, self.on_step = start, end, on_step
        self.ledger.begin(start, end)
        self._new_step()
        self._t_step, self._marks = time.time(), self._cell_marks()
        self.training.start()
        self._carry_out(Decision(roles=self.policy.initial_roles(), dispatch=0), reason="start")
        self._replan(StepBegan(start, time.time(), executions=self.cfg.batch_size))
        try:
            while self.version < end and not self.stop.is_set():
                item = self.driver.next()
                if isinstance(item, Failure):
                    raise RuntimeError(item.message)
                event = Tick(self.version, time.time()) if item is None else self._handle(item)
                self._replan(event)
                self._maybe_train()
        finally:
            self._shutdown()
        return self.version

    # -- events from the workers' threads (thread-safe) ----------------------------------------------
    def _finished(self, result, step: int) -> None:
        self.driver.post(Finished(step, time.time(), execution_id=result.execution_id, result=result))

    def _micro_step_done(self, cell: int, step: int, slot: int, flops: float, t_start: float, t_end: float) -> None:
        self.driver.post(MicroStepDone(step, t_end, cell=cell, slot=slot, flops=flops, t_start=t_start))

    def _switched(self, cell: int, to: Role, seconds: float, moved: int = 0, move_s: float = 0.0) -> None:
        self.driver.post(Switched(self.version, time.time(), cell=cell, seconds=seconds, moved=moved, move_s=move_s))

    # -- on the driver thread ---------------------------------------------------------------------------
    def _handle(self, event: Event) -> Event:
        """Books ``event``'s facts; returns it."""
        if isinstance(event, Finished):
            self.ledger.finished(event.result, event.step)
            if event.step == self.version:
                self._feed()
        elif isinstance(event, MicroStepDone):
            self.timeline.micro_step(
                event.t_start, event.time, event.cell, event.step, slot=event.slot, work=event.flops
            )
            self.costs.micro_steps.append([event.flops, event.time - event.t_start])
            self._owed_switch(event.cell)
        elif isinstance(event, Switched):
            self._switch_ended(event)
        return event

    def _switch_ended(self, event: Switched) -> None:
        c, now = event.cell, time.time()
        role = self.cells.end_switch(c)
        self.switch_s[c] += event.seconds
        costs = self.costs.serving_to_training if role is Role.TRAINING else self.costs.training_to_serving
        costs.append(event.seconds)
        if event.moved:
            self.costs.session_moves.append([event.moved, event.move_s])
        self.timeline.role(now, c, role, reason=f"switched in {event.seconds:.3f}s")
        log.info("%s: %s (switch took %.3fs)", self.handles[c].name, role.value, event.seconds)

    # == decisions =================================================================================
    def _replan(self, event: Event) -> None:
        """Waiting executions take the slots that freed, then the policy decides on ``event`` (and again while
        its decisions dispatch or start executions): ``Driver.replan``, as the simulator does."""
        self.ledger.start_waiting(self.cells.serving_slots(), self._finished)
        self.driver.replan(event, self._observe, lambda d: self._carry_out(d, reason=event.kind))

    def _observe(self) -> ClusterState:
        """The policy's state now: ``state.cluster_state`` on the controller's facts (the simulator's builder)."""
        run = self.ledger.steps.get(self.version)
        counts = self.training.queue.counts()
        for i in range(self.cells.k):
            self.cells.busy[i] = self.training.busy(i)
        facts = TrainingFacts(run.processed if run else 0, counts["ready"], counts["claimed"])
        return cluster_state(time.time(), self.version, self.cells, self.ledger, facts)

    def _carry_out(self, decision: Decision, reason: str) -> int:
        """Starts the decision's switches and dispatch; returns the executions dispatched or started."""
        self._begin_switches(list(self.cells.switches_to_begin(decision.roles)), reason)
        for i, cell in enumerate(self.training.cells):  # a cell that owes a switch claims no more micro-steps
            if self.cells.role[i] is Role.TRAINING:
                (cell.gate.set if self.cells.pending_switch[i] is None else cell.gate.clear)()
        dispatched = self.ledger.dispatch(decision.dispatch)
        return dispatched + self.ledger.start_waiting(self.cells.serving_slots(), self._finished)

    def _begin_switches(self, moving: list[tuple[int, Role]], reason: str) -> None:
        now = time.time()
        for i, want in moving:  # every role is set first, so a leaving cell's sessions go to a cell that stays
            self.cells.begin_switch(i, want)
            self.timeline.role(now, i, Role.SWITCHING, reason=reason, to=want)
        for i, want in moving:
            self.switcher.start(i, want, self._migration_target(i) if want is Role.TRAINING else None)

    def _owed_switch(self, cell: int) -> None:
        """A cell that was busy when the policy asked it to switch does so now that it is free."""
        want = self.cells.take_pending(cell)
        if want is not None:
            self._begin_switches([(cell, want)], reason="owed")

    def _migration_target(self, leaving: int) -> int | None:
        """The serving cell that stays longest: cells leave in index order, so the highest-index one."""
        role, target = self.cells.role, self.cells.target
        staying = [
            i
            for i in range(self.cells.k)
            if i != leaving and (role[i] is Role.SERVING and target[i] is None or target[i] is Role.SERVING)
        ]
        return staying[-1] if staying else None

    # == training ==================================================================================
    def _new_step(self) -> None:
        self.training.new_step(self.version, self.cfg.micro_step_slots)
        self._closed = False
        self._feed()

    def _feed(self) -> None:
        if not self._closed:
            self._closed = self.ledger.feed(self.version, self.training.version, self.training.queue)

    def _maybe_train(self) -> None:
        """The core's optimizer step once every micro-step of the current step is done, then the next step."""
        if self.version >= self.end or not self._closed or not self.training.queue.done:
            return
        step = self.version
        t0 = time.time()
        metrics = self.training.optimizer_step()
        t1 = time.time()
        self.timeline.optimizer_step(t0, t1, 0, step, self.training.version)
        self.costs.optimizer_steps.append(t1 - t0)
        role, target = self.cells.role, self.cells.target
        serving = [h for i, h in enumerate(self.handles) if role[i] is Role.SERVING or target[i] is Role.SERVING]
        self.training.publish(serving)
        t2 = time.time()
        self.timeline.weight_publish(t1, t2, step, self.training.version)
        self.costs.weight_syncs.append(t2 - t1)
        self.version += 1
        run = self.ledger.pop(step)
        metrics.update(self._step_metrics(run, t1))
        self.on_step(step, metrics, [run.results[s.execution_id] for s in run.specs], self.ledger.pipeline.get_state())
        if self.version < self.end:
            self._new_step()
        self._owed_switch(0)  # the core computed the optimizer step (the simulator's core is busy with it)
        self._replan(StepTrained(step, time.time()))

    def _step_metrics(self, run: StepRun, now: float) -> dict[str, Any]:
        marks, prev = self._cell_marks(), self._marks
        wall = max(now - self._t_step, 1e-9)
        per_cell = {}
        for h, cur, old in zip(self.handles, marks, prev):
            busy = (cur["serve_busy"] - old["serve_busy"]) + (cur["train"] - old["train"])
            per_cell[f"idle_fraction/{h.name}"] = max(0.0, 1.0 - (busy + cur["switch"] - old["switch"]) / wall)
            per_cell[f"micro_steps/{h.name}"] = cur["micro_steps"] - old["micro_steps"]
        self._marks, self._t_step = marks, now
        stats = run.pipeline_stats
        return {
            "step_s": wall,
            "calls_per_execution": float(np.mean(list(run.calls.values()))) if run.calls else 0.0,
            "staleness_mean": run.staleness.mean,
            "staleness_max": run.staleness.max,
            "dropped_stale": len(run.staleness.dropped),
            "skipped_groups": run.skipped_groups,
            "executions_excluded_by_pipeline": len(run.pipeline_excluded),
            # executions with tokens in the step's micro-batches, and those the pipeline left out by why
            "executions_trained": stats.get("executions", 0) - stats.get("excluded", 0),
            **left_out_counts(reason for _, reason in run.pipeline_excluded),
            "calls_untrained_greedy": stats.get("greedy_calls", 0),
            "tokens_computed": stats.get("tokens_computed", 0),
            "tokens_trained": stats.get("tokens_trained", 0),
            "micro_batches": stats.get("micro_batches", 0),
            "branches_selected": stats.get("selected", 0),
            "idle_fraction": float(np.mean([v for k, v in per_cell.items() if k.startswith("idle")])),
            "switch_s": sum(m["switch"] - p["switch"] for m, p in zip(marks, prev)),
            "rollout_first_to_last_s": (run.t_last_finish or now) - (run.t_first_dispatch or now),
            **per_cell,
        }

    def _cell_marks(self) -> list[dict[str, float]]:
        return [
            {"serve_busy": h.stats().busy_s, "train": t.train_s, "switch": s, "micro_steps": t.micro_steps}
            for h, t, s in zip(self.handles, self.training.cells, self.switch_s)
        ]

    # == shutdown ==================================================================================
    def _shutdown(self) -> None:
        """Every cell back to serving with the current weights (eval and the next segment start there)."""
        self.switcher.join()
        self.training.stop()
        now, version = time.time(), self.training.version
        role = self.cells.role
        stale = [h for i, h in enumerate(self.handles) if role[i] is not Role.SERVING or h.policy_version != version]
        self.training.publish(stale)
        for i, h in enumerate(self.handles):
            if role[i] is not Role.SERVING:
                self.timeline.role(now, i, Role.SERVING, reason="end of segment")
            self.router.undrain(h.name)
        self.cells.reset([Role.SERVING] * self.cells.k)
        self.driver.clear()  # events of this segment (e.g. the joined switches') must not reach the next one
        self.driver.flush()
        self.timeline.flush()

    def close(self) -> None:
        self.driver.close()
