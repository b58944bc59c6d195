"""OpenAI Responses (``POST /v1/responses``): request validation, input items to internal messages, the ``response``
object and its SSE event sequence, and the adapter joining them to the pipeline.

Owns the mapping between Responses items and the internal (OpenAI chat) messages the chat template renders and
token-in/token-out compares, so that a client re-sending the previous output as items (``store: false``, the
whole history every call, as Codex CLI does) continues its thread on the exact previous ids:

    instructions                          -> {"role": "system", "content": instructions}             (first)
    input as a string                     -> {"role": "user", "content": input}
    message user / system / developer     -> {"role": "user" | "system", "content": text parts joined by "\\n\\n"}
    one assistant turn: the consecutive reasoning, assistant message and function_call items after a user or
    tool message                          -> {"role": "assistant", "content": output_text parts joined,
                                              "reasoning_content": reasoning text (its reasoning_text content,
                                              else its summary texts, joined by "\\n"),
                                              "tool_calls": [{"id": call_id, "type": "function",
                                                              "function": {"name", "arguments"}}]}
    function_call_output                  -> {"role": "tool", "tool_call_id": call_id, "content": output}
    tools of type "function" (flat)       -> [{"type": "function", "function": {name, description, parameters}}]

Tools of any other type (``local_shell``, ``web_search``, ``custom`` ...) are ignored: the model is offered
only the function tools (Codex CLI sends such tools and works without them). ``tool_choice`` is served as
for chat (``sampling.py``): ``auto``, ``none``, ``required`` and ``{"type": "function", "name": ...}`` (the
reply then starts with that call's forced opener); other forms (hosted tools, ``allowed_tools``),
``previous_response_id`` (nothing is stored: send the whole history) and non-text input parts are refused
with a 400 "not supported yet". ``temperature`` / ``top_p`` are served under the sampling policy and kept in
the record's ``client_sampling`` with ``tool_choice``; the API has no ``n``, ``stop`` or ``seed``.
``parallel_tool_calls`` is echoed, not enforced (the model may make several calls either way). ``store``,
``include``, ``text``, ``reasoning``, ``prompt_cache_key``, ``metadata``, ``truncation`` are accepted and
ignored.

A completion comes back as output items: ``reasoning`` (its text as ``reasoning_text`` content) if the model
thought, ``message`` with one ``output_text`` part (if it wrote text, or made no call), one ``function_call``
per tool call; streamed as ``response.created``, ``response.in_progress``, per item ``output_item.added`` /
(``content_part.added``, ``reasoning_text.delta`` or ``output_text.delta`` live, ``*.done``,
``content_part.done``) or (``function_call_arguments.delta`` / ``.done``) / ``output_item.done``, then
``response.completed`` with the whole response (``status: "incomplete"`` when the token budget ended it).
Every event carries a ``sequence_number``. A failure after the stream started sends ``error`` and
``response.failed``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import Field

from gyre_jax.proxy import sse
from gyre_jax.proxy.adapters.base import Lenient, StreamWriter, TurnAdapter
from gyre_jax.proxy.chat_template import ParsedCompletion
from gyre_jax.proxy.errors import ProxyError
from gyre_jax.proxy.turns import Completion, Delta, Turn, TurnRequest

DOCS = "the OpenAI Responses API"


class ResponsesRequest(Lenient):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# ----------------------------------------------------------------------------------------------------------------------
# Request -> internal messages and tools


def check_responses_supported(req: ResponsesRequest) -> None:
    """Rejects valid Responses features this proxy does not implement, rather than silently ignoring them."""
    if req.previous_response_id is not None:
        raise ProxyError(400, "not supported yet: previous_response_id; send the whole history (store=false)",
                         param="previous_response_id")  # fmt: skip
    choice = req.tool_choice
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        raise ProxyError(400, f"tool_choice={choice!r}: expected 'auto', 'none', 'required' or "
                         '{"type": "function", "name": ...}', param="tool_choice")  # fmt: skip
    if isinstance(choice, dict) and (choice.get("type") != "function" or not isinstance(choice.get("name"), str)):
        raise ProxyError(400, f"not supported yet: tool_choice={choice!r}; use 'auto', 'none', 'required' or "
                         '{"type": "function", "name": ...} naming a function tool', param="tool_choice")  # fmt: skip


def internal_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses ``tool_choice`` in the internal (OpenAI chat) form: the strings as they are, a named function
    ``{"type": "function", "name": n}`` as ``{"type": "function", "function": {"name": n}}``."""
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def content_text(content: Any, where: str, joiner: str) -> str:
    """A message's text: a string, or its text parts (input_text / output_text / text) joined by ``joiner``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content: expected a string or a list of content parts")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise ValueError(f"{where}.content.{k}: not supported yet: {kind!r} parts; send input_text/output_text")
    return joiner.join(texts)


def reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text content if it has any, else its summary texts."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise ValueError(f"{where}: a reasoning item's content and summary must be lists of text parts")
    texts = [p.get("text") for p in parts if isinstance(p, dict)]
    if not all(isinstance(t, str) for t in texts):
        raise ValueError(f"{where}: reasoning parts need a string 'text'")
    return "\n".join(texts)


def _string_field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ValueError(f"{where}: a {item.get('type')} item needs a string {name!r}")
    return value


class _Conversation:
    """Builds internal messages from items in order; the open assistant turn collects its reasoning, text and calls."""

    def __init__(self, instructions: str | None) -> None:
        self.messages: list[dict[str, Any]] = []
        self.turn: dict[str, Any] | None = None  # the assistant message being built
        if instructions is not None:
            self.messages.append({"role": "system", "content": instructions})

    def assistant(self) -> dict[str, Any]:
        if self.turn is None:
            self.turn = {"role": "assistant", "content": ""}
            self.messages.append(self.turn)
        return self.turn

    def add(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        self.turn = None

    def item(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise ValueError(f"{where}: an input item must be an object")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"{where}: role {role!r} must be user, system, developer or assistant")
            if role == "assistant":
                self.assistant()["content"] += content_text(item.get("content"), where, "")
            else:
                text = content_text(item.get("content"), where, "\n\n")
                self.add({"role": "user" if role == "user" else "system", "content": text})
        elif kind == "reasoning":
            turn, text = self.assistant(), reasoning_text(item, where)
            turn["reasoning_content"] = turn["reasoning_content"] + "\n" + text if "reasoning_content" in turn else text
        elif kind == "function_call":
            call = {"id": _string_field(item, "call_id", where), "type": "function",
                    "function": {"name": _string_field(item, "name", where),
                                 "arguments": _string_field(item, "arguments", where)}}  # fmt: skip
            self.assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else content_text(output, f"{where}.output", "\n\n")
            self.add({"role": "tool", "tool_call_id": _string_field(item, "call_id", where), "content": text})
        else:
            raise ValueError(f"{where}: not supported yet: {kind!r} input items; send messages, reasoning, "
                             "function_call and function_call_output items")  # fmt: skip


def to_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's instructions and input as internal messages; raises ValueError naming the bad item."""
    conversation = _Conversation(req.instructions)
    if isinstance(req.input, str):
        conversation.add({"role": "user", "content": req.input})
    else:
        for i, item in enumerate(req.input):
            conversation.item(item, f"input.{i}")
    if not conversation.messages:
        raise ValueError("input: the conversation is empty; send at least one message")
    return conversation.messages


def function_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The function tools in internal form; tools of other types are ignored (see the module docstring)."""
    out = []
    for k, tool in enumerate(tools or []):
        if tool.get("type") != "function":
            continue
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ValueError(f"tools.{k}: a function tool needs a string 'name'")
        function: dict[str, Any] = {"name": tool["name"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": function})
    return out or None


# ----------------------------------------------------------------------------------------------------------------------
# Completion -> output items and the response object


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def call_items(parsed: ParsedCompletion) -> list[dict[str, Any]]:
    return [{"type": "function_call", "id": new_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
             "arguments": call["function"]["arguments"], "status": "completed"} for call in parsed.tool_calls]  # fmt: skip


def output_items(parsed: ParsedCompletion, reasoning_id: str, message_id: str) -> list[dict[str, Any]]:
    """reasoning (if the model thought), the message (if it wrote text or made no call), the function calls."""
    items = []
    if parsed.reasoning:
        items.append(reasoning_item(reasoning_id, parsed.reasoning))
    if parsed.content or not parsed.tool_calls:
        items.append(message_item(message_id, parsed.content))
    return items + call_items(parsed)


def response_body(
    reply_id: str, turn: Turn, model: str, output: list[dict[str, Any]], completion: Completion | None, status: str
) -> dict[str, Any]:
    """The ``response`` object; ``completion`` None while it is in progress (no usage yet)."""
    req: ResponsesRequest = turn.request.wire
    body: dict[str, Any] = {
        "id": reply_id, "object": "response", "created_at": turn.created, "status": status, "model": model,
        "output": output, "error": None, "incomplete_details": None, "instructions": req.instructions,
        "metadata": {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": req.temperature, "top_p": req.top_p, "tool_choice": req.tool_choice or "auto",
        "tools": [tool for tool in req.tools or [] if tool.get("type") == "function"],
        "max_output_tokens": req.max_output_tokens, "previous_response_id": None, "reasoning": None,
        "store": False, "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": None,
    }  # fmt: skip
    if completion is not None:
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        body["completed_at"] = int(time.time())
        prompt, generated = turn.prompt_tokens, completion.completion_tokens
        body["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": completion.result.cached_tokens},
                         "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": prompt + generated}  # fmt: skip
    return body


def final_status(completion: Completion) -> str:
    return "incomplete" if completion.finish_reason == "length" else "completed"


# ----------------------------------------------------------------------------------------------------------------------
# The stream


class ResponseStreamWriter(StreamWriter):
    """The Responses SSE sequence (module docstring), items opened as their first delta arrives."""

    def __init__(self, adapter: TurnAdapter, turn: Turn, reply_id: str) -> None:
        super().__init__(adapter, turn, reply_id)
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open_kind: str | None = None  # "reasoning" | "message" while that item is open
        self.text = ""  # the open item's text so far
        self.reasoning_id, self.message_id = new_id("rs"), new_id("msg")
        self.wrote_message = False

    def event(self, name: str, **fields: Any) -> str:
        payload = {"type": name, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse.event(name, payload)

    def body(self, status: str, completion: Completion | None = None) -> dict[str, Any]:
        return response_body(self.reply_id, self.turn, self.model, self.output, completion, status)

    def open(self) -> list[str]:
        return [self.event("response.created", response=self.body("in_progress")),
                self.event("response.in_progress", response=self.body("in_progress"))]  # fmt: skip

    def _start(self, kind: str) -> list[str]:
        events = self._finish_open()
        self.open_kind, self.text = kind, ""
        index = len(self.output)
        if kind == "reasoning":
            item, part = reasoning_item(self.reasoning_id, "", "in_progress"), {"type": "reasoning_text", "text": ""}
        else:
            item = message_item(self.message_id, None, "in_progress")
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.wrote_message = True
        return events + [self.event("response.output_item.added", output_index=index, item=item),
                         self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                    content_index=0, part=part)]  # fmt: skip

    def _finish_open(self) -> list[str]:
        if self.open_kind is None:
            return []
        index, text = len(self.output), self.text
        if self.open_kind == "reasoning":
            item, done = reasoning_item(self.reasoning_id, text), "response.reasoning_text.done"
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
        else:
            item, done = message_item(self.message_id, text), "response.output_text.done"
            part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        extra = {"logprobs": []} if self.open_kind == "message" else {}
        self.output.append(item)
        self.open_kind = None
        return [self.event(done, text=text, **where, **extra), self.event("response.content_part.done", part=part, **where),
                self.event("response.output_item.done", output_index=index, item=item)]  # fmt: skip

    def _text(self, kind: str, text: str) -> list[str]:
        events = self._start(kind) if self.open_kind != kind else []
        self.text += text
        name, extra = (
            ("response.reasoning_text.delta", {})
            if kind == "reasoning"
            else ("response.output_text.delta", {"logprobs": []})
        )
        item_id = self.reasoning_id if kind == "reasoning" else self.message_id
        return events + [self.event(name, item_id=item_id, output_index=len(self.output), content_index=0,
                                    delta=text, **extra)]  # fmt: skip

    def delta(self, delta: Delta) -> list[str]:
        events = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        return events

    def close(self, completion: Completion) -> list[str]:
        parsed = completion.parsed
        assert parsed is not None
        events = []
        if not self.wrote_message and not parsed.tool_calls:  # a reply always has a message or a call
            events += self._start("message")
        events += self._finish_open()
        for item in call_items(parsed):
            index, where = len(self.output), {"item_id": item["id"], "output_index": len(self.output)}
            events += [self.event("response.output_item.added", output_index=index,
                                  item={**item, "arguments": "", "status": "in_progress"}),
                       self.event("response.function_call_arguments.delta", delta=item["arguments"], **where),
                       self.event("response.function_call_arguments.done", arguments=item["arguments"], **where),
                       self.event("response.output_item.done", output_index=index, item=item)]  # fmt: skip
            self.output.append(item)
        return events + [self.event("response.completed", response=self.body(final_status(completion), completion))]

    def error(self, err: ProxyError) -> list[str]:
        failed = self.body("failed")
        message = err.message_for("responses")
        failed["error"] = {"code": err.code or "server_error", "message": message}
        return [self.event("error", code=err.code, message=message, param=err.param_for("responses")),
                self.event("response.failed", response=failed)]  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------------
# The adapter


class Responses(TurnAdapter):
    """``POST /v1/responses``: a chat turn; replies one ``response`` object, or its SSE events
    (``ResponseStreamWriter``, keep-alive comments while nothing comes)."""

    endpoint = "responses"

    request_schema = ResponsesRequest

    def parse(self, body: dict[str, Any]) -> TurnRequest:
        req = self.validated(ResponsesRequest, body, "responses request", DOCS)
        check_responses_supported(req)
        try:
            messages, tools = to_messages(req), function_tools(req.tools)
        except ValueError as exc:
            raise ProxyError(400, f"invalid responses request: {exc}", param="input") from None
        return TurnRequest(
            api="responses",
            messages=messages,
            tools=tools,
            parse_tools=req.tool_choice != "none",
            tool_choice=internal_tool_choice(req.tool_choice),
            stream=bool(req.stream),
            temperature=req.temperature,
            top_p=req.top_p,
            max_tokens=req.max_output_tokens,
            wire=req,
        )

    def reply_id(self) -> str:
        return new_id("resp")

    def respond(self, turn: Turn, completion: Completion) -> dict[str, Any]:
        assert completion.parsed is not None
        output = output_items(completion.parsed, new_id("rs"), new_id("msg"))
        return response_body(self.reply_id(), turn, self.model_name, output, completion, final_status(completion))

    def writer(self, turn: Turn, reply_id: str) -> StreamWriter:
        return ResponseStreamWriter(self, turn, reply_id)
