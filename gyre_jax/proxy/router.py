"""Routes generation requests over several named backends (one per serving cell) as one ``GenerationBackend``.

Owns session affinity (a session stays on the backend that served it, so its prefix cache stays warm,
while that backend is not drained), least-loaded placement of new sessions, draining of a backend
before its cell changes role, and transparent retry: a request that a backend cancels on its own
(its cell was drained with ``cancel_in_flight=True``, or its serving loop stopped) or that fails
because the loop stopped is re-submitted to another backend, or held until one is available, so the
caller only ever sees a completed generation. Only a cancel the caller asked for resolves as
"cancelled". Thread-safe: the proxy's event loop and the scheduler call it concurrently.

A streamed request (one with a ``TokenListener``) that is retried after some of its tokens reached the caller
continues from them: the retry's prompt is the original prompt + those tokens (its budget what is left), the
caller's listener hears only the new tokens, and the result holds exactly the tokens the caller was told, with
their log-probs and policy versions, then the continuation's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from gyre_jax.serving.types import GenerationBackend, GenerationRequest, GenerationResult, TokenChunk

logger = logging.getLogger(__name__)


@dataclass
class _Routed:
    """A request the router owns until its caller's future is resolved."""

    request: GenerationRequest
    future: concurrent.futures.Future  # the caller's future
    backend: str | None = None  # where it runs now (None: parked, waiting for an available backend)
    attempts: int = 0  # re-submissions so far
    cancel_requested: bool = False
    # the tokens the caller's listener was told, over every attempt: ids, log-probs, policy versions
    told: tuple[list[int], list[float], list[int]] = field(default_factory=lambda: ([], [], []))
    base: int = 0  # told tokens the running attempt continues from (its prompt ends with them)

    def attempt(self) -> GenerationRequest:
        """What to submit for the next attempt: the request itself, or, once tokens were told to a streaming
        caller, a continuation after them (same request id) whose listener tells the caller the rest."""
        request = self.request
        if request.on_tokens is None:
            return request
        self.base = len(self.told[0])
        attempt, told = self.attempts, self.told

        def tell(chunk: TokenChunk) -> None:
            if self.attempts != attempt:  # a late chunk of an attempt that was given up: the caller never sees it
                return
            start = self.base + chunk.start
            if start != len(told[0]):
                raise RuntimeError(f"request {chunk.request_id}: token {start} told out of order")
            told[0].extend(chunk.token_ids)
            told[1].extend(chunk.logprobs)
            told[2].extend(chunk.policy_versions)
            request.on_tokens(dataclasses.replace(chunk, start=start))

        sampling = dataclasses.replace(request.sampling, max_tokens=request.sampling.max_tokens - self.base)
        return dataclasses.replace(
            request, prompt_ids=list(request.prompt_ids) + told[0][: self.base], sampling=sampling, on_tokens=tell
        )

    def merged(self, result: GenerationResult) -> GenerationResult:
        """The caller's result: the told tokens this attempt continued from, then the attempt's own."""
        if self.base == 0:
            return result
        ids, logprobs, versions = (part[: self.base] for part in self.told)
        return dataclasses.replace(
            result,
            token_ids=ids + list(result.token_ids),
            logprobs=logprobs + list(result.logprobs),
            policy_versions=versions + list(result.policy_versions),
            **_split_told_experts(result, self.base),
            prompt_len=len(self.request.prompt_ids),
            cached_tokens=min(result.cached_tokens, len(self.request.prompt_ids)),
        )

    def told_result(self, reason: str) -> GenerationResult:
        """A result of just the told tokens (nothing left to generate, or cancelled by the caller)."""
        ids, logprobs, versions = (list(part) for part in self.told)
        return GenerationResult(self.request.request_id, ids, logprobs, versions, reason, len(self.request.prompt_ids))


def _split_told_experts(result: GenerationResult, told: int) -> dict:
    """A continuation's expert ids (routing replay) as the caller's request has them: its prompt ended with the
    ``told`` tokens, so their rows (from its prefill; -1 if its KV was reused) move from the prompt's to the
    completion's. Nothing recorded: both None."""
    prompt, completion = result.prompt_expert_ids, result.expert_ids
    if prompt is None:
        return {"expert_ids": None, "prompt_expert_ids": None}
    if completion is None:  # no generate step ran for it: its tokens' rows are not known
        completion = np.full((len(result.token_ids), *prompt.shape[1:]), -1, prompt.dtype)
    return {"expert_ids": np.concatenate([prompt[-told:], completion]), "prompt_expert_ids": prompt[:-told]}


class Router:
    """A ``GenerationBackend`` over named backends with session affinity, least-in-flight placement,
    draining and transparent retry.

    A new session (or one whose backend is drained) goes to the available backend with the fewest
    in-flight requests, ties broken by fewest pinned sessions, then by name order.

    ``max_sessions`` bounds the affinity table (least recently used sessions are forgotten first; a
    forgotten session is simply placed again as a new one). ``max_retries`` bounds how often one
    request is re-submitted after backends cancelled or failed it; past that, the last outcome is
    passed to the caller.
    """

    def __init__(
        self, backends: Mapping[str, GenerationBackend], max_sessions: int = 65536, max_retries: int = 8
    ) -> None:
        if not backends:
            raise ValueError("Router needs at least one backend, e.g. Router({'cell0': engine_loop})")
        if max_sessions < 1:
            raise ValueError(f"max_sessions={max_sessions} must be >= 1")
        if max_retries < 0:
            raise ValueError(f"max_retries={max_retries} must be >= 0")
        self._backends: dict[str, GenerationBackend] = dict(backends)
        self._max_sessions = max_sessions
        self._max_retries = max_retries
        self._lock = threading.Lock()
        self._drained: set[str] = set()
        self._in_flight: dict[str, int] = {name: 0 for name in self._backends}
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session_id -> backend name
        self._pinned: dict[str, int] = {name: 0 for name in self._backends}  # sessions pinned to each backend
        self._routed: dict[str, _Routed] = {}  # request_id -> its state, until the caller's future resolves
        self._parked: list[_Routed] = []  # waiting for a backend to become available
        self.retries = 0  # re-submissions done, over the router's life

    @property
    def max_context(self) -> int:
        """The smallest context of any backend: a request that fits it fits wherever it is routed."""
        return min(int(backend.max_context) for backend in self._backends.values())

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._backends)

    def in_flight(self, name: str) -> int:
        """Requests submitted to backend ``name`` that have not completed yet."""
        self._check_name(name)
        with self._lock:
            return self._in_flight[name]

    def parked(self) -> int:
        """Requests waiting for an available backend (all were drained when they needed a retry)."""
        with self._lock:
            return len(self._parked)

    def session_backend(self, session_id: str) -> str | None:
        """The backend a session is pinned to, or None if it has none (new or forgotten)."""
        with self._lock:
            return self._sessions.get(session_id)

    def drain(self, name: str, cancel_in_flight: bool = False) -> None:
        """Routes no new request to ``name``.

        Its in-flight requests finish there normally, or, with ``cancel_in_flight``, are cancelled at
        once and re-submitted elsewhere (their partial tokens are dropped; the caller sees one
        completion, generated by the backend that finished it).
        """
        self._check_name(name)
        with self._lock:
            self._drained.add(name)
            moving = [rid for rid, routed in self._routed.items() if routed.backend == name] if cancel_in_flight else []
        for request_id in moving:
            self._backends[name].cancel(request_id)

    def repin(self, session_id: str, name: str) -> None:
        """Pins ``session_id`` to backend ``name`` (its KV moved there, e.g. when a cell left serving), so the
        session's next call goes where its prefix cache is."""
        self._check_name(name)
        with self._lock:
            self._pin(session_id, name)

    def undrain(self, name: str) -> None:
        """Lets ``name`` take new requests again (and the parked ones)."""
        self._check_name(name)
        with self._lock:
            self._drained.discard(name)
            parked, self._parked = self._parked, []
        for routed in parked:
            self._dispatch(routed, exclude=None)

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        """Sends ``request`` to its session's backend if that one is available, else to the least loaded one.

        Raises RuntimeError if every backend is drained or refuses the request.
        """
        routed = _Routed(request=request, future=concurrent.futures.Future())
        attempt = routed.attempt()
        tried: set[str] = set()
        while True:
            with self._lock:
                name = self._place(request.session_id, exclude=tried)
                if name is None:
                    if tried:
                        raise RuntimeError(
                            f"every available serving backend refused the request ({', '.join(sorted(tried))})"
                        )
                    raise RuntimeError(
                        f"all serving backends are drained ({', '.join(self._backends)}); undrain one (Router.undrain) "
                        "before submitting"
                    )
                self._start(routed, name)
            try:
                inner = self._backends[name].submit(attempt)
            except RuntimeError:
                logger.warning("backend %s refused request %s; trying another", name, request.request_id, exc_info=True)
                with self._lock:
                    self._stop(routed, name)
                tried.add(name)
                continue
            break
        inner.add_done_callback(lambda f: self._on_done(routed, name, f))
        return routed.future

    def cancel(self, request_id: str) -> None:
        """Cancels the request wherever it is; its future resolves "cancelled". Unknown/finished ids are ignored."""
        with self._lock:
            routed = self._routed.get(request_id)
            if routed is None:
                return
            routed.cancel_requested = True
            name = routed.backend
            parked = routed in self._parked
            if parked:
                self._parked.remove(routed)
                self._routed.pop(request_id, None)
        if parked:
            self._resolve(routed, routed.told_result("cancelled"))
        elif name is not None:
            self._backends[name].cancel(request_id)

    # -- internals (methods named _start/_stop/_place expect the lock held) -----------------------------------------

    def _start(self, routed: _Routed, name: str) -> None:
        routed.backend = name
        self._in_flight[name] += 1
        self._routed[routed.request.request_id] = routed

    def _stop(self, routed: _Routed, name: str) -> None:
        if routed.backend == name:
            routed.backend = None
            self._in_flight[name] -= 1

    def _place(self, session_id: str | None, exclude: set[str] | None = None) -> str | None:
        """Chooses an available backend not in ``exclude`` and pins the session to it; None if there is none."""
        available = [n for n in self._backends if n not in self._drained and n not in (exclude or ())]
        if not available:
            return None
        pinned = self._sessions.get(session_id) if session_id is not None else None
        if pinned in available:
            name = pinned
        else:  # fewest in flight; ties go to the backend with fewer sessions, then to the first named
            name = min(available, key=lambda n: (self._in_flight[n], self._pinned[n]))
        if session_id is not None:
            self._pin(session_id, name)
        return name

    def _pin(self, session_id: str, name: str) -> None:
        previous = self._sessions.pop(session_id, None)
        if previous is not None:
            self._pinned[previous] -= 1
        self._sessions[session_id] = name
        self._pinned[name] += 1
        while len(self._sessions) > self._max_sessions:
            _, forgotten = self._sessions.popitem(last=False)
            self._pinned[forgotten] -= 1

    def _on_done(self, routed: _Routed, name: str, inner: concurrent.futures.Future) -> None:
        exc = inner.exception()
        result = inner.result() if exc is None else None
        with self._lock:
            self._stop(routed, name)
            lost = (result is not None and result.finish_reason == "cancelled") or isinstance(exc, RuntimeError)
            retry = lost and not routed.cancel_requested and routed.attempts < self._max_retries
            if retry:
                routed.attempts += 1
                self.retries += 1
            else:
                self._routed.pop(routed.request.request_id, None)
        if retry:
            logger.info("request %s lost on %s (%s); re-submitting", routed.request.request_id, name,
                        exc or "cancelled by the backend")  # fmt: skip
            self._dispatch(routed, exclude=name)
        elif exc is not None:
            routed.future.set_exception(exc)
        else:
            self._resolve(routed, routed.merged(result))

    def _dispatch(self, routed: _Routed, exclude: str | None) -> None:
        """Re-submits ``routed``: preferably not to ``exclude``; parks it when no backend is available."""
        request = routed.request
        tried: set[str] = set()
        while True:
            with self._lock:
                if routed.cancel_requested:
                    self._routed.pop(request.request_id, None)
                    cancelled = True
                else:
                    cancelled = False
                    name = self._place(request.session_id, exclude=tried | ({exclude} if exclude else set()))
                    if name is None and exclude is not None and exclude not in tried:
                        name = self._place(request.session_id, exclude=tried)
                    if name is None and not tried:
                        self._parked.append(routed)  # every backend is drained: wait for an undrain
                        return
                    if name is None:
                        self._routed.pop(request.request_id, None)
                    else:
                        self._start(routed, name)
            if not cancelled and name is None:
                routed.future.set_exception(
                    RuntimeError(f"every available serving backend refused the request ({', '.join(sorted(tried))})")
                )
                return
            if cancelled:
                self._resolve(routed, routed.told_result("cancelled"))
                return
            if len(routed.told[0]) >= request.sampling.max_tokens:  # the told tokens used the whole budget
                with self._lock:
                    self._stop(routed, name)
                    self._routed.pop(request.request_id, None)
                self._resolve(routed, routed.told_result("length"))
                return
            try:
                inner = self._backends[name].submit(routed.attempt())
            except RuntimeError:
                with self._lock:
                    self._stop(routed, name)
                tried.add(name)
                continue
            inner.add_done_callback(lambda f, n=name: self._on_done(routed, n, f))
            return

    @staticmethod
    def _resolve(routed: _Routed, result: GenerationResult | None) -> None:
        if not routed.future.done():
            routed.future.set_result(result)

    def _check_name(self, name: str) -> None:
        if name not in self._backends:
            raise KeyError(f"unknown backend {name!r}; this router has {list(self._backends)}")
