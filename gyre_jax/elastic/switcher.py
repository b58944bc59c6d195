"""Role switches: a cell leaving serving for training, or coming back, each in its own thread and timed.

Serving -> training: the router stops sending the cell new calls; its sessions (KV included, requests in
flight too) move to the serving cell that stays longest and their pins follow them; a non-core cell
loads the current weights onto its training layout; then its gate opens and its training thread claims
micro-steps. With no serving cell left to take them, its requests are cancelled and the router re-submits
them when a cell serves again. Training -> serving: the gate closes, the micro-step in progress finishes,
the cell gets the current weights on its serving layout and the router sends it calls again. A harness
never sees a switch. Each switch ends with ``on_switched(cell, role, seconds, moved, move_s)`` (the sessions
moved and how long moving them took) or, if it failed, ``on_error(message)``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import jax

from gyre_jax.elastic.state import Role
from gyre_jax.elastic.training import CellTraining, TrainingCell
from gyre_jax.faultpoints import kill_point
from gyre_jax.progress import Durations, Progress

log = logging.getLogger("gyre_jax.switcher")
SWITCH_PROGRESS_DELAY_S = 2.0  # a switch shorter than this shows no progress


class Switcher:
    """Starts and tracks switch threads (see the module docstring)."""

    def __init__(
        self,
        router,
        training: CellTraining,
        on_switched: Callable[[int, Role, float, int, float], None],
        on_error: Callable[[str], None],
    ):
        self.router = router
        self.training = training
        self.on_switched = on_switched
        self.on_error = on_error
        self._threads: list[threading.Thread] = []
        self._durations = Durations()  # the last switch of each kind: the next one's time left

    def start(self, index: int, to: Role, target: int | None) -> None:
        """Cell ``index`` switches to ``to``; leaving serving, its sessions go to cell ``target`` (None: none)."""
        cell = self.training.cells[index]
        if to is Role.SERVING:
            cell.gate.clear()
        dest = None if target is None else self.training.cells[target]
        th = threading.Thread(
            target=self._switch, args=(cell, to, dest), name=f"switch-{cell.handle.name}", daemon=True
        )
        th.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [th]

    def join(self, timeout_s: float = 60.0) -> None:
        for th in self._threads:
            th.join(timeout=timeout_s)
        self._threads.clear()

    def _switch(self, cell: TrainingCell, to: Role, dest: TrainingCell | None) -> None:
        t0 = time.perf_counter()
        kill_point("role_switch")
        desc, kind = f"{cell.handle.name}: switch to {to.value}", f"to {to.value}"
        # shown only when it lasts (a large model's weights and sessions moving), with the last one's duration
        progress = Progress(desc, delay_s=SWITCH_PROGRESS_DELAY_S, estimate_s=self._durations.get(kind))
        moved = (0, 0.0)
        try:
            if to is Role.TRAINING:
                moved = self._to_training(cell, dest, progress)
            else:
                self._to_serving(cell, progress)
        except BaseException as e:  # noqa: BLE001 - reported to the driver, which stops the run
            progress.close("failed")
            log.exception("%s: switch to %s failed", cell.handle.name, to.value)
            self.on_error(f"{cell.handle.name}: switch to {to.value} failed: {e!r}")
            return
        progress.close()
        self._durations.put(kind, time.perf_counter() - t0)
        self.on_switched(cell.handle.index, to, time.perf_counter() - t0, *moved)

    def _to_training(self, cell: TrainingCell, dest: TrainingCell | None, progress: Progress) -> tuple[int, float]:
        """-> (sessions moved, seconds moving them took)."""
        name = cell.handle.name
        self.router.drain(name, cancel_in_flight=dest is None)
        moved, move_s = [], 0.0
        if dest is not None:  # KV included, wherever either cell runs
            progress.note(f"moving sessions to {dest.handle.name}")
            t0 = time.perf_counter()
            moved = cell.handle.move_sessions_to(dest.handle)
            move_s = time.perf_counter() - t0
            for s in moved:
                if s.session_id is not None:
                    self.router.repin(s.session_id, dest.handle.name)
            if moved:
                log.info(
                    "%s -> %s: moved %d sessions (%d requests in flight) in %.3fs",
                    name,
                    dest.handle.name,
                    len(moved),
                    sum(s.in_flight for s in moved),
                    move_s,
                )
        progress.note("loading the weights")
        self.training.load(cell)
        jax.block_until_ready(cell.weights)  # the switch's time includes the weights' move
        cell.gate.set()
        return len(moved), move_s

    def _to_serving(self, cell: TrainingCell, progress: Progress) -> None:
        progress.note("finishing the micro-step in progress")
        with cell.lock:  # the micro-step in progress finishes first
            pass
        with self.training.lock:  # the optimizer step replaces (donates) the train state under this lock
            stale = cell.handle.policy_version != self.training.version
        if stale:
            progress.note("publishing the weights")
            self.training.publish([cell.handle])
        self.router.undrain(cell.handle.name)
