"""OpenAI- and Anthropic-compatible HTTP proxy between black-box harnesses and the serving backend.

Owns execution identity (one API key per execution, sent as ``Authorization: Bearer`` or
``x-api-key``), thread identity (a header where the harness sends one, else the structure of the
conversation), per-thread conversation state for token-in/token-out prompt building, and the durable
TITO record of every served call: a call's record is fsynced before its response is sent, and a
record is only ever appended to the file of the execution its API key was issued to.

Endpoints: ``GET /v1/models``; ``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI);
``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic; ``?beta=true`` accepted);
``GET /health``. All calls may stream (SSE). Errors are OpenAI error bodies on the OpenAI routes and
Anthropic error bodies on the Anthropic routes, always a 4xx for bad input; nothing a client sends
takes the server down. See docs/proxy.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy import anthropic_api, openai_api, tito
from gyre_jax.proxy.chat_template import ParsedCompletion, parse_completion
from gyre_jax.proxy.errors import Api, ProxyError, internal_error, validation_error
from gyre_jax.proxy.records import RecordStore, TitoRecord
from gyre_jax.serving.types import (
    ContextTooLongError,
    GenerationBackend,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 4096  # completion budget when a request names none (always clipped to the context)
THREAD_HEADERS = ("x-gyre-thread-id", "x-claude-code-session-id")  # first present one names the thread
DEFAULT_THREAD = "main"
MAX_THREADS_PER_EXECUTION = 256  # thread states kept per execution (least recently used forgotten first)
_DISCONNECT_POLL_S = 0.1  # how often a waiting call checks whether its client went away
_KEEPALIVE_S = 15.0  # SSE keep-alive (OpenAI: comment; Anthropic: ping) interval while a streamed call waits
_DRAIN_LIMIT_BYTES = 64 * 1024 * 1024  # an oversized body is read (and dropped) up to this, so the client sees the 413

# Kept importable from here (older code and tests import them from the server module).
_internal_error = internal_error
ChatCompletionRequest = openai_api.ChatCompletionRequest


# ----------------------------------------------------------------------------------------------------------------------
# Per-execution state


@dataclass
class _Execution:
    execution_id: str
    api_key: str
    next_record_index: int  # call_index of the next record; equals the number of recorded calls
    ended: bool = False
    started_calls: int = 0  # calls that reached the backend, for derived seeds
    # Last call of each thread, least recently used first; bounded by MAX_THREADS_PER_EXECUTION contexts.
    threads: OrderedDict[str, tito.ThreadState] = field(default_factory=OrderedDict)
    # (header thread, structure key) -> thread id, for threads told apart by structure; bounded the same way.
    thread_names: OrderedDict[tuple[str, str], str] = field(default_factory=OrderedDict)
    in_flight: set[str] = field(default_factory=set)  # backend request ids
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Call:
    """One validated call on its way through the backend."""

    api: str  # "chat" | "completions" | "messages"
    execution: _Execution
    thread_id: str
    messages: list[dict] | None  # internal (OpenAI-form) messages; None for a raw-prompt completion
    tools: list[dict] | None
    parse_tools: bool
    logprobs: bool
    include_usage: bool
    build: tito.PromptBuild
    generation: GenerationRequest
    t_start: float
    completion_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class _Completion:
    result: GenerationResult
    text_ids: list[int]  # completion ids without the trailing stop id
    text: str  # decode(text_ids)
    parsed: ParsedCompletion | None  # None for a raw-prompt completion
    finish_reason: str  # OpenAI finish reason: stop | length | tool_calls


def derive_seed(server_seed: int, execution_id: str, call_index: int) -> int:
    """Deterministic per-call sampling seed (31 bits) for requests that do not name one."""
    digest = hashlib.sha256(f"{server_seed}/{execution_id}/{call_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _thread_base(request: Request) -> str:
    for header in THREAD_HEADERS:
        value = request.headers.get(header, "").strip()
        if value:
            return value
    return DEFAULT_THREAD


def structure_key(messages: list[dict]) -> str:
    """What tells threads apart when no header does: the first system prompt and the first user message.

    A sub-agent, a summarizer or a side query starts from a different system prompt or first request
    than the main conversation, and keeps them for its whole life.
    """
    system = next((m for m in messages[:1] if m.get("role") == "system"), None)
    user = next((m for m in messages if m.get("role") == "user"), None)
    parts = [tito.normalize_message(m)["content"] if m is not None else None for m in (system, user)]
    return hashlib.sha256(json.dumps(parts).encode("utf-8")).hexdigest()[:12]


def _parse(text: str, parse_tools: bool) -> ParsedCompletion:
    parsed = parse_completion(text)
    if parse_tools or not parsed.tool_calls:
        return parsed
    # tool_choice none: the model's tool-call text is returned as plain content.
    body = text.split("</think>", 1)[1].lstrip("\n") if "</think>" in text else text
    return ParsedCompletion(content=body, reasoning=parsed.reasoning)


def _token_bytes(tokenizer: tito.Tokenizer, token_id: int) -> bytes:
    if isinstance(tokenizer, ByteTokenizer) and token_id < 256:
        return bytes([token_id])
    token_bytes = getattr(tokenizer, "token_bytes", None)
    if callable(token_bytes):
        return token_bytes(token_id)
    return tokenizer.decode([token_id]).encode("utf-8")


# ----------------------------------------------------------------------------------------------------------------------
# The server


class ProxyServer:
    """The proxy over a ``GenerationBackend``; run it with ``start()``/``stop()`` or ``with``.

    ``tokenizer`` is anything with ``encode``, ``decode``, ``token_id`` and ``eos_ids`` (the byte
    tokenizer, or a ``tokenizer.json`` wrapper). ``max_tokens_cap`` bounds every call's completion
    whatever the client asks (None: only the context bounds it); ``default_max_tokens`` is the budget
    of a request that names none. ``max_threads_per_execution`` bounds the per-thread state an
    execution keeps (one context each), so memory stays bounded however long it runs.
    """

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: tito.Tokenizer,
        record_store: RecordStore,
        model_name: str = "gyre-tiny",
        host: str = "127.0.0.1",
        port: int = 0,
        max_request_bytes: int = 4 * 1024 * 1024,
        seed: int = 0,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        tools_format: str = "qwen3",
        max_tokens_cap: int | None = None,
        max_threads_per_execution: int = MAX_THREADS_PER_EXECUTION,
    ) -> None:
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes={max_request_bytes} must be >= 1")
        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens={default_max_tokens} must be >= 1")
        if max_tokens_cap is not None and max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap={max_tokens_cap} must be >= 1 (or None for no cap)")
        if max_threads_per_execution < 1:
            raise ValueError(f"max_threads_per_execution={max_threads_per_execution} must be >= 1")
        self.backend = backend
        self.tokenizer = tokenizer
        self.record_store = record_store
        self.model_name = model_name
        self.host = host
        self.max_request_bytes = max_request_bytes
        self.seed = seed
        self.default_max_tokens = default_max_tokens
        self.tools_format = tools_format
        self.max_tokens_cap = max_tokens_cap
        self.max_threads_per_execution = max_threads_per_execution
        self._requested_port = port
        self._lock = threading.Lock()  # guards the two maps below
        self._executions: dict[str, _Execution] = {}
        self._by_key: dict[str, _Execution] = {}
        self._server: uvicorn.Server | None = None
        self._socket: socket.socket | None = None
        self._port: int | None = None  # the bound port, known after start()
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self.app = self._build_app()

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> ProxyServer:
        """Serves in a daemon thread; returns once the server accepts connections."""
        if self._thread is not None:
            raise RuntimeError("ProxyServer.start() called twice; create a new ProxyServer to serve again")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self._requested_port))
        except OSError as exc:
            sock.close()
            raise RuntimeError(
                f"proxy cannot bind {self.host}:{self._requested_port}: {exc}; pick another port (0 = any free)"
            ) from exc
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5
        )
        self._server = uvicorn.Server(config)
        self._socket = sock
        self._port = int(sock.getsockname()[1])
        self._thread = threading.Thread(target=self._serve, name=f"gyre-proxy-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"proxy server on {self.base_url} exited during startup: {self._thread_error!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"proxy server on {self.base_url} did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def _serve(self) -> None:
        assert self._server is not None and self._socket is not None
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as exc:  # reported by start() / stop(); a daemon thread has no one else to tell
            self._thread_error = exc
            logger.exception("proxy server thread crashed")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stops accepting calls, lets in-flight ones finish (cancelling them after 5 s), joins the thread."""
        if self._thread is None or self._server is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._socket is not None:
            self._socket.close()
        if self._thread.is_alive():
            raise RuntimeError(f"proxy server on {self.base_url} did not stop within {timeout_s} s")

    def __enter__(self) -> ProxyServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the proxy has no port before start()")
        return self._port

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    @property
    def anthropic_base_url(self) -> str:
        """What ``ANTHROPIC_BASE_URL`` should be: the Anthropic SDK appends ``/v1/messages`` itself."""
        return self.base_url.removesuffix("/v1")

    # -- execution identity ----------------------------------------------------------------------------------------

    def open_execution(self, execution_id: str) -> str:
        """Issues a fresh API key for ``execution_id``; its calls are recorded in that execution's file only."""
        self.record_store.path(execution_id)  # validates the id
        with self._lock:
            if execution_id in self._executions:
                raise ValueError(
                    f"execution {execution_id!r} was already opened on this proxy; give each execution a new id"
                )
        # An execution resumed after a proxy restart continues its call numbering.
        recorded = self.record_store.count(execution_id)
        key = "gyre-" + secrets.token_hex(24)
        execution = _Execution(execution_id=execution_id, api_key=key, next_record_index=recorded)
        with self._lock:
            if execution_id in self._executions:
                raise ValueError(
                    f"execution {execution_id!r} was already opened on this proxy; give each execution a new id"
                )
            self._executions[execution_id] = execution
            self._by_key[key] = execution
        return key

    def close_execution(self, execution_id: str) -> None:
        """Ends the execution: its key gets 409 from now on, in-flight calls are cancelled and not recorded."""
        execution = self._execution(execution_id)
        with execution.lock:
            execution.ended = True
            in_flight = list(execution.in_flight)
            execution.threads.clear()
            execution.thread_names.clear()
        for request_id in in_flight:
            self.backend.cancel(request_id)

    def execution_calls(self, execution_id: str) -> int:
        """Number of calls recorded for the execution."""
        return self._execution(execution_id).next_record_index

    def execution_threads(self, execution_id: str) -> list[str]:
        """Thread ids the execution's live state knows (least recently used first)."""
        execution = self._execution(execution_id)
        with execution.lock:
            return list(execution.threads)

    def _execution(self, execution_id: str) -> _Execution:
        with self._lock:
            execution = self._executions.get(execution_id)
        if execution is None:
            raise KeyError(f"execution {execution_id!r} was never opened on this proxy; call open_execution() first")
        return execution

    def _authenticate(self, request: Request) -> _Execution:
        key = request.headers.get("x-api-key", "").strip()
        if not key:
            scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
            key = bearer.strip() if scheme.lower() == "bearer" else ""
        if not key:
            raise ProxyError(
                401,
                "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>' with the key issued for "
                "this execution",
                code="invalid_api_key",
            )
        with self._lock:
            execution = self._by_key.get(key)
        if execution is None:
            raise ProxyError(
                401,
                "unknown API key: this proxy never issued it; use the key given to this execution",
                code="invalid_api_key",
            )
        if execution.ended:
            raise ProxyError(
                409,
                f"execution {execution.execution_id!r} has ended; no further calls are accepted for it",
                code="execution_ended",
            )
        return execution

    def _thread_for(self, execution: _Execution, base: str, messages: list[dict] | None) -> str:
        """The thread id: the header's (or "main") for the first conversation structure seen under it,
        ``<header>~<structure key>`` for each other one (a sub-agent sharing its parent's header)."""
        if messages is None:
            return base
        key = structure_key(messages)
        with execution.lock:
            names = execution.thread_names
            name = names.get((base, key))
            if name is None:
                name = base if not any(b == base for b, _ in names) else f"{base}~{key}"
            names[(base, key)] = name
            names.move_to_end((base, key))
            while len(names) > self.max_threads_per_execution:
                names.popitem(last=False)
        return name

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ProxyError(
                404,
                f"model {model!r} does not exist; this proxy serves {self.model_name!r} (see GET /v1/models)",
                code="model_not_found",
                param="model",
            )

    # -- app -------------------------------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="gyre-jax proxy", docs_url=None, redoc_url=None, openapi_url=None)

        def api_of(request: Request) -> Api:
            return "anthropic" if request.url.path.startswith("/v1/messages") else "openai"

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            message = f"{request.method} {request.url.path}: {exc.detail}"
            if exc.status_code == 404:
                message += (
                    "; this proxy serves GET /v1/models, POST /v1/chat/completions, POST /v1/completions, "
                    "POST /v1/messages and POST /v1/messages/count_tokens"
                )
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            return ProxyError(exc.status_code, message, code=code).response(api_of(request))

        @app.exception_handler(RequestValidationError)
        async def validation_failed(request: Request, exc: RequestValidationError) -> JSONResponse:
            return ProxyError(400, f"invalid request: {exc.errors()}").response(api_of(request))

        @app.exception_handler(Exception)
        async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
            logger.error("unexpected error serving %s %s", request.method, request.url.path, exc_info=exc)
            return internal_error().response(api_of(request))

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            try:
                self._authenticate(request)
            except ProxyError as err:
                return err.response()
            # One card readable by both SDKs (OpenAI: id/object/owned_by; Anthropic: type/display_name/created_at).
            card = {"id": self.model_name, "object": "model", "type": "model", "display_name": self.model_name,
                    "created": 0, "created_at": "1970-01-01T00:00:00Z", "owned_by": "gyre-jax"}  # fmt: skip
            return JSONResponse({"object": "list", "data": [card], "has_more": False,
                                 "first_id": self.model_name, "last_id": self.model_name})  # fmt: skip

        def route(handler, api: Api):
            async def endpoint(request: Request) -> Response:
                try:
                    return await handler(request)
                except ProxyError as err:
                    return err.response(api)
                except Exception:
                    logger.exception("unexpected error serving %s", request.url.path)
                    return internal_error().response(api)

            return endpoint

        app.post("/v1/chat/completions")(route(self._chat_completions, "openai"))
        app.post("/v1/completions")(route(self._completions, "openai"))
        app.post("/v1/messages")(route(self._messages, "anthropic"))
        app.post("/v1/messages/count_tokens")(route(self._count_tokens, "anthropic"))
        return app

    # -- reading requests ------------------------------------------------------------------------------------------

    async def _read_json(self, request: Request) -> dict[str, Any]:
        body = await self._read_body(request)
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProxyError(400, f"request body is not valid JSON ({exc}); send a JSON object") from None
        if not isinstance(data, dict):
            raise ProxyError(400, f"request body must be a JSON object, got {type(data).__name__}")
        return data

    async def _read_body(self, request: Request) -> bytes:
        """The body, or 413 if it is over ``max_request_bytes`` (by Content-Length or by its actual size).

        An oversized body is still read (and dropped, up to a cap) so the client gets the 413 instead of
        a connection reset while it is still sending.
        """
        limit = self.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and not declared.strip().isdigit():
            raise ProxyError(400, f"Content-Length header {declared!r} is not a non-negative integer")
        body = bytearray()
        seen = 0
        try:
            async with contextlib.aclosing(request.stream()) as chunks:
                async for chunk in chunks:
                    seen += len(chunk)
                    if seen > _DRAIN_LIMIT_BYTES:
                        break
                    if seen <= limit:
                        body += chunk
        except ClientDisconnect:
            raise ProxyError(400, "the client disconnected while sending the request body") from None
        if seen > limit or (declared is not None and int(declared) > limit):
            raise ProxyError(
                413,
                f"request body of {max(seen, int(declared or 0))} bytes is larger than this proxy's limit of "
                f"{limit} bytes; shorten the conversation",
                code="request_too_large",
            )
        return bytes(body)

    # -- OpenAI: chat completions ----------------------------------------------------------------------------------

    async def _chat_completions(self, request: Request) -> Response:
        t_start = time.time()
        execution = self._authenticate(request)
        body = await self._read_json(request)
        try:
            req = openai_api.ChatCompletionRequest.model_validate(body)
        except pydantic.ValidationError as exc:
            raise validation_error(exc, "chat completion request", "the OpenAI chat completions API") from None
        self._check_model(req.model)
        openai_api.check_chat_supported(req)
        kwargs = req.chat_template_kwargs
        call = self._prepare_chat(
            "chat", execution, _thread_base(request), body["messages"], body.get("tools") or None,
            enable_thinking=kwargs.enable_thinking if kwargs is not None else None,
            parse_tools=req.tool_choice != "none", logprobs=bool(req.logprobs),
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            temperature=req.temperature, top_p=req.top_p, top_k=None,
            max_tokens=req.max_completion_tokens or req.max_tokens, seed=req.seed, t_start=t_start,
        )  # fmt: skip
        call.completion_id = "chatcmpl-" + uuid.uuid4().hex
        if req.stream:
            return self._sse_response(self._chat_stream(call, request))
        completion = await self._run(call, request)
        if completion is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        return JSONResponse(self._chat_body(call, completion))

    def _chat_logprobs(self, call: _Call, completion: _Completion) -> dict[str, Any] | None:
        if not call.logprobs:
            return None
        entries = []
        for token_id, logprob in zip(completion.text_ids, completion.result.logprobs):
            raw = _token_bytes(self.tokenizer, token_id)
            text = self.tokenizer.decode([token_id])
            entries.append({"token": text, "logprob": float(logprob), "bytes": list(raw), "top_logprobs": []})
        return {"content": entries}

    def _usage(self, call: _Call, completion: _Completion) -> dict[str, int]:
        return openai_api.usage(len(call.build.prompt_ids), len(completion.result.token_ids))

    def _chat_body(self, call: _Call, completion: _Completion) -> dict[str, Any]:
        assert completion.parsed is not None
        return {
            "id": call.completion_id,
            "object": "chat.completion",
            "created": call.created,
            "model": self.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": openai_api.returned_message(completion.parsed),
                    "logprobs": self._chat_logprobs(call, completion),
                    "finish_reason": completion.finish_reason,
                }
            ],
            "usage": self._usage(call, completion),
        }

    async def _chat_stream(self, call: _Call, request: Request) -> AsyncIterator[str]:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        yield openai_api.chat_chunk(call.completion_id, call.created, self.model_name, [role])
        async for item in self._stream_result(call, request, ": keep-alive\n\n", "openai"):
            if isinstance(item, str):
                yield item
                continue
            assert item.parsed is not None
            for chunk in openai_api.chat_stream_chunks(
                call.completion_id, call.created, self.model_name, openai_api.returned_message(item.parsed),
                self._chat_logprobs(call, item), item.finish_reason,
                self._usage(call, item) if call.include_usage else None,
            ):  # fmt: skip
                yield chunk
            yield openai_api.sse("[DONE]")

    # -- OpenAI: legacy completions --------------------------------------------------------------------------------

    async def _completions(self, request: Request) -> Response:
        t_start = time.time()
        execution = self._authenticate(request)
        body = await self._read_json(request)
        try:
            req = openai_api.CompletionRequest.model_validate(body)
        except pydantic.ValidationError as exc:
            raise validation_error(exc, "completion request", "the OpenAI completions API") from None
        self._check_model(req.model)
        openai_api.check_completion_supported(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            vocab = int(getattr(self.tokenizer, "vocab_size", 0) or 0)
            bad = [t for t in prompt if t < 0 or (vocab and t >= vocab)]
            if bad:
                raise ProxyError(
                    400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt"
                )
            prompt_ids = list(prompt)
        else:
            text = prompt[0] if isinstance(prompt, list) else prompt
            prompt_ids = self.tokenizer.encode(text)
        if not prompt_ids:
            raise ProxyError(400, "the prompt is empty; send at least one token", param="prompt")
        call = self._new_call(
            "completions", execution, self._thread_for(execution, _thread_base(request), None), None, None,
            tito.PromptBuild(prompt_ids=prompt_ids, reused_prefix_len=0, continued=False),
            parse_tools=False, logprobs=req.logprobs is not None,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            temperature=req.temperature, top_p=req.top_p, top_k=None, max_tokens=req.max_tokens, seed=req.seed,
            t_start=t_start,
        )  # fmt: skip
        call.completion_id = "cmpl-" + uuid.uuid4().hex
        if req.stream:
            return self._sse_response(self._completion_stream(call, request))
        completion = await self._run(call, request)
        if completion is None:
            return Response(status_code=499)
        choice = openai_api.completion_choice(
            completion.text, self._completion_logprobs(call, completion), completion.finish_reason
        )
        return JSONResponse(
            openai_api.text_completion_body(
                call.completion_id, call.created, self.model_name, choice, self._usage(call, completion)
            )
        )

    def _completion_logprobs(self, call: _Call, completion: _Completion) -> dict[str, Any] | None:
        if not call.logprobs:
            return None
        tokens, offsets, offset = [], [], 0
        for token_id in completion.text_ids:
            piece = self.tokenizer.decode([token_id])
            tokens.append(piece)
            offsets.append(offset)
            offset += len(piece)
        n = len(completion.text_ids)
        return {"tokens": tokens, "token_logprobs": [float(x) for x in completion.result.logprobs[:n]],
                "top_logprobs": None, "text_offset": offsets}  # fmt: skip

    async def _completion_stream(self, call: _Call, request: Request) -> AsyncIterator[str]:
        async for item in self._stream_result(call, request, ": keep-alive\n\n", "openai"):
            if isinstance(item, str):
                yield item
                continue
            choice = openai_api.completion_choice(item.text, self._completion_logprobs(call, item), item.finish_reason)
            yield openai_api.sse(
                openai_api.text_completion_body(call.completion_id, call.created, self.model_name, choice, None)
            )
            if call.include_usage:
                yield openai_api.sse({"id": call.completion_id, "object": "text_completion", "created": call.created,
                                      "model": self.model_name, "choices": [], "usage": self._usage(call, item)})  # fmt: skip
            yield openai_api.sse("[DONE]")

    # -- Anthropic: messages ---------------------------------------------------------------------------------------

    def _anthropic_request(
        self, body: dict[str, Any], schema: type[pydantic.BaseModel]
    ) -> tuple[Any, anthropic_api.Converted]:
        try:
            req = schema.model_validate(body)
        except pydantic.ValidationError as exc:
            raise validation_error(exc, "messages request", "the Anthropic Messages API") from None
        self._check_model(req.model)
        try:
            if isinstance(req, anthropic_api.MessagesRequest):
                anthropic_api.check_supported(req)
            converted = anthropic_api.to_internal(req)
        except ValueError as exc:
            raise ProxyError(400, f"invalid messages request: {exc}") from None
        return req, converted

    async def _messages(self, request: Request) -> Response:
        t_start = time.time()
        execution = self._authenticate(request)
        body = await self._read_json(request)
        req, converted = self._anthropic_request(body, anthropic_api.MessagesRequest)
        call = self._prepare_chat(
            "messages", execution, _thread_base(request), converted.messages, converted.tools,
            enable_thinking=converted.enable_thinking, parse_tools=converted.parse_tools, logprobs=False,
            include_usage=True, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            max_tokens=req.max_tokens, seed=None, t_start=t_start,
        )  # fmt: skip
        call.completion_id = "msg_" + uuid.uuid4().hex[:24]
        if req.stream:
            return self._sse_response(self._messages_stream(call, request))
        completion = await self._run(call, request)
        if completion is None:
            return Response(status_code=499)
        return JSONResponse(self._message_body(call, completion))

    def _message_body(self, call: _Call, completion: _Completion) -> dict[str, Any]:
        assert completion.parsed is not None
        return anthropic_api.message_body(
            call.completion_id, self.model_name, anthropic_api.content_blocks(completion.parsed),
            anthropic_api.STOP_REASONS[completion.finish_reason], len(call.build.prompt_ids),
            len(completion.result.token_ids),
        )  # fmt: skip

    async def _messages_stream(self, call: _Call, request: Request) -> AsyncIterator[str]:
        start = anthropic_api.message_body(
            call.completion_id, self.model_name, None, None, len(call.build.prompt_ids), 0
        )
        yield anthropic_api.sse("message_start", {"type": "message_start", "message": start})
        yield anthropic_api.PING
        async for item in self._stream_result(call, request, anthropic_api.PING, "anthropic"):
            if isinstance(item, str):
                yield item
                continue
            assert item.parsed is not None
            blocks = anthropic_api.content_blocks(item.parsed)
            for event in anthropic_api.stream_events(
                blocks, anthropic_api.STOP_REASONS[item.finish_reason], len(item.result.token_ids)
            ):
                yield event

    async def _count_tokens(self, request: Request) -> Response:
        self._authenticate(request)
        body = await self._read_json(request)
        _, converted = self._anthropic_request(body, anthropic_api.CountTokensRequest)
        try:
            text = tito.chat_template.render(converted.messages, converted.tools, add_generation_prompt=True,
                                             enable_thinking=converted.enable_thinking, tools_format=self.tools_format)  # fmt: skip
        except ValueError as exc:
            raise ProxyError(400, f"cannot render messages: {exc}", param="messages") from None
        return JSONResponse({"input_tokens": len(self.tokenizer.encode(text))})

    # -- the call pipeline shared by all APIs ----------------------------------------------------------------------

    def _prepare_chat(
        self, api: str, execution: _Execution, base: str, messages: list[dict], tools: list[dict] | None, *,
        enable_thinking: bool | None, **kwargs: Any,
    ) -> _Call:  # fmt: skip
        thread_id = self._thread_for(execution, base, messages)
        with execution.lock:
            state = execution.threads.get(thread_id)
        try:
            build = tito.build_prompt(self.tokenizer, messages, tools, state, enable_thinking=enable_thinking,
                                      tools_format=self.tools_format)  # fmt: skip
        except ValueError as exc:
            raise ProxyError(400, f"cannot render messages: {exc}", param="messages") from None
        return self._new_call(api, execution, thread_id, messages, tools, build, **kwargs)

    def _new_call(
        self, api: str, execution: _Execution, thread_id: str, messages: list[dict] | None, tools: list[dict] | None,
        build: tito.PromptBuild, *, parse_tools: bool, logprobs: bool, include_usage: bool, temperature: float | None,
        top_p: float | None, top_k: int | None, max_tokens: int | None, seed: int | None, t_start: float,
    ) -> _Call:  # fmt: skip
        with execution.lock:
            call_number = execution.started_calls
            execution.started_calls += 1
        max_context = int(self.backend.max_context)
        prompt_len = len(build.prompt_ids)
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
        requested = max_tokens or self.default_max_tokens
        if self.max_tokens_cap is not None:
            requested = min(requested, self.max_tokens_cap)
        sampling = SamplingParams(
            temperature=1.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            top_k=int(top_k or 0),
            max_tokens=min(requested, room),
            stop_ids=tuple(self.tokenizer.eos_ids),
            # A client seed is folded into [0, 2**31) so every backend's PRNG accepts it.
            seed=seed % 2**31 if seed is not None else derive_seed(self.seed, execution.execution_id, call_number),
        )
        sampling.validate()
        generation = GenerationRequest(
            prompt_ids=build.prompt_ids, sampling=sampling, session_id=f"{execution.execution_id}/{thread_id}"
        )
        return _Call(api=api, execution=execution, thread_id=thread_id, messages=messages, tools=tools,
                     parse_tools=parse_tools, logprobs=logprobs, include_usage=include_usage, build=build,
                     generation=generation, t_start=t_start)  # fmt: skip

    @staticmethod
    def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    async def _run(self, call: _Call, request: Request) -> _Completion | None:
        """Waits for the call's generation and commits it; None if the client went away meanwhile."""
        result = None
        async for item in self._wait(call, request):
            result = item
        if result is None:
            return None
        return await self._commit(call, result)

    async def _stream_result(
        self, call: _Call, request: Request, keepalive: str, api: Api
    ) -> AsyncIterator[str | _Completion]:
        """Yields ``keepalive`` while the call runs, then its committed completion, or one error event."""
        try:
            result = None
            async for item in self._wait(call, request):
                if item is None:
                    yield keepalive
                result = item
            if result is None:
                return
            completion = await self._commit(call, result)
        except ProxyError as err:
            yield self._stream_error(err, api)
            return
        except Exception:
            logger.exception("unexpected error in a streamed call")
            yield self._stream_error(internal_error(), api)
            return
        yield completion

    @staticmethod
    def _stream_error(err: ProxyError, api: Api) -> str:
        if api == "anthropic":
            return anthropic_api.sse("error", err.body("anthropic"))
        return openai_api.sse(err.body("openai"))

    async def _wait(self, call: _Call, request: Request) -> AsyncIterator[GenerationResult | None]:
        """Submits the call; yields None every keepalive interval while it runs, then its result.

        Ends without a result if the client disconnects (the backend request is then cancelled).
        """
        request_id = call.generation.request_id
        execution = call.execution
        with execution.lock:
            if execution.ended:
                raise ProxyError(409, f"execution {execution.execution_id!r} has ended", code="execution_ended")
            execution.in_flight.add(request_id)
        try:
            try:
                future = self.backend.submit(call.generation)
            except RuntimeError as exc:  # e.g. the router has no serving backend left
                raise ProxyError(
                    503, f"no serving backend is available: {exc}; retry later", error_type="server_error"
                ) from None
            waiting = asyncio.wrap_future(future)
            waiting.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "exception was never retrieved"
            next_keepalive = time.monotonic() + _KEEPALIVE_S
            try:
                while not waiting.done():
                    await asyncio.wait({waiting}, timeout=_DISCONNECT_POLL_S)
                    if waiting.done():
                        break
                    if await request.is_disconnected():
                        self.backend.cancel(request_id)
                        return
                    if time.monotonic() >= next_keepalive:
                        next_keepalive += _KEEPALIVE_S
                        yield None
            except asyncio.CancelledError:
                self.backend.cancel(request_id)
                raise
            yield self._checked_result(call, waiting)
        finally:
            with execution.lock:
                execution.in_flight.discard(request_id)

    def _checked_result(self, call: _Call, waiting: asyncio.Future[GenerationResult]) -> GenerationResult:
        try:
            result = waiting.result()
        except ContextTooLongError as exc:
            raise ProxyError(
                400,
                f"the prompt of {len(call.build.prompt_ids)} tokens does not fit the serving context: {exc}; "
                "shorten or summarize the conversation",
                code="context_length_exceeded",
                param="messages",
            ) from None
        if result.finish_reason == "cancelled":
            if call.execution.ended:
                raise ProxyError(409, f"execution {call.execution.execution_id!r} has ended", code="execution_ended")
            raise ProxyError(
                503,
                "the serving backend cancelled this generation and could not place it elsewhere; retry the call",
                error_type="server_error",
                code="generation_cancelled",
            )
        return result

    async def _commit(self, call: _Call, result: GenerationResult) -> _Completion:
        """Parses the completion, records it durably and remembers it as the thread's last call."""
        stop_ids = call.generation.sampling.stop_ids
        ids = list(result.token_ids)
        text_ids = ids[:-1] if result.finish_reason == "stop" and ids and ids[-1] in stop_ids else ids
        text = self.tokenizer.decode(text_ids)
        parsed = _parse(text, call.parse_tools) if call.messages is not None else None
        if parsed is not None and parsed.tool_calls:
            finish = "tool_calls"
        else:
            finish = "stop" if result.finish_reason == "stop" else "length"
        completion = _Completion(result=result, text_ids=text_ids, text=text, parsed=parsed, finish_reason=finish)
        await asyncio.to_thread(self._record, call, completion)
        return completion

    def _record(self, call: _Call, completion: _Completion) -> None:
        execution, result = call.execution, completion.result
        with execution.lock:
            if execution.ended:
                raise ProxyError(
                    409,
                    f"execution {execution.execution_id!r} ended while this call ran; it was not recorded",
                    code="execution_ended",
                )
            record = TitoRecord(
                execution_id=execution.execution_id,
                call_index=execution.next_record_index,
                thread_id=call.thread_id,
                request_id=call.generation.request_id,
                prompt_ids=list(call.build.prompt_ids),
                completion_ids=list(result.token_ids),
                completion_logprobs=[float(x) for x in result.logprobs],
                policy_versions=[int(v) for v in result.policy_versions],
                finish_reason=result.finish_reason,
                temperature=call.generation.sampling.temperature,
                reused_prefix_len=call.build.reused_prefix_len,
                t_start=call.t_start,
                t_end=time.time(),
                model=self.model_name,
                api=call.api,
                cell=result.cell,
            )
            self.record_store.append(record)
            execution.next_record_index += 1
            if call.messages is None or completion.parsed is None:
                return
            threads = execution.threads
            threads[call.thread_id] = tito.ThreadState(
                messages=[tito.normalize_message(m) for m in call.messages],
                tools_key=tito.tools_key(call.tools),
                prompt_ids=list(call.build.prompt_ids),
                completion_ids=list(result.token_ids),
                returned=tito.normalize_message(openai_api.returned_message(completion.parsed)),
                finished=result.finish_reason == "stop",
            )
            threads.move_to_end(call.thread_id)
            while len(threads) > self.max_threads_per_execution:
                threads.popitem(last=False)
