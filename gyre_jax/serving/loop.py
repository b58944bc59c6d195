"""Continuous batching for one cell: requests join free decode slots between generate steps and leave as
soon as they finish; long prompts are prefilled in chunks between decode steps; a session's next call
reuses the KV of its previous one; sessions can be exported to (and imported from) another cell's loop.

``ServingLoop`` implements ``GenerationBackend`` on top of an ``Engine`` and knows nothing else about the
model. A daemon thread repeats:
  1. control (under the lock): apply a weight update, cancellations, export/import commands; admit
     queued requests into free slots (taking the session's cached KV, if any);
  2. prefill: at most ``prefill_chunk`` prompt tokens (one chunk each call) of the slots still
     prefilling, oldest first, while other slots decode (everything needed for one slot to start, when
     none decodes); a slot whose prompt is fully prefilled is inserted and starts decoding;
  3. dispatch one generate step for the decoding slots (over the smallest decode window and slot bucket
     that hold them), then read the tokens of the step dispatched in the previous iteration: the device
     never waits for this thread. Each request's future resolves when it samples a stop id, completes a
     stop string, reaches its token budget or the context limit, or is cancelled. New requests take the
     lowest free slot, so a lightly loaded cell steps only its first few slots.

Rules:
  - Weight updates apply between two steps. ``on_update="continue"`` (default): requests in flight keep
    their KV and continue under the new weights. ``"recompute"``: their KV (prompt + tokens so far) is
    prefilled again under the new weights before they continue, so every later token is sampled from
    the new policy given the whole context. Either way every token reports the policy version that
    sampled it, and nothing already sampled changes.
  - Session prefix cache (``kv_pages`` pages of ``engine.page_size`` tokens, LRU): when a request with a
    ``session_id`` ends, the KV of its prompt + completion is kept; the session's next request prefills
    only what follows the longest common prefix. By default (``reuse_stale_kv=False``) entries computed
    under an older policy version are dropped at a weight update, as SGLang and vLLM flush on updates.
  - Migration: see ``serving.session`` (``export_sessions``/``drain`` and ``import_session``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from gyre_jax.serving import sampling
from gyre_jax.serving.engine import Engine, KVPages, Prefix, ResultTokens
from gyre_jax.serving.prefix_cache import PrefixCache, PrefixCacheStats
from gyre_jax.serving.session import SessionState
from gyre_jax.serving.stopping import Detokenize, StopStrings
from gyre_jax.serving.types import ContextTooLongError, GenerationRequest, GenerationResult

log = logging.getLogger(__name__)

ON_UPDATE = ("continue", "recompute")


@dataclass
class _Job:
    """A request on this loop: queued, prefilling in a slot, or decoding in a slot."""

    request: GenerationRequest
    future: concurrent.futures.Future
    target: list[int]  # ids whose KV must be cached before decoding: the prompt (+ generated[:-1] when resuming)
    seq: int  # admission order (prefill is first come, first served)
    key: jax.Array | None = None  # [2] uint32: key for the next sample (None: derived at admission)
    done: int = 0  # leading ids of ``target`` whose KV is in ``prefix`` (or in ``kv``)
    prefix: Prefix | None = None
    kv: KVPages | None = None  # imported KV, turned into ``prefix`` at admission
    kv_version: int | None = None  # oldest policy version in the KV
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    budget: int = 0  # tokens this request may still generate (set when it starts decoding)
    cached_tokens: int = 0
    decoding: bool = False
    stop: StopStrings | None = None

    @property
    def resuming(self) -> bool:
        """The next token was sampled already (a migrated or recomputed request): insert it, sample nothing."""
        return bool(self.tokens)


@dataclass
class _Step:
    """A generate step in flight: its (device) result, the jobs it stepped by slot, the policy version it ran."""

    result: ResultTokens
    jobs: dict[int, _Job]
    version: int


@dataclass
class LoopStats:
    requests_done: int = 0
    tokens_generated: int = 0  # tokens sampled by generate steps (the first token of a request comes from prefill)
    prefill_tokens: int = 0  # prompt tokens actually prefilled (cached and imported KV excluded)
    prefill_calls: int = 0
    generate_steps: int = 0
    busy_s: float = 0.0
    sessions_exported: int = 0
    sessions_imported: int = 0
    cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)


class ServingLoop:
    """A cell's serving loop (thread-safe ``submit``/``cancel``/``update_params``/``export_sessions``/``import_session``)."""

    def __init__(
        self,
        engine: Engine,
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
    ):
        """``kv_pages``: page budget of the session prefix cache (None: as many tokens as the decode slots
        hold; 0: no cache). ``prefill_chunk``: prompt tokens per prefill call and per step while others
        decode (None: ``engine.max_prefill_length``). ``detokenize``: ids -> text, needed for stop strings."""
        if on_update not in ON_UPDATE:
            raise ValueError(f"on_update={on_update!r} must be one of {ON_UPDATE}")
        if on_update == "recompute" and reuse_stale_kv:
            raise ValueError(
                "on_update='recompute' recomputes KV under new weights; it cannot be combined with reuse_stale_kv=True"
            )
        chunk = engine.max_prefill_length if prefill_chunk is None else prefill_chunk
        if not 1 <= chunk <= engine.max_prefill_length:
            raise ValueError(
                f"prefill_chunk={prefill_chunk} must be in [1, engine.max_prefill_length={engine.max_prefill_length}]"
            )
        if kv_pages is None:
            kv_pages = engine.max_concurrent_decodes * engine.pages_per_seq
        if kv_pages < 0:
            raise ValueError(f"kv_pages={kv_pages} must be >= 0 (0 disables the session prefix cache)")
        self.engine = engine
        self.name = name
        self.max_context = engine.max_seq_len
        self.prefill_chunk = chunk
        self.on_update = on_update
        self.reuse_stale_kv = reuse_stale_kv
        self._detokenize = detokenize
        self._params = params
        self._version = policy_version
        self._pending_update: tuple | None = None
        self._seed = seed
        self._seed_counter = 0
        self._seq = itertools.count()
        self._queue: collections.deque[_Job] = collections.deque()
        self._cancelled: set[str] = set()
        self._commands: collections.deque[tuple[Callable[[], object], concurrent.futures.Future]] = collections.deque()
        self._moved: dict[str, SessionState] = {}  # exported in-flight requests, for forwarding cancels
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._slots: list[_Job | None] = [None] * engine.max_concurrent_decodes
        self._state = None
        self._pending: _Step | None = None  # the generate step in flight (dispatched, tokens not read yet)
        self._cache = PrefixCache(kv_pages, engine.page_size) if kv_pages > 0 else None
        self._pool: KVPages | None = None
        self.stats = LoopStats()
        # one entry per loop iteration that did work: (decode batch, context tokens of that batch, tokens
        # prefilled, seconds); the controller turns these into the simulator's measured serving costs
        self.step_log: collections.deque[tuple[int, int, int, float]] = collections.deque(maxlen=50_000)
        self.error: BaseException | None = None
        self._refresh_cache_stats()

    # -- public API -------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self._cache

    def start(self) -> ServingLoop:
        if self._thread is None:
            self._ensure_state()
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
                self._finish(slot, "cancelled", save=False)
            while self._queue:
                job = self._queue.popleft()
                self._resolve(job, "cancelled")
            self._fail_commands(RuntimeError(f"serving loop {self.name} is stopped"))

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            job = self._new_job(request, future)
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
            self._queue.append(job)
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
            return len(self._queue) + sum(s is not None for s in self._slots)

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

    # -- request bookkeeping ----------------------------------------------------------------------
    def _new_job(self, request: GenerationRequest, future: concurrent.futures.Future) -> _Job:
        """Validates a new request (raises ValueError with what to do) and wraps it."""
        sp = request.sampling
        sp.validate()
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError("empty prompt: at least one token is needed")
        if n + 1 > self.max_context:
            raise ContextTooLongError(
                f"prompt of {n} tokens does not fit this cell (context {self.max_context} tokens, at most "
                f"{self.max_context - 1} prompt tokens); shorten the conversation"
            )
        return _Job(
            request=request,
            future=future,
            target=list(request.prompt_ids),
            seq=next(self._seq),
            stop=self._stop_checker(request),
        )

    def _stop_checker(self, request: GenerationRequest) -> StopStrings | None:
        strings = request.sampling.stop_strings
        if not strings:
            return None
        if self._detokenize is None:
            raise ValueError(
                f"stop_strings={strings!r} need detokenization, and serving loop {self.name} has no "
                "detokenize function; build it with ServingLoop(..., detokenize=tokenizer.decode) or use stop_ids"
            )
        return StopStrings(strings, self._detokenize)

    def _result(self, job: _Job, reason: str, stop_reason=None) -> GenerationResult:
        return GenerationResult(
            request_id=job.request.request_id,
            token_ids=job.tokens,
            logprobs=job.logprobs,
            policy_versions=job.versions,
            finish_reason=reason,
            prompt_len=len(job.request.prompt_ids),
            cell=self.name,
            cached_tokens=job.cached_tokens,
            stop_reason=stop_reason,
        )

    def _resolve(self, job: _Job, reason: str, stop_reason=None) -> None:
        if not job.future.done():
            job.future.set_result(self._result(job, reason, stop_reason))

    def _finish(self, slot: int, reason: str, stop_reason=None, save: bool = True) -> None:
        """Ends the request in ``slot`` (caller holds the lock): caches its session's KV, frees the slot."""
        job = self._slots[slot]
        self._slots[slot] = None
        if job is None:
            return
        if job.decoding and self._state is not None:
            if save:
                self._store_session(job, slot)
            self._state = self.engine.release(self._state, slot)
        self.stats.requests_done += 1
        self._resolve(job, reason, stop_reason)

    def _store_session(self, job: _Job, slot: int) -> None:
        sid = job.request.session_id
        if self._cache is None or sid is None:
            return
        kv_tokens = list(job.request.prompt_ids) + job.tokens[:-1]  # the newest token is sampled, not cached
        pages = self._cache.store(sid, kv_tokens, self._version if job.kv_version is None else job.kv_version)
        if pages is not None:
            self._pool = self.engine.save_slot(self._pool, self._state, slot, pages)
        self._refresh_cache_stats()  # before the request's future resolves

    def _accept(self, slot: int, token: int, logprob: float, version: int | None = None) -> None:
        """Records a sampled token (``version``: the policy that sampled it; default the current one)."""
        job = self._slots[slot]
        assert job is not None
        job.tokens.append(token)
        job.logprobs.append(logprob)
        job.versions.append(self._version if version is None else version)
        job.budget -= 1
        if token in job.request.sampling.stop_ids:
            self._finish(slot, "stop", stop_reason=token)
        elif job.stop is not None and (matched := job.stop.check(job.tokens)) is not None:
            self._finish(slot, "stop", stop_reason=matched)
        elif job.budget <= 0:
            self._finish(slot, "length")

    def _key_for(self, request: GenerationRequest) -> jax.Array:
        seed = request.sampling.seed
        if seed is None:
            self._seed_counter += 1
            seed = zlib.crc32(f"{self._seed}/{self.name}/{self._seed_counter}".encode())
        return sampling.key_for_seed(seed)

    # -- control (loop thread, under the lock) ----------------------------------------------------
    def _ensure_state(self) -> None:
        if self._state is None:
            self._state = self.engine.init_decode_state()
        if self._cache is not None and self._pool is None:
            self._pool = self.engine.init_page_pool(self._cache.num_pages)

    def _control(self) -> None:
        if self._commands or (self._pending_update is not None and self.on_update == "recompute"):
            self._flush()  # exports and recomputes need every sampled token accounted for
        if self._pending_update is not None:
            (self._params, version), self._pending_update = self._pending_update, None
            changed = version != self._version
            self._version = version
            if changed and self.on_update == "recompute":
                self._recompute_in_flight()
            if changed and self._cache is not None and not self.reuse_stale_kv:
                self._cache.drop_stale(version)
        if self._cancelled:
            kept = collections.deque()
            for job in self._queue:
                if job.request.request_id in self._cancelled:
                    self._resolve(job, "cancelled")
                else:
                    kept.append(job)
            self._queue = kept
            for slot, job in enumerate(self._slots):
                if job is not None and job.request.request_id in self._cancelled:
                    self._finish(slot, "cancelled")
            self._cancelled.clear()
        while self._commands:
            fn, fut = self._commands.popleft()
            try:
                fut.set_result(fn())
            except Exception as exc:  # a bad command fails its caller, never the loop
                fut.set_exception(exc)
        free = [slot for slot, job in enumerate(self._slots) if job is None]
        while free and self._queue:
            job = self._queue.popleft()
            if job.future.done():  # e.g. resolved elsewhere while it waited
                continue
            try:
                self._admit(job)
            except Exception as exc:  # this request fails; the loop serves on
                log.exception("serving loop %s: could not admit request %s", self.name, job.request.request_id)
                job.future.set_exception(exc)
                continue
            self._slots[free.pop(0)] = job
        self._refresh_cache_stats()

    def _admit(self, job: _Job) -> None:
        """Gives a job its sampling key and any KV it can start from (imported, or the session's cache entry)."""
        if job.key is None:
            job.key = self._key_for(job.request)
        if job.kv is not None:
            ready = job.done if job.resuming else min(job.done, len(job.target) - 1)  # >= 1 token left to sample from
            if ready > 0:
                job.prefix = self.engine.prefix_from_pages(job.kv, ready, job.key)
            job.done, job.kv = ready, None
            return
        sid = job.request.session_id
        if self._cache is None or sid is None or job.resuming:
            return
        hit = self._cache.take(sid, job.target, None if self.reuse_stale_kv else self._version)
        if hit is None:
            return
        job.prefix = self.engine.load_prefix(self._pool, hit.entry.pages, hit.reused, job.key)
        self._cache.release(hit.entry)  # the load above is dispatched first: later writes to these pages wait for it
        job.done = job.cached_tokens = hit.reused
        job.kv_version = hit.entry.version

    def _recompute_in_flight(self) -> None:
        """on_update="recompute": every request in a slot prefills its KV again under the new weights."""
        keys = np.asarray(jax.device_get(self._state.keys))
        for slot, job in enumerate(self._slots):
            if job is None:
                continue
            if job.decoding:
                job.key = jnp.asarray(keys[slot])
                job.target = list(job.request.prompt_ids) + job.tokens[:-1]
                job.decoding = False
                self._state = self.engine.release(self._state, slot)
            job.done, job.prefix, job.kv_version, job.cached_tokens = 0, None, None, 0

    def _on_loop(self, fn: Callable[[], object]):
        """Runs ``fn`` on the loop thread between two steps (or here, if the loop is not running)."""
        with self._cv:
            if self.error is not None:
                raise RuntimeError(f"serving loop {self.name} has failed: {self.error!r}")
            if self._thread is None or threading.current_thread() is self._thread:
                self._ensure_state()
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

        cached, running, queued = [], [], []
        if include_cached and self._cache is not None:
            for sid in self._cache.sessions():
                if wanted(sid):
                    entry = self._cache.pop(sid)
                    kv = self.engine.export_pages(self._pool, entry.pages)
                    self._cache.release(entry)
                    cached.append(SessionState(sid, kv, entry.tokens.tolist(), entry.version, source=self.name))
        keys = None
        for slot, job in enumerate(self._slots):
            if job is None or not wanted(job.request.session_id):
                continue
            if job.decoding:
                keys = np.asarray(jax.device_get(self._state.keys)) if keys is None else keys
                kv_tokens = list(job.request.prompt_ids) + job.tokens[:-1]
                kv = self.engine.export_slot(self._state, slot, len(kv_tokens))
                self._state = self.engine.release(self._state, slot)
                key = keys[slot]
            else:
                kv_tokens = job.target[: job.done]
                kv = self.engine.export_prefix(job.prefix, job.done) if job.prefix is not None and job.done else None
                key = None if job.key is None else np.asarray(job.key)
            self._slots[slot] = None
            running.append(self._state_of(job, kv, kv_tokens, key))
        kept = collections.deque()
        for job in self._queue:
            if wanted(job.request.session_id):
                kv_tokens = job.target[: job.done] if job.kv is not None else []
                queued.append(self._state_of(job, job.kv, kv_tokens, None if job.key is None else np.asarray(job.key)))
            else:
                kept.append(job)
        self._queue = kept
        out = cached + running + queued
        self.stats.sessions_exported += len(out)
        self._refresh_cache_stats()
        return out

    def _state_of(self, job: _Job, kv: KVPages | None, kv_tokens: list[int], key) -> SessionState:
        state = SessionState(
            session_id=job.request.session_id,
            kv=kv,
            kv_tokens=kv_tokens,
            kv_version=self._version if job.kv_version is None else job.kv_version,
            request=job.request,
            future=job.future,
            token_ids=job.tokens,
            logprobs=job.logprobs,
            policy_versions=job.versions,
            key=key,
            cached_tokens=job.cached_tokens,
            source=self.name,
        )
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
                pages = self._cache.store(state.session_id, state.kv_tokens, state.kv_version)
                if pages is not None:
                    self._pool = self.engine.import_pages(self._pool, kv, pages)
            self.stats.sessions_imported += 1
            self._refresh_cache_stats()
            return
        request, future = state.request, state.future
        if future is None or future.done():
            return  # nobody waits for it any more (e.g. cancelled during the move)
        prompt = list(request.prompt_ids)
        target = prompt + state.token_ids[:-1] if state.token_ids else prompt
        if state.kv_tokens != target[: len(state.kv_tokens)] or (kv is None and state.kv_tokens):
            raise ValueError(
                f"session {state.session_id!r}: kv_tokens are not a prefix of the request's prompt + "
                "generated tokens; export states with ServingLoop.export_sessions"
            )
        try:
            stop = self._stop_checker(request)
            if len(prompt) + max(len(state.token_ids), 1) > self.max_context:
                raise ContextTooLongError(
                    f"request {request.request_id} ({len(prompt)} prompt + {len(state.token_ids)} "
                    f"generated tokens) does not fit serving loop {self.name} "
                    f"(context {self.max_context} tokens)"
                )
        except ValueError as exc:
            future.set_exception(exc)
            return
        job = _Job(
            request=request,
            future=future,
            target=target,
            seq=next(self._seq),
            key=None if state.key is None else jnp.asarray(state.key, jnp.uint32),
            done=len(state.kv_tokens) if kv is not None else 0,
            kv=kv,
            kv_version=state.kv_version if kv is not None else None,
            tokens=list(state.token_ids),
            logprobs=list(state.logprobs),
            versions=list(state.policy_versions),
            cached_tokens=state.cached_tokens,
            stop=stop,
        )
        self._queue.appendleft(job)  # a moved request goes ahead of new ones
        state.moved_to = self
        self.stats.sessions_imported += 1

    # -- the loop ---------------------------------------------------------------------------------
    def _has_work(self) -> bool:
        return any(s is not None for s in self._slots)

    def _prefill_step(self) -> None:
        """Prefills up to ``prefill_chunk`` tokens of the slots still prefilling (oldest first); slots whose
        prompt is complete start decoding. With no slot decoding, goes on until one can start."""
        pending = sorted(
            ((slot, job) for slot, job in enumerate(self._slots) if job is not None and not job.decoding),
            key=lambda sj: sj[1].seq,
        )
        if not pending:
            return
        must_start = not any(j is not None and j.decoding for j in self._slots)
        spent = 0
        for slot, job in pending:
            while job.done < len(job.target):
                if spent >= self.prefill_chunk and not must_start:
                    return
                n = min(self.prefill_chunk, len(job.target) - job.done)
                if job.prefix is None and n < len(job.target):  # chunks follow: all of them on a full-length cache
                    job.prefix = self.engine.empty_prefix(job.key)
                try:
                    job.prefix = self.engine.prefill(
                        params=self._params,
                        tokens=job.target[job.done : job.done + n],
                        sampling_params=job.request.sampling,
                        key=job.key,
                        existing_prefix=job.prefix,
                    )
                except Exception as exc:  # this request fails; the loop serves on
                    log.warning("serving loop %s: prefill of %s failed: %s", self.name, job.request.request_id, exc)
                    with self._cv:
                        self._slots[slot] = None
                    if not job.future.done():
                        job.future.set_exception(exc)
                    break
                if job.kv_version is None:
                    job.kv_version = self._version
                job.done += n
                spent += n
                self.stats.prefill_tokens += n
                self.stats.prefill_calls += 1
            else:
                self._start_decoding(slot, job)
                must_start = False

    def _start_decoding(self, slot: int, job: _Job) -> None:
        prefix = job.prefix
        if job.resuming:  # insert the token sampled before the move/update, with the key state after it
            prefix = dataclasses.replace(
                prefix, token=jnp.int32(job.tokens[-1]), logprob=jnp.float32(job.logprobs[-1]), key=job.key
            )
        sp = job.request.sampling
        self._state = self.engine.insert(prefix, self._state, slot, sp)
        job.prefix = None
        job.budget = min(sp.max_tokens, self.max_context - len(job.request.prompt_ids)) - len(job.tokens)
        with self._cv:
            job.decoding = True
            if job.resuming:
                if job.budget <= 0:
                    self._finish(slot, "length")
                return
            token, logprob = jax.device_get((prefix.token, prefix.logprob))
            self._accept(slot, int(token), float(logprob))

    def _dispatch_generate(self, in_flight: _Step | None) -> _Step | None:
        """Starts one generate step for the decoding slots (not waiting for it). Jobs still owed their token of
        the step ``in_flight`` hold one more cached token by the time this step runs."""
        decoding = {slot: j for slot, j in enumerate(self._slots) if j is not None and j.decoding}
        if not decoding:
            return None
        owed = in_flight.jobs if in_flight is not None else {}
        longest = max(
            len(j.request.prompt_ids) + len(j.tokens) - 1 + (owed.get(slot) is j) for slot, j in decoding.items()
        )
        self._state, result = self.engine.generate(
            self._params, self._state, max_length=longest, slot_limit=max(decoding) + 1, wait=False
        )
        self.stats.generate_steps += 1
        return _Step(result=result, jobs=decoding, version=self._version)

    def _collect(self, step: _Step | None) -> None:
        """Gives each job its token of ``step``; a slot whose job ended or changed since it was dispatched
        (finished, cancelled, exported) ignores it."""
        if step is None:
            return
        result = step.result.to_host()
        tokens, logprobs, valid = result.tokens.tolist(), result.logprobs.tolist(), result.valid.tolist()
        with self._cv:
            for slot, job in step.jobs.items():
                if self._slots[slot] is not job or not job.decoding:
                    continue
                if not valid[slot]:  # cannot happen while budgets respect the context; never pass garbage on
                    log.error(
                        "serving loop %s: slot %d sampled no valid token (request %s); ending it",
                        self.name,
                        slot,
                        job.request.request_id,
                    )
                    self._finish(slot, "length")
                    continue
                self.stats.tokens_generated += 1
                self._accept(slot, tokens[slot], logprobs[slot], step.version)

    def _flush(self) -> None:
        """Collects the step in flight, so slots, tokens and the decode state agree (before an export, a
        recompute or a stop)."""
        step, self._pending = self._pending, None
        self._collect(step)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    if self._stop:
                        break
                    self._control()
                    if not self._has_work() and self._pending is None:
                        self._cv.wait(timeout=0.05)
                        continue
                t0 = time.perf_counter()
                prefilled = self.stats.prefill_tokens
                self._prefill_step()
                # pipelined: step k+1 is dispatched before step k's tokens are read, so the device never waits
                # for this thread; a request that ends at step k wastes its token of step k+1
                previous = self._pending
                self._pending = self._dispatch_generate(previous)
                self._collect(previous)
                dt = time.perf_counter() - t0
                self.stats.busy_s += dt
                if previous is not None or self.stats.prefill_tokens > prefilled:
                    jobs = previous.jobs.values() if previous is not None else ()
                    context = sum(len(j.request.prompt_ids) + len(j.tokens) for j in jobs)
                    self.step_log.append((len(jobs), context, self.stats.prefill_tokens - prefilled, dt))
        except BaseException as exc:  # the loop must never die silently: fail every waiter with the cause
            log.exception("serving loop %s failed", self.name)
            with self._cv:
                self.error = exc
                failure = RuntimeError(f"serving loop {self.name} failed: {exc!r}")
                for slot, job in enumerate(self._slots):
                    if job is not None and not job.future.done():
                        job.future.set_exception(failure)
                    self._slots[slot] = None
                while self._queue:
                    job = self._queue.popleft()
                    if not job.future.done():
                        job.future.set_exception(failure)
                self._fail_commands(failure)
