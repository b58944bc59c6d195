"""Token-in/token-out prompt building: earlier turns are reused as the exact ids the policy saw and made.

When a call's messages extend the last call of a live conversation (same tools, same earlier messages, then
the assistant message the proxy returned; ``identity.Execution.place`` picks the longest such conversation
among the several each thread keeps), the new prompt is ``previous prompt ids + previous completion
ids`` followed by the template rendering of only the new messages. Nothing generated is
re-tokenized, so the trainer trains on what the policy produced. Any other call (a summary, a
sub-agent, a retry with edited history) is rendered in full and starts a new branch.
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
    """What the proxy remembers of a conversation's last call: bounded by one context, however long the run."""

    messages: list[dict]  # normalized messages of the last request
    tools_key: str  # canonical JSON of the tools of the last request
    prompt_ids: list[int]
    completion_ids: list[int]
    returned: dict  # normalized assistant message the proxy returned
    finished: bool  # the completion ended with a stop token


CallPoint = tuple[int, int, int, bool]  # an earlier call: (its messages, prompt ids, completion ids, finished)


def call_point(state: ThreadState) -> CallPoint:
    return (len(state.messages), len(state.prompt_ids), len(state.completion_ids), state.finished)


def _common_len(a: list[dict], b: list[dict]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass
class LiveConversation:
    """A conversation the proxy can continue token-in/token-out from its last call *or any earlier one*.

    ``latest`` is its last call; ``points`` its earlier calls (oldest first) as offsets into ``latest``: each
    earlier call's messages, returned turn, prompt and completion ids are prefixes of ``latest``'s (that is what
    continuing them meant), so a fork from any of them (a retry, a summary request re-sending an earlier point)
    reuses its ids at the cost of four integers per call.
    """

    thread_id: str
    latest: ThreadState
    points: tuple[CallPoint, ...] = ()

    def match(self, normalized: list[dict], key: str) -> tuple[int, ThreadState, tuple[CallPoint, ...]] | None:
        """The call of this conversation that a request (``normalized`` messages, tools ``key``) extends, latest
        or else the latest earlier one: ``(its message count, its state, the call points before it and it)``."""
        latest = self.latest
        if key != latest.tools_key:
            return None
        common = _common_len(normalized, latest.messages)
        k = len(latest.messages)
        if common == k and len(normalized) > k and normalized[k] == latest.returned:
            return k, latest, (*self.points, call_point(latest))
        for i in range(len(self.points) - 1, -1, -1):
            k, p, c, finished = self.points[i]
            if k < common:  # its messages and the turn it returned (latest.messages[k]) are re-sent verbatim
                state = ThreadState(latest.messages[:k], key, latest.prompt_ids[:p], latest.prompt_ids[p : p + c],
                                    latest.messages[k], finished)  # fmt: skip
                return k, state, self.points[: i + 1]
        return None


@dataclass
class PromptBuild:
    prompt_ids: list[int]
    reused_prefix_len: int  # leading ids copied verbatim from the previous call (0 for a new branch)
    continued: bool


def tools_key(tools: list[dict] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


def extends(state: ThreadState, normalized: list[dict], key: str) -> bool:
    """Whether a call with ``normalized`` messages (``normalize_message``; at least the first ``len(state.messages)
    + 1`` of them) and tools ``key`` (``tools_key``) continues ``state``: same tools, the same earlier messages,
    then the assistant message the proxy returned for it."""
    k = len(state.messages)
    return (
        key == state.tools_key
        and len(normalized) > k
        and normalized[k] == state.returned
        and normalized[:k] == state.messages
    )


def build_prompt(
    tokenizer: Tokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    state: ThreadState | None,
    enable_thinking: bool | None = None,
    tools_format: str = "qwen3",
) -> PromptBuild:
    """Prompt ids for ``messages``, reusing ``state``'s exact ids when the conversation continues it."""
    if state is not None:
        k = len(state.messages)
        if extends(state, [normalize_message(m) for m in messages[: k + 1]], tools_key(tools)):
            ids = list(state.prompt_ids) + list(state.completion_ids)
            if not state.finished or not ids or ids[-1] != tokenizer.token_id(chat_template.IM_END):
                ids += tokenizer.encode(chat_template.IM_END)  # the turn was cut (length) or ended otherwise
            reused = len(ids)
            suffix = chat_template.render_segments(messages, tools, tools_format)[k + 1 :]
            ids += tokenizer.encode("\n" + "".join(suffix) + chat_template.generation_prompt(enable_thinking))
            return PromptBuild(prompt_ids=ids, reused_prefix_len=reused, continued=True)
    text = chat_template.render(
        messages, tools, add_generation_prompt=True, enable_thinking=enable_thinking, tools_format=tools_format
    )
    return PromptBuild(prompt_ids=tokenizer.encode(text), reused_prefix_len=0, continued=False)


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
