"""Scheduler events: what happened in a run, as the scheduling policy is told it. One frozen dataclass per
kind, shared by the real controller (``controller.py``, whose worker threads post them to the ``Driver``)
and the simulator (``gyre_jax.sim``), so a policy object gets the same event types from both.

Every event has ``step`` (the RL step it belongs to: see each kind) and ``time`` (seconds, in the driver's
clock: wall-clock for a real run, simulated for the simulator; when the fact happened, e.g. the end of a
micro-step). The kinds:

==================  =================================================================================
``step_began``       a controller segment (or a simulation) starts at ``step``; ``executions``: per step
``started``          the last decision dispatched or started executions (the driver decides again)
``finished``         an execution's harness ended (finished, timed out or crashed); ``step``: its step
``data_ready``       an execution's (or a step's) data entered the micro-step queue
``micro_step_done``  cell ``cell`` computed a micro-step of step ``step``
``weights_pulled``   simulator only: satellite ``cell`` pulled the new weights (the real run loads them
                     inside its next micro-step claim)
``step_trained``     the optimizer step of ``step`` was applied (``ClusterState.version`` is ``step + 1``)
``switched``         cell ``cell`` has the role it was switching to (its target), after ``seconds``
``tick``             nothing happened for the driver's tick interval (time-based rules)
==================  =================================================================================

Serialized form (the ``"event"`` object of a ``decisions.jsonl`` line, ``Event.to_dict``): the kind and the
event's fields, e.g. ``{"kind": "finished", "step": 3, "time": 1733.25, "execution_id": "s3-t1-g05"}`` or
``{"kind": "switched", "step": 1, "time": 912.5, "cell": 0, "seconds": 2.75}``; ``event_from_dict`` reads
it back (lines written before these types, ``{"kind", "step", "time", "execution_id",
"executions_in_step", "cell"}``, too). A field marked ``serialized=False`` (the real run's
``ExecutionResult``) is not written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

_LOCAL = {"serialized": False}  # metadata of a field that stays in the process (not in decisions.jsonl)


@dataclass(frozen=True)
class Event:
    """The fields every event has (see the module docstring); use one of the kinds below."""

    kind: ClassVar[str] = ""
    step: int
    time: float

    def to_dict(self) -> dict[str, Any]:
        """The event's serialized form: ``{"kind": ..., "step": ..., "time": ..., <its fields>}``."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):
            if f.metadata.get("serialized", True):
                out[f.name] = getattr(self, f.name)
        return out


@dataclass(frozen=True)
class StepBegan(Event):
    kind: ClassVar[str] = "step_began"
    executions: int = 0  # executions per step (N)


@dataclass(frozen=True)
class Started(Event):
    kind: ClassVar[str] = "started"


@dataclass(frozen=True)
class Finished(Event):
    kind: ClassVar[str] = "finished"
    execution_id: str | None = None
    # the real run's ``rollout.executor.ExecutionResult`` (the controller's ledger books it); None in the simulator
    result: Any = field(default=None, compare=False, repr=False, metadata=_LOCAL)


@dataclass(frozen=True)
class DataReady(Event):
    kind: ClassVar[str] = "data_ready"
    execution_id: str | None = None  # None: a whole step's data (the simulator without streaming)


@dataclass(frozen=True)
class MicroStepDone(Event):
    """``time``: when the micro-step ended. The real run also says which queue slot it was, its FLOPs and when
    it started (the timeline's micro-step span and the measured costs)."""

    kind: ClassVar[str] = "micro_step_done"
    cell: int = 0
    slot: int | None = None
    flops: float = 0.0
    t_start: float | None = None


@dataclass(frozen=True)
class WeightsPulled(Event):
    kind: ClassVar[str] = "weights_pulled"
    cell: int = 0


@dataclass(frozen=True)
class StepTrained(Event):
    kind: ClassVar[str] = "step_trained"


@dataclass(frozen=True)
class Switched(Event):
    kind: ClassVar[str] = "switched"
    cell: int = 0
    seconds: float = 0.0  # how long the switch took
    moved: int = 0  # sessions it moved to another cell (serving -> training), KV included
    move_s: float = 0.0  # how long moving them took (part of ``seconds``)


@dataclass(frozen=True)
class Tick(Event):
    kind: ClassVar[str] = "tick"


EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (StepBegan, Started, Finished, DataReady, MicroStepDone, WeightsPulled, StepTrained, Switched, Tick)
}
EVENT_KINDS = tuple(EVENT_TYPES)
_OLD_KEYS = {"executions_in_step": "executions"}  # the single Event record of decisions.jsonl files before these types


def event_from_dict(d: dict[str, Any]) -> Event:
    """An event back from its serialized form (``Event.to_dict``, or an older line's single-record form)."""
    kind = d.get("kind")
    cls = EVENT_TYPES.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r} (expected one of {', '.join(EVENT_KINDS)})")
    known = {f.name for f in dataclasses.fields(cls) if f.metadata.get("serialized", True)}
    values = {_OLD_KEYS.get(k, k): v for k, v in d.items() if k != "kind"}
    unknown = sorted(k for k in values if k not in known)
    old_defaults = all(values[k] in (None, 0) for k in unknown)  # an older line's unused fields: None or 0
    if unknown and not old_defaults:
        raise ValueError(f"event {kind!r} has no field(s) {unknown} (its fields: {', '.join(sorted(known))})")
    return cls(**{k: v for k, v in values.items() if k in known})
