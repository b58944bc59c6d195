"""The adapter contract: how one HTTP API becomes a ``TurnRequest`` and how its replies are framed.

An adapter knows one wire format and nothing of prompts, threads, backends or records; the pipeline knows
turns and nothing of wire formats. ``ProxyServer`` mounts each adapter on its path with one line.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import Any, ClassVar, TypeVar

import pydantic

from gyre_jax.proxy import sse
from gyre_jax.proxy.errors import Api, ProxyError, validation_error
from gyre_jax.proxy.turns import Completed, Completion, Failed, Turn, TurnEvent, TurnRequest

Schema = TypeVar("Schema", bound=pydantic.BaseModel)


class Lenient(pydantic.BaseModel):
    """Base of request schemas: unknown fields are ignored (clients send many we do not need)."""

    model_config = pydantic.ConfigDict(extra="ignore")


class TurnAdapter(abc.ABC):
    """One API's wire format, for the model ``model_name``. ``ProxyServer`` calls four methods:

    - ``parse(body) -> TurnRequest``: validate the JSON body and translate it; bad input raises ``ProxyError``
      (a 4xx saying what was wrong). Nothing is placed on the backend before ``parse`` returns.
    - ``respond(turn, completion) -> body``: the JSON reply of a committed, non-streamed turn.
    - ``stream(turn, events) -> SSE strings``: the event stream of a streamed turn, given the pipeline's
      ``KeepAlive`` / ``Completed`` / ``Failed`` events. The default frames ``stream_open`` at once, ``keepalive``
      per KeepAlive, then ``stream_close`` of the completion or ``stream_error``; an adapter that frames
      incrementally (live deltas) overrides it.
    - ``error_body(err) -> body``: an error in the style (``error_style``) this API's clients understand.

    A call with several choices (``TurnRequest.n`` > 1; each choice a ``Turn`` with its ``index``) is answered by
    ``respond_choices`` / ``stream_choices``; an API with ``n`` implements ``respond_choices``, ``stream_choice``
    and ``stream_end``.
    """

    error_style: ClassVar[Api] = "openai"
    keepalive: ClassVar[str] = sse.KEEPALIVE_COMMENT  # sent for each KeepAlive while a streamed turn waits

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    @abc.abstractmethod
    def parse(self, body: dict[str, Any]) -> TurnRequest: ...

    @abc.abstractmethod
    def reply_id(self) -> str:
        """A fresh id for one reply (``chatcmpl-...``, ``msg_...``)."""

    @abc.abstractmethod
    def respond(self, turn: Turn, completion: Completion) -> dict[str, Any]: ...

    @abc.abstractmethod
    def stream_close(self, turn: Turn, reply_id: str, completion: Completion) -> list[str]:
        """The events that carry the completion and end the stream."""

    def stream_open(self, turn: Turn, reply_id: str) -> list[str]:
        """The events sent as soon as the stream starts, before the turn runs."""
        return []

    async def stream(self, turn: Turn, events: AsyncIterator[TurnEvent]) -> AsyncIterator[str]:
        """SSE strings for the pipeline's events; ends early, without a close, if the client went away."""
        reply_id = self.reply_id()
        for text in self.stream_open(turn, reply_id):
            yield text
        async for event in events:
            if isinstance(event, Completed):
                for text in self.stream_close(turn, reply_id, event.completion):
                    yield text
            elif isinstance(event, Failed):
                yield self.stream_error(event.error)
            else:
                yield self.keepalive

    def respond_choices(self, turns: list[Turn], completions: list[Completion]) -> dict[str, Any]:
        """The JSON reply of a call with several choices (n > 1), in choice order."""
        raise ProxyError(400, f"not supported: n > 1 on {type(self).__name__}; request one choice per call", param="n")

    def stream_choice(self, turn: Turn, reply_id: str, completion: Completion) -> list[str]:
        """The events that carry one choice of a streamed call with several choices."""
        raise ProxyError(400, f"not supported: n > 1 on {type(self).__name__}; request one choice per call", param="n")

    def stream_end(self, turns: list[Turn], reply_id: str, completions: list[Completion]) -> list[str]:
        """The events that end a streamed call with several choices, once every choice was sent."""
        return []

    async def stream_choices(self, turns: list[Turn], events: AsyncIterator[TurnEvent]) -> AsyncIterator[str]:
        """``stream`` of a call with several choices: each choice's open events, keep-alives, then each choice's
        events as its ``Completed`` arrives (in choice order), then ``stream_end``."""
        reply_id = self.reply_id()
        for turn in turns:
            for text in self.stream_open(turn, reply_id):
                yield text
        done: list[Completion] = []
        async for event in events:
            if isinstance(event, Completed):
                done.append(event.completion)
                for text in self.stream_choice(turns[len(done) - 1], reply_id, event.completion):
                    yield text
                if len(done) == len(turns):
                    for text in self.stream_end(turns, reply_id, done):
                        yield text
            elif isinstance(event, Failed):
                yield self.stream_error(event.error)
            else:
                yield self.keepalive

    def error_body(self, err: ProxyError) -> dict[str, Any]:
        return err.body(self.error_style)

    def stream_error(self, err: ProxyError) -> str:
        """An error after the stream's headers went out, as an SSE event."""
        return sse.data(self.error_body(err))

    def validated(self, schema: type[Schema], body: dict[str, Any], what: str, docs: str) -> Schema:
        """``body`` as ``schema``: 400 naming the invalid fields (``what`` the request is, ``docs`` its API), 404 if
        it names a model other than the one served."""
        try:
            req = schema.model_validate(body)
        except pydantic.ValidationError as exc:
            raise validation_error(exc, what, docs) from None
        model = getattr(req, "model", self.model_name)
        if model != self.model_name:
            raise ProxyError(
                404,
                f"model {model!r} does not exist; this proxy serves {self.model_name!r} (see GET /v1/models)",
                code="model_not_found",
                param="model",
            )
        return req
