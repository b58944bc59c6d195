"""The driver's decision point: events in, the scheduling policy's decision out, each logged.

Workers, executions and switches post typed events (``events.py``) from their threads (``post``; a failure
as ``Failure``); the driver thread takes them one at a time (``next``), is the only caller of the policy
(``decide``, ``replan``), and logs every decision with its event and the cluster state it saw to
``decisions.jsonl``, so a policy can be replayed alone on the same sequence and must decide the same
(``state.state_from_dict``, ``events.event_from_dict``; ``tests/elastic/test_controller.py``). The
simulator decides through the same ``Driver`` (``replan``), so its decisions are logged the same way.

``decisions.jsonl``: one JSON object per decision,
``{"event": <Event.to_dict()>, "state": <state.state_dict()>, "roles": ["serving", ...], "dispatch": 3}``.
"""

from __future__ import annotations

import json
import queue as queue_lib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gyre_jax.elastic.events import Event, Started
from gyre_jax.elastic.policies import Decision, SchedulingPolicy
from gyre_jax.elastic.state import ClusterState, state_dict

MAX_ROUNDS = 16  # decisions on one event (the first, then ``started`` while executions are dispatched or started)


@dataclass(frozen=True)
class Failure:
    """A worker thread failed (a micro-step, a switch, a follower process): the driver stops the run."""

    message: str


class Driver:
    """Event queue + policy + decision log. ``tick_s``: ``next`` returns None after this long without an
    event (the caller's ``tick``, for time-based rules, e.g. ``idle_before_return_s``). ``on_decision(event, state,
    decision)``: told of every decision on the driver thread, before anything changes (the live view,
    ``live.LiveState.decision``)."""

    def __init__(
        self,
        policy: SchedulingPolicy,
        decisions_path: Path | None = None,
        tick_s: float = 1.0,
        on_decision: Callable[[Event, ClusterState, Decision], None] | None = None,
    ):
        self.policy = policy
        self.tick_s = tick_s
        self.on_decision = on_decision
        self._events: queue_lib.Queue[Event | Failure] = queue_lib.Queue()
        self._log = open(decisions_path, "a", encoding="utf-8") if decisions_path is not None else None

    def post(self, item: Event | Failure) -> None:
        """Thread-safe: an event (or a failure) for the driver thread."""
        self._events.put(item)

    def next(self) -> Event | Failure | None:
        """The next event or failure, or None after ``tick_s`` without one."""
        try:
            return self._events.get(timeout=self.tick_s)
        except queue_lib.Empty:
            return None

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
        if self._log is not None:
            self.record(event, state, decision)
        if self.on_decision is not None:
            self.on_decision(event, state, decision)
        return decision

    def replan(self, event: Event, observe: Callable[[], ClusterState], carry_out: Callable[[Decision], int]) -> None:
        """Decides on ``event`` in the state ``observe()`` gives (now, in the driver's clock) and carries the decision out
        (``carry_out`` returns how many executions it dispatched or started); while it did, decides again on a
        ``started`` event (so a policy sees the slots those executions took), at most ``MAX_ROUNDS`` times."""
        for _ in range(MAX_ROUNDS):
            state = observe()
            if not carry_out(self.decide(event, state)):
                return
            event = Started(state.version, state.time)

    def record(self, event: Event, state: ClusterState, decision: Decision) -> None:
        if self._log is None:
            return
        line = {
            "event": event.to_dict(),
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
