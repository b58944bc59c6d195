"""``LocalCell``: a cell this process runs, its ``ServingLoop`` and gradient worker behind the ``CellHandle``
protocol. The one implementation of a cell's serving, weights, stats and sessions: the leader's own cells are
``LocalCell``s, and a follower's ``runtime.host.CellHost`` runs each of its cells as one too.

With a LoRA adapter (``model.lora``) a cell holds its frozen base once, shared by its serving loop and its gradient
worker, and ``set_weights`` moves only the adapter: the loop serves base + adapter (applied, not merged)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import jax

from gyre_jax.model import lora
from gyre_jax.rl.micro_step import MicroStepWorker
from gyre_jax.runtime import sessions
from gyre_jax.runtime.base import CellHandleBase
from gyre_jax.runtime.cells import Cell, CellLayout
from gyre_jax.runtime.handle import CellHandle, CellStats, MovedSession
from gyre_jax.runtime.transfer import transfer
from gyre_jax.serving.loop import ServingLoop
from gyre_jax.serving.programs import Flattened
from gyre_jax.serving.session import SessionState
from gyre_jax.serving.types import GenerationRequest, GenerationResult

MakeLoop = Callable[[Any, int], ServingLoop]  # (params on the cell's serving layout, policy version) -> started loop


class LocalCell(CellHandleBase):
    """A ``CellHandle`` over a ``ServingLoop`` and a ``MicroStepWorker`` on the cell's own devices.

    ``loop``: the started loop, or None for a cell that has no weights yet (a follower's cell before the leader's
    first ``set_weights``): then ``make_loop(params, version)`` starts it when the first weights arrive
    (``serve``). Until then it holds no sessions and serves nothing."""

    def __init__(
        self,
        cell: Cell,
        layout: CellLayout,
        loop: ServingLoop | None,
        worker: MicroStepWorker | None,
        make_loop: MakeLoop | None = None,
    ):
        if loop is None and make_loop is None:
            raise ValueError(f"{cell.name}: give a started loop or make_loop to start one at the first weights")
        self.cell = cell
        self.layout = layout
        self.loop = loop
        self.worker = worker
        self.make_loop = make_loop
        self.lora = lora.enabled(layout.model_cfg)
        self.base: Any = None  # LoRA: the frozen base on this cell (its serving loop's and its worker's, one copy)
        self._split_shardings = lora.split(layout.param_shardings) if self.lora else None  # (adapter, base)
        self._adapter_def = jax.tree.structure(self._split_shardings[0]) if self.lora else None
        self._adapter_targets = jax.tree.leaves(self._split_shardings[0]) if self.lora else None

    def _serving(self) -> ServingLoop:
        if self.loop is None:
            raise RuntimeError(f"{self.name} has no weights yet: set_weights starts its serving loop")
        return self.loop

    @property
    def max_context(self) -> int:
        return self._serving().max_context

    @property
    def policy_version(self) -> int:
        return -1 if self.loop is None else self.loop.policy_version

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        return self._serving().submit(request)

    def cancel(self, request_id: str) -> None:
        if self.loop is not None:
            self.loop.cancel(request_id)

    def set_weights(self, params: Any, version: int) -> None:
        """A copy of ``params`` on this cell's serving layout (never aliasing: the optimizer donates its own). With a
        LoRA adapter ``params`` is the adapter (only it moves; the cell serves it over the base it holds) or a whole
        model state (its base becomes the cell's: once)."""
        self.serve(self.place(params), version)

    def place(self, params: Any) -> Any:
        """``params`` on this cell's serving layout: a copy (see ``set_weights``). With LoRA: the cell's base and a copy
        of the adapter, moved as one array and unpacked here by one program (``lora.put_leaves``), given to the serving
        programs as flat leaves (``Flattened``: no per-leaf move, no ``nnx.Variable`` rebuilt); a whole model state's
        base becomes the cell's. An adapter the trainer packed once for every receiver (``lora.publication``) is
        only moved and unpacked."""
        if not self.lora:
            return transfer(lora.source_of(params), self.layout.param_shardings, may_alias=False)
        if isinstance(params, lora.Packed) and params.layout.treedef == self._adapter_def and self.base is not None:
            moved = lora.unpack_onto(params, self._adapter_targets, transfer, may_alias=False)  # packed once, sent
            return Flattened(*lora.merged_leaves(*self._base_flat, moved, self._adapter_def))
        leaves, treedef = jax.tree.flatten(lora.source_of(params))
        if treedef != self._adapter_def:  # a whole model state: the frozen base, never donated, so arrays already
            adapter, base = lora.split(params)  # here are shared, not copied
            if base is not None and lora.num_leaves(base):
                self.base = transfer(base, self._split_shardings[1], may_alias=True)
                self._base_flat = jax.tree.flatten(self.base)
                if self.worker is not None and hasattr(self.worker, "set_base"):
                    self.worker.set_base(self.base)  # the same arrays: the cell holds its base once
            leaves, treedef = jax.tree.flatten(adapter)
        if self.base is None:
            raise RuntimeError(f"{self.name}: a LoRA adapter arrived before the cell had its base weights")
        moved = lora.put_leaves(leaves, self._adapter_targets, transfer, may_alias=False)  # one array moves
        return Flattened(*lora.merged_leaves(*self._base_flat, moved, treedef))

    def serve(self, params: Any, version: int) -> None:
        """Serves ``params`` (already on this cell's serving layout) as policy ``version``: the loop swaps them in
        at its next step, or starts with them (``make_loop``) if this cell had no weights yet."""
        if self.loop is None:
            self.loop = self.make_loop(params, version)
        else:
            self.loop.update_params(params, version)

    # -- sessions -------------------------------------------------------------------------------------------
    def drain(self) -> list[SessionState]:
        """Everything the loop holds (cached sessions, requests in flight and queued), KV included; the loop stays
        up, empty."""
        return [] if self.loop is None else self.loop.drain()

    def import_sessions(self, states: Sequence[SessionState]) -> None:
        self._serving().import_sessions(states)

    def move_sessions_to(self, target: CellHandle) -> list[MovedSession]:
        return target.sessions_from_local(self)

    def sessions_from_local(self, source: LocalCell) -> list[MovedSession]:
        return sessions.local_to_local(source, self)

    def sessions_from_remote(self, source) -> list[MovedSession]:
        return sessions.remote_to_local(source, self)

    def drop_sessions(self) -> int:
        states = self.drain()
        for state in states:
            state.cancel()
        return len(states)

    def stats(self) -> CellStats:
        if self.loop is None:
            return CellStats()
        return CellStats(
            busy_s=self.loop.stats.busy_s, in_flight=self.loop.num_in_flight(), step_log=list(self.loop.step_log)
        )

    def close(self) -> None:
        if self.loop is not None:
            self.loop.stop()
