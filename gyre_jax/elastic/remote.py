"""Cells on other processes: the leader's stand-ins and the follower that runs them.

In a multi-process run (``docs/multihost.md``) process 0 is the *leader*: it runs the proxy, the executor,
the records, the trajectory pipeline, the controller and the core cell (cell 0, with the optimizer). Every
other process is a *follower*: it runs the serving loops and gradient workers of the cells on its own
devices and does what the leader's controller tells it. A cell is a set of whole hosts or a part of one
host; this module handles cells that lie within one process (a cell over several hosts would need every
serving step in lockstep on all of them: not supported yet, refused when the trainer builds the cells).

Two kinds of traffic:

- **Host messages** (requests and their results, micro-batches, commands, stats) travel through the JAX
  coordination service's key-value store, as ordered per-process ``Channel``s. They are small: token ids,
  packed micro-batches of a few thousand tokens, counters.
- **Device data** (weights to a remote cell's serving or training layout, a remote micro-step's
  gradients to the core) moves only through JAX: ``distributed.cell_put``, one jitted program over the
  two cells' devices in which XLA's collectives move the bytes. Both processes must run each such program
  at the same point: the leader takes ``RemoteProcess.collective`` (one lock), sends the command, and runs
  its side; the follower's command thread runs its side when it reads the command. Commands are read in
  the order they were sent, so every process runs the cross-process programs in one order.

Leader side: ``RemoteProcess`` (the channels and a reader thread), ``RemoteLoop`` (the ``ServingLoop``
interface the router and controller use), ``RemoteWorker`` (the ``GradWorker`` interface) and
``move_sessions``. Follower side: ``Follower``.

Sessions move between cells on different processes with their KV (``move_sessions``): host parts on the
channels, each KV by one ``cell_put``; a request in flight continues where it stopped.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import pickle
import queue as queue_lib
import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from gyre_jax import distributed
from gyre_jax.serving.engine import KVPages
from gyre_jax.serving.session import SessionState
from gyre_jax.serving.types import GenerationRequest

log = logging.getLogger("gyre_jax.remote")

_PREFIX = "gyre/ch"
_POLL_MS = 500  # a channel reader wakes this often to notice it was closed


class RemoteError(RuntimeError):
    """A follower reported a failure, or a query got no answer."""


class Channel:
    """Ordered one-way messages (pickled Python objects) through the coordination service's key-value store.

    One writer and one reader: message ``k`` is key ``gyre/ch/<name>/<k>``; the reader deletes each key
    after reading it. Both ends are the same program (one run, one code version), so pickle is safe here.
    """

    def __init__(self, client, name: str):
        self.client = client
        self.name = name
        self._send_seq = 0
        self._recv_seq = 0
        self._lock = threading.Lock()

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            key = f"{_PREFIX}/{self.name}/{self._send_seq}"
            self._send_seq += 1
            self.client.key_value_set_bytes(key, data)

    def recv(self, timeout_ms: int = _POLL_MS) -> Any:
        """The next message; ``TimeoutError`` if none arrived within ``timeout_ms``."""
        key = f"{_PREFIX}/{self.name}/{self._recv_seq}"
        try:
            data = self.client.blocking_key_value_get_bytes(key, timeout_ms)
        except Exception as exc:  # noqa: BLE001 - jax raises its runtime error type for a deadline
            if "DEADLINE" in str(exc).upper():
                raise TimeoutError(key) from None
            raise
        self._recv_seq += 1
        try:
            self.client.key_value_delete(key)
        except Exception:  # noqa: BLE001 - a leftover key costs memory only
            pass
        return pickle.loads(data)


# == leader side ===========================================================================================
class RemoteProcess:
    """The leader's link to one follower process: a command channel, a reply channel and its reader."""

    _collective_lock = threading.Lock()  # cross-process programs start in one order (all followers share it)

    def __init__(
        self,
        client,
        process_id: int,
        on_error: Callable[[str], None] | None = None,
        on_stop: Callable[[], None] | None = None,
    ):
        self.process_id = process_id
        self.on_stop = on_stop
        self.commands = Channel(client, f"to{process_id}")
        self.replies = Channel(client, f"from{process_id}")
        self.on_error = on_error
        self._ids = itertools.count()
        self._pending: dict[Any, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name=f"remote-{process_id}-replies", daemon=True)
        self._reader.start()

    def send(self, *command: Any) -> None:
        self.commands.send(command)

    def expect(self) -> tuple[int, concurrent.futures.Future]:
        """A fresh token and the future its reply resolves."""
        token = next(self._ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._pending[token] = fut
        return token, fut

    def forget(self, token: Any) -> None:
        """Stops waiting for ``token``'s reply (its future is resolved elsewhere now)."""
        with self._lock:
            self._pending.pop(token, None)

    def query(self, what: str, *args: Any, timeout_s: float = 120.0) -> Any:
        token, fut = self.expect()
        self.send("query", token, what, *args)
        try:
            return fut.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise RemoteError(f"process {self.process_id} did not answer {what!r} within {timeout_s} s") from None

    @staticmethod
    @contextmanager
    def ordered():
        """The lock under which cross-process programs are started (their commands sent inside it)."""
        with RemoteProcess._collective_lock:
            yield

    @contextmanager
    def collective(self, *command: Any):
        """Sends ``command`` and holds the lock while the leader runs its side of the cross-process program."""
        with RemoteProcess._collective_lock:
            self.send(*command)
            yield

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                kind, token, value = self.replies.recv()
            except TimeoutError:
                continue
            except Exception as exc:  # noqa: BLE001 - the coordination service is gone: the watchdog reports it
                if not self._closed.is_set():
                    log.warning("process %d: reply channel closed (%s)", self.process_id, exc)
                return
            if kind == "stop":  # the follower got SIGINT/SIGTERM: the leader stops the run (and checkpoints)
                log.warning("process %d asks to stop (%s)", self.process_id, value)
                if self.on_stop is not None:
                    self.on_stop()
                continue
            if kind == "error" and token is None:
                log.error("process %d failed: %s", self.process_id, value)
                if self.on_error is not None:
                    self.on_error(f"process {self.process_id}: {value}")
                continue
            with self._lock:
                fut = self._pending.pop(token, None)
            if fut is None or fut.done():
                continue
            if kind == "error":
                fut.set_exception(value if isinstance(value, BaseException) else RemoteError(str(value)))
            else:
                fut.set_result(value)

    def close(self) -> None:
        """Tells the follower to stop (its ``serve`` returns) and stops the reader."""
        if self._closed.is_set():
            return
        try:
            self.query("stop", timeout_s=60.0)
        except Exception as exc:  # noqa: BLE001 - best effort: the follower may be gone already
            log.warning("process %d did not confirm stopping: %s", self.process_id, exc)
        self._closed.set()
        self._reader.join(timeout=5)


@dataclasses.dataclass
class _RemoteStats:
    busy_s: float = 0.0


class RemoteLoop:
    """The leader's stand-in for a ``ServingLoop`` on another process (what the router and controller use)."""

    remote = True

    def __init__(
        self,
        proc: RemoteProcess,
        cell_index: int,
        name: str,
        max_context: int,
        serving_shardings: Any,
        policy_version: int = 0,
        engine: Any = None,
    ):
        self.proc = proc
        self.cell_index = cell_index
        self.name = name
        self.max_context = max_context
        self.serving_shardings = serving_shardings
        self.policy_version = policy_version
        self.engine = engine  # the cell's Engine, built here for its shardings only (KV pages on its mesh)
        self._futures: dict[str, concurrent.futures.Future] = {}  # request id -> the caller's future, until done
        self._moved: dict[str, Any] = {}  # request id -> the loop it moved to (cancels follow it)
        self._lock = threading.Lock()

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future:
        token, fut = self.proc.expect()
        self.track(request.request_id, fut)
        self.proc.send("submit", token, self.cell_index, request)
        return fut

    def track(self, request_id: str, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._futures[request_id] = fut
        fut.add_done_callback(lambda _: self._forget(request_id))

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._futures.pop(request_id, None)
            self._moved.pop(request_id, None)

    def future_of(self, request_id: str) -> concurrent.futures.Future | None:
        with self._lock:
            return self._futures.get(request_id)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            moved = self._moved.get(request_id)
        if moved is not None:
            moved.cancel(request_id)  # the request now lives on another loop
            return
        self.proc.send("cancel", None, self.cell_index, request_id)

    def update_params(self, params: Any, version: int) -> None:
        """``params``: the core's (on cell 0's mesh): moved onto this cell's serving layout by one cross-process
        program, then swapped in by the remote loop at its next step boundary."""
        with self.proc.collective("publish", None, self.cell_index, version):
            out = distributed.cell_put(params, self.serving_shardings)
        del out  # the leader holds none of its shards
        self.policy_version = version

    @property
    def stats(self) -> _RemoteStats:
        return _RemoteStats(busy_s=float(self.proc.query("busy_s", self.cell_index)))

    @property
    def step_log(self) -> list:
        return list(self.proc.query("step_log", self.cell_index))

    def drain(self) -> list:
        """Drops the remote loop's cached sessions and cancels what it still runs (the router re-submits it).
        To move them with their KV instead, use ``move_sessions``."""
        self.proc.query("drain", self.cell_index, timeout_s=600.0)  # waits for the loop's step (a compile, maybe)
        return []

    def import_sessions(self, states) -> None:
        raise NotImplementedError("sessions reach a cell on another process through move_sessions")

    def num_in_flight(self) -> int:
        return int(self.proc.query("in_flight", self.cell_index))

    def stop(self) -> None:
        pass  # the follower stops its loops when its RemoteProcess is closed


_STATE_FIELDS = (
    "session_id",
    "kv_tokens",
    "kv_version",
    "request",
    "token_ids",
    "logprobs",
    "policy_versions",
    "key",
    "cached_tokens",
    "source",
)


def _host_part(state: SessionState) -> dict:
    part = {f: getattr(state, f) for f in _STATE_FIELDS}
    part["key"] = None if state.key is None else np.asarray(state.key)
    return part


def _kv_layout(kv: KVPages | None) -> tuple[int, list] | None:
    """(pages, [(shape, dtype, spec) per leaf]) of a KV to move, or None."""
    if kv is None:
        return None
    return kv.num_pages, [(tuple(x.shape), x.dtype, x.sharding.spec) for x in jax.tree.leaves(kv)]


def _abstract_kv(layout, mesh, like: KVPages) -> KVPages:
    """``ShapeDtypeStruct`` leaves standing for a KV this process does not hold (``cell_put``'s source)."""
    treedef = jax.tree.structure(like)
    return jax.tree.unflatten(
        treedef,
        [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec)) for shape, dtype, spec in layout[1]],
    )


def _chain(src: concurrent.futures.Future, dst: concurrent.futures.Future | None) -> None:
    """When ``src`` resolves, ``dst`` (the caller's future) resolves the same way."""
    if dst is None:
        return

    def done(f):
        if dst.done():
            return
        exc = f.exception()
        dst.set_exception(exc) if exc is not None else dst.set_result(f.result())

    src.add_done_callback(done)


def move_sessions(
    source: Any, target: Any, source_cell: int | None = None, target_cell: int | None = None
) -> list[SessionState]:
    """Moves every session of serving loop ``source`` into ``target``, KV included, whichever processes they
    run on (``ServingLoop`` here, ``RemoteLoop`` for another process). Returns the moved states (host
    parts; ``kv`` is None in them once moved across processes). A request in flight continues on
    ``target`` where it stopped; its caller's future resolves from there; cancels follow it.
    ``source_cell`` / ``target_cell``: the cells' indices (a ``RemoteLoop`` knows its own).

    Across processes each KV crosses by one ``cell_put`` (started in the collective order); the rest is
    host data on the command channels."""
    src_remote, dst_remote = getattr(source, "remote", False), getattr(target, "remote", False)
    src_cell = source.cell_index if src_remote else source_cell
    dst_cell = target.cell_index if dst_remote else target_cell
    if not src_remote and not dst_remote:
        states = source.drain()
        target.import_sessions(states)
        return states
    if src_remote and dst_remote and source.proc is target.proc:  # both cells on one follower
        return source.proc.query("move_local", src_cell, dst_cell, timeout_s=600.0)
    if src_remote:
        parts = source.proc.query("export", src_cell, timeout_s=600.0)  # [(host part, token, layout)]
        moving = [
            (part, source.future_of(part["request"].request_id) if part["request"] is not None else None, None, layout)
            for part, _, layout in parts
        ]
        for _, was, _ in parts:  # the follower no longer answers for these: the importing loop does
            source.proc.forget(was)
    else:
        moving = [(_host_part(st), st.future, st, _kv_layout(st.kv)) for st in source.drain()]
    out = []
    for index, (part, caller, state, layout) in enumerate(moving):
        if part["request"] is not None and (caller is None or caller.done()):
            part = dict(part, request=None)  # nobody waits for it any more: its KV becomes a cache entry
        rid = None if part["request"] is None else part["request"].request_id
        kv = None
        if not dst_remote:  # source on a follower, target here
            if layout is not None:
                like = target.engine.kv_pages_shardings(layout[0])
                with source.proc.collective("kv_out", None, src_cell, index, dst_cell):
                    kv = distributed.cell_put(_abstract_kv(layout, mesh_of(source), like), like)
            moved = SessionState(kv=kv, future=caller, **part)
            target.import_session(moved)
            if rid is not None:
                source._moved[rid] = target
        else:
            token = None
            if rid is not None:
                token, fut = target.proc.expect()
                _chain(fut, caller)
                target.track(rid, caller)
            with RemoteProcess.ordered():
                if src_remote:  # follower to follower: the two of them run the program
                    source.proc.send("kv_out", None, src_cell, index, dst_cell)
                    target.proc.send("kv_in", token, dst_cell, part, src_cell, layout)
                else:
                    target.proc.send("kv_in", token, dst_cell, part, src_cell, layout)
                    if layout is not None:
                        distributed.cell_put(state.kv, target.engine.kv_pages_shardings(layout[0]))
            if rid is not None:
                if src_remote:
                    source._moved[rid] = target
                else:
                    state.moved_to = target  # the local loop forwards cancels
            moved = SessionState(kv=None, future=caller, **part)
        out.append(moved)
    return out


def mesh_of(loop: Any):
    """The mesh of a serving loop's cell (a ``ServingLoop``'s engine, or a ``RemoteLoop``'s)."""
    return loop.engine.mesh


class RemoteWorker:
    """The leader's stand-in for a ``GradWorker`` on another process (what the controller's cell worker uses).

    ``snapshot`` moves the core's params onto the remote cell's training layout (cross-process program);
    ``micro_step`` ships the packed micro-batch (host arrays), waits until the follower has the gradients,
    then moves them onto the core's layout (cross-process program) and returns them there.
    """

    remote = True

    def __init__(
        self,
        proc: RemoteProcess,
        cell_index: int,
        name: str,
        param_shardings: Any,
        core_shardings: Any,
        timeout_s: float = 3600.0,
    ):
        self.proc = proc
        self.cell_index = cell_index
        self.name = name
        self.param_shardings = param_shardings  # on the remote cell's mesh
        self.core_shardings = core_shardings
        self.timeout_s = timeout_s

    def snapshot(self, params: Any) -> Any:
        with self.proc.collective("snapshot", None, self.cell_index):
            return distributed.cell_put(params, self.param_shardings)

    def micro_step(self, params: Any, mb: Any, kind: str = "rl") -> tuple[Any, dict]:
        del params  # the follower uses the snapshot it received last (commands arrive in order)
        token, fut = self.proc.expect()
        self.proc.send("micro_step", token, self.cell_index, jax.tree.map(np.asarray, mb), kind)
        try:
            aux, specs = fut.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise RemoteError(
                f"{self.name}: no gradients from process {self.proc.process_id} within {self.timeout_s} s"
            ) from None
        treedef = jax.tree.structure(self.core_shardings)
        mesh = jax.tree.leaves(self.param_shardings)[0].mesh
        abstract = [
            jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))
            for shape, dtype, spec in specs
        ]
        with self.proc.collective("send_grads", token, self.cell_index):
            grads = distributed.cell_put(jax.tree.unflatten(treedef, abstract), self.core_shardings)
        return grads, aux


# == follower side =========================================================================================
@dataclasses.dataclass
class FollowerCell:
    """One of the follower's own cells: how to make its serving loop, and its gradient worker."""

    index: int
    name: str
    make_loop: Callable[[Any, int], Any]  # (params on the serving layout, policy version) -> started ServingLoop
    serving_shardings: Any
    worker: Any  # GradWorker on the cell's mesh
    loop: Any = None
    snapshot: Any = None
    grads: dict = dataclasses.field(default_factory=dict)
    work: queue_lib.Queue = dataclasses.field(default_factory=queue_lib.Queue)


class Follower:
    """Runs a follower process's cells as the leader's commands say, until the leader sends ``stop``."""

    def __init__(
        self,
        client,
        process_id: int,
        cells: list[FollowerCell],
        core_shardings: Any,
        engines: dict[int, Any] | None = None,
    ):
        self.process_id = process_id
        self.engines = engines or {}  # every cell's Engine (other processes' too: for their meshes and KV layouts)
        self._tokens: dict[str, Any] = {}  # request id -> the leader's token for its result
        self._outbox: dict[int, Any] = {}  # exported KV waiting for its kv_out program
        self.commands = Channel(client, f"to{process_id}")
        self.replies = Channel(client, f"from{process_id}")
        self.cells = {c.index: c for c in cells}
        self.core_shardings = core_shardings  # the core's param layout (on process 0's devices)
        self._abstract_core = None
        self._stopped = threading.Event()
        self._stop_requested = False

    def _reply(self, kind: str, token: Any, value: Any) -> None:
        try:
            self.replies.send((kind, token, value))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # e.g. an exception that cannot pickle
            self.replies.send(("error", token, RemoteError(f"{value!r} (could not be sent: {exc})")))

    def _core_abstract(self, like: Any) -> Any:
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like, self.core_shardings)

    def serve(self, abstract_params: Any) -> None:
        """The command loop (this thread runs every cross-process program, in the order sent)."""
        self._abstract_core = self._core_abstract(abstract_params)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):  # e.g. Slurm's preemption: process 0 stops and saves
                signal.signal(sig, self._signalled)
        workers = [
            threading.Thread(target=self._compute, args=(c,), name=f"follower-{c.name}", daemon=True)
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
                except Exception as exc:  # noqa: BLE001 - the coordination service (process 0) is gone
                    raise distributed.DistributedError(
                        f"lost process 0's commands ({type(exc).__name__}: {str(exc)[:200]}); process 0 died or is "
                        f"unreachable: restart all processes to resume from the last checkpoint"
                    ) from None
                try:
                    self._handle(*command)
                except Exception as exc:  # noqa: BLE001 - reported; the leader stops the run
                    log.exception("follower %d: command %r failed", self.process_id, command[0])
                    self._reply("error", None, f"command {command[0]!r} failed: {exc!r}")
                    raise
        finally:
            for c in self.cells.values():
                c.work.put(None)
                if c.loop is not None:
                    c.loop.stop()

    def _signalled(self, signum, _frame) -> None:
        if self._stop_requested:
            log.error("second stop request: exiting now (process 0 then stops the run)")
            os._exit(130)
        self._stop_requested = True
        log.warning("signal %d: asking process 0 to stop the run and save a checkpoint (send again to force)", signum)
        self._reply("stop", None, f"signal {signum}")

    def _handle(self, what: str, token: Any, *args: Any) -> None:
        if what == "submit":
            cell, request = args
            self._tokens[request.request_id] = token
            try:
                fut = self.cells[cell].loop.submit(request)
            except Exception as exc:  # noqa: BLE001 - e.g. a prompt that cannot fit: the caller's future raises
                self._tokens.pop(request.request_id, None)
                self._reply("error", token, exc)
                return
            fut.add_done_callback(lambda f, rid=request.request_id: self._done(rid, f))
        elif what == "kv_out":
            _cell, index, dest = args
            kv = self._outbox.pop(index)
            like = self.engines[dest].kv_pages_shardings(kv.num_pages)
            jax.block_until_ready(distributed.cell_put(kv, like))
        elif what == "kv_in":
            cell, part, source, layout = args
            c = self.cells[cell]
            kv = None
            if layout is not None:
                like = c.loop.engine.kv_pages_shardings(layout[0])
                kv = distributed.cell_put(_abstract_kv(layout, self.engines[source].mesh, like), like)
            future = None
            if part["request"] is not None:
                future = concurrent.futures.Future()
                self._tokens[part["request"].request_id] = token
                future.add_done_callback(lambda f, rid=part["request"].request_id: self._done(rid, f))
            c.loop.import_session(SessionState(kv=kv, future=future, **part))
        elif what == "cancel":
            (cell, request_id), c = args, self.cells[args[0]]
            if c.loop is not None:
                c.loop.cancel(request_id)
        elif what == "publish":
            cell, version = args
            c = self.cells[cell]
            params = distributed.cell_put(self._abstract_core, c.serving_shardings)
            if c.loop is None:
                c.loop = c.make_loop(params, version)
            else:
                c.loop.update_params(params, version)
        elif what == "snapshot":
            c = self.cells[args[0]]
            c.snapshot = distributed.cell_put(self._abstract_core, c.worker.param_shardings)
        elif what == "micro_step":
            cell, mb, kind = args
            c = self.cells[cell]
            c.work.put((token, c.snapshot, mb, kind))
        elif what == "send_grads":
            c = self.cells[args[0]]
            grads = c.grads.pop(token)
            jax.block_until_ready(distributed.cell_put(grads, self.core_shardings))
        elif what == "query":
            self._query(token, *args)
        else:
            raise RemoteError(f"unknown command {what!r}")

    def _query(self, token: Any, what: str, *args: Any) -> None:
        if what == "stop":
            self._stopped.set()
            self._reply("ok", token, True)
            return
        c = self.cells[args[0]]
        if what == "busy_s":
            value = 0.0 if c.loop is None else c.loop.stats.busy_s
        elif what == "step_log":
            value = [] if c.loop is None else list(c.loop.step_log)
        elif what == "in_flight":
            value = 0 if c.loop is None else c.loop.num_in_flight()
        elif what == "drain":
            states = [] if c.loop is None else c.loop.drain()
            for s in states:
                s.cancel()
            value = len(states)
        elif what == "export":  # for move_sessions: host parts now, each KV by its kv_out program
            value = []
            for index, st in enumerate([] if c.loop is None else c.loop.drain()):
                was = None if st.request is None else self._tokens.pop(st.request.request_id, None)
                if st.kv is not None:
                    self._outbox[index] = st.kv
                value.append((_host_part(st), was, _kv_layout(st.kv)))
        elif what == "move_local":
            states = c.loop.drain()
            self.cells[args[1]].loop.import_sessions(states)
            value = [SessionState(kv=None, future=None, **_host_part(st)) for st in states]
        else:
            raise RemoteError(f"unknown query {what!r}")
        self._reply("ok", token, value)

    def _done(self, request_id: str, fut: concurrent.futures.Future) -> None:
        token = self._tokens.pop(request_id, None)
        if token is not None:  # None: the request moved to another process, which answers for it
            self._reply(*_outcome(fut, token))

    def _compute(self, c: FollowerCell) -> None:
        while True:
            item = c.work.get()
            if item is None:
                return
            token, params, mb, kind = item
            try:
                grads, aux = c.worker.micro_step(params, mb, kind)
                aux = {k: float(np.asarray(v)) for k, v in jax.device_get(aux).items()}
                specs = [(tuple(g.shape), g.dtype, g.sharding.spec) for g in jax.tree.leaves(grads)]
                c.grads[token] = grads
                self._reply("ok", token, (aux, specs))
            except Exception as exc:  # noqa: BLE001 - the leader's micro-step fails and the run stops
                log.exception("follower %d: micro-step failed", self.process_id)
                self._reply("error", token, RemoteError(f"{c.name}: micro-step failed: {exc!r}"))


def _outcome(fut: concurrent.futures.Future, token: Any) -> tuple[str, Any, Any]:
    exc = fut.exception()
    return ("error", token, exc) if exc is not None else ("ok", token, fut.result())
