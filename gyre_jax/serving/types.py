"""Records that cross the serving boundary: what the proxy asks a serving cell for, and what comes back.

The proxy (and anything else that wants tokens) talks to serving through the ``GenerationBackend``
protocol: ``submit`` returns a ``concurrent.futures.Future`` resolved by the cell's serving loop.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from dataclasses import dataclass, field
from typing import Protocol

_request_ids = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_request_ids)}"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` means greedy; ``top_k == 0`` and ``top_p == 1`` disable them.

    Log-probs are always those of the temperature-scaled distribution (``softmax(logits / T)``; ``T = 1``
    for greedy), before top-k/top-p truncation: that is the distribution the trainer re-computes.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop_ids: tuple[int, ...] = ()
    seed: int | None = None

    def validate(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")


@dataclass
class GenerationRequest:
    """A prompt (exact token ids) to complete. ``session_id`` lets the router keep a session on one cell."""

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session_id: str | None = None
    request_id: str = field(default_factory=new_request_id)


@dataclass
class GenerationResult:
    """Completion of one request.

    token_ids / logprobs / policy_versions: [N] each; logprobs are behaviour log-probs of each sampled
    token, policy_versions the weight version that produced each token (they can differ within one
    completion if weights were updated while it was in flight). ``finish_reason`` is ``"stop"`` (a stop
    id was sampled; it is included in ``token_ids``), ``"length"`` (max_tokens or context limit),
    or ``"cancelled"``.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str
    prompt_len: int
    cell: str = ""


class ContextTooLongError(ValueError):
    """The prompt (plus at least one generated token) does not fit the serving context."""


class GenerationBackend(Protocol):
    """Anything that completes prompts: a cell's serving loop, or the router over several cells."""

    max_context: int

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        """Queues ``request``. The future raises ``ContextTooLongError`` if the prompt cannot fit."""
        ...

    def cancel(self, request_id: str) -> None:
        """Stops a queued or running request; its future resolves with finish_reason "cancelled"."""
        ...
