"""OpenAI Responses API (``POST /v1/responses``) through the real ``openai`` SDK, streaming and not.

The backend streams a scripted completion token by token (a ``<think>`` block, then a tool call until a tool
response is in the prompt, then an answer). Checks: output items and usage, the SSE event sequence with
consecutive sequence numbers, a function_call_output round trip whose continuing call reuses the previous
prompt + completion ids verbatim, records that decode to exactly what the client saw, a Codex-shaped body,
and 4xx answers after which the server keeps serving.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from timelimits import scaled

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy.records import RecordStore, TitoRecord
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.serving.types import GenerationRequest, GenerationResult, TokenChunk

TOKENIZER = ByteTokenizer()
IM_END = TOKENIZER.token_id("<|im_end|>")
MODEL = "gyre-tiny"
THOUGHT = "I should look it up — ☀?"
CALL = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny in Paris ☀."
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]  # fmt: skip


def script(prompt: str) -> str:
    body = ANSWER if "<tool_response>" in prompt else CALL
    return f"<think>\n{THOUGHT}\n</think>\n\n{body}"


class StreamingBackend:
    """Completes ``script(prompt)`` + <|im_end|>, telling each token to the request's listener as it goes."""

    def __init__(self) -> None:
        self.max_context = 65536  # a real Codex request is about 25K byte tokens
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4)

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        return self._pool.submit(self._run, request)

    def cancel(self, request_id: str) -> None:
        pass

    def _run(self, request: GenerationRequest) -> GenerationResult:
        if "EXPLODE" in TOKENIZER.decode(request.prompt_ids):
            raise RuntimeError("scripted backend failure")
        ids = (TOKENIZER.encode(script(TOKENIZER.decode(request.prompt_ids))) + [IM_END])[: request.sampling.max_tokens]
        for k, token in enumerate(ids):
            if request.on_tokens is not None:
                request.on_tokens(TokenChunk(request.request_id, k, (token,), (-0.5,), (2,)))
        finish = "stop" if ids[-1] == IM_END else "length"
        n = len(ids)
        return GenerationResult(request.request_id, ids, [-0.5] * n, [2] * n, finish, len(request.prompt_ids))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> RecordStore:
    return RecordStore(tmp_path_factory.mktemp("records"))


@pytest.fixture(scope="module")
def server(store: RecordStore) -> Iterator[ProxyServer]:
    backend = StreamingBackend()
    with ProxyServer(backend, TOKENIZER, store, model_name=MODEL) as proxy:
        yield proxy
    backend._pool.shutdown()


_counter = iter(range(10**6))


@pytest.fixture()
def execution(server: ProxyServer) -> tuple[str, str]:
    execution_id = f"exec-{next(_counter)}"
    return execution_id, server.open_execution(execution_id)


def sdk(server: ProxyServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=scaled(20.0))


def decoded(record: TitoRecord) -> str:
    ids = record.completion_ids
    return TOKENIZER.decode(ids[:-1] if ids and ids[-1] == IM_END else ids)


def seen_text(output: list) -> str:
    """What a client saw of a response's output, re-assembled as the model's text."""
    text = ""
    for item in output:
        if item.type == "reasoning":
            text += f"<think>\n{item.content[0].text}\n</think>\n\n"
        elif item.type == "message":
            text += item.content[0].text
        else:
            text += f'\n<tool_call>\n{{"name": "{item.name}", "arguments": {item.arguments}}}\n</tool_call>'
    return text


def first_input() -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}]


def test_function_call_round_trip_reuses_the_previous_ids(server, store, execution) -> None:
    execution_id, key = execution
    client = sdk(server, key)
    first = client.responses.create(model=MODEL, instructions="You are a weather agent.", input=first_input(),
                                    tools=TOOLS, store=False)  # fmt: skip
    assert first.id.startswith("resp_") and first.status == "completed" and first.object == "response"
    assert [item.type for item in first.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = first.output
    assert reasoning.content[0].text == THOUGHT and message.content[0].text == "Let me check."
    assert (call.name, json.loads(call.arguments), call.status) == ("get_weather", {"city": "Paris"}, "completed")
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    (record,) = store.read(execution_id)
    assert record.api == "responses" and seen_text(first.output) == decoded(record)
    assert first.usage.input_tokens == len(record.prompt_ids) and first.usage.output_tokens == len(
        record.completion_ids
    )
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens

    history = first_input() + [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"})
    second = client.responses.create(model=MODEL, instructions="You are a weather agent.", input=history,
                                     tools=TOOLS, store=False)  # fmt: skip
    assert second.output_text == ANSWER and [item.type for item in second.output] == ["reasoning", "message"]
    first_record, second_record = store.read(execution_id)
    reused = first_record.prompt_ids + first_record.completion_ids
    assert second_record.reused_prefix_len == len(reused) > 0
    assert second_record.prompt_ids[: len(reused)] == reused
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in TOKENIZER.decode(second_record.prompt_ids)
    assert seen_text(second.output) == decoded(second_record)


def test_streamed_event_sequence_adds_up_to_the_response(server, store, execution) -> None:
    execution_id, key = execution
    client = sdk(server, key)
    events = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_kinds = [(e.type, e.item.type) for e in events if e.type.startswith("response.output_item")]
    assert item_kinds == [("response.output_item.added", "reasoning"), ("response.output_item.done", "reasoning"),
                          ("response.output_item.added", "message"), ("response.output_item.done", "message"),
                          ("response.output_item.added", "function_call"),
                          ("response.output_item.done", "function_call")]  # fmt: skip
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert sum(e.type == "response.output_text.delta" for e in events) > 3  # live, token by token
    assert (thought, text) == (THOUGHT, "Let me check.")
    (text_done,) = [e for e in events if e.type == "response.output_text.done"]
    (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert text_done.text == text and json.loads(args_done.arguments) == {"city": "Paris"}
    final = events[-1].response
    assert final.status == "completed" and final.usage.output_tokens == len(store.read(execution_id)[0].completion_ids)
    done_items = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.model_dump() for i in final.output] == [i.model_dump() for i in done_items]
    assert seen_text(final.output) == decoded(store.read(execution_id)[0])

    with client.responses.stream(model=MODEL, input="again", tools=TOOLS) as stream:
        helper_final = stream.get_final_response()
    assert [i.type for i in helper_final.output] == ["reasoning", "message", "function_call"]


def test_budget_end_is_incomplete(server, execution) -> None:
    _, key = execution
    response = sdk(server, key).responses.create(model=MODEL, input="Weather?", max_output_tokens=5)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5


def codex_body(stream: bool = True) -> dict:
    """The fields Codex CLI sends (``codex exec`` with a custom provider, wire_api = "responses")."""
    return {
        "model": MODEL, "instructions": "You are Codex, a coding agent.", "stream": stream, "store": False,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Look it up."}],
             "content": None, "encrypted_content": None},
            {"type": "function_call", "name": "get_weather", "arguments": '{"city":"Paris"}', "call_id": "call_1"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        "tools": TOOLS + [{"type": "local_shell"}, {"type": "web_search"},
                          {"type": "custom", "name": "apply_patch", "description": "Patch.",
                           "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}],
        "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0199-session", "text": {"verbosity": "low"},
    }  # fmt: skip


def test_codex_shaped_request_is_served(server, store, execution) -> None:
    execution_id, key = execution
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST", f"{server.base_url}/responses", json=codex_body(), headers=headers, timeout=scaled(20)
    ) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    payloads = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [p["type"] for p in payloads] and names[-1] == "response.completed"
    assert payloads[-1]["response"]["output"][-1]["content"][0]["text"] == ANSWER
    (record,) = store.read(execution_id)
    prompt = TOKENIZER.decode(record.prompt_ids)
    assert prompt.startswith("<|im_start|>system\nYou are Codex, a coding agent.")
    assert "local_shell" not in prompt and "apply_patch" not in prompt and "get_weather" in prompt
    # the reasoning item is the assistant turn's reasoning_content (rendered: it follows the last user query)
    assert "<tool_response>\nsunny\n</tool_response>" in prompt and "<think>\nLook it up.\n</think>" in prompt
    plain = httpx.post(
        f"{server.base_url}/responses", json=codex_body(stream=False), headers=headers, timeout=scaled(20)
    )
    assert plain.status_code == 200 and plain.json()["output"][-1]["content"][0]["text"] == ANSWER


def test_a_real_codex_cli_request_is_served(server, store, execution) -> None:
    """The first request of ``codex exec "say hi"`` (Codex CLI 0.171.0, custom provider with wire_api = "responses",
    captured against a logging server): developer messages, function tools next to a ``namespace`` and a
    ``web_search`` tool (ignored), ``client_metadata``, ``include``, ``store: false``, ``stream: true``."""
    execution_id, key = execution
    body = json.loads(
        (Path(__file__).resolve().parents[1] / "fixtures" / "codex_0.171.0_responses_request.json").read_text()
    )
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{server.base_url}/responses", json=body, headers=headers, timeout=scaled(30)) as reply:
        assert reply.status_code == 200, reply.read()
        payloads = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
    assert payloads[-1]["type"] == "response.completed" and payloads[-1]["response"]["status"] == "completed"
    (record,) = store.read(execution_id)
    prompt = TOKENIZER.decode(record.prompt_ids)
    assert prompt.startswith("<|im_start|>system\n") and '"name": "exec_command"' in prompt
    assert "multi_agent_v1" not in prompt and "external_web_access" not in prompt
    assert prompt.endswith("<|im_start|>user\nsay hi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("change", "status", "says"),
    [
        ({"input": [{"type": "image_generation_call", "id": "x"}]}, 400, "not supported yet: 'image_generation_call'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "'input_image'"),
        ({"input": [{"type": "function_call", "name": "f"}]}, 400, "'call_id'"),
        ({"model": "gpt-5"}, 404, "does not exist"),
        ({"previous_response_id": "resp_1"}, 400, "send the whole history (store=false)"),
        ({"tool_choice": {"type": "file_search"}}, 400, "not supported yet: tool_choice"),
        ({"tool_choice": "required"}, 400, "requires a tool call but the request has no tools"),
        ({"tool_choice": {"type": "function", "name": "nope"}}, 400, "not among the tools"),
        ({"input": 3}, 400, "input"),
    ],
)
def test_bad_requests_get_openai_4xx_and_the_server_keeps_serving(server, execution, change, status, says) -> None:
    _, key = execution
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "input": "hi", **change}
    for stream in (False, True):
        reply = httpx.post(
            f"{server.base_url}/responses", json={**body, "stream": stream}, headers=headers, timeout=scaled(20)
        )
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and says in error["message"]
    assert sdk(server, key).responses.create(model=MODEL, input="Weather?").status == "completed"


def test_failure_after_the_stream_started_is_an_error_and_response_failed(server, execution) -> None:
    _, key = execution
    client = sdk(server, key)
    events = list(client.responses.create(model=MODEL, input="EXPLODE", stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert events[-1].response.status == "failed" and events[2].message == events[-1].response.error.message
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "input": "EXPLODE", "stream": True}
    reply = httpx.post(f"{server.base_url}/responses", json=body, headers=headers, timeout=scaled(20))
    payloads = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
    assert [p["type"] for p in payloads][-2:] == ["error", "response.failed"]
    assert payloads[-1]["response"]["status"] == "failed" and payloads[-1]["response"]["error"]["message"]
    assert client.responses.create(model=MODEL, input="Weather?").status == "completed"
