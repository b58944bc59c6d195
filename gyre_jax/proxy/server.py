"""OpenAI-compatible HTTP proxy between black-box harnesses and the serving backend.

Owns execution identity (one API key per execution), per-thread conversation state for
token-in/token-out prompt building, and the durable TITO record of every served call: a call's
record is fsynced before its response is sent, and a record is only ever appended to the file of
the execution its API key was issued to.

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions`` (plain and ``stream: true``), ``GET /health``.
Every error is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``.
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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy import tito
from gyre_jax.proxy.chat_template import ParsedCompletion, parse_completion
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
_DISCONNECT_POLL_S = 0.1  # how often a waiting call checks whether its client went away
_KEEPALIVE_S = 15.0  # SSE comment interval while a streamed call waits for its generation
_DRAIN_LIMIT_BYTES = 64 * 1024 * 1024  # an oversized body is read (and dropped) up to this, so the client sees the 413


# ----------------------------------------------------------------------------------------------------------------------
# Errors


class ProxyError(Exception):
    """An error answered to the client as an OpenAI error body with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        error_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _internal_error() -> ProxyError:
    return ProxyError(
        500,
        "internal error in the proxy while serving this call; the call was not recorded. Retry it; if it "
        "repeats, the traceback is in the proxy's log.",
        error_type="server_error",
        code="internal_error",
    )


# ----------------------------------------------------------------------------------------------------------------------
# Request schema (validation only: the raw JSON messages and tools are what gets rendered, so key order is kept)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class FunctionTool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatCompletionRequest(_Lenient):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    n: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None


def _validation_error(exc: pydantic.ValidationError) -> ProxyError:
    errors = exc.errors(include_url=False)
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    param = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
    return ProxyError(
        400,
        "invalid chat completion request: " + "; ".join(parts) + more + ". See the OpenAI chat completions API.",
        param=param,
    )


def _check_supported(req: ChatCompletionRequest) -> None:
    """Rejects valid OpenAI features this proxy does not implement, rather than silently ignoring them."""
    if req.n not in (None, 1):
        raise ProxyError(400, f"not supported yet: n={req.n}; request one choice (n=1) per call", param="n")
    if req.stop:
        raise ProxyError(
            400,
            "not supported yet: stop sequences; omit 'stop' (generation ends at the end-of-turn token)",
            param="stop",
        )
    if req.tool_choice not in (None, "auto", "none"):
        raise ProxyError(
            400,
            f"not supported yet: tool_choice={req.tool_choice!r}; use 'auto', 'none' or omit it",
            param="tool_choice",
        )


# ----------------------------------------------------------------------------------------------------------------------
# Per-execution state


@dataclass
class _Execution:
    execution_id: str
    api_key: str
    next_record_index: int  # call_index of the next record; equals the number of recorded calls
    ended: bool = False
    started_calls: int = 0  # calls that reached the backend, for derived seeds
    threads: dict[str, tito.ThreadState] = field(default_factory=dict)  # last call of each thread
    in_flight: set[str] = field(default_factory=set)  # backend request ids
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Call:
    """One validated chat call on its way through the backend."""

    execution: _Execution
    thread_id: str
    messages: list[dict]
    tools: list[dict] | None
    parse_tools: bool
    logprobs: bool
    include_usage: bool
    build: tito.PromptBuild
    generation: GenerationRequest
    t_start: float
    completion_id: str = field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class _Completion:
    result: GenerationResult
    text_ids: list[int]  # completion ids without the trailing stop id
    parsed: ParsedCompletion
    finish_reason: str  # OpenAI finish reason


def derive_seed(server_seed: int, execution_id: str, call_index: int) -> int:
    """Deterministic per-call sampling seed (31 bits) for requests that do not name one."""
    digest = hashlib.sha256(f"{server_seed}/{execution_id}/{call_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _thread_id(request: Request) -> str:
    for header in THREAD_HEADERS:
        value = request.headers.get(header, "").strip()
        if value:
            return value
    return DEFAULT_THREAD


# ----------------------------------------------------------------------------------------------------------------------
# Response bodies


def _parse(text: str, parse_tools: bool) -> ParsedCompletion:
    parsed = parse_completion(text)
    if parse_tools or not parsed.tool_calls:
        return parsed
    # tool_choice="none": the model's tool-call text is returned as plain content.
    body = text.split("</think>", 1)[1].lstrip("\n") if "</think>" in text else text
    return ParsedCompletion(content=body, reasoning=parsed.reasoning)


def _returned_message(parsed: ParsedCompletion) -> dict[str, Any]:
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


def _logprob_entries(tokenizer: ByteTokenizer, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    entries = []
    for token_id, logprob in zip(ids, logprobs):
        text = tokenizer.decode([token_id])
        raw = bytes([token_id]) if isinstance(tokenizer, ByteTokenizer) and token_id < 256 else text.encode("utf-8")
        entries.append({"token": text, "logprob": float(logprob), "bytes": list(raw), "top_logprobs": []})
    return entries


def _usage(call: _Call, completion: _Completion) -> dict[str, int]:
    prompt, generated = len(call.build.prompt_ids), len(completion.result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


# ----------------------------------------------------------------------------------------------------------------------
# The server


class ProxyServer:
    """OpenAI-compatible proxy over a ``GenerationBackend``; run it with ``start()``/``stop()`` or ``with``."""

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: ByteTokenizer,
        record_store: RecordStore,
        model_name: str = "gyre-tiny",
        host: str = "127.0.0.1",
        port: int = 0,
        max_request_bytes: int = 4 * 1024 * 1024,
        seed: int = 0,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        tools_format: str = "qwen3",
    ) -> None:
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes={max_request_bytes} must be >= 1")
        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens={default_max_tokens} must be >= 1")
        self.backend = backend
        self.tokenizer = tokenizer
        self.record_store = record_store
        self.model_name = model_name
        self.host = host
        self.max_request_bytes = max_request_bytes
        self.seed = seed
        self.default_max_tokens = default_max_tokens
        self.tools_format = tools_format
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

    def start(self, timeout_s: float = 30.0) -> "ProxyServer":
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

    def __enter__(self) -> "ProxyServer":
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
        recorded = len(self.record_store.read(execution_id))
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
        for request_id in in_flight:
            self.backend.cancel(request_id)

    def execution_calls(self, execution_id: str) -> int:
        """Number of calls recorded for the execution."""
        return self._execution(execution_id).next_record_index

    def _execution(self, execution_id: str) -> _Execution:
        with self._lock:
            execution = self._executions.get(execution_id)
        if execution is None:
            raise KeyError(f"execution {execution_id!r} was never opened on this proxy; call open_execution() first")
        return execution

    def _authenticate(self, request: Request) -> _Execution:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise ProxyError(
                401,
                "missing API key: send 'Authorization: Bearer <key>' with the key issued for this execution",
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

    # -- app -------------------------------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="gyre-jax proxy", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            message = f"{request.method} {request.url.path}: {exc.detail}"
            if exc.status_code == 404:
                message += "; this proxy serves GET /v1/models and POST /v1/chat/completions"
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            return ProxyError(exc.status_code, message, code=code).response()

        @app.exception_handler(RequestValidationError)
        async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
            return ProxyError(400, f"invalid request: {exc.errors()}").response()

        @app.exception_handler(Exception)
        async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
            logger.error("unexpected error serving %s %s", request.method, request.url.path, exc_info=exc)
            return _internal_error().response()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            try:
                self._authenticate(request)
            except ProxyError as err:
                return err.response()
            card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "gyre-jax"}
            return JSONResponse({"object": "list", "data": [card]})

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            try:
                return await self._chat_completions(request)
            except ProxyError as err:
                return err.response()
            except Exception:
                logger.exception("unexpected error in a chat completion")
                return _internal_error().response()

        return app

    # -- chat completions ------------------------------------------------------------------------------------------

    async def _chat_completions(self, request: Request) -> Response:
        t_start = time.time()
        execution = self._authenticate(request)
        body = await self._read_json(request)
        try:
            req = ChatCompletionRequest.model_validate(body)
        except pydantic.ValidationError as exc:
            raise _validation_error(exc) from None
        if req.model != self.model_name:
            raise ProxyError(
                404,
                f"model {req.model!r} does not exist; this proxy serves {self.model_name!r} (see GET /v1/models)",
                code="model_not_found",
                param="model",
            )
        _check_supported(req)
        call = self._prepare_call(execution, _thread_id(request), body, req, t_start)
        if req.stream:
            return StreamingResponse(
                self._stream(call, request),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        result = None
        async for item in self._wait(call, request):
            result = item
        if result is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        completion = await self._commit(call, result)
        return JSONResponse(self._completion_body(call, completion))

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

    def _prepare_call(
        self, execution: _Execution, thread_id: str, body: dict[str, Any], req: ChatCompletionRequest, t_start: float
    ) -> _Call:
        messages: list[dict] = body["messages"]
        tools: list[dict] | None = body.get("tools") or None
        with execution.lock:
            state = execution.threads.get(thread_id)
        try:
            build = tito.build_prompt(self.tokenizer, messages, tools, state, tools_format=self.tools_format)
        except ValueError as exc:
            raise ProxyError(400, f"cannot render messages: {exc}", param="messages") from None
        with execution.lock:
            call_number = execution.started_calls
            execution.started_calls += 1
        sampling = self._sampling(req, len(build.prompt_ids), execution.execution_id, call_number)
        generation = GenerationRequest(
            prompt_ids=build.prompt_ids, sampling=sampling, session_id=f"{execution.execution_id}/{thread_id}"
        )
        return _Call(
            execution=execution,
            thread_id=thread_id,
            messages=messages,
            tools=tools,
            parse_tools=req.tool_choice != "none",
            logprobs=bool(req.logprobs),
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            build=build,
            generation=generation,
            t_start=t_start,
        )

    def _sampling(
        self, req: ChatCompletionRequest, prompt_len: int, execution_id: str, call_number: int
    ) -> SamplingParams:
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
        requested = req.max_completion_tokens or req.max_tokens or self.default_max_tokens
        sampling = SamplingParams(
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p),
            max_tokens=min(requested, room),
            stop_ids=tuple(self.tokenizer.eos_ids),
            # A client seed is folded into [0, 2**31) so every backend's PRNG accepts it.
            seed=req.seed % 2**31 if req.seed is not None else derive_seed(self.seed, execution_id, call_number),
        )
        sampling.validate()
        return sampling

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
                "the serving backend cancelled this generation (e.g. its cell was drained); retry the call",
                error_type="server_error",
                code="generation_cancelled",
            )
        return result

    async def _commit(self, call: _Call, result: GenerationResult) -> _Completion:
        """Parses the completion, records it durably and remembers it as the thread's last call."""
        stop_ids = call.generation.sampling.stop_ids
        ids = list(result.token_ids)
        text_ids = ids[:-1] if result.finish_reason == "stop" and ids and ids[-1] in stop_ids else ids
        parsed = _parse(self.tokenizer.decode(text_ids), call.parse_tools)
        if parsed.tool_calls:
            finish = "tool_calls"
        else:
            finish = "stop" if result.finish_reason == "stop" else "length"
        completion = _Completion(result=result, text_ids=text_ids, parsed=parsed, finish_reason=finish)
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
            )
            self.record_store.append(record)
            execution.next_record_index += 1
            execution.threads[call.thread_id] = tito.ThreadState(
                messages=[tito.normalize_message(m) for m in call.messages],
                tools_key=tito.tools_key(call.tools),
                prompt_ids=list(call.build.prompt_ids),
                completion_ids=list(result.token_ids),
                returned=tito.normalize_message(_returned_message(completion.parsed)),
                finished=result.finish_reason == "stop",
            )

    def _logprobs(self, call: _Call, completion: _Completion) -> dict[str, Any] | None:
        if not call.logprobs:
            return None
        n = len(completion.text_ids)
        return {"content": _logprob_entries(self.tokenizer, completion.text_ids, completion.result.logprobs[:n])}

    def _completion_body(self, call: _Call, completion: _Completion) -> dict[str, Any]:
        return {
            "id": call.completion_id,
            "object": "chat.completion",
            "created": call.created,
            "model": self.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": _returned_message(completion.parsed),
                    "logprobs": self._logprobs(call, completion),
                    "finish_reason": completion.finish_reason,
                }
            ],
            "usage": _usage(call, completion),
        }

    # -- streaming -------------------------------------------------------------------------------------------------

    def _chunk(self, call: _Call, choices: list[dict[str, Any]], **extra: Any) -> str:
        payload = {
            "id": call.completion_id,
            "object": "chat.completion.chunk",
            "created": call.created,
            "model": self.model_name,
            "choices": choices,
            **extra,
        }
        return _sse(payload)

    def _stream_chunks(self, call: _Call, completion: _Completion) -> list[str]:
        """The whole completion as chunks: reasoning, content (with logprobs), each tool call, the finish."""

        def choice(delta: dict[str, Any], logprobs: dict[str, Any] | None = None, finish: str | None = None) -> dict:
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

        message = _returned_message(completion.parsed)
        chunks = []
        if message.get("reasoning_content") is not None:
            chunks.append(self._chunk(call, [choice({"reasoning_content": message["reasoning_content"]})]))
        if message["content"] or call.logprobs:
            chunks.append(
                self._chunk(call, [choice({"content": message["content"] or ""}, self._logprobs(call, completion))])
            )
        for index, tool_call in enumerate(message.get("tool_calls", [])):
            delta = {"tool_calls": [{"index": index, **tool_call}]}
            chunks.append(self._chunk(call, [choice(delta)]))
        chunks.append(self._chunk(call, [choice({}, finish=completion.finish_reason)]))
        if call.include_usage:
            chunks.append(self._chunk(call, [], usage=_usage(call, completion)))
        return chunks

    async def _stream(self, call: _Call, request: Request) -> AsyncIterator[str]:
        yield self._chunk(
            call, [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )
        try:
            result = None
            async for item in self._wait(call, request):
                if item is None:
                    yield ": keep-alive\n\n"
                result = item
            if result is None:
                return
            completion = await self._commit(call, result)
        except ProxyError as err:
            yield _sse(err.body())
            return
        except Exception:
            logger.exception("unexpected error in a streamed chat completion")
            yield _sse(_internal_error().body())
            return
        for chunk in self._stream_chunks(call, completion):
            yield chunk
        yield _sse("[DONE]")
