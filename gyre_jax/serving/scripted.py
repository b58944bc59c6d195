"""A scripted generation backend: completions chosen by a script instead of sampled from a model.

``ScriptedBackend`` implements the ``GenerationBackend`` contract (``submit`` -> ``Future[GenerationResult]``,
``cancel``, ``max_context``) and answers every request with the text its ``script`` returns for the request's
decoded prompt, tokenized with the stack's tokenizer and ended by the end-of-turn id (``finish_reason``
``"stop"``), with deterministic log-probs. A real harness driven through the real proxy against it does exactly
what the script makes it do (call a tool, start a sub-agent, answer, end): that is how the corpus of real harness
traffic under ``tests/fixtures/harness_traffic/`` is recorded (``tests/integration/record_traffic.py``) and how it
is replayed (``tests/proxy/test_harness_traffic.py``).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from gyre_jax.serving.types import ContextTooLongError, GenerationRequest, GenerationResult

SCRIPTED_LOGPROB = -0.5  # behaviour log-prob of every scripted token (any finite value <= 0 would do)


class ScriptTokenizer(Protocol):
    """What the backend needs of a tokenizer (every project tokenizer has it)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_id(self, token: str) -> int: ...


Script = Callable[[str], str]  # decoded prompt text -> completion text (without the end-of-turn token)


class ScriptedBackend:
    """Completes each prompt with ``script(decoded prompt)`` + the end-of-turn token.

    ``end_token`` is the chat template's end of turn (``<|im_end|>``); ``max_context`` bounds prompt +
    completion as a serving cell's context would (a prompt that leaves no room fails with
    ``ContextTooLongError``); ``name`` is the ``cell`` of every result. A script that raises fails that
    request's future with its exception. ``calls`` counts the requests answered. Thread-safe.
    """

    def __init__(
        self,
        tokenizer: ScriptTokenizer,
        script: Script,
        max_context: int = 1 << 20,
        end_token: str = "<|im_end|>",
        name: str = "scripted",
        policy_version: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.max_context = max_context
        self.end_id = tokenizer.token_id(end_token)
        self.name = name
        self.policy_version = policy_version
        self.calls = 0
        self._lock = threading.Lock()

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        future: concurrent.futures.Future[GenerationResult] = concurrent.futures.Future()
        try:
            future.set_result(self._complete(request))
        except Exception as exc:  # the script's or the context's failure is this request's
            future.set_exception(exc)
        return future

    def _complete(self, request: GenerationRequest) -> GenerationResult:
        prompt_len = len(request.prompt_ids)
        if prompt_len + 1 > self.max_context:
            raise ContextTooLongError(f"prompt of {prompt_len} tokens + 1 does not fit max_context {self.max_context}")
        text = self.script(self.tokenizer.decode(request.prompt_ids))
        ids = self.tokenizer.encode(text)
        room = min(request.sampling.max_tokens, self.max_context - prompt_len)
        finish, stop = ("stop", self.end_id) if len(ids) < room else ("length", None)
        ids = ids + [self.end_id] if finish == "stop" else ids[:room]
        with self._lock:
            self.calls += 1
        return GenerationResult(
            request_id=request.request_id,
            token_ids=ids,
            logprobs=[SCRIPTED_LOGPROB] * len(ids),
            policy_versions=[self.policy_version] * len(ids),
            finish_reason=finish,
            prompt_len=prompt_len,
            cell=self.name,
            stop_reason=stop,
        )

    def cancel(self, request_id: str) -> None:
        """Nothing to stop: every request is answered when it is submitted."""
