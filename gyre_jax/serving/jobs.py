"""A request's life on a serving loop, host side: ``Job`` (queued, prefilling in a slot, or decoding in a
slot; what each sampled token does to it; its result), the checks a request passes before it is queued, a
generate step in flight (``Step``) and the loop's counters (``LoopStats``). No device work here.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass, field

import jax
import numpy as np

from gyre_jax.serving.engine_api import ResultTokens, Sampled
from gyre_jax.serving.kv_cache import KVPages
from gyre_jax.serving.prefix_cache import PrefixCacheStats
from gyre_jax.serving.stopping import Detokenize, StopStrings
from gyre_jax.serving.types import ContextTooLongError, GenerationRequest, GenerationResult, TokenChunk

log = logging.getLogger(__name__)


@dataclass
class Job:
    """A request on this loop: queued, prefilling in a slot, or decoding in a slot."""

    request: GenerationRequest
    future: concurrent.futures.Future
    target: list[int]  # ids whose KV must be cached before decoding: the prompt (+ generated[:-1] when resuming)
    seq: int  # admission order (prefill is first come, first served)
    key: jax.Array | None = None  # [2] uint32: key for the next sample (None: derived at admission)
    done: int = 0  # leading ids of ``target`` whose KV is in its slot (or in ``kv``)
    kv: KVPages | None = None  # imported KV, given to its slot at admission
    kv_version: int | None = None  # oldest policy version in the KV
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    budget: int = 0  # tokens this request may still generate (set when it starts decoding)
    cached_tokens: int = 0
    decoding: bool = False
    stop: StopStrings | None = None
    first: Sampled | None = None  # what its last prefill chunk sampled (read when its slot starts)
    # routing replay (engine built with record_experts): experts[i] = [L_moe, K] int16 ids the MoE layers
    # selected for tokens[i] (None: not known, e.g. tokens generated before a migration)
    experts: list[np.ndarray | None] = field(default_factory=list)
    # ... and [len(prompt), L_moe, K] int16 for the prompt tokens this loop prefilled (-1: cached, not prefilled)
    prompt_experts: np.ndarray | None = None

    @property
    def resuming(self) -> bool:
        """The next token was sampled already (a migrated or recomputed request): insert it, sample nothing."""
        return bool(self.tokens)

    def record(self, token: int, logprob: float, version: int) -> tuple[str, int | str | None] | None:
        """Appends a token sampled by policy ``version``; returns why the request ends with it, as (finish
        reason, stop reason), or None while it goes on."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        self.budget -= 1
        self._tell(token, logprob, version)
        if token in self.request.sampling.stop_ids:
            return "stop", token
        if self.stop is not None and (matched := self.stop.check(self.tokens)) is not None:
            return "stop", matched
        if self.budget <= 0:
            return "length", None
        return None

    def note_experts(self, ids: np.ndarray) -> None:
        """Records the experts [L_moe, K] a generate step selected for this job's input token: its last token."""
        index = len(self.tokens) - 1
        self.experts.extend([None] * (index + 1 - len(self.experts)))
        self.experts[index] = ids

    def note_prompt_experts(self, start: int, ids: np.ndarray) -> None:
        """Records the experts [n, L_moe, K] prefill selected for target ids [start, start + n) (prompt ones only)."""
        prompt_len = len(self.request.prompt_ids)
        if self.prompt_experts is None:
            self.prompt_experts = np.full((prompt_len, *ids.shape[1:]), -1, np.int16)
        end = min(start + len(ids), prompt_len)
        if end > start:
            self.prompt_experts[start:end] = ids[: end - start]

    def expert_array(self) -> np.ndarray | None:
        """[len(tokens), L_moe, K] int16, -1 rows where not known (the last token, never fed back, is one);
        None if no step recorded any."""
        known = [e for e in self.experts if e is not None]
        if not known:
            return None
        out = np.full((len(self.tokens), *known[0].shape), -1, np.int16)
        for i, e in enumerate(self.experts[: len(self.tokens)]):
            if e is not None:
                out[i] = e
        return out

    def _tell(self, token: int, logprob: float, version: int) -> None:
        """Hands the new token to the request's listener, if any; a listener that raises is dropped, not fatal."""
        listener = self.request.on_tokens
        if listener is None:
            return
        chunk = TokenChunk(self.request.request_id, len(self.tokens) - 1, (token,), (logprob,), (version,))
        try:
            listener(chunk)
        except Exception:
            log.exception("token listener of request %s failed; it is told nothing more", self.request.request_id)
            self.request.on_tokens = None

    def resolve(self, reason: str, cell: str, stop_reason=None) -> None:
        """Resolves the request's future with what it generated (unless it is resolved already)."""
        if not self.future.done():
            self.future.set_result(
                GenerationResult(
                    request_id=self.request.request_id,
                    token_ids=self.tokens,
                    logprobs=self.logprobs,
                    policy_versions=self.versions,
                    finish_reason=reason,
                    prompt_len=len(self.request.prompt_ids),
                    cell=cell,
                    cached_tokens=self.cached_tokens,
                    stop_reason=stop_reason,
                    expert_ids=self.expert_array(),
                    prompt_expert_ids=self.prompt_experts,
                )
            )


@dataclass
class Step:
    """A generate step in flight: its (device) result, the jobs it stepped by slot, the policy version it ran."""

    result: ResultTokens
    jobs: dict[int, Job]
    version: int
    num_steps: int = 1  # generate steps in the program (> 1: the result's arrays have a leading [num_steps] axis)


@dataclass
class LoopStats:
    requests_done: int = 0
    tokens_generated: int = 0  # tokens sampled by generate steps (the first token of a request comes from prefill)
    prefill_tokens: int = 0  # prompt tokens actually prefilled (cached and imported KV excluded)
    prefill_calls: int = 0
    generate_steps: int = 0  # decode steps run (a multi-step program counts each of its steps)
    generate_calls: int = 0  # generate programs dispatched
    busy_s: float = 0.0
    sessions_exported: int = 0
    sessions_imported: int = 0
    cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)


def check_prompt(request: GenerationRequest, max_context: int) -> None:
    """Raises ValueError (with what to do) for a request a cell of ``max_context`` tokens cannot serve."""
    request.sampling.validate()
    n = len(request.prompt_ids)
    if n == 0:
        raise ValueError("empty prompt: at least one token is needed")
    if n + 1 > max_context:
        raise ContextTooLongError(
            f"prompt of {n} tokens does not fit this cell (context {max_context} tokens, at most "
            f"{max_context - 1} prompt tokens); shorten the conversation"
        )


def check_resume(request: GenerationRequest, generated: int, max_context: int, loop_name: str) -> None:
    """Raises ContextTooLongError if a request that generated ``generated`` tokens elsewhere cannot continue on
    loop ``loop_name`` (context ``max_context``)."""
    if len(request.prompt_ids) + max(generated, 1) > max_context:
        raise ContextTooLongError(
            f"request {request.request_id} ({len(request.prompt_ids)} prompt + {generated} "
            f"generated tokens) does not fit serving loop {loop_name} "
            f"(context {max_context} tokens)"
        )


def stop_checker(request: GenerationRequest, detokenize: Detokenize | None, loop_name: str) -> StopStrings | None:
    """The request's stop-string matcher (None without stop strings); raises ValueError if it needs a
    ``detokenize`` function the loop does not have."""
    strings = request.sampling.stop_strings
    if not strings:
        return None
    if detokenize is None:
        raise ValueError(
            f"stop_strings={strings!r} need detokenization, and serving loop {loop_name} has no "
            "detokenize function; build it with ServingLoop(..., detokenize=tokenizer.decode) or use stop_ids"
        )
    return StopStrings(strings, detokenize)
