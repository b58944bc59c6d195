"""Execution and agent identity: the API key issued to each execution, its live conversations (for
token-in/token-out), and how a call is named to a thread, i.e. an agent (``agents.py`` has the rules).

An ``Execution`` owns everything mutable about one execution (record numbering, conversations, agents, in-flight
requests) behind its own lock; ``Executions`` issues and resolves keys. Nothing here knows a wire format.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gyre_jax.disk import DiskFull
from gyre_jax.proxy import agents, tito
from gyre_jax.proxy.errors import ProxyError, execution_ended
from gyre_jax.proxy.records import RecordStore, TitoRecord

THREAD_HEADERS = ("x-gyre-thread-id", "x-claude-code-session-id")  # first present one names the thread
DEFAULT_THREAD = "main"
MAX_THREAD_ID_CHARS = 256  # a thread id is stored in every record of its calls: longer ones are refused (400)
MAX_THREADS_PER_EXECUTION = 256  # conversations (and agents) kept per execution (least recently used forgotten first)
AUXILIARY = "auxiliary"  # TitoRecord.agent_kind of a harness-side utility call


def thread_base(headers: Mapping[str, str]) -> str:
    """The thread a call's headers name (``headers``: case-insensitive, as Starlette's), else ``"main"``; 400 for one
    over ``MAX_THREAD_ID_CHARS``."""
    for header in THREAD_HEADERS:
        value = headers.get(header, "").strip()
        if len(value) > MAX_THREAD_ID_CHARS:
            raise ProxyError(
                400, f"header {header} is {len(value)} characters; a thread id is at most {MAX_THREAD_ID_CHARS}"
            )
        if value:
            return value
    return DEFAULT_THREAD


def _bounded_put(table: OrderedDict, key: object, value: object, limit: int) -> None:
    """Sets ``table[key]`` as the most recently used entry, forgetting the least recently used beyond ``limit``."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)


@dataclass(frozen=True)
class Placement:
    """Where a call goes: its thread (= agent), the conversation it continues or starts, and the call of it that it
    extends (None: a new conversation, rendered in full). ``agent_kind`` is the record's (``""`` or auxiliary);
    ``points`` the calls of the conversation before ``state`` (``tito.LiveConversation``); ``built`` adds ``state``'s.
    """

    thread_id: str
    conversation: int  # -1 for a raw prompt (no conversation state)
    state: tito.ThreadState | None = None
    agent_kind: str = ""
    points: tuple[tito.CallPoint, ...] = ()

    def built(self, build: tito.PromptBuild) -> Placement:
        """The placement once its prompt is built: the continued call's point as ``build`` holds it (re-sent
        verbatim or changed), after the earlier ones; no points if ``build`` continues nothing (rendered in full)."""
        points = (*self.points, build.point) if build.continued and build.point is not None else ()
        return dataclasses.replace(self, points=points)


@dataclass
class Execution:
    """One execution's live state on the proxy. Methods take ``lock``; ``ended`` and ``next_record_index`` may be
    read without it (a snapshot)."""

    execution_id: str
    api_key: str
    next_record_index: int  # call_index of the next record; equals the number of recorded calls
    max_threads: int  # bound on ``conversations`` and ``agents`` (one context each)
    ended: bool = False
    started_calls: int = 0  # calls placed on the backend, for derived seeds
    conversations: OrderedDict[int, tito.LiveConversation] = field(default_factory=OrderedDict)  # by id, LRU first
    agents: OrderedDict[str, agents.Agent] = field(default_factory=OrderedDict)  # by thread id, LRU first
    next_conversation: int = 0
    last_answered: dict[str, str] = field(default_factory=dict)  # header -> thread whose answer was recorded last
    named: set[str] = field(default_factory=set)  # every thread id given to an agent (one string each), never reused
    in_flight: set[str] = field(default_factory=set)  # backend request ids
    lock: threading.Lock = field(default_factory=threading.Lock)

    def place(self, base: str, messages: list[dict] | None, tools: list[dict] | None = None) -> Placement:
        """Names a call's thread and finds the conversation it continues (see ``agents.py``).

        A chat call continues, among the live conversations of its header (``base``), the one with the longest
        call it extends (its last call, or an earlier one: then it forks a new conversation; its assistant turn
        re-sent verbatim, as one of an n > 1 call's choices, or changed: ``tito.LiveConversation.match``, a
        verbatim re-send winning a tie), whatever agent that is; otherwise it starts a new conversation, whose agent the rules of ``agents.py`` decide. So
        agents sharing a system prompt (nested sub-agents) never take each other's state. A raw prompt
        (``messages`` None) goes to ``base`` with no state.
        """
        if messages is None:
            return Placement(base, -1)
        normalized = [tito.normalize_message(m) for m in messages]
        key = tito.tools_key(tools)
        with self.lock:
            best, best_rank = None, (-1, False)
            for number, conversation in self.conversations.items():
                agent = self.agents.get(conversation.thread_id)
                found = None if agent is not None and agent.base != base else conversation.match(normalized, key)
                if found is not None and found[:2] >= best_rank:  # the longest; a verbatim re-send over a changed one
                    best, best_rank = (number, conversation, *found[2:]), found[:2]
            if best is not None:
                number, conversation, state, points = best
                if state is not conversation.latest:  # a fork from an earlier call
                    number = self._new_number()
                agent = self.agents.get(conversation.thread_id)
                kind = AUXILIARY if agent is not None and agent.auxiliary else ""
                return Placement(conversation.thread_id, number, state, kind, points)
            agent = self._restated_agent(base, normalized) or self._new_conversation_agent(base, messages, tools)
            return Placement(agent.thread_id, self._new_number(), None, AUXILIARY if agent.auxiliary else "")

    def _new_number(self) -> int:
        number = self.next_conversation
        self.next_conversation += 1
        return number

    def _restated_agent(self, base: str, normalized: list[dict]) -> agents.Agent | None:
        """Rule 2 of ``agents.py``: the agent of ``base`` whose live conversation (the most recent first) a new one
        restates under another system prompt, marked most recently used; None if none. Caller holds ``lock``."""
        for conversation in reversed(self.conversations.values()):
            agent = self.agents.get(conversation.thread_id)
            latest = conversation.latest
            answers = {k: [latest.messages[k]] for k, _, _ in conversation.points}
            answers[len(latest.messages)] = [c.returned for c in (latest, *latest.alternatives)]
            if agent is not None and agent.base == base and agents.restates(normalized, latest.messages, answers):
                self.agents.move_to_end(agent.thread_id)
                return agent
        return None

    def _new_conversation_agent(self, base: str, messages: list[dict], tools: list[dict] | None) -> agents.Agent:
        """The agent of a new conversation (rules 3-5 of ``agents.py``); caller holds ``lock``."""
        key = agents.system_key(messages)
        known = list(self.agents.values())
        auxiliary = agents.is_auxiliary(messages, tools, any(a.tools and a.base == base for a in known))
        last = self.agents.get(self.last_answered.get(base, ""))
        agent = agents.match_agent(known, base, key, auxiliary, messages, last)
        if agent is None:
            name = agents.agent_name(base, key, auxiliary, self.named)
            self.named.add(name)
            agent = agents.Agent(name, base, key, agents.first_user(messages), auxiliary, bool(tools))
        _bounded_put(self.agents, agent.thread_id, agent, self.max_threads)
        return agent

    def thread_ids(self) -> list[str]:
        """Threads (agents) with a live conversation, least recently used first."""
        with self.lock:
            return list(dict.fromkeys(c.thread_id for c in self.conversations.values()))

    def thread_state(self, thread_id: str) -> tito.ThreadState | None:
        """The last call of the thread's most recently used conversation."""
        with self.lock:
            states = [c.latest for c in self.conversations.values() if c.thread_id == thread_id]
            return states[-1] if states else None

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
        placement: Placement | None,
        state: tito.ThreadState | None,
    ) -> None:
        """Appends ``make_record(call_index)`` (fsynced) and remembers ``state`` as the last call of the placement's
        conversation (and its answer as its agent's last), atomically.

        409 if the execution ended while the call ran: nothing is recorded then.
        """
        with self.lock:
            if self.ended:
                raise execution_ended(self.execution_id, "ended while this call ran; it was not recorded")
            try:
                store.append(make_record(self.next_record_index))
            except DiskFull as exc:
                raise ProxyError(
                    507,
                    f"disk full writing {exc.path}: this call was not recorded; free space on the proxy's disk and "
                    "retry it (the proxy keeps serving)",
                    code="disk_full",
                    error_type="server_error",
                ) from exc
            self.next_record_index += 1
            if state is None or placement is None or placement.conversation < 0:
                return
            conversation = tito.LiveConversation(placement.thread_id, state, placement.points)
            _bounded_put(self.conversations, placement.conversation, conversation, self.max_threads)
            agent = self.agents.get(placement.thread_id)
            if agent is not None:
                agent.last_prose = "" if state.returned.get("tool_calls") else state.returned["content"]
                self.agents.move_to_end(placement.thread_id)
                self.last_answered[agent.base] = agent.thread_id

    def end(self) -> list[str]:
        """Ends the execution and forgets its conversations and agents; returns the backend request ids in flight."""
        with self.lock:
            self.ended = True
            self.conversations.clear()
            self.agents.clear()
            self.last_answered.clear()
            self.named.clear()
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
