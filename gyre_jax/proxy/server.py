"""OpenAI- and Anthropic-compatible HTTP proxy between black-box harnesses and the serving backend.

Owns the HTTP side: the server's lifecycle (uvicorn in a daemon thread), reading bounded JSON bodies, route
registration and error handlers. Each API route is an adapter (``adapters/``) over the shared turn pipeline
(``pipeline.py``); execution and thread identity live in ``identity.py``.

Endpoints: ``GET /v1/models``; ``POST /v1/chat/completions``, ``POST /v1/completions`` and
``POST /v1/responses`` (OpenAI);
``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic; ``?beta=true`` accepted);
``GET /health``; ``GET /openapi.json`` (this proxy's OpenAPI document, ``openapi.py``). All calls may stream
(SSE). Errors are OpenAI error bodies on the OpenAI routes and
Anthropic error bodies on the Anthropic routes, always a 4xx for bad input; nothing a client sends
takes the server down. A call's record is fsynced before its response is sent. Model calls pass bounded
admission (``admission.py``: 429 + Retry-After beyond it); slow or abusive connections are bounded by
``connections.py``. See docs/proxy.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import inspect
import ipaddress
import logging
import socket
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from gyre_jax.proxy import json_input, openapi, sse, tito
from gyre_jax.proxy.adapters.anthropic_messages import CountTokensRequest, Messages
from gyre_jax.proxy.adapters.base import TurnAdapter
from gyre_jax.proxy.adapters.openai_chat import ChatCompletions
from gyre_jax.proxy.adapters.openai_completions import Completions
from gyre_jax.proxy.adapters.openai_responses import Responses
from gyre_jax.proxy.admission import Admission
from gyre_jax.proxy.chat_format import ChatFormat
from gyre_jax.proxy.connections import ConnectionCap, ConnectionLimits, GuardedH11Protocol
from gyre_jax.proxy.errors import REFUSAL_KINDS, ProxyError, internal_error, refusal_kind
from gyre_jax.proxy.identity import MAX_THREADS_PER_EXECUTION, Execution, Executions, thread_base
from gyre_jax.proxy.pipeline import DEFAULT_MAX_TOKENS, TurnPipeline
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.sampling import CLIENT, SamplingPolicy
from gyre_jax.proxy.turns import Failed, Turn, TurnEvent, TurnRequest
from gyre_jax.serving.types import GenerationBackend

logger = logging.getLogger(__name__)

_DRAIN_LIMIT_BYTES = 64 * 1024 * 1024  # an oversized body is read (and dropped) up to this, so the client sees the 413
DEFAULT_MAX_ACTIVE_CALLS = 256  # model calls in flight at once (config.proxy.max_active_calls: 0 derives it)
DEFAULT_MAX_QUEUED_CALLS = 1024  # model calls waiting for a slot before further ones get 429

Handler = Callable[[Request], Awaitable[Response]]


async def read_json(request: Request, limit: int, timeout_s: float | None = None) -> dict[str, Any]:
    """The request's body as a JSON object; 400 if it is not one, 413 if it is over ``limit`` bytes, 408 if it did
    not all arrive within ``timeout_s`` (None: no limit)."""
    try:
        async with asyncio.timeout(timeout_s):
            body = await read_body(request, limit)
    except TimeoutError:
        raise ProxyError(
            408, f"the request body did not arrive within {timeout_s} s; send it all at once", code="request_timeout"
        ) from None
    try:
        data = json_input.parse(body)
    except ValueError as exc:  # bad JSON or UTF-8, NaN, lone surrogates, deep nesting, ints past 4300 digits
        raise ProxyError(400, f"request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(data, dict):
        raise ProxyError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return data


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 if it is over ``limit`` bytes (by Content-Length or by its actual size).

    An oversized body is still read (and dropped, up to a cap) so the client gets the 413 instead of
    a connection reset while it is still sending.
    """
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


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) only listens on this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve to any interface
        return False


def check_bind(host: str, allow_remote_bind: bool) -> None:
    """ValueError unless ``host`` is loopback or remote binds are allowed: the proxy serves model calls to anyone
    who reaches its port with a key, so exposing it beyond this machine must be asked for."""
    if not allow_remote_bind and not is_loopback(host):
        raise ValueError(
            f"proxy host {host!r} is not a loopback address: the proxy would accept connections from other machines. "
            "Bind 127.0.0.1 (harnesses on this host, sandboxed ones through their bridge), or set "
            "config.proxy.allow_remote_bind=True (ProxyServer(allow_remote_bind=True)) where harnesses run elsewhere"
        )


class ProxyServer:
    """The proxy over a ``GenerationBackend``; run it with ``start()``/``stop()`` or ``with``.

    ``tokenizer`` is anything with ``encode``, ``decode``, ``token_id`` and ``eos_ids`` (the byte
    tokenizer, or a ``tokenizer.json`` wrapper). ``max_tokens_cap`` bounds every call's completion
    whatever the client asks (None: only the context bounds it); ``default_max_tokens`` is the budget
    of a request that names none. ``max_threads_per_execution`` bounds the per-thread state an
    execution keeps (one context each), so memory stays bounded however long it runs. ``sampling`` says whose
    temperature / top-p / top-k calls are served with: the client's (``CLIENT``, the default here) or a
    training run's (``SamplingPolicy.policy(...)``, what ``train`` passes). ``max_active_calls`` model calls run at
    once and ``max_queued_calls`` more wait for a slot (FIFO); further ones get 429 with ``Retry-After:
    retry_after_s`` (``admission.py``). ``limits`` are the connection-level ones (``connections.py``). ``host``
    must be a loopback address unless ``allow_remote_bind`` (anyone who reaches the port may try keys; see
    ``check_bind``). ``routes``: more routes mounted on the app (the run's live view). The settings are read once,
    at construction.
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
        tools_format: str | ChatFormat = "qwen3",  # the chat format, or a built-in one's name
        max_tokens_cap: int | None = None,
        max_threads_per_execution: int = MAX_THREADS_PER_EXECUTION,
        sampling: SamplingPolicy = CLIENT,
        max_active_calls: int = DEFAULT_MAX_ACTIVE_CALLS,
        max_queued_calls: int = DEFAULT_MAX_QUEUED_CALLS,
        retry_after_s: int = 1,
        limits: ConnectionLimits | None = None,
        allow_remote_bind: bool = False,
        routes: Sequence[Callable[[FastAPI], None]] = (),
    ) -> None:
        check_bind(host, allow_remote_bind)
        _check_settings(max_request_bytes, default_max_tokens, max_tokens_cap, max_threads_per_execution)
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
        self._admission = Admission(max_active_calls, max_queued_calls, retry_after_s, model=model_name)
        # room for every admitted and queued call, plus 256 for the rest (429s, count_tokens, models, health)
        self.limits = limits or ConnectionLimits(max_requests=max_active_calls + max_queued_calls + 256)
        self._executions = Executions(record_store, max_threads_per_execution)
        self._refusals: dict[str, collections.Counter[str]] = {}  # execution id -> refused calls by kind
        self._refusals_lock = threading.Lock()  # written on the event loop, read by the executor's threads
        self._pipeline = TurnPipeline(backend, tokenizer, record_store, model_name, seed=seed,
                                      default_max_tokens=default_max_tokens, tools_format=tools_format,
                                      max_tokens_cap=max_tokens_cap, sampling=sampling)  # fmt: skip
        self._requested_port = port
        self._server: uvicorn.Server | None = None
        self._cap: ConnectionCap | None = None  # the connection cap in front of the app, made by start()
        self._socket: socket.socket | None = None
        self._port: int | None = None  # the bound port, known after start()
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._endpoints: list[str] = []  # "METHOD /path" of the API routes, for the 404 message
        self._adapters: dict[str, TurnAdapter] = {}  # API route path -> its adapter (errors outside the routes)
        self.operations: list[openapi.Operation] = []  # every route served, as GET /openapi.json documents it
        self.app = self._build_app()
        for mount in routes:  # more read-only routes beside the API (the live view, proxy/live.py)
            mount(self.app)

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
        self._server = uvicorn.Server(self._uvicorn_config())
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

    def _uvicorn_config(self) -> uvicorn.Config:
        """uvicorn over the app behind the connection cap, with the connection limits (``connections.py``)."""
        lim = self.limits
        self._cap = ConnectionCap(self.app, lim, self._refuse_request)
        return uvicorn.Config(self._cap, log_level="warning", access_log=False, lifespan="off", ws="none",
                              timeout_graceful_shutdown=5, http=functools.partial(GuardedH11Protocol, limits=lim),
                              timeout_keep_alive=lim.keep_alive_s, h11_max_incomplete_event_size=lim.max_header_bytes)  # fmt: skip

    def _refuse_request(self, path: str, status: int, message: str) -> Response:
        """The connection cap's 503 (with ``Retry-After``) or 431, in the style of ``path``'s API."""
        return self._error_at(path, _cap_refusal(status, message, self._admission.retry_after_s))

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
        return self._executions.open(execution_id)

    def close_execution(self, execution_id: str) -> None:
        """Ends the execution: its key gets 409 from now on, in-flight calls are cancelled and not recorded."""
        for request_id in self._executions.get(execution_id).end():
            self.backend.cancel(request_id)

    def execution_calls(self, execution_id: str) -> int:
        """Number of calls recorded for the execution."""
        return self._executions.get(execution_id).next_record_index

    def admission_stats(self) -> dict[str, int]:
        """Counters of model calls: admitted, queued, refused (429), left_queue, active, waiting; and
        refused_503 (requests over the connection limits' max_requests)."""
        stats = dataclasses.asdict(self._admission.stats())
        return {**stats, "refused_503": self._cap.refused if self._cap is not None else 0}

    def execution_refusals(self, execution_id: str) -> dict[str, int]:
        """How many of the execution's model calls were refused, by why (``errors.REFUSAL_KINDS``: ``context`` a
        prompt over the context, ``admission`` a 429, ``bad_request`` any other 4xx of what it sent); a stream that
        failed after its headers counts too."""
        with self._refusals_lock:
            counts = self._refusals.get(execution_id, {})
            return {kind: counts.get(kind, 0) for kind in REFUSAL_KINDS}

    def _count_refusal(self, execution_id: str, err: ProxyError) -> None:
        kind = refusal_kind(err)
        if kind is None:
            return
        with self._refusals_lock:
            counts = self._refusals.setdefault(execution_id, collections.Counter())
            counts[kind] += 1

    async def _counted(self, execution: Execution, events: AsyncIterator[TurnEvent]) -> AsyncIterator[TurnEvent]:
        """``events`` of a stream, counting a ``Failed`` one as the execution's refusal (``_count_refusal``)."""
        async for event in events:
            if isinstance(event, Failed):
                self._count_refusal(execution.execution_id, event.error)
            yield event

    def execution_threads(self, execution_id: str) -> list[str]:
        """Thread ids the execution's live state knows (least recently used first)."""
        return self._executions.get(execution_id).thread_ids()

    # -- app -------------------------------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        """Health, models, the OpenAPI document, and one route per API adapter: adding an API is one more ``_mount``
        line. Each route registers its ``openapi.Operation``, so ``GET /openapi.json`` lists exactly what is served."""
        app = FastAPI(title="gyre-jax proxy", docs_url=None, redoc_url=None, openapi_url=None)
        app.router.route_class = WeakEndpointRoute  # every route, the mounted ones included (see the class)
        _add_error_handlers(app, self._error_at, self._endpoints)

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/openapi.json")
        async def schema() -> dict:
            return openapi.document(self.operations, self.model_name)

        self.operations += [openapi.Operation("get", "/health", "liveness", auth=False),
                            openapi.Operation("get", "/openapi.json", "this document", auth=False)]  # fmt: skip
        app.get("/v1/models")(self._models)
        self._endpoints.append("GET /v1/models")
        self.operations.append(openapi.Operation("get", "/v1/models", "the served model (OpenAI and Anthropic form)"))
        messages = Messages(self.model_name)
        self._mount(app, "/v1/chat/completions", ChatCompletions(self.model_name))
        self._mount(app, "/v1/completions", Completions(self.model_name))
        self._mount(app, "/v1/responses", Responses(self.model_name))
        self._mount(app, "/v1/messages", messages)
        count = openapi.Operation("post", "/v1/messages/count_tokens", "Anthropic count_tokens", CountTokensRequest,
                                  "anthropic", query=("beta",))  # fmt: skip
        self._post(app, count, self._count_tokens_handler(messages), messages)
        return app

    def _mount(self, app: FastAPI, path: str, adapter: TurnAdapter) -> None:
        """``POST path``: model calls in ``adapter``'s wire format, through the turn pipeline."""
        query = ("beta",) if adapter.error_style == "anthropic" else ()
        summary = f"a model call in the {type(adapter).__name__} wire format ({adapter.error_style} API)"
        op = openapi.Operation("post", path, summary, adapter.request_schema, adapter.error_style, streams=True,
                               query=query)  # fmt: skip
        self._post(app, op, self._turn_handler(adapter), adapter)

    def _post(self, app: FastAPI, op: openapi.Operation, handler: Handler, adapter: TurnAdapter) -> None:
        """``POST op.path`` served by ``handler``; its errors (and those of paths under it) in ``adapter``'s style."""

        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except ProxyError as err:
                return _error_response(adapter, err)
            except Exception:
                logger.exception("unexpected error serving %s", request.url.path)
                return _error_response(adapter, internal_error())

        app.post(op.path)(endpoint)
        self._endpoints.append(f"POST {op.path}")
        self._adapters[op.path] = adapter
        self.operations.append(op)

    def _turn_handler(self, adapter: TurnAdapter) -> Handler:
        """One API call: key -> body -> ``adapter.parse`` -> pipeline -> ``adapter.respond`` or ``adapter.stream``."""

        async def handle(request: Request) -> Response:
            t_start = time.time()
            execution = self._executions.authenticate(request.headers)
            try:
                return await admitted(request, execution, t_start)
            except ProxyError as err:  # refused: counted for the execution (``execution_refusals``)
                self._count_refusal(execution.execution_id, err)
                raise

        async def admitted(request: Request, execution: Execution, t_start: float) -> Response:
            body = await read_json(request, self.max_request_bytes, self.limits.body_timeout_s)
            turn_request = adapter.parse(body)
            if not await self._admission.acquire(request.is_disconnected):
                return Response(status_code=499)  # the client went away while queued; nobody reads this
            handed = False
            try:
                response = await serve(request, execution, turn_request, t_start)
                if isinstance(response, sse.EventStream):  # the stream holds the slot until it is sent or abandoned
                    response.on_close.append(self._admission.release)
                    handed = True
                return response
            finally:
                if not handed:
                    self._admission.release()

        async def serve(request: Request, execution: Execution, turn_request: TurnRequest, t_start: float) -> Response:
            turn = self._pipeline.prepare(turn_request, execution, thread_base(request.headers), t_start)
            if (turn_request.n or 1) > 1:
                return await self._choices(adapter, turn, request)
            if turn_request.stream:
                events = self._counted(execution, self._pipeline.stream(turn, request.is_disconnected))
                return sse.response(adapter.stream(turn, events))
            completion = await self._pipeline.run(turn, request.is_disconnected)
            if completion is None:  # the client went away; nobody reads this
                return Response(status_code=499)
            return JSONResponse(adapter.respond(turn, completion))

        return handle

    async def _choices(self, adapter: TurnAdapter, turn: Turn, request: Request) -> Response:
        """A call with several choices (n > 1): each its own generation and record, answered together."""
        turns = self._pipeline.choices(turn)
        if turn.request.stream:
            events = self._counted(turn.execution, self._pipeline.stream_choices(turns, request.is_disconnected))
            return sse.response(adapter.stream_choices(turns, events))
        completions = await self._pipeline.run_choices(turns, request.is_disconnected)
        if completions is None:
            return Response(status_code=499)
        return JSONResponse(adapter.respond_choices(turns, completions))

    def _count_tokens_handler(self, messages: Messages) -> Handler:
        """Anthropic ``count_tokens``: the full rendering's token count; nothing is run or recorded."""

        async def count_tokens(request: Request) -> Response:
            self._executions.authenticate(request.headers)
            body = await read_json(request, self.max_request_bytes, self.limits.body_timeout_s)
            input_tokens = self._pipeline.count_tokens(messages.parse_count_tokens(body))
            return JSONResponse(messages.count_tokens_body(input_tokens))

        return count_tokens

    async def _models(self, request: Request) -> Response:
        try:
            self._executions.authenticate(request.headers)
        except ProxyError as err:
            return err.response()
        return JSONResponse(_models_body(self.model_name))

    def _error_at(self, path: str, err: ProxyError) -> JSONResponse:
        """``err`` in the style of the API route ``path`` falls under (``/v1/messages/nope``: Anthropic), else OpenAI."""
        adapter = next((a for route, a in self._adapters.items() if path.startswith(route)), None)
        return err.response() if adapter is None else _error_response(adapter, err)


def _cap_refusal(status: int, message: str, retry_after_s: int) -> ProxyError:
    """The connection cap's refusal: 503 with ``Retry-After`` (too many requests) or 431 (a head too large)."""
    if status == 503:
        headers = {"Retry-After": str(retry_after_s), "Connection": "close"}
        return ProxyError(503, message, error_type="server_error", code="too_many_requests", headers=headers)
    return ProxyError(status, message, code="headers_too_large", headers={"Connection": "close"})


def _check_settings(max_request_bytes: int, default_max_tokens: int, max_tokens_cap: int | None,
                    max_threads_per_execution: int) -> None:  # fmt: skip
    """``ProxyServer``'s size settings, each checked (ValueError naming it)."""
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes={max_request_bytes} must be >= 1")
    if default_max_tokens < 1:
        raise ValueError(f"default_max_tokens={default_max_tokens} must be >= 1")
    if max_tokens_cap is not None and max_tokens_cap < 1:
        raise ValueError(f"max_tokens_cap={max_tokens_cap} must be >= 1 (or None for no cap)")
    if max_threads_per_execution < 1:
        raise ValueError(f"max_threads_per_execution={max_threads_per_execution} must be >= 1")


class WeakEndpointRoute(APIRoute):
    """An ``APIRoute`` whose endpoint reaches the function it serves through a weak reference; the route holds the
    function. FastAPI (0.165, what this project installs) remembers every endpoint it has inspected in module-level
    ``lru_cache``s of 4096 entries, for the life of the process, and this server's endpoints reach the server, hence
    its backend: the router, the cells, their engines with their KV pools and compiled programs. A process that
    builds several servers (a notebook running one training run after another, a test worker) kept every one of
    them, device memory included (a test worker's compiled programs grew until the kernel's map limit killed it).
    With the function held only by its route, a server nothing else holds is freed with its app; FastAPI's caches
    keep the small forwarding function."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        self.target = endpoint
        super().__init__(path, _forwarding(endpoint), **kwargs)


def _forwarding(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """A function with ``endpoint``'s signature (annotations evaluated, so FastAPI reads the same parameters) that
    calls it through a weak reference (the route that calls it holds ``endpoint``, so the reference is live)."""
    ref = weakref.ref(endpoint)
    if inspect.iscoroutinefunction(endpoint):

        async def forward(*args: Any, **kwargs: Any) -> Any:
            return await ref()(*args, **kwargs)

    else:

        def forward(*args: Any, **kwargs: Any) -> Any:
            return ref()(*args, **kwargs)

    forward.__signature__ = inspect.signature(endpoint, eval_str=True)  # type: ignore[attr-defined]
    forward.__name__ = getattr(endpoint, "__name__", "endpoint")
    forward.__doc__ = endpoint.__doc__
    return forward


def _models_body(model_name: str) -> dict[str, Any]:
    """``GET /v1/models``: one card readable by both SDKs (OpenAI: id/object/owned_by; Anthropic: type/display_name/
    created_at)."""
    card = {"id": model_name, "object": "model", "type": "model", "display_name": model_name,
            "created": 0, "created_at": "1970-01-01T00:00:00Z", "owned_by": "gyre-jax"}  # fmt: skip
    return {"object": "list", "data": [card], "has_more": False, "first_id": model_name, "last_id": model_name}


def _add_error_handlers(app: FastAPI, error_at: Callable[[str, ProxyError], JSONResponse], served: list[str]) -> None:
    """Errors raised outside the API routes (unknown path, wrong method, ...) in the style of the path's API
    (``error_at(path, err)``); a 404 lists the ``served`` endpoints."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:
            message += f"; this proxy serves {', '.join(served[:-1])} and {served[-1]}"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        response = error_at(request.url.path, ProxyError(exc.status_code, message, code=code))
        response.headers.update(exc.headers or {})  # a 405's Allow (RFC 9110: the methods the path serves)
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_failed(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_at(request.url.path, ProxyError(400, f"invalid request: {exc.errors()}"))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unexpected error serving %s %s", request.method, request.url.path, exc_info=exc)
        return error_at(request.url.path, internal_error())


def _error_response(adapter: TurnAdapter, err: ProxyError) -> JSONResponse:
    return JSONResponse(adapter.error_body(err), status_code=err.status, headers=err.headers)
