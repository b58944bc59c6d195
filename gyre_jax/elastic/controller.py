"""The cell controller: runs RL steps on cells that switch between serving rollouts and training.

One controller drives all three scheduling policies (``policies.py``: colocated, async, elastic); the
policy object decides, the controller carries out. It is the driver thread that owns every fact (cell
roles, the step being trained) and composes four parts:

- ``driver.Driver``: events in, the policy's decision out, each logged to ``decisions.jsonl``;
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

from gyre_jax.elastic.driver import Driver
from gyre_jax.elastic.ledger import RolloutLedger, StepRun
from gyre_jax.elastic.policies import ClusterState, Decision, Event, Role, SchedulingPolicy, Waterlevel
from gyre_jax.elastic.switcher import Switcher
from gyre_jax.elastic.timeline import TimelineWriter
from gyre_jax.elastic.training import CellTraining

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


@dataclass
class CellRole:
    role: Role = Role.SERVING
    target: Role | None = None  # the role a SWITCHING cell moves to
    switch_s: float = 0.0
    switches: int = 0


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
        self.driver = Driver(policy, decisions_path, cfg.tick_s)
        self.switcher = Switcher(router, training, self._switched, self.report_error)
        training.on_micro_step = self._micro_step_done
        training.on_error = self.report_error
        self.handles = [c.handle for c in training.cells]
        self.cells = [CellRole() for _ in self.handles]
        self.costs = CostLog(cell_accelerators=len(self.handles[0].cell.devices))
        self.version = 0

    def report_error(self, message: str) -> None:
        """Thread-safe: stops the run with ``message`` (a failed micro-step, switch or follower process)."""
        self.driver.post("error", message=message)

    # == the segment ===============================================================================
    def run(self, start: int, end: int, on_step: OnStep) -> int:
        """Trains steps ``start .. end - 1``; returns the next step to train (``end`` unless stopped)."""
        self.version, self.end, self.on_step = start, end, on_step
        self.ledger.begin(start, end)
        self._new_step()
        self._t_step, self._marks = time.time(), self._cell_marks()
        self.training.start()
        began = Event("step_began", start, time.time(), executions_in_step=self.cfg.batch_size)
        self._apply(Decision(roles=self.policy.initial_roles(), dispatch=0), began)
        self._plan(began)
        try:
            while self.version < end and not self.stop.is_set():
                kind, payload = self.driver.next()
                if kind == "error":
                    raise RuntimeError(payload["message"])
                event = self._handle(kind, payload)
                self._maybe_train()
                if self.version >= end:
                    break
                self._plan(event)
                self.ledger.start_waiting(self._serving_slots(), self._finished)
        finally:
            self._shutdown()
        return self.version

    def _finished(self, result, step: int) -> None:
        self.driver.post("finished", result=result, step=step)

    def _micro_step_done(self, cell: int, step: int, slot: int, flops: float, t_start: float, t_end: float) -> None:
        self.driver.post("micro_step_done", cell=cell, step=step, slot=slot, flops=flops, t_start=t_start, t_end=t_end)

    def _switched(self, cell: int, to: Role, seconds: float) -> None:
        self.driver.post("switched", cell=cell, to=to, duration=seconds)

    def _handle(self, kind: str, p: dict) -> Event:
        now = time.time()
        if kind == "finished":
            self.ledger.finished(p["result"], p["step"])
            if p["step"] == self.version:
                self._feed()
            return Event("finished", p["step"], now, execution_id=p["result"].execution_id)
        if kind == "micro_step_done":
            self.timeline.micro_step(p["t_start"], p["t_end"], p["cell"], p["step"], slot=p["slot"], work=p["flops"])
            self.costs.micro_steps.append([p["flops"], p["t_end"] - p["t_start"]])
            return Event("micro_step_done", p["step"], now, cell=p["cell"])
        if kind == "switched":
            c = self.cells[p["cell"]]
            c.role, c.target = p["to"], None
            c.switch_s += p["duration"]
            c.switches += 1
            costs = self.costs.serving_to_training if c.role is Role.TRAINING else self.costs.training_to_serving
            costs.append(p["duration"])
            self.timeline.role(now, p["cell"], c.role, reason=f"switched in {p['duration']:.3f}s")
            log.info("%s: %s (switch took %.3fs)", self.handles[p["cell"]].name, c.role.value, p["duration"])
            return Event("switched", self.version, now, cell=p["cell"])
        return Event("tick", self.version, now)

    # == decisions =================================================================================
    def _cluster_state(self, now: float) -> ClusterState:
        run = self.ledger.steps.get(self.version)
        counts = self.training.queue.counts()
        wl = self.ledger.wl
        return ClusterState(
            time=now,
            roles=[c.role for c in self.cells],
            capacity=[self.cfg.sessions_per_cell] * len(self.cells),
            waterlevel=Waterlevel(wl.dispatched, wl.started, wl.finished),
            targets=[c.target for c in self.cells],
            busy=[self.training.busy(i) for i in range(len(self.cells))],
            version=self.version,
            batch_size=self.cfg.batch_size,
            step_dispatched=run.dispatched if run else 0,
            step_finished=run.finished if run else 0,
            step_processed=run.processed if run else 0,
            ready=counts["ready"],
            in_flight=counts["claimed"],
            undispatched=self.ledger.undispatched,
            due_outstanding=self.ledger.due_outstanding(self.version),
            held=0,
        )

    def _plan(self, event: Event) -> None:
        self._apply(self.driver.decide(event, self._cluster_state(event.time)), event)

    def _apply(self, decision: Decision, event: Event) -> None:
        moving = [
            (i, want)
            for i, (c, want) in enumerate(zip(self.cells, decision.roles))
            if c.role is not Role.SWITCHING and want is not c.role
        ]
        now = time.time()
        for i, want in moving:  # every role is set first, so a leaving cell's sessions go to a cell that stays
            self.cells[i].role, self.cells[i].target = Role.SWITCHING, want
            self.timeline.role(now, i, Role.SWITCHING, reason=event.kind, to=want)
        for i, want in moving:
            self.switcher.start(i, want, self._migration_target(i) if want is Role.TRAINING else None)
        self.ledger.dispatch(decision.dispatch)

    def _migration_target(self, leaving: int) -> int | None:
        """The serving cell that stays longest: cells leave in index order, so the highest-index one."""
        staying = [
            i
            for i, c in enumerate(self.cells)
            if i != leaving and (c.role is Role.SERVING and c.target is None or c.target is Role.SERVING)
        ]
        return staying[-1] if staying else None

    def _serving_slots(self) -> int:
        return sum(self.cfg.sessions_per_cell for c in self.cells if c.role is Role.SERVING)

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
        serving = [h for h, c in zip(self.handles, self.cells) if c.role is Role.SERVING or c.target is Role.SERVING]
        self.training.publish(serving)
        self.costs.weight_syncs.append(time.time() - t1)
        self.version += 1
        run = self.ledger.pop(step)
        metrics.update(self._step_metrics(run, t1))
        self.on_step(step, metrics, [run.results[s.execution_id] for s in run.specs], self.ledger.pipeline.get_state())
        if self.version < self.end:
            self._new_step()
        self._plan(Event("step_trained", step, time.time()))

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
            {"serve_busy": h.stats().busy_s, "train": t.train_s, "switch": c.switch_s, "micro_steps": t.micro_steps}
            for h, t, c in zip(self.handles, self.training.cells, self.cells)
        ]

    # == shutdown ==================================================================================
    def _shutdown(self) -> None:
        """Every cell back to serving with the current weights (eval and the next segment start there)."""
        self.switcher.join()
        self.training.stop()
        now, version = time.time(), self.training.version
        stale = [
            h for h, c in zip(self.handles, self.cells) if c.role is not Role.SERVING or h.policy_version != version
        ]
        self.training.publish(stale)
        for h, c in zip(self.handles, self.cells):
            if c.role is not Role.SERVING:
                c.role, c.target = Role.SERVING, None
                self.timeline.role(now, h.index, Role.SERVING, reason="end of segment")
            self.router.undrain(h.name)
        self.driver.clear()  # events of this segment (e.g. the joined switches') must not reach the next one
        self.driver.flush()
        self.timeline.flush()

    def close(self) -> None:
        self.driver.close()
