"""The run's live view: what the cells are doing now, published for readers that must never slow the run down (the
proxy's ``/live`` page, ``proxy/live.py``).

``LiveState`` is fed by the writers the run already has, from their own threads, each call a few appends under a
lock held for microseconds:

- ``timeline_event(event)``: every event the ``TimelineWriter`` writes (``elastic/timeline.py``'s Chrome-trace
  events: role spans, micro-steps, optimizer steps, executions, the waterlevel), passed as written;
- ``decision(event, state, decision)``: every scheduling decision with the ``ClusterState`` the policy saw
  (``elastic/state.py``; the driver's ``on_decision``), serialized as ``decisions.jsonl`` serializes it;
- ``step_done(step, metrics)``, ``phase(name, ...)``: the run's steps and phases (``run.Run``).

``snapshot()`` is the reader's side: a consistent copy made under the same short lock (lists of dicts that are never
changed once appended: a changed span is replaced, never mutated), so a slow reader costs the writers nothing but
that copy. Serialized form (``GET /live/state``, docs/commands.md):

    {"time": float, "t0": float, "phase": str, "step": int, "total_steps": int, "policy": str, "cells": [str],
     "state": <state.state_dict() of the last decision> | null, "event": str,
     "window_start": float,                      # the Gantt's left edge: the start of the previous step
     "roles": [[{"role": str, "start": float, "end": float | null, "to": str | null, "reason": str}]],  # per cell
     "micro_steps": [[{"start", "end", "step", "slot"}]], "optimizer_steps": [{"start", "end", "step", "cell"}],
     "executions": [{"id", "start", "end" | null, "status" | null, "step", "cell"}],  # in the window
     "step_counts": {"in_flight": int, "finished": int, "timeout": int, "crashed": int},  # executions of this step
     "waterlevel": [[t, dispatched, started, finished]],                 # the last WATERLEVEL_POINTS counters
     "steps": [{"step", "reward_mean", "pass_rate", "loss", "grad_norm", "step_s", "policy_version"}],
     "links": {"trace": str | null, "tensorboard": str | null, "tensorboard_dir": str | null}}

Times are seconds since ``t0`` (the run's wall clock at its start).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gyre_jax.elastic.state import ClusterState, state_dict

WATERLEVEL_POINTS = 600  # counter samples kept for the waterlevel's curve
MAX_EXECUTIONS = 2000  # execution spans kept in the window (the oldest ended ones go first)
STEPS_KEPT = 50  # the last steps' rewards and losses
STEP_KEYS = ("reward_mean", "pass_rate", "loss", "grad_norm", "step_s", "policy_version", "excluded", "timeouts")


class LiveState:
    """The published view (see the module docstring). ``trace_path``: the timeline file being written (served as
    the trace link); ``tensorboard_dir`` and ``tensorboard_url``: where the run's TensorBoard events are, and a
    running TensorBoard's address if there is one."""

    def __init__(
        self,
        cell_names: Sequence[str],
        *,
        total_steps: int = 0,
        policy: str = "",
        t0: float | None = None,
        trace_path: Path | None = None,
        tensorboard_dir: Path | None = None,
        tensorboard_url: str | None = None,
    ):
        self._lock = threading.Lock()
        self.cell_names = list(cell_names)
        self.t0 = time.time() if t0 is None else t0
        self.trace_path = trace_path
        self.total_steps = total_steps
        self.policy = policy
        self._links = {"trace": None, "tensorboard": tensorboard_url,
                       "tensorboard_dir": str(tensorboard_dir) if tensorboard_dir else None}  # fmt: skip
        self._phase = "starting"
        self._step = 0
        self._state: dict | None = None
        self._event = ""
        self._trace_t0 = self.t0  # the timeline file's own t0 (its ts are relative to it)
        self._window_start = 0.0
        self._step_start = 0.0
        self._roles: list[list[dict]] = [[] for _ in self.cell_names]
        self._micro: list[list[dict]] = [[] for _ in self.cell_names]
        self._optimizer: list[dict] = []
        self._executions: dict[str, dict] = {}
        self._counts = {"in_flight": 0, "finished": 0, "timeout": 0, "crashed": 0}
        self._waterlevel: deque[list[float]] = deque(maxlen=WATERLEVEL_POINTS)
        self._steps: deque[dict] = deque(maxlen=STEPS_KEPT)

    # -- writers (any thread; each a few appends under the lock) -----------------------------------------------
    def timeline_event(self, e: dict) -> None:
        """One event as ``TimelineWriter`` writes it (its ``ts``/``dur`` in microseconds since the trace's t0)."""
        ph = e.get("ph")
        if ph == "M":
            if e.get("name") == "gyre_timeline":
                with self._lock:
                    self._trace_t0 = float(e["args"].get("t0", self.t0))
            return
        t = self._trace_t0 - self.t0 + e.get("ts", 0.0) / 1e6
        with self._lock:
            if ph == "B" and e.get("cat") == "role":
                spans = self._roles[e["tid"]]
                if spans and spans[-1]["end"] is None:
                    spans[-1] = {**spans[-1], "end": t}
                args = e.get("args", {})
                spans.append({"role": e["name"], "start": t, "end": None, "to": args.get("to"),
                              "reason": args.get("reason", "")})  # fmt: skip
            elif ph == "E" and e.get("pid") == 1:
                spans = self._roles[e["tid"]]
                if spans and spans[-1]["end"] is None:
                    spans[-1] = {**spans[-1], "end": t}
            elif ph == "X" and e.get("name") == "micro_step":
                args = e.get("args", {})
                self._micro[e["tid"]].append({"start": t, "end": t + e["dur"] / 1e6, "step": args.get("step"),
                                              "slot": args.get("slot")})  # fmt: skip
            elif ph == "X" and e.get("name") == "optimizer_step":
                args = e.get("args", {})
                end = t + e["dur"] / 1e6
                self._optimizer.append({"start": t, "end": end, "step": args.get("step"), "cell": e.get("tid")})
                self._new_window(end)
            elif ph == "b":
                args = e.get("args", {})
                self._executions[e["id"]] = {"id": e["id"], "start": t, "end": None, "status": None,
                                             "step": args.get("step"), "cell": args.get("cell")}  # fmt: skip
                self._counts = {**self._counts, "in_flight": self._counts["in_flight"] + 1}
                self._trim_executions()
            elif ph == "e" and e["id"] in self._executions:
                status = e.get("args", {}).get("status", "finished")
                self._executions[e["id"]] = {**self._executions[e["id"]], "end": t, "status": status}
                counts = dict(self._counts)
                counts["in_flight"] = max(0, counts["in_flight"] - 1)
                counts[status if status in counts else "finished"] += 1
                self._counts = counts
            elif ph == "C" and e.get("name") == "waterlevel":
                a = e.get("args", {})
                self._waterlevel.append([t, a.get("dispatched", 0), a.get("started", 0), a.get("finished", 0)])

    def decision(self, event: Any, state: ClusterState, decision: Any = None) -> None:
        """A scheduling decision's event and the state the policy saw (the driver's thread)."""
        serialized = state_dict(state)  # a deep copy: the driver's lists change after this returns
        with self._lock:
            self._state = serialized
            self._event = getattr(event, "kind", type(event).__name__)

    def step_done(self, step: int, metrics: dict[str, Any]) -> None:
        """Step ``step`` (0-based) trained with ``metrics`` (its metrics line)."""
        row = {"step": step + 1, **{k: metrics.get(k) for k in STEP_KEYS}}
        with self._lock:
            self._steps.append(row)
            self._step = step + 1

    def phase(self, name: str, step: int | None = None) -> None:
        """What the run does now: "warm start", "rl", "evaluation after 40 RL steps", "done" ..."""
        with self._lock:
            self._phase = name
            if step is not None:
                self._step = step

    def _new_window(self, now: float) -> None:
        """A step ended at ``now``: the window starts at the step that just ended; older spans are dropped (lock
        held)."""
        self._window_start, self._step_start = self._step_start, now
        keep = self._window_start

        def recent(spans: list[dict]) -> list[dict]:
            return [s for s in spans if s["end"] is None or s["end"] >= keep]

        self._roles = [recent(spans) for spans in self._roles]
        self._micro = [recent(spans) for spans in self._micro]
        self._optimizer = recent(self._optimizer)
        self._executions = {k: v for k, v in self._executions.items() if v["end"] is None or v["end"] >= keep}
        self._counts = {"in_flight": self._counts["in_flight"], "finished": 0, "timeout": 0, "crashed": 0}

    def _trim_executions(self) -> None:
        if len(self._executions) > MAX_EXECUTIONS:
            ended = sorted((v["end"], k) for k, v in self._executions.items() if v["end"] is not None)
            for _, k in ended[: len(self._executions) - MAX_EXECUTIONS]:
                del self._executions[k]

    # -- the reader ----------------------------------------------------------------------------------------
    def latest_state(self) -> dict | None:
        """The last decision's ``ClusterState`` as a dict (never changed once published; no copy)."""
        with self._lock:
            return self._state

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of the view (see the module docstring), made under the lock."""
        with self._lock:
            view = {
                "time": time.time() - self.t0,
                "t0": self.t0,
                "phase": self._phase,
                "step": self._step,
                "total_steps": self.total_steps,
                "policy": self.policy,
                "cells": list(self.cell_names),
                "state": self._state,
                "event": self._event,
                "window_start": self._window_start,
                "roles": [list(spans) for spans in self._roles],
                "micro_steps": [list(spans) for spans in self._micro],
                "optimizer_steps": list(self._optimizer),
                "executions": list(self._executions.values()),
                "step_counts": dict(self._counts),
                "waterlevel": list(self._waterlevel),
                "steps": list(self._steps),
                "links": dict(self._links),
            }
        view["links"]["trace"] = str(self.trace_path) if self.trace_path is not None else None
        return view
