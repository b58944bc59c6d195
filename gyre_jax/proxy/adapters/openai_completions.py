"""OpenAI legacy completions (``POST /v1/completions``): request schema, unsupported-feature checks, the
``text_completion`` body and stream, and the adapter joining them to the pipeline.

The prompt is a string (special tokens in it become their single ids) or a list of token ids, used
verbatim; the completion is returned as raw text (nothing is parsed).
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import Field

from gyre_jax.proxy import sse
from gyre_jax.proxy.adapters.base import Lenient, StreamWriter, TurnAdapter
from gyre_jax.proxy.adapters.openai_chat import StreamOptions, include_usage, openai_stop, usage
from gyre_jax.proxy.errors import ProxyError
from gyre_jax.proxy.sampling import MAX_CHOICES
from gyre_jax.proxy.turns import Completion, Delta, Turn, TurnRequest


class CompletionRequest(Lenient):
    model: str
    prompt: str | list[str] | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = None
    stop: str | list[str] | None = None
    suffix: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None


def check_completion_supported(req: CompletionRequest) -> None:
    """Rejects valid OpenAI features this proxy does not implement, rather than silently ignoring them."""
    if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) and len(req.prompt) != 1:
        raise ProxyError(400, "not supported yet: a batch of prompts; send one prompt per call", param="prompt")
    if req.suffix:
        raise ProxyError(400, "not supported yet: 'suffix'; omit it", param="suffix")
    if req.echo:
        raise ProxyError(400, "not supported yet: echo=true; omit it", param="echo")


def completion_logprobs(completion: Completion) -> dict[str, Any] | None:
    """``{tokens, token_logprobs, top_logprobs: None, text_offset}`` over the returned tokens; None if not asked."""
    if completion.pieces is None:
        return None
    tokens, offsets, offset = [], [], 0
    for piece in completion.pieces:
        tokens.append(piece.text)
        offsets.append(offset)
        offset += len(piece.text)
    return {"tokens": tokens, "token_logprobs": [p.logprob for p in completion.pieces],
            "top_logprobs": None, "text_offset": offsets}  # fmt: skip


def text_completion_body(
    completion_id: str, turn: Turn, model: str, choices: list[dict[str, Any]], usage_body: dict[str, int] | None
) -> dict[str, Any]:
    body = {"id": completion_id, "object": "text_completion", "created": turn.created, "model": model,
            "choices": choices}  # fmt: skip
    if usage_body is not None:
        body["usage"] = usage_body
    return body


def completion_choice(completion: Completion, index: int = 0) -> dict[str, Any]:
    return {
        "text": completion.text,
        "index": index,
        "logprobs": completion_logprobs(completion),
        "finish_reason": completion.finish_reason,
    }


class Completions(TurnAdapter):
    """``POST /v1/completions``: a raw-prompt turn; replies ``text_completion``, or a stream of chunks
    (``CompletionStreamWriter``, keep-alive comments while nothing comes)."""

    endpoint = "completions"

    request_schema = CompletionRequest

    def parse(self, body: dict[str, Any]) -> TurnRequest:
        req = self.validated(CompletionRequest, body, "completion request", "the OpenAI completions API")
        check_completion_supported(req)
        prompt = req.prompt
        if isinstance(prompt, list) and not (prompt and isinstance(prompt[0], int)):
            prompt = prompt[0]  # one prompt string in a list
        return TurnRequest(
            api="completions",
            prompt=prompt,
            parse_tools=False,
            logprobs=req.logprobs is not None,
            stream=bool(req.stream),
            temperature=req.temperature,
            top_p=req.top_p,
            max_tokens=req.max_tokens,
            seed=req.seed,
            stop=openai_stop(req.stop),
            n=req.n,
            wire=req,
        )

    def reply_id(self) -> str:
        return "cmpl-" + uuid.uuid4().hex

    def respond(self, turn: Turn, completion: Completion) -> dict[str, Any]:
        choices = [completion_choice(completion)]
        return text_completion_body(self.reply_id(), turn, self.model_name, choices, usage(turn, completion))

    def respond_choices(self, turns: list[Turn], completions: list[Completion]) -> dict[str, Any]:
        choices = [completion_choice(c, t.index) for t, c in zip(turns, completions)]
        return text_completion_body(self.reply_id(), turns[0], self.model_name, choices, usage(turns[0], *completions))

    def writer(self, turn: Turn, reply_id: str) -> StreamWriter:
        return CompletionStreamWriter(self, turn, reply_id)


class CompletionStreamWriter(StreamWriter):
    """``text_completion`` chunks of one choice (``turn.index``): the text as it is sampled, then one chunk with
    the log-probs (if asked) and the finish reason; at the call's end a usage chunk if asked, and ``[DONE]``."""

    def chunk(self, choices: list[dict[str, Any]], usage_body: dict[str, int] | None = None) -> str:
        return sse.data(text_completion_body(self.reply_id, self.turn, self.model, choices, usage_body))

    def delta(self, delta: Delta) -> list[str]:
        if not delta.text:
            return []
        return [self.chunk([{"text": delta.text, "index": self.turn.index, "logprobs": None, "finish_reason": None}])]

    def finish(self, completion: Completion) -> list[str]:
        last = {"text": "", "index": self.turn.index, "logprobs": completion_logprobs(completion),
                "finish_reason": completion.finish_reason}  # fmt: skip
        return [self.chunk([last])]

    def end(self, completions: list[Completion]) -> list[str]:
        events = []
        if include_usage(self.turn.request.wire):
            events.append(self.chunk([], usage(self.turn, *completions)))
        return events + [sse.data("[DONE]")]
