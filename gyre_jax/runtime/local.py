"""``LocalCell``: a cell this process runs, its ``ServingLoop`` and ``GradWorker`` behind the ``CellHandle``
protocol."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from gyre_jax.rl.micro_step import MicroStepWorker
from gyre_jax.runtime.base import CellHandleBase
from gyre_jax.runtime.cells import Cell, CellLayout
from gyre_jax.runtime.handle import CellStats
from gyre_jax.runtime.transfer import transfer
from gyre_jax.serving.loop import ServingLoop
from gyre_jax.serving.types import GenerationRequest, GenerationResult


class LocalCell(CellHandleBase):
    """A ``CellHandle`` over a started ``ServingLoop`` and a ``MicroStepWorker`` on the cell's own devices."""

    def __init__(self, cell: Cell, layout: CellLayout, loop: ServingLoop, worker: MicroStepWorker):
        self.cell = cell
        self.layout = layout
        self.loop = loop
        self.worker = worker

    @property
    def max_context(self) -> int:
        return self.loop.max_context

    @property
    def policy_version(self) -> int:
        return self.loop.policy_version

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        return self.loop.submit(request)

    def cancel(self, request_id: str) -> None:
        self.loop.cancel(request_id)

    def set_weights(self, params: Any, version: int) -> None:
        """A copy of ``params`` on this cell's serving layout (never aliasing: the optimizer donates its own)."""
        self.loop.update_params(transfer(params, self.layout.param_shardings, may_alias=False), version)

    def drop_sessions(self) -> int:
        states = self.loop.drain()
        for state in states:
            state.cancel()
        return len(states)

    def stats(self) -> CellStats:
        return CellStats(
            busy_s=self.loop.stats.busy_s, in_flight=self.loop.num_in_flight(), step_log=list(self.loop.step_log)
        )

    def close(self) -> None:
        self.loop.stop()
