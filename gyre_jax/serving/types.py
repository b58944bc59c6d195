"""Records that cross the serving boundary: what the proxy asks a serving cell for, and what comes back.

The proxy (and anything else that wants tokens) talks to serving through the ``GenerationBackend``
protocol: ``submit`` returns a ``concurrent.futures.Future`` resolved by the cell's serving loop. A request
may carry a ``TokenListener`` (``GenerationRequest.on_tokens``): the loop calls it with each ``TokenChunk``
as it samples them, so a caller can stream tokens before the future resolves. The result always holds every
token, whether or not a listener saw them (a listener never crosses a process: see ``GenerationRequest``).
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

_request_ids = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_request_ids)}"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` means greedy; ``top_k == 0`` and ``top_p == 1`` disable them.

    Log-probs are always those of the temperature-scaled distribution (``softmax(logits / T)``; ``T = 1``
    for greedy), before top-k/top-p truncation: that is the distribution the trainer re-computes.

    Generation stops after a token in ``stop_ids`` or after the token that completes one of
    ``stop_strings`` in the detokenized completion (that token is kept: the result holds exact token ids,
    and the caller cuts the text at the stop string). ``stop_strings`` need a loop built with a
    ``detokenize`` callable. ``seed`` fixes the sampling key (None: the loop derives one).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop_ids: tuple[int, ...] = ()
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()

    def validate(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if isinstance(self.stop_strings, str) or not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ValueError(f"stop_strings={self.stop_strings!r} must be a tuple of non-empty strings")


@dataclass(frozen=True)
class TokenChunk:
    """Tokens one request just sampled, in order: ``token_ids[k]`` is token ``start + k`` of its completion.

    token_ids / logprobs / policy_versions: [n] each, as they will appear in the ``GenerationResult``.
    """

    request_id: str
    start: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_versions: tuple[int, ...]


# Called by a serving loop's thread, under its lock, with each step's new tokens of one request: it must return
# at once (hand the chunk to another thread or event loop) and should not raise (an error is logged and the
# listener is dropped for that request; the request itself goes on).
TokenListener = Callable[[TokenChunk], None]


@dataclass
class GenerationRequest:
    """A prompt (exact token ids) to complete. ``session_id`` lets the router keep a session on one cell.

    ``on_tokens``: an optional ``TokenListener`` told of every sampled token as it is sampled, chunk by chunk
    with no gap or repeat (tokens sampled before a migration or a recompute are not told again). It stays in
    this process: a pickled request (sent to a cell of another process) travels without it, and its tokens
    then reach the caller only in the result.
    """

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session_id: str | None = None
    request_id: str = field(default_factory=new_request_id)
    on_tokens: TokenListener | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["on_tokens"] = None  # a callable of this process means nothing in another one
        return state


@dataclass
class GenerationResult:
    """Completion of one request.

    token_ids / logprobs / policy_versions: [N] each; logprobs are behaviour log-probs of each sampled
    token, policy_versions the weight version that produced each token (they can differ within one
    completion if weights were updated while it was in flight). ``finish_reason`` is ``"stop"`` (a stop
    id was sampled, or a stop string completed; the token that did it is included in ``token_ids``),
    ``"length"`` (max_tokens or context limit), or ``"cancelled"``. ``stop_reason`` is the stop id or stop
    string that ended it (None otherwise). ``cached_tokens`` is how many leading prompt tokens were not
    prefilled because their KV was reused (session prefix cache, or a migrated session). ``expert_ids``
    (only from an engine built with ``record_experts``, else None): [N, L_moe, K] int16, the experts each MoE
    layer selected for each completion token when it was fed back to the model, -1 rows where not known (the
    last token, tokens generated before a migration or a retry); routing replay, docs/learner.md.
    ``prompt_expert_ids``: the same for the prompt tokens, [prompt_len, L_moe, K] (-1 rows: not prefilled here,
    e.g. KV reused from the session prefix cache), or None.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str
    prompt_len: int
    cell: str = ""
    cached_tokens: int = 0
    stop_reason: int | str | None = None
    expert_ids: Any = None  # np.ndarray [N, L_moe, K] int16 or None
    prompt_expert_ids: Any = None  # np.ndarray [prompt_len, L_moe, K] int16 or None


class ContextTooLongError(ValueError):
    """The prompt (plus at least one generated token) does not fit the serving context."""


class PagePoolExhausted(ContextTooLongError):
    """A paged engine's slot needs a KV page and none is free: the cell's KV budget is spent."""


class GenerationBackend(Protocol):
    """Anything that completes prompts: a cell's serving loop, or the router over several cells."""

    max_context: int

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        """Queues ``request``. The future raises ``ContextTooLongError`` if the prompt cannot fit."""
        ...

    def cancel(self, request_id: str) -> None:
        """Stops a queued or running request; its future resolves with finish_reason "cancelled"."""
        ...
