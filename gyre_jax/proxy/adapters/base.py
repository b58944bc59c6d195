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
from gyre_jax.proxy.errors import Api, Endpoint, ProxyError, validation_error
from gyre_jax.proxy.turns import Completed, Completion, Delta, Failed, Turn, TurnEvent, TurnRequest

Schema = TypeVar("Schema", bound=pydantic.BaseModel)


class Lenient(pydantic.BaseModel):
    """Base of request schemas: unknown fields are ignored (clients send many we do not need)."""

    model_config = pydantic.ConfigDict(extra="ignore")


class StreamWriter(abc.ABC):
    """The framing of one streamed reply (of one choice, ``turn.index``, of a call with several), with the state it
    needs between events (open blocks, counters).

    ``open`` is sent as soon as the stream starts, ``delta`` for each ``Delta`` as the turn's text arrives,
    ``close`` for the committed completion (everything the deltas did not carry: tool calls, finish reason,
    usage, the end marker); ``error`` if the turn failed after the stream started. An API with ``n`` splits
    ``close`` into ``finish`` (the end of one choice) and ``end`` (usage once and the end marker, once every
    choice finished; told every choice's completion).
    """

    def __init__(self, adapter: TurnAdapter, turn: Turn, reply_id: str) -> None:
        self.adapter = adapter
        self.turn = turn
        self.reply_id = reply_id
        self.model = adapter.model_name

    def open(self) -> list[str]:
        return []

    @abc.abstractmethod
    def delta(self, delta: Delta) -> list[str]: ...

    def close(self, completion: Completion) -> list[str]:
        return self.finish(completion) + self.end([completion])

    def finish(self, completion: Completion) -> list[str]:
        raise RuntimeError(
            f"not supported yet: {type(self).__name__} streams one choice per call (its API has no n; its adapter "
            "refuses n > 1 in parse), so a call's choices cannot end one by one here"
        )

    def end(self, completions: list[Completion]) -> list[str]:
        return []

    def error(self, err: ProxyError) -> list[str]:
        return [self.adapter.stream_error(err)]


class TurnAdapter(abc.ABC):
    """One API's wire format, for the model ``model_name``. ``ProxyServer`` calls four methods:

    - ``parse(body) -> TurnRequest``: validate the JSON body and translate it; bad input raises ``ProxyError``
      (a 4xx saying what was wrong). Nothing is placed on the backend before ``parse`` returns.
    - ``respond(turn, completion) -> body``: the JSON reply of a committed, non-streamed turn.
    - ``stream(turn, events) -> SSE strings``: the event stream of a streamed turn, given the pipeline's
      ``KeepAlive`` / ``Delta`` / ``Completed`` / ``Failed`` events, framed by the adapter's ``StreamWriter``
      (``writer``): its ``open`` at once, ``keepalive`` per KeepAlive, its ``delta`` per Delta, then its
      ``close`` of the completion or its ``error``.
    - ``error_body(err) -> body``: an error in the style (``error_style``) this API's clients understand, worded as
      this API (``endpoint``) words it (``ProxyError.message_for``: a context overflow reads as the real API's).

    A call with several choices (``TurnRequest.n`` > 1; each choice a ``Turn`` with its ``index``) is answered by
    ``respond_choices`` / ``stream_choices``; an API with ``n`` implements ``respond_choices`` and its writer's
    ``finish`` and ``end``.
    """

    error_style: ClassVar[Api] = "openai"
    endpoint: ClassVar[Endpoint]  # which API this is (the records' ``api``): chat | completions | responses | messages
    request_schema: ClassVar[type[pydantic.BaseModel]]  # the body ``parse`` validates (documented by openapi.py)
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
    def writer(self, turn: Turn, reply_id: str) -> StreamWriter:
        """A fresh ``StreamWriter`` for one streamed reply."""

    async def stream(self, turn: Turn, events: AsyncIterator[TurnEvent]) -> AsyncIterator[str]:
        """SSE strings for the pipeline's events; ends early, without a close, if the client went away."""
        async for text in self.stream_choices([turn], events):
            yield text

    def respond_choices(self, turns: list[Turn], completions: list[Completion]) -> dict[str, Any]:
        """The JSON reply of a call with several choices (n > 1), in choice order."""
        raise ProxyError(400, f"not supported: n > 1 on {type(self).__name__}; request one choice per call", param="n")

    async def stream_choices(self, turns: list[Turn], events: AsyncIterator[TurnEvent]) -> AsyncIterator[str]:
        """``stream`` of a call's choices (one, or n > 1): one writer per choice, each ``Delta`` and ``Completed``
        to its choice's writer (``index``); a single choice closes with ``close``, several each ``finish`` and,
        once all finished, one ``end``."""
        reply_id = self.reply_id()
        writers = [self.writer(turn, reply_id) for turn in turns]
        for writer in writers:
            for text in writer.open():
                yield text
        done: dict[int, Completion] = {}
        async for event in events:
            if isinstance(event, Delta):
                texts = writers[event.index].delta(event)
            elif isinstance(event, Completed) and len(writers) == 1:
                texts = writers[0].close(event.completion)
            elif isinstance(event, Completed):
                done[event.index] = event.completion
                texts = writers[event.index].finish(event.completion)
                if len(done) == len(writers):
                    texts += writers[0].end([done[i] for i in range(len(writers))])
            elif isinstance(event, Failed):
                texts = writers[0].error(event.error)
            else:
                texts = [self.keepalive]
            for text in texts:
                yield text

    def error_body(self, err: ProxyError) -> dict[str, Any]:
        return err.body(self.error_style, self.endpoint)

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
