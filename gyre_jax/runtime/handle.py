"""``CellHandle``: a cell as the scheduler sees it, whichever process runs it.

The seam between *what runs* (serving loops, gradient micro-steps, session moves: ``serving/``, ``rl/``)
and *where it runs* (this process or another). The elastic controller, the router and the trainer only
hold handles; ``LocalCell`` (``runtime.local``) runs the cell here and ``RemoteCell`` (``runtime.remote``)
drives a cell on a follower process. Both honour the whole protocol: nothing above this layer asks where a
cell lives.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any, Protocol

from gyre_jax.rl.micro_step import MicroStepWorker
from gyre_jax.runtime.cells import Cell, CellLayout
from gyre_jax.serving.types import GenerationRequest, GenerationResult


@dataclass(frozen=True)
class CellStats:
    """What a cell's serving loop reports: seconds it computed, requests it holds, and its step log (one
    ``(batch, context, prefilled tokens, seconds, wall-clock end)`` per loop iteration: the simulator's calibration
    input and the step profile's)."""

    busy_s: float = 0.0
    in_flight: int = 0
    step_log: list[tuple[int, int, int, float, float]] = field(default_factory=list)


@dataclass(frozen=True)
class MovedSession:
    """A session that moved to another cell with its KV: its id (None for a session-less request), whether a
    request was in flight (it continues on the target where it stopped; its caller's future resolves there)
    and how many tokens that request had generated before the move."""

    session_id: str | None
    in_flight: bool
    generated: int = 0


class CellHandle(Protocol):
    """A cell: serving (the router's ``GenerationBackend``), weights, sessions, training, stats.

    Serving: ``submit`` / ``cancel`` / ``max_context`` as a ``GenerationBackend``. ``set_weights(params,
    version)`` takes the core's params (on any mesh, any process) onto this cell's serving layout; the loop
    swaps them in at its next step. ``move_sessions_to(target)`` moves every session this cell holds (cached
    KV, requests in flight, queued requests) to ``target``, KV included; requests continue there token for
    token and their callers' futures resolve from there; cancels sent here follow them. ``drop_sessions``
    cancels what runs here (the router re-submits it elsewhere) and forgets cached sessions.

    Training: ``worker`` is this cell's ``MicroStepWorker`` for ``rl.micro_step.run_micro_steps``:
    ``worker.snapshot(params, slot)`` puts weights on this cell (returning what ``micro_step`` takes),
    ``worker.micro_step(weights, micro_batch, kind, ref_weights)`` returns gradients the core's accumulator
    can add. ``close`` stops the cell's serving loop.
    """

    cell: Cell
    layout: CellLayout
    worker: MicroStepWorker

    @property
    def name(self) -> str: ...

    @property
    def index(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    @property
    def policy_version(self) -> int: ...

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]: ...

    def cancel(self, request_id: str) -> None: ...

    def set_weights(self, params: Any, version: int) -> None: ...

    def move_sessions_to(self, target: CellHandle) -> list[MovedSession]: ...

    def drop_sessions(self) -> int: ...

    def stats(self) -> CellStats: ...

    def close(self) -> None: ...
