"""Waiting on the serving backend for a turn: submit its request, pass on the tokens the backend streams,
time keep-alives, cancel it if the client goes away, and turn a failed generation into the ``ProxyError`` it
means to the client. ``TurnPipeline`` places and commits turns; this is what it does in between.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from gyre_jax.proxy.errors import ContextOverflow, ProxyError, execution_ended
from gyre_jax.proxy.turns import Delta, Turn
from gyre_jax.serving.types import ContextTooLongError, GenerationBackend, GenerationResult, TokenChunk

DISCONNECT_POLL_S = 0.1  # how often a waiting turn checks whether its client went away
KEEPALIVE_S = 15.0  # interval of KeepAlive events while a streamed turn waits

T = TypeVar("T")
IsDisconnected = Callable[[], Awaitable[bool]]  # e.g. Starlette's ``request.is_disconnected``


class Waiter:
    """Runs turns' generation requests on ``backend`` (see the module docstring)."""

    def __init__(self, backend: GenerationBackend) -> None:
        self.backend = backend

    async def wait(
        self, turn: Turn, is_disconnected: IsDisconnected, listen: bool
    ) -> AsyncIterator[GenerationResult | TokenChunk | None]:
        """Submits the turn; yields (with ``listen``) each TokenChunk as the backend samples it, None when nothing
        came for KEEPALIVE_S, then its checked result.

        Ends without a result if the client disconnects (the backend request is then cancelled).
        """
        request_id = turn.generation.request_id
        chunks: asyncio.Queue[TokenChunk] = asyncio.Queue()
        if listen:
            event_loop = asyncio.get_running_loop()
            turn.generation.on_tokens = lambda chunk: event_loop.call_soon_threadsafe(chunks.put_nowait, chunk)
        turn.execution.begin(request_id)
        try:
            waiting = self.submit(turn)
            next_keepalive = time.monotonic() + KEEPALIVE_S
            next_poll = time.monotonic() + DISCONNECT_POLL_S
            try:
                while not (waiting.done() and chunks.empty()):
                    chunk = await next_chunk(chunks, waiting, DISCONNECT_POLL_S)
                    now = time.monotonic()
                    if chunk is not None:
                        next_keepalive = now + KEEPALIVE_S
                        yield chunk
                    if waiting.done():
                        continue
                    if now >= next_poll:
                        next_poll = now + DISCONNECT_POLL_S
                        if await is_disconnected():
                            self.backend.cancel(request_id)
                            return
                    if now >= next_keepalive:
                        next_keepalive = now + KEEPALIVE_S
                        yield None
            except (asyncio.CancelledError, GeneratorExit):  # cancelled, or its stream was closed (client gone)
                self.backend.cancel(request_id)
                raise
            yield self.checked_result(turn, waiting)
        finally:
            turn.execution.finish(request_id)

    def submit(self, turn: Turn) -> asyncio.Future[GenerationResult]:
        """The turn's backend request, submitted; 503 if no backend can take it."""
        try:
            future = self.backend.submit(turn.generation)
        except RuntimeError as exc:  # e.g. the router has no serving backend left
            raise ProxyError(
                503, f"no serving backend is available: {exc}; retry later", error_type="server_error"
            ) from None
        waiting = asyncio.wrap_future(future)
        waiting.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "exception was never retrieved"
        return waiting

    def checked_result(self, turn: Turn, waiting: asyncio.Future[GenerationResult]) -> GenerationResult:
        """The generation, or the ProxyError its failure means to the client (400 context, 409 ended, 503)."""
        try:
            result = waiting.result()
        except ContextTooLongError as exc:  # the serving cell's own limit: worded as the proxy's own overflow
            limit = int(self.backend.max_context)
            raise ContextOverflow(turn.prompt_tokens, limit, detail=f"the serving backend refused it: {exc}") from None
        except ValueError as exc:
            if not turn.generation.sampling.stop_strings:
                raise
            raise ProxyError(
                400, f"not supported by this serving backend: stop sequences ({exc}); omit them", param="stop"
            ) from None
        if result.finish_reason == "cancelled":
            if turn.execution.ended:
                raise execution_ended(turn.execution.execution_id)
            raise ProxyError(
                503,
                "the serving backend cancelled this generation and could not place it elsewhere; retry the call",
                error_type="server_error",
                code="generation_cancelled",
            )
        return result

    async def wait_choices(
        self, turns: list[Turn], is_disconnected: IsDisconnected
    ) -> AsyncIterator[list[GenerationResult] | None]:
        """``wait`` of a call's choices (n > 1, none listened to): the first alone, then the rest at once (one of
        them reuses the prompt's KV that the first left in its session's prefix cache); yields None every
        KEEPALIVE_S, then all the results. Ends without results if the client disconnects (every choice is then
        cancelled)."""
        first = None
        async for item in self.wait(turns[0], is_disconnected, listen=False):
            if item is None:
                yield None
            first = item
        if first is None:
            return
        waits = [final(self.wait(turn, is_disconnected, listen=False)) for turn in turns[1:]]
        tasks = [asyncio.ensure_future(wait) for wait in waits]
        try:
            while not all(task.done() for task in tasks):
                _, pending = await asyncio.wait(tasks, timeout=KEEPALIVE_S)
                if pending:
                    yield None
        finally:
            for task in tasks:
                task.cancel()
        rest = results_of(tasks)
        if rest is not None:
            yield [first, *rest]


def results_of(tasks: list[asyncio.Future]) -> list | None:
    """The results of a call's finished choice tasks, in order; None if one ended without a result (its client
    went away). Every exception is retrieved and the first one raised: it fails the call."""
    for error in [task.exception() for task in tasks if task.exception() is not None][:1]:
        raise error
    results = [task.result() for task in tasks]
    return results if all(result is not None for result in results) else None


async def final(items: AsyncIterator[T | None]) -> T | None:
    """The last item that is not None (a wait's result without its keep-alives); None if there was none."""
    last = None
    async for item in items:
        last = item if item is not None else last
    return last


async def next_chunk(chunks: asyncio.Queue[TokenChunk], waiting: asyncio.Future, timeout: float) -> TokenChunk | None:
    """The next queued chunk, waiting up to ``timeout`` s for one (or for ``waiting`` to finish); None if none came."""
    if not chunks.empty():
        return chunks.get_nowait()
    if waiting.done():
        return None
    getter = asyncio.ensure_future(chunks.get())
    try:
        await asyncio.wait({getter, waiting}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not getter.done():
            getter.cancel()
    return getter.result() if getter.done() and not getter.cancelled() else None


async def drain(
    deltas: asyncio.Queue[Delta], tasks: list[asyncio.Future[GenerationResult | None]]
) -> AsyncIterator[Delta | None]:
    """The queued deltas as they come until every task finished; None after KEEPALIVE_S without one."""
    last = time.monotonic()
    while True:
        while not deltas.empty():
            yield deltas.get_nowait()
            last = time.monotonic()
        pending = [task for task in tasks if not task.done()]
        if not pending:
            return
        getter = asyncio.ensure_future(deltas.get())
        try:
            timeout = max(0.0, last + KEEPALIVE_S - time.monotonic())
            await asyncio.wait({getter, *pending}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            yield getter.result()
            last = time.monotonic()
        elif time.monotonic() >= last + KEEPALIVE_S:
            yield None
            last = time.monotonic()
