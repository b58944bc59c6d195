"""What a call is sampled with, and the pure rules of the sampling features every API shares.

- ``SamplingPolicy``: whose temperature / top-p / top-k a call is served with. ``client`` (the standalone
  proxy's default: tests, notebooks, evaluation) serves what the request asks; ``policy`` (a training run,
  ``proxy.sampling = "policy"``) serves the run's values whatever the harness asks. Either way the record
  keeps what the client asked (``client_sampling``).
- Stop strings: ``visible_len`` finds where the client's text ends when a stop string completed.
- ``tool_choice``: ``check_tool_choice`` validates the internal (OpenAI chat) form against the tools and
  ``forced_prefix`` is the text decoding is forced to start with.

Internal ``tool_choice`` (what every adapter translates to): ``"auto"`` | ``"none"`` | ``"required"`` |
``{"type": "function", "function": {"name": str}}`` (OpenAI chat's own forms; Anthropic ``any`` is
``required``, ``{"type": "tool", "name": n}`` the named function).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SAMPLING_MODES = ("policy", "client")
MAX_CHOICES = 16  # n per call: each choice is a whole generation and a record
TOOL_CALL_OPEN = '<tool_call>\n{"name": "'  # how the chat template opens a tool call (both tools formats)


@dataclass(frozen=True)
class SamplingPolicy:
    """Whose sampling values a call is served with (see the module docstring).

    ``mode`` "client": the request's temperature / top_p / top_k (None: 1.0 / 1.0 / off); "policy": this
    policy's ``temperature`` / ``top_p`` / ``top_k`` for every call. Stop strings, ``n``, ``tool_choice``,
    ``max_tokens`` and ``seed`` are always the client's (they shape the conversation, not the distribution).
    """

    mode: str = "client"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.mode not in SAMPLING_MODES:
            raise ValueError(f"sampling mode {self.mode!r} must be one of {SAMPLING_MODES}")
        if self.mode == "policy" and not self.temperature > 0:
            raise ValueError(f"a policy sampling temperature of {self.temperature} must be > 0 (RL needs sampling)")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] and top_k={self.top_k} >= 0 (0 disables it)")

    @classmethod
    def client(cls) -> SamplingPolicy:
        return cls("client")

    @classmethod
    def policy(cls, temperature: float, top_p: float = 1.0, top_k: int = 0) -> SamplingPolicy:
        return cls("policy", temperature, top_p, top_k)

    def resolve(self, temperature: float | None, top_p: float | None, top_k: int | None) -> tuple[float, float, int]:
        """(temperature, top_p, top_k) served for a request that asked for these (None: not sent)."""
        if self.mode == "policy":
            return self.temperature, self.top_p, self.top_k
        return (
            1.0 if temperature is None else float(temperature),
            1.0 if top_p is None else float(top_p),
            min(int(top_k or 0), 2**31 - 1),  # top-k past the vocabulary is no truncation; int32 on the device
        )


CLIENT = SamplingPolicy.client()  # the standalone proxy's default: serve what each request asks


def client_sampling(fields: dict[str, Any]) -> dict[str, Any] | None:
    """The record's ``client_sampling``: the fields of ``fields`` the client sent (not None, not empty), or
    None if it sent none. Stop strings are a list; ``tool_choice`` is in the internal form."""
    sent = {k: (list(v) if isinstance(v, tuple) else v) for k, v in fields.items() if v is not None and v != ()}
    return sent or None


def stop_strings(stop: str | Sequence[str] | None, limit: int | None, field: str) -> tuple[str, ...]:
    """A request's stop strings as a tuple (empty strings dropped: they would match at once); ValueError
    naming ``field`` if there are more than ``limit``."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else list(stop)
    if limit is not None and len(items) > limit:
        raise ValueError(f"{field}: at most {limit} stop sequences, got {len(items)}")
    return tuple(dict.fromkeys(s for s in items if s))


def visible_len(text: str, stops: Sequence[str]) -> tuple[int, str | None]:
    """Where the client's text ends: (index of the earliest stop string in ``text``, that string), or
    (len(text), None) if none occurs."""
    found = [(text.find(s), s) for s in stops if s in text]
    if not found:
        return len(text), None
    return min(found, key=lambda x: x[0])


def check_tool_choice(tool_choice: Any, tools: list[dict] | None) -> None:
    """Raises ValueError (what was wrong, what to send) if ``tool_choice`` cannot be served with ``tools``."""
    if tool_choice in (None, "auto", "none"):
        return
    names = [t.get("function", t).get("name") for t in tools or []]
    if tool_choice == "required":
        if not names:
            raise ValueError("tool_choice requires a tool call but the request has no tools; send tools or 'auto'")
        return
    name = forced_name(tool_choice)
    if name is None:
        raise ValueError(
            f"tool_choice {tool_choice!r}: expected 'auto', 'none', 'required' or "
            '{"type": "function", "function": {"name": ...}}'
        )
    if name not in names:
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools {names}")


def forced_name(tool_choice: Any) -> str | None:
    """The function name a named ``tool_choice`` forces (None for the string forms or a malformed one)."""
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        return None
    name = (tool_choice.get("function") or {}).get("name")
    return name if isinstance(name, str) and name else None


def forced_prefix(tool_choice: Any, tools: list[dict] | None, calls: Any = None) -> str:
    """The text the assistant turn is forced to start with: up to and including the name's closing quote
    and ``"arguments": `` when one function is allowed (named, or ``required`` with one tool), the tool
    call's opener (``<tool_call>\\n{"name": "``) when several are; "" when nothing is forced. ``calls``: the
    tool-call family (``chat_format.ToolCallFormat``: its own opener and arguments key); None: hermes."""
    name = forced_name(tool_choice)
    if name is None and tool_choice == "required":
        names = [t.get("function", t).get("name") for t in tools or []]
        name = names[0] if len(names) == 1 else None
        if name is None:
            return TOOL_CALL_OPEN if calls is None else calls.forced(None)
    if name is None:
        return ""
    return TOOL_CALL_OPEN + name + '", "arguments": ' if calls is None else calls.forced(name)
