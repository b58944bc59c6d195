"""The turn pipeline shared by every API: a ``TurnRequest`` in, a committed ``Completion`` out.

Places a turn (thread, token-in/token-out prompt, sampling), submits it to the backend, waits for it
(cancelling it if the client goes away, yielding keep-alives to a stream), checks the result, and commits
it: the completion is parsed, its TITO record is fsynced into the execution's file, and the thread
remembers it, all before any reply is framed. Wire formats live in ``adapters/``.
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
from gyre_jax.proxy.turns import (
    Completed,
    Completion,
    Failed,
    KeepAlive,
    Turn,
    TurnEvent,
    TurnRequest,
    complete,
    derive_seed,
    thread_state,
    tito_record,
)
from gyre_jax.serving.types import (
    ContextTooLongError,
    GenerationBackend,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
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
        placement = execution.place(thread_base, request.messages, request.tools)
        thread_id = placement.thread_id
        if request.messages is None:
            build = self._raw_prompt(request.prompt)
        else:
            try:
                build = tito.build_prompt(self.tokenizer, request.messages, request.tools, placement.state,
                                          enable_thinking=request.enable_thinking, tools_format=self.tools_format)  # fmt: skip
            except ValueError as exc:
                raise ProxyError(400, f"cannot render messages: {exc}", param="messages") from None
        sampling = self._sampling(request, execution, len(build.prompt_ids))
        generation = GenerationRequest(
            prompt_ids=build.prompt_ids, sampling=sampling, session_id=f"{execution.execution_id}/{thread_id}"
        )
        return Turn(request, execution, thread_id, build, generation, t_start, placement=placement)

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
        async for item in self._wait(turn, is_disconnected):
            result = item
        if result is None:
            return None
        return await self._commit(turn, result)

    async def stream(self, turn: Turn, is_disconnected: IsDisconnected) -> AsyncIterator[TurnEvent]:
        """``run`` for a stream: KeepAlive while the turn waits, then Completed, or Failed with the error.

        Ends without either if the client went away. Nothing is raised: the stream's headers are already sent.
        """
        try:
            result = None
            async for item in self._wait(turn, is_disconnected):
                if item is None:
                    yield KeepAlive()
                result = item
            if result is None:
                return
            completion = await self._commit(turn, result)
        except ProxyError as err:
            yield Failed(err)
            return
        except Exception:
            logger.exception("unexpected error in a streamed call")
            yield Failed(internal_error())
            return
        yield Completed(completion)

    async def _wait(self, turn: Turn, is_disconnected: IsDisconnected) -> AsyncIterator[GenerationResult | None]:
        """Submits the turn; yields None every KEEPALIVE_S while it runs, then its checked result.

        Ends without a result if the client disconnects (the backend request is then cancelled).
        """
        request_id = turn.generation.request_id
        turn.execution.begin(request_id)
        try:
            try:
                future = self.backend.submit(turn.generation)
            except RuntimeError as exc:  # e.g. the router has no serving backend left
                raise ProxyError(
                    503, f"no serving backend is available: {exc}; retry later", error_type="server_error"
                ) from None
            waiting = asyncio.wrap_future(future)
            waiting.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "exception was never retrieved"
            next_keepalive = time.monotonic() + KEEPALIVE_S
            try:
                while not waiting.done():
                    await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
                    if waiting.done():
                        break
                    if await is_disconnected():
                        self.backend.cancel(request_id)
                        return
                    if time.monotonic() >= next_keepalive:
                        next_keepalive += KEEPALIVE_S
                        yield None
            except asyncio.CancelledError:
                self.backend.cancel(request_id)
                raise
            yield self._checked_result(turn, waiting)
        finally:
            turn.execution.finish(request_id)

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
            turn.placement,
            thread_state(turn, completion),
        )
