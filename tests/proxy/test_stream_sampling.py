"""Live streaming combined with the sampling features, through a real ProxyServer over a backend that tells each
token as it is made (``conftest.StoppingBackend``), driven by the real ``openai`` and ``anthropic`` SDKs:
stop strings (no delta past the cut, the whole-token rule at the cut), a forced tool call (its text reaches the
client as the tool call), n > 1 (each choice live with its index, usage and [DONE] once), and the Responses
API's tool_choice and client_sampling."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
from timelimits import scaled

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy.sampling import TOOL_CALL_OPEN
from gyre_jax.proxy.streaming import TextStream
from gyre_jax.serving.types import GenerationRequest

TOK = ByteTokenizer()
IM_END = TOK.token_id("<|im_end|>")
MODEL = "gyre-tiny"
REACT = "Thought: look it up\nCode: print(1)\nObservation: 1\nFinal answer"
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    for name in ("get_weather", "get_time")
]  # fmt: skip


def script(request: GenerationRequest) -> str:
    prompt = TOK.decode(request.prompt_ids)
    if prompt.endswith('"arguments": '):
        return '{"city": "Paris"}}\n</tool_call>'
    if prompt.endswith(TOOL_CALL_OPEN):
        return 'get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
    if "CHOICES" in prompt:
        return f"answer {request.sampling.seed % 1000} and more text"
    if "THINKTOKEN" in prompt:
        return "Answer <think> more"  # <think> is one token: a stop string may start inside it
    return REACT


def completion_text(record) -> str:
    ids = record.completion_ids
    return TOK.decode(ids[:-1] if ids and ids[-1] == IM_END else ids)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def oai(stack, execution_id: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=stack.server.base_url, api_key=stack.key(execution_id), max_retries=0, timeout=scaled(10)
    )


def sse_data(body: str) -> list[dict]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]


# -- stop strings ------------------------------------------------------------------------------------------------------


def test_text_stream_holds_what_a_stop_string_could_still_cut() -> None:
    ids = TOK.encode("Answer <think> more")
    stream = TextStream(TOK.decode, (), stops=("hink", "zzzzzz"))
    sent = [stream.feed([i]) for i in ids]
    # never more than the text before the <think> token (the stop starts inside it), nor within 5 chars of the end
    assert "".join(sent) == "Answer "
    assert all(len("".join(sent[: k + 1])) <= max(0, len(TOK.decode(ids[: k + 1])) - 5) for k in range(len(ids)))
    assert stream.finish("Answer ") == ""


def test_streamed_chat_with_stop_sends_no_text_past_the_cut(make_stack) -> None:
    with make_stack(script) as stack:
        stream = oai(stack, "e-s").chat.completions.create(
            model=MODEL, messages=user("go"), stop=["Observation:", "Nope"], stream=True
        )
        pieces, finish = [], None
        for chunk in stream:
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        (rec,) = stack.store.read("e-s")
        assert "".join(pieces) == "Thought: look it up\nCode: print(1)\n" == completion_text(rec)
        assert len([p for p in pieces if p]) > 3 and finish == "stop"  # live: many deltas, not one closing piece


def test_streamed_completion_with_a_stop_inside_a_token_drops_the_token(make_stack) -> None:
    with make_stack(script) as stack:
        body = httpx.post(f"{stack.server.base_url}/completions", timeout=scaled(10),
                          headers={"Authorization": f"Bearer {stack.key('e-m')}"},
                          json={"model": MODEL, "prompt": "THINKTOKEN", "stop": "hink", "stream": True}).text  # fmt: skip
        texts = [c["choices"][0]["text"] for c in sse_data(body) if c["choices"]]
        (rec,) = stack.store.read("e-m")
        assert "".join(texts) == "Answer " == completion_text(rec)
        assert TOK.decode(stack.backend.results[0].token_ids).endswith("<think>")  # the loop stopped after it


def test_anthropic_stream_with_stop_sequences(make_stack) -> None:
    with make_stack(script) as stack:
        client = anthropic.Anthropic(base_url=stack.server.anthropic_base_url, api_key=stack.key("e-a"),
                                     max_retries=0)  # fmt: skip
        deltas = []
        with client.messages.stream(model=MODEL, max_tokens=64, messages=user("x"),
                                    stop_sequences=["print(1)"]) as stream:  # fmt: skip
            for event in stream:
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    deltas.append(event.delta.text)
            final = stream.get_final_message()
        (rec,) = stack.store.read("e-a")
        assert "".join(deltas) == "Thought: look it up\nCode: " == completion_text(rec) == final.content[0].text
        assert final.stop_reason == "stop_sequence" and final.stop_sequence == "print(1)"


# -- forced tool calls -------------------------------------------------------------------------------------------------


def test_streamed_forced_tool_call_reaches_the_client_as_the_call(make_stack) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    with make_stack(script) as stack:
        stream = oai(stack, "e-f").chat.completions.create(
            model=MODEL, messages=user("weather?"), tools=TOOLS, tool_choice=named, stream=True
        )
        content, calls, finish = "", [], None
        for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                calls += choice.delta.tool_calls or []
                finish = choice.finish_reason or finish
        assert content == "" and finish == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        (rec,) = stack.store.read("e-f")
        assert completion_text(rec) == '{"city": "Paris"}}\n</tool_call>' and rec.client_sampling == {
            "tool_choice": named
        }

        client = anthropic.Anthropic(base_url=stack.server.anthropic_base_url, api_key=stack.key("e-fa"),
                                     max_retries=0)  # fmt: skip
        tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
        with client.messages.stream(model=MODEL, max_tokens=64, messages=user("time?"), tools=tools,
                                    tool_choice={"type": "any"}) as stream:  # fmt: skip
            final = stream.get_final_message()
        assert final.stop_reason == "tool_use" and [(b.type, b.name, b.input) for b in final.content] == [
            ("tool_use", "get_time", {"city": "Oslo"})]  # fmt: skip


# -- n > 1 -------------------------------------------------------------------------------------------------------------


def test_n2_stream_each_choice_live_with_its_index_usage_and_done_once(make_stack) -> None:
    with make_stack(script) as stack:
        body = httpx.post(f"{stack.server.base_url}/chat/completions", timeout=scaled(10),
                          headers={"Authorization": f"Bearer {stack.key('e-n')}"},
                          json={"model": MODEL, "messages": user("CHOICES"), "n": 2, "seed": 5, "stream": True,
                                "stop": " and", "stream_options": {"include_usage": True}}).text  # fmt: skip
        chunks = sse_data(body)
        text, deltas, finish = {0: "", 1: ""}, {0: 0, 1: 0}, {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content") or ""
                text[choice["index"]] += piece
                deltas[choice["index"]] += bool(piece)
                if choice["finish_reason"]:
                    finish[choice["index"]] = choice["finish_reason"]
        assert text == {0: "answer 5", 1: "answer 6"} and finish == {0: "stop", 1: "stop"}
        assert min(deltas.values()) > 1  # each choice streamed in pieces
        records = stack.store.read("e-n")
        assert [completion_text(r) for r in records] == ["answer 5", "answer 6"]
        usages = [c["usage"] for c in chunks if c.get("usage")]
        assert len(usages) == 1 and usages[0]["completion_tokens"] == sum(
            len(r.token_ids) for r in stack.backend.results
        )
        assert body.count("data: [DONE]") == 1 and body.rstrip().endswith("data: [DONE]")


# -- Responses: tool_choice and client_sampling --------------------------------------------------------------------------


def test_responses_tool_choice_and_client_sampling(make_stack) -> None:
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]  # fmt: skip
    with make_stack(script) as stack:
        client = oai(stack, "e-r")
        named = client.responses.create(model=MODEL, input="weather?", tools=tools, temperature=0.5,
                                        tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
        assert [(i.type, i.name, json.loads(i.arguments)) for i in named.output] == [
            ("function_call", "get_weather", {"city": "Paris"})]  # fmt: skip
        with client.responses.stream(model=MODEL, input="time?", tools=tools, tool_choice="required",
                                     parallel_tool_calls=True) as stream:  # fmt: skip
            final = stream.get_final_response()
        assert [(i.type, i.name) for i in final.output] == [("function_call", "get_time")]
        auto = client.responses.create(model=MODEL, input="hi", tools=tools, tool_choice="auto")
        assert auto.output[0].type == "message"
        records = stack.store.read("e-r")
        assert [r.client_sampling for r in records] == [
            {"temperature": 0.5, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            {"tool_choice": "required"}, {"tool_choice": "auto"}]  # fmt: skip
        assert records[0].temperature == 0.5
        assert TOK.decode(records[1].prompt_ids).endswith("assistant\n" + TOOL_CALL_OPEN)
