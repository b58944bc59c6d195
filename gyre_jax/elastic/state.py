"""What a scheduling policy decides from (``ClusterState``) and the one way a driver builds it.

The real controller and the simulator both keep the same facts: the cells' roles (``Cells``, one class for
both), the rollout's books (a ledger with the ``RolloutBooks`` methods: ``elastic.ledger.RolloutLedger`` and
``sim.ledger.SimLedger``) and what the training side reports (``TrainingFacts``). Both call
``cluster_state(time, version, cells, books, training)`` on them, so the policy gets the same inputs built
the same way in a real run and in the simulator; quantities derived from the facts (``held``) are derived
here, once. Serialized form (the ``"state"`` object of a ``decisions.jsonl`` line): ``state_dict``;
``state_from_dict`` reads it back.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol


class Role(enum.StrEnum):
    SERVING = "serving"
    TRAINING = "training"
    SWITCHING = "switching"


@dataclass
class Waterlevel:
    dispatched: int = 0  # d(t): executions handed to the executor
    started: int = 0  # p(t): executions whose session holds a serving slot
    finished: int = 0  # f(t): executions whose harness ended (finished, timed out or crashed)

    @property
    def outstanding(self) -> int:
        """w = d - f: executions dispatched and not yet finished."""
        return self.dispatched - self.finished

    @property
    def queued(self) -> int:
        """d - p: executions dispatched that wait for a serving slot."""
        return self.dispatched - self.started

    @property
    def sessions(self) -> int:
        """p - f: executions started whose harness has not ended (on a slot, or waiting for one after a move)."""
        return self.started - self.finished


@dataclass
class ClusterState:
    """The facts a policy decides from, built by ``cluster_state`` and handed over with every event.

    Per-cell lists have one entry per cell (cell 0 is the core). ``targets[c]`` is the role a SWITCHING
    cell is moving to (None for cells that are not switching). ``busy[c]`` is True while a training cell
    computes a micro-step or the optimizer step (in the simulator also a weight pull). The ``step_*``
    counters, ``ready`` and ``in_flight`` describe step ``version`` (the step that trains next): its
    executions dispatched, finished (harness ended) and processed (micro-steps queued), micro-steps ready
    to claim and being computed. ``batch_size`` is the number of executions per step (N); ``undispatched``
    how many executions the run still has to dispatch before its last step (None: no end in sight).
    ``due_outstanding`` counts the executions of steps <= ``version`` dispatched and not finished (w
    restricted to the steps the trainer is waiting for); ``held`` the sessions that lost their slot to a
    leaving cell and wait for one: the sessions started and not ended beyond the slots of the SERVING cells.
    """

    time: float
    roles: list[Role]
    capacity: list[int]
    waterlevel: Waterlevel = field(default_factory=Waterlevel)
    targets: list[Role | None] | None = None
    busy: list[bool] | None = None
    version: int = 0
    batch_size: int = 0
    step_dispatched: int = 0
    step_finished: int = 0
    step_processed: int = 0
    ready: int = 0
    in_flight: int = 0
    undispatched: int | None = None
    due_outstanding: int = 0
    held: int = 0

    @property
    def num_cells(self) -> int:
        return len(self.roles)

    def effective_role(self, cell: int) -> Role:
        """The role a cell has, or is switching to."""
        role = self.roles[cell]
        if role is Role.SWITCHING:
            target = self.targets[cell] if self.targets is not None else None
            if target is None:
                raise ValueError(f"cell {cell} is switching but state.targets[{cell}] is not set")
            return target
        return role

    def is_busy(self, cell: int) -> bool:
        return bool(self.busy[cell]) if self.busy is not None else False


class Cells:
    """The cells' roles as the scheduler sees them: ``role[c]`` (SERVING, TRAINING or SWITCHING to
    ``target[c]``), ``busy[c]`` (a training cell computing), the switch a busy cell owes
    (``pending_switch[c]``) and ``capacity[c]`` (serving slots). The lists are updated in place, never
    replaced (the simulator's serving and training models share them).

    A policy's roles are carried out with ``switches_to_begin``: a cell that is switching finishes its
    switch first, and a busy cell finishes its micro-step (or weight pull) first, keeping its role and
    owing the switch until the driver calls ``take_pending`` when it is free (its ``micro_step_done``).
    ``owner`` names the policy in errors."""

    def __init__(self, roles: Sequence[Role], capacity: Sequence[int], owner: str = "the policy"):
        if len(capacity) != len(roles):
            raise ValueError(f"{len(roles)} roles but {len(capacity)} capacities: one per cell")
        k = len(roles)
        self.k = k
        self.owner = owner
        self.role: list[Role] = list(roles)
        self.target: list[Role | None] = [None] * k
        self.busy = [False] * k
        self.pending_switch: list[Role | None] = [None] * k
        self.any_pending = False
        self.capacity = list(capacity)

    def switches_to_begin(self, wanted: Sequence[Role]) -> Iterator[tuple[int, Role]]:
        """The switches to begin now (cell, role) for the roles a policy wants, in cell order; a busy cell
        owes its switch until it is free (``take_pending``), a switching cell finishes its switch first."""
        if len(wanted) != self.k:
            raise RuntimeError(f"{self.owner} returned {len(wanted)} roles for {self.k} cells")
        role, busy, pending = self.role, self.busy, self.pending_switch
        if wanted == role and not self.any_pending:
            return
        self.any_pending = False
        for c in range(self.k):
            want, cur = wanted[c], role[c]
            if cur is Role.SWITCHING:
                continue
            if want is cur:
                pending[c] = None
                continue
            if want is not Role.SERVING and want is not Role.TRAINING:
                raise RuntimeError(f"{self.owner} asked cell {c} for role {want!r} (SERVING or TRAINING only)")
            if busy[c]:
                pending[c] = want  # finishes its micro-step / weight pull first
                self.any_pending = True
                continue
            yield c, want

    def take_pending(self, c: int) -> Role | None:
        """The switch cell ``c`` owes (None if none), now no longer owed."""
        want = self.pending_switch[c]
        self.pending_switch[c] = None
        return want

    def begin_switch(self, c: int, want: Role) -> Role:
        """Cell ``c`` starts switching to ``want``; returns the role it leaves."""
        old = self.role[c]
        self.role[c] = Role.SWITCHING
        self.target[c] = want
        return old

    def end_switch(self, c: int) -> Role:
        """Cell ``c`` has its new role; returns it."""
        want = self.target[c]
        if want is None:
            raise RuntimeError(f"cell {c} ended a switch it never began (role {self.role[c].value})")
        self.role[c] = want
        self.target[c] = None
        return want

    def reset(self, roles: Sequence[Role]) -> None:
        """Every cell has ``roles[c]`` now, none switching, busy or owing a switch."""
        self.role[:] = roles
        self.target[:] = [None] * self.k
        self.busy[:] = [False] * self.k
        self.pending_switch[:] = [None] * self.k
        self.any_pending = False

    def serving_slots(self) -> int:
        """Slots of the cells in the SERVING role (a switching cell has none)."""
        cap = self.capacity
        if cap.count(cap[0]) == self.k:  # equal cells (the usual case): count instead of summing
            return self.role.count(Role.SERVING) * cap[0]
        return sum([c for r, c in zip(self.role, cap) if r is Role.SERVING])


class TrainingFacts(NamedTuple):
    """What the training side reports about step ``version``: executions whose data is queued (processed),
    micro-steps ready to claim and micro-steps being computed."""

    processed: int = 0
    ready: int = 0
    in_flight: int = 0


class RolloutBooks(Protocol):
    """The rollout's books a driver keeps (the real ledger and the simulator's): the waterlevel, and per step
    the executions dispatched and finished."""

    wl: Waterlevel
    batch_size: int

    @property
    def undispatched(self) -> int: ...

    def step_counts(self, step: int) -> tuple[int, int]:
        """(dispatched, finished) executions of ``step``."""
        ...

    def due_outstanding(self, version: int) -> int:
        """Executions of steps <= ``version`` dispatched and not finished."""
        ...


def cluster_state(
    time: float, version: int, cells: Cells, books: RolloutBooks, training: TrainingFacts
) -> ClusterState:
    """The policy's state at ``time`` with the policy at ``version``: the one builder both drivers call. The
    per-cell lists and the waterlevel are the driver's own (no copies: the simulator calls this after every
    event), valid while the policy decides; ``Driver.decide`` serializes the state before anything changes."""
    wl = books.wl
    dispatched, finished = books.step_counts(version)
    return ClusterState(
        time=time,
        roles=cells.role,
        capacity=cells.capacity,
        waterlevel=wl,
        targets=cells.target,
        busy=cells.busy,
        version=version,
        batch_size=books.batch_size,
        step_dispatched=dispatched,
        step_finished=finished,
        step_processed=training.processed,
        ready=training.ready,
        in_flight=training.in_flight,
        undispatched=books.undispatched,
        due_outstanding=books.due_outstanding(version),
        held=max(0, wl.sessions - cells.serving_slots()),
    )


def state_dict(state: ClusterState) -> dict[str, Any]:
    """A ``ClusterState`` as the JSON object of a ``decisions.jsonl`` line."""
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
