"""The real ``openai`` and ``anthropic`` SDKs, streaming and not, with tools, against the tiny model served by
the real engine through the proxy: every call is recorded with the exact ids the client was served."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import numpy as np
import openai
from timelimits import scaled

from gyre_jax.proxy import turns
from gyre_jax.proxy.adapters import anthropic_messages as anthropic_api

TOOLS_OPENAI = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                 "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]  # fmt: skip
TOOLS_ANTHROPIC = [{"name": "read_file", "description": "Read a file.",
                    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]  # fmt: skip


def check_record(stack, record, max_tokens: int) -> None:
    n = len(record.completion_ids)
    assert 1 <= n <= max_tokens and len(record.completion_logprobs) == n and record.policy_versions == [0] * n
    assert all(np.isfinite(record.completion_logprobs)) and max(record.completion_logprobs) <= 0
    assert record.cell == "cell0" and record.temperature == 1.0


def test_openai_sdk_plain_and_streaming_with_tools(stack) -> None:
    key = stack.proxy.open_execution("sdk-openai")
    client = openai.OpenAI(base_url=stack.proxy.base_url, api_key=key, max_retries=0, timeout=scaled(120))
    messages = [{"role": "system", "content": "Solve the task."}, {"role": "user", "content": "Read input.txt."}]
    first = client.chat.completions.create(model="gyre-tiny", messages=messages, tools=TOOLS_OPENAI, max_tokens=12,
                                           logprobs=True)  # fmt: skip
    message = first.choices[0].message
    messages.append(
        turns.returned_message(stack.parsed(stack.records.read("sdk-openai")[0])) | {"content": message.content}
    )
    messages.append({"role": "user", "content": "Go on."})
    content, finish = "", None
    for chunk in client.chat.completions.create(model="gyre-tiny", messages=messages, tools=TOOLS_OPENAI, max_tokens=12,
                                                stream=True):  # fmt: skip
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    r1, r2 = stack.records.read("sdk-openai")
    for record in (r1, r2):
        check_record(stack, record, 12)
    # What each client received is exactly what the recorded ids decode and parse to.
    assert (message.content or "") == stack.parsed(r1).content and content == stack.parsed(r2).content
    assert [e.logprob for e in first.choices[0].logprobs.content] == r1.completion_logprobs[
        : len(first.choices[0].logprobs.content)
    ]
    assert first.usage.prompt_tokens == len(r1.prompt_ids) and r1.api == "chat"
    # The second call reuses the first call's prompt and completion ids verbatim (token-in/token-out).
    assert r2.reused_prefix_len >= len(r1.prompt_ids) + len(r1.completion_ids)
    assert r2.prompt_ids[: len(r1.prompt_ids) + len(r1.completion_ids)] == r1.prompt_ids + r1.completion_ids
    assert stack.tokenizer.decode(r1.prompt_ids).startswith(
        "<|im_start|>system\nSolve the task.\n\n# Tools\n<tools>\nread_file(path: string)"
    )
    stack.proxy.close_execution("sdk-openai")


def test_anthropic_sdk_plain_and_streaming_with_tools(stack) -> None:
    key = stack.proxy.open_execution("sdk-anthropic")
    client = anthropic.Anthropic(
        base_url=stack.proxy.anthropic_base_url, api_key=key, max_retries=0, timeout=scaled(120)
    )
    messages = [{"role": "user", "content": "Read input.txt."}]
    first = client.messages.create(model="gyre-tiny", max_tokens=12, system="Solve the task.", tools=TOOLS_ANTHROPIC,
                                   messages=messages)  # fmt: skip
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": "Go on."}]  # fmt: skip
    with client.messages.stream(model="gyre-tiny", max_tokens=12, system="Solve the task.", tools=TOOLS_ANTHROPIC,
                                messages=messages) as stream:  # fmt: skip
        second = stream.get_final_message()
    r1, r2 = stack.records.read("sdk-anthropic")
    for record, reply in ((r1, first), (r2, second)):
        check_record(stack, record, 12)
        expected = anthropic_api.content_blocks(stack.parsed(record))
        got = [b.model_dump(exclude_none=True) for b in reply.content]
        for block in expected + got:
            block.pop("id", None)
            block.pop("citations", None)
        assert got == expected
        assert reply.usage.input_tokens == len(record.prompt_ids) and reply.usage.output_tokens == len(
            record.completion_ids
        )
        assert (
            reply.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[record.finish_reason]
            or reply.stop_reason == "tool_use"
        )
    assert r2.prompt_ids[: len(r1.prompt_ids) + len(r1.completion_ids)] == r1.prompt_ids + r1.completion_ids
    # Sampling is seeded per (server seed, execution, call): the same call again gives the same tokens.
    key2 = stack.proxy.open_execution("sdk-anthropic-again")
    again = anthropic.Anthropic(
        base_url=stack.proxy.anthropic_base_url, api_key=key2, max_retries=0, timeout=scaled(120)
    )
    body = {"model": "gyre-tiny", "max_tokens": 12, "system": "Solve the task.", "tools": TOOLS_ANTHROPIC,
            "messages": [{"role": "user", "content": "Read input.txt."}]}  # fmt: skip
    again.messages.create(**body)
    (r_again,) = stack.records.read("sdk-anthropic-again")
    assert r_again.prompt_ids == r1.prompt_ids


def test_drained_cell_request_is_retried_transparently(stack) -> None:
    """A request cancelled by its cell being drained mid-generation is re-run; the client sees one answer."""
    key = stack.proxy.open_execution("sdk-drain")
    router = stack.router
    results: dict[str, httpx.Response] = {}

    def call() -> None:
        results["r"] = httpx.post(f"{stack.proxy.base_url}/chat/completions", timeout=scaled(120),
                                  headers={"Authorization": f"Bearer {key}"},
                                  json={"model": "gyre-tiny", "max_tokens": 24,
                                        "messages": [{"role": "user", "content": "x " * 3000}]})  # fmt: skip

    thread = threading.Thread(target=call)
    thread.start()

    deadline = time.monotonic() + scaled(60)
    while router.in_flight("cell0") == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    retries = router.retries
    router.drain("cell0", cancel_in_flight=True)  # the only cell: the request waits, parked
    time.sleep(0.2)
    router.undrain("cell0")
    thread.join(scaled(120))
    assert results["r"].status_code == 200, results["r"].text
    (record,) = stack.records.read("sdk-drain")
    assert record.finish_reason in ("stop", "length") and router.retries == retries + 1
    assert results["r"].json()["choices"][0]["message"]["content"] == stack.parsed(record).content
    stack.proxy.close_execution("sdk-drain")


def test_bad_input_burst_against_the_real_engine_then_valid(stack) -> None:
    """Malformed requests of both APIs get 4xx error bodies; a client gone mid-stream frees its decode slot."""
    key = stack.proxy.open_execution("sdk-burst")
    oai, anth = f"{stack.proxy.base_url}/chat/completions", f"{stack.proxy.anthropic_base_url}/v1/messages"
    auth = {"Authorization": f"Bearer {key}"}
    good_oai = {"model": "gyre-tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    good_anth = {"model": "gyre-tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    huge = "word " * 20000  # about 20K tokens: over the 16K context
    for url, body, status in [
        (oai, b"{oops", 400), (anth, b"{oops", 400), (oai, {**good_oai, "temperature": "warm"}, 400),
        (anth, {**good_anth, "max_tokens": None}, 400), (oai, {**good_oai, "model": "gpt-5"}, 404),
        (anth, {**good_anth, "model": "claude-x"}, 404), (oai, {"model": "gyre-tiny"}, 400), (anth, {"model": "gyre-tiny"}, 400),
        (oai, {**good_oai, "messages": [{"role": "user", "content": huge}]}, 400),
        (anth, {**good_anth, "messages": [{"role": "user", "content": huge}]}, 400),
        (anth, {**good_anth, "messages": [{"role": "user", "content": "x" * (2 * 1024 * 1024)}]}, 413),
    ]:  # fmt: skip
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = httpx.post(
            url, content=content, headers={**auth, "content-type": "application/json"}, timeout=scaled(60)
        )
        assert response.status_code == status, (url, response.text)
        error = response.json()
        assert (error["type"] == "error" and error["error"]["message"]) if url == anth else error["error"]["message"]
    with httpx.stream("POST", anth, json={**good_anth, "max_tokens": 24, "stream": True,
                                          "messages": [{"role": "user", "content": "x " * 1500}]},
                      headers=auth, timeout=scaled(60)) as response:  # fmt: skip
        assert next(response.iter_lines()) == "event: message_start"
    deadline = time.monotonic() + scaled(60)
    while stack.loop.num_in_flight() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stack.loop.num_in_flight() == 0 and stack.router.in_flight("cell0") == 0
    assert stack.proxy.execution_calls("sdk-burst") == 0
    assert httpx.post(oai, json=good_oai, headers=auth, timeout=scaled(60)).status_code == 200
    assert httpx.post(anth, json=good_anth, headers=auth, timeout=scaled(60)).status_code == 200
    assert stack.proxy.execution_calls("sdk-burst") == 2


def test_stop_strings_choices_and_forced_tool_calls_on_the_real_engine(stack) -> None:
    """Stop strings run in the real serving loop (built with ``detokenize``): each record decodes to exactly the
    returned text; n choices and a forced tool call are recorded as served."""
    key = stack.proxy.open_execution("sdk-sampling")
    client = openai.OpenAI(base_url=stack.proxy.base_url, api_key=key, max_retries=0, timeout=scaled(120))
    stops, cuts = [" ", "e", "a", "\n"], 0
    for seed in range(6):
        prompt = "<|im_start|>user\nRead input.txt.<|im_end|>\n<|im_start|>assistant\n"  # what it was trained on
        out = client.completions.create(model="gyre-tiny", prompt=prompt, stop=stops, seed=seed)
        record = stack.records.read("sdk-sampling")[-1]
        ids = record.completion_ids
        ids = ids[:-1] if ids and ids[-1] in stack.tokenizer.eos_ids else ids
        assert stack.tokenizer.decode(ids) == out.choices[0].text and not any(s in out.choices[0].text for s in stops)
        cuts += out.choices[0].finish_reason == "stop" and ids == record.completion_ids  # ended by a stop string
    assert cuts >= 1
    named = {"type": "function", "function": {"name": "read_file"}}
    messages = [{"role": "user", "content": "Read input.txt."}]
    out = client.chat.completions.create(model="gyre-tiny", messages=messages, tools=TOOLS_OPENAI, tool_choice=named,
                                         n=2, seed=1)  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1]
    records = stack.records.read("sdk-sampling")[-2:]
    forced = '<tool_call>\n{"name": "read_file", "arguments": '
    for record in records:
        check_record(stack, record, 24)
        assert stack.tokenizer.decode(record.prompt_ids).endswith("<|im_start|>assistant\n" + forced)
        assert record.client_sampling == {"seed": 1, "n": 2, "tool_choice": named}
    stack.proxy.close_execution("sdk-sampling")


def test_streamed_stop_strings_choices_and_forced_tool_calls_on_the_real_engine(stack) -> None:
    """Live streams (the serving loop's token listener) with stop strings, n = 2 and a forced tool call: what each
    client accumulated from the deltas is exactly what its record decodes to (BPE tokens: the whole-token rule
    at a stop string's cut), each choice streams with its index, usage and [DONE] come once."""
    key = stack.proxy.open_execution("sdk-stream-sampling")
    client = openai.OpenAI(base_url=stack.proxy.base_url, api_key=key, max_retries=0, timeout=scaled(120))
    stops, cuts = [" ", "e", "a", "\n"], 0
    prompt = "<|im_start|>user\nRead input.txt.<|im_end|>\n<|im_start|>assistant\n"
    for seed in range(6):
        text, finish = "", None
        for chunk in client.completions.create(model="gyre-tiny", prompt=prompt, stop=stops, seed=seed, stream=True):
            text += chunk.choices[0].text if chunk.choices else ""
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        record = stack.records.read("sdk-stream-sampling")[-1]
        assert stack.completion_text(record) == text and not any(s in text for s in stops)
        cuts += finish == "stop" and record.completion_ids[-1:] != [stack.tokenizer.eos_ids[0]]
    assert cuts >= 1

    anthropic_client = anthropic.Anthropic(base_url=stack.proxy.anthropic_base_url, api_key=key, max_retries=0)
    with anthropic_client.messages.stream(model="gyre-tiny", max_tokens=24, stop_sequences=["e", " "],
                                          messages=[{"role": "user", "content": "Read input.txt."}]) as stream:  # fmt: skip
        deltas = [e.delta.text for e in stream if e.type == "content_block_delta" and e.delta.type == "text_delta"]
        final = stream.get_final_message()
    record = stack.records.read("sdk-stream-sampling")[-1]
    assert "".join(deltas) == stack.parsed(record).content == "".join(b.text for b in final.content if b.type == "text")

    named = {"type": "function", "function": {"name": "read_file"}}
    body = {"model": "gyre-tiny", "messages": [{"role": "user", "content": "Read input.txt."}], "tools": TOOLS_OPENAI,
            "tool_choice": named, "n": 2, "seed": 3, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    reply = httpx.post(f"{stack.proxy.base_url}/chat/completions", json=body, timeout=scaled(120),
                       headers={"Authorization": f"Bearer {key}"}).text  # fmt: skip
    chunks = [json.loads(line[6:]) for line in reply.splitlines() if line.startswith("data: {")]
    content, arguments = {0: "", 1: ""}, {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            content[choice["index"]] += choice["delta"].get("content") or ""
            for call in choice["delta"].get("tool_calls") or []:
                assert call["function"]["name"] == "read_file"
                arguments[choice["index"]] += call["function"]["arguments"]
    forced = '<tool_call>\n{"name": "read_file", "arguments": '
    for index, record in enumerate(stack.records.read("sdk-stream-sampling")[-2:]):
        served = turns.parse_forced(forced + stack.completion_text(record), True)
        assert content[index] == served.content
        assert arguments[index] == "".join(c["function"]["arguments"] for c in served.tool_calls)
    assert len([c for c in chunks if c.get("usage")]) == 1 and reply.count("data: [DONE]") == 1
    stack.proxy.close_execution("sdk-stream-sampling")
