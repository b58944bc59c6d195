"""Continuous batching for one cell: requests join free decode slots between generate steps and leave
as soon as they finish.

``ServingLoop`` implements ``GenerationBackend`` on top of an ``Engine``: a daemon thread admits queued
requests (prefill + insert), runs one generate step for all slots, and resolves each request's future
when it samples a stop id, reaches its token budget or the context limit, or is cancelled.

Weight updates (``update_params``) are applied between two generate steps; requests in flight keep
going under the new weights, and every token reports the policy version that produced it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
import zlib
from dataclasses import dataclass, field

import jax
import numpy as np

from gyre_jax.serving import sampling
from gyre_jax.serving.engine import Engine
from gyre_jax.serving.types import ContextTooLongError, GenerationRequest, GenerationResult

log = logging.getLogger(__name__)


@dataclass
class _Active:
    request: GenerationRequest
    future: concurrent.futures.Future
    budget: int  # tokens this request may still generate
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


@dataclass
class LoopStats:
    requests_done: int = 0
    tokens_generated: int = 0
    prefill_tokens: int = 0
    generate_steps: int = 0
    busy_s: float = 0.0


class ServingLoop:
    """A cell's serving loop (thread-safe ``submit``/``cancel``/``update_params``)."""

    def __init__(self, engine: Engine, params, policy_version: int = 0, name: str = "cell0", seed: int = 0):
        self.engine = engine
        self.name = name
        self.max_context = engine.max_seq_len
        self._params = params
        self._version = policy_version
        self._pending_update: tuple | None = None
        self._seed = seed
        self._seed_counter = 0
        self._queue: collections.deque[tuple[GenerationRequest, concurrent.futures.Future]] = collections.deque()
        self._cancelled: set[str] = set()
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._slots: list[_Active | None] = [None] * engine.max_concurrent_decodes
        self._state = None
        self.stats = LoopStats()
        self.error: BaseException | None = None

    # -- public API -------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._version

    def start(self) -> "ServingLoop":
        if self._thread is None:
            self._state = self.engine.init_decode_state()
            self._thread = threading.Thread(target=self._run, name=f"serving-{self.name}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the thread; requests still queued or running resolve as "cancelled"; later submits fail."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._cv:
            for slot in range(len(self._slots)):
                self._finish(slot, "cancelled")
            while self._queue:
                req, fut = self._queue.popleft()
                if not fut.done():
                    fut.set_result(GenerationResult(req.request_id, [], [], [], "cancelled", len(req.prompt_ids), self.name))

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        n = len(request.prompt_ids)
        try:
            request.sampling.validate()
            if n == 0:
                raise ValueError("empty prompt: at least one token is needed")
            if n + 1 > self.max_context or n > self.engine.max_prefill_length:
                raise ContextTooLongError(
                    f"prompt of {n} tokens does not fit this cell (context {self.max_context} tokens, "
                    f"prefill limit {self.engine.max_prefill_length}); shorten the conversation"
                )
        except ValueError as exc:
            future.set_exception(exc)
            return future
        with self._cv:
            if self._stop:
                future.set_exception(RuntimeError(f"serving loop {self.name} is stopped; submit to a running cell"))
                return future
            if self.error is not None:
                future.set_exception(RuntimeError(f"serving loop {self.name} has failed: {self.error!r}"))
                return future
            self._queue.append((request, future))
            self._cv.notify_all()
        return future

    def cancel(self, request_id: str) -> None:
        with self._cv:
            self._cancelled.add(request_id)
            self._cv.notify_all()

    def update_params(self, params, version: int) -> None:
        """New weights (same shapes and shardings as before) for the next generate step."""
        with self._cv:
            self._pending_update = (params, version)
            self._cv.notify_all()

    def num_in_flight(self) -> int:
        with self._cv:
            return len(self._queue) + sum(s is not None for s in self._slots)

    def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.num_in_flight():
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    # -- loop -------------------------------------------------------------------------------------
    def _finish(self, slot: int, reason: str) -> None:
        active = self._slots[slot]
        self._slots[slot] = None
        if active is None:
            return
        self.stats.requests_done += 1
        result = GenerationResult(
            request_id=active.request.request_id, token_ids=active.tokens, logprobs=active.logprobs,
            policy_versions=active.versions, finish_reason=reason, prompt_len=len(active.request.prompt_ids),
            cell=self.name,
        )
        if not active.future.done():
            active.future.set_result(result)

    def _accept(self, slot: int, token: int, logprob: float) -> None:
        active = self._slots[slot]
        assert active is not None
        active.tokens.append(int(token))
        active.logprobs.append(float(logprob))
        active.versions.append(self._version)
        active.budget -= 1
        if int(token) in active.request.sampling.stop_ids:
            self._finish(slot, "stop")
        elif active.budget <= 0:
            self._finish(slot, "length")

    def _handle_control(self) -> list[tuple[GenerationRequest, concurrent.futures.Future]]:
        """Under the lock: applies weight updates and cancellations, takes admissible requests."""
        if self._pending_update is not None:
            self._params, self._version = self._pending_update
            self._pending_update = None
        if self._cancelled:
            kept = collections.deque()
            for req, fut in self._queue:
                if req.request_id in self._cancelled:
                    fut.set_result(GenerationResult(req.request_id, [], [], [], "cancelled", len(req.prompt_ids), self.name))
                else:
                    kept.append((req, fut))
            self._queue = kept
            for slot, active in enumerate(self._slots):
                if active is not None and active.request.request_id in self._cancelled:
                    self._finish(slot, "cancelled")
            self._cancelled.clear()
        admitted = []
        free = [i for i, s in enumerate(self._slots) if s is None]
        while free and self._queue:
            req, fut = self._queue.popleft()
            slot = free.pop(0)
            self._slots[slot] = _Active(req, fut, budget=0)  # reserve; filled in outside the lock
            admitted.append((slot, req, fut))
        return admitted

    def _key_for(self, request: GenerationRequest):
        seed = request.sampling.seed
        if seed is None:
            self._seed_counter += 1
            seed = zlib.crc32(f"{self._seed}/{self.name}/{self._seed_counter}".encode())
        return sampling.key_for_seed(seed)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    if self._stop:
                        break
                    admitted = self._handle_control()
                    idle = not admitted and all(s is None for s in self._slots)
                    if idle:
                        self._cv.wait(timeout=0.05)
                        continue
                t0 = time.perf_counter()
                for slot, req, fut in admitted:
                    sp = req.sampling
                    try:
                        prefix = self.engine.prefill(params=self._params, tokens=req.prompt_ids, sampling_params=sp,
                                                     key=self._key_for(req))
                    except ValueError as exc:  # e.g. ContextTooLongError: this request fails, the loop serves on
                        with self._cv:
                            self._slots[slot] = None
                        fut.set_exception(exc)
                        continue
                    self._state = self.engine.insert(prefix, self._state, slot, sp)
                    self.stats.prefill_tokens += len(req.prompt_ids)
                    budget = min(sp.max_tokens, self.max_context - len(req.prompt_ids))
                    with self._cv:
                        self._slots[slot] = _Active(req, fut, budget=budget)
                        token, logprob = jax.device_get((prefix.token, prefix.logprob))
                        self._accept(slot, int(token), float(logprob))
                with self._cv:
                    any_active = any(s is not None for s in self._slots)
                if any_active:
                    self._state, result = self.engine.generate(self._params, self._state)
                    self.stats.generate_steps += 1
                    with self._cv:
                        for slot, active in enumerate(self._slots):
                            if active is not None:
                                self.stats.tokens_generated += 1
                                self._accept(slot, int(result.tokens[slot]), float(result.logprobs[slot]))
                self.stats.busy_s += time.perf_counter() - t0
        except BaseException as exc:  # the loop must never die silently: fail every waiter with the cause
            log.exception("serving loop %s failed", self.name)
            with self._cv:
                self.error = exc
                for slot, active in enumerate(self._slots):
                    if active is not None and not active.future.done():
                        active.future.set_exception(RuntimeError(f"serving loop {self.name} failed: {exc!r}"))
                    self._slots[slot] = None
                while self._queue:
                    _, fut = self._queue.popleft()
                    fut.set_exception(RuntimeError(f"serving loop {self.name} failed: {exc!r}"))
