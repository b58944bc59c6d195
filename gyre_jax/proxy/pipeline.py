"""The turn pipeline shared by every API: a ``TurnRequest`` in, a committed ``Completion`` out.

Places a turn (thread, token-in/token-out prompt, sampling), submits it to the backend, waits for it
(cancelling it if the client goes away, yielding keep-alives to a stream), checks the result, and commits
it: the completion is parsed, its TITO record is fsynced into the execution's file, and the thread
remembers it, all before any reply is framed. Wire formats live in ``adapters/``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from gyre_jax.proxy import chat_template, sampling, tito
from gyre_jax.proxy.errors import ProxyError, execution_ended, internal_error
from gyre_jax.proxy.identity import Execution
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.sampling import CLIENT, SamplingPolicy
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
    new_request_id,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 4096  # completion budget when a request names none (always clipped to the context)
DISCONNECT_POLL_S = 0.1  # how often a waiting turn checks whether its client went away
KEEPALIVE_S = 15.0  # interval of KeepAlive events while a streamed turn waits

T = TypeVar("T")
IsDisconnected = Callable[[], Awaitable[bool]]  # e.g. Starlette's ``request.is_disconnected``


def forced_prefix(request: TurnRequest) -> str:
    """The text a chat turn's ``tool_choice`` forces it to start with ("" if none); 400 if it cannot be served."""
    if request.messages is None:
        return ""
    try:
        sampling.check_tool_choice(request.tool_choice, request.tools)
    except ValueError as exc:
        raise ProxyError(400, str(exc), param="tool_choice") from None
    return sampling.forced_prefix(request.tool_choice, request.tools)


async def _final(items: AsyncIterator[T | None]) -> T | None:
    """The last item that is not None (a wait's result without its keep-alives); None if there was none."""
    last = None
    async for item in items:
        last = item if item is not None else last
    return last


class TurnPipeline:
    """Places, runs and commits turns on one backend, for every API adapter alike.

    ``tokenizer`` renders and decodes; ``max_tokens_cap`` bounds every completion whatever the client asks
    (None: only the context bounds it); ``default_max_tokens`` is the budget of a request that names none;
    ``seed`` is the proxy's seed, from which calls that name no seed get theirs; ``sampling`` says whose
    temperature / top-p / top-k a call is served with (``SamplingPolicy``: the client's unless told otherwise).
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
        sampling: SamplingPolicy = CLIENT,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.record_store = record_store
        self.model_name = model_name
        self.seed = seed
        self.default_max_tokens = default_max_tokens
        self.tools_format = tools_format
        self.max_tokens_cap = max_tokens_cap
        self.sampling = sampling

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
        forced = forced_prefix(request)
        if forced:  # forced ids end the prompt: recorded as given, never trained, continued verbatim
            build = dataclasses.replace(build, prompt_ids=build.prompt_ids + self.tokenizer.encode(forced))
        params = self._sampling(request, execution, len(build.prompt_ids))
        generation = GenerationRequest(
            prompt_ids=build.prompt_ids, sampling=params, session_id=f"{execution.execution_id}/{thread_id}"
        )
        return Turn(
            request,
            execution,
            thread_id,
            build,
            generation,
            t_start,
            placement=placement.built(build),
            forced_text=forced,
        )

    def choices(self, turn: Turn) -> list[Turn]:
        """The turn's ``n`` choices (itself first): the same prompt, each with its own seed, request and record."""
        turns = [turn]  # each a whole generation and record; adapters bound n by sampling.MAX_CHOICES
        for index in range(1, turn.request.n or 1):
            request = turn.request  # a client seed stays reproducible, and differs per choice
            seed = None if request.seed is None else request.seed + index
            params = self._sampling(dataclasses.replace(request, seed=seed), turn.execution, turn.prompt_tokens)
            generation = dataclasses.replace(turn.generation, sampling=params, request_id=new_request_id())
            turns.append(dataclasses.replace(turn, generation=generation, index=index))
        return turns

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
        temperature, top_p, top_k = self.sampling.resolve(request.temperature, request.top_p, request.top_k)
        params = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_tokens=min(requested, room),
            stop_ids=tuple(self.tokenizer.eos_ids),
            # A client seed is folded into [0, 2**31) so every backend's PRNG accepts it.
            seed=seed % 2**31 if seed is not None else derive_seed(self.seed, execution.execution_id, call_number),
            stop_strings=tuple(request.stop),
        )
        params.validate()
        return params

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

    async def run_choices(self, turns: list[Turn], is_disconnected: IsDisconnected) -> list[Completion] | None:
        """``run`` for a call's choices (``choices``): their completions in order; None if the client went away."""
        results = await _final(self._wait_choices(turns, is_disconnected))
        return None if results is None else await self._commit_all(turns, results)

    async def stream_choices(self, turns: list[Turn], is_disconnected: IsDisconnected) -> AsyncIterator[TurnEvent]:
        """``stream`` for a call's choices: KeepAlive while they run, then one Completed per choice in order,
        or Failed. Nothing is raised: the stream's headers are already sent."""
        try:
            results = None
            async for item in self._wait_choices(turns, is_disconnected):
                if item is None:
                    yield KeepAlive()
                results = item
            if results is None:
                return
            completions = await self._commit_all(turns, results)
        except ProxyError as err:
            yield Failed(err)
            return
        except Exception:
            logger.exception("unexpected error in a streamed call")
            yield Failed(internal_error())
            return
        for completion in completions:
            yield Completed(completion)

    async def _wait_choices(
        self, turns: list[Turn], is_disconnected: IsDisconnected
    ) -> AsyncIterator[list[GenerationResult] | None]:
        """Runs the first choice, then the rest at once (one of them reuses the prompt's KV that the first left
        in its session's prefix cache); yields None every KEEPALIVE_S, then all the results.

        Ends without results if the client disconnects (every running choice is then cancelled)."""
        first = None
        async for item in self._wait(turns[0], is_disconnected):
            if item is None:
                yield None
            first = item
        if first is None:
            return
        tasks = [asyncio.ensure_future(_final(self._wait(turn, is_disconnected))) for turn in turns[1:]]
        try:
            while not all(task.done() for task in tasks):
                _, pending = await asyncio.wait(tasks, timeout=KEEPALIVE_S)
                if pending:
                    yield None
        finally:
            for task in tasks:
                task.cancel()
        for error in [task.exception() for task in tasks if task.exception() is not None][:1]:
            raise error  # every exception retrieved; the first one fails the call
        rest = [task.result() for task in tasks]
        if all(result is not None for result in rest):
            yield [first, *rest]

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

    async def _commit(self, turn: Turn, result: GenerationResult) -> Completion:
        """Parses the completion, records it durably (fsync, off the event loop) and remembers the thread's call."""
        return (await self._commit_all([turn], [result]))[0]

    async def _commit_all(self, turns: list[Turn], results: list[GenerationResult]) -> list[Completion]:
        """``_commit`` of a call's choices, in order: each its own record; the thread remembers them all."""
        completions = [complete(turn, result, self.tokenizer) for turn, result in zip(turns, results)]
        await asyncio.to_thread(_record, self.record_store, self.model_name, turns, completions)
        return completions


def _record(record_store: RecordStore, model_name: str, turns: list[Turn], completions: list[Completion]) -> None:
    """Records a call's choices in order (each fsynced), each remembered with the others as its alternatives."""
    siblings: tuple[tito.ThreadState, ...] = ()
    for turn, completion in zip(turns, completions):
        state = thread_state(turn, completion, siblings)
        turn.execution.record(
            record_store,
            lambda call_index, t=turn, c=completion: tito_record(t, c, call_index, model_name),
            turn.placement,
            state,
        )
        if state is not None:
            siblings = (*siblings, dataclasses.replace(state, alternatives=()))
