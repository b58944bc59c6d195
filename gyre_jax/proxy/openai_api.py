"""The OpenAI API in the proxy's terms: request schemas, unsupported-feature checks, response bodies, stream chunks.

Chat completions (``POST /v1/chat/completions``) carry OpenAI messages, which are already the proxy's
internal message form; the raw JSON messages and tools are what gets rendered (key order kept), the
schemas here only validate. Legacy completions (``POST /v1/completions``) take a prompt string (special
tokens in it become their single ids) or a list of token ids, used verbatim.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gyre_jax.proxy.chat_template import ParsedCompletion
from gyre_jax.proxy.errors import ProxyError


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class FunctionTool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatTemplateKwargs(_Lenient):
    enable_thinking: bool | None = None


class ChatCompletionRequest(_Lenient):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    n: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None  # vLLM/SGLang extension: {"enable_thinking": false}


class CompletionRequest(_Lenient):
    model: str
    prompt: str | list[str] | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    n: int | None = Field(default=None, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = None
    stop: str | list[str] | None = None
    suffix: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None


def check_chat_supported(req: ChatCompletionRequest) -> None:
    """Rejects valid OpenAI features this proxy does not implement, rather than silently ignoring them."""
    if req.n not in (None, 1):
        raise ProxyError(400, f"not supported yet: n={req.n}; request one choice (n=1) per call", param="n")
    if req.stop:
        raise ProxyError(
            400,
            "not supported yet: stop sequences; omit 'stop' (generation ends at the end-of-turn token)",
            param="stop",
        )
    if req.tool_choice not in (None, "auto", "none"):
        raise ProxyError(
            400,
            f"not supported yet: tool_choice={req.tool_choice!r}; use 'auto', 'none' or omit it",
            param="tool_choice",
        )


def check_completion_supported(req: CompletionRequest) -> None:
    if req.n not in (None, 1):
        raise ProxyError(400, f"not supported yet: n={req.n}; request one choice (n=1) per call", param="n")
    if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) and len(req.prompt) != 1:
        raise ProxyError(400, "not supported yet: a batch of prompts; send one prompt per call", param="prompt")
    for name in ("stop", "suffix"):
        if getattr(req, name):
            raise ProxyError(400, f"not supported yet: {name!r}; omit it", param=name)
    if req.echo:
        raise ProxyError(400, "not supported yet: echo=true; omit it", param="echo")


# ----------------------------------------------------------------------------------------------------------------------
# Response bodies


def returned_message(parsed: ParsedCompletion) -> dict[str, Any]:
    """The assistant message as the client receives it (and, normalized, as the thread remembers it)."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if (parsed.tool_calls and not parsed.content) else parsed.content,
    }
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    return message


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def chat_chunk(completion_id: str, created: int, model: str, choices: list[dict[str, Any]], **extra: Any) -> str:
    payload = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        **extra,
    }
    return sse(payload)


def chat_stream_chunks(
    completion_id: str,
    created: int,
    model: str,
    message: dict[str, Any],
    logprobs: dict[str, Any] | None,
    finish_reason: str,
    usage_body: dict[str, int] | None,
) -> list[str]:
    """A whole chat completion as chunks: reasoning, content (with logprobs), each tool call, the finish."""

    def choice(delta: dict[str, Any], lp: dict[str, Any] | None = None, finish: str | None = None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}

    chunks = []
    if message.get("reasoning_content") is not None:
        chunks.append(
            chat_chunk(completion_id, created, model, [choice({"reasoning_content": message["reasoning_content"]})])
        )
    if message["content"] or logprobs is not None:
        chunks.append(
            chat_chunk(completion_id, created, model, [choice({"content": message["content"] or ""}, logprobs)])
        )
    for index, tool_call in enumerate(message.get("tool_calls", [])):
        chunks.append(
            chat_chunk(completion_id, created, model, [choice({"tool_calls": [{"index": index, **tool_call}]})])
        )
    chunks.append(chat_chunk(completion_id, created, model, [choice({}, finish=finish_reason)]))
    if usage_body is not None:
        chunks.append(chat_chunk(completion_id, created, model, [], usage=usage_body))
    return chunks


def completion_choice(text: str, logprobs: dict[str, Any] | None, finish_reason: str | None) -> dict[str, Any]:
    return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}


def text_completion_body(
    completion_id: str, created: int, model: str, choice: dict[str, Any], usage_body: dict[str, int] | None
) -> dict[str, Any]:
    body = {"id": completion_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if usage_body is not None:
        body["usage"] = usage_body
    return body
