"""Scheduling policies: plain Python objects (no JAX) that decide each cell's role from rollout events.

The same policy objects drive the real controller and the simulator. A policy sees events (a step
began, an execution was dispatched / started / finished, a step finished training) together with
the rollout waterlevel (counters d dispatched, p started, f finished; outstanding w = d - f), and
returns the roles it wants every cell to have.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass


class Role(str, enum.Enum):
    SERVING = "serving"
    TRAINING = "training"
    SWITCHING = "switching"


@dataclass
class Waterlevel:
    dispatched: int = 0  # d(t)
    started: int = 0  # p(t)
    finished: int = 0  # f(t)

    @property
    def outstanding(self) -> int:
        """w = d - f: executions dispatched and not yet finished."""
        return self.dispatched - self.finished


@dataclass(frozen=True)
class Event:
    """kind: "step_began" | "dispatched" | "started" | "finished" | "step_trained"."""

    kind: str
    step: int
    time: float
    execution_id: str | None = None
    executions_in_step: int = 0


class SchedulingPolicy(abc.ABC):
    """Interface: ``decide(event, waterlevel, roles) -> roles`` (one role per cell)."""

    name = "base"

    def __init__(self, num_cells: int):
        if num_cells < 1:
            raise ValueError(f"num_cells={num_cells} must be >= 1")
        self.num_cells = num_cells

    def initial_roles(self) -> list[Role]:
        return [Role.SERVING] * self.num_cells

    @abc.abstractmethod
    def decide(self, event: Event, waterlevel: Waterlevel, roles: list[Role]) -> list[Role]:
        """The roles every cell should have after ``event``."""


class ColocatedPolicy(SchedulingPolicy):
    """All cells serve until every execution of the step has finished, then all cells train."""

    name = "colocated"

    def __init__(self, num_cells: int):
        super().__init__(num_cells)
        self._expected = 0

    def decide(self, event: Event, waterlevel: Waterlevel, roles: list[Role]) -> list[Role]:
        if event.kind == "step_began":
            self._expected = waterlevel.dispatched + event.executions_in_step
            return [Role.SERVING] * self.num_cells
        if event.kind == "finished" and waterlevel.finished >= self._expected and waterlevel.outstanding == 0:
            return [Role.TRAINING] * self.num_cells
        if event.kind == "step_trained":
            return [Role.SERVING] * self.num_cells
        return list(roles)


def make_policy(name: str, num_cells: int) -> SchedulingPolicy:
    if name == "colocated":
        return ColocatedPolicy(num_cells)
    raise ValueError(f"scheduling policy {name!r} is not supported yet (available: colocated)")
