"""The micro-step queue of one optimizer step: producers put packed micro-batches as they become ready,
training cells (the core and any satellites) claim them, compute gradients and complete them.

A step has a fixed number of slots (``num_micro_steps``). A slot is filled by ``put`` (in arrival order,
or at an explicit index when the producer knows a canonical order), claimed by one worker at a time,
and completed once its gradients reached the accumulator. ``close`` says no more micro-batches will
come (unfilled slots stay empty). A worker that fails or leaves (a cell switching back to serving)
``release``-s its claim and the slot is handed out again. The step is done when every filled slot is
completed and the queue is full or closed. Claims are handed out lowest index first.

Thread-safe; plain Python (no JAX), so the elastic controller and the simulator can drive it alike.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

PENDING, READY, CLAIMED, DONE = "pending", "ready", "claimed", "done"


class QueueAborted(RuntimeError):
    """The step was aborted (``MicroStepQueue.abort``); nobody should claim or complete anything more."""


@dataclass(frozen=True)
class Claim:
    """One claimed micro-step: slot ``index`` of the step, its micro-batch, the claiming worker."""

    index: int
    batch: Any
    worker: str
    attempt: int  # 0 for the first claim of this slot, +1 per release


class MicroStepQueue:
    """Slots 0..num_micro_steps-1 of one optimizer step (see the module docstring for the life cycle)."""

    def __init__(self, num_micro_steps: int):
        if num_micro_steps < 1:
            raise ValueError(f"num_micro_steps={num_micro_steps} must be >= 1")
        self.num_micro_steps = num_micro_steps
        self._cond = threading.Condition()
        self._state = [PENDING] * num_micro_steps
        self._batch: list[Any] = [None] * num_micro_steps
        self._attempts = [0] * num_micro_steps
        self._claimer: list[str | None] = [None] * num_micro_steps  # the worker holding each claimed slot
        self._next_put = 0
        self._closed = False
        self._error: BaseException | None = None
        self.completed_by: dict[str, int] = {}
        self.released = 0

    # -- producer side ----------------------------------------------------------------------------
    def put(self, batch: Any, index: int | None = None) -> int:
        """Fills the next free slot (or slot ``index``) with ``batch``; returns the slot index."""
        with self._cond:
            self._raise_if_aborted()
            if self._closed:
                raise ValueError("put after close: this step's queue takes no more micro-batches")
            if index is None:
                while self._next_put < self.num_micro_steps and self._state[self._next_put] != PENDING:
                    self._next_put += 1
                index = self._next_put
                if index >= self.num_micro_steps:
                    raise ValueError(
                        f"the step's {self.num_micro_steps} micro-step slots are all filled; the producer "
                        "made more micro-batches than rl.micro_steps_per_step (use larger micro-batches "
                        "or more micro-steps per step)"
                    )
            elif not 0 <= index < self.num_micro_steps:
                raise ValueError(f"slot index {index} is outside [0, {self.num_micro_steps})")
            elif self._state[index] != PENDING:
                raise ValueError(f"slot {index} is already filled")
            self._batch[index] = batch
            self._state[index] = READY
            self._cond.notify_all()
            return index

    def close(self) -> None:
        """No more micro-batches for this step: slots still unfilled stay empty."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def abort(self, error: BaseException | str) -> None:
        """Fails the step: every waiting and future ``claim`` raises ``QueueAborted``."""
        with self._cond:
            if self._error is None:
                self._error = error if isinstance(error, BaseException) else QueueAborted(str(error))
            self._cond.notify_all()

    # -- worker side ------------------------------------------------------------------------------
    def claim(self, worker: str, timeout: float | None = None) -> Claim | None:
        """The lowest-index ready slot, claimed for ``worker``; blocks while none is ready but the step is not
        done. Returns None once the step is done. Raises ``TimeoutError`` after ``timeout`` seconds without
        work, ``QueueAborted`` if the step was aborted."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_if_aborted()
                for i, state in enumerate(self._state):
                    if state == READY:
                        self._state[i] = CLAIMED
                        self._claimer[i] = worker
                        return Claim(index=i, batch=self._batch[i], worker=worker, attempt=self._attempts[i])
                if self._done_locked():
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"worker {worker!r} waited {timeout}s for a micro-batch: {self._describe_locked()}"
                    )
                self._cond.wait(remaining)

    def complete(self, claim: Claim) -> None:
        """The claim's gradients are in the accumulator."""
        with self._cond:
            self._check_claimed(claim)
            self._state[claim.index] = DONE
            self._claimer[claim.index] = None
            self._batch[claim.index] = None  # the host arrays can go
            self.completed_by[claim.worker] = self.completed_by.get(claim.worker, 0) + 1
            self._cond.notify_all()

    def release(self, claim: Claim) -> None:
        """Gives a claimed slot back (its worker failed or left); another worker will take it."""
        with self._cond:
            self._check_claimed(claim)
            self._state[claim.index] = READY
            self._claimer[claim.index] = None
            self._attempts[claim.index] += 1
            self.released += 1
            self._cond.notify_all()

    # -- status -----------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the step is done (True) or ``timeout`` passes (False). Raises if aborted."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._done_locked():
                self._raise_if_aborted()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    @property
    def done(self) -> bool:
        with self._cond:
            return self._done_locked()

    def filled(self) -> list[int]:
        """Indices of the slots that hold (or held) a micro-batch."""
        with self._cond:
            return [i for i, s in enumerate(self._state) if s != PENDING]

    def empty_slots(self) -> list[int]:
        """Slots that will never be filled (only meaningful once closed)."""
        with self._cond:
            return [i for i, s in enumerate(self._state) if s == PENDING] if self._closed else []

    def working(self, worker: str) -> bool:
        """Whether ``worker`` holds a claim now (is computing one of this step's micro-steps)."""
        with self._cond:
            return worker in self._claimer

    def counts(self) -> dict[str, int]:
        with self._cond:
            return {s: self._state.count(s) for s in (PENDING, READY, CLAIMED, DONE)}

    # -- internals --------------------------------------------------------------------------------
    def _done_locked(self) -> bool:
        if any(s in (READY, CLAIMED) for s in self._state):
            return False
        return self._closed or all(s == DONE for s in self._state)

    def _raise_if_aborted(self) -> None:
        if self._error is not None:
            raise QueueAborted(f"the step was aborted: {self._error!r}") from self._error

    def _check_claimed(self, claim: Claim) -> None:
        self._raise_if_aborted()
        if self._state[claim.index] != CLAIMED or self._attempts[claim.index] != claim.attempt:
            raise ValueError(
                f"slot {claim.index} is not claimed by this claim (state {self._state[claim.index]}, "
                f"attempt {self._attempts[claim.index]} vs {claim.attempt})"
            )

    def _describe_locked(self) -> str:
        counts = {s: self._state.count(s) for s in (PENDING, READY, CLAIMED, DONE)}
        return f"slots {counts}, closed={self._closed}"
