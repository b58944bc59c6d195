"""OpenAI chat completions (``POST /v1/chat/completions``): request schema, unsupported-feature checks, the
``chat.completion`` body and the ``chat.completion.chunk`` stream, and the adapter joining them to the pipeline.

OpenAI messages and tools are already the proxy's internal form: the raw JSON messages and tools are what
gets rendered (key order kept), the schemas here only validate.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import Field

from gyre_jax.proxy import sse
from gyre_jax.proxy.adapters.base import Lenient, StreamWriter, TurnAdapter
from gyre_jax.proxy.errors import ProxyError
from gyre_jax.proxy.sampling import MAX_CHOICES, stop_strings
from gyre_jax.proxy.turns import Completion, Delta, Turn, TurnRequest


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class FunctionTool(Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class StreamOptions(Lenient):
    include_usage: bool = False


class ChatTemplateKwargs(Lenient):
    enable_thinking: bool | None = None


class ChatCompletionRequest(Lenient):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None  # vLLM/SGLang extension: {"enable_thinking": false}


def check_chat_supported(req: ChatCompletionRequest) -> None:
    """Rejects valid OpenAI features this proxy does not implement, rather than silently ignoring them."""
    choice = req.tool_choice
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        raise ProxyError(
            400, f"tool_choice={choice!r}: expected 'auto', 'none', 'required' or a named function", param="tool_choice"
        )


def openai_stop(stop: str | list[str] | None) -> tuple[str, ...]:
    """OpenAI ``stop`` (a string or up to 4 strings) as stop strings; 400 if there are more."""
    try:
        return stop_strings(stop, 4, "stop")
    except ValueError as exc:
        raise ProxyError(400, str(exc), param="stop") from None


# ----------------------------------------------------------------------------------------------------------------------
# Response bodies and stream chunks (shared with legacy completions: usage, include_usage)


def usage(turn: Turn, completion: Completion, *more: Completion) -> dict[str, int]:
    """Token usage of a call: its prompt once, the completions of all its choices."""
    prompt_tokens = turn.prompt_tokens
    completion_tokens = sum(c.completion_tokens for c in (completion, *more))
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def include_usage(req: ChatCompletionRequest | Any) -> bool:
    """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
    return bool(req.stream_options and req.stream_options.include_usage)


def chat_logprobs(completion: Completion) -> dict[str, Any] | None:
    """``{"content": [{token, logprob, bytes, top_logprobs}]}``, one entry per returned token; None if not asked."""
    if completion.pieces is None:
        return None
    entries = [
        {"token": p.text, "logprob": p.logprob, "bytes": list(p.raw), "top_logprobs": []} for p in completion.pieces
    ]
    return {"content": entries}


def chat_chunk(completion_id: str, created: int, model: str, choices: list[dict[str, Any]], **extra: Any) -> str:
    payload = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        **extra,
    }
    return sse.data(payload)


def stream_choice(
    delta: dict[str, Any], logprobs: dict[str, Any] | None = None, finish: str | None = None, index: int = 0
) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


class ChatStreamWriter(StreamWriter):
    """``chat.completion.chunk``s of one choice (``turn.index``): the role at once, then ``reasoning_content`` /
    ``content`` deltas as they are sampled; at its end the log-probs (one chunk, if asked), each tool call, the
    finish; at the call's end usage if asked and ``[DONE]``."""

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        return chat_chunk(self.reply_id, self.turn.created, self.model, choices, **extra)

    def choice(self, delta: dict[str, Any], logprobs: dict[str, Any] | None = None, finish: str | None = None) -> dict:
        return stream_choice(delta, logprobs, finish, self.turn.index)

    def open(self) -> list[str]:
        return [self.chunk([self.choice({"role": "assistant", "content": ""})])]

    def delta(self, delta: Delta) -> list[str]:
        chunks = []
        if delta.reasoning:
            chunks.append(self.chunk([self.choice({"reasoning_content": delta.reasoning})]))
        if delta.content:
            chunks.append(self.chunk([self.choice({"content": delta.content})]))
        return chunks

    def finish(self, completion: Completion) -> list[str]:
        assert completion.message is not None
        chunks = []
        logprobs = chat_logprobs(completion)
        if logprobs is not None:
            chunks.append(self.chunk([self.choice({"content": ""}, logprobs)]))
        for index, tool_call in enumerate(completion.message.get("tool_calls", [])):
            chunks.append(self.chunk([self.choice({"tool_calls": [{"index": index, **tool_call}]})]))
        return chunks + [self.chunk([self.choice({}, finish=completion.finish_reason)])]

    def end(self, completions: list[Completion]) -> list[str]:
        chunks = []
        if include_usage(self.turn.request.wire):
            chunks.append(self.chunk([], usage=usage(self.turn, *completions)))
        return chunks + [sse.data("[DONE]")]


# ----------------------------------------------------------------------------------------------------------------------
# The adapter


class ChatCompletions(TurnAdapter):
    """``POST /v1/chat/completions``: a chat turn; replies ``chat.completion``, or a stream of chunks
    (``ChatStreamWriter``, keep-alive comments while nothing comes)."""

    endpoint = "chat"

    request_schema = ChatCompletionRequest

    def parse(self, body: dict[str, Any]) -> TurnRequest:
        req = self.validated(ChatCompletionRequest, body, "chat completion request", "the OpenAI chat completions API")
        check_chat_supported(req)
        kwargs = req.chat_template_kwargs
        return TurnRequest(
            api="chat",
            messages=body["messages"],
            tools=body.get("tools") or None,
            enable_thinking=kwargs.enable_thinking if kwargs is not None else None,
            parse_tools=req.tool_choice != "none",
            tool_choice=req.tool_choice,
            stop=openai_stop(req.stop),
            n=req.n,
            logprobs=bool(req.logprobs),
            stream=bool(req.stream),
            temperature=req.temperature,
            top_p=req.top_p,
            max_tokens=req.max_completion_tokens or req.max_tokens,
            seed=req.seed,
            wire=req,
        )

    def reply_id(self) -> str:
        return "chatcmpl-" + uuid.uuid4().hex

    def respond(self, turn: Turn, completion: Completion) -> dict[str, Any]:
        choice = {
            "index": turn.index,
            "message": completion.message,
            "logprobs": chat_logprobs(completion),
            "finish_reason": completion.finish_reason,
        }
        return {
            "id": self.reply_id(),
            "object": "chat.completion",
            "created": turn.created,
            "model": self.model_name,
            "choices": [choice],
            "usage": usage(turn, completion),
        }

    def respond_choices(self, turns: list[Turn], completions: list[Completion]) -> dict[str, Any]:
        body = self.respond(turns[0], completions[0])
        body["choices"] = [self.respond(t, c)["choices"][0] for t, c in zip(turns, completions)]
        body["usage"] = usage(turns[0], *completions)
        return body

    def writer(self, turn: Turn, reply_id: str) -> StreamWriter:
        return ChatStreamWriter(self, turn, reply_id)
