"""The simulator's clock and event queue (one per run).

An event is ``(time, seq, kind, x, y)`` on a heap, popped in time order; ``seq`` breaks ties in push order,
so a run is deterministic. ``kind`` is one of the constants below; ``x`` is the execution, cell or step it
concerns and ``y`` a token (a segment event whose token is stale was cancelled) or 0.
"""

from __future__ import annotations

import heapq
import itertools

SEG, EVAL, BATCH, MICRO, OPT, SWITCH, PULL, BOUNDARY = range(8)
EPS = 1e-6  # work (FLOPs) and times below this are zero


class EventQueue:
    """``now`` (simulated seconds) and the events still to come (``heap``)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = itertools.count()

    def push(self, t: float, kind: int, x: int, y: int = 0) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, x, y))
