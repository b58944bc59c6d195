"""Training over cells: the one owner of the train state during RL, and the cells that compute its steps.

Cell 0 is the *core*: its worker is the ``Learner``'s and it holds the authoritative params and the only
optimizer state (``CellTraining.state``). Each optimizer step has a ``MicroStepQueue`` and an ordered
``GradAccumulator`` on the core. Every cell has a training thread that, while its gate is open (its role is
TRAINING), runs the learner's own claim loop (``rl.micro_step.run_micro_steps``) on the current step with
its weights: the core's params for the core, a snapshot on its own layout for the others (pulled through
its ``CellHandle``, so a cell on another process takes part the same way), and the reference policy's
params too when the loss has a KL term. When the step's queue is done the core applies AdamW once
(``Learner.finish_step``) and the new policy goes to every serving cell (``publish``). Weights stay fixed
within a step, and gradients are added in slot order, so the new params do not depend on which cells
computed which micro-steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gyre_jax.faultpoints import kill_point
from gyre_jax.model import lora
from gyre_jax.rl.accumulator import GradAccumulator
from gyre_jax.rl.learner import Learner, TrainState
from gyre_jax.rl.micro_step import micro_batch_flops, run_micro_steps
from gyre_jax.rl.microstep_queue import Claim, MicroStepQueue, QueueAborted
from gyre_jax.runtime.handle import CellHandle

log = logging.getLogger("gyre_jax.training")


@dataclass
class TrainingCell:
    """One cell's training side: the gate its thread waits on, and its weight snapshots."""

    handle: CellHandle
    gate: threading.Event = field(default_factory=threading.Event)  # set while the cell may claim micro-steps
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while the cell works on a step
    weights: Any = None  # the policy's weights on this cell (its worker's snapshot), for ``weights_version``
    weights_version: int = -1
    ref_weights: Any = None  # the reference policy's (KL), loaded once
    train_s: float = 0.0
    micro_steps: int = 0


class CellTraining:
    """The train state and the training cells (see the module docstring).

    ``ref_params``: the reference policy on the core's layout (None when the loss has no KL term).
    ``on_micro_step(cell, step, claim, flops, t_start, t_end)`` follows every completed micro-step;
    ``on_error(message)`` reports a failed micro-step (the driver stops the run)."""

    def __init__(
        self,
        learner: Learner,
        state: TrainState,
        handles: Sequence[CellHandle],
        *,
        ref_params: Any = None,
        kind: str = "rl",
        claim_timeout_s: float = 0.05,
        on_micro_step: Callable[..., None] | None = None,
        on_error: Callable[[str], None] | None = None,
    ):
        if learner.loss_cfg.kl_coef > 0 and ref_params is None:
            raise ValueError(
                f"the loss has a KL term (kl_coef={learner.loss_cfg.kl_coef}) but no reference policy was given: "
                "pass ref_params (the policy at the start of RL)"
            )
        self.learner = learner
        self.state = state
        self.ref_params = ref_params if learner.loss_cfg.kl_coef > 0 else None
        self.kind = kind
        self.claim_timeout_s = claim_timeout_s
        self.on_micro_step = on_micro_step
        self.on_error = on_error
        self.cells = [TrainingCell(h) for h in handles]
        self.lock = threading.Lock()  # ``state`` is read by snapshots and replaced by the optimizer step
        self._lora = lora.enabled(learner.model_cfg)
        self._published: tuple[Any, Any] | None = None  # (params, their publication): see ``_publication``
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self.step = -1
        self.queue: MicroStepQueue | None = None
        self.acc: GradAccumulator | None = None

    @property
    def version(self) -> int:
        """The policy version of the core's params: optimizer updates applied."""
        return int(self.state.step)

    # -- the step -----------------------------------------------------------------------------------------
    def new_step(self, step: int, slots: int) -> MicroStepQueue:
        """Step ``step``'s micro-step queue of ``slots`` slots (and its accumulator on the core)."""
        self.queue = MicroStepQueue(slots)
        self.acc = self.learner.new_accumulator(slots)
        self.step = step
        return self.queue

    def busy(self, index: int) -> bool:
        """Whether cell ``index`` is computing one of the current step's micro-steps."""
        return self.queue is not None and self.queue.working(self.cells[index].handle.worker.name)

    def optimizer_step(self) -> dict[str, Any]:
        """The core's optimizer step once the current queue is done; the step's learner metrics."""
        if not self.queue.filled():
            log.warning(
                "step %d: nothing to train on (every execution excluded, stale or in a skipped group); "
                "no optimizer step",
                self.step,
            )
            return {"optimizer_skipped": 1}
        kill_point("optimizer_step")
        with self.lock:
            self.state, metrics = self.learner.finish_step(
                self.state, self.queue, self.acc, self.kind, t0=time.perf_counter()
            )
        kill_point("optimizer_step")
        return metrics

    def publish(self, handles: Sequence[CellHandle]) -> None:
        """The current policy to ``handles`` (serving cells), device to device onto their serving layouts."""
        with self.lock:
            for h in handles:
                h.set_weights(self._publication(), self.version)

    def _publication(self) -> Any:
        """The current params as every receiver of this version takes them (call under ``lock``): a LoRA adapter
        packed once (``lora.publication``: each serving cell and satellite then moves and unpacks one array), not
        flattened and packed again per receiver; the params themselves otherwise."""
        params = self.state.params
        if self._published is None or self._published[0] is not params:
            self._published = (params, lora.publication(params) if self._lora else params)
        return self._published[1]

    def load(self, cell: TrainingCell) -> None:
        """The cell's weights for the current policy (a satellite's snapshot; the core uses its own params)."""
        if cell.handle.index == 0:
            return
        with self.lock:
            if cell.weights_version != self.version:
                cell.weights = cell.handle.worker.snapshot(self._publication())
                cell.weights_version = self.version
            if self.ref_params is not None and cell.ref_weights is None:
                cell.ref_weights = cell.handle.worker.snapshot(self.ref_params, slot="ref")

    def _weights(self, cell: TrainingCell) -> tuple[Any, Any]:
        if cell.handle.index == 0:
            return self.state.params, self.ref_params
        self.load(cell)
        return cell.weights, cell.ref_weights

    # -- the cells' threads -------------------------------------------------------------------------------
    def start(self) -> None:
        self._closing.clear()
        for cell in self.cells:
            th = threading.Thread(target=self._train, args=(cell,), name=f"train-{cell.handle.name}", daemon=True)
            th.start()
            self._threads.append(th)

    def stop(self) -> None:
        """Closes every gate and joins the threads (each finishes its micro-step in progress first)."""
        self._closing.set()
        for cell in self.cells:
            cell.gate.clear()
        if self.queue is not None:
            self.queue.abort("the run segment ended")
        for th in self._threads:
            th.join(timeout=60)
        self._threads.clear()

    def _train(self, cell: TrainingCell) -> None:
        """The cell's thread: the claim loop on the current step while the gate is open."""
        while not self._closing.is_set():
            if not cell.gate.wait(timeout=0.1):
                continue
            with cell.lock:
                queue, acc, step = self.queue, self.acc, self.step
                if not cell.gate.is_set() or queue is None:
                    continue
                try:
                    weights, ref = self._weights(cell)
                    done = run_micro_steps(
                        cell.handle.worker,
                        weights,
                        ref,
                        queue,
                        acc,
                        self.kind,
                        timeout=self.claim_timeout_s,
                        active=lambda q=queue: cell.gate.is_set() and self.queue is q,
                        on_done=lambda claim, t0, t1, s=step: self._done(cell, s, claim, t0, t1),
                    )
                except QueueAborted:
                    continue
                except BaseException as e:  # noqa: BLE001 - reported to the driver, which stops the run
                    log.exception("%s: a micro-step of step %d failed", cell.handle.name, step)
                    if self.on_error is not None:
                        self.on_error(f"{cell.handle.name}: a micro-step of step {step} failed: {e!r}")
                    return
            if done == 0 and queue.done:  # the step is done: wait for the next one
                time.sleep(self.claim_timeout_s)

    def _done(self, cell: TrainingCell, step: int, claim: Claim, t_start: float, t_end: float) -> None:
        cell.micro_steps += 1
        cell.train_s += t_end - t_start
        if self.on_micro_step is not None:
            flops = micro_batch_flops(self.learner.model_cfg, claim.batch)
            self.on_micro_step(cell.handle.index, step, claim.index, flops, t_start, t_end)
