"""The driver's decision point: events in, the scheduling policy's decision out, each logged.

Workers, executions and switches post events (``post``) from their threads; the driver thread takes them
one at a time (``next``), is the only caller of the policy (``decide``), and logs every decision with its
event and the cluster state it saw to ``decisions.jsonl``, so a policy can be replayed alone on the same
sequence and must decide the same (``state_from_dict``; ``tests/elastic/test_controller.py``).
"""

from __future__ import annotations

import dataclasses
import json
import queue as queue_lib
from pathlib import Path
from typing import Any

from gyre_jax.elastic.policies import ClusterState, Decision, Event, Role, SchedulingPolicy, Waterlevel


class Driver:
    """Event queue + policy + decision log. ``tick_s``: a "tick" event after this long without one (for
    time-based rules, e.g. ``idle_before_return_s``)."""

    def __init__(self, policy: SchedulingPolicy, decisions_path: Path | None = None, tick_s: float = 1.0):
        self.policy = policy
        self.tick_s = tick_s
        self._events: queue_lib.Queue = queue_lib.Queue()
        self._log = open(decisions_path, "a", encoding="utf-8") if decisions_path is not None else None

    def post(self, kind: str, **payload: Any) -> None:
        """Thread-safe: an event for the driver thread."""
        self._events.put((kind, payload))

    def next(self) -> tuple[str, dict]:
        """The next event, or ``("tick", {})`` after ``tick_s`` without one."""
        try:
            return self._events.get(timeout=self.tick_s)
        except queue_lib.Empty:
            return "tick", {}

    @property
    def idle(self) -> bool:
        return self._events.empty()

    def clear(self) -> None:
        """Drops pending events (a segment's leftovers must not reach the next one)."""
        while True:
            try:
                self._events.get_nowait()
            except queue_lib.Empty:
                return

    def decide(self, event: Event, state: ClusterState) -> Decision:
        """The policy's decision on ``event`` in ``state``, logged."""
        decision = self.policy.plan(event, state)
        self.record(event, state, decision)
        return decision

    def record(self, event: Event, state: ClusterState | None, decision: Decision) -> None:
        if self._log is None or state is None:
            return
        line = {
            "event": dataclasses.asdict(event),
            "state": state_dict(state),
            "roles": [r.value for r in decision.roles],
            "dispatch": decision.dispatch,
        }
        self._log.write(json.dumps(line) + "\n")

    def flush(self) -> None:
        if self._log is not None:
            self._log.flush()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


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
