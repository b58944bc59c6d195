"""Server-sent events: the two framings the APIs use (OpenAI ``data:`` lines, Anthropic named events) and the
streaming HTTP response that carries them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

KEEPALIVE_COMMENT = ": keep-alive\n\n"  # an SSE comment: keeps proxies and clients from timing out, ignored by SDKs


def data(payload: dict[str, Any] | str) -> str:
    """``data: <payload>`` (OpenAI style): a dict as compact ASCII JSON, a string (``[DONE]``) verbatim."""
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {text}\n\n"


def event(name: str, payload: dict[str, Any]) -> str:
    """``event: <name>`` + ``data: <payload>`` (Anthropic style): compact JSON, non-ASCII kept as UTF-8."""
    return f"event: {name}\ndata: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def response(events: AsyncIterator[str]) -> StreamingResponse:
    """A ``text/event-stream`` response sending ``events`` as they come, unbuffered by intermediaries."""
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
