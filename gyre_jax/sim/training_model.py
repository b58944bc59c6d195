"""The training side of a simulated run: the micro-step queue and the cells that train.

It owns what of step ``version``'s data is in the queue (each execution's work enters after its evaluation:
streamed per execution or per group, or the whole batch once processed; the newest ``pack_lookahead``
micro-steps' worth waits in the packer until the step's data is complete), training cells claiming
micro-steps of ``micro_step_tokens`` worth of FLOPs (a cell's first one compiles), the core's optimizer step
(plus a gradient reduction when satellites helped), the pause after it (``step_boundary_s``), satellites'
weight pulls, and the time all of it took. Cell roles and busy flags are the shared ``CellRoles``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from gyre_jax.elastic.state import Role, TrainingFacts
from gyre_jax.elastic.timeline import TimelineWriter
from gyre_jax.sim.cells import CellRoles
from gyre_jax.sim.events import BATCH, BOUNDARY, EPS, MICRO, OPT, PULL, EventQueue
from gyre_jax.sim.workload import SegmentPlan

if TYPE_CHECKING:
    from gyre_jax.sim.simulator import SimConfig

TRAINING = Role.TRAINING


class TrainingModel:
    """Micro-steps and optimizer steps of ``config`` on ``cells``, timed on ``clock``; ``plans``: step -> its
    executions' ``SegmentPlan``; ``timeline`` (optional) records every micro-step and optimizer step."""

    def __init__(
        self,
        config: SimConfig,
        clock: EventQueue,
        cells: CellRoles,
        plans: dict[int, SegmentPlan],
        timeline: TimelineWriter | None,
        step_of: Callable[[int], int] | None = None,
    ):
        s, k = config.pool_steps, config.num_cells
        self.clock, self.cells, self.plans, self.timeline = clock, cells, plans, timeline
        self.n, self.steps, self.group_size = config.batch_size, config.steps, config.group_size
        self.step_of = step_of or (lambda i: i // self.n)  # the step an execution trains in (partial rollouts move it)
        self.streaming, self.stream_unit, self.lookahead = config.streaming, config.stream_unit, config.pack_lookahead
        self.tr, self.pipe = config.cost.training, config.cost.pipeline
        self.rate = self.tr.cell_flops(config.cell_accelerators)
        self.micro_flops = self.tr.micro_step_flops
        self.exec_work = [0.0] * (s * self.n)  # training work (FLOPs) of each ended execution
        self.was_evaluated = [False] * (s * self.n)
        # per step
        self.eval_count = [0] * s
        self.queued_count = [0] * s  # executions whose micro-steps are in the queue
        self.group_evals: dict[int, int] = {}  # group (i // group_size) -> executions evaluated (stream_unit)
        self.group_next = [0] * s  # the next task whose group enters the queue (stream_unit="group_in_order")
        self.ready_work = [0.0] * s
        self.total_work = [0.0] * s
        self.in_flight = [0] * s
        self.sat_used: list[set[int]] = [set() for _ in range(s)]  # satellites that trained in each step
        # per cell
        self.micro_work = [0.0] * k
        self.micro_t0 = [0.0] * k
        self.micro_time = [0.0] * k
        self.warm = [False] * k  # the cell has run a micro-step (its gradient step is compiled)
        # the optimizer step
        self.micro_count = 0
        self.opt_time = 0.0
        self.opt_warm = False
        self.opt_running = False
        self.boundary_until = 0.0  # no micro-step is claimed before (pipeline.step_boundary_s after a step)

    # -- data -------------------------------------------------------------------------------------
    def ready_micro_steps(self, v: int) -> int:
        """Micro-steps of step ``v`` a training cell could claim now."""
        if v >= self.steps:
            return 0
        w = self.ready_work[v]
        complete = self.queued_count[v] == self.n
        if not complete:
            w -= self.lookahead * self.micro_flops  # still in the packer's open micro-batches
        if w <= EPS:
            return 0
        full = int(w // self.micro_flops)
        rest = w - full * self.micro_flops
        return full + (1 if complete and rest > EPS else 0)

    def step_facts(self, v: int) -> TrainingFacts:
        """Step ``v``'s executions whose data is queued, micro-steps ready to claim and micro-steps running
        (zeros past the last step)."""
        if v >= self.steps:
            return TrainingFacts()
        return TrainingFacts(self.queued_count[v], self.ready_micro_steps(v), self.in_flight[v])

    def evaluated(self, i: int) -> bool:
        """Execution ``i`` is evaluated; True if data entered the micro-step queue (without streaming the
        step's whole batch is processed, a ``BATCH`` event, once its last execution is evaluated)."""
        step = self.step_of(i)
        self.was_evaluated[i] = True
        self.eval_count[step] += 1
        self.total_work[step] += self.exec_work[i]
        if self.streaming:
            return self._stream(i, step)
        if self.eval_count[step] == self.n:
            tokens = float(np.sum(self.plans[step].tokens))
            self.clock.push(self.clock.now + tokens * self.pipe.processing_s_per_token / self.pipe.workers, BATCH, step)
        return False

    def _stream(self, i: int, step: int) -> bool:
        """Puts what execution i's evaluation completes into the micro-step queue (``stream_unit``); False if
        nothing entered it."""
        unit = self.stream_unit
        if unit == "execution":
            self.queued_count[step] += 1
            self.ready_work[step] += self.exec_work[i]
            return True
        g = self.group_size
        group = i // g
        done = self.group_evals.get(group, 0) + 1
        self.group_evals[group] = done
        if unit == "group":
            if done < g:
                return False
            self._queue_group(step, group)
            return True
        released, per_step = False, self.n // g
        while (
            self.group_next[step] < per_step and self.group_evals.get(step * per_step + self.group_next[step], 0) == g
        ):
            self._queue_group(step, step * per_step + self.group_next[step])
            self.group_next[step] += 1
            released = True
        return released

    def _queue_group(self, step: int, group: int) -> None:
        g = self.group_size
        first = group * g
        self.queued_count[step] += g
        self.ready_work[step] += sum(self.exec_work[first : first + g])

    def move(self, i: int, old: int, new: int) -> None:
        """Execution ``i`` now trains in step ``new``, not ``old`` (partial rollouts): its evaluated work moves;
        its data has not entered a queue (whole groups enter once evaluated, after their group is assigned)."""
        if self.was_evaluated[i]:
            self.eval_count[old] -= 1
            self.eval_count[new] += 1
            self.total_work[old] -= self.exec_work[i]
            self.total_work[new] += self.exec_work[i]

    def drop(self, i: int) -> None:
        """Execution ``i`` is dropped (beyond the staleness bound): it enters its step's queue with no work."""
        if self.was_evaluated[i]:
            self.total_work[self.step_of(i)] -= self.exec_work[i]
        self.exec_work[i] = 0.0

    def batch_ready(self, step: int) -> None:
        """Without streaming: the step's whole batch is processed and in the queue."""
        self.queued_count[step] = self.n
        self.ready_work[step] = self.total_work[step]

    # -- micro-steps and the optimizer step -------------------------------------------------------
    def claim(self, v: int) -> None:
        """Free training cells holding weights ``v`` claim the ready micro-steps of step ``v``."""
        now = self.clock.now
        if v >= self.steps or self.opt_running or now < self.boundary_until:
            return
        ready = self.ready_work[v]
        if ready <= EPS:
            return
        complete = self.queued_count[v] == self.n
        m = self.micro_flops
        held = 0.0 if complete else self.lookahead * m  # in the packer's open micro-batches
        tr, cells = self.tr, self.cells
        role, busy, pending, wver = cells.role, cells.busy, cells.pending_switch, cells.wver
        for c in range(cells.k):
            if role[c] is not TRAINING or busy[c] or pending[c] is not None or wver[c] != v:
                continue
            if ready - held < m - EPS and not complete:
                break
            w = min(m, ready)
            ready -= w
            busy[c] = True
            self.micro_work[c] = w
            self.micro_t0[c] = now
            self.in_flight[v] += 1
            if c != 0:
                self.sat_used[v].add(c)
            cells.switch_tok[c] += 1
            compile_s = 0.0 if self.warm[c] else tr.warmup_micro_step_s
            self.warm[c] = True
            self.clock.push(now + tr.micro_step_overhead_s + w / self.rate + compile_s, MICRO, c, cells.switch_tok[c])
            if ready <= EPS:
                ready = 0.0
                break
        self.ready_work[v] = ready

    def micro_done(self, c: int, v: int) -> None:
        """Cell ``c`` finished its micro-step of step ``v``."""
        self.cells.busy[c] = False
        self.in_flight[v] -= 1
        self.micro_count += 1
        self.micro_time[c] += self.clock.now - self.micro_t0[c]
        if self.timeline is not None:
            self.timeline.micro_step(self.micro_t0[c], self.clock.now, c, v, flops=self.micro_work[c])

    def check_step(self, v: int) -> None:
        """Starts step ``v``'s optimizer step on the core once all its data is trained and the core is free."""
        if (
            v >= self.steps
            or self.opt_running
            or self.queued_count[v] < self.n
            or self.ready_work[v] > EPS
            or self.in_flight[v]
        ):
            return
        if self.cells.role[0] is not TRAINING or self.cells.busy[0]:
            return  # the core applies the optimizer step once it is training and free
        tr = self.tr
        sats = len(self.sat_used[v])
        dur = tr.optimizer_step_s + (tr.grad_reduce_s + sats * tr.grad_receive_s if sats else 0.0)
        if not self.opt_warm:
            dur += tr.warmup_optimizer_step_s
            self.opt_warm = True
        self.opt_running = True
        self.cells.busy[0] = True
        self.micro_t0[0] = self.clock.now
        self.clock.push(self.clock.now + dur, OPT, v)

    def optimizer_done(self, v: int) -> None:
        """The optimizer step of step ``v`` ended (the core is free)."""
        self.opt_running = False
        self.cells.busy[0] = False
        self.opt_time += self.clock.now - self.micro_t0[0]
        if self.timeline is not None:
            self.timeline.optimizer_step(self.micro_t0[0], self.clock.now, 0, v, v + 1)

    def start_boundary(self, version: int) -> None:
        """After an optimizer step: no micro-step is claimed for ``step_boundary_s`` (a ``BOUNDARY`` event)."""
        boundary = self.pipe.step_boundary_s
        if boundary > 0:
            self.boundary_until = self.clock.now + boundary
            self.clock.push(self.boundary_until, BOUNDARY, version)

    def pull(self, c: int, version: int, sync_s: float) -> None:
        """A free training satellite ``c`` pulls weights ``version`` (``sync_s``; a ``PULL`` event)."""
        cells = self.cells
        if c != 0 and not cells.busy[c] and cells.wver[c] != version:
            cells.busy[c] = True
            cells.switch_tok[c] += 1
            self.clock.push(self.clock.now + sync_s, PULL, c, cells.switch_tok[c])

    def pull_done(self, c: int, version: int) -> None:
        self.cells.busy[c] = False
        self.cells.wver[c] = version

    # -- what it measured -------------------------------------------------------------------------
    def busy_s(self) -> float:
        """Cell-seconds spent on micro-steps and optimizer steps."""
        return sum(self.micro_time) + self.opt_time

    def stats(self) -> dict[str, float]:
        return {
            "flops": float(sum(self.total_work[: self.steps])),
            "micro_steps": self.micro_count,
            "micro_step_cell_s": float(sum(self.micro_time)),
            "optimizer_s": self.opt_time,
        }
