"""Execution and thread identity: the API key issued to each execution, its per-thread conversation state, and
how a call is named to a thread (a header where the harness sends one, else the structure of the conversation).

An ``Execution`` owns everything mutable about one execution (record numbering, thread states, in-flight
requests) behind its own lock; ``Executions`` issues and resolves keys. Nothing here knows a wire format.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gyre_jax.proxy import tito
from gyre_jax.proxy.errors import ProxyError, execution_ended
from gyre_jax.proxy.records import RecordStore, TitoRecord

THREAD_HEADERS = ("x-gyre-thread-id", "x-claude-code-session-id")  # first present one names the thread
DEFAULT_THREAD = "main"
MAX_THREADS_PER_EXECUTION = 256  # thread states kept per execution (least recently used forgotten first)


def thread_base(headers: Mapping[str, str]) -> str:
    """The thread a call's headers name (``headers``: case-insensitive, as Starlette's), else ``"main"``."""
    for header in THREAD_HEADERS:
        value = headers.get(header, "").strip()
        if value:
            return value
    return DEFAULT_THREAD


def structure_key(messages: list[dict]) -> str:
    """What tells threads apart when no header does: the first system prompt and the first user message.

    A sub-agent, a summarizer or a side query starts from a different system prompt or first request
    than the main conversation, and keeps them for its whole life. Returns 12 hex digits.
    """
    system = next((m for m in messages[:1] if m.get("role") == "system"), None)
    user = next((m for m in messages if m.get("role") == "user"), None)
    parts = [tito.normalize_message(m)["content"] if m is not None else None for m in (system, user)]
    return hashlib.sha256(json.dumps(parts).encode("utf-8")).hexdigest()[:12]


def _bounded_put(table: OrderedDict, key: object, value: object, limit: int) -> None:
    """Sets ``table[key]`` as the most recently used entry, forgetting the least recently used beyond ``limit``."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)


@dataclass
class Execution:
    """One execution's live state on the proxy. Methods take ``lock``; ``ended`` and ``next_record_index`` may be
    read without it (a snapshot)."""

    execution_id: str
    api_key: str
    next_record_index: int  # call_index of the next record; equals the number of recorded calls
    max_threads: int  # bound on ``threads`` and ``thread_names`` (one context each)
    ended: bool = False
    started_calls: int = 0  # calls placed on the backend, for derived seeds
    # Last call of each thread, least recently used first.
    threads: OrderedDict[str, tito.ThreadState] = field(default_factory=OrderedDict)
    # (header thread, structure key) -> thread id, for threads told apart by structure.
    thread_names: OrderedDict[tuple[str, str], str] = field(default_factory=OrderedDict)
    in_flight: set[str] = field(default_factory=set)  # backend request ids
    lock: threading.Lock = field(default_factory=threading.Lock)

    def thread_id(self, base: str, messages: list[dict] | None) -> str:
        """The header's thread (``base``) for the first conversation structure seen under it, ``<base>~<structure
        key>`` for each other one (a sub-agent sharing its parent's header); ``base`` for a raw prompt."""
        if messages is None:
            return base
        key = structure_key(messages)
        with self.lock:
            name = self.thread_names.get((base, key))
            if name is None:
                name = base if not any(b == base for b, _ in self.thread_names) else f"{base}~{key}"
            _bounded_put(self.thread_names, (base, key), name, self.max_threads)
        return name

    def thread_ids(self) -> list[str]:
        """Threads with live state, least recently used first."""
        with self.lock:
            return list(self.threads)

    def thread_state(self, thread_id: str) -> tito.ThreadState | None:
        with self.lock:
            return self.threads.get(thread_id)

    def next_call_number(self) -> int:
        """Numbers the calls placed on the backend (0, 1, ...), recorded or not: the input of derived seeds."""
        with self.lock:
            number = self.started_calls
            self.started_calls += 1
        return number

    def begin(self, request_id: str) -> None:
        """Marks a backend request in flight (``end`` cancels it); 409 if the execution has ended."""
        with self.lock:
            if self.ended:
                raise execution_ended(self.execution_id)
            self.in_flight.add(request_id)

    def finish(self, request_id: str) -> None:
        with self.lock:
            self.in_flight.discard(request_id)

    def record(
        self,
        store: RecordStore,
        make_record: Callable[[int], TitoRecord],
        thread_id: str,
        state: tito.ThreadState | None,
    ) -> None:
        """Appends ``make_record(call_index)`` (fsynced) and remembers ``state`` as the thread's last call, atomically.

        409 if the execution ended while the call ran: nothing is recorded then.
        """
        with self.lock:
            if self.ended:
                raise execution_ended(self.execution_id, "ended while this call ran; it was not recorded")
            store.append(make_record(self.next_record_index))
            self.next_record_index += 1
            if state is not None:
                _bounded_put(self.threads, thread_id, state, self.max_threads)

    def end(self) -> list[str]:
        """Ends the execution and forgets its threads; returns the backend request ids still in flight."""
        with self.lock:
            self.ended = True
            self.threads.clear()
            self.thread_names.clear()
            return list(self.in_flight)


class Executions:
    """The executions a proxy serves, by id and by API key. Thread-safe."""

    def __init__(self, record_store: RecordStore, max_threads: int = MAX_THREADS_PER_EXECUTION) -> None:
        self.record_store = record_store
        self.max_threads = max_threads
        self._lock = threading.Lock()  # guards the two maps below
        self._by_id: dict[str, Execution] = {}
        self._by_key: dict[str, Execution] = {}

    def open(self, execution_id: str) -> str:
        """Issues a fresh API key for ``execution_id``; an execution resumed after a restart continues its numbering."""
        self.record_store.path(execution_id)  # validates the id
        with self._lock:
            self._check_new(execution_id)
        recorded = self.record_store.count(execution_id)
        key = "gyre-" + secrets.token_hex(24)
        execution = Execution(execution_id, key, next_record_index=recorded, max_threads=self.max_threads)
        with self._lock:
            self._check_new(execution_id)
            self._by_id[execution_id] = execution
            self._by_key[key] = execution
        return key

    def _check_new(self, execution_id: str) -> None:
        """ValueError if the id was opened before (caller holds ``_lock``)."""
        if execution_id in self._by_id:
            raise ValueError(
                f"execution {execution_id!r} was already opened on this proxy; give each execution a new id"
            )

    def get(self, execution_id: str) -> Execution:
        with self._lock:
            execution = self._by_id.get(execution_id)
        if execution is None:
            raise KeyError(f"execution {execution_id!r} was never opened on this proxy; call open_execution() first")
        return execution

    def authenticate(self, headers: Mapping[str, str]) -> Execution:
        """The execution whose key the call sends (``x-api-key`` or ``Authorization: Bearer``); 401 or 409 if none."""
        key = headers.get("x-api-key", "").strip()
        if not key:
            scheme, _, bearer = headers.get("authorization", "").partition(" ")
            key = bearer.strip() if scheme.lower() == "bearer" else ""
        if not key:
            raise ProxyError(
                401,
                "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>' with the key issued for "
                "this execution",
                code="invalid_api_key",
            )
        with self._lock:
            execution = self._by_key.get(key)
        if execution is None:
            raise ProxyError(
                401,
                "unknown API key: this proxy never issued it; use the key given to this execution",
                code="invalid_api_key",
            )
        if execution.ended:
            raise execution_ended(execution.execution_id, "has ended; no further calls are accepted for it")
        return execution
