"""Routes generation requests over several named backends (one per serving cell) as one ``GenerationBackend``.

Owns session affinity (a session stays on the backend that served it, so its prefix cache stays warm,
while that backend is not drained), least-loaded placement of new sessions, and draining of a backend
before its cell changes role. Thread-safe: the proxy's event loop and the scheduler call it concurrently.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from collections.abc import Mapping

from gyre_jax.serving.types import GenerationBackend, GenerationRequest, GenerationResult


class Router:
    """A ``GenerationBackend`` over named backends with session affinity, least-in-flight placement and draining.

    A new session (or one whose backend is drained) goes to the available backend with the fewest
    in-flight requests, ties broken by fewest pinned sessions, then by name order.

    ``max_sessions`` bounds the affinity table (least recently used sessions are forgotten first; a
    forgotten session is simply placed again as a new one).
    """

    def __init__(self, backends: Mapping[str, GenerationBackend], max_sessions: int = 65536) -> None:
        if not backends:
            raise ValueError("Router needs at least one backend, e.g. Router({'cell0': engine_loop})")
        if max_sessions < 1:
            raise ValueError(f"max_sessions={max_sessions} must be >= 1")
        self._backends: dict[str, GenerationBackend] = dict(backends)
        self._max_sessions = max_sessions
        self._lock = threading.Lock()
        self._drained: set[str] = set()
        self._in_flight: dict[str, int] = {name: 0 for name in self._backends}
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session_id -> backend name
        self._pinned: dict[str, int] = {name: 0 for name in self._backends}  # sessions pinned to each backend
        self._requests: dict[str, str] = {}  # request_id -> backend name, while in flight

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

    def session_backend(self, session_id: str) -> str | None:
        """The backend a session is pinned to, or None if it has none (new or forgotten)."""
        with self._lock:
            return self._sessions.get(session_id)

    def drain(self, name: str) -> None:
        """Routes no new request to ``name``; its in-flight requests finish (or are cancelled) normally."""
        self._check_name(name)
        with self._lock:
            self._drained.add(name)

    def undrain(self, name: str) -> None:
        """Lets ``name`` take new requests again."""
        self._check_name(name)
        with self._lock:
            self._drained.discard(name)

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        """Sends ``request`` to its session's backend if that one is available, else to the least loaded one."""
        with self._lock:
            name = self._place(request.session_id)
            self._in_flight[name] += 1
            self._requests[request.request_id] = name
        try:
            future = self._backends[name].submit(request)
        except BaseException:
            self._finished(name, request.request_id)
            raise
        future.add_done_callback(lambda _: self._finished(name, request.request_id))
        return future

    def cancel(self, request_id: str) -> None:
        """Forwards to the backend that got the request; a request that already finished is ignored."""
        with self._lock:
            name = self._requests.get(request_id)
        if name is not None:
            self._backends[name].cancel(request_id)

    def _place(self, session_id: str | None) -> str:
        """Chooses a backend (caller holds the lock) and pins the session to it."""
        available = [name for name in self._backends if name not in self._drained]
        if not available:
            raise RuntimeError(
                f"all serving backends are drained ({', '.join(self._backends)}); undrain one (Router.undrain) "
                "before submitting"
            )
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

    def _finished(self, name: str, request_id: str) -> None:
        with self._lock:
            if self._requests.pop(request_id, None) is not None:
                self._in_flight[name] -= 1

    def _check_name(self, name: str) -> None:
        if name not in self._backends:
            raise KeyError(f"unknown backend {name!r}; this router has {list(self._backends)}")
