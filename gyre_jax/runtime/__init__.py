"""Where things run: processes, cells, and the one seam the scheduler sees (``CellHandle``).

- ``process``: start-up (``initialize``: platform, devices, ``jax.distributed``), the control plane
  (``broadcast_decision``, ``sync``, ``abort``) and fail-fast (``watchdog``).
- ``cells``: ``make_train_mesh``, ``make_cells`` (equal, host-aligned submeshes), ``CellLayout``.
- ``transfer``: ``transfer`` (every move of arrays between cells, in one process or across processes) and
  ``publish_to_cells``; ``p2p``: cross-process moves point to point (``jax.experimental.transfer``).
- ``lockstep``: a cell over several processes runs every device call on all of them, driven by its first.
- ``handle``: the ``CellHandle`` protocol; ``local.LocalCell`` runs a cell in this process,
  ``remote.RemoteCell`` drives a cell on a follower process (typed ``commands`` on TCP ``channel``s, an ordered
  ``remote.TransferLog``), and ``host.CellHost`` is the follower's side; ``sessions`` moves sessions
  between any two handles.

Nothing above this package asks where a cell lives.
"""

from gyre_jax.runtime.cells import Cell, CellLayout, make_cells, make_train_mesh
from gyre_jax.runtime.handle import CellHandle, CellStats, MovedSession
from gyre_jax.runtime.process import (
    DistributedError,
    ProcessInfo,
    abort,
    add_failure_hook,
    broadcast_decision,
    initialize,
    is_coordinator,
    runtime,
    shutdown,
    sync,
)
from gyre_jax.runtime.transfer import publish_to_cells, transfer
from gyre_jax.runtime.watchdog import FAILED_EXIT_CODE, PEER_LOST_EXIT_CODE

__all__ = [
    "FAILED_EXIT_CODE",
    "PEER_LOST_EXIT_CODE",
    "Cell",
    "CellHandle",
    "CellLayout",
    "CellStats",
    "DistributedError",
    "MovedSession",
    "ProcessInfo",
    "abort",
    "add_failure_hook",
    "broadcast_decision",
    "initialize",
    "is_coordinator",
    "make_cells",
    "make_train_mesh",
    "publish_to_cells",
    "runtime",
    "shutdown",
    "sync",
    "transfer",
]
