"""The Anthropic Messages API, legacy completions, thread identity and memory bounds of the proxy, driven by
the real ``anthropic`` / ``openai`` SDKs and raw httpx against a running server over a scripted backend."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from timelimits import scaled

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy.adapters import anthropic_messages as anthropic_api
from gyre_jax.proxy.chat_template import parse_completion
from gyre_jax.proxy.records import RecordStore, TitoRecord
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.serving.types import GenerationRequest, GenerationResult

TOKENIZER = ByteTokenizer()
IM_END = TOKENIZER.token_id("<|im_end|>")
MODEL = "gyre-tiny"
MAX_CONTEXT = 4096
THINK_TOOL = '<think>\nI need the weather.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
FINAL = "It is sunny."
TOOLS = [{"name": "get_weather", "description": "Weather of a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]  # fmt: skip


class Backend:
    """Completes with THINK_TOOL until a tool response is in the prompt, then FINAL; ``SLOW`` prompts wait."""

    def __init__(self) -> None:
        self.max_context = MAX_CONTEXT
        self.requests: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self._events: dict[str, threading.Event] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(8)

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        self.requests.append(request)
        self._events[request.request_id] = threading.Event()
        return self._pool.submit(self._run, request)

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        if request_id in self._events:
            self._events[request_id].set()

    def _run(self, request: GenerationRequest) -> GenerationResult:
        prompt = TOKENIZER.decode(request.prompt_ids)
        if "SLOW" in prompt and self._events[request.request_id].wait(scaled(10)):
            return GenerationResult(request.request_id, [], [], [], "cancelled", len(request.prompt_ids))
        text = FINAL if "<tool_response>" in prompt else THINK_TOOL
        ids = (TOKENIZER.encode(text) + [IM_END])[: request.sampling.max_tokens]
        finish = "stop" if ids[-1] == IM_END else "length"
        return GenerationResult(
            request.request_id, ids, [-0.25] * len(ids), [5] * len(ids), finish, len(request.prompt_ids), "cell0"
        )


@pytest.fixture(scope="module")
def backend() -> Iterator[Backend]:
    b = Backend()
    yield b
    for event in b._events.values():
        event.set()
    b._pool.shutdown()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> RecordStore:
    return RecordStore(tmp_path_factory.mktemp("records"))


@pytest.fixture(scope="module")
def server(backend, store) -> Iterator[ProxyServer]:
    with ProxyServer(backend, TOKENIZER, store, model_name=MODEL, max_request_bytes=128 * 1024, max_tokens_cap=2000,
                     max_threads_per_execution=3) as proxy:  # fmt: skip
        yield proxy


_ids = iter(range(10**6))


@pytest.fixture()
def execution(server) -> tuple[str, str]:
    execution_id = f"anth-{next(_ids)}"
    return execution_id, server.open_execution(execution_id)


def client(server: ProxyServer, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.anthropic_base_url, api_key=key, max_retries=0, timeout=scaled(10.0))


def completion_text(record: TitoRecord) -> str:
    ids = record.completion_ids[:-1] if record.finish_reason == "stop" else record.completion_ids
    return TOKENIZER.decode(ids)


def blocks_from_record(record: TitoRecord) -> list[dict]:
    """What the client must have received, re-derived from the record's token ids alone."""
    blocks = anthropic_api.content_blocks(parse_completion(completion_text(record)))
    for block in blocks:
        block.pop("id", None)
    return blocks


def dump(content) -> list[dict]:
    out = [b.model_dump(exclude_none=True) for b in content]
    for block in out:
        block.pop("id", None)
        block.pop("citations", None)
    return out


@pytest.mark.parametrize("user_text", [False, True], ids=["tool_result_only", "tool_result_and_text"])
def test_sdk_tool_round_trip_with_thinking_non_streaming(server, store, execution, user_text) -> None:
    """The tool result alone continues the first call token-in/token-out (its thinking kept: the template keeps
    reasoning after the last user query); a text block after it is a new user query, before which Qwen3's template
    drops the first turn's thinking: the second call is that re-rendering, a branch forking at the first turn."""
    execution_id, key = execution
    sdk = client(server, key)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = sdk.messages.create(model=MODEL, max_tokens=512, system="You are helpful.", tools=TOOLS, messages=messages)
    assert first.stop_reason == "tool_use" and first.role == "assistant" and first.type == "message"
    kinds = [b.type for b in first.content]
    assert kinds == ["thinking", "text", "tool_use"]
    assert first.content[0].thinking == "I need the weather." and first.content[1].text == "Checking."
    tool_use = first.content[2]
    assert tool_use.name == "get_weather" and tool_use.input == {"city": "Paris"} and tool_use.id.startswith("toolu_")
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": tool_use.id, "content": "sunny"},
                *([{"type": "text", "text": "Thanks!"}] if user_text else []),
            ],
        },  # fmt: skip
    ]
    second = sdk.messages.create(model=MODEL, max_tokens=512, system="You are helpful.", tools=TOOLS, messages=messages)
    assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["text"]
    assert second.content[0].text == FINAL

    r1, r2 = store.read(execution_id)
    assert (r1.api, r2.api, r1.cell) == ("messages", "messages", "cell0")
    assert dump(first.content) == blocks_from_record(r1) and dump(second.content) == blocks_from_record(r2)
    if user_text:  # re-rendered: the template's text, r1's prompt ids reused, r1's turn re-rendered without thinking
        assert r2.reused_prefix_len == len(r1.prompt_ids) and r2.prompt_ids[: len(r1.prompt_ids)] == r1.prompt_ids
        new_text = TOKENIZER.decode(r2.prompt_ids[r2.reused_prefix_len :])
        assert new_text.startswith("Checking.\n<tool_call>") and "<think>" not in new_text
        assert new_text.endswith(
            "</tool_response><|im_end|>\n<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n"
        )
    else:  # token-in/token-out: the second prompt starts with the first prompt + completion, verbatim
        assert r2.reused_prefix_len == len(r1.prompt_ids) + len(r1.completion_ids)
        assert r2.prompt_ids[: r2.reused_prefix_len] == r1.prompt_ids + r1.completion_ids
        new_text = TOKENIZER.decode(r2.prompt_ids[r2.reused_prefix_len :])
        assert (
            new_text
            == "\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        )
    assert TOKENIZER.decode(r1.prompt_ids).startswith("<|im_start|>system\nYou are helpful.\n\n# Tools")
    assert first.usage.input_tokens == len(r1.prompt_ids) and first.usage.output_tokens == len(r1.completion_ids)


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
    return events


def test_streaming_event_sequence_and_sdk_stream(server, store, execution) -> None:
    execution_id, key = execution
    body = {"model": MODEL, "max_tokens": 256, "stream": True, "tools": TOOLS,
            "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "thinking": {"type": "adaptive"}, "context_management": {"edits": []}, "metadata": {"user_id": "u"}}  # fmt: skip
    with httpx.stream("POST", f"{server.anthropic_base_url}/v1/messages?beta=true", json=body,
                      headers={"x-api-key": key, "anthropic-version": "2023-06-01"}, timeout=scaled(10)) as response:  # fmt: skip
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert all(n == d["type"] for n, d in events)
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert deltas == ["thinking_delta", "signature_delta", "text_delta", "input_json_delta"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    (record,) = store.read(execution_id)
    assert events[-2][1]["usage"]["output_tokens"] == len(record.completion_ids)
    assert events[0][1]["message"]["usage"]["input_tokens"] == len(record.prompt_ids)
    assert TOKENIZER.decode(record.prompt_ids).startswith("<|im_start|>system\nA\n\nB\n\n# Tools")

    with client(server, key).messages.stream(model=MODEL, max_tokens=256, tools=TOOLS,
                                             messages=[{"role": "user", "content": "again"}]) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"] and final.stop_reason == "tool_use"
    assert dump(final.content) == blocks_from_record(store.read(execution_id)[-1])


def test_claude_code_shapes_threads_and_count_tokens(server, store, execution) -> None:
    """A 'system' message inside messages, x-api-key, the session header, sub-agents told apart by structure."""
    execution_id, key = execution
    headers = {"x-api-key": key, "X-Claude-Code-Session-Id": "sess-1"}

    def call(system: str, first_user: str, extra: list[dict] | None = None) -> httpx.Response:
        body = {"model": MODEL, "max_tokens": 64, "system": system,
                "messages": [{"role": "user", "content": first_user},
                             {"role": "system", "content": [{"type": "text", "text": "# Environment"}]}, *(extra or [])]}  # fmt: skip
        return httpx.post(
            f"{server.anthropic_base_url}/v1/messages?beta=true", json=body, headers=headers, timeout=scaled(10)
        )

    assert call("main agent", "do it").status_code == 200
    assert call("sub agent", "sub task").status_code == 200
    assert call("main agent", "do it").status_code == 200  # a retry of the main agent's first call
    records = store.read(execution_id)
    assert [r.thread_id for r in records[:2]] == ["sess-1", "sess-1~" + records[1].thread_id.split("~")[1]]
    assert records[2].thread_id == "sess-1" and records[1].thread_id != "sess-1"
    text = TOKENIZER.decode(records[0].prompt_ids)
    assert (
        "<|im_start|>user\ndo it<|im_end|>\n<|im_start|>system\n# Environment<|im_end|>\n<|im_start|>assistant\n"
        in text
    )

    count = httpx.post(f"{server.anthropic_base_url}/v1/messages/count_tokens", headers=headers, timeout=scaled(10),
                       json={"model": MODEL, "system": "main agent", "messages": [{"role": "user", "content": "do it"}]})  # fmt: skip
    assert count.status_code == 200
    assert count.json()["input_tokens"] == len(
        TOKENIZER.encode(
            "<|im_start|>system\nmain agent<|im_end|>\n<|im_start|>user\ndo it<|im_end|>\n<|im_start|>assistant\n"
        )
    )
    sdk_count = client(server, key).messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "do it"}])
    assert sdk_count.input_tokens > 0
    assert server.execution_calls(execution_id) == 3  # count_tokens records nothing


def test_thread_state_is_bounded_per_execution(server, execution) -> None:
    execution_id, key = execution
    sdk = client(server, key)
    for i in range(6):
        sdk.messages.create(
            model=MODEL, max_tokens=32, system=f"agent {i}", messages=[{"role": "user", "content": "x"}]
        )
    threads = server.execution_threads(execution_id)
    assert len(threads) == 3  # max_threads_per_execution: the least recently used were forgotten


def assert_anthropic_error(response: httpx.Response, status: int, kind: str | None = None) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]
    if kind is not None:
        assert body["error"]["type"] == kind
    return body["error"]["message"]


def test_malformed_anthropic_burst_then_valid(server, backend, execution) -> None:
    execution_id, key = execution
    url = f"{server.anthropic_base_url}/v1/messages"
    headers = {"x-api-key": key, "content-type": "application/json"}
    good = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "hello"}]}
    bad: list[tuple[bytes | dict, int, str]] = [
        (b"{broken", 400, "invalid_request_error"),
        (b"[]", 400, "invalid_request_error"),
        ({**good, "max_tokens": "lots"}, 400, "invalid_request_error"),
        ({k: v for k, v in good.items() if k != "max_tokens"}, 400, "invalid_request_error"),
        ({k: v for k, v in good.items() if k != "messages"}, 400, "invalid_request_error"),
        ({**good, "messages": []}, 400, "invalid_request_error"),
        ({**good, "messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request_error"),
        (
            {**good, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "invalid_request_error",
        ),
        (
            {**good, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t"}]}]},
            400,
            "invalid_request_error",
        ),
        ({**good, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, 400, "invalid_request_error"),
        ({**good, "messages": [{"role": "user", "content": [{"text": "no type"}]}]}, 400, "invalid_request_error"),
        ({**good, "tools": [{"description": "no name"}]}, 400, "invalid_request_error"),
        ({**good, "temperature": -3}, 400, "invalid_request_error"),
        ({**good, "stop_sequences": ["x"] * 65}, 400, "invalid_request_error"),
        ({**good, "tool_choice": {"type": "tool"}}, 400, "invalid_request_error"),
        ({**good, "thinking": {"type": "sometimes"}}, 400, "invalid_request_error"),
        ({**good, "model": "claude-opus"}, 404, "not_found_error"),
        ({**good, "messages": [{"role": "user", "content": "x" * (MAX_CONTEXT + 5)}]}, 400, "invalid_request_error"),
        (
            json.dumps({**good, "messages": [{"role": "user", "content": "x" * 200_000}]}).encode(),
            413,
            "request_too_large",
        ),
    ]
    for body, status, kind in bad:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        assert_anthropic_error(httpx.post(url, content=content, headers=headers, timeout=scaled(10)), status, kind)
    assert "no tools" in assert_anthropic_error(
        httpx.post(url, json={**good, "tool_choice": {"type": "any"}}, headers=headers, timeout=scaled(10)), 400
    )
    assert_anthropic_error(
        httpx.post(url, json=good, headers={"x-api-key": "never-issued"}, timeout=scaled(10)),
        401,
        "authentication_error",
    )
    assert_anthropic_error(httpx.post(url, json=good, timeout=scaled(10)), 401, "authentication_error")
    assert_anthropic_error(
        httpx.get(f"{server.anthropic_base_url}/v1/messages/nope", headers=headers, timeout=scaled(10)), 404
    )
    with pytest.raises(anthropic.NotFoundError):
        client(server, key).messages.create(model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "x"}])

    # A client that disconnects mid-stream: its generation is cancelled (the slot is freed), nothing recorded.
    before = len(backend.cancelled)
    with httpx.stream("POST", url, json={**good, "stream": True, "messages": [{"role": "user", "content": "SLOW"}]},
                      headers=headers, timeout=scaled(10)) as response:  # fmt: skip
        first = next(response.iter_lines())
        assert first == "event: message_start"
    deadline = time.monotonic() + scaled(5)
    while len(backend.cancelled) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(backend.cancelled) == before + 1
    assert server.execution_calls(execution_id) == 0
    assert httpx.post(url, json=good, headers=headers, timeout=scaled(10)).status_code == 200
    assert server.execution_calls(execution_id) == 1
    server.close_execution(execution_id)
    assert_anthropic_error(httpx.post(url, json=good, headers=headers, timeout=scaled(10)), 409)


def test_legacy_completions_and_token_cap(server, store, backend, execution) -> None:
    execution_id, key = execution
    oai = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=scaled(10))
    out = oai.completions.create(model=MODEL, prompt="<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                                 max_tokens=10_000, logprobs=0)  # fmt: skip
    (record,) = store.read(execution_id)
    assert record.api == "completions" and record.thread_id == "main"
    assert record.prompt_ids == TOKENIZER.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert out.choices[0].text == completion_text(record) == THINK_TOOL and out.choices[0].finish_reason == "stop"
    assert out.choices[0].logprobs.token_logprobs == [-0.25] * (len(record.completion_ids) - 1)
    assert "".join(out.choices[0].logprobs.tokens) == THINK_TOOL
    by_id = {r.request_id: r for r in backend.requests}
    assert by_id[record.request_id].sampling.max_tokens == 2000  # max_tokens_cap
    # Token ids in, verbatim; streaming.
    ids = TOKENIZER.encode("<tool_response>x</tool_response>")
    chunks = list(oai.completions.create(model=MODEL, prompt=ids, max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == FINAL[:3]
    assert store.read(execution_id)[1].prompt_ids == ids and store.read(execution_id)[1].finish_reason == "length"
    bad = httpx.post(f"{server.base_url}/completions", headers={"Authorization": f"Bearer {key}"}, timeout=scaled(10),
                     json={"model": MODEL, "prompt": [10**6]})  # fmt: skip
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
    assert httpx.post(f"{server.base_url}/completions", headers={"Authorization": f"Bearer {key}"}, timeout=scaled(10),
                      json={"model": MODEL, "prompt": "x", "echo": True}).status_code == 400  # fmt: skip


def test_record_store_counts_and_streams_without_loading_everything(tmp_path) -> None:
    store = RecordStore(tmp_path)
    for i in range(3):
        store.append(
            TitoRecord("e", i, "main", f"r{i}", [1, 2], [3], [-0.1], [0], "stop", 1.0, 0, 0.0, 1.0, api="messages")
        )
    with open(store.path("e"), "a", encoding="utf-8") as f:
        f.write('{"execution_id": "e", "call_index": 3')  # a torn last line: that call never got its response
    assert store.count("e") == 3 and [r.call_index for r in store.iter("e")] == [0, 1, 2] == [
        r.call_index for r in store.read("e")
    ]
    assert store.count("missing") == 0 and list(store.iter("missing")) == []
    # Records written before api/cell existed still load.
    legacy = {k: v for k, v in json.loads(store.read("e")[0].to_json()).items() if k not in ("api", "cell")}
    assert TitoRecord.from_json(json.dumps(legacy)).api == ""
