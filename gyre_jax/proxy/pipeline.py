"""The turn pipeline shared by every API: a ``TurnRequest`` in, a committed ``Completion`` out.

Places a turn (thread, token-in/token-out prompt, sampling), submits it to the backend, waits for it
(cancelling it if the client goes away; for a stream, passing on text deltas as the backend samples tokens,
and keep-alives while nothing comes), checks the result, and commits it: the completion is parsed, its TITO
record is fsynced into the execution's file, and the thread remembers it, all before the reply (or a
stream's last event) is framed. Wire formats live in ``adapters/``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from gyre_jax.proxy import chat_template, tito
from gyre_jax.proxy.errors import ProxyError, execution_ended, internal_error
from gyre_jax.proxy.identity import Execution
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.streaming import LiveReply, Pieces
from gyre_jax.proxy.turns import (
    Completed,
    Completion,
    Delta,
    Failed,
    KeepAlive,
    Turn,
    TurnEvent,
    TurnRequest,
    complete,
    derive_seed,
    parse_text,
    text_ids_of,
    thread_state,
    tito_record,
)
from gyre_jax.serving.types import (
    ContextTooLongError,
    GenerationBackend,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    TokenChunk,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 4096  # completion budget when a request names none (always clipped to the context)
DISCONNECT_POLL_S = 0.1  # how often a waiting turn checks whether its client went away
KEEPALIVE_S = 15.0  # interval of KeepAlive events while a streamed turn waits

IsDisconnected = Callable[[], Awaitable[bool]]  # e.g. Starlette's ``request.is_disconnected``


class TurnPipeline:
    """Places, runs and commits turns on one backend, for every API adapter alike.

    ``tokenizer`` renders and decodes; ``max_tokens_cap`` bounds every completion whatever the client asks
    (None: only the context bounds it); ``default_max_tokens`` is the budget of a request that names none;
    ``seed`` is the proxy's seed, from which calls that name no seed get theirs.
    """

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: tito.Tokenizer,
        record_store: RecordStore,
        model_name: str,
        seed: int = 0,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        tools_format: str = "qwen3",
        max_tokens_cap: int | None = None,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.record_store = record_store
        self.model_name = model_name
        self.seed = seed
        self.default_max_tokens = default_max_tokens
        self.tools_format = tools_format
        self.max_tokens_cap = max_tokens_cap

    # -- placing a turn --------------------------------------------------------------------------------------------

    def prepare(self, request: TurnRequest, execution: Execution, thread_base: str, t_start: float) -> Turn:
        """Names the thread, builds the prompt ids and the sampling of the turn; 400 if it cannot be served."""
        if request.messages is None:
            build = self._raw_prompt(request.prompt)
            thread_id = execution.thread_id(thread_base, None)
        else:
            thread_id = execution.thread_id(thread_base, request.messages)
            state = execution.thread_state(thread_id)
            try:
                build = tito.build_prompt(self.tokenizer, request.messages, request.tools, state,
                                          enable_thinking=request.enable_thinking, tools_format=self.tools_format)  # fmt: skip
            except ValueError as exc:
                raise ProxyError(400, f"cannot render messages: {exc}", param="messages") from None
        sampling = self._sampling(request, execution, len(build.prompt_ids))
        generation = GenerationRequest(
            prompt_ids=build.prompt_ids, sampling=sampling, session_id=f"{execution.execution_id}/{thread_id}"
        )
        return Turn(request, execution, thread_id, build, generation, t_start)

    def _raw_prompt(self, prompt: str | list[int] | None) -> tito.PromptBuild:
        """Prompt ids of a raw completion: token ids verbatim (checked against the vocabulary) or an encoded string."""
        if isinstance(prompt, list):
            vocab = int(getattr(self.tokenizer, "vocab_size", 0) or 0)
            bad = [t for t in prompt if t < 0 or (vocab and t >= vocab)]
            if bad:
                raise ProxyError(
                    400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt"
                )
            prompt_ids = list(prompt)
        else:
            prompt_ids = self.tokenizer.encode(prompt or "")
        if not prompt_ids:
            raise ProxyError(400, "the prompt is empty; send at least one token", param="prompt")
        return tito.PromptBuild(prompt_ids=prompt_ids, reused_prefix_len=0, continued=False)

    def _sampling(self, request: TurnRequest, execution: Execution, prompt_len: int) -> SamplingParams:
        """The turn's sampling: its completion budget fits the context left after ``prompt_len`` ids."""
        call_number = execution.next_call_number()
        max_context = int(self.backend.max_context)
        room = max_context - prompt_len
        if room < 1:
            raise ProxyError(
                400,
                f"the prompt is {prompt_len} tokens but the model's context is {max_context} tokens, which leaves no "
                f"room for a completion (at most {max_context - 1} prompt tokens); shorten or summarize the "
                "conversation",
                code="context_length_exceeded",
                param="messages",
            )
        requested = request.max_tokens or self.default_max_tokens
        if self.max_tokens_cap is not None:
            requested = min(requested, self.max_tokens_cap)
        seed = request.seed
        sampling = SamplingParams(
            temperature=1.0 if request.temperature is None else float(request.temperature),
            top_p=1.0 if request.top_p is None else float(request.top_p),
            top_k=int(request.top_k or 0),
            max_tokens=min(requested, room),
            stop_ids=tuple(self.tokenizer.eos_ids),
            # A client seed is folded into [0, 2**31) so every backend's PRNG accepts it.
            seed=seed % 2**31 if seed is not None else derive_seed(self.seed, execution.execution_id, call_number),
        )
        sampling.validate()
        return sampling

    def count_tokens(self, request: TurnRequest) -> int:
        """Prompt tokens of the request's conversation rendered in full (no thread state, nothing recorded)."""
        try:
            text = chat_template.render(request.messages or [], request.tools, add_generation_prompt=True,
                                        enable_thinking=request.enable_thinking, tools_format=self.tools_format)  # fmt: skip
        except ValueError as exc:
            raise ProxyError(400, f"cannot render messages: {exc}", param="messages") from None
        return len(self.tokenizer.encode(text))

    # -- running a turn --------------------------------------------------------------------------------------------

    async def run(self, turn: Turn, is_disconnected: IsDisconnected) -> Completion | None:
        """Submits the turn, waits and commits it; None if the client went away meanwhile. Errors: ProxyError."""
        result = None
        async for item in self._wait(turn, is_disconnected, listen=False):
            result = item
        if result is None:
            return None
        return await self._commit(turn, result)

    async def stream(self, turn: Turn, is_disconnected: IsDisconnected) -> AsyncIterator[TurnEvent]:
        """``run`` for a stream: a Delta as soon as the backend samples tokens that make new text, KeepAlive while
        nothing comes, then (the record fsynced) the last Delta with the text held back so far, and Completed; or
        Failed with the error. Ends without either if the client went away. Nothing is raised: the stream's
        headers are already sent.

        The deltas concatenate to the committed completion (see ``streaming``); tokens the backend did not stream
        (a cell in another process) arrive with the result and go out in one piece before Completed.
        """
        live = LiveReply(self.tokenizer.decode, turn.generation.sampling.stop_ids,
                         chat=turn.request.messages is not None, parse_tools=turn.request.parse_tools)  # fmt: skip
        try:
            result = None
            async for item in self._wait(turn, is_disconnected, listen=True):
                if item is None:
                    yield KeepAlive()
                elif isinstance(item, TokenChunk):
                    pieces = live.feed(item.token_ids)
                    if pieces:
                        yield Delta(item.token_ids, pieces.text, pieces.reasoning, pieces.content)
                else:
                    result = item
            if result is None:
                return
            last = tuple(result.token_ids[live.tokens :])  # tokens that were not streamed: in the closing delta
            closing, completion = self._close(turn, result, live)
            await asyncio.to_thread(self._record, turn, completion)
        except ProxyError as err:
            yield Failed(err)
            return
        except Exception:
            logger.exception("unexpected error in a streamed call")
            yield Failed(internal_error())
            return
        if closing:
            yield Delta(last, closing.text, closing.reasoning, closing.content)
        yield Completed(completion)

    def _close(self, turn: Turn, result: GenerationResult, live: LiveReply) -> tuple[Pieces, Completion]:
        """The closing text of a streamed turn and its completion, parsed as its deltas showed it."""
        text = self.tokenizer.decode(text_ids_of(turn, result))
        whole = parse_text(text, turn.request.parse_tools) if turn.request.messages is not None else None
        closing, parsed = live.finish(result.token_ids, text, whole)
        return closing, complete(turn, result, self.tokenizer, parsed)

    async def _wait(
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
            waiting = self._submit(turn)
            next_keepalive = time.monotonic() + KEEPALIVE_S
            next_poll = time.monotonic() + DISCONNECT_POLL_S
            try:
                while not (waiting.done() and chunks.empty()):
                    chunk = await _next_chunk(chunks, waiting, DISCONNECT_POLL_S)
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
            except asyncio.CancelledError:
                self.backend.cancel(request_id)
                raise
            yield self._checked_result(turn, waiting)
        finally:
            turn.execution.finish(request_id)

    def _submit(self, turn: Turn) -> asyncio.Future[GenerationResult]:
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

    @staticmethod
    def _checked_result(turn: Turn, waiting: asyncio.Future[GenerationResult]) -> GenerationResult:
        """The generation, or the ProxyError its failure means to the client (400 context, 409 ended, 503)."""
        try:
            result = waiting.result()
        except ContextTooLongError as exc:
            raise ProxyError(
                400,
                f"the prompt of {turn.prompt_tokens} tokens does not fit the serving context: {exc}; "
                "shorten or summarize the conversation",
                code="context_length_exceeded",
                param="messages",
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

    async def _commit(self, turn: Turn, result: GenerationResult) -> Completion:
        """Parses the completion, records it durably (fsync, off the event loop) and remembers the thread's call."""
        completion = complete(turn, result, self.tokenizer)
        await asyncio.to_thread(self._record, turn, completion)
        return completion

    def _record(self, turn: Turn, completion: Completion) -> None:
        turn.execution.record(
            self.record_store,
            lambda call_index: tito_record(turn, completion, call_index, self.model_name),
            turn.thread_id,
            thread_state(turn, completion),
        )


async def _next_chunk(chunks: asyncio.Queue[TokenChunk], waiting: asyncio.Future, timeout: float) -> TokenChunk | None:
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
