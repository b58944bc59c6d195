"""Token-in/token-out prompt building: earlier turns are reused as the exact ids the policy saw and made.

When a call's messages extend the previous call of the same thread (same earlier messages, then the
assistant message the proxy returned), the new prompt is ``previous prompt ids + previous completion
ids`` followed by the template rendering of only the new messages. Nothing generated is
re-tokenized, so the trainer trains on what the policy produced. Any other call (a summary, a
sub-agent, a retry with edited history) is rendered in full and starts a new branch.

A client that re-sends the assistant turn with text appended (smolagents appends the stop string it cut)
still continues: when the re-sent turn's text starts with the returned text, the previous ids are reused
up to there (without a trailing ``<|im_end|>``) and only the appended rest is tokenized. A call with
several choices (n > 1) remembers each: the next call may continue any of them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gyre_jax.proxy import chat_template


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
    completion_text: str = ""  # the returned turn's text (decode of the turn's forced + completion ids)
    alternatives: tuple[ThreadState, ...] = ()  # the same call's other choices (n > 1)


@dataclass
class PromptBuild:
    prompt_ids: list[int]
    reused_prefix_len: int  # leading ids copied verbatim from the previous call (0 for a new branch)
    continued: bool


def tools_key(tools: list[dict] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


def build_prompt(
    tokenizer: Tokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    state: ThreadState | None,
    enable_thinking: bool | None = None,
    tools_format: str = "qwen3",
) -> PromptBuild:
    """Prompt ids for ``messages``, reusing ``state``'s (or one of its alternatives') exact ids when the
    conversation continues it."""
    candidates = [] if state is None else [state, *state.alternatives]
    for candidate in candidates:
        build = _continue(tokenizer, messages, tools, candidate, enable_thinking, tools_format)
        if build is not None:
            return build
    text = chat_template.render(
        messages, tools, add_generation_prompt=True, enable_thinking=enable_thinking, tools_format=tools_format
    )
    return PromptBuild(prompt_ids=tokenizer.encode(text), reused_prefix_len=0, continued=False)


def _continue(
    tokenizer: Tokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    state: ThreadState,
    enable_thinking: bool | None,
    tools_format: str,
) -> PromptBuild | None:
    """The prompt continuing ``state`` (its ids, then the new messages rendered), or None if it does not."""
    k = len(state.messages)
    if tools_key(tools) != state.tools_key or len(messages) <= k:
        return None
    if [normalize_message(m) for m in messages[:k]] != state.messages:
        return None
    im_end = tokenizer.token_id(chat_template.IM_END)
    ids = list(state.prompt_ids) + list(state.completion_ids)
    if normalize_message(messages[k]) == state.returned:
        if not state.finished or not ids or ids[-1] != im_end:
            ids += tokenizer.encode(chat_template.IM_END)  # the turn was cut (length, stop string) or ended otherwise
    else:
        resent = _resent_text(messages[k])
        if resent is None or not state.completion_text or not resent.startswith(state.completion_text):
            return None
        if ids and ids[-1] == im_end:
            ids.pop()  # the client appended text after the end of the turn: reuse up to it
        reused = len(ids)
        ids += tokenizer.encode(resent[len(state.completion_text) :] + chat_template.IM_END)
        return _with_suffix(tokenizer, ids, reused, messages, tools, k, enable_thinking, tools_format)
    return _with_suffix(tokenizer, ids, len(ids), messages, tools, k, enable_thinking, tools_format)


def _resent_text(message: dict) -> str | None:
    """The re-sent assistant turn as the model would have generated it; None if it is not an assistant turn."""
    if message.get("role") != "assistant":
        return None
    try:
        return assistant_completion_text(message)
    except ValueError:
        return None


def _with_suffix(
    tokenizer: Tokenizer,
    ids: list[int],
    reused: int,
    messages: list[dict],
    tools: list[dict] | None,
    k: int,
    enable_thinking: bool | None,
    tools_format: str,
) -> PromptBuild:
    """``ids`` (ending with the continued turn's ``<|im_end|>``) followed by the messages after ``messages[k]``."""
    suffix = chat_template.render_segments(messages, tools, tools_format)[k + 1 :]
    ids += tokenizer.encode("\n" + "".join(suffix) + chat_template.generation_prompt(enable_thinking))
    return PromptBuild(prompt_ids=ids, reused_prefix_len=reused, continued=True)


@dataclass
class Conversation:
    """A demonstration rendered exactly as the proxy would have served it, call by call."""

    ids: list[int] = field(default_factory=list)
    trainable: list[bool] = field(default_factory=list)  # True on assistant-generated ids (incl. <|im_end|>)


def render_demonstration(
    tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None, tools_format: str = "qwen3"
) -> Conversation:
    """Token ids of a whole conversation as TITO builds it, with the assistant completions marked trainable."""
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
        )
    return conv
