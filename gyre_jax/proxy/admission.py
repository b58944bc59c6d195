"""Bounded admission of model calls: at most ``max_active`` in flight, at most ``max_queued`` waiting (FIFO).

A call beyond both is refused at once with 429 and ``Retry-After`` (the OpenAI and Anthropic SDKs retry a 429
after the time it names), so an overloaded proxy answers quickly instead of holding every connection and its
memory. A queued call whose client goes away leaves the queue. A slot is handed from a finishing call straight
to the oldest waiting one, so a newcomer never overtakes the queue. Everything runs on the server's event loop
(no locks); the counters may be read from any thread. See docs/proxy.md, "Admission and connection limits".
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

from gyre_jax.proxy.errors import ProxyError, rate_limited
from gyre_jax.proxy.waiting import IsDisconnected

QUEUED_POLL_S = 0.25  # how often a queued call checks whether its client went away


@dataclass
class AdmissionStats:
    """Counters over the proxy's life: calls ``admitted`` (at once or after queueing), ``queued`` (had to
    wait), ``refused`` (429), ``left_queue`` (client went away while queued); ``active`` / ``waiting`` now."""

    admitted: int = 0
    queued: int = 0
    refused: int = 0
    left_queue: int = 0
    active: int = 0
    waiting: int = 0


class Admission:
    """The slots of model calls: ``await acquire(is_disconnected)`` before running one, ``release()`` after.

    ``retry_after_s`` is what a refusal's ``Retry-After`` header says (whole seconds, >= 1); ``model`` is named in it.
    """

    def __init__(self, max_active: int, max_queued: int, retry_after_s: int = 1, model: str = "this model") -> None:
        if max_active < 1:
            raise ValueError(f"max_active_calls={max_active} must be >= 1")
        if max_queued < 0:
            raise ValueError(f"max_queued_calls={max_queued} must be >= 0")
        if retry_after_s < 1:
            raise ValueError(f"retry_after_s={retry_after_s} must be >= 1 (whole seconds)")
        self.max_active = max_active
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.model = model
        self._active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._stats = AdmissionStats()

    def stats(self) -> AdmissionStats:
        """A snapshot of the counters."""
        s = self._stats
        return AdmissionStats(s.admitted, s.queued, s.refused, s.left_queue, self._active, len(self._waiters))

    async def acquire(self, is_disconnected: IsDisconnected) -> bool:
        """Takes a slot, waiting in the queue if all are busy; False if the client went away while queued.

        Raises ProxyError 429 (with ``Retry-After``) at once if the queue is full too.
        """
        if self._active < self.max_active and not self._waiters:
            self._active += 1
            self._stats.admitted += 1
            return True
        if len(self._waiters) >= self.max_queued:
            self._stats.refused += 1
            raise self.refusal()
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(slot)
        self._stats.queued += 1
        try:
            while not slot.done():
                await asyncio.wait({slot}, timeout=QUEUED_POLL_S)
                if not slot.done() and await is_disconnected():
                    if slot.done():  # handed a slot meanwhile: pass it on
                        self.release()
                        self._stats.left_queue += 1
                    else:
                        self._leave(slot)
                    return False
        except BaseException:  # cancelled while queued (server shutting down): give back what was handed over
            if slot.done() and not slot.cancelled():
                self.release()
            else:
                self._leave(slot)
            raise
        self._stats.admitted += 1
        return True

    def release(self) -> None:
        """Frees a slot: handed to the oldest waiting call, if any."""
        while self._waiters:
            slot = self._waiters.popleft()
            if not slot.done():
                slot.set_result(None)  # the slot passes on; the active count stays
                return
        self._active -= 1

    def refusal(self) -> ProxyError:
        """The 429 of a call that found every slot and the queue full."""
        detail = (
            f"model calls in flight: Limit {self.max_active} active and {self.max_queued} waiting, all in use (raise "
            "config.proxy.max_active_calls / max_queued_calls for more)"
        )
        return rate_limited(self.model, detail, self.retry_after_s)

    def _leave(self, slot: asyncio.Future[None]) -> None:
        self._stats.left_queue += 1
        slot.cancel()
        try:
            self._waiters.remove(slot)
        except ValueError:
            pass
