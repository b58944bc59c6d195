"""Token-in/token-out prompt building: earlier turns are reused as the exact ids the policy saw and made.

When a call's messages extend a call of a live conversation (same tools, same earlier messages, then the
assistant message the proxy returned; ``identity.Execution.place`` picks the conversation with the longest such
call among the several each thread keeps, its last call or an earlier one), the new prompt is ``previous prompt
ids + previous completion ids`` followed by the template's text after that turn. Nothing generated is
re-tokenized, so the trainer trains on what the policy produced. Any other call (a summary, a
sub-agent, a retry with edited history) is rendered in full and starts a new branch.

This holds for any chat template (``chat_format``) that renders the history *stably* (``split_turn``: the earlier
call's prompt is a prefix of the conversation rendered with its turn, which is a prefix of the new rendering).
A template that re-renders the history (Qwen3 drops the reasoning of turns before the last user query) gets
what it renders: the call's prompt is the template's text of the whole conversation, its leading ids reused as
far as their text agrees, and it forks from the previous call there (a new branch of the same agent in the
trajectory tree); the previous records keep the ids the model produced, so no trained id was ever served as
other text.

A client that re-sends the assistant turn changed (smolagents appends the stop string it cut; another
may edit it) still continues as far as its text agrees: the previous prompt ids (the forced tool-call
opener included, if the re-sent turn starts with it) and the leading completion ids whose text the re-sent
turn starts with verbatim are reused, and only the rest of the re-sent turn is tokenized. A call with
several choices (n > 1) remembers each: the next call may continue any of them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gyre_jax.proxy import chat_format, chat_template


class Tokenizer(Protocol):
    """What the proxy needs of a tokenizer (the byte tokenizer, or a ``tokenizer.json`` wrapper).

    ``encode`` must map every special-token string in the text to its single id, and
    ``decode(encode(s)) == s`` must hold for rendered chat text.
    """

    @property
    def eos_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_id(self, token: str) -> int: ...


def assistant_completion_text(message: dict) -> str:
    """What the model generates for an assistant message (after ``<|im_start|>assistant\\n``, before ``<|im_end|>``)."""
    content = chat_template._content_text(message.get("content"))
    reasoning = message.get("reasoning_content")
    text = ""
    if reasoning:
        text += "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n"
    text += content
    for k, call in enumerate(message.get("tool_calls") or []):
        if (k == 0 and content) or k > 0:
            text += "\n"
        text += chat_template._render_tool_call(call)
    return text


def _normalize_args(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def normalize_message(message: dict) -> dict:
    """The parts of a message that determine its tokens (ids, names and key order of clients vary)."""
    out: dict[str, Any] = {
        "role": message.get("role"),
        "content": chat_template._content_text(message.get("content")).strip(),
    }
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        calls.append((fn.get("name"), _normalize_args(fn.get("arguments", {}))))
    if calls:
        out["tool_calls"] = calls
    return out


@dataclass
class ThreadState:
    """What the proxy remembers of a thread's last call: bounded by one context, however long the run."""

    messages: list[dict]  # normalized messages of the last request
    tools_key: str  # canonical JSON of the tools of the last request
    prompt_ids: list[int]
    completion_ids: list[int]
    returned: dict  # normalized assistant message the proxy returned
    finished: bool  # the completion ended with a stop token
    forced_text: str = ""  # text forced at the turn's start (tool_choice): the end of prompt_ids
    alternatives: tuple[ThreadState, ...] = ()  # the same call's other choices (n > 1)
    returned_message: dict | None = None  # the assistant message as returned (its reasoning: a client may drop it)


CallPoint = tuple[int, int, int]  # an earlier call: (its messages, prompt ids before its turn, its turn's ids)


def _common_len(a: list[dict], b: list[dict]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _resends(normalized: list[dict], k: int, returned: list[dict]) -> bool | None:
    """Whether ``normalized[k]`` re-sends one of the ``returned`` turns as returned (True), an assistant turn
    changed (False: ``build_prompt`` reuses it as far as its text agrees), or is no assistant turn (None)."""
    if len(normalized) <= k or normalized[k].get("role") != "assistant":
        return None
    return normalized[k] in returned


@dataclass
class LiveConversation:
    """A conversation the proxy can continue token-in/token-out from its last call *or any earlier one*.

    ``latest`` is its last call (its n > 1 choices in ``alternatives``); ``points`` its earlier calls (oldest
    first) as offsets into ``latest``: each earlier call's messages, prompt ids and turn, *as the call that
    continued it re-sent them* (``PromptBuild.point``: its forced opener and the kept tokens of its completion,
    the rest of a changed re-send tokenized), are prefixes of ``latest``'s, so a fork from any of them (a retry,
    a summary request re-sending an earlier point) reuses its ids at the cost of three integers per call.
    """

    thread_id: str
    latest: ThreadState
    points: tuple[CallPoint, ...] = ()

    def match(self, normalized: list[dict], key: str) -> tuple[int, bool, ThreadState, tuple[CallPoint, ...]] | None:
        """The call of this conversation that a request (``normalized`` messages, tools ``key``) extends, latest
        or else the latest earlier one: ``(its message count, whether its turn is re-sent verbatim, its state, the
        call points before it)``. A turn re-sent changed (``_resends``) still matches: the request continues the
        latest call whose earlier messages it repeats."""
        latest = self.latest
        if key != latest.tools_key:
            return None
        common = _common_len(normalized, latest.messages)
        k = len(latest.messages)
        exact = _resends(normalized, k, [c.returned for c in (latest, *latest.alternatives)])
        if common == k and exact is not None:
            return k, exact, latest, self.points
        for i in range(len(self.points) - 1, -1, -1):
            k, p, t = self.points[i]
            exact = _resends(normalized, k, [latest.messages[k]])  # the turn as it was re-sent after this call
            if k <= common and exact is not None:
                state = ThreadState(latest.messages[:k], key, latest.prompt_ids[:p], latest.prompt_ids[p : p + t],
                                    latest.messages[k], True)  # fmt: skip
                return k, exact, state, self.points[:i]
        return None


@dataclass
class PromptBuild:
    prompt_ids: list[int]
    reused_prefix_len: int  # leading ids copied verbatim from the previous call (0 for a new branch)
    continued: bool
    # where the continued call lies in ``prompt_ids``: (its messages, prompt ids before its turn, its turn's ids up to
    # and including <|im_end|>); a forced opener counts as turn (``LiveConversation.points``)
    point: CallPoint | None = None


def tools_key(tools: list[dict] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


def build_prompt(
    tokenizer: Tokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    state: ThreadState | None,
    enable_thinking: bool | None = None,
    tools_format: str | chat_format.ChatFormat = "qwen3",
) -> PromptBuild:
    """Prompt ids for ``messages``, reusing the exact ids of ``state`` (or of one of its alternatives, the
    choices of an n > 1 call) when the conversation continues it: one whose returned turn is re-sent as
    returned first, else the one of which the re-sent turn agrees longest. ``tools_format``: the chat format
    (``chat_format.ChatFormat``) or the name of a built-in one."""
    fmt = chat_format.of(tools_format)
    candidates = [state, *state.alternatives] if state is not None else []
    candidates = [c for c in candidates if _extends_history(messages, tools, c)]
    for candidate in candidates:
        if normalize_message(messages[len(candidate.messages)]) == candidate.returned:
            return _continue(tokenizer, messages, tools, candidate, enable_thinking, fmt, as_returned=True)
    builds = [_continue(tokenizer, messages, tools, c, enable_thinking, fmt, as_returned=False) for c in candidates]
    builds = [b for b in builds if b is not None]
    if builds:
        return max(builds, key=lambda b: b.reused_prefix_len)
    text = fmt.render(messages, tools, add_generation_prompt=True, enable_thinking=enable_thinking)
    return PromptBuild(prompt_ids=tokenizer.encode(text), reused_prefix_len=0, continued=False)


def _extends_history(messages: list[dict], tools: list[dict] | None, state: ThreadState) -> bool:
    """Whether ``messages`` repeat ``state``'s messages (same tools) and go on past its assistant turn."""
    k = len(state.messages)
    if tools_key(tools) != state.tools_key or len(messages) <= k:
        return False
    return [normalize_message(m) for m in messages[:k]] == state.messages


@dataclass(frozen=True)
class TurnSplit:
    """How the template renders the new conversation around its assistant turn ``k`` (``split_turn``).

    ``turn``: the turn's text as the template renders it there (after the generation prompt, before the end
    token); ``end``: the end-of-turn token's text; ``after``: the template's text after it, generation prompt
    included."""

    turn: str
    end: str
    after: str


def split_turn(
    tokenizer: Tokenizer, fmt: chat_format.ChatFormat, messages: list[dict], k: int, tools, enable_thinking
) -> TurnSplit | None:
    """Turn ``k`` (an assistant turn) of ``messages`` as the template renders the whole conversation, if it keeps
    the history before it *stably*: the prompt the earlier call was served (``messages[:k]`` + generation prompt)
    is a prefix of the new rendering. None when the template re-renders that history (Mistral Nemo writes the
    system prompt into the user turn only while it is the last message; Qwen3 with ``enable_thinking=False``
    served an empty ``<think>`` block that the history no longer shows), when the turn has no end-of-turn token,
    or when the partial conversation cannot be rendered."""
    try:
        head = fmt.render(messages[:k], tools, add_generation_prompt=True, enable_thinking=enable_thinking)
        full = fmt.render(messages, tools, add_generation_prompt=True, enable_thinking=enable_thinking)
    except ValueError:
        return None
    if not full.startswith(head):
        return None
    ends = {tokenizer.decode([i]) for i in tokenizer.eos_ids} - {""}
    found = [(full.find(e, len(head)), e) for e in ends]
    found = [f for f in found if f[0] >= 0]
    if not found:
        return None
    pos, end = min(found, key=lambda f: (f[0], -len(f[1])))
    return TurnSplit(full[len(head) : pos], end, full[pos + len(end) :])


def _with_reasoning(messages: list[dict], k: int, state: ThreadState) -> list[dict]:
    """``messages`` with turn ``k`` given the reasoning the proxy returned for it when the client re-sent it
    without (OpenAI chat clients drop ``reasoning_content``): the turn is what the model produced."""
    reasoning = (state.returned_message or {}).get("reasoning_content")
    message = messages[k]
    if not reasoning or message.get("reasoning_content") or message.get("reasoning"):
        return messages
    return [*messages[:k], {**message, "reasoning_content": reasoning}, *messages[k + 1 :]]


def _continue(
    tokenizer: Tokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    state: ThreadState,
    enable_thinking: bool | None,
    fmt: chat_format.ChatFormat,
    as_returned: bool,
) -> PromptBuild | None:
    """The prompt continuing ``state`` (its turn re-sent ``as_returned``, or changed).

    Where the template renders the history stably (``split_turn``) and still shows the turn's reasoning:
    ``state``'s prompt ids, its turn's ids (the forced opener, then the completion: as returned, all of them and the
    end token, whatever formatting the template would give the turn; changed, as far as the re-sent text agrees, the
    rest of that text tokenized), then the template's text after the turn. Where it re-renders the history or drops
    the turn's reasoning: the template's rendering of the whole conversation, its leading ids taken from ``state`` as far as
    their text agrees; the call then forks from ``state`` (``continued`` False: the trajectory tree makes it a
    branch; the earlier records keep the ids the model produced)."""
    k = len(state.messages)
    if not as_returned and messages[k].get("role") != "assistant":
        return None
    msgs = _with_reasoning(messages, k, state) if as_returned else messages
    prompt, turn = _split_turn(tokenizer, state)
    split = split_turn(tokenizer, fmt, msgs, k, tools, enable_thinking)
    reasoning = str(msgs[k].get("reasoning_content") or "").strip()
    if split is not None and as_returned and reasoning and reasoning not in split.turn:
        split = None  # the template drops this turn's reasoning now (Qwen3: a new user query came): re-rendered
    if split is None:
        full = fmt.render(msgs, tools, add_generation_prompt=True, enable_thinking=enable_thinking)
        prior = prompt + turn
        agree = whole_tokens(tokenizer, prior, full)
        ids = prior[:agree] + tokenizer.encode(full[len(tokenizer.decode(prior[:agree])) :])
        return PromptBuild(prompt_ids=ids, reused_prefix_len=agree, continued=False)
    end_ids = tokenizer.encode(split.end)
    ends_turn = len(end_ids) == 1 and bool(turn) and turn[-1] == end_ids[0]
    if as_returned:
        ids = prompt + turn + ([] if state.finished and ends_turn else end_ids)
        reused = len(ids)
    else:
        if ends_turn:
            turn = turn[:-1]
        agree = whole_tokens(tokenizer, turn, split.turn)
        ids = prompt + turn[:agree]
        reused = len(ids)
        ids += tokenizer.encode(split.turn[len(tokenizer.decode(turn[:agree])) :] + split.end)
    point = (k, len(prompt), len(ids) - len(prompt))
    ids += tokenizer.encode(split.after)
    return PromptBuild(prompt_ids=ids, reused_prefix_len=reused, continued=True, point=point)


def _split_turn(tokenizer: Tokenizer, state: ThreadState) -> tuple[list[int], list[int]]:
    """``state``'s prompt ids before its assistant turn, and the turn's ids: the forced opener (``forced_text``,
    the end of its prompt ids), then the completion ids."""
    start = len(state.prompt_ids) - (len(tokenizer.encode(state.forced_text)) if state.forced_text else 0)
    return list(state.prompt_ids[:start]), list(state.prompt_ids[start:]) + list(state.completion_ids)


def whole_tokens(tokenizer: Tokenizer, ids: Sequence[int], text: str) -> int:
    """The most leading ``ids`` whose decoded text ``text`` starts with (whole tokens; O(log N) decodes)."""
    full = tokenizer.decode(list(ids))
    if text.startswith(full):
        return len(ids)
    agree = next((i for i, (a, b) in enumerate(zip(full, text)) if a != b), min(len(full), len(text)))
    lo, hi = 0, len(ids)  # the most ids whose text is no longer than the agreeing characters
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.decode(list(ids[:mid]))) <= agree:
            lo = mid
        else:
            hi = mid - 1
    while lo > 0 and not text.startswith(tokenizer.decode(list(ids[:lo]))):
        lo -= 1  # a token cut inside a character decodes to U+FFFD: step back to a whole one
    return lo


@dataclass
class Conversation:
    """A demonstration rendered exactly as the proxy would have served it, call by call."""

    ids: list[int] = field(default_factory=list)
    trainable: list[bool] = field(default_factory=list)  # True on assistant-generated ids (incl. <|im_end|>)


def render_demonstration(
    tokenizer: Tokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    tools_format: str | chat_format.ChatFormat = "qwen3",
) -> Conversation:
    """Token ids of a whole conversation as TITO builds it, with the assistant completions marked trainable
    (built-in formats: the completion text as ``assistant_completion_text`` writes it, ended by ``<|im_end|>``)."""
    im_end = tokenizer.token_id(chat_template.IM_END)
    state: ThreadState | None = None
    conv = Conversation()
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        build = build_prompt(tokenizer, messages[:i], tools, state, tools_format=tools_format)
        completion = tokenizer.encode(assistant_completion_text(message)) + [im_end]
        if not build.continued:
            conv = Conversation()  # a new branch: demonstrations here are single-branch
        new_prompt = build.prompt_ids[len(conv.ids) :]
        conv.ids += new_prompt + completion
        conv.trainable += [False] * len(new_prompt) + [True] * len(completion)
        state = ThreadState(
            messages=[normalize_message(m) for m in messages[:i]],
            tools_key=tools_key(tools),
            prompt_ids=build.prompt_ids,
            completion_ids=completion,
            returned=normalize_message(message),
            finished=True,
            returned_message=message,
        )
    return conv
