"""The rollout ledger: a controller segment's executions, from dispatch to the step's micro-step queue.

Executions are dispatched (d) in task order, or with ``admission="longest_first"`` their task groups longest
predicted first (``policies.DurationHistory``), started when a serving slot is free (p) and finished when the
harness ended and the evaluator scored them (f): the rollout waterlevel. When a task's group of G
executions has all finished, it is scored with ``rl.step_data.score_executions`` on its TITO records
(staleness over every policy-generated token, executions over the drop bound leave the group, then
group-normalized advantages), appended to the durable execution queue, and the Grain pipeline's packed
micro-batches go straight into the training step's ``MicroStepQueue`` (streaming: training starts before
the step's last execution ends). Groups of later steps (dispatched ahead, within the dispatch bound) wait
here until their step is the one training.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gyre_jax.elastic.policies import ADMISSION_ORDERS, DurationHistory
from gyre_jax.elastic.state import Waterlevel
from gyre_jax.elastic.timeline import TimelineWriter
from gyre_jax.rl.microstep_queue import MicroStepQueue
from gyre_jax.rl.staleness import StalenessReport
from gyre_jax.rl.step_data import score_executions
from gyre_jax.rollout.executor import ExecutionResult, ExecutionSpec

STREAM_ORDERS = ("task", "arrival")


@dataclass
class StepRun:
    """Step ``step``'s executions and data, as the ledger tracks them."""

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
    staleness: StalenessReport = field(default_factory=StalenessReport)
    calls: dict[str, int] = field(default_factory=dict)  # model calls (TITO records) per execution
    skipped_groups: int = 0
    pipeline_stats: collections.Counter = field(default_factory=collections.Counter)
    pipeline_excluded: list = field(default_factory=list)
    t_first_dispatch: float | None = None
    t_last_finish: float | None = None
    order: list[int] = field(default_factory=list)  # positions in ``specs``, in dispatch order (set at the first)

    def ready_groups(self, order: str) -> list[str]:
        """Completed groups not fed yet: in task order up to the first incomplete one, or in arrival order."""
        if order == "arrival":
            return [g for g in self.completed_groups if g not in self.fed_groups]
        ready = []
        for g in self.group_order:
            if g in self.fed_groups:
                continue
            if g not in self.completed_groups:
                break
            ready.append(g)
        return ready


class RolloutLedger:
    """A segment's executions and their way into training (see the module docstring).

    ``make_specs(step)``: the step's executions in task order (the callee also sets aside leftovers of an
    interrupted attempt). ``drop_staleness``: the drop bound (None: none). ``stream_order``: groups enter
    the pipeline in task order (deterministic) or as they complete. ``admission``: the order a step's
    executions are dispatched in: "task", or "longest_first" (its tasks by their predicted durations, longest
    first: ``policies.DurationHistory``, the simulator's policy object, fed every ended execution's harness
    time; the order is fixed when the step's first execution is dispatched)."""

    def __init__(
        self,
        *,
        batch_size: int,
        drop_staleness: int | None,
        stream_order: str,
        executor,
        records,
        pipeline,
        make_specs: Callable[[int], list[ExecutionSpec]],
        timeline: TimelineWriter,
        admission: str = "task",
    ):
        if stream_order not in STREAM_ORDERS:
            raise ValueError(f"stream_order={stream_order!r} must be one of {STREAM_ORDERS}")
        if admission not in ADMISSION_ORDERS:
            raise ValueError(f"admission={admission!r} must be one of {ADMISSION_ORDERS}")
        self.history = DurationHistory() if admission == "longest_first" else None
        self.batch_size = batch_size
        self.drop_staleness = drop_staleness
        self.stream_order = stream_order
        self.executor = executor
        self.records = records
        self.pipeline = pipeline
        self.make_specs = make_specs
        self.timeline = timeline
        self.begin(0, 0)

    def begin(self, start: int, end: int) -> None:
        """A new segment: steps ``start .. end - 1``, none of their executions dispatched.

        The waterlevel counts the whole run, as the policy's version does: steps ``0 .. start - 1`` were trained
        in earlier segments (before an evaluation, or before the checkpoint a run resumed from), so their
        ``start * N`` executions count as dispatched and finished. Admission (``policies.admissible``: at most
        ``(eta + version + 1) * N`` dispatched) then lets the segment's first decision dispatch step
        ``start``'s executions (and eta steps ahead) only; counters restarted at 0 would admit ``start`` steps
        more, rolled out by the policy of step ``start`` and trained steps later, off-policy under eta = 0."""
        self.start, self.end = start, end
        before = start * self.batch_size
        self.wl = Waterlevel(dispatched=before, started=before, finished=before)
        self.steps: dict[int, StepRun] = {}
        self.waiting: collections.deque[tuple[int, ExecutionSpec]] = collections.deque()
        self.running = 0  # executions started whose harness has not ended (``wl.sessions``)
        self._dispatched = 0  # executions dispatched since ``start``
        self._total = (end - start) * self.batch_size
        self._packed = iter(self.pipeline) if end > start else iter(())

    # -- the books a policy's state is built from (``state.RolloutBooks``) ---------------------------------
    @property
    def undispatched(self) -> int:
        return self._total - self._dispatched

    def step_counts(self, step: int) -> tuple[int, int]:
        """(dispatched, finished) executions of ``step``."""
        run = self.steps.get(step)
        return (run.dispatched, run.finished) if run is not None else (0, 0)

    def due_outstanding(self, version: int) -> int:
        """Executions of steps <= ``version`` dispatched and not finished."""
        return sum(r.dispatched - r.finished for s, r in self.steps.items() if s <= version)

    def step_run(self, step: int) -> StepRun:
        run = self.steps.get(step)
        if run is None:
            specs = self.make_specs(step)
            if len(specs) != self.batch_size:
                raise ValueError(f"step {step} has {len(specs)} executions; expected {self.batch_size}")
            members: dict[str, list[str]] = {}
            for s in specs:
                members.setdefault(s.group_id, []).append(s.execution_id)
            run = StepRun(step=step, specs=specs, group_order=list(members), members=members)
            self.steps[step] = run
        return run

    # -- executions ---------------------------------------------------------------------------------------
    def dispatch(self, count: int) -> int:
        """The next ``count`` executions in task order (fewer at the segment's end) wait for a serving slot;
        returns how many."""
        count = min(count, self.undispatched)
        for _ in range(count):
            step = self.start + self._dispatched // self.batch_size
            run = self.step_run(step)
            if not run.order:
                run.order = self.admission_order(run)
            spec = run.specs[run.order[self._dispatched % self.batch_size]]
            self._dispatched += 1
            run.dispatched += 1
            run.t_first_dispatch = run.t_first_dispatch or time.time()
            self.wl.dispatched += 1
            self.waiting.append((step, spec))
        return count

    def admission_order(self, run: StepRun) -> list[int]:
        """Positions of ``run.specs`` in dispatch order: task order, or (``admission="longest_first"``) its groups
        by their tasks' predicted durations, longest first (ties in task order), each group's members together."""
        if self.history is None:
            return list(range(len(run.specs)))
        positions: dict[str, list[int]] = {}
        for k, spec in enumerate(run.specs):
            positions.setdefault(spec.group_id, []).append(k)
        tasks = [run.specs[positions[g][0]].task.task_id for g in run.group_order]
        return [k for j in self.history.order(tasks) for k in positions[run.group_order[j]]]

    def start_waiting(self, slots: int, on_finished: Callable[[ExecutionResult, int], None]) -> int:
        """Starts waiting executions while fewer than ``slots`` run; ``on_finished(result, step)`` follows each.
        Returns how many started."""
        started = 0
        while self.waiting and self.running < slots:
            started += 1
            step, spec = self.waiting.popleft()
            self.running += 1
            self.wl.started += 1
            now = time.time()
            self.timeline.execution_started(now, spec.execution_id, step=step)
            self.timeline.waterlevel(now, self.wl.dispatched, self.wl.started, self.wl.finished)
            self.executor.submit(spec, lambda r, s=step: on_finished(r, s))
        return started

    def finished(self, result: ExecutionResult, step: int) -> None:
        """An execution's harness ended and it was scored; its group completes with its last member."""
        now = time.time()
        run = self.steps[step]
        run.results[result.execution_id] = result
        run.finished += 1
        run.t_last_finish = now
        self.wl.finished += 1
        self.running -= 1
        if self.history is not None and result.returncode is not None:  # its harness ran (a timeout: its limit)
            self.history.record(result.task_id, result.duration_s)
        self.timeline.execution_ended(now, result.execution_id, result.status, step=step, reward=result.reward)
        self.timeline.waterlevel(now, self.wl.dispatched, self.wl.started, self.wl.finished)
        if all(e in run.results for e in run.members[result.group_id]):
            run.completed_groups.append(result.group_id)

    # -- data ---------------------------------------------------------------------------------------------
    def feed(self, step: int, version: int, queue: MicroStepQueue) -> bool:
        """Scores and enqueues step ``step``'s completed groups (the learner is at policy ``version``) and puts
        what the pipeline packs into ``queue``. Returns True once the step's last micro-batch is in (the
        queue is then closed)."""
        run = self.steps.get(step)
        if run is None:
            return False
        for g in run.ready_groups(self.stream_order):
            run.fed_groups.add(g)
            entries, untrained = self._score_group(run, g, version)
            last = len(run.fed_groups) == len(run.group_order)
            self.pipeline.enqueue(run.step, entries, normalizer=self.batch_size, last=last, untrained=untrained)
            run.processed += len(entries)
        for item in self._packed:
            run.pipeline_stats.update(item.stats)
            run.pipeline_excluded.extend(item.excluded)
            if item.packed is not None:
                mb = item.packed.micro_batch
                run.pipeline_stats["tokens_computed"] += mb.num_tokens
                run.pipeline_stats["tokens_trained"] += mb.num_target_tokens
                run.pipeline_stats["micro_batches"] += 1
                queue.put(mb)
            if item.end_of_step:
                queue.close()
                return True
        return False

    def _score_group(self, run: StepRun, group: str, version: int) -> tuple[list[tuple[str, float]], set[str]]:
        """(execution id, advantage) of every member in task order, and the members that will not train."""
        eids = run.members[group]
        records = {e: self.records.read(e) for e in eids}
        run.calls.update({e: len(r) for e, r in records.items()})
        rewards = {e: None if run.results[e].excluded else run.results[e].reward for e in eids}
        adv, report = score_executions(rewards, dict.fromkeys(eids, group), records, version, self.drop_staleness)
        run.staleness.staleness.update(report.staleness)
        run.staleness.dropped.extend(report.dropped)
        run.staleness.unknown.extend(report.unknown)
        run.skipped_groups += adv.skipped_groups
        return [(e, adv.advantages.get(e, 0.0)) for e in eids], {e for e in eids if e not in adv.advantages}

    def pop(self, step: int) -> StepRun:
        return self.steps.pop(step)
