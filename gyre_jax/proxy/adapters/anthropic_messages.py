"""Anthropic Messages (``POST /v1/messages`` and ``/v1/messages/count_tokens``): request validation, conversion,
the ``message`` body and SSE events, and the adapter joining them to the pipeline.

Owns the mapping between Anthropic's content blocks and the internal (OpenAI-style) message form that
the chat template renders and token-in/token-out compares:

    system (string or text blocks)      -> {"role": "system", "content": text}            (first message)
    user text blocks                    -> {"role": "user", "content": texts joined by "\\n\\n"}
    user tool_result blocks             -> {"role": "tool", "tool_call_id": id, "content": text}, before the text
    a "system" message (Claude Code)    -> {"role": "system", "content": text}            (rendered in place)
    assistant thinking blocks           -> "reasoning_content" (joined by "\\n")
    assistant text blocks               -> "content"
    assistant tool_use blocks           -> "tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}]
    tools [{name, description, input_schema}] -> [{"type": "function", "function": {name, description, parameters}}]

and back: a parsed completion becomes thinking / text / tool_use blocks, returned as one ``message`` object
or as the SSE event sequence (``message_start``, per block ``content_block_start`` / ``_delta`` /
``_stop``, ``message_delta`` with ``stop_reason`` and ``usage``, ``message_stop``; ``ping`` while
waiting), thinking and text deltas streamed as they are sampled, tool_use blocks at the end. Unknown request fields (``metadata``, ``context_management``, ``output_config``,
``cache_control`` ...) are ignored. Images, documents and server tools fail with "not supported yet".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from typing import Any

from pydantic import Field

from gyre_jax.proxy import sse
from gyre_jax.proxy.adapters.base import Lenient, StreamWriter, TurnAdapter
from gyre_jax.proxy.chat_template import ParsedCompletion, tojson
from gyre_jax.proxy.errors import ProxyError
from gyre_jax.proxy.sampling import stop_strings
from gyre_jax.proxy.turns import Completion, Delta, Turn, TurnRequest

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}  # internal -> Anthropic
MAX_STOP_SEQUENCES = 64  # each is checked after every generated token


def stop_reason(completion: Completion) -> str:
    """``end_turn`` | ``stop_sequence`` (one of the request's ``stop_sequences`` ended it) | ``max_tokens`` |
    ``tool_use``."""
    if completion.finish_reason == "stop" and completion.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS[completion.finish_reason]


def internal_tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Anthropic ``tool_choice`` in the internal (OpenAI chat) form: auto, none, any -> required, tool -> named."""
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return kind


class TextBlock(Lenient):
    type: str
    text: str


class AnthropicMessage(Lenient):
    role: str = Field(pattern="^(user|assistant|system)$")
    content: str | list[dict[str, Any]]


class AnthropicTool(Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ThinkingConfig(Lenient):
    type: str = Field(pattern="^(enabled|disabled|adaptive)$")
    budget_tokens: int | None = None


class MessagesRequest(Lenient):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool | None = None


class CountTokensRequest(Lenient):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    thinking: ThinkingConfig | None = None


# ----------------------------------------------------------------------------------------------------------------------
# Request -> internal messages


def _system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system
    return "\n\n".join(block.text for block in system if block.type == "text")


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise ValueError(f"{where}: a content block must be an object with a string 'type'")
    return block["type"]


def _text_of(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise ValueError(f"{where}: a text block needs a string 'text'")
    return text


def _tool_result_text(block: dict, where: str) -> str:
    content = block.get("content", "")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: tool_result 'content' must be a string or a list of text blocks")
    parts = []
    for k, part in enumerate(content):
        kind = _block_type(part, f"{where}.content.{k}")
        if kind != "text":
            raise ValueError(f"{where}.content.{k}: not supported yet: {kind!r} blocks in a tool_result; send text")
        parts.append(_text_of(part, f"{where}.content.{k}"))
    return "\n\n".join(parts)


def _user_messages(content: list[dict], where: str) -> list[dict[str, Any]]:
    tool_messages, texts = [], []
    for k, block in enumerate(content):
        at = f"{where}.content.{k}"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"{at}: a tool_result block needs a string 'tool_use_id'")
            tool_messages.append({"role": "tool", "tool_call_id": call_id, "content": _tool_result_text(block, at)})
        else:
            raise ValueError(
                f"{at}: not supported yet: {kind!r} blocks in a user message; send text or tool_result blocks"
            )
    out = list(tool_messages)
    if texts or not tool_messages:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def _assistant_message(content: list[dict], where: str) -> dict[str, Any]:
    texts, thoughts, calls = [], [], []
    for k, block in enumerate(content):
        at = f"{where}.content.{k}"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "thinking":
            thinking = block.get("thinking")
            if not isinstance(thinking, str):
                raise ValueError(f"{at}: a thinking block needs a string 'thinking'")
            thoughts.append(thinking)
        elif kind == "redacted_thinking":
            continue  # opaque to us; nothing of it was generated by this policy
        elif kind == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, dict):
                raise ValueError(f"{at}: a tool_use block needs a string 'id', a string 'name' and an object 'input'")
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": tojson(args)}})
        else:
            raise ValueError(f"{at}: not supported yet: {kind!r} blocks in an assistant message")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def convert_tools(tools: list[AnthropicTool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for k, tool in enumerate(tools):
        if tool.type not in (None, "custom") and tool.input_schema is None:
            raise ValueError(
                f"tools.{k}: not supported yet: server tool {tool.type!r}; send client tools with an input_schema"
            )
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = (
            tool.input_schema if tool.input_schema is not None else {"type": "object", "properties": {}}
        )
        out.append({"type": "function", "function": function})
    return out


def to_internal(req: MessagesRequest | CountTokensRequest) -> TurnRequest:
    """The request's conversation, tools, thinking switch and tool choice as a turn (sampling not yet filled in).

    Raises ValueError naming what is wrong (``messages.2.content.0: ...``).
    """
    messages: list[dict[str, Any]] = []
    system = _system_text(req.system)
    if system is not None:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        where = f"messages.{i}"
        content = message.content
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if message.role == "user":
            messages.extend(_user_messages(content, where))
        elif message.role == "assistant":
            messages.append(_assistant_message(content, where))
        else:  # "system" inside messages (sent by current Claude Code): a system turn in place
            texts = []
            for k, block in enumerate(content):
                if _block_type(block, f"{where}.content.{k}") != "text":
                    raise ValueError(f"{where}.content.{k}: a system message may only hold text blocks")
                texts.append(_text_of(block, f"{where}.content.{k}"))
            messages.append({"role": "system", "content": "\n\n".join(texts)})
    thinking = req.thinking.type if req.thinking is not None else None
    choice = internal_tool_choice(getattr(req, "tool_choice", None))
    return TurnRequest(
        api="messages",
        messages=messages,
        tools=convert_tools(req.tools),
        enable_thinking=False if thinking == "disabled" else None,
        parse_tools=choice != "none",  # False for tool_choice {"type": "none"}
        tool_choice=choice,
        wire=req,
    )


def check_supported(req: MessagesRequest) -> None:
    """Raises ValueError for valid Anthropic features this proxy does not implement."""
    choice = req.tool_choice
    if choice is not None and choice.get("type") not in ("auto", "any", "tool", "none"):
        raise ValueError(f"tool_choice {choice!r}: expected type 'auto', 'any', 'tool' or 'none'")
    if choice is not None and choice.get("type") == "tool" and not isinstance(choice.get("name"), str):
        raise ValueError(f"tool_choice {choice!r}: type 'tool' needs the tool's 'name'")


# ----------------------------------------------------------------------------------------------------------------------
# Completion -> Anthropic content blocks, message and SSE events


def tool_use_id(openai_id: str) -> str:
    return "toolu_" + openai_id.removeprefix("call_")


def signature(thinking: str) -> str:
    """A stable signature for a thinking block (clients send it back; the proxy never checks it)."""
    return "gyre-" + hashlib.sha256(thinking.encode("utf-8")).hexdigest()[:32]


def content_blocks(parsed: ParsedCompletion) -> list[dict[str, Any]]:
    """thinking (if the model thought), text (if any), then one tool_use block per tool call."""
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": signature(parsed.reasoning)})
    if parsed.content or not parsed.tool_calls:
        blocks.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        fn = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call["id"]),
                "name": fn["name"],
                "input": json.loads(fn["arguments"]),
            }
        )
    return blocks


def message_body(
    message_id: str,
    model: str,
    blocks: list[dict[str, Any]] | None,
    stop_reason: str | None,
    input_tokens: int,
    output_tokens: int,
    stop_sequence: str | None = None,
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks if blocks is not None else [],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    }


PING = sse.event("ping", {"type": "ping"})


def block_event(kind: str, index: int, **fields: Any) -> str:
    """``content_block_start`` / ``_delta`` / ``_stop`` of block ``index``."""
    return sse.event(kind, {"type": kind, "index": index, **fields})


class MessageStreamWriter(StreamWriter):
    """Anthropic SSE: ``message_start`` and a ping at once; a thinking block then a text block, each opened by its
    first delta and streamed as sampled; at the end the open block's stop, one ``tool_use`` block per tool call
    (its input as one ``input_json_delta``), ``message_delta`` (stop reason, usage) and ``message_stop``."""

    def __init__(self, adapter: TurnAdapter, turn: Turn, reply_id: str) -> None:
        super().__init__(adapter, turn, reply_id)
        self.index = -1  # index of the newest block
        self.open_kind: str | None = None  # "thinking" | "text" while that block is open
        self.thinking = ""  # the thinking block's text so far
        self.had_text = False

    def open(self) -> list[str]:
        start = message_body(self.reply_id, self.model, None, None, self.turn.prompt_tokens, 0)
        return [sse.event("message_start", {"type": "message_start", "message": start}), PING]

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self._stop_open()
        self.index += 1
        self.open_kind = kind
        return events + [block_event("content_block_start", self.index, content_block=block)]

    def _stop_open(self) -> list[str]:
        events = []
        if self.open_kind == "thinking":
            delta = {"type": "signature_delta", "signature": signature(self.thinking)}
            events.append(block_event("content_block_delta", self.index, delta=delta))
        if self.open_kind is not None:
            events.append(block_event("content_block_stop", self.index))
        self.open_kind = None
        return events

    def delta(self, delta: Delta) -> list[str]:
        events = []
        if delta.reasoning:
            if self.open_kind != "thinking":
                events += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.thinking += delta.reasoning
            events.append(block_event("content_block_delta", self.index,
                                      delta={"type": "thinking_delta", "thinking": delta.reasoning}))  # fmt: skip
        if delta.content:
            if self.open_kind != "text":
                events += self._start("text", {"type": "text", "text": ""})
                self.had_text = True
            events.append(block_event("content_block_delta", self.index,
                                      delta={"type": "text_delta", "text": delta.content}))  # fmt: skip
        return events

    def close(self, completion: Completion) -> list[str]:
        parsed = completion.parsed
        assert parsed is not None
        events = []
        if parsed.reasoning is not None and self.index < 0:  # an empty thinking block, as the message body has it
            events += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        if not self.had_text and not parsed.tool_calls:  # a message always has a text block or a tool call
            events += self._start("text", {"type": "text", "text": ""})
        events += self._stop_open()
        for block in content_blocks(parsed):
            if block["type"] != "tool_use":
                continue
            self.index += 1
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            events.append(block_event("content_block_start", self.index, content_block=start))
            delta = {"type": "input_json_delta", "partial_json": tojson(block["input"])}
            events.append(block_event("content_block_delta", self.index, delta=delta))
            events.append(block_event("content_block_stop", self.index))
        end = {"stop_reason": stop_reason(completion), "stop_sequence": completion.stop_sequence}
        events.append(sse.event("message_delta", {"type": "message_delta", "delta": end,
                                                  "usage": {"output_tokens": completion.completion_tokens}}))  # fmt: skip
        events.append(sse.event("message_stop", {"type": "message_stop"}))
        return events


# ----------------------------------------------------------------------------------------------------------------------
# The adapter


class Messages(TurnAdapter):
    """``POST /v1/messages``: a chat turn; replies one ``message``, or its SSE events (``MessageStreamWriter``, pings
    while nothing comes). Also parses ``count_tokens`` bodies."""

    endpoint = "messages"

    request_schema = MessagesRequest

    error_style = "anthropic"
    keepalive = PING

    def parse(self, body: dict[str, Any]) -> TurnRequest:
        turn_request = self._convert(body, MessagesRequest)
        req = turn_request.wire
        try:
            stop = stop_strings(req.stop_sequences, MAX_STOP_SEQUENCES, "stop_sequences")
        except ValueError as exc:
            raise ProxyError(400, f"invalid messages request: {exc}") from None
        return dataclasses.replace(
            turn_request,
            stream=bool(req.stream),
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_tokens=req.max_tokens,
            stop=stop,
        )

    def parse_count_tokens(self, body: dict[str, Any]) -> TurnRequest:
        """A ``count_tokens`` body as the conversation to count (``TurnPipeline.count_tokens``); never run."""
        return self._convert(body, CountTokensRequest)

    def _convert(self, body: dict[str, Any], schema: type[MessagesRequest] | type[CountTokensRequest]) -> TurnRequest:
        req = self.validated(schema, body, "messages request", "the Anthropic Messages API")
        try:
            if isinstance(req, MessagesRequest):
                check_supported(req)
            return to_internal(req)
        except ValueError as exc:
            raise ProxyError(400, f"invalid messages request: {exc}") from None

    def reply_id(self) -> str:
        return "msg_" + uuid.uuid4().hex[:24]

    def respond(self, turn: Turn, completion: Completion) -> dict[str, Any]:
        assert completion.parsed is not None
        return message_body(
            self.reply_id(), self.model_name, content_blocks(completion.parsed), stop_reason(completion),
            turn.prompt_tokens, completion.completion_tokens, completion.stop_sequence,
        )  # fmt: skip

    def writer(self, turn: Turn, reply_id: str) -> StreamWriter:
        return MessageStreamWriter(self, turn, reply_id)

    def stream_error(self, err: ProxyError) -> str:
        return sse.event("error", self.error_body(err))

    @staticmethod
    def count_tokens_body(input_tokens: int) -> dict[str, Any]:
        return {"input_tokens": input_tokens}
