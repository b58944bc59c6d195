"""The leader's side of cells on other processes: ``RemoteCell`` (a ``CellHandle``), its link to the follower
process, and the run's ordered log of cross-process transfers.

In a multi-process run (``docs/multihost.md``) process 0 leads: it runs the proxy, the executor, the
records, the trajectory pipeline, the controller and the core cell. Every other process is a follower
(``runtime.host.CellHost``) that runs the cells on its own devices as the leader's commands say. Host
messages (``runtime.commands``) travel on ``Channel``s (direct TCP connections); device data (weights,
gradients, KV) moves only by ``transfer``: point to point under a ``uuid`` (``runtime.p2p``), or, as the
fallback, by a program every process taking part runs at the same point. The leader announces each move,
under ``TransferLog.lock``, to the followers taking part (with their sequence numbers and the move's
``uuid``) before running its own side, and commands are read in the order sent, so every process runs
them in one order.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from gyre_jax.model import lora
from gyre_jax.runtime import commands as cmd
from gyre_jax.runtime import sessions
from gyre_jax.runtime.base import CellHandleBase
from gyre_jax.runtime.cells import Cell, CellLayout
from gyre_jax.runtime.channel import Channel
from gyre_jax.runtime.handle import CellHandle, CellStats, MovedSession
from gyre_jax.runtime.process import runtime
from gyre_jax.runtime.transfer import abstract_on, transfer
from gyre_jax.serving.types import GenerationRequest, GenerationResult

log = logging.getLogger("gyre_jax.remote")


class RemoteError(RuntimeError):
    """A follower reported a failure, or a command got no answer in time."""


class TransferLog:
    """The run's cross-process transfer programs, in the one order every process runs them.

    ``announce(processes)`` (under ``lock``) gives each follower taking part its next sequence number; the
    follower checks it against its own count before running its side. The last entries are kept for
    diagnosis (``recent``)."""

    def __init__(self, keep: int = 256):
        self.lock = threading.RLock()
        self._next: dict[int, int] = collections.defaultdict(int)
        self._uuids = itertools.count(1)
        self.recent: collections.deque[tuple[str, dict[int, int], int]] = collections.deque(maxlen=keep)

    def announce(self, kind: str, *processes: int) -> tuple[dict[int, int], int]:
        """Each process's sequence number for this move, and the move's number in the run (its ``uuid``)."""
        seqs = {}
        for p in processes:
            seqs[p] = self._next[p]
            self._next[p] += 1
        uuid = next(self._uuids)
        self.recent.append((kind, seqs, uuid))
        return seqs, uuid


class FollowerLink:
    """The leader's end of one follower process: its command channel, the reply reader, pending replies.

    ``on_error(message)``: the follower failed as a whole; ``on_stop()``: it asks the run to stop (a signal)."""

    def __init__(
        self,
        client: Any,
        process_id: int,
        on_error: Callable[[str], None] | None = None,
        on_stop: Callable[[], None] | None = None,
    ):
        self.process_id = process_id
        self.on_error = on_error
        self.on_stop = on_stop
        self.commands = Channel(client, f"to{process_id}")
        self.replies = Channel(client, f"from{process_id}")
        self._tokens = itertools.count()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name=f"follower-{process_id}-replies", daemon=True)
        self._reader.start()

    def send(self, command: Any) -> None:
        self.commands.send(command)

    def expect(self) -> tuple[int, concurrent.futures.Future]:
        """A fresh token and the future its reply resolves."""
        token = next(self._tokens)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._pending[token] = fut
        return token, fut

    def take(self, token: int | None) -> concurrent.futures.Future | None:
        """The future waiting for ``token``'s reply, which the follower will no longer send (the request moved)."""
        with self._lock:
            return None if token is None else self._pending.pop(token, None)

    def ask(self, make: Callable[[int], Any], timeout_s: float = 120.0) -> Any:
        """Sends ``make(token)`` and waits for its reply's value."""
        token, fut = self.expect()
        command = make(token)
        self.send(command)
        try:
            return fut.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise RemoteError(
                f"process {self.process_id} did not answer {type(command).__name__} within {timeout_s} s"
            ) from None

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                message = self.replies.recv()
            except TimeoutError:
                continue
            except Exception as exc:  # noqa: BLE001 - the control-plane store is gone: the watchdog reports it
                if not self._closed.is_set():
                    log.warning("process %d: reply channel closed (%s)", self.process_id, exc)
                return
            self._dispatch(message)

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, cmd.StopRequest):
            log.warning("process %d asks to stop (%s)", self.process_id, message.reason)
            if self.on_stop is not None:
                self.on_stop()
            return
        if isinstance(message, cmd.Failure) and message.token is None:
            log.error("process %d failed: %s", self.process_id, message.error)
            if self.on_error is not None:
                self.on_error(f"process {self.process_id}: {message.error}")
            return
        fut = self.take(message.token)
        if fut is None or fut.done():
            return
        if isinstance(message, cmd.Failure):
            error = message.error
            fut.set_exception(error if isinstance(error, BaseException) else RemoteError(str(error)))
        else:
            fut.set_result(message.value)

    def close(self, timeout_s: float = 60.0) -> None:
        """Tells the follower to stop (its ``serve`` returns), waiting ``timeout_s`` for its answer, and stops
        the reader."""
        if self._closed.is_set():
            return
        try:
            self.ask(lambda token: cmd.Stop(token=token), timeout_s=timeout_s)
        except Exception as exc:  # noqa: BLE001 - best effort: the follower may be gone already
            log.warning("process %d did not confirm stopping: %s", self.process_id, exc)
        self._closed.set()
        self._reader.join(timeout=5)


class RemoteWorker:
    """A remote cell's ``MicroStepWorker``: weights stay on the follower (``snapshot`` returns a ``WeightsRef``),
    the micro-batch travels as host arrays, and the gradients come back onto the core's layout by one
    ``transfer`` program."""

    def __init__(self, owner: RemoteCell, core_shardings: Any, timeout_s: float = 3600.0):
        self.owner = owner
        self.name = owner.name
        self.param_shardings = owner.layout.param_shardings
        self.core_shardings = core_shardings
        self.timeout_s = timeout_s
        self._serials = itertools.count()

    def snapshot(self, params: Any, slot: str = "params") -> cmd.WeightsRef:
        """``params`` (the core's, or the reference policy's) onto the remote cell's training layout."""
        ref = cmd.WeightsRef(cell=self.owner.index, slot=slot, serial=next(self._serials))
        with self.owner.program("load_weights") as (seqs, uuid):
            self.owner.link.send(cmd.LoadWeights(self.owner.index, ref, seqs[self.owner.process], uuid))
            transfer(lora.source_of(params), self.param_shardings, uuid=uuid)
        return ref

    def micro_step(
        self, params: cmd.WeightsRef, mb: Any, kind: str = "rl", ref_params: cmd.WeightsRef | None = None
    ) -> tuple[Any, dict]:
        """Gradients (on the core's layout) and metrics of ``mb`` with the weights ``params`` names."""
        link, index = self.owner.link, self.owner.index
        token, fut = link.expect()
        batch = jax.tree.map(np.asarray, mb)
        link.send(cmd.MicroStep(index, token, params, ref_params, batch, kind))
        try:
            aux, layout = fut.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise RemoteError(
                f"{self.name}: no gradients from process {link.process_id} within {self.timeout_s} s"
            ) from None
        with self.owner.program("send_grads") as (seqs, uuid):
            link.send(cmd.SendGrads(cell=index, token=token, transfer=seqs[link.process_id], uuid=uuid))
            source = abstract_on(layout, self.owner.cell.mesh, self.core_shardings)
            grads = transfer(source, self.core_shardings, uuid=uuid)
        return grads, aux


class RemoteCell(CellHandleBase):
    """A ``CellHandle`` for a cell on follower process ``link.process_id``."""

    def __init__(
        self,
        link: FollowerLink,
        transfers: TransferLog,
        cell: Cell,
        layout: CellLayout,
        core_shardings: Any,
        max_context: int,
    ):
        self.link = link
        self.transfers = transfers
        self.cell = cell
        self.layout = layout
        self._max_context = max_context
        self._version = -1  # no weights until the first set_weights
        self._moved: dict[str, CellHandle] = {}  # request id -> the cell it moved to (cancels follow it)
        self._lock = threading.Lock()
        self.worker = RemoteWorker(self, core_shardings)

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def process(self) -> int:
        return self.link.process_id

    @contextmanager
    def program(self, kind: str, *others: int) -> Iterator[tuple[dict[int, int], int]]:
        """Announces a move this cell's process (and processes ``others``) take part in; yields each one's
        sequence number and the move's ``uuid``. Send the command(s) and run the leader's side (if any) inside
        the block."""
        with self.transfers.lock:
            yield self.transfers.announce(kind, self.process, *others)

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        token, fut = self.link.expect()
        self.link.send(cmd.Submit(cell=self.index, token=token, request=request))
        return fut

    def cancel(self, request_id: str) -> None:
        with self._lock:
            moved = self._moved.get(request_id)
        if moved is not None:
            moved.cancel(request_id)
        else:
            self.link.send(cmd.Cancel(cell=self.index, request_id=request_id))

    def forward_cancels(self, request_id: str, target: CellHandle, caller: concurrent.futures.Future | None) -> None:
        """Cancels of ``request_id`` sent here go to ``target`` (where it runs now) until its caller is answered."""
        with self._lock:
            self._moved[request_id] = target
        if caller is not None:
            caller.add_done_callback(lambda _: self._forget_moved(request_id))

    def _forget_moved(self, request_id: str) -> None:
        with self._lock:
            self._moved.pop(request_id, None)

    def set_weights(self, params: Any, version: int) -> None:
        """``params`` (the core's) onto the remote cell's serving layout by one program; swapped in remotely at
        the loop's next step."""
        with self.program("set_weights") as (seqs, uuid):
            self.link.send(cmd.SetWeights(self.index, version, seqs[self.process], uuid))
            transfer(lora.source_of(params), self.layout.param_shardings, uuid=uuid)
        self._version = version

    def move_sessions_to(self, target: CellHandle) -> list[MovedSession]:
        return target.sessions_from_remote(self)

    def sessions_from_local(self, source) -> list[MovedSession]:
        return sessions.local_to_remote(source, self)

    def sessions_from_remote(self, source: RemoteCell) -> list[MovedSession]:
        return sessions.remote_to_remote(source, self)

    def drop_sessions(self) -> int:
        return int(self.link.ask(lambda t: cmd.DropSessions(cell=self.index, token=t), timeout_s=600.0))

    def stats(self) -> CellStats:
        return self.link.ask(lambda t: cmd.Stats(cell=self.index, token=t))

    def close(self) -> None:
        try:
            self.link.ask(lambda t: cmd.CloseCell(cell=self.index, token=t), timeout_s=60.0)
        except Exception as exc:  # noqa: BLE001 - best effort on shutdown: the follower may be gone
            log.warning("%s: the follower did not confirm closing: %s", self.name, exc)


@dataclass
class Cells:
    """The leader's cells: a handle per cell, in cell order, and the links to the follower processes holding some
    (none in a one-process run)."""

    handles: list[CellHandle]
    links: list[FollowerLink]

    def step_logs(self) -> list[list[tuple[int, int, int, float, float]]]:
        """Each cell's serving step log (``CellStats.step_log``: the simulator's calibration input)."""
        return [h.stats().step_log for h in self.handles]


def open_cells(
    cells: list[Cell],
    layouts: list[CellLayout],
    make_local: Callable[[Cell, CellLayout], CellHandle],
    core_shardings: Any,
    max_context: int,
    on_error: Callable[[str], None] | None = None,
    on_stop: Callable[[], None] | None = None,
) -> Cells:
    """A handle per cell, for the leader: ``make_local(cell, layout)`` for the cells this process drives (holds
    alone, or drives as a cell's first process: ``runtime.lockstep``), a ``RemoteCell`` (one ``FollowerLink`` per
    driving follower process, one ``TransferLog`` for the run) for the others.
    A remote cell has no weights yet (``policy_version`` -1): ``set_weights`` starts its serving loop. Each link
    reports its follower's failure to ``on_error`` and its stop requests to ``on_stop`` (``FollowerLink``)."""
    links: dict[int, FollowerLink] = {}
    transfers = TransferLog()
    me = jax.process_index()
    handles: list[CellHandle] = []
    for cell, layout in zip(cells, layouts):
        owner = cell.processes[0]  # the cell's driver (a cell over several processes runs in lockstep on all)
        if owner == me:
            handles.append(make_local(cell, layout))
            continue
        if owner not in links:
            links[owner] = FollowerLink(runtime().client, owner, on_error=on_error, on_stop=on_stop)
        handles.append(RemoteCell(links[owner], transfers, cell, layout, core_shardings, max_context))
    return Cells(handles, list(links.values()))
