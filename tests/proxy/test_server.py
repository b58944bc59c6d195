"""The OpenAI-compatible proxy, driven by the real ``openai`` SDK and raw httpx against a running server.

The backend is a scripted fake (the real engine lives in gyre_jax.serving): it "generates" fixed texts
followed by <|im_end|>, with log-prob -0.5 and policy version 3 on every token.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from timelimits import scaled, slow_factor

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy.records import RecordStore, TitoRecord
from gyre_jax.proxy.router import Router
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.proxy.turns import derive_seed
from gyre_jax.serving.types import ContextTooLongError, GenerationRequest, GenerationResult

TOKENIZER = ByteTokenizer()
IM_END = TOKENIZER.token_id("<|im_end|>")
MODEL = "gyre-tiny"
MAX_CONTEXT = 4096
MAX_REQUEST_BYTES = 256 * 1024

TOOL_CALL_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
FINAL_TEXT = "It is sunny in Paris."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def default_script(request: GenerationRequest) -> str:
    """Calls the tool until a tool response is in the prompt, then answers."""
    prompt = TOKENIZER.decode(request.prompt_ids)
    return FINAL_TEXT if "<tool_response>" in prompt else TOOL_CALL_TEXT


class ScriptedBackend:
    """A ``GenerationBackend`` whose completions are ``script(request)`` + <|im_end|>, produced on a thread pool.

    Prompts containing ``SLOW`` wait ``slow_s`` (cancellable); ``EXPLODE`` makes the future raise.
    """

    def __init__(self, script: Callable[[GenerationRequest], str] = default_script, max_context: int = MAX_CONTEXT):
        self.script = script
        self.max_context = max_context
        self.reject_prompts_longer_than: int | None = None  # simulate the engine's own context check
        self.slow_s = 10.0
        self.requests: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self._wakeups: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=16)

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        with self._lock:
            self.requests.append(request)
            self._wakeups[request.request_id] = threading.Event()
        limit = self.reject_prompts_longer_than
        if limit is not None and len(request.prompt_ids) > limit:
            future: concurrent.futures.Future[GenerationResult] = concurrent.futures.Future()
            future.set_exception(ContextTooLongError(f"prompt of {len(request.prompt_ids)} ids > {limit}"))
            return future
        return self._pool.submit(self._generate, request)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self.cancelled.append(request_id)
            wakeup = self._wakeups.get(request_id)
        if wakeup is not None:
            wakeup.set()

    def _generate(self, request: GenerationRequest) -> GenerationResult:
        prompt = TOKENIZER.decode(request.prompt_ids)
        if "EXPLODE" in prompt:
            raise RuntimeError("scripted backend failure")
        if "SLOW" in prompt and self._wakeups[request.request_id].wait(self.slow_s):
            return GenerationResult(request.request_id, [], [], [], "cancelled", len(request.prompt_ids))
        ids = (TOKENIZER.encode(self.script(request)) + [IM_END])[: request.sampling.max_tokens]
        finish = "stop" if ids[-1] in request.sampling.stop_ids else "length"
        return GenerationResult(
            request_id=request.request_id,
            token_ids=ids,
            logprobs=[-0.5] * len(ids),
            policy_versions=[3] * len(ids),
            finish_reason=finish,
            prompt_len=len(request.prompt_ids),
        )

    def shutdown(self) -> None:
        for wakeup in list(self._wakeups.values()):
            wakeup.set()
        self._pool.shutdown(wait=True)


# ----------------------------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def backend() -> Iterator[ScriptedBackend]:
    fake = ScriptedBackend()
    yield fake
    fake.shutdown()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> RecordStore:
    return RecordStore(tmp_path_factory.mktemp("records"))


@pytest.fixture(scope="module")
def server(backend: ScriptedBackend, store: RecordStore) -> Iterator[ProxyServer]:
    with ProxyServer(backend, TOKENIZER, store, model_name=MODEL, max_request_bytes=MAX_REQUEST_BYTES, seed=7) as proxy:
        yield proxy


_counter = iter(range(10**6))


@pytest.fixture()
def execution(server: ProxyServer) -> tuple[str, str]:
    """A fresh execution: (execution_id, api_key)."""
    execution_id = f"exec-{next(_counter)}"
    return execution_id, server.open_execution(execution_id)


def sdk(server: ProxyServer, key: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=scaled(10.0), **kwargs)


def post(server: ProxyServer, key: str | None, body: object, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers.update(kwargs.pop("headers", {}))
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers.setdefault("Content-Type", "application/json")
    kwargs.setdefault("timeout", 10.0)
    return httpx.post(f"{server.base_url}/chat/completions", content=content, headers=headers, **kwargs)


def user_turn(text: str = "What is the weather in Paris?") -> list[dict]:
    return [{"role": "system", "content": "You are a helpful agent."}, {"role": "user", "content": text}]


def assert_openai_error(response: httpx.Response, status: int | None = None, code: str | None = None) -> dict:
    assert 400 <= response.status_code < 600, response.text
    if status is not None:
        assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def decoded_completion(record: TitoRecord) -> str:
    ids = record.completion_ids
    if record.finish_reason == "stop" and ids and ids[-1] in TOKENIZER.eos_ids:
        ids = ids[:-1]
    return TOKENIZER.decode(ids)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# ----------------------------------------------------------------------------------------------------------------------
# The happy paths, through the real openai SDK


def test_models_lists_the_served_model(server: ProxyServer, execution: tuple[str, str]) -> None:
    models = sdk(server, execution[1]).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_multi_turn_tool_call_reuses_exact_ids(
    server: ProxyServer, store: RecordStore, execution: tuple[str, str]
) -> None:
    execution_id, key = execution
    client = sdk(server, key)
    messages = user_turn()
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris"}

    messages = messages + [
        {"role": "assistant", "content": choice.message.content, "tool_calls": [tool_call.model_dump()]},
        {"role": "tool", "tool_call_id": tool_call.id, "content": "sunny, 24 C"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == FINAL_TEXT
    assert second.choices[0].message.tool_calls is None

    r1, r2 = store.read(execution_id)
    assert server.execution_calls(execution_id) == 2
    assert (r1.call_index, r2.call_index) == (0, 1)
    assert r1.thread_id == r2.thread_id == "main"
    assert r1.reused_prefix_len == 0
    assert r2.reused_prefix_len == len(r1.prompt_ids) + len(r1.completion_ids)
    assert r2.prompt_ids[: r2.reused_prefix_len] == r1.prompt_ids + r1.completion_ids
    assert r1.completion_ids[-1] == IM_END and r1.finish_reason == "stop"
    assert r1.completion_logprobs == [-0.5] * len(r1.completion_ids)
    assert r1.policy_versions == [3] * len(r1.completion_ids)
    assert r1.model == MODEL and r1.t_start <= r1.t_end <= r2.t_start
    assert decoded_completion(r1) == TOOL_CALL_TEXT
    assert decoded_completion(r2) == FINAL_TEXT
    assert first.usage.prompt_tokens == len(r1.prompt_ids)
    assert first.usage.completion_tokens == len(r1.completion_ids)
    assert first.usage.total_tokens == len(r1.prompt_ids) + len(r1.completion_ids)


def stream_call(client: openai.OpenAI, **kwargs) -> tuple[str, list[dict], str | None, object]:
    """Accumulates a streamed completion: (content, tool calls, finish reason, usage)."""
    content, calls, finish, usage = "", {}, None, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, usage


def test_streaming_multi_turn(server: ProxyServer, store: RecordStore, execution: tuple[str, str]) -> None:
    execution_id, key = execution
    client = sdk(server, key)
    messages = user_turn()
    content, calls, finish, usage = stream_call(
        client, messages=messages, tools=TOOLS, stream_options={"include_usage": True}
    )
    assert content == "Let me check." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    (r1,) = store.read(execution_id)
    assert usage.prompt_tokens == len(r1.prompt_ids) and usage.completion_tokens == len(r1.completion_ids)
    assert decoded_completion(r1) == TOOL_CALL_TEXT

    messages = messages + [
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls
            ],
        },
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny, 24 C"},
    ]
    content, calls, finish, _ = stream_call(client, messages=messages, tools=TOOLS)
    assert (content, calls, finish) == (FINAL_TEXT, [], "stop")
    _, r2 = store.read(execution_id)
    assert r2.reused_prefix_len == len(r1.prompt_ids) + len(r1.completion_ids)
    assert r2.prompt_ids[: r2.reused_prefix_len] == r1.prompt_ids + r1.completion_ids


def test_logprobs_per_completion_token(server: ProxyServer, store: RecordStore, execution: tuple[str, str]) -> None:
    execution_id, key = execution
    response = sdk(server, key).chat.completions.create(
        model=MODEL, messages=user_turn(), tools=TOOLS, logprobs=True, top_logprobs=2
    )
    (record,) = store.read(execution_id)
    entries = response.choices[0].logprobs.content
    assert len(entries) == len(record.completion_ids) - 1  # the stop token is not part of the text
    assert all(e.logprob == -0.5 and e.top_logprobs == [] for e in entries)
    assert bytes(b for e in entries for b in e.bytes).decode("utf-8") == TOOL_CALL_TEXT
    assert "".join(e.token for e in entries) == TOKENIZER.decode(record.completion_ids[:-1])


def test_threads_sampling_and_isolation(
    server: ProxyServer, backend: ScriptedBackend, store: RecordStore, execution: tuple[str, str]
) -> None:
    execution_id, key = execution
    client = sdk(server, key)
    # A sub-agent thread, an explicit seed and temperature, a huge max_tokens, and a body naming another execution.
    client.chat.completions.create(
        model=MODEL,
        messages=user_turn("sub task"),
        temperature=0.25,
        top_p=0.9,
        seed=1234,
        max_tokens=10**6,
        extra_headers={"X-Gyre-Thread-Id": "sub-1"},
        extra_body={"execution_id": "intruder", "user": "intruder", "some_future_field": {"x": 1}},
    )
    client.chat.completions.create(
        model=MODEL, messages=user_turn(), extra_headers={"X-Claude-Code-Session-Id": "cc-session"}
    )
    sub, claude = store.read(execution_id)
    assert (sub.thread_id, claude.thread_id) == ("sub-1", "cc-session")
    assert sub.temperature == 0.25 and claude.temperature == 1.0
    assert not store.path("intruder").exists()

    by_id = {r.request_id: r for r in backend.requests}
    sub_sampling = by_id[sub.request_id].sampling
    assert (sub_sampling.seed, sub_sampling.top_p) == (1234, 0.9)
    assert sub_sampling.max_tokens == MAX_CONTEXT - len(sub.prompt_ids)  # clipped to the context
    assert sub_sampling.stop_ids == TOKENIZER.eos_ids
    assert by_id[sub.request_id].session_id == f"{execution_id}/sub-1"
    # No client seed: derived from (server seed, execution, call number), so reruns sample identically.
    assert by_id[claude.request_id].sampling.seed == derive_seed(7, execution_id, 1)


def test_tool_choice_none_returns_tool_text_as_content(server: ProxyServer, execution: tuple[str, str]) -> None:
    response = sdk(server, execution[1]).chat.completions.create(
        model=MODEL, messages=user_turn(), tools=TOOLS, tool_choice="none"
    )
    assert response.choices[0].message.content == TOOL_CALL_TEXT
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].finish_reason == "stop"


def test_length_finish_and_continuation(server: ProxyServer, store: RecordStore, execution: tuple[str, str]) -> None:
    execution_id, key = execution
    client = sdk(server, key)
    messages = user_turn("say something")
    first = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5)
    assert first.choices[0].finish_reason == "length"
    assert first.choices[0].message.content == TOOL_CALL_TEXT[:5]
    messages = messages + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "go on"},
    ]
    client.chat.completions.create(model=MODEL, messages=messages)
    r1, r2 = store.read(execution_id)
    assert r1.finish_reason == "length" and len(r1.completion_ids) == 5
    # A cut-off completion is continued verbatim, closed with <|im_end|>.
    assert r2.prompt_ids[: r2.reused_prefix_len] == r1.prompt_ids + r1.completion_ids + [IM_END]


def test_concurrent_calls_do_not_block_each_other(
    server: ProxyServer, backend: ScriptedBackend, execution: tuple[str, str]
) -> None:
    execution_id, key = execution
    client = sdk(server, key)
    f = slow_factor()  # the calls' time and the bound scaled alike: 8 calls in turn would still take 1.6x the bound
    backend.slow_s = 0.5 * f  # "SLOW" prompts take 0.5 s (idle machine) and then complete normally
    try:
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [
                pool.submit(
                    client.chat.completions.create,
                    model=MODEL,
                    messages=user_turn(f"SLOW {i}"),
                    extra_headers={"X-Gyre-Thread-Id": f"t{i}"},
                )
                for i in range(8)
            ]
            results = [f.result() for f in futures]
        elapsed = time.monotonic() - start
    finally:
        backend.slow_s = 10.0
    assert all(r.choices[0].finish_reason == "tool_calls" for r in results)
    assert elapsed < 2.5 * f, f"8 concurrent {0.5 * f:.2f} s calls took {elapsed:.2f} s: the event loop is blocked"
    assert server.execution_calls(execution_id) == 8


def test_router_as_backend(store: RecordStore) -> None:
    cells = {"cell0": ScriptedBackend(max_context=4096), "cell1": ScriptedBackend(max_context=2048)}
    router = Router(cells)
    try:
        with ProxyServer(router, TOKENIZER, store, model_name=MODEL) as proxy:
            key = proxy.open_execution("routed")
            client = sdk(proxy, key)
            for thread in ["a", "b", "a", "b", "a"]:
                client.chat.completions.create(
                    model=MODEL, messages=user_turn(), extra_headers={"X-Gyre-Thread-Id": thread}
                )
            served = {name: {r.session_id for r in cell.requests} for name, cell in cells.items()}
            assert sorted(served.values(), key=sorted) == [{"routed/a"}, {"routed/b"}]
            (record,) = [r for r in store.read("routed") if r.call_index == 4]
            assert by_request(cells, record.request_id).sampling.max_tokens == 2048 - len(record.prompt_ids)
    finally:
        for cell in cells.values():
            cell.shutdown()


def test_a_stopped_server_is_freed_with_its_backend(store: RecordStore) -> None:
    """FastAPI keeps every endpoint it has inspected in process-wide caches; a server's routes must not keep the
    server (and through it the router, the cells, their engines and compiled programs) alive once it has stopped
    and nothing else holds it. Served by every route kind: an API route, a bound method (models), a mounted one."""
    import gc

    server_ref, backend_ref = _serve_and_stop(store)
    gc.collect()
    assert server_ref() is None and backend_ref() is None, [type(r).__name__ for r in gc.get_referrers(server_ref())]


def _serve_and_stop(store: RecordStore) -> tuple:
    """Serves one call of each route kind, stops; weak references to the server and its backend."""
    import weakref

    backend = ScriptedBackend()

    def mount(app) -> None:  # a mounted route whose closure holds the backend, as the live view's holds the run
        @app.get("/extra")
        async def extra() -> dict:
            return {"backend": type(backend).__name__}

    with ProxyServer(backend, TOKENIZER, store, model_name=MODEL, routes=[mount]) as proxy:
        client = sdk(proxy, proxy.open_execution("freed"))
        assert client.chat.completions.create(model=MODEL, messages=user_turn()).choices[0].message.content
        assert [m.id for m in client.models.list().data] == [MODEL]
        root = proxy.base_url.removesuffix("/v1")
        assert httpx.get(root + "/extra").json() == {"backend": "ScriptedBackend"}
        assert httpx.get(root + "/health").json() == {"status": "ok"}
        proxy.close_execution("freed")
    backend.shutdown()
    return weakref.ref(proxy), weakref.ref(backend)


def by_request(cells: dict[str, ScriptedBackend], request_id: str) -> GenerationRequest:
    return next(r for cell in cells.values() for r in cell.requests if r.request_id == request_id)


# ----------------------------------------------------------------------------------------------------------------------
# Bad input: always a 4xx with an OpenAI error body, and the server keeps serving


def valid_body(**overrides: object) -> dict:
    return {"model": MODEL, "messages": user_turn(), **overrides}


def test_malformed_burst_then_valid(server: ProxyServer, store: RecordStore, execution: tuple[str, str]) -> None:
    execution_id, key = execution
    bad_bodies: list[tuple[bytes | dict, int, str | None]] = [
        (b"{not json", 400, None),
        (b"", 400, None),
        (b"\xff\xfe\x00", 400, None),
        (b"[1, 2, 3]", 400, None),
        (b'"a string"', 400, None),
        ({"messages": user_turn()}, 400, None),  # no model
        ({"model": MODEL}, 400, None),  # no messages
        (valid_body(messages=[]), 400, None),
        (valid_body(messages="hello"), 400, None),
        (valid_body(messages=[{"role": "wizard", "content": "hi"}]), 400, None),
        (valid_body(messages=[{"content": "hi"}]), 400, None),
        (valid_body(messages=[{"role": "user", "content": 42}]), 400, None),
        (
            valid_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            400,
            None,
        ),
        (valid_body(messages=[{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]), 400, None),
        (valid_body(temperature="hot"), 400, None),
        (valid_body(temperature=-1), 400, None),
        (valid_body(top_p=0), 400, None),
        (valid_body(max_tokens=0), 400, None),
        (valid_body(max_tokens="many"), 400, None),
        (valid_body(tools=[{"type": "function"}]), 400, None),
        (valid_body(tools=[{"type": "retrieval", "function": {"name": "x"}}]), 400, None),
        (valid_body(n=17), 400, None),  # more choices than sampling.MAX_CHOICES
        (valid_body(stop=["a", "b", "c", "d", "e"]), 400, None),  # OpenAI allows 4
        (valid_body(tool_choice="required"), 400, None),  # no tools to call
        (valid_body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), 400, None),
        (valid_body(tool_choice="sometimes"), 400, None),
        (valid_body(model="gpt-4o"), 404, "model_not_found"),
        (valid_body(messages=[{"role": "user", "content": "x" * (MAX_CONTEXT + 10)}]), 400, "context_length_exceeded"),
    ]
    for body, status, code in bad_bodies:
        error = assert_openai_error(post(server, key, body), status, code)
        if body == valid_body(temperature="hot"):
            assert "temperature" in error["message"] and error["param"] == "temperature"
        if status == 400 and code is None and isinstance(body, dict) and "messages" not in body:
            assert "messages" in error["message"]
    assert (
        "at most 4 stop sequences" in assert_openai_error(post(server, key, valid_body(stop=list("abcde"))))["message"]
    )
    assert "no tools" in assert_openai_error(post(server, key, valid_body(tool_choice="required")))["message"]
    assert server.execution_calls(execution_id) == 0
    assert post(server, key, valid_body()).status_code == 200
    assert server.execution_calls(execution_id) == 1


def test_oversized_bodies_get_413(server: ProxyServer, execution: tuple[str, str]) -> None:
    _, key = execution
    huge = json.dumps(valid_body(messages=[{"role": "user", "content": "x" * (MAX_REQUEST_BYTES + 1)}])).encode()
    assert_openai_error(post(server, key, huge), 413)

    def chunked() -> Iterator[bytes]:  # no Content-Length: the actual size is what counts
        for start in range(0, len(huge), 65536):
            yield huge[start : start + 65536]

    response = httpx.post(
        f"{server.base_url}/chat/completions",
        content=chunked(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        timeout=scaled(10.0),
    )
    assert_openai_error(response, 413)
    assert post(server, key, valid_body()).status_code == 200


def test_auth_and_routes(server: ProxyServer, execution: tuple[str, str]) -> None:
    execution_id, key = execution
    assert_openai_error(post(server, None, valid_body()), 401, "invalid_api_key")
    assert_openai_error(post(server, "gyre-never-issued", valid_body()), 401, "invalid_api_key")
    assert_openai_error(post(server, key, valid_body(), headers={"Authorization": key}), 401)
    with pytest.raises(openai.AuthenticationError):
        sdk(server, "wrong").chat.completions.create(model=MODEL, messages=user_turn())
    assert_openai_error(
        httpx.get(f"{server.base_url}/nope", headers={"Authorization": f"Bearer {key}"}), 404, "not_found"
    )
    assert_openai_error(httpx.get(f"{server.base_url}/chat/completions"), 405)
    with pytest.raises(openai.NotFoundError):
        sdk(server, key).chat.completions.create(model="other-model", messages=user_turn())

    assert post(server, key, valid_body()).status_code == 200
    server.close_execution(execution_id)
    assert_openai_error(post(server, key, valid_body()), 409, "execution_ended")
    assert server.execution_calls(execution_id) == 1
    with pytest.raises(ValueError, match="already opened"):
        server.open_execution(execution_id)
    with pytest.raises(KeyError, match="never opened"):
        server.execution_calls("no-such-execution")


def test_backend_context_error_and_crash(
    server: ProxyServer, backend: ScriptedBackend, execution: tuple[str, str]
) -> None:
    execution_id, key = execution
    backend.reject_prompts_longer_than = 10
    try:
        assert_openai_error(post(server, key, valid_body()), 400, "context_length_exceeded")
        stream = post(server, key, valid_body(stream=True))
        assert stream.status_code == 200 and '"context_length_exceeded"' in stream.text
    finally:
        backend.reject_prompts_longer_than = None
    error = assert_openai_error(post(server, key, valid_body(messages=user_turn("EXPLODE"))), 500, "internal_error")
    assert error["type"] == "server_error"
    with pytest.raises(openai.APIError):
        list(sdk(server, key).chat.completions.create(model=MODEL, messages=user_turn("EXPLODE"), stream=True))
    assert server.execution_calls(execution_id) == 0
    assert post(server, key, valid_body()).status_code == 200


def test_client_disconnect_cancels_and_records_nothing(
    server: ProxyServer, backend: ScriptedBackend, execution: tuple[str, str]
) -> None:
    execution_id, key = execution
    before = len(backend.cancelled)
    with pytest.raises(httpx.ReadTimeout):
        post(server, key, valid_body(messages=user_turn("SLOW plain")), timeout=min(scaled(0.3), 5.0))  # slow_s: 10
    assert wait_until(lambda: len(backend.cancelled) == before + 1), "non-streaming disconnect did not cancel"

    with httpx.stream(
        "POST",
        f"{server.base_url}/chat/completions",
        json=valid_body(messages=user_turn("SLOW streamed"), stream=True),
        headers={"Authorization": f"Bearer {key}"},
        timeout=scaled(5.0),
    ) as response:
        first_line = next(response.iter_lines())
        assert (
            first_line.startswith("data: ") and json.loads(first_line[6:])["choices"][0]["delta"]["role"] == "assistant"
        )
    assert wait_until(lambda: len(backend.cancelled) == before + 2), "streaming disconnect did not cancel"
    time.sleep(0.2)
    assert server.execution_calls(execution_id) == 0


def test_close_execution_cancels_in_flight(
    server: ProxyServer, backend: ScriptedBackend, execution: tuple[str, str]
) -> None:
    execution_id, key = execution
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, server, key, valid_body(messages=user_turn("SLOW")))
        assert wait_until(
            lambda: any(
                "SLOW" in TOKENIZER.decode(r.prompt_ids) and r.session_id == f"{execution_id}/main"
                for r in backend.requests
            )
        )
        server.close_execution(execution_id)
        assert_openai_error(pending.result(), 409, "execution_ended")
    assert server.execution_calls(execution_id) == 0


def test_context_manager_stops_the_server(backend: ScriptedBackend, store: RecordStore) -> None:
    with ProxyServer(backend, TOKENIZER, store) as proxy:
        url = proxy.base_url
        assert proxy.base_url.startswith("http://127.0.0.1:") and proxy.base_url.endswith("/v1")
        assert httpx.get(url.removesuffix("/v1") + "/health").json() == {"status": "ok"}
    with pytest.raises(httpx.ConnectError):
        httpx.get(url.removesuffix("/v1") + "/health", timeout=scaled(1.0))


def test_reopened_execution_continues_call_numbering(backend: ScriptedBackend, store: RecordStore) -> None:
    """After a proxy restart, an execution's records keep dense call indices in the same file."""
    for expected_index in (0, 1):
        with ProxyServer(backend, TOKENIZER, store) as proxy:
            key = proxy.open_execution("resumed")
            assert proxy.execution_calls("resumed") == expected_index
            assert post(proxy, key, valid_body()).status_code == 200
    assert [r.call_index for r in store.read("resumed")] == [0, 1]
