"""Which agent a new conversation belongs to, decided from what harness traffic really carries.

A call that extends a live conversation (token-in/token-out, ``tito.LiveConversation.match``) belongs to that
conversation's agent. A call that extends none starts a new conversation, and these rules name its agent
(``Execution.place``):

1. **Key.** Conversations are keyed by their *normalized* system prompt (``system_key``). Normalizing removes
   per-conversation noise that says nothing about who is speaking: whole lines that are transport headers
   (``x-<name>: value``, e.g. Claude Code's ``x-anthropic-billing-header`` whose hash differs per
   conversation), UUIDs, hex digests of 8 or more digits, dates and times. Instructions, tool lists and
   working directories are kept.
2. **Restated history.** A new conversation that restates a known conversation's history under another system
   prompt (or tools) belongs to that conversation's agent: after its system prompt it repeats that conversation's
   messages up to one of the turns the agent answered, and goes on with that answer re-sent there (verbatim, or
   changed as harnesses re-send a turn: a stop string appended, a tool call written out as text). smolagents'
   final-answer call after its step limit does this: its own system prompt, no tools, the agent's memory re-sent.
   It is that agent's new branch (``main-summary`` for the main agent), never an auxiliary call; a sub-agent
   given the same task restates no answer of the parent's, so stays a new agent.
3. **Auxiliary.** A new conversation that offers no tools is a harness-side utility call (a title, a topic
   check, a quota probe, a commit message) when an agent that offers tools is already known in its thread, or
   when its system prompt or first user turn carries one of ``AUXILIARY_MARKERS``. Auxiliary conversations are
   recorded with ``agent_kind = "auxiliary"`` and never take the thread's own name (they are never the main agent).
4. **Same agent.** Among the agents with the same key, a new conversation belongs to one whose first user turn
   it repeats (a retry or an edited history), or, failing that, to the agent whose answer was recorded last in
   the thread if that answer was prose (no tool call) and the new conversation quotes it (a summary
   continuation: the harness starts over at once from the summary the agent just wrote; a line of at least
   ``MIN_QUOTE_CHARS`` characters, tags removed, appears verbatim). Text that reached a new conversation later,
   through another agent (a parent quoting a finished sub-agent's report in a new task), does not count. A
   conversation quoting the summary of an agent with another key (a separate summarizer) continues the most
   recently active agent of its own key.
5. **New agent.** Otherwise it is a new agent (a sub-agent; several sub-agents may share one system prompt).
   The first non-auxiliary agent of a thread header takes the header's name (``main`` without a header); each
   other agent is ``<header>~<12 hex digits of its key>``, and ``.2``, ``.3`` ... for further agents of the
   same key.

Nothing here knows a wire format: messages are the internal (OpenAI chat) form.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from gyre_jax.proxy import chat_template

MIN_QUOTE_CHARS = 20  # a quoted line this long (tags removed) marks a summary continuation

# Phrases of known harness utility prompts (in the system prompt or first user turn of a tool-less call).
AUXILIARY_MARKERS = (
    "you are a title generator",  # opencode: session title
    "generate a title for this conversation",  # opencode: session title
    "one-line git commit message",  # aider: commit message
)

_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?"
_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*,?"
_NOISE = (
    (re.compile(r"^[ \t]*x-[A-Za-z0-9-]+:.*$\n?", re.M), ""),  # transport header lines
    (re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"), "<uuid>"),
    (re.compile(r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b"), "<hex>"),
    (re.compile(r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?"), "<date>"),
    (re.compile(rf"\b(?:{_DAY} )?{_MONTH} \d{{1,2}},? \d{{4}}\b"), "<date>"),
    (re.compile(rf"\b(?:{_DAY} )?\d{{1,2}} {_MONTH},? \d{{4}}\b"), "<date>"),
    (re.compile(r"\b\d{1,2}/\d{1,2}/\d{2,4}\b"), "<date>"),
    (re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?(?:\s?[AaPp][Mm])?\b"), "<time>"),
)
_TAG = re.compile(r"</?[A-Za-z][\w-]*>")


def normalize_system(text: str) -> str:
    """``text`` without per-conversation noise (rule 1 of the module docstring), stripped."""
    for pattern, replacement in _NOISE:
        text = pattern.sub(replacement, text)
    return text.strip()


def _text(message: dict | None) -> str:
    return chat_template._content_text(message.get("content")).strip() if message else ""


def system_key(messages: list[dict]) -> str:
    """12 hex digits naming the normalized system prompt of ``messages`` (its first message, if a system one)."""
    system = messages[0] if messages and messages[0].get("role") == "system" else None
    return hashlib.sha256(normalize_system(_text(system)).encode("utf-8")).hexdigest()[:12]


def first_user(messages: list[dict]) -> str:
    """The first user turn's text (stripped), "" if there is none."""
    return _text(next((m for m in messages if m.get("role") == "user"), None))


def quotes(prose: str, messages: list[dict]) -> bool:
    """Whether ``messages`` quote a line of ``prose`` of at least ``MIN_QUOTE_CHARS`` characters (tags removed)."""
    lines = [line.strip() for line in _TAG.sub("\n", prose).splitlines()]
    lines = [line for line in lines if len(line) >= MIN_QUOTE_CHARS]
    if not lines:
        return False
    text = "\n".join(_text(m) for m in messages)
    return any(line in text for line in lines)


def _leaves(value: object) -> list[str]:
    """The names and primitive values in a tool call's arguments, as text."""
    if isinstance(value, dict):
        return [text for k, v in value.items() for text in (str(k), *_leaves(v))]
    if isinstance(value, list):
        return [text for v in value for text in _leaves(v)]
    return [value if isinstance(value, str) else json.dumps(value)]


def resends(turn: dict, answer: dict) -> bool:
    """Whether assistant ``turn`` re-sends ``answer`` (both in ``tito.normalize_message``'s form): verbatim, or
    changed as harnesses re-send a turn: its text starting with the answer's text (a stop string appended), each
    of its tool calls re-sent as a call or written out in the text (name, argument names and values)."""
    if turn == answer:
        return True
    if not answer.get("content") and not answer.get("tool_calls"):
        return False  # an empty answer is re-sent only verbatim
    text = turn.get("content", "")
    if not text.startswith(answer.get("content", "")):
        return False
    calls = turn.get("tool_calls", [])
    return all(
        call in calls or all(part in text for part in (call[0], *_leaves(call[1])))
        for call in answer.get("tool_calls", [])
    )


def restates(normalized: list[dict], history: list[dict], answers: dict[int, list[dict]]) -> bool:
    """Rule 2: whether a new conversation restates a known one's history under another system prompt.

    ``normalized``: the new conversation's messages; ``history``: the known conversation's; ``answers``: for each
    turn its agent answered, its index into ``history`` (``len(history)`` for its last call's answer) and the
    answer (its n > 1 choices), all in ``tito.normalize_message``'s form. True if, system prompts aside,
    ``normalized`` repeats ``history`` up to one of those turns (at least one message) and re-sends the answer
    there (``resends``).
    """
    mine = normalized[1:] if normalized and normalized[0].get("role") == "system" else normalized
    skip = 1 if history and history[0].get("role") == "system" else 0
    for index, choices in answers.items():
        k = index - skip
        if 0 < k < len(mine) and mine[k].get("role") == "assistant" and mine[:k] == history[skip:index]:
            if any(resends(mine[k], answer) for answer in choices):
                return True
    return False


def is_auxiliary(messages: list[dict], tools: list[dict] | None, tooled_agent_known: bool) -> bool:
    """Rule 3: a tool-less new conversation after a tool-using agent, or one carrying a utility marker."""
    if tools:
        return False
    if tooled_agent_known:
        return True
    head = " ".join(_text(m) for m in messages[:1] if m.get("role") == "system") + " " + first_user(messages)
    head = " ".join(head.lower().split())
    return any(marker in head for marker in AUXILIARY_MARKERS)


@dataclass
class Agent:
    """What an execution remembers of one agent: how new conversations are matched to it (rules 4 and 5)."""

    thread_id: str
    base: str  # the thread header's name (or "main")
    key: str  # system_key of its conversations
    first_user: str  # the first user turn of its first conversation
    auxiliary: bool
    tools: bool  # it offered tools
    last_prose: str = ""  # its last answer's text if that answer called no tool, else ""


def agent_name(base: str, key: str, auxiliary: bool, taken: set[str]) -> str:
    """Rule 5's name of a new agent, given the thread ids ``taken`` by earlier agents."""
    if not auxiliary and base not in taken:
        return base
    name = f"{base}~{key}"
    n = 1
    while name in taken:
        n += 1
        name = f"{base}~{key}.{n}"
    return name


def match_agent(
    agents: list[Agent], base: str, key: str, auxiliary: bool, messages: list[dict], last: Agent | None
) -> Agent | None:
    """Rule 4: the agent of the same kind (``auxiliary`` or not) that a new conversation of ``base`` with ``key``
    continues, or None. ``agents``: the execution's, least recently active first; ``last``: the agent whose
    answer was recorded last under ``base`` (only it can have just written a summary to restart from)."""
    same = [a for a in agents if a.base == base and a.key == key and a.auxiliary == auxiliary]
    user = first_user(messages)
    for agent in reversed(same):
        if agent.first_user == user:
            return agent
    if last is not None and last.last_prose and quotes(last.last_prose, messages):
        if last in same:
            return last
        return same[-1] if same else None
    return None
