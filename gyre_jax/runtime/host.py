"""The follower's side: ``CellHost`` runs this process's cells as the leader's commands say.

Each cell is a ``runtime.local.LocalCell`` (the same serving, weights, stats and session code as the leader's own
cells), wrapped in a ``HostedCell`` with what the follower keeps between commands. One thread reads the commands in the order the leader sent them and handles each through one dispatch
table (``CellHost.handlers``); it alone runs this process's side of every ``transfer`` program, checking
each one's sequence number in the run's transfer log first. Gradient micro-steps run in one worker thread
per cell, so a long micro-step does not hold up the cell's serving commands. Replies and failures go back
on the reply channel.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pickle
import queue as queue_lib
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from gyre_jax.runtime import commands as cmd
from gyre_jax.runtime.cells import CellLayout
from gyre_jax.runtime.channel import Channel
from gyre_jax.runtime.local import LocalCell
from gyre_jax.runtime.sessions import host_part, local_to_local
from gyre_jax.runtime.transfer import abstract_on, describe, transfer
from gyre_jax.runtime.watchdog import DistributedError
from gyre_jax.serving.session import SessionState

log = logging.getLogger("gyre_jax.host")


@dataclass
class HostedCell:
    """One of this process's cells: the ``LocalCell`` that runs it (its loop starts at the leader's first
    ``SetWeights``) and what the follower keeps for the leader's later commands."""

    local: LocalCell
    weights: dict[str, tuple[int, Any]] = field(default_factory=dict)  # slot -> (serial, params on this cell)
    grads: dict[int, Any] = field(default_factory=dict)  # MicroStep token -> gradients waiting for SendGrads
    outbox: dict[int, Any] = field(default_factory=dict)  # exported session index -> its KV, until SendKV
    work: queue_lib.Queue = field(default_factory=queue_lib.Queue)

    @property
    def name(self) -> str:
        return self.local.name

    def weights_for(self, ref: cmd.WeightsRef | None) -> Any:
        if ref is None:
            return None
        serial, tree = self.weights.get(ref.slot, (None, None))
        if serial != ref.serial:
            raise DistributedError(
                f"{self.name}: a micro-step asked for weights {ref.slot}#{ref.serial} but holds "
                f"{ref.slot}#{serial}: the leader must load them first (commands out of order)"
            )
        return tree


class CellHost:
    """Serves this follower process's cells until the leader sends ``Stop``.

    ``cells``: this process's cells by index; ``layouts``: every cell's layout (KV destinations and sources
    on other processes); ``core_abstract``: the core's params as ``ShapeDtypeStruct``s on its layout (the
    source of weights this process receives)."""

    def __init__(
        self,
        client: Any,
        process_id: int,
        cells: dict[int, HostedCell],
        layouts: dict[int, CellLayout],
        core_abstract: Any,
    ):
        self.process_id = process_id
        self.cells = cells
        self.layouts = layouts
        self.core_abstract = core_abstract
        self.core_shardings = jax.tree.map(lambda a: a.sharding, core_abstract)
        self.commands = Channel(client, f"to{process_id}")
        self.replies = Channel(client, f"from{process_id}")
        self._reply_tokens: dict[str, int] = {}  # request id -> the leader's token for its result
        self._transfers = 0  # transfer programs run so far (checked against each command's sequence number)
        self._stopped = threading.Event()
        self._stop_requested = False
        self.handlers: dict[type, Callable[[Any], None]] = {
            cmd.Submit: self._submit,
            cmd.Cancel: self._cancel,
            cmd.SetWeights: self._set_weights,
            cmd.LoadWeights: self._load_weights,
            cmd.MicroStep: self._micro_step,
            cmd.SendGrads: self._send_grads,
            cmd.ExportSessions: self._export_sessions,
            cmd.SendKV: self._send_kv,
            cmd.ImportSession: self._import_session,
            cmd.MoveSessions: self._move_sessions,
            cmd.DropSessions: self._drop_sessions,
            cmd.Stats: self._stats,
            cmd.CloseCell: self._close_cell,
            cmd.Stop: self._stop,
        }

    # -- the command loop ---------------------------------------------------------------------------------
    def serve(self) -> None:
        """Reads and handles commands until ``Stop`` (this thread runs every transfer program, in order)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):  # e.g. Slurm's preemption: process 0 stops and saves
                signal.signal(sig, self._signalled)
        workers = [
            threading.Thread(target=self._compute, args=(c,), name=f"host-{c.name}", daemon=True)
            for c in self.cells.values()
        ]
        for th in workers:
            th.start()
        try:
            while not self._stopped.is_set():
                try:
                    command = self.commands.recv()
                except TimeoutError:
                    continue
                except Exception as exc:  # noqa: BLE001 - the control-plane store (process 0) is gone
                    raise DistributedError(
                        f"lost process 0's commands ({type(exc).__name__}: {str(exc)[:200]}); process 0 died or is "
                        f"unreachable: restart all processes to resume from the last checkpoint"
                    ) from None
                self.handle(command)
        finally:
            for c in self.cells.values():
                c.work.put(None)
                c.local.close()

    def handle(self, command: Any) -> None:
        """Runs one command; a failure is reported to the leader (which stops the run) and raised."""
        handler = self.handlers.get(type(command))
        try:
            if handler is None:
                raise DistributedError(f"unknown command {type(command).__name__}")
            handler(command)
        except Exception as exc:
            log.exception("process %d: %s failed", self.process_id, type(command).__name__)
            self._send(cmd.Failure(None, f"{type(command).__name__} failed: {exc!r}"))
            raise

    def _send(self, message: Any) -> None:
        try:
            self.replies.send(message)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # e.g. an exception that cannot pickle
            token = getattr(message, "token", None)
            self.replies.send(cmd.Failure(token, f"{message!r} could not be sent: {exc}"))

    def _reply(self, token: int, value: Any) -> None:
        self._send(cmd.Reply(token, value))

    def _program(self, seq: int | None, what: str) -> None:
        """Checks that the transfer program about to run is the next one in this process's log."""
        if seq != self._transfers:
            raise DistributedError(
                f"process {self.process_id}: {what} is transfer #{seq} but #{self._transfers} is due: the "
                f"cross-process programs are out of order (a leader bug); stopping before they deadlock"
            )
        self._transfers += 1

    def _signalled(self, signum, _frame) -> None:
        if self._stop_requested:
            log.error("second stop request: exiting now (process 0 then stops the run)")
            os._exit(130)
        self._stop_requested = True
        log.warning("signal %d: asking process 0 to stop the run and save a checkpoint (send again to force)", signum)
        self._send(cmd.StopRequest(f"signal {signum}"))

    # -- serving ------------------------------------------------------------------------------------------
    def _submit(self, c: cmd.Submit) -> None:
        rid = c.request.request_id
        self._reply_tokens[rid] = c.token
        try:
            fut = self.cells[c.cell].local.submit(c.request)
        except Exception as exc:  # noqa: BLE001 - e.g. a prompt that cannot fit: the caller's future raises
            self._reply_tokens.pop(rid, None)
            self._send(cmd.Failure(c.token, exc))
            return
        fut.add_done_callback(lambda f: self._answer(rid, f))

    def _answer(self, request_id: str, fut: concurrent.futures.Future) -> None:
        token = self._reply_tokens.pop(request_id, None)
        if token is None:  # the request moved to another process, which answers for it
            return
        exc = fut.exception()
        self._send(cmd.Failure(token, exc) if exc is not None else cmd.Reply(token, fut.result()))

    def _cancel(self, c: cmd.Cancel) -> None:
        self.cells[c.cell].local.cancel(c.request_id)

    def _set_weights(self, c: cmd.SetWeights) -> None:
        local = self.cells[c.cell].local
        self._program(c.transfer, "SetWeights")
        local.serve(transfer(self.core_abstract, local.layout.param_shardings, uuid=c.uuid), c.version)

    def _stats(self, c: cmd.Stats) -> None:
        self._reply(c.token, self.cells[c.cell].local.stats())

    def _close_cell(self, c: cmd.CloseCell) -> None:
        self.cells[c.cell].local.close()
        self._reply(c.token, True)

    def _stop(self, c: cmd.Stop) -> None:
        self._stopped.set()
        self._reply(c.token, True)

    # -- training -----------------------------------------------------------------------------------------
    def _load_weights(self, c: cmd.LoadWeights) -> None:
        cell = self.cells[c.cell]
        self._program(c.transfer, "LoadWeights")
        cell.weights[c.ref.slot] = (
            c.ref.serial,
            transfer(self.core_abstract, cell.local.worker.param_shardings, uuid=c.uuid),
        )

    def _micro_step(self, c: cmd.MicroStep) -> None:
        cell = self.cells[c.cell]
        cell.work.put((c, cell.weights_for(c.weights), cell.weights_for(c.ref_weights)))

    def _compute(self, cell: HostedCell) -> None:
        while (item := cell.work.get()) is not None:
            c, params, ref = item
            try:
                grads, aux = cell.local.worker.micro_step(params, c.batch, c.kind, ref)
                aux = {k: float(np.asarray(v)) for k, v in jax.device_get(aux).items()}
                cell.grads[c.token] = grads
                self._reply(c.token, (aux, describe(grads)))
            except Exception as exc:  # noqa: BLE001 - the leader's micro-step fails and its claim goes back
                log.exception("process %d: micro-step on %s failed", self.process_id, cell.name)
                self._send(cmd.Failure(c.token, RuntimeError(f"{cell.name}: micro-step failed: {exc!r}")))

    def _send_grads(self, c: cmd.SendGrads) -> None:
        grads = self.cells[c.cell].grads.pop(c.token)
        self._program(c.transfer, "SendGrads")
        jax.block_until_ready(transfer(grads, self.core_shardings, uuid=c.uuid))

    # -- sessions -----------------------------------------------------------------------------------------
    def _export_sessions(self, c: cmd.ExportSessions) -> None:
        cell = self.cells[c.cell]
        parts = []
        for index, state in enumerate(cell.local.drain()):
            token = None if state.request is None else self._reply_tokens.pop(state.request.request_id, None)
            if state.kv is not None:
                cell.outbox[index] = state.kv
            parts.append(host_part(state, token))
        self._reply(c.token, parts)

    def _send_kv(self, c: cmd.SendKV) -> None:
        kv = self.cells[c.cell].outbox.pop(c.index)
        self._program(c.transfer, "SendKV")
        jax.block_until_ready(transfer(kv, self.layouts[c.dest].kv_pages_shardings(kv.num_pages), uuid=c.uuid))

    def _import_session(self, c: cmd.ImportSession) -> None:
        cell = self.cells[c.cell]
        kv = None
        if c.part.kv is not None:
            self._program(c.transfer, "ImportSession")
            like = cell.local.layout.kv_pages_shardings(c.part.kv[0])
            kv = transfer(abstract_on(c.part.kv[1], self.layouts[c.source].cell.mesh, like), like, uuid=c.uuid)
        future = None
        request = c.part.fields["request"]
        if request is not None:
            future = concurrent.futures.Future()
            self._reply_tokens[request.request_id] = c.token
            future.add_done_callback(lambda f, rid=request.request_id: self._answer(rid, f))
        cell.local.import_sessions([SessionState(kv=kv, future=future, **c.part.fields)])

    def _move_sessions(self, c: cmd.MoveSessions) -> None:
        self._reply(c.token, local_to_local(self.cells[c.cell].local, self.cells[c.dest].local))

    def _drop_sessions(self, c: cmd.DropSessions) -> None:
        self._reply(c.token, self.cells[c.cell].local.drop_sessions())
