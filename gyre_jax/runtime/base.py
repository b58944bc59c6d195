"""``CellHandleBase``: what both ``CellHandle`` implementations (``LocalCell``, ``RemoteCell``) share."""

from __future__ import annotations

from gyre_jax.runtime.cells import Cell, CellLayout
from gyre_jax.runtime.handle import CellHandle, MovedSession


class CellHandleBase:
    """What every ``CellHandle`` implementation shares: the cell it stands for, its layout, its name and index,
    and that its sessions move by ``runtime.sessions.move_sessions``."""

    cell: Cell
    layout: CellLayout

    @property
    def name(self) -> str:
        return self.cell.name

    @property
    def index(self) -> int:
        return self.cell.index

    def move_sessions_to(self, target: CellHandle) -> list[MovedSession]:
        from gyre_jax.runtime.sessions import move_sessions  # it imports both implementations

        return move_sessions(self, target)
