"""The run timeline: role changes, micro-steps, optimizer steps, executions and the waterlevel, written as
a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing). The simulator and the real
controller write it with the same ``TimelineWriter``; ``load_timeline`` reads it back for plots and
comparisons.

Serialized form: the Chrome "JSON Array Format", one event per line, appended as the run goes:

    [
    {"ph": "M", "name": "gyre_timeline", "pid": 0, "tid": 0, "args": {"version": 1, "source": "sim", "t0": 0.0, "cells": ["cell0", ...]}},
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "cells"}},
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 0, "args": {"name": "cell0"}},
    {"ph": "B", "name": "serving", "cat": "role", "pid": 1, "tid": 0, "ts": 0.0, "args": {"reason": "start"}},
    {"ph": "E", "pid": 1, "tid": 0, "ts": 812000000.0},
    {"ph": "X", "name": "micro_step", "cat": "train", "pid": 1, "tid": 3, "ts": ..., "dur": ..., "args": {"step": 4, "work": 1.2e15}},
    {"ph": "X", "name": "optimizer_step", "cat": "train", "pid": 1, "tid": 0, "ts": ..., "dur": ..., "args": {"step": 4, "version": 5}},
    {"ph": "X", "name": "weight_publish", "cat": "train", "pid": 1, "tid": 0, "ts": ..., "dur": ..., "args": {"step": 4, "version": 5}},
    {"ph": "b", "name": "execution", "cat": "execution", "id": "s4-t12-g03", "pid": 2, "tid": 0, "ts": ..., "args": {"step": 4, "cell": 7}},
    {"ph": "e", "name": "execution", "cat": "execution", "id": "s4-t12-g03", "pid": 2, "tid": 0, "ts": ..., "args": {"status": "timeout"}},
    {"ph": "C", "name": "waterlevel", "pid": 1, "ts": ..., "args": {"dispatched": 96, "started": 90, "finished": 40, "outstanding": 56}},
    ...
    {"ph": "M", "name": "gyre_timeline_end", "pid": 0, "tid": 0, "args": {"t_end": 9000.0}}
    ]

- Times: ``ts``/``dur`` in microseconds since ``t0`` (``args.t0`` of the first event, in the writer's
  clock: wall-clock seconds for a real run, 0 for the simulator).
- Process 1 ("cells") has one thread per cell: its role as B/E spans named ``serving``, ``training`` or
  ``switching`` (``args.to``: the role it is switching to; ``args.reason``: the event that caused it),
  micro-steps and optimizer steps (X) inside the training spans, and (real runs) each step's weight publish
  (X, on the core's thread): from the optimizer step's end until the serving cells hold the new weights.
- Process 2 ("executions") holds one async span (b/e, ``id`` = execution id) per execution, from the
  moment its session got a slot to the end of its harness; ``args.status``: finished | timeout | crashed.
- Counter ``waterlevel`` (C): d, p, f and w = d - f.
- A file cut short by a crash (no closing ``]``, a torn last line) still loads, and Perfetto opens it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
_CELLS_PID, _EXEC_PID = 1, 2
ROLE_NAMES = ("serving", "training", "switching")


def _role_name(role: Any) -> str:
    name = getattr(role, "value", role)
    if name not in ROLE_NAMES:
        raise ValueError(f"unknown role {role!r} (expected one of {', '.join(ROLE_NAMES)})")
    return name


class TimelineWriter:
    """Appends timeline events to ``path`` (or keeps them in memory when ``path`` is None).

    ``t0`` is the clock value that maps to ts = 0; every method takes times in the same clock (seconds).
    ``flush_every`` events are buffered between writes (1 for a real run that must survive a crash).
    ``listener(event)``: told of every event as written (the live view, ``live.LiveState.timeline_event``).
    Not thread-safe: the controller calls it from one thread.
    """

    def __init__(
        self,
        path: str | os.PathLike | None,
        cell_names: Sequence[str],
        *,
        source: str,
        t0: float = 0.0,
        flush_every: int = 1,
        keep_in_memory: bool = False,
        listener: Callable[[dict], None] | None = None,
    ):
        if not cell_names:
            raise ValueError("a timeline needs at least one cell name")
        if flush_every < 1:
            raise ValueError(f"flush_every={flush_every} must be >= 1")
        self.path = Path(path) if path is not None else None
        self.cell_names = list(cell_names)
        self.t0 = float(t0)
        self.flush_every = flush_every
        self.listener = listener
        self.events: list[dict] | None = [] if (keep_in_memory or self.path is None) else None
        self._buffer: list[str] = []
        self._open_role: list[str | None] = [None] * len(self.cell_names)
        self._closed = False
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", encoding="utf-8")
            self._file.write("[\n")
        self._emit(
            {
                "ph": "M",
                "name": "gyre_timeline",
                "pid": 0,
                "tid": 0,
                "args": {"version": FORMAT_VERSION, "source": source, "t0": self.t0, "cells": self.cell_names},
            }
        )
        self._emit({"ph": "M", "name": "process_name", "pid": _CELLS_PID, "args": {"name": "cells"}})
        self._emit({"ph": "M", "name": "process_name", "pid": _EXEC_PID, "args": {"name": "executions"}})
        for i, name in enumerate(self.cell_names):
            self._emit({"ph": "M", "name": "thread_name", "pid": _CELLS_PID, "tid": i, "args": {"name": name}})

    # -- writing ----------------------------------------------------------------------------------
    def _ts(self, time: float) -> float:
        return round((time - self.t0) * 1e6, 3)

    def _emit(self, event: dict) -> None:
        if self._closed:
            raise RuntimeError("the timeline is closed")
        if self.events is not None:
            self.events.append(event)
        if self.listener is not None:
            self.listener(event)
        if self._file is not None:
            self._buffer.append(json.dumps(event, separators=(",", ":")) + ",\n")
            if len(self._buffer) >= self.flush_every:
                self.flush()

    def flush(self) -> None:
        if self._file is not None and self._buffer:
            self._file.write("".join(self._buffer))
            self._buffer.clear()
            self._file.flush()

    def _check_cell(self, cell: int) -> None:
        if not 0 <= cell < len(self.cell_names):
            raise ValueError(f"cell {cell} out of range (the timeline has {len(self.cell_names)} cells)")

    def role(self, time: float, cell: int, role: Any, reason: str = "", to: Any = None) -> None:
        """Cell ``cell`` has role ``role`` from ``time`` on (its previous role span ends there)."""
        self._check_cell(cell)
        name = _role_name(role)
        if self._open_role[cell] is not None:
            self._emit({"ph": "E", "pid": _CELLS_PID, "tid": cell, "ts": self._ts(time)})
        args: dict[str, Any] = {"reason": reason}
        if to is not None:
            args["to"] = _role_name(to)
        self._emit(
            {"ph": "B", "name": name, "cat": "role", "pid": _CELLS_PID, "tid": cell, "ts": self._ts(time), "args": args}
        )
        self._open_role[cell] = name

    def micro_step(self, t_start: float, t_end: float, cell: int, step: int, **args: Any) -> None:
        self._check_cell(cell)
        self._emit(
            {
                "ph": "X",
                "name": "micro_step",
                "cat": "train",
                "pid": _CELLS_PID,
                "tid": cell,
                "ts": self._ts(t_start),
                "dur": round((t_end - t_start) * 1e6, 3),
                "args": {"step": step, **args},
            }
        )

    def optimizer_step(self, t_start: float, t_end: float, cell: int, step: int, version: int) -> None:
        self._check_cell(cell)
        self._emit(
            {
                "ph": "X",
                "name": "optimizer_step",
                "cat": "train",
                "pid": _CELLS_PID,
                "tid": cell,
                "ts": self._ts(t_start),
                "dur": round((t_end - t_start) * 1e6, 3),
                "args": {"step": step, "version": version},
            }
        )

    def weight_publish(self, t_start: float, t_end: float, step: int, version: int) -> None:
        """The new weights going from the core to the serving cells after step ``step``'s optimizer step."""
        self._emit(
            {
                "ph": "X",
                "name": "weight_publish",
                "cat": "train",
                "pid": _CELLS_PID,
                "tid": 0,
                "ts": self._ts(t_start),
                "dur": round((t_end - t_start) * 1e6, 3),
                "args": {"step": step, "version": version},
            }
        )

    def execution_started(self, time: float, execution_id: str, **args: Any) -> None:
        self._emit(
            {
                "ph": "b",
                "name": "execution",
                "cat": "execution",
                "id": execution_id,
                "pid": _EXEC_PID,
                "tid": 0,
                "ts": self._ts(time),
                "args": args,
            }
        )

    def execution_ended(self, time: float, execution_id: str, status: str, **args: Any) -> None:
        self._emit(
            {
                "ph": "e",
                "name": "execution",
                "cat": "execution",
                "id": execution_id,
                "pid": _EXEC_PID,
                "tid": 0,
                "ts": self._ts(time),
                "args": {"status": status, **args},
            }
        )

    def waterlevel(self, time: float, dispatched: int, started: int, finished: int) -> None:
        self._emit(
            {
                "ph": "C",
                "name": "waterlevel",
                "pid": _CELLS_PID,
                "ts": self._ts(time),
                "args": {
                    "dispatched": dispatched,
                    "started": started,
                    "finished": finished,
                    "outstanding": dispatched - finished,
                },
            }
        )

    def instant(self, time: float, name: str, **args: Any) -> None:
        self._emit({"ph": "i", "name": name, "s": "g", "pid": _CELLS_PID, "tid": 0, "ts": self._ts(time), "args": args})

    def close(self, time: float) -> None:
        """Ends every open role span at ``time`` and closes the file (the JSON array is complete)."""
        if self._closed:
            return
        for cell, name in enumerate(self._open_role):
            if name is not None:
                self._emit({"ph": "E", "pid": _CELLS_PID, "tid": cell, "ts": self._ts(time)})
                self._open_role[cell] = None
        end = {"ph": "M", "name": "gyre_timeline_end", "pid": 0, "tid": 0, "args": {"t_end": self._ts(time) / 1e6}}
        if self.events is not None:
            self.events.append(end)
        if self._file is not None:
            self.flush()
            self._file.write(json.dumps(end, separators=(",", ":")) + "\n]\n")
            self._file.close()
            self._file = None
        self._closed = True

    def __enter__(self) -> TimelineWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._closed and self._file is not None:
            self.flush()
            self._file.close()
            self._file = None


# -- reading --------------------------------------------------------------------------------------
@dataclass
class Span:
    start: float  # seconds since t0
    end: float
    name: str
    args: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """A timeline read back: per-cell role spans, micro-steps and optimizer steps, executions, counters."""

    source: str
    t0: float
    cells: list[str]
    roles: list[list[Span]]  # per cell, in time order
    micro_steps: list[list[Span]]  # per cell
    optimizer_steps: list[Span]
    executions: dict[str, Span]  # execution id -> span (end = inf while it never ended)
    waterlevel: list[tuple[float, dict]]
    t_end: float
    publishes: list[Span] = field(default_factory=list)  # weight publishes after optimizer steps (real runs)

    def role_time(self, cell: int, role: str) -> float:
        return sum(s.duration for s in self.roles[cell] if s.name == role)

    def busy_fraction(self) -> dict[str, float]:
        """Fractions of cell-time (t = 0 .. t_end, all cells) spent per role and computing micro-steps."""
        total = self.t_end * len(self.cells)
        if total <= 0:
            return {}
        out = {role: sum(self.role_time(c, role) for c in range(len(self.cells))) / total for role in ROLE_NAMES}
        out["micro_step"] = sum(s.duration for cell in self.micro_steps for s in cell) / total
        return out


def parse_events(text: str) -> list[dict]:
    """Events of a JSON-array trace, tolerating a missing ``]``, a trailing comma and a torn last line."""
    stripped = text.strip()
    try:
        data = json.loads(stripped)
        return data["traceEvents"] if isinstance(data, dict) else data
    except json.JSONDecodeError:
        pass
    events = []
    for line in stripped.splitlines():
        line = line.strip().rstrip(",")
        if line in ("", "[", "]"):
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn last line: everything before it is intact
    return events


def _read_events(source: str | os.PathLike | list[dict]) -> tuple[list[dict], str]:
    """(events, where they came from, for messages)."""
    if isinstance(source, list):
        return source, "in-memory events"
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"timeline {path} not found (a run writes it as timeline.json in its workdir)")
    return parse_events(path.read_text(encoding="utf-8")), str(path)


def _add_event(tl: Timeline, open_role: list[Span | None], e: dict) -> None:
    """Records one trace event in ``tl`` (``open_role[c]``: cell c's role span still open)."""
    ph = e.get("ph")
    ts = e.get("ts", 0.0) / 1e6
    tl.t_end = max(tl.t_end, ts + e.get("dur", 0.0) / 1e6)
    if ph == "M":
        if e.get("name") == "gyre_timeline_end":
            tl.t_end = max(tl.t_end, float(e["args"]["t_end"]))
        return
    if ph in ("B", "E") and e.get("pid") == _CELLS_PID:
        cell = e["tid"]
        if open_role[cell] is not None:
            open_role[cell].end = ts
            tl.roles[cell].append(open_role[cell])
            open_role[cell] = None
        if ph == "B":
            open_role[cell] = Span(ts, ts, e["name"], dict(e.get("args", {})))
    elif ph == "X" and e.get("name") == "micro_step":
        tl.micro_steps[e["tid"]].append(Span(ts, ts + e["dur"] / 1e6, "micro_step", dict(e.get("args", {}))))
    elif ph == "X" and e.get("name") == "optimizer_step":
        tl.optimizer_steps.append(
            Span(ts, ts + e["dur"] / 1e6, "optimizer_step", {**e.get("args", {}), "cell": e["tid"]})
        )
    elif ph == "X" and e.get("name") == "weight_publish":
        tl.publishes.append(Span(ts, ts + e["dur"] / 1e6, "weight_publish", dict(e.get("args", {}))))
    elif ph == "b":
        tl.executions[e["id"]] = Span(ts, float("inf"), "execution", dict(e.get("args", {})))
    elif ph == "e" and e["id"] in tl.executions:
        span = tl.executions[e["id"]]
        span.end = ts
        span.args.update(e.get("args", {}))
    elif ph == "C" and e.get("name") == "waterlevel":
        tl.waterlevel.append((ts, dict(e["args"])))


def load_timeline(source: str | os.PathLike | list[dict]) -> Timeline:
    """Reads a timeline file written by ``TimelineWriter`` (or its in-memory event list)."""
    events, where = _read_events(source)
    header = next((e for e in events if e.get("ph") == "M" and e.get("name") == "gyre_timeline"), None)
    if header is None:
        raise ValueError(f"{where} is not a gyre timeline (no 'gyre_timeline' metadata event)")
    meta = header["args"]
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{where}: timeline format version {meta.get('version')} (this reader knows {FORMAT_VERSION})")
    cells = list(meta["cells"])
    tl = Timeline(
        source=meta.get("source", ""),
        t0=float(meta.get("t0", 0.0)),
        cells=cells,
        roles=[[] for _ in cells],
        micro_steps=[[] for _ in cells],
        optimizer_steps=[],
        executions={},
        waterlevel=[],
        t_end=0.0,
    )
    open_role: list[Span | None] = [None] * len(cells)
    for e in events:
        _add_event(tl, open_role, e)
    for cell, span in enumerate(open_role):
        if span is not None:  # a run cut short: the span lasts to the last thing recorded
            span.end = tl.t_end
            tl.roles[cell].append(span)
    for span in tl.optimizer_steps:
        span.args.setdefault("cell", 0)
    return tl
