"""The turn, the seam between the APIs and the pipeline: what every API request is translated into
(``TurnRequest``), what the pipeline makes of it (``Turn``, ``Completion``, the ``TurnEvent``s of a streamed
turn), and the pure functions of a finished turn (per-call seed, completion, TITO record, thread state).

Nothing here knows a wire format: messages are in the internal (OpenAI chat) form that the chat template
renders, and finish reasons are ``stop`` | ``length`` | ``tool_calls``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy import chat_format, sampling, tito
from gyre_jax.proxy.chat_template import ParsedCompletion, parse_completion
from gyre_jax.proxy.errors import ProxyError
from gyre_jax.proxy.identity import Execution, Placement
from gyre_jax.proxy.records import TitoRecord, encode_experts
from gyre_jax.serving.types import GenerationRequest, GenerationResult


@dataclass(frozen=True)
class TurnRequest:
    """One model call as an adapter translated it; the pipeline reads nothing else of the HTTP request.

    Either ``messages`` (a chat turn: rendered with the chat template, continuing its thread token-in/token-out)
    or ``prompt`` (a raw completion: a string whose special tokens become their single ids, or token ids used
    verbatim). Sampling fields left None take the pipeline's defaults (``SamplingPolicy``).

    This is the one place an API's sampling features land: an adapter (any API, e.g. a Responses adapter) fills
    ``temperature`` / ``top_p`` / ``top_k`` / ``seed``, ``stop``, ``n`` and ``tool_choice`` (internal form,
    ``sampling.py``) with what the client sent, None / () where it sent nothing; the pipeline serves them and
    ``client_sampling()`` records them.
    """

    api: str  # the record's "api": chat | completions | messages | responses (one name per API)
    messages: list[dict[str, Any]] | None = None  # internal (OpenAI chat) messages, key order as the client sent
    tools: list[dict[str, Any]] | None = None  # internal (OpenAI function) tools
    prompt: str | list[int] | None = None
    enable_thinking: bool | None = None  # False: the prompt closes an empty <think> block
    parse_tools: bool = True  # False (tool_choice none): tool-call text stays plain content
    logprobs: bool = False  # the completion carries one TokenPiece per returned token
    stream: bool = False  # answered as SSE (``TurnAdapter.stream``) rather than one body (``respond``)
    temperature: float | None = None  # None: 1.0
    top_p: float | None = None  # None: 1.0
    top_k: int | None = None  # None or 0: off
    max_tokens: int | None = None  # None: the proxy's default; always clipped to its cap and to the context
    seed: int | None = None  # None: derived from the proxy's seed, the execution and its call number
    stop: tuple[str, ...] = ()  # stop strings: the returned text ends before the first one (sampling.stop_strings)
    n: int | None = None  # choices (None: 1): each its own generation and TITO record, sharing the prompt
    tool_choice: str | dict[str, Any] | None = None  # internal form (sampling.py); None: not sent, as "auto"
    wire: Any = None  # the adapter's validated request, for framing the reply; the pipeline never reads it

    def client_sampling(self) -> dict[str, Any] | None:
        """The sampling fields the client sent, as the record keeps them (``TitoRecord.client_sampling``)."""
        return sampling.client_sampling(
            {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
             "stop": self.stop, "n": self.n, "tool_choice": self.tool_choice}
        )  # fmt: skip


@dataclass
class Turn:
    """A ``TurnRequest`` placed by the pipeline: its execution, thread, prompt ids and backend request."""

    request: TurnRequest
    execution: Execution
    thread_id: str
    build: tito.PromptBuild
    generation: GenerationRequest
    t_start: float  # when the HTTP request arrived (Unix time)
    created: int = field(default_factory=lambda: int(time.time()))  # when the turn was placed (Unix second)
    placement: Placement | None = None  # the conversation it continues or starts (None: recorded on no conversation)
    forced_text: str = ""  # text forced at the turn's start (tool_choice): its ids end build.prompt_ids
    index: int = 0  # the choice this turn is (n > 1), in the reply's ``choices``
    tool_format: chat_format.ToolCallFormat = chat_format.HERMES  # how the model writes tool calls

    @property
    def prompt_tokens(self) -> int:
        return len(self.build.prompt_ids)


@dataclass(frozen=True)
class TokenPiece:
    """One returned token for log-prob replies: its text, its raw bytes and its log-prob."""

    text: str
    raw: bytes
    logprob: float


@dataclass
class Completion:
    """A turn's generation, committed: durably recorded and remembered as its thread's last call."""

    result: GenerationResult
    text_ids: list[int]  # completion ids without the trailing stop id
    text: str  # decode(text_ids)
    parsed: ParsedCompletion | None  # None for a raw-prompt completion
    message: dict[str, Any] | None  # the assistant message (internal form) for a chat turn, else None
    finish_reason: str  # stop | length | tool_calls
    pieces: list[TokenPiece] | None  # one per text id when the request asked for log-probs, else None
    kept: int | None = None  # leading generated ids the record keeps (None: all); fewer when a stop string cut it
    stop_sequence: str | None = None  # the stop string that ended the text, if one did

    @property
    def kept_ids(self) -> list[int]:
        """The generated ids the record and the thread keep: [kept] (see ``complete``)."""
        ids = self.result.token_ids
        return list(ids if self.kept is None else ids[: self.kept])

    @property
    def completion_tokens(self) -> int:
        """Generated tokens, the stop token included (what usage counts)."""
        return len(self.result.token_ids)


@dataclass(frozen=True)
class KeepAlive:
    """A streamed turn is still running (sent at an interval while the client waits)."""


@dataclass(frozen=True)
class Delta:
    """New text of a streamed turn, as its tokens were sampled (never half a character, never a stop token's text).

    ``token_ids``: the ids this delta covers (a delta may cover none: the text held back at the end);
    ``text``: their raw text; ``reasoning`` / ``content``: the same text as a chat reply splits it (the
    ``<think>`` block's text, the content; text from a ``<tool_call>`` opener on is held back and goes out
    parsed in the completion). For a raw completion ``content == text``. The deltas of a turn concatenate
    to its committed ``Completion``: ``text``, ``parsed.reasoning`` and ``parsed.content``. ``index``: the
    choice (``Turn.index``) of a call with several.
    """

    token_ids: tuple[int, ...]
    text: str
    reasoning: str = ""
    content: str = ""
    index: int = 0


@dataclass(frozen=True)
class Completed:
    """A streamed turn's committed completion: its last event (of choice ``index``: a call with several choices
    ends with one per choice, in order)."""

    completion: Completion
    index: int = 0


@dataclass(frozen=True)
class Failed:
    """A streamed turn failed after its stream started: always its last event."""

    error: ProxyError


# What a streamed turn yields: KeepAlive and Delta events in any order, then Completed or Failed (neither if the
# client went away).
TurnEvent = KeepAlive | Delta | Completed | Failed


def derive_seed(server_seed: int, execution_id: str, call_index: int) -> int:
    """Deterministic per-call sampling seed (31 bits) for requests that do not name one."""
    digest = hashlib.sha256(f"{server_seed}/{execution_id}/{call_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def returned_message(parsed: ParsedCompletion) -> dict[str, Any]:
    """The assistant message as the client receives it (and, normalized, as the thread remembers it)."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if (parsed.tool_calls and not parsed.content) else parsed.content,
    }
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    return message


def parse_text(
    text: str, parse_tools: bool, calls: chat_format.ToolCallFormat = chat_format.HERMES
) -> ParsedCompletion:
    """The completion's reasoning, content and tool calls (written in the family ``calls``); with ``parse_tools``
    False tool-call text stays content."""
    parsed = parse_completion(text, calls.parse)
    if parse_tools or not parsed.tool_calls:
        return parsed
    body = text.split("</think>", 1)[1].lstrip("\n") if "</think>" in text else text
    return ParsedCompletion(content=body, reasoning=parsed.reasoning)


def token_bytes(tokenizer: tito.Tokenizer, token_id: int) -> bytes:
    """The raw bytes one id stands for (its UTF-8 text where the tokenizer cannot say)."""
    if isinstance(tokenizer, ByteTokenizer) and token_id < 256:
        return bytes([token_id])
    raw = getattr(tokenizer, "token_bytes", None)
    if callable(raw):
        return raw(token_id)
    return tokenizer.decode([token_id]).encode("utf-8")


def parse_forced(
    text: str, parse_tools: bool, calls: chat_format.ToolCallFormat = chat_format.HERMES
) -> ParsedCompletion:
    """``parse_text`` of a turn forced to open a tool call: a call the model closed without the template's
    closing text (hermes ``}\n</tool_call>``: it stopped after valid arguments) is closed for it; the record
    keeps the real ids."""
    parsed = parse_text(text, parse_tools, calls)
    if parsed.tool_calls or (calls is chat_format.HERMES and "</tool_call>" in text):
        return parsed
    for closing in calls.closings:
        repaired = parse_text(text.rstrip() + closing, parse_tools, calls)
        if repaired.tool_calls and not repaired.tool_call_errors:
            return repaired
    return parsed


def parse_turn_text(turn: Turn, text: str) -> ParsedCompletion | None:
    """The parse of a chat turn's whole text (``forced_text`` included); None for a raw completion."""
    if turn.request.messages is None:
        return None
    parse = parse_forced if turn.forced_text else parse_text
    return parse(text, turn.request.parse_tools, turn.tool_format)


def committed_text(
    turn: Turn, result: GenerationResult, tokenizer: tito.Tokenizer
) -> tuple[list[int], str, int | None, str | None]:
    """(text ids [N], text, kept, stop_sequence) of a generation: the trailing stop id cut; a stop string cuts
    the text before it and the record keeps only whole generated tokens (``kept``; None: all): when the stop
    string starts inside a token, that token and the rest are dropped and the text ends where the kept tokens
    end, so the record decodes to exactly the returned text (``forced_text`` + kept ids)."""
    ids = list(result.token_ids)
    stop_ids = turn.generation.sampling.stop_ids
    text_ids = ids[:-1] if result.finish_reason == "stop" and ids and ids[-1] in stop_ids else ids
    kept, stop_sequence = None, None
    if turn.request.stop:
        decoded = tokenizer.decode(text_ids)
        cut, stop_sequence = sampling.visible_len(decoded, turn.request.stop)
        if stop_sequence is not None:
            kept = tito.whole_tokens(tokenizer, text_ids, decoded[:cut])
            text_ids = ids[:kept]
    return text_ids, turn.forced_text + tokenizer.decode(text_ids), kept, stop_sequence


def complete(
    turn: Turn, result: GenerationResult, tokenizer: tito.Tokenizer, parsed: ParsedCompletion | None = None
) -> Completion:
    """What a generation means for its turn: text ids [N], text, parse, finish reason, pieces (see
    ``committed_text`` for the cut).

    ``parsed``: the parse a streamed turn committed to (what its deltas showed); None: parse the text here."""
    text_ids, text, kept, stop_sequence = committed_text(turn, result, tokenizer)
    if parsed is None:
        parsed = parse_turn_text(turn, text)
    if parsed is not None and parsed.tool_calls:
        finish = "tool_calls"
    else:
        finish = "stop" if result.finish_reason == "stop" or stop_sequence is not None else "length"
    pieces = None
    if turn.request.logprobs:
        pieces = [
            TokenPiece(tokenizer.decode([token_id]), token_bytes(tokenizer, token_id), float(logprob))
            for token_id, logprob in zip(text_ids, result.logprobs)
        ]
    message = returned_message(parsed) if parsed is not None else None
    return Completion(result, text_ids, text, parsed, message, finish, pieces, kept, stop_sequence)


def tito_record(turn: Turn, completion: Completion, call_index: int, model: str) -> TitoRecord:
    """The turn's durable record (``t_end`` is now): exactly the prompt and completion ids it was served."""
    result = completion.result
    kept = len(completion.kept_ids)
    return TitoRecord(
        execution_id=turn.execution.execution_id,
        call_index=call_index,
        thread_id=turn.thread_id,
        request_id=turn.generation.request_id,
        prompt_ids=list(turn.build.prompt_ids),
        completion_ids=completion.kept_ids,
        completion_logprobs=[float(x) for x in result.logprobs[:kept]],
        policy_versions=[int(v) for v in result.policy_versions[:kept]],
        finish_reason=result.finish_reason,
        temperature=turn.generation.sampling.temperature,
        reused_prefix_len=turn.build.reused_prefix_len,
        t_start=turn.t_start,
        t_end=time.time(),
        model=model,
        api=turn.request.api,
        cell=result.cell,
        agent_kind=turn.placement.agent_kind if turn.placement is not None else "",
        client_sampling=turn.request.client_sampling(),
        completion_experts=None if result.expert_ids is None else encode_experts(result.expert_ids[:kept]),
        prompt_experts=_prompt_experts(result, len(turn.build.prompt_ids)),
        cached_prompt_tokens=min(int(result.cached_tokens), len(turn.build.prompt_ids)),
    )


def _prompt_experts(result, prompt_len: int) -> dict | None:
    """The record's ``prompt_experts``: the result's, when it has one row per prompt id (else None)."""
    ids = result.prompt_expert_ids
    return None if ids is None or len(ids) != prompt_len else encode_experts(ids)


def thread_state(
    turn: Turn, completion: Completion, siblings: tuple[tito.ThreadState, ...] = ()
) -> tito.ThreadState | None:
    """What the thread remembers of a chat turn for the next call's token-in/token-out; None for a raw prompt.

    ``siblings``: the states of the call's other choices (n > 1), so the next call may continue any of them.
    """
    if turn.request.messages is None or completion.message is None:
        return None
    return tito.ThreadState(
        messages=[tito.normalize_message(m) for m in turn.request.messages],
        tools_key=tito.tools_key(turn.request.tools),
        prompt_ids=list(turn.build.prompt_ids),
        completion_ids=completion.kept_ids,
        returned=tito.normalize_message(completion.message),
        finished=completion.result.finish_reason == "stop",
        forced_text=turn.forced_text,
        alternatives=siblings,
        returned_message=completion.message,
    )
