"""Continuous batching for one cell: requests join free decode slots between generate steps and leave as
soon as they finish; long prompts are prefilled in chunks between decode steps; a session's next call
reuses the KV of its previous one; sessions can be exported to (and imported from) another cell's loop.

``ServingLoop`` implements ``GenerationBackend`` on top of a ``ServingEngine`` (``engine_api``: the dense
``engine.Engine`` or the paged ``paged.PagedEngine``, driven the same way) and knows nothing else about the
model or the KV layout. A daemon thread repeats:
  1. control (under the lock): apply a weight update, cancellations, export/import commands; admit
     queued requests into free slots (taking the session's cached KV, if any);
  2. prefill: at most ``prefill_chunk`` prompt tokens (one chunk each call) of the slots still
     prefilling, oldest first, while other slots decode (everything needed for one slot to start, when
     none decodes); whole prompts that fit one chunk go several in one program (all of them when none
     decodes: a burst starts in one iteration); a slot whose prompt is fully prefilled is inserted and
     starts decoding;
  3. dispatch one generate step for the decoding slots (over the smallest decode window and slot bucket
     that hold them; the engine's ``decode_steps`` steps in one program when every slot decodes and no
     request waits to join), then read the tokens of the step dispatched in the previous iteration: the
     device never waits for this thread. Each request's future resolves when it samples a stop id, completes a
     stop string, reaches its token budget or the context limit, or is cancelled. New requests take the
     lowest free slot, so a lightly loaded cell steps only its first few slots.

Rules:
  - Weight updates apply between two steps. ``on_update="continue"`` (default): requests in flight keep
    their KV and continue under the new weights. ``"recompute"``: their KV (prompt + tokens so far) is
    prefilled again under the new weights before they continue, so every later token is sampled from
    the new policy given the whole context. Either way every token reports the policy version that
    sampled it, and nothing already sampled changes.
  - Session prefix cache (``kv_pages`` pages of ``engine.page_size`` tokens of the engine's pool, LRU): when a request with a
    ``session_id`` ends, the KV of its prompt + completion is kept; the session's next request prefills
    only what follows the longest common prefix. By default (``reuse_stale_kv=False``) entries computed
    under an older policy version are dropped at a weight update, as SGLang and vLLM flush on updates.
  - Migration: see ``serving.session`` (``export_sessions``/``drain`` and ``import_session``).

The loop owns the thread, weight updates, cancellations, commands and migration; the requests waiting for
a slot are a ``request_queue.RequestQueue``, the slots a ``batch.DecodeBatch``, the session prefix cache's index a
``session_cache.SessionCache``, a request's bookkeeping a ``jobs.Job``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from gyre_jax.serving.batch import DecodeBatch
from gyre_jax.serving.engine_api import ServingEngine
from gyre_jax.serving.jobs import Job, LoopStats, check_prompt, check_resume, stop_checker
from gyre_jax.serving.kv_cache import KVPages
from gyre_jax.serving.prefix_cache import PrefixCache
from gyre_jax.serving.request_queue import RequestQueue
from gyre_jax.serving.session import SessionState
from gyre_jax.serving.session_cache import SessionCache
from gyre_jax.serving.stopping import Detokenize
from gyre_jax.serving.types import GenerationRequest

log = logging.getLogger(__name__)

ON_UPDATE = ("continue", "recompute")


def _check_options(
    engine: ServingEngine, prefill_chunk: int | None, kv_pages: int | None, on_update: str, reuse: bool, lookahead: int
) -> tuple[int, int]:
    """(prefill chunk, session cache pages) with their defaults; raises ValueError for options a loop cannot have."""
    if lookahead < 1:
        raise ValueError(f"lookahead={lookahead} must be >= 1 (decode steps dispatched before a step is read)")
    if on_update not in ON_UPDATE:
        raise ValueError(f"on_update={on_update!r} must be one of {ON_UPDATE}")
    if on_update == "recompute" and reuse:
        raise ValueError(
            "on_update='recompute' recomputes KV under new weights; it cannot be combined with reuse_stale_kv=True"
        )
    chunk = engine.max_prefill_length if prefill_chunk is None else prefill_chunk
    if not 1 <= chunk <= engine.max_prefill_length:
        raise ValueError(
            f"prefill_chunk={prefill_chunk} must be in [1, engine.max_prefill_length={engine.max_prefill_length}]"
        )
    if kv_pages is not None and kv_pages < 0:
        raise ValueError(f"kv_pages={kv_pages} must be >= 0 (0 disables the session prefix cache)")
    return chunk, engine.num_pages if kv_pages is None else kv_pages


class ServingLoop:
    """A cell's serving loop (thread-safe ``submit``/``cancel``/``update_params``/``export_sessions``/``import_session``)."""

    def __init__(
        self,
        engine: ServingEngine,
        params,
        policy_version: int = 0,
        name: str = "cell0",
        seed: int = 0,
        *,
        kv_pages: int | None = None,
        prefill_chunk: int | None = None,
        detokenize: Detokenize | None = None,
        on_update: str = "continue",
        reuse_stale_kv: bool = False,
        prefill_together: bool = True,
        lookahead: int = 2,
    ):
        """``kv_pages``: page budget of the session prefix cache (None: the engine's ``num_pages``, on the paged
        layout the pool its slots share; 0: no cache). ``prefill_chunk``: prompt tokens per prefill call and per step while others
        decode (None: ``engine.max_prefill_length``). ``detokenize``: ids -> text, for stop strings.
        ``prefill_together`` (False: one prompt per prefill call): several one-chunk prompts per program.
        ``lookahead``: decode steps dispatched after a step before its tokens are read (``DecodeBatch.step``)."""
        chunk, kv_pages = _check_options(engine, prefill_chunk, kv_pages, on_update, reuse_stale_kv, lookahead)
        self.engine, self.name = engine, name
        self.max_context = engine.max_seq_len
        self.prefill_chunk = chunk
        self.on_update = on_update
        self.reuse_stale_kv = reuse_stale_kv
        self._detokenize = detokenize
        self._pending_update: tuple | None = None
        self._requests = RequestQueue(seed, name)
        self._cancelled: set[str] = set()
        self._commands: collections.deque[tuple[Callable[[], object], concurrent.futures.Future]] = collections.deque()
        self._moved: dict[str, SessionState] = {}  # exported in-flight requests, for forwarding cancels
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.stats = LoopStats()
        common = dict(
            name=name, prefill_chunk=chunk, lock=self._cv, stats=self.stats, lookahead=lookahead,
            prefill_together=prefill_together,
        )  # fmt: skip
        self._cache = SessionCache(engine, kv_pages) if kv_pages > 0 else None
        self._batch = DecodeBatch(engine, params, policy_version, cache=self._cache, **common)
        # one entry per loop iteration that did work: (decode batch, context tokens of that batch, tokens
        # prefilled, seconds, wall-clock end); the controller turns these into the simulator's measured serving
        # costs and the run's step profile (gyre_jax/sim/step_profile.py)
        self.step_log: collections.deque[tuple[int, int, int, float, float]] = collections.deque(maxlen=50_000)
        self.error: BaseException | None = None
        self._refresh_cache_stats()

    # -- public API -------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._batch.version

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return None if self._cache is None else self._cache.index

    def start(self) -> ServingLoop:
        if self._thread is None:
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
            for slot in range(len(self._batch.slots)):
                self._batch.finish(slot, "cancelled", save=False)
            for job in self._requests.take(lambda job: True):
                job.resolve("cancelled", self.name)
            self._fail_commands(RuntimeError(f"serving loop {self.name} is stopped"))

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            check_prompt(request, self.max_context)
            job = Job(
                request=request,
                future=future,
                target=list(request.prompt_ids),
                seq=self._requests.next_seq(),
                stop=stop_checker(request, self._detokenize, self.name),
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
            self._requests.jobs.append(job)
            self._cv.notify_all()
        return future

    def cancel(self, request_id: str) -> None:
        with self._cv:
            moved = self._moved.get(request_id)
            if moved is None or moved.moved_to is None:
                self._cancelled.add(request_id)
                self._cv.notify_all()
                return
        moved.moved_to.cancel(request_id)  # the request now lives on another loop

    def update_params(self, params, version: int) -> None:
        """New weights (same shapes and shardings as before) for the next generate step."""
        with self._cv:
            self._pending_update = (params, version)
            self._cv.notify_all()

    def num_in_flight(self) -> int:
        with self._cv:
            return len(self._requests) + sum(s is not None for s in self._batch.slots)

    def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.num_in_flight():
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def export_sessions(
        self, session_ids: Iterable[str] | None = None, *, include_cached: bool = True
    ) -> list[SessionState]:
        """Removes sessions from this loop and returns them, KV included, for ``import_session`` elsewhere.

        ``session_ids=None`` takes everything: cached sessions, requests in slots and queued requests
        (with or without a session id). Otherwise only those sessions' cached entries and requests. Order:
        cached entries first, then requests in slots, then queued ones (import them in this order)."""
        selected = None if session_ids is None else set(session_ids)
        return self._on_loop(lambda: self._export(selected, include_cached))

    def drain(self) -> list[SessionState]:
        """Everything this loop holds, as migratable sessions; the loop stays up, empty (route nothing new
        to it first, e.g. ``Router.drain``)."""
        return self.export_sessions(None)

    def import_session(self, state: SessionState) -> None:
        """Takes over a session exported by another loop (its KV is copied onto this engine's mesh).

        A cached session becomes a prefix-cache entry here; a request in flight is queued ahead of new
        requests and continues where it stopped; its original future resolves from this loop."""
        self._on_loop(lambda: self._import(state))

    def import_sessions(self, states: Sequence[SessionState]) -> None:
        for state in states:
            self.import_session(state)

    # -- control (loop thread, under the lock) ----------------------------------------------------
    def _control(self) -> None:
        batch = self._batch
        if self._commands or (self._pending_update is not None and self.on_update == "recompute"):
            batch.flush()  # exports and recomputes need every sampled token accounted for
        if self._pending_update is not None:
            (params, version), self._pending_update = self._pending_update, None
            changed = batch.set_weights(params, version)
            if changed and self.on_update == "recompute":
                batch.recompute_in_flight()
            if changed and self._cache is not None and not self.reuse_stale_kv:
                self._cache.drop_stale(version)
        if self._cancelled:
            self._requests.cancel(self._cancelled, self.name)
            batch.cancel(self._cancelled)
            self._cancelled.clear()
        while self._commands:
            fn, fut = self._commands.popleft()
            try:
                fut.set_result(fn())
            except Exception as exc:  # a bad command fails its caller, never the loop
                fut.set_exception(exc)
        self._requests.admit(batch, self.reuse_stale_kv)
        self._refresh_cache_stats()

    def _on_loop(self, fn: Callable[[], object]):
        """Runs ``fn`` on the loop thread between two steps (or here, if the loop is not running)."""
        with self._cv:
            if self.error is not None:
                raise RuntimeError(f"serving loop {self.name} has failed: {self.error!r}")
            if self._thread is None or threading.current_thread() is self._thread:
                return fn()
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._commands.append((fn, fut))
            self._cv.notify_all()
        return fut.result()

    def _fail_commands(self, exc: BaseException) -> None:
        while self._commands:
            _, fut = self._commands.popleft()
            if not fut.done():
                fut.set_exception(exc)

    def _refresh_cache_stats(self) -> None:
        if self._cache is not None:
            self.stats.cache = self._cache.stats

    # -- migration (loop thread, under the lock) --------------------------------------------------
    def _export(self, selected: set[str] | None, include_cached: bool) -> list[SessionState]:
        def wanted(sid):
            return selected is None or (sid is not None and sid in selected)

        cached = self._cache.export(wanted, self.name) if include_cached and self._cache is not None else []
        running = [self._state_of(*moved) for moved in self._batch.export(wanted)]
        queued = [
            self._state_of(job, job.kv, job.target[: job.done] if job.kv is not None else [], job.key)
            for job in self._requests.take(lambda job: wanted(job.request.session_id))
        ]
        out = cached + running + queued
        self.stats.sessions_exported += len(out)
        self._refresh_cache_stats()
        return out

    def _state_of(self, job: Job, kv: KVPages | None, kv_tokens: list[int], key) -> SessionState:
        """``key``: [2] the job's next sampling key (None: not derived yet)."""
        version = self._batch.version if job.kv_version is None else job.kv_version
        key = None if key is None else np.asarray(key)
        state = SessionState.of_job(job, kv, kv_tokens, version, key, source=self.name)
        rid = job.request.request_id
        self._moved[rid] = state
        job.future.add_done_callback(lambda _: self._moved.pop(rid, None))
        return state

    def _import(self, state: SessionState) -> None:
        kv = None if state.kv is None or not state.kv_tokens else self.engine.to_mesh(state.kv)
        if kv is not None and len(state.kv_tokens) > kv.num_pages * self.engine.page_size:
            raise ValueError(
                f"session {state.session_id!r}: {len(state.kv_tokens)} kv_tokens but only {kv.num_pages} pages of KV"
            )
        if state.request is None:  # an idle session: keep its KV as a cache entry here
            if self._cache is not None and state.session_id is not None and kv is not None and state.kv_tokens:
                self._cache.put(state.session_id, state.kv_tokens, state.kv_version, kv)
            self.stats.sessions_imported += 1
            self._refresh_cache_stats()
            return
        request, future = state.request, state.future
        if future is None or future.done():
            return  # nobody waits for it any more (e.g. cancelled during the move)
        target = state.target(has_kv=kv is not None)
        try:
            stop = stop_checker(request, self._detokenize, self.name)
            check_resume(request, len(state.token_ids), self.max_context, self.name)
        except ValueError as exc:
            future.set_exception(exc)
            return
        key = None if state.key is None else np.asarray(state.key, np.uint32)
        self._requests.jobs.appendleft(state.to_job(target, self._requests.next_seq(), key, kv, stop))  # ahead of new
        state.moved_to = self
        self.stats.sessions_imported += 1

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    if self._stop:
                        break
                    self._control()
                    if not self._batch.has_work() and not self._batch.in_flight:
                        self._cv.wait(timeout=0.05)
                        continue
                    multi_step = not self._requests.jobs and not self._commands  # nobody waits to join
                t0 = time.perf_counter()
                prefilled = self.stats.prefill_tokens
                previous = self._batch.step(multi_step)
                dt = time.perf_counter() - t0
                self.stats.busy_s += dt
                if previous is not None or self.stats.prefill_tokens > prefilled:
                    jobs = previous.jobs.values() if previous is not None else ()
                    context = sum(len(j.request.prompt_ids) + len(j.tokens) for j in jobs)
                    n = previous.num_steps if previous is not None and self.stats.prefill_tokens == prefilled else 1
                    end = time.time()
                    new_tokens = self.stats.prefill_tokens - prefilled
                    for i in range(n):  # one entry per decode step: a multi-step program's time split evenly
                        self.step_log.append((len(jobs), context, new_tokens, dt / n, end - dt * (n - 1 - i) / n))
        except BaseException as exc:  # the loop must never die silently: fail every waiter with the cause
            log.exception("serving loop %s failed", self.name)
            with self._cv:
                self.error = exc
                failure = RuntimeError(f"serving loop {self.name} failed: {exc!r}")
                for job in self._batch.slots + self._requests.take(lambda job: True):
                    if job is not None and not job.future.done():
                        job.future.set_exception(failure)
                self._batch.slots[:] = [None] * len(self._batch.slots)
                self._fail_commands(failure)
