"""Live token streaming through the proxy, on all three APIs, with the real ``openai`` and ``anthropic`` SDKs.

The backend streams its scripted completion token by token through the request's listener and then stops
half way, until the test opens a gate; the test opens it only once the client has received a content delta.
So a proxy that held the text back until the end would never get there (the client times out): each test
passes only if deltas leave while the generation is still running. Texts hold multi-byte characters split
across byte tokens, a ``<think>`` block and a tool call, and each stream must add up to the non-streamed
reply and to the record's decoded tokens.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator

import anthropic
import openai
import pytest
from timelimits import scaled

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.serving.types import GenerationRequest, GenerationResult, TokenChunk

TOKENIZER = ByteTokenizer()
IM_END = TOKENIZER.token_id("<|im_end|>")
MODEL = "gyre-tiny"
THOUGHT_TEXT = "<think>\nPlanning: é → 😀.\n</think>\n\n"
ANSWER_TEXT = "Héllo wörld 😀, the answer is 42.\n"
CALL_TEXT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


def script(prompt: str) -> str:
    if "TOOL" in prompt:
        return THOUGHT_TEXT + CALL_TEXT
    if "THINK" in prompt:
        return THOUGHT_TEXT + ANSWER_TEXT
    return ANSWER_TEXT


class GatedBackend:
    """Streams ``script(prompt)`` + <|im_end|> one token per listener call; a streamed request stops after
    ``HALF`` of its tokens until ``gate`` is set. Requests without a listener complete at once."""

    HALF = 12

    def __init__(self) -> None:
        self.max_context = 4096
        self.gate = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        return self._pool.submit(self._run, request)

    def cancel(self, request_id: str) -> None:
        pass

    def _run(self, request: GenerationRequest) -> GenerationResult:
        ids = TOKENIZER.encode(script(TOKENIZER.decode(request.prompt_ids))) + [IM_END]
        for k, token in enumerate(ids):
            if request.on_tokens is None:
                break
            if k == self.HALF and not self.gate.wait(scaled(30)):
                raise RuntimeError("the client never saw a delta: the proxy did not stream")
            request.on_tokens(TokenChunk(request.request_id, k, (token,), (-0.25,), (5,)))
        n = len(ids)
        return GenerationResult(request.request_id, ids, [-0.25] * n, [5] * n, "stop", len(request.prompt_ids))

    def shutdown(self) -> None:
        self.gate.set()
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def backend() -> Iterator[GatedBackend]:
    fake = GatedBackend()
    yield fake
    fake.shutdown()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> RecordStore:
    return RecordStore(tmp_path_factory.mktemp("records"))


@pytest.fixture(scope="module")
def server(backend: GatedBackend, store: RecordStore) -> Iterator[ProxyServer]:
    with ProxyServer(backend, TOKENIZER, store, model_name=MODEL) as proxy:
        yield proxy


_counter = iter(range(10**6))


@pytest.fixture()
def execution(server: ProxyServer, backend: GatedBackend) -> tuple[str, str]:
    backend.gate.clear()
    execution_id = f"exec-{next(_counter)}"
    return execution_id, server.open_execution(execution_id)


def record_text(store: RecordStore, execution_id: str) -> str:
    record = store.read(execution_id)[-1]
    ids = record.completion_ids
    assert ids[-1] == IM_END and record.completion_logprobs == [-0.25] * len(ids)
    return TOKENIZER.decode(ids[:-1])


@pytest.mark.parametrize("ask", ["plain", "THINK", "TOOL"])
def test_chat_streams_live_and_adds_up(server, store, backend, execution, ask) -> None:
    execution_id, key = execution
    client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=scaled(20.0))
    messages = [{"role": "user", "content": f"{ask} please"}]
    reasoning, content, calls, finish, usage, before_gate = "", "", {}, None, None, 0
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=True,
                                                stream_options={"include_usage": True}):  # fmt: skip
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        piece = (getattr(delta, "reasoning_content", None) or "") + (delta.content or "")
        assert "\ufffd" not in piece
        if piece and not backend.gate.is_set():
            before_gate += 1
            backend.gate.set()  # a delta arrived while the generation was still running
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls[call.index] = (call.function.name, call.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert before_gate == 1
    full = record_text(store, execution_id)  # fsynced before the stream's last event
    want = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS).choices[0]
    assert content == (want.message.content or "") and reasoning == (
        getattr(want.message, "reasoning_content", None) or ""
    )
    assert finish == want.finish_reason and usage.completion_tokens == len(TOKENIZER.encode(full)) + 1
    if ask == "TOOL":
        assert (reasoning, content) == ("Planning: é → 😀.", "Checking.") and finish == "tool_calls"
        assert calls == {0: ("get_weather", '{"city": "Zürich"}')}
    elif ask == "THINK":
        assert (reasoning, content) == ("Planning: é → 😀.", ANSWER_TEXT) and not calls
    else:
        assert (reasoning, content) == ("", full) == ("", ANSWER_TEXT)


def test_completions_stream_live_and_add_up(server, store, backend, execution) -> None:
    execution_id, key = execution
    client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=scaled(20.0))
    text, pieces = "", 0
    for chunk in client.completions.create(model=MODEL, prompt="THINK about it", stream=True, max_tokens=500):
        piece = chunk.choices[0].text if chunk.choices else ""
        assert "\ufffd" not in piece
        if piece and not backend.gate.is_set():
            backend.gate.set()
        text += piece
        pieces += bool(piece)
    assert text == THOUGHT_TEXT + ANSWER_TEXT == record_text(store, execution_id) and pieces > 2
    assert client.completions.create(model=MODEL, prompt="THINK about it").choices[0].text == text


@pytest.mark.parametrize("ask", ["THINK", "TOOL"])
def test_messages_stream_live_and_add_up(server, store, backend, execution, ask) -> None:
    execution_id, key = execution
    client = anthropic.Anthropic(base_url=server.anthropic_base_url, api_key=key, max_retries=0, timeout=scaled(20.0))
    tools = [{"name": "get_weather", "description": "Weather.", "input_schema": {"type": "object"}}]
    kwargs = dict(model=MODEL, max_tokens=500, tools=tools, messages=[{"role": "user", "content": f"{ask} now"}])
    thinking, text = "", ""
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type in ("text_delta", "thinking_delta"):
                piece = getattr(event.delta, "text", None) or getattr(event.delta, "thinking", "")
                assert "\ufffd" not in piece
                backend.gate.set()
                thinking += getattr(event.delta, "thinking", "")
                text += getattr(event.delta, "text", "")
        final = stream.get_final_message()
    assert record_text(store, execution_id) == script(ask)
    plain = client.messages.create(**kwargs)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in plain.content] or ask == "TOOL"
    assert [b.type for b in final.content] == [b.type for b in plain.content]
    assert thinking == "Planning: é → 😀." and final.stop_reason == plain.stop_reason
    if ask == "TOOL":
        assert text == "Checking." and final.content[-1].input == {"city": "Zürich"} and final.stop_reason == "tool_use"
    else:
        assert text == ANSWER_TEXT and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(store.read(execution_id)[-1].completion_ids)


def test_keepalives_flow_while_nothing_decodes(server, store, backend, execution, monkeypatch) -> None:
    """After the first deltas the backend stalls (gate closed): keep-alive comments go out meanwhile, and the
    stream then completes normally once decoding resumes."""
    import httpx

    from gyre_jax.proxy import waiting

    monkeypatch.setattr(waiting, "KEEPALIVE_S", 0.05)
    execution_id, key = execution
    body = {"model": MODEL, "messages": [{"role": "user", "content": "plain"}], "stream": True}
    seen_text, keepalives_after_text, lines = False, 0, []
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=scaled(20)) as reply:  # fmt: skip
        for line in reply.iter_lines():
            lines.append(line)
            seen_text = seen_text or '"content":"H' in line
            if seen_text and line.startswith(": keep-alive"):
                keepalives_after_text += 1
                backend.gate.set()  # only a keep-alive sent while the backend stalls gets here
    assert keepalives_after_text >= 1 and [line for line in lines if line][-1] == "data: [DONE]"
    assert record_text(store, execution_id) == ANSWER_TEXT
