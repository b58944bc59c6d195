"""``SessionState``: a session leaving one serving loop for another, with its KV cache.

``ServingLoop.export_sessions`` / ``drain`` produce them, ``ServingLoop.import_session`` consumes them (a cell
leaving serving: ``runtime.CellHandle.move_sessions_to``). Within a process a state moves whole: its KV
travels device to device (``jax.device_put`` onto the importing engine's mesh) and the request's
``Future`` goes with it, resolved by the importing loop, so whoever waits on the original ``submit`` (the
proxy) gets the result without knowing the request moved. Across processes (``runtime/sessions.py``) the
host fields travel as a command, the KV by one ``runtime.transfer`` program, and the importing process
answers the caller's future.

The migration rule: an in-flight request continues on the new loop exactly where it stopped (same
tokens, same sampling key, nothing re-sampled), so a greedy or seeded continuation is identical to the
unmigrated one; tokens sampled after the move carry the new loop's policy version. A request still
waiting for a slot moves without KV (its session's cached entry moves separately). An idle session
(no request in flight) moves as a cached entry. A request exported while partly prefilled moves with
the KV computed so far and the rest of its prompt is prefilled on the new loop.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

import numpy as np

from gyre_jax.serving.jobs import Job
from gyre_jax.serving.kv_cache import KVPages
from gyre_jax.serving.stopping import StopStrings
from gyre_jax.serving.types import GenerationRequest, GenerationResult


@dataclasses.dataclass
class SessionState:
    """One session (or one session-less request) in transit between serving loops.

    kv:          KV of ``kv_tokens``, per layer [n, page_size, K, D] (None: nothing computed yet)
    kv_tokens:   ids whose KV ``kv`` holds (positions 0 .. len-1)
    kv_version:  policy version that computed ``kv`` (the oldest, if it spans a weight update)
    request:     the request in flight (None: an idle session whose KV was cached)
    future:      that request's future, resolved by the importing loop
    token_ids, logprobs, policy_versions: what the request generated so far; when non-empty the last
                 token has been sampled but is not in ``kv`` yet (``kv_tokens`` = prompt + token_ids[:-1])
    key:         [2] uint32 sampling key to continue with (None: the importing loop derives one)
    cached_tokens: prompt tokens the request did not prefill (reported in its result)
    source:      name of the exporting loop
    """

    session_id: str | None
    kv: KVPages | None
    kv_tokens: list[int]
    kv_version: int
    request: GenerationRequest | None = None
    future: concurrent.futures.Future | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    policy_versions: list[int] = dataclasses.field(default_factory=list)
    key: np.ndarray | None = None
    cached_tokens: int = 0
    source: str = ""
    moved_to: Any = dataclasses.field(default=None, repr=False)  # the importing loop (cancels are forwarded)

    @property
    def in_flight(self) -> bool:
        return self.request is not None

    @classmethod
    def of_job(
        cls, job: Job, kv: KVPages | None, kv_tokens: list[int], kv_version: int, key, source: str
    ) -> SessionState:
        """The state of a request leaving loop ``source`` (its session's, if it has one)."""
        return cls(
            session_id=job.request.session_id,
            kv=kv,
            kv_tokens=kv_tokens,
            kv_version=kv_version,
            request=job.request,
            future=job.future,
            token_ids=job.tokens,
            logprobs=job.logprobs,
            policy_versions=job.versions,
            key=key,
            cached_tokens=job.cached_tokens,
            source=source,
        )

    def target(self, has_kv: bool) -> list[int]:
        """The ids whose KV the request needs before it decodes: its prompt (+ generated[:-1] when it already
        sampled); raises ValueError if ``kv_tokens`` are not a prefix of them (or have no KV, ``has_kv``)."""
        prompt = list(self.request.prompt_ids)
        target = prompt + self.token_ids[:-1] if self.token_ids else prompt
        if self.kv_tokens != target[: len(self.kv_tokens)] or (not has_kv and self.kv_tokens):
            raise ValueError(
                f"session {self.session_id!r}: kv_tokens are not a prefix of the request's prompt + "
                "generated tokens; export states with ServingLoop.export_sessions"
            )
        return target

    def to_job(self, target: list[int], seq: int, key, kv: KVPages | None, stop: StopStrings | None) -> Job:
        """The request as a job of the importing loop (``kv``: its KV on that loop's mesh, or None), continuing
        where it stopped."""
        return Job(
            request=self.request,
            future=self.future,
            target=target,
            seq=seq,
            key=key,
            done=len(self.kv_tokens) if kv is not None else 0,
            kv=kv,
            kv_version=self.kv_version if kv is not None else None,
            tokens=list(self.token_ids),
            logprobs=list(self.logprobs),
            versions=list(self.policy_versions),
            cached_tokens=self.cached_tokens,
            stop=stop,
        )

    def cancel(self) -> None:
        """Resolves the request (if any) as "cancelled" with what it generated so far: for a state that will
        not be imported anywhere (e.g. no serving cell is left). Its caller sees a cancelled generation."""
        if self.future is not None and not self.future.done():
            self.future.set_result(
                GenerationResult(
                    request_id=self.request.request_id,
                    token_ids=self.token_ids,
                    logprobs=self.logprobs,
                    policy_versions=self.policy_versions,
                    finish_reason="cancelled",
                    prompt_len=len(self.request.prompt_ids),
                    cell=self.source,
                    cached_tokens=self.cached_tokens,
                )
            )

    def describe(self) -> dict:
        """A JSON-able summary for logs: ids and lengths, no arrays."""
        return {
            "session_id": self.session_id,
            "request_id": None if self.request is None else self.request.request_id,
            "kv_tokens": len(self.kv_tokens),
            "kv_pages": None if self.kv is None else self.kv.num_pages,
            "kv_version": self.kv_version,
            "generated": len(self.token_ids),
            "source": self.source,
        }
