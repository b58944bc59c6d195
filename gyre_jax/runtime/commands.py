"""The messages between the leader (process 0) and a follower: typed commands, and the follower's replies.

Every command names the cell it is for. A command that expects an answer carries ``token``: the follower
answers with ``Reply(token, value)`` or ``Failure(token, error)``. A command whose work is a cross-process
``transfer`` program carries ``transfer``: the follower's sequence number of that program in the run's
transfer log (``remote.TransferLog``), which the follower checks before running its side, so both
processes run every program in one order, and ``uuid``: the move's number in the run, under which the
sending process offers its arrays and the receiving one pulls them (point-to-point moves, ``runtime.p2p``). Host data only: token ids, packed micro-batches as host
arrays, sessions' host parts, array layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gyre_jax.serving.types import GenerationRequest

# A leaf layout: (shape, dtype, partition spec), as ``transfer.describe`` gives it.
Layout = list[tuple[tuple[int, ...], Any, Any]]


@dataclass(frozen=True)
class WeightsRef:
    """Weights kept on a follower's cell under ``slot`` (``"params"``, ``"ref"``), as loaded by the
    ``LoadWeights`` with this ``serial``: what a ``RemoteCell``'s ``worker.snapshot`` returns."""

    cell: int
    slot: str
    serial: int


@dataclass(frozen=True)
class SessionPart:
    """A session's host part on its way between processes (``SessionState`` without KV and future), the layout
    of its KV (``(num_pages, leaf layouts)``; None: no KV) and, for an exported request in flight, the token
    of the leader's future that was waiting for it."""

    fields: dict[str, Any]
    kv: tuple[int, Layout] | None
    token: int | None = None


# -- commands (leader -> follower) ----------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    cell: int
    token: int
    request: GenerationRequest


@dataclass(frozen=True)
class Cancel:
    cell: int
    request_id: str


@dataclass(frozen=True)
class SetWeights:
    """Program: the core's params onto the cell's serving layout; the loop (made at the first) swaps them in."""

    cell: int
    version: int
    transfer: int
    uuid: int | None = None


@dataclass(frozen=True)
class LoadWeights:
    """Program: the core's params (or the reference policy's) onto the cell's training layout, kept as ``ref``."""

    cell: int
    ref: WeightsRef
    transfer: int
    uuid: int | None = None


@dataclass(frozen=True)
class MicroStep:
    """Gradients of ``batch`` with the named weights; the reply is ``(metrics, gradient layout)`` and the
    gradients wait on the follower for their ``SendGrads``."""

    cell: int
    token: int
    weights: WeightsRef
    ref_weights: WeightsRef | None
    batch: Any  # MicroBatch of host arrays
    kind: str


@dataclass(frozen=True)
class SendGrads:
    """Program: the gradients of ``MicroStep`` ``token`` onto the core's layout."""

    cell: int
    token: int
    transfer: int
    uuid: int | None = None


@dataclass(frozen=True)
class ExportSessions:
    """Drain the cell; reply: its sessions' ``SessionPart``s (KV kept here, numbered, for ``SendKV``)."""

    cell: int
    token: int


@dataclass(frozen=True)
class SendKV:
    """Program: exported session ``index``'s KV onto cell ``dest``'s KV layout."""

    cell: int
    index: int
    dest: int
    transfer: int
    uuid: int | None = None


@dataclass(frozen=True)
class ImportSession:
    """Program (when the part has KV): its KV from cell ``source``; then the session joins the cell's loop.
    ``token``: where the request's result goes (None: no request in flight)."""

    cell: int
    token: int | None
    part: SessionPart
    source: int
    transfer: int | None
    uuid: int | None = None


@dataclass(frozen=True)
class MoveSessions:
    """Move every session of ``cell`` to ``dest``, both on this follower; reply: their ``SessionPart``s."""

    cell: int
    token: int
    dest: int


@dataclass(frozen=True)
class DropSessions:
    """Cancel the cell's requests and forget its cached sessions; reply: how many."""

    cell: int
    token: int


@dataclass(frozen=True)
class Stats:
    cell: int
    token: int


@dataclass(frozen=True)
class CloseCell:
    cell: int
    token: int


@dataclass(frozen=True)
class Stop:
    """The follower stops serving commands (its ``serve`` returns) after answering."""

    token: int
    cell: int = -1


# -- replies (follower -> leader) -----------------------------------------------------------------------
@dataclass(frozen=True)
class Reply:
    token: int
    value: Any = None


@dataclass(frozen=True)
class Failure:
    """``token`` None: the follower itself failed (a command raised); the leader stops the run."""

    token: int | None
    error: Any = field(default=None)


@dataclass(frozen=True)
class StopRequest:
    """The follower got SIGINT/SIGTERM: the leader stops the run and saves a checkpoint."""

    reason: str
