"""The turn pipeline shared by every API: a ``TurnRequest`` in, a committed ``Completion`` out.

Places a turn (thread, token-in/token-out prompt, sampling), submits it to the backend, waits for it
(cancelling it if the client goes away; for a stream, passing on text deltas as the backend samples tokens,
and keep-alives while nothing comes), checks the result, and commits it: the completion is parsed, its TITO
record is fsynced into the execution's file, and the thread remembers it, all before the reply (or a
stream's last event) is framed. Wire formats live in ``adapters/``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

from gyre_jax.proxy import chat_format, sampling, tito
from gyre_jax.proxy.errors import ContextOverflow, ProxyError, internal_error
from gyre_jax.proxy.identity import Execution
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.sampling import CLIENT, SamplingPolicy
from gyre_jax.proxy.streaming import LiveReply
from gyre_jax.proxy.turns import (
    Completed,
    Completion,
    Delta,
    Failed,
    KeepAlive,
    Turn,
    TurnEvent,
    TurnRequest,
    committed_text,
    complete,
    derive_seed,
    parse_turn_text,
    thread_state,
    tito_record,
)
from gyre_jax.proxy.waiting import IsDisconnected, Waiter, drain, final, results_of
from gyre_jax.serving.types import (
    GenerationBackend,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    TokenChunk,
    new_request_id,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 4096  # completion budget when a request names none (always clipped to the context)


def forced_prefix(request: TurnRequest, calls: chat_format.ToolCallFormat = chat_format.HERMES) -> str:
    """The text a chat turn's ``tool_choice`` forces it to start with in the tool-call family ``calls`` ("" if
    none); 400 if it cannot be served."""
    if request.messages is None:
        return ""
    try:
        sampling.check_tool_choice(request.tool_choice, request.tools)
    except ValueError as exc:
        raise ProxyError(400, str(exc), param="tool_choice") from None
    return sampling.forced_prefix(request.tool_choice, request.tools, calls)


class TurnPipeline:
    """Places, runs and commits turns on one backend, for every API adapter alike.

    ``tokenizer`` encodes and decodes; ``tools_format`` is the chat format (``chat_format.ChatFormat``: the
    checkpoint's own template and tool-call family) or a built-in one's name; ``max_tokens_cap`` bounds every completion whatever the client asks
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
        tools_format: str | chat_format.ChatFormat = "qwen3",
        max_tokens_cap: int | None = None,
        sampling: SamplingPolicy = CLIENT,
    ) -> None:
        self.backend = backend
        self.waiter = Waiter(backend)
        self.tokenizer = tokenizer
        self.record_store = record_store
        self.model_name = model_name
        self.seed = seed
        self.default_max_tokens = default_max_tokens
        self.chat_format = chat_format.of(tools_format)  # the model's template and tool-call family
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
                                          enable_thinking=request.enable_thinking, tools_format=self.chat_format)  # fmt: skip
            except ValueError as exc:
                raise ProxyError(400, f"cannot render messages: {exc}", param="messages") from None
        forced = forced_prefix(request, self.chat_format.tool_calls)
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
            tool_format=self.chat_format.tool_calls,
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
        if room < 1:  # worded as each API words it, so harnesses recognise the overflow and compact
            raise ContextOverflow(prompt_len, max_context)
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
            text = self.chat_format.render(request.messages or [], request.tools, add_generation_prompt=True,
                                           enable_thinking=request.enable_thinking)  # fmt: skip
        except ValueError as exc:
            raise ProxyError(400, f"cannot render messages: {exc}", param="messages") from None
        return len(self.tokenizer.encode(text))

    # -- running a turn --------------------------------------------------------------------------------------------

    async def run(self, turn: Turn, is_disconnected: IsDisconnected) -> Completion | None:
        """Submits the turn, waits and commits it; None if the client went away meanwhile. Errors: ProxyError."""
        result = None
        async for item in self.waiter.wait(turn, is_disconnected, listen=False):
            result = item
        if result is None:
            return None
        return await self._commit(turn, result)

    async def stream(self, turn: Turn, is_disconnected: IsDisconnected) -> AsyncIterator[TurnEvent]:
        """``run`` for a stream: a Delta as soon as the backend samples tokens that make new text (first the text a
        ``tool_choice`` forced, if any), KeepAlive while nothing comes, then (the record fsynced) the last Delta
        with the text held back so far, and Completed; or Failed with the error. Ends without either if the
        client went away. Nothing is raised: the stream's headers are already sent.

        The deltas concatenate to the committed completion (see ``streaming``: with stop strings, no delta goes
        past where the committed text may end); tokens the backend did not stream (a cell in another process)
        arrive with the result and go out in one piece before Completed.
        """
        async for event in self.stream_choices([turn], is_disconnected):
            yield event

    async def stream_choices(self, turns: list[Turn], is_disconnected: IsDisconnected) -> AsyncIterator[TurnEvent]:
        """``stream`` of a call's choices (``choices``; one or more), each streamed live, its events tagged with
        its ``index``: the first choice runs alone, then the rest at once, their deltas interleaved as sampled.
        Once all finished and their records are fsynced: each choice's closing Delta and Completed, in order."""
        lives = [self._live_reply(turn) for turn in turns]
        try:
            results = None
            async for item in self._live_choices(turns, lives, is_disconnected):
                if item is None:
                    yield KeepAlive()
                elif isinstance(item, Delta):
                    yield item
                else:
                    results = item
            if results is None:
                return
            closes = [self._close(turn, result, live) for turn, result, live in zip(turns, results, lives)]
            await asyncio.to_thread(_record, self.record_store, self.model_name, turns, [c for _, c in closes])
        except ProxyError as err:
            yield Failed(err)
            return
        except Exception:
            logger.exception("unexpected error in a streamed call")
            yield Failed(internal_error())
            return
        for turn, (closing, completion) in zip(turns, closes):
            if closing is not None:
                yield closing
            yield Completed(completion, turn.index)

    def _live_reply(self, turn: Turn) -> LiveReply:
        request = turn.request
        chat = request.messages is not None
        return LiveReply(self.tokenizer.decode, turn.generation.sampling.stop_ids, chat, request.parse_tools,
                         stops=request.stop, forced=turn.forced_text, call_open=turn.tool_format.open)  # fmt: skip

    async def _live(
        self, turn: Turn, live: LiveReply, is_disconnected: IsDisconnected
    ) -> AsyncIterator[Delta | GenerationResult | None]:
        """One choice's stream: the forced text's Delta at once, a Delta per chunk that makes new text, None
        for a keep-alive, then its checked result (none if the client went away)."""
        pieces = live.start()
        if pieces:
            yield Delta((), pieces.text, pieces.reasoning, pieces.content, turn.index)
        async for item in self.waiter.wait(turn, is_disconnected, listen=True):
            if isinstance(item, TokenChunk):
                pieces = live.feed(item.token_ids)
                if pieces:
                    yield Delta(item.token_ids, pieces.text, pieces.reasoning, pieces.content, turn.index)
            else:
                yield item

    async def _live_choices(
        self, turns: list[Turn], lives: list[LiveReply], is_disconnected: IsDisconnected
    ) -> AsyncIterator[Delta | list[GenerationResult] | None]:
        """``_live`` of each choice: the first alone, then the rest at once (one of them reuses the prompt's KV
        the first left in its session's prefix cache), their deltas as they come, None after KEEPALIVE_S without
        any; then all the results. Ends without results if the client went away (every choice cancelled)."""
        first = None
        async for item in self._live(turns[0], lives[0], is_disconnected):
            if isinstance(item, GenerationResult):
                first = item
            else:
                yield item
        if first is None:
            return
        deltas: asyncio.Queue[Delta] = asyncio.Queue()

        async def pump(turn: Turn, live: LiveReply) -> GenerationResult | None:
            result = None
            async for item in self._live(turn, live, is_disconnected):
                if isinstance(item, Delta):
                    deltas.put_nowait(item)
                elif item is not None:
                    result = item
            return result

        tasks = [asyncio.ensure_future(pump(turn, live)) for turn, live in zip(turns[1:], lives[1:])]
        try:
            async for item in drain(deltas, tasks):
                yield item
        finally:
            for task in tasks:
                task.cancel()
        rest = results_of(tasks)
        if rest is not None:
            yield [first, *rest]

    def _close(self, turn: Turn, result: GenerationResult, live: LiveReply) -> tuple[Delta | None, Completion]:
        """The closing Delta of a streamed turn (None if nothing is left to send) and its completion, cut at a
        stop string as a non-streamed call's is and parsed as its deltas showed it."""
        last = tuple(result.token_ids[live.tokens :])  # tokens that were not streamed: in the closing delta
        _, text, _, _ = committed_text(turn, result, self.tokenizer)
        pieces, parsed = live.finish(result.token_ids, text, parse_turn_text(turn, text))
        closing = Delta(last, pieces.text, pieces.reasoning, pieces.content, turn.index) if pieces else None
        return closing, complete(turn, result, self.tokenizer, parsed)

    async def run_choices(self, turns: list[Turn], is_disconnected: IsDisconnected) -> list[Completion] | None:
        """``run`` for a call's choices (``choices``): their completions in order; None if the client went away."""
        results = await final(self.waiter.wait_choices(turns, is_disconnected))
        return None if results is None else await self._commit_all(turns, results)

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
