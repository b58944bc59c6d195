"""The execution queue: the durable, append-only list of finished executions waiting to be trained on.

Serialized form: ``<dir>/queue.jsonl``, one JSON object per line, appended, flushed and fsynced
(see docs/trajectory.md):

    {"index": int, "execution_id": str, "step": int, "advantage": float, "weight": float,
     "last_in_step": bool}

``index`` counts entries from 0 without gaps. ``weight`` is the execution's share of its optimizer
step's loss (``1 / N`` for the N executions of the step). ``last_in_step`` marks the step's final
entry: the pipeline finishes that step's micro-batches there. A reader addresses entries by byte
offset, so resuming from a saved offset reads nothing twice and holds nothing in memory.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from gyre_jax.disk import append_whole, cut
from gyre_jax.faultpoints import armed, kill_point


@dataclass(frozen=True)
class QueuedExecution:
    index: int
    execution_id: str
    step: int
    advantage: float
    weight: float
    last_in_step: bool

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> QueuedExecution:
        return cls(**json.loads(line))


class ExecutionQueue:
    """``queue.jsonl`` in ``directory``: ``append_step`` writes, ``read_at`` reads one entry by byte offset."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "queue.jsonl"
        self.path.touch(exist_ok=True)
        self._end: tuple[int, int] | None = None

    def end(self) -> tuple[int, int]:
        """(byte offset, index) just past the last complete entry."""
        if self._end is None:
            offset = index = 0
            with open(self.path, "rb") as f:
                for line in f:
                    if not line.endswith(b"\n"):
                        break
                    offset, index = offset + len(line), index + 1
            self._end = (offset, index)
        return self._end

    def append_step(
        self,
        step: int,
        executions: list[tuple[str, float]],
        normalizer: int | None = None,
        *,
        last: bool = True,
        untrained: frozenset[str] | set[str] = frozenset(),
    ) -> list[QueuedExecution]:
        """Appends one optimizer step's executions ``(execution_id, advantage)``; each gets weight ``1 / normalizer``
        (default: the number of executions given). Written and fsynced before returning.

        A step may be appended in parts (a streaming trainer appends each task group as it completes):
        ``last=False`` leaves the step open; the part with ``last=True`` ends it. Executions in ``untrained``
        (their group was skipped, or they are over the staleness bound) get weight 0: they are queued so the
        step's record is complete, and the pipeline reports them as left out without reading their records."""
        if not executions:
            raise ValueError(f"step {step}: nothing to enqueue (a step needs at least one execution)")
        n = len(executions) if normalizer is None else int(normalizer)
        if n < len(executions):
            raise ValueError(f"step {step}: normalizer={n} must be >= the {len(executions)} executions of the step")
        seen = set()
        for eid, adv in executions:
            if not isinstance(eid, str) or not eid or "/" in eid or eid.startswith("."):
                raise ValueError(f"step {step}: invalid execution id {eid!r}")
            if eid in seen:
                raise ValueError(f"step {step}: execution {eid!r} is listed twice")
            seen.add(eid)
            if not math.isfinite(float(adv)):
                raise ValueError(f"step {step}: execution {eid!r} has a non-finite advantage {adv!r}")
        end_offset, first = self.end()
        entries = [
            QueuedExecution(
                index=first + i,
                execution_id=eid,
                step=int(step),
                advantage=float(adv),
                weight=0.0 if eid in untrained else 1.0 / n,
                last_in_step=last and i == len(executions) - 1,
            )
            for i, (eid, adv) in enumerate(executions)
        ]
        data = "".join(e.to_json() + "\n" for e in entries).encode("utf-8")
        torn = (lambda: kill_point("queue_torn")) if armed("queue_torn") else None  # the fault suite: a kill mid-append
        append_whole(self.path, data, at=end_offset, torn=torn)  # a torn tail after end_offset is cut first
        self._end = (end_offset + len(data), first + len(entries))
        return entries

    def read_at(self, offset: int) -> tuple[QueuedExecution, int] | None:
        """The entry starting at byte ``offset`` and the offset after it; None if none is complete yet."""
        with open(self.path, "rb") as f:
            f.seek(offset)
            line = f.readline()
        if not line.endswith(b"\n"):
            return None  # end of the queue, or an entry still being written
        try:
            return QueuedExecution.from_json(line.decode("utf-8")), offset + len(line)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"{self.path} at byte {offset}: corrupt queue entry ({e}); the queue is written only by "
                f"ExecutionQueue.append_step, so this file was damaged"
            ) from None

    def truncate(self, offset: int, index: int) -> int:
        """Drops every entry from byte ``offset`` (entry ``index``) on; returns how many were dropped."""
        end_offset, end_index = self.end()
        if offset > end_offset or index > end_index:
            raise ValueError(
                f"{self.path}: cannot cut the queue at entry {index} (byte {offset}): it holds {end_index} "
                f"entries ({end_offset} bytes). The saved pipeline state does not belong to this queue."
            )
        cut(self.path, offset)
        self._end = (offset, index)
        return end_index - index
