"""Moving every session of one cell to another, KV included, whichever processes run them.

``CellHandle.move_sessions_to`` dispatches on both ends (``runtime.base.CellHandleBase``) to one function here per
pair of kinds: ``local_to_local`` (``ServingLoop.drain`` then ``import_sessions``: the KV moves device to device;
also what a follower runs for two of its own cells), ``local_to_remote`` (host parts by command, each KV by one
``transfer`` program), ``remote_to_local`` (the follower exports, each KV crosses by a program it sends) and
``remote_to_remote`` (two cells of one follower: moved there; of two followers: both run each KV's program). In
every case a request in flight continues on ``target`` where it stopped, its caller's future resolves from there,
and cancels sent to ``source`` follow it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from gyre_jax.runtime import commands as cmd
from gyre_jax.runtime.handle import CellHandle, MovedSession
from gyre_jax.runtime.transfer import abstract_on, describe, transfer
from gyre_jax.serving.session import SessionState

if TYPE_CHECKING:  # annotations only: the two handle types import this module
    from gyre_jax.runtime.local import LocalCell
    from gyre_jax.runtime.remote import RemoteCell

HOST_FIELDS = tuple(f.name for f in dataclasses.fields(SessionState) if f.name not in ("kv", "future", "moved_to"))


def host_part(state: SessionState, token: int | None = None) -> cmd.SessionPart:
    """The session's host fields and its KV's layout (the KV itself moves by a program)."""
    fields = {name: getattr(state, name) for name in HOST_FIELDS}
    fields["key"] = None if state.key is None else np.asarray(state.key)
    kv = None if state.kv is None else (state.kv.num_pages, describe(state.kv))
    return cmd.SessionPart(fields=fields, kv=kv, token=token)


def moved(part: cmd.SessionPart) -> MovedSession:
    f = part.fields
    return MovedSession(f["session_id"], f["request"] is not None, len(f["token_ids"]))


def local_to_local(source: LocalCell, target: LocalCell) -> list[MovedSession]:
    """Both cells in this process: the sessions move whole (KV device to device, futures unchanged)."""
    states = source.drain()
    target.import_sessions(states)
    return [MovedSession(s.session_id, s.request is not None, len(s.token_ids)) for s in states]


def _waiting(part: cmd.SessionPart, caller: concurrent.futures.Future | None) -> cmd.SessionPart:
    """``part`` without its request when nobody waits for the result any more (its KV becomes a cached entry)."""
    if part.fields["request"] is not None and (caller is None or caller.done()):
        return dataclasses.replace(part, fields=dict(part.fields, request=None))
    return part


def _import_token(target: RemoteCell, part: cmd.SessionPart, caller: concurrent.futures.Future | None) -> int | None:
    """A token on ``target``'s link whose reply resolves ``caller`` (None when no request is in flight)."""
    if part.fields["request"] is None:
        return None
    token, fut = target.link.expect()
    chain(fut, caller)
    return token


def local_to_remote(source: LocalCell, target: RemoteCell) -> list[MovedSession]:
    out = []
    for state in source.drain():
        part = _waiting(host_part(state), state.future)
        token = _import_token(target, part, state.future)
        if part.kv is None:
            target.link.send(cmd.ImportSession(target.index, token, part, source.index, None))
        else:
            with target.program("kv_in") as (seqs, uuid):
                target.link.send(cmd.ImportSession(target.index, token, part, source.index, seqs[target.process], uuid))
                transfer(state.kv, target.layout.kv_pages_shardings(part.kv[0]), uuid=uuid)
        if part.fields["request"] is not None:
            state.moved_to = target  # the local loop forwards cancels
        out.append(moved(part))
    return out


def _exported(source: RemoteCell, target: CellHandle):
    """Drains ``source`` on its follower; yields ``(index, part, caller)`` per session (``caller``: the future
    waiting for its request, which the follower no longer answers: ``target`` does), then makes cancels sent
    to ``source`` follow each moved request."""
    parts = source.link.ask(lambda t: cmd.ExportSessions(cell=source.index, token=t), timeout_s=600.0)
    for index, exported in enumerate(parts):
        caller = source.link.take(exported.token)
        part = _waiting(exported, caller)
        yield index, part, caller
        if part.fields["request"] is not None:
            source.forward_cancels(part.fields["request"].request_id, target, caller)


def remote_to_local(source: RemoteCell, target: LocalCell) -> list[MovedSession]:
    out = []
    for index, part, caller in _exported(source, target):
        kv = None
        if part.kv is not None:
            like = target.layout.kv_pages_shardings(part.kv[0])
            with source.program("kv_out") as (seqs, uuid):
                source.link.send(cmd.SendKV(source.index, index, target.index, seqs[source.process], uuid))
                kv = transfer(abstract_on(part.kv[1], source.cell.mesh, like), like, uuid=uuid)
        target.import_sessions([SessionState(kv=kv, future=caller, **part.fields)])
        out.append(moved(part))
    return out


def remote_to_remote(source: RemoteCell, target: RemoteCell) -> list[MovedSession]:
    if source.link is target.link:  # two cells of one follower: it moves them itself (``local_to_local`` there)
        return source.link.ask(lambda t: cmd.MoveSessions(cell=source.index, token=t, dest=target.index), 600.0)
    out = []
    for index, part, caller in _exported(source, target):
        token = _import_token(target, part, caller)
        if part.kv is None:
            target.link.send(cmd.ImportSession(target.index, token, part, source.index, None))
        else:
            with source.program("kv_move", target.process) as (seqs, uuid):  # the two followers run it
                source.link.send(cmd.SendKV(source.index, index, target.index, seqs[source.process], uuid))
                target.link.send(cmd.ImportSession(target.index, token, part, source.index, seqs[target.process], uuid))
        out.append(moved(part))
    return out


def chain(source: concurrent.futures.Future, dest: concurrent.futures.Future | None) -> None:
    """When ``source`` resolves, ``dest`` (a caller's future) resolves the same way."""
    if dest is None:
        return

    def done(f: concurrent.futures.Future) -> None:
        if dest.done():
            return
        exc = f.exception()
        dest.set_exception(exc) if exc is not None else dest.set_result(f.result())

    source.add_done_callback(done)
