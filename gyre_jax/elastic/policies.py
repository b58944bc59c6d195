"""Scheduling policies: plain Python objects (no JAX) that decide each cell's role and how many executions
to dispatch, from rollout events and the facts the driver keeps.

The same policy objects drive the real controller and the simulator (``gyre_jax.sim``). The driver (the
controller or the simulator) owns the facts: cell roles, slots per cell, the rollout waterlevel
(counters d dispatched, p started, f finished; outstanding w = d - f), the policy version, and where
the step being trained stands. After every event it calls

    decision = policy.plan(event, state)        # Event, ClusterState -> Decision

and carries the decision out:

1. ``decision.roles[c]`` is the role cell ``c`` should have (SERVING or TRAINING). For a cell whose
   current role differs and that is not already switching, the driver starts a switch: the role becomes
   SWITCHING at once and a ``switched`` event follows when the cell has its new role; a training cell
   that is busy (computing a micro-step) keeps its role and owes the switch until it is free
   (``state.Cells``: the same in the controller and the simulator). A serving cell that leaves stops
   taking new sessions and moves its sessions to the serving cell that stays longest (the last one in the
   leave order).
2. ``decision.dispatch`` more executions may be launched now, the next ones in task order (step by
   step). Each starts on a serving cell with a free slot or waits for one (dispatched, not started).
   While a decision dispatched or started executions, the driver decides again on a ``started`` event
   (``driver.Driver.replan``).
3. Cells in the TRAINING role claim micro-steps of step ``state.version`` from the shared queue
   (fast cells take more); the core cell (cell 0) holds the only optimizer state and applies the
   optimizer step once every micro-step of the step is done. Weights stay fixed within a step.

The events are the typed records of ``events.py`` (one event may stand for several executions that changed
at the same instant; the counters in ``state`` carry the numbers); the state is built by
``state.cluster_state`` from the driver's facts, the same function in the controller and the simulator.

A policy's decisions depend only on the events and states it was given, so the same sequence gives the
same decisions in the controller and in the simulator (``tests/elastic/test_policies.py``,
``tests/elastic/test_controller.py``: a real run's sequence through the simulator's books,
``sim.replay``). The first trainer's call ``decide(event, waterlevel, roles) -> roles`` still works for the
colocated policy: the policy then keeps the step facts itself from the events.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from gyre_jax.elastic.events import Event, MicroStepDone, StepBegan, StepTrained, Switched, WeightsPulled
from gyre_jax.elastic.state import ClusterState, Role, Waterlevel


@dataclass(frozen=True)
class Decision:
    """``roles``: the role each cell should have (SERVING or TRAINING); ``dispatch``: executions that may be
    launched now (0 or more)."""

    roles: list[Role]
    dispatch: int = 0


def admissible(state: ClusterState, dispatch_staleness: int) -> int:
    """Executions that may be dispatched under staleness bound eta (AReaL's admission rule).

    Batch k (executions k*N ... (k+1)*N - 1) may start once the policy version is at least k - eta, so at
    most (eta + version + 1) * N executions are ever dispatched: none is trained more than eta versions
    after the weights it started with.
    """
    if state.batch_size <= 0:
        return 0
    allowed = max(0, (dispatch_staleness + state.version + 1) * state.batch_size - state.waterlevel.dispatched)
    return allowed if state.undispatched is None else min(allowed, state.undispatched)


class SchedulingPolicy(abc.ABC):
    """Interface: ``initial_roles()`` and ``plan(event, state) -> Decision`` (see the module docstring)."""

    name = "base"

    def __init__(self, num_cells: int):
        if num_cells < 1:
            raise ValueError(f"num_cells={num_cells} must be >= 1")
        self.num_cells = num_cells
        self._compat: _CompatState | None = None

    def initial_roles(self) -> list[Role]:
        return [Role.SERVING] * self.num_cells

    @abc.abstractmethod
    def plan(self, event: Event, state: ClusterState) -> Decision:
        """The roles every cell should have after ``event``, and how many executions to dispatch now."""

    def decide(self, event: Event, waterlevel: Waterlevel, roles: list[Role]) -> list[Role]:
        """Older call used by the trainer: roles only; the step facts are kept here from the events
        (``StepBegan`` with its ``executions``, ``Finished``, ``StepTrained``)."""
        if self._compat is None:
            self._compat = _CompatState()
        state = self._compat.update(event, waterlevel, roles)
        return self.plan(event, state).roles

    def _check(self, state: ClusterState) -> None:
        if state.num_cells != self.num_cells:
            raise ValueError(f"{self.name} policy has {self.num_cells} cells but the state has {state.num_cells}")


class _CompatState:
    """Step facts for ``decide(event, waterlevel, roles)``, derived from the events alone."""

    def __init__(self) -> None:
        self.version = 0
        self.batch_size = 0
        self.finished_before_step = 0

    def update(self, event: Event, waterlevel: Waterlevel, roles: list[Role]) -> ClusterState:
        if isinstance(event, StepBegan):
            self.batch_size = event.executions
            self.finished_before_step = waterlevel.finished
        elif isinstance(event, StepTrained):
            self.version += 1
            self.batch_size = 0
        return ClusterState(
            time=event.time,
            roles=list(roles),
            capacity=[0] * len(roles),
            waterlevel=waterlevel,
            version=self.version,
            batch_size=self.batch_size,
            step_finished=waterlevel.finished - self.finished_before_step,
        )


class ColocatedPolicy(SchedulingPolicy):
    """All cells serve until every execution of the step has finished, then all cells train; on-policy.

    The next step's executions are dispatched once the step is trained (staleness 0).
    """

    name = "colocated"

    def plan(self, event: Event, state: ClusterState) -> Decision:
        self._check(state)
        done = state.batch_size > 0 and state.step_finished >= state.batch_size and state.waterlevel.outstanding == 0
        role = Role.TRAINING if done else Role.SERVING
        return Decision(roles=[role] * self.num_cells, dispatch=0 if done else admissible(state, 0))


class AsyncPolicy(SchedulingPolicy):
    """A fixed split: cells ``0 .. training_cells - 1`` train (cell 0 is the core), the others serve.

    Executions are dispatched as far ahead as the staleness bound ``dispatch_staleness`` (eta) allows.
    """

    name = "async"

    def __init__(self, num_cells: int, training_cells: int | None = None, dispatch_staleness: int = 1):
        super().__init__(num_cells)
        if num_cells < 2:
            raise ValueError(f"the async policy needs >= 2 cells (one trains, one serves), got num_cells={num_cells}")
        training_cells = num_cells // 2 if training_cells is None else training_cells
        if not 1 <= training_cells <= num_cells - 1:
            raise ValueError(
                f"async training_cells={training_cells} must be in [1, {num_cells - 1}] "
                f"(at least one cell trains and one serves)"
            )
        if dispatch_staleness < 0:
            raise ValueError(f"dispatch_staleness={dispatch_staleness} must be >= 0")
        self.training_cells = training_cells
        self.dispatch_staleness = dispatch_staleness
        self._roles = [Role.TRAINING] * training_cells + [Role.SERVING] * (num_cells - training_cells)

    def initial_roles(self) -> list[Role]:
        return list(self._roles)

    def plan(self, event: Event, state: ClusterState) -> Decision:
        self._check(state)
        return Decision(roles=list(self._roles), dispatch=admissible(state, self.dispatch_staleness))


_CELL_FREED = (MicroStepDone, WeightsPulled, Switched)  # a cell's work or switch ended (``idle_before_return_s``)


class ElasticPolicy(SchedulingPolicy):
    """Waterlevel scheduling: cells leave serving as the rollout waterlevel falls and return on demand.

    Executions of steps up to ``version`` are *due* (the step being trained needs them); executions of
    later steps, dispatched early within the staleness bound eta, are *ahead*: they fill serving slots
    nobody else needs and yield them when a cell leaves (the driver moves them or they wait for a slot,
    their timeout clock paused).

    - Leave: the next serving cell in the fixed order (the core, cell 0, first; then satellites 1, 2, ...)
      may switch to training only if w <= C_R - C_e, where w counts the due executions outstanding
      (after this decision's dispatch) and C_R - C_e is the slots left on the cells that keep serving.
      One cell leaves at a time (none while another is still switching out). ``leave_on`` says when a
      cell wants to leave: ``"backlog"`` (default) while micro-steps of step ``version`` are ready and no
      training cell is free to take them; ``"waterlevel"`` (the published rule) whenever step ``version``
      has executions dispatched and not yet trained on.
    - Return: training cells go back to serving in reverse order, as many as the waiting executions
      need: when due executions wait for a slot (a cell computing a micro-step finishes it first), or,
      while training has no backlog, when ahead executions or moved sessions wait (cells idle for at
      least ``idle_before_return_s``, so that a cell does not bounce between roles). The
      core returns last: not while micro-steps of its step are ready or running, and for ahead
      executions not while its step has data to come.
    - Dispatch: due executions always (they wait for a slot if none is free); ahead executions, up to
      the staleness bound eta (AReaL's rule), only into free slots and only while training has no backlog.
    Training cells claim micro-steps as executions are evaluated (streaming); the driver does that.
    """

    name = "elastic"
    LEAVE_RULES = ("backlog", "waterlevel")

    def __init__(
        self,
        num_cells: int,
        dispatch_staleness: int = 1,
        leave_on: str = "waterlevel",
        idle_before_return_s: float = 0.0,
        yield_ahead: bool = False,
    ):
        super().__init__(num_cells)
        if dispatch_staleness < 0:
            raise ValueError(f"dispatch_staleness={dispatch_staleness} must be >= 0")
        if leave_on not in self.LEAVE_RULES:
            raise ValueError(f"leave_on={leave_on!r} must be one of {', '.join(self.LEAVE_RULES)}")
        if idle_before_return_s < 0:
            raise ValueError(f"idle_before_return_s={idle_before_return_s} must be >= 0")
        self.dispatch_staleness = dispatch_staleness
        self.leave_on = leave_on
        self.idle_before_return_s = idle_before_return_s
        self.yield_ahead = yield_ahead
        self._idle_since = [0.0] * num_cells  # when each cell last finished a micro-step or a switch

    def plan(self, event: Event, state: ClusterState) -> Decision:
        self._check(state)
        n = self.num_cells
        if isinstance(event, _CELL_FREED):
            self._idle_since[event.cell] = event.time
        if Role.SWITCHING in state.roles:
            roles = [state.effective_role(c) for c in range(n)]
        else:
            roles = list(state.roles)
        capacity = state.capacity
        if capacity.count(capacity[0]) == n:  # equal cells (the usual case): count instead of summing
            serving_capacity = roles.count(Role.SERVING) * capacity[0]
        else:
            serving_capacity = sum([cap for r, cap in zip(roles, capacity) if r is Role.SERVING])
        allowed = admissible(state, self.dispatch_staleness)
        due_new = min(allowed, max(0, (state.version + 1) * state.batch_size - state.waterlevel.dispatched))
        backlog = state.ready > 0
        # Data of the step that trains next is on its way (evaluating) and no cell trains yet: keep freed
        # slots free, or ahead executions would take the capacity the step is about to need.
        imminent = state.step_finished > state.step_processed and Role.TRAINING not in roles
        free = serving_capacity - state.waterlevel.outstanding - due_new
        ahead_new = 0 if (backlog or imminent) else max(0, min(allowed - due_new, free))
        dispatch = due_new + ahead_new
        due_outstanding = state.due_outstanding + due_new
        due_waiting = due_outstanding - serving_capacity
        ahead_waiting = 0 if backlog else state.held + (allowed - dispatch)
        returned = False
        if due_waiting > 0 or ahead_waiting > 0:
            returned = self._return(state, roles, due_waiting, ahead_waiting, backlog)
        if due_waiting <= 0 and not returned:
            w = due_outstanding if self.yield_ahead else state.waterlevel.outstanding + dispatch
            self._leave(state, roles, backlog, w, serving_capacity)
        return Decision(roles=roles, dispatch=dispatch)

    def _return(
        self, state: ClusterState, roles: list[Role], due_waiting: int, ahead_waiting: int, backlog: bool
    ) -> bool:
        """Return: training cells go back to serving in reverse order (in ``roles``), as many as the waiting
        executions need. True if any cell returns."""
        due = due_waiting > 0  # due executions come first: a busy cell finishes its micro-step, then moves
        waiting = due_waiting if due else ahead_waiting
        # The core keeps training while its step has work now; for ahead executions, also while data is coming.
        core_needed = (
            backlog
            or state.in_flight > 0
            or (not due and state.step_dispatched > 0 and state.step_processed < state.step_dispatched)
        )
        returned = False
        for c in range(self.num_cells - 1, -1, -1):
            if waiting <= 0:
                break
            if state.roles[c] is not Role.TRAINING:  # a switching cell finishes its switch first
                continue
            if not due and (
                state.is_busy(c) or backlog or state.time - self._idle_since[c] < self.idle_before_return_s
            ):
                continue
            if c == 0 and (core_needed or Role.TRAINING in roles[1:]):
                continue
            roles[c] = Role.SERVING
            waiting -= state.capacity[c]
            returned = True
        return returned

    def _leave(self, state: ClusterState, roles: list[Role], backlog: bool, w: int, serving_capacity: int) -> None:
        """Leave: the next serving cell in the fixed order switches to training (in ``roles``) when it wants to
        (``leave_on``), no other cell is leaving, and the ``w`` outstanding executions fit the cells left."""
        current = state.roles
        step_open = state.step_dispatched > 0 and not (
            state.step_processed >= state.batch_size and state.ready == 0 and state.in_flight == 0
        )
        wants = backlog if self.leave_on == "backlog" else step_open
        leaving = Role.SWITCHING in current and any(
            r is Role.SWITCHING and t is Role.TRAINING for r, t in zip(current, roles)
        )
        if wants and not leaving:
            for c in range(self.num_cells):
                if roles[c] is Role.SERVING:
                    if current[c] is Role.SERVING and w <= serving_capacity - state.capacity[c]:
                        roles[c] = Role.TRAINING
                    break


ADMISSION_ORDERS = ("task", "longest_first")


class DurationHistory:
    """Per-task duration history, for admission in order of predicted duration (longest first).

    ``record(task, seconds)`` after each execution ends (slot to harness end; a timed-out one counts as its
    timeout); ``predict(task)`` is the mean of the task's recorded durations, or, for a task never seen, the
    mean over every task seen (0 before any). ``order(tasks)`` is the admission order of a batch's tasks:
    positions sorted by predicted duration, longest first, ties in task order. Plain Python, used by the
    simulator (``sim/partial.py``) and the real controller's ledger (``ledger.RolloutLedger``); a task is any
    hashable id (the simulator's dataset index, a run's task id).
    """

    def __init__(self) -> None:
        self.sum: dict[Hashable, float] = {}
        self.count: dict[Hashable, int] = {}
        self.total = 0.0
        self.n = 0

    def record(self, task: Hashable, seconds: float) -> None:
        self.sum[task] = self.sum.get(task, 0.0) + seconds
        self.count[task] = self.count.get(task, 0) + 1
        self.total += seconds
        self.n += 1

    def predict(self, task: Hashable) -> float:
        c = self.count.get(task, 0)
        if c:
            return self.sum[task] / c
        return self.total / self.n if self.n else 0.0

    def order(self, tasks: Sequence[Hashable]) -> list[int]:
        """Positions 0 .. len(tasks) - 1, the task predicted longest first (a stable sort: ties in task order)."""
        pred = [self.predict(t) for t in tasks]
        return sorted(range(len(tasks)), key=lambda j: -pred[j])


POLICY_NAMES = ("colocated", "async", "elastic")


def make_policy(name: str, num_cells: int, **options) -> SchedulingPolicy:
    """The policy ``name`` for ``num_cells`` cells. Options: async ``training_cells``, ``dispatch_staleness``;
    elastic ``dispatch_staleness``, ``leave_on``, ``idle_before_return_s``, ``yield_ahead``; colocated none."""
    if "max_staleness" in options:
        raise ValueError(
            "the policy option max_staleness was renamed: use dispatch_staleness (as config.schedule.dispatch_staleness)"
        )
    if name == "colocated":
        if options:
            raise ValueError(f"the colocated policy takes no options, got {sorted(options)}")
        return ColocatedPolicy(num_cells)
    if name == "async":
        unknown = set(options) - {"training_cells", "dispatch_staleness"}
        if unknown:
            raise ValueError(
                f"unknown async policy options {sorted(unknown)} (known: training_cells, dispatch_staleness)"
            )
        return AsyncPolicy(num_cells, **options)
    if name == "elastic":
        unknown = set(options) - {"dispatch_staleness", "leave_on", "idle_before_return_s", "yield_ahead"}
        if unknown:
            raise ValueError(
                f"unknown elastic policy options {sorted(unknown)} "
                f"(known: dispatch_staleness, leave_on, idle_before_return_s, yield_ahead)"
            )
        return ElasticPolicy(num_cells, **options)
    raise ValueError(f"unknown scheduling policy {name!r} (available: {', '.join(POLICY_NAMES)})")
