"""Server-sent events: the two framings the APIs use (OpenAI ``data:`` lines, Anthropic named events) and the
streaming HTTP response that carries them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

KEEPALIVE_COMMENT = ": keep-alive\n\n"  # an SSE comment: keeps proxies and clients from timing out, ignored by SDKs


def data(payload: dict[str, Any] | str) -> str:
    """``data: <payload>`` (OpenAI style): a dict as compact ASCII JSON, a string (``[DONE]``) verbatim."""
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {text}\n\n"


def event(name: str, payload: dict[str, Any]) -> str:
    """``event: <name>`` + ``data: <payload>`` (Anthropic style): compact JSON, non-ASCII kept as UTF-8."""
    return f"event: {name}\ndata: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """A streaming response that, once sent or abandoned (client gone, write timeout, shutdown), closes its events
    (a streamed turn's generation is then cancelled) and calls each ``on_close`` callback (an admission slot)."""

    def __init__(self, events: AsyncIterator[str], **kwargs: Any) -> None:
        super().__init__(events, **kwargs)
        self.on_close: list[Callable[[], None]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                with contextlib.suppress(Exception):
                    await self.body_iterator.aclose()  # type: ignore[union-attr]
            finally:
                for callback in self.on_close:
                    callback()


def response(events: AsyncIterator[str]) -> EventStream:
    """A ``text/event-stream`` response sending ``events`` as they come, unbuffered by intermediaries."""
    return EventStream(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
