"""Connection-level limits of the proxy's HTTP server, so slow or abusive clients cannot block others or grow memory.

uvicorn (h11) already bounds a request's headers (``h11_max_incomplete_event_size``; larger ones get 431 here) and
closes a connection idle between requests after ``timeout_keep_alive``. What it lacks, ``GuardedH11Protocol``
adds:

- a header timeout: a connection that has not sent a whole request head ``header_timeout_s`` after it opened
  (or after its previous response) gets 408 and is closed (a slowloris sender dribbling header bytes; uvicorn
  re-arms nothing while bytes keep coming);
- a write timeout: a response whose transport stayed paused (its client not reading, the socket buffers full)
  for ``write_timeout_s`` is aborted; the ASGI side then sees a disconnect, so a streamed model call is
  cancelled and its admission slot freed.

``ConnectionCap`` answers 503 with ``Retry-After`` (in the API's own error style) to a request that arrives while
``max_requests`` requests are in progress, as uvicorn's ``limit_concurrency`` would, but with the header the SDKs
honour. (It counts requests, not open connections: a burst of connections opened at once would otherwise all be
refused. Idle connections are bounded in time by the keep-alive and header timeouts.) A body read timeout is the
server's (``server.read_json``). See docs/proxy.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from gyre_jax.proxy.errors import ProxyError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    """The proxy's connection-level limits (see the module docstring); every time in seconds."""

    max_requests: int = 2048  # requests in progress (each on its own connection) beyond which one gets 503
    header_timeout_s: float = 10.0  # > keep_alive_s: an idle keep-alive connection still has time to send
    body_timeout_s: float = 30.0  # to receive a whole request body once its head arrived (408 after)
    write_timeout_s: float = 30.0  # a response blocked on a client that does not read is aborted after this
    keep_alive_s: int = 5  # an idle connection between requests is closed after this (uvicorn's timeout_keep_alive)
    max_header_bytes: int = 16 * 1024  # a request head larger than this gets 431 (whole or still arriving)
    send_buffer_bytes: int = 256 * 1024  # the kernel send buffer of each connection (SO_SNDBUF; Linux doubles it)

    def __post_init__(self) -> None:
        if self.max_requests < 1:
            raise ValueError(f"max_requests={self.max_requests} must be >= 1")
        for name in ("header_timeout_s", "body_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 seconds")
        if self.keep_alive_s < 1:
            raise ValueError(f"keep_alive_s={self.keep_alive_s} must be >= 1")
        if self.header_timeout_s <= self.keep_alive_s:
            raise ValueError(
                f"header_timeout_s={self.header_timeout_s} must exceed keep_alive_s={self.keep_alive_s}, or a "
                "keep-alive connection that idles almost that long has no time left to send its next request"
            )
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes={self.max_header_bytes} must be >= 1024")
        if self.send_buffer_bytes < 4096:
            raise ValueError(f"send_buffer_bytes={self.send_buffer_bytes} must be >= 4096")


_TIMEOUT_TEXT = b"the request head did not arrive in time; send it all at once"


def _raw_response(status_line: bytes, body: bytes, content_type: bytes = b"text/plain; charset=utf-8") -> bytes:
    """A whole HTTP/1.1 response (the connection closed after it), written below the ASGI app."""
    return (b"HTTP/1.1 %s\r\ncontent-type: %s\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
            % (status_line, content_type, len(body), body))  # fmt: skip


_TIMEOUT_408 = _raw_response(b"408 Request Timeout", _TIMEOUT_TEXT)
_LINGER_S = 2.0  # how long a refused connection reads and drops what its client still sends before closing
_TOO_LARGE_431 = _raw_response(  # the path is not known yet: the OpenAI error style, as outside the API routes
    b"431 Request Header Fields Too Large",
    json.dumps(ProxyError(431, "the request head is over this proxy's limit; send smaller headers",
                          code="headers_too_large").body()).encode(),
    b"application/json",
)  # fmt: skip


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout and a write timeout (module docstring)."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._lingering = False  # answered and closing (``_answer_and_close``)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # bounded: a client that does not read pauses the response (and its timer) soon
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._limits.send_buffer_bytes)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm_header_timer()  # waiting for the next request's head (none pipelined)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self._limits.write_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def send_400_response(self, msg: str) -> None:
        """A head still arriving when it passed ``max_header_bytes`` (h11's "receive buffer too long") gets 431,
        as a whole head over it gets from ``ConnectionCap``; any other malformed request uvicorn's 400."""
        if len(self.conn.trailing_data[0]) > self._limits.max_header_bytes:
            self._answer_and_close(_TOO_LARGE_431)
            return
        super().send_400_response(msg)

    def _answer_and_close(self, response: bytes) -> None:
        """Sends ``response`` and closes once the client has read it: the write side first (FIN after the bytes),
        then, reading and dropping what the client still sends, the socket when the client closes or after
        ``_LINGER_S``. Closing at once with unread bytes from the client (the rest of a refused head) makes the
        kernel reset the connection, which can discard the response before the client reads it (nginx's
        lingering close)."""
        self._lingering = True
        self.transport.write(response)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(_LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if not self._lingering:  # else: what a refused client still sends, read and dropped
            super().data_received(data)

    def eof_received(self) -> None:
        if self._lingering:  # the client has read the answer and closed its side
            self.transport.close()
            return
        super().eof_received()

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        cycle = self.cycle  # a new request head replaces it; the timer then does nothing
        self._header_timer = self.loop.call_later(self._limits.header_timeout_s, self._header_timed_out, cycle)

    def _header_timed_out(self, cycle: object) -> None:
        self._header_timer = None
        if self.cycle is cycle and not self.transport.is_closing():
            logger.info("closing a connection from %s: no request head within %s s", self.client,
                           self._limits.header_timeout_s)  # fmt: skip
            self._answer_and_close(_TIMEOUT_408)

    def _write_timed_out(self) -> None:
        self._write_timer = None  # resume_writing cancels it: the transport is still paused
        logger.info("aborting a response to %s: it did not read for %s s", self.client,
                       self._limits.write_timeout_s)  # fmt: skip
        self.transport.abort()


class ConnectionCap:
    """ASGI middleware: a request whose head is over ``max_header_bytes`` gets 431 (h11 checks only heads still
    arriving); one arriving while ``max_requests`` are in progress gets 503 with ``Retry-After``. ``refuse(path,
    status, message)`` renders them in the path's API style; other requests go to ``app``. Runs on the server's
    event loop; ``refused`` counts the 503s."""

    def __init__(self, app: ASGIApp, limits: ConnectionLimits, refuse: Callable[[str, int, str], ASGIApp]) -> None:
        self.app = app
        self.max_requests = limits.max_requests
        self.max_header_bytes = limits.max_header_bytes
        self.refuse = refuse
        self.in_progress = 0
        self.refused = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = sum(len(name) + len(value) + 4 for name, value in scope["headers"]) + len(scope["raw_path"])
        if head > self.max_header_bytes:
            message = f"the request head is {head} bytes, over this proxy's limit of {self.max_header_bytes}; send smaller headers"
            await self.refuse(scope["path"], 431, message)(scope, receive, send)
            return
        if self.in_progress >= self.max_requests:
            self.refused += 1
            message = f"the proxy is serving its limit of {self.max_requests} requests at once; retry later"
            await self.refuse(scope["path"], 503, message)(scope, receive, send)
            return
        self.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1
