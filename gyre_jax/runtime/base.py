"""``CellHandleBase``: what both ``CellHandle`` implementations (``LocalCell``, ``RemoteCell``) share."""

from __future__ import annotations

from gyre_jax.runtime.cells import Cell, CellLayout
from gyre_jax.runtime.handle import CellHandle, MovedSession


class CellHandleBase:
    """What every ``CellHandle`` implementation shares: the cell it stands for, its layout, its name and index, and
    how its sessions move.

    A session move is dispatched on both ends, with no type test and no import of the other implementation:
    ``source.move_sessions_to(target)`` calls ``target.sessions_from_local(source)`` (``LocalCell``) or
    ``target.sessions_from_remote(source)`` (``RemoteCell``), and each of those runs the one function of
    ``runtime.sessions`` for that pair of kinds."""

    cell: Cell
    layout: CellLayout

    @property
    def name(self) -> str:
        return self.cell.name

    @property
    def index(self) -> int:
        return self.cell.index

    def move_sessions_to(self, target: CellHandle) -> list[MovedSession]:
        raise NotImplementedError

    def sessions_from_local(self, source) -> list[MovedSession]:
        """Takes every session of ``source`` (a ``LocalCell``), KV included."""
        raise NotImplementedError

    def sessions_from_remote(self, source) -> list[MovedSession]:
        """Takes every session of ``source`` (a ``RemoteCell``), KV included."""
        raise NotImplementedError
