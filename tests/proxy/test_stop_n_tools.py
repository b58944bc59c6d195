"""Stop strings, n > 1 and tool_choice through a real ProxyServer, driven by the real ``openai`` and ``anthropic``
SDKs: what the client sees, what is recorded (the record decodes to exactly the returned text; forced tokens are
prompt, never completion) and how the next call reuses the previous ids."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from timelimits import scaled

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy import chat_template, tito
from gyre_jax.proxy.sampling import TOOL_CALL_OPEN
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


def prompt_text(request: GenerationRequest) -> str:
    return TOK.decode(request.prompt_ids)


def script(request: GenerationRequest) -> str:
    """The completion for a prompt: tool arguments after a forced opener, a per-seed answer for choices."""
    prompt = prompt_text(request)
    if prompt.endswith('"arguments": '):
        return '{"city": "Paris"}}\n</tool_call>'
    if prompt.endswith(TOOL_CALL_OPEN):
        return 'get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
    if "CHOICES" in prompt:
        return f"answer {request.sampling.seed % 1000}"
    if "MIDTOKEN" in prompt:
        return 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    return REACT


def completion_text(record) -> str:
    ids = record.completion_ids
    return TOK.decode(ids[:-1] if ids and ids[-1] == IM_END else ids)


def user(text: str) -> list[dict]:
    return [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": text}]


def oai(stack, execution_id: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=stack.server.base_url, api_key=stack.key(execution_id), max_retries=0, timeout=scaled(10)
    )


# -- stop strings ------------------------------------------------------------------------------------------------------


def test_chat_stop_cuts_the_text_and_the_record_and_the_next_call_reuses_it(make_stack) -> None:
    with make_stack(script) as stack:
        messages = user("solve it")
        content = "Thought: look it up\nCode: print(1)\n"
        # the client re-sends the text as returned (reuse: + the <|im_end|> the cut turn lacked); smolagents re-sends
        # it with the stop string (and more) appended; another strips it and appends (reuse: as far as it agrees)
        cases = [("e-plain", content, 1), ("e-appended", content + "Observation: 1", 0),
                 ("e-stripped", content.rstrip() + "</code>", -1)]  # fmt: skip
        for eid, resent, extra in cases:
            client = oai(stack, eid)
            first = client.chat.completions.create(model=MODEL, messages=messages, stop=["Observation:", "Nope"])
            assert first.choices[0].message.content == content and first.choices[0].finish_reason == "stop"
            (rec,) = stack.store.read(eid)
            assert completion_text(rec) == content and rec.completion_ids[-1] != IM_END and rec.finish_reason == "stop"
            assert rec.client_sampling == {"stop": ["Observation:", "Nope"]}
            assert stack.backend.requests[-1].sampling.stop_strings == ("Observation:", "Nope")

            conv = [*messages, {"role": "assistant", "content": resent}, {"role": "user", "content": "go on"}]
            client.chat.completions.create(model=MODEL, messages=conv, stop=["Observation:"])
            nxt = stack.store.read(eid)[1]
            previous = rec.prompt_ids + rec.completion_ids
            assert nxt.reused_prefix_len == len(previous) + extra
            reused = min(len(previous), nxt.reused_prefix_len)
            assert nxt.prompt_ids[:reused] == previous[:reused]
            assert TOK.decode(nxt.prompt_ids) == chat_template.render(conv)  # same text as a full rendering


def test_whole_tokens_stop_at_the_last_whole_character() -> None:
    ids = TOK.encode("aéb")  # é is two byte tokens
    assert [tito.whole_tokens(TOK, ids, t) for t in ("aéb!", "aé", "aè", "x", "")] == [4, 3, 1, 0, 0]


def test_a_stop_string_starting_inside_a_token_drops_that_token(make_stack) -> None:
    with make_stack(script) as stack:
        out = oai(stack, "e-mid").chat.completions.create(model=MODEL, messages=user("MIDTOKEN"), stop="tool_c")
        (rec,) = stack.store.read("e-mid")
        # "tool_c" starts inside the single <tool_call> token: the text ends before that token
        assert out.choices[0].message.content == "Let me check.\n" == completion_text(rec)
        assert len(stack.backend.results[0].token_ids) == len(rec.completion_ids) + 1
        assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"


def test_completions_and_anthropic_stop(make_stack) -> None:
    with make_stack(script) as stack:
        out = oai(stack, "e-cmp").completions.create(model=MODEL, prompt="go", stop="\n", max_tokens=64)
        assert out.choices[0].text == "Thought: look it up" and out.choices[0].finish_reason == "stop"
        assert completion_text(stack.store.read("e-cmp")[0]) == "Thought: look it up"

        key = stack.key("e-ant")
        client = anthropic.Anthropic(base_url=stack.server.anthropic_base_url, api_key=key, max_retries=0)
        msg = client.messages.create(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "x"}],
                                     stop_sequences=["Code:"])  # fmt: skip
        assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "Code:"
        assert [b.text for b in msg.content] == ["Thought: look it up\n"]
        with client.messages.stream(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "x"}],
                                    stop_sequences=["Code:"]) as stream:  # fmt: skip
            final = stream.get_final_message()
        assert final.stop_reason == "stop_sequence" and final.stop_sequence == "Code:"
        records = stack.store.read("e-ant")
        assert [completion_text(r) for r in records] == ["Thought: look it up\n"] * 2
        assert records[0].client_sampling == {"stop": ["Code:"]}


def test_stop_strings_on_a_backend_that_cannot_detokenize_get_400(make_stack) -> None:
    with make_stack(script, detokenize=None) as stack:
        with pytest.raises(openai.BadRequestError, match="stop sequences"):
            oai(stack, "e-nodetok").chat.completions.create(model=MODEL, messages=user("x"), stop="Code:")
        assert oai(stack, "e-ok").chat.completions.create(model=MODEL, messages=user("x")).choices[0].message.content


# -- n > 1 -------------------------------------------------------------------------------------------------------------


def test_n_choices_each_recorded_and_any_one_continued(make_stack) -> None:
    with make_stack(script) as stack:
        client = oai(stack, "e-n")
        messages = user("CHOICES")
        out = client.chat.completions.create(model=MODEL, messages=messages, n=3, seed=41)
        assert [c.index for c in out.choices] == [0, 1, 2]
        texts = [c.message.content for c in out.choices]
        assert texts == ["answer 41", "answer 42", "answer 43"]
        records = stack.store.read("e-n")
        assert [r.call_index for r in records] == [0, 1, 2] and len({r.thread_id for r in records}) == 1
        assert [completion_text(r) for r in records] == texts and len({tuple(r.prompt_ids) for r in records}) == 1
        assert out.usage.prompt_tokens == len(records[0].prompt_ids)
        assert out.usage.completion_tokens == sum(len(r.completion_ids) for r in records)
        # the first choice ran alone, the others after it (sharing the session's cached prompt on a real loop)
        first_id = stack.backend.requests[0].request_id
        assert stack.backend.log[:2] == [("submit", first_id), ("done", first_id)]
        assert len({r.session_id for r in stack.backend.requests}) == 1
        for k in (2, 0):  # whichever choice the client continues
            eid = f"e-n{k}"
            client = oai(stack, eid)
            texts = [c.message.content for c in client.chat.completions.create(model=MODEL, messages=messages, n=3,
                                                                               seed=41).choices]  # fmt: skip
            follow = [*messages, {"role": "assistant", "content": texts[k]}, {"role": "user", "content": "CHOICES"}]
            client.chat.completions.create(model=MODEL, messages=follow, seed=1)
            records = stack.store.read(eid)
            previous = records[k].prompt_ids + records[k].completion_ids
            assert (
                records[-1].reused_prefix_len == len(previous) and records[-1].prompt_ids[: len(previous)] == previous
            )
            assert {r.thread_id for r in records} == {"main"}  # the choices and their continuation: one agent
        # a choice re-sent changed (text appended) continues that choice, as far as its text agrees
        client = oai(stack, "e-n1x")
        texts = [c.message.content for c in client.chat.completions.create(model=MODEL, messages=messages, n=3,
                                                                           seed=41).choices]  # fmt: skip
        follow = [*messages, {"role": "assistant", "content": texts[1] + "!"}, {"role": "user", "content": "go"}]
        client.chat.completions.create(model=MODEL, messages=follow, seed=1)
        records = stack.store.read("e-n1x")
        kept = records[1].prompt_ids + records[1].completion_ids[:-1]  # all but its <|im_end|>
        assert records[-1].reused_prefix_len == len(kept) and records[-1].prompt_ids[: len(kept)] == kept
        assert TOK.decode(records[-1].prompt_ids) == chat_template.render(follow)
        assert {r.thread_id for r in records} == {"main"}


def test_n_choices_stream_and_completions(make_stack) -> None:
    with make_stack(script) as stack:
        client = oai(stack, "e-ns")
        stream = client.chat.completions.create(model=MODEL, messages=user("CHOICES"), n=2, seed=5, stream=True,
                                                stream_options={"include_usage": True})  # fmt: skip
        text, finish, usage = {0: "", 1: ""}, {}, None
        for chunk in stream:
            for choice in chunk.choices:
                text[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finish[choice.index] = choice.finish_reason
            usage = chunk.usage or usage
        assert text == {0: "answer 5", 1: "answer 6"} and finish == {0: "stop", 1: "stop"}
        assert usage.completion_tokens == 2 * len(TOK.encode("answer 5")) + 2

        out = oai(stack, "e-nc").completions.create(model=MODEL, prompt="CHOICES", n=2, seed=7, max_tokens=32)
        assert [(c.index, c.text) for c in out.choices] == [(0, "answer 7"), (1, "answer 8")]
        body = httpx.post(f"{stack.server.base_url}/completions", timeout=scaled(10),
                          headers={"Authorization": f"Bearer {stack.key('e-ncs')}"},
                          json={"model": MODEL, "prompt": "CHOICES", "n": 2, "seed": 7, "stream": True}).text  # fmt: skip
        chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
        streamed = {0: "", 1: ""}
        for c in chunks:
            streamed[c["choices"][0]["index"]] += c["choices"][0]["text"]
        assert streamed == {0: "answer 7", 1: "answer 8"}
        assert body.count("[DONE]") == 1 and len(stack.store.read("e-ncs")) == 2


# -- tool_choice -------------------------------------------------------------------------------------------------------


def test_named_and_required_tool_choice_force_a_call(make_stack) -> None:
    with make_stack(script) as stack:
        client = oai(stack, "e-tc")
        named = {"type": "function", "function": {"name": "get_weather"}}
        out = client.chat.completions.create(model=MODEL, messages=user("weather?"), tools=TOOLS, tool_choice=named)
        call = out.choices[0].message.tool_calls[0]
        assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        rec = stack.store.read("e-tc")[0]
        forced = TOOL_CALL_OPEN + 'get_weather", "arguments": '
        assert TOK.decode(rec.prompt_ids).endswith("<|im_start|>assistant\n" + forced)  # forced ids are prompt
        assert completion_text(rec) == '{"city": "Paris"}}\n</tool_call>'  # only what the model generated
        assert rec.client_sampling == {"tool_choice": named}

        # several tools: only the opener is forced, the model picks the name
        out = client.chat.completions.create(model=MODEL, messages=user("time?"), tools=TOOLS, tool_choice="required")
        assert out.choices[0].message.tool_calls[0].function.name == "get_time"
        rec = stack.store.read("e-tc")[1]
        assert TOK.decode(rec.prompt_ids).endswith("assistant\n" + TOOL_CALL_OPEN)

        # the next call (the tool's result) continues the forced turn's ids verbatim
        call = out.choices[0].message
        follow = [*user("time?"), call.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "noon"}]  # fmt: skip
        client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS)
        last = stack.store.read("e-tc")[-1]
        assert last.reused_prefix_len > len(rec.prompt_ids) + len(rec.completion_ids) - 1


def test_a_forced_call_re_sent_as_text_reuses_the_prompt_before_the_forced_ids(make_stack) -> None:
    with make_stack(script) as stack:
        client = oai(stack, "e-astext")
        messages = user("weather?")
        client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required")
        # smolagents' ToolCallingAgent re-sends the call as text, then the observation as a user turn
        as_text = "Calling tools:\n[{'id': 'call_1', 'function': {'name': 'get_time'}}]"
        conv = [*messages, {"role": "assistant", "content": as_text}, {"role": "user", "content": "Observation: noon"}]
        client.chat.completions.create(model=MODEL, messages=conv, tools=TOOLS, tool_choice="required")
        first, second = stack.store.read("e-astext")
        before_forced = len(first.prompt_ids) - len(TOK.encode(TOOL_CALL_OPEN))
        assert second.reused_prefix_len == before_forced and second.prompt_ids[:before_forced] == first.prompt_ids[
            :before_forced]  # fmt: skip
        rendered = chat_template.render(conv, TOOLS, tools_format="qwen3") + TOOL_CALL_OPEN
        assert TOK.decode(second.prompt_ids) == rendered


def test_forced_call_closed_for_the_model_or_left_as_text(make_stack) -> None:
    answers = iter(['{"city": "Rome"}}', '{"city": Rome}}\n</tool_call>'])
    with make_stack(lambda request: next(answers)) as stack:
        client = oai(stack, "e-fix")
        named = {"type": "function", "function": {"name": "get_weather"}}
        ok = client.chat.completions.create(model=MODEL, messages=user("a"), tools=TOOLS, tool_choice=named)
        assert ok.choices[0].finish_reason == "tool_calls"
        assert json.loads(ok.choices[0].message.tool_calls[0].function.arguments) == {"city": "Rome"}
        bad = client.chat.completions.create(model=MODEL, messages=user("b"), tools=TOOLS, tool_choice=named)
        assert bad.choices[0].finish_reason == "stop" and bad.choices[0].message.tool_calls is None
        assert bad.choices[0].message.content.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": R')


def test_anthropic_tool_choice_any_and_tool(make_stack) -> None:
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    with make_stack(script) as stack:
        client = anthropic.Anthropic(base_url=stack.server.anthropic_base_url, api_key=stack.key("e-atc"),
                                     max_retries=0)  # fmt: skip
        msgs = [{"role": "user", "content": "weather?"}]
        named = client.messages.create(model=MODEL, max_tokens=64, messages=msgs, tools=tools,
                                       tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
        assert named.stop_reason == "tool_use" and named.content[-1].name == "get_weather"
        assert named.content[-1].input == {"city": "Paris"}
        anyone = client.messages.create(model=MODEL, max_tokens=64, messages=msgs, tools=tools,
                                        tool_choice={"type": "any"})  # fmt: skip
        assert anyone.stop_reason == "tool_use" and anyone.content[-1].name == "get_time"
        records = stack.store.read("e-atc")
        assert [r.client_sampling["tool_choice"] for r in records] == [
            {"type": "function", "function": {"name": "get_weather"}}, "required"]  # fmt: skip


# -- re-sent turns and the conversation a call continues ---------------------------------------------------------------


def test_a_turn_re_sent_changed_continues_its_conversation_whose_earlier_call_stays_forkable(make_stack) -> None:
    with make_stack(script) as stack:
        client = oai(stack, "e-fork")
        messages = user("solve it")
        out = client.chat.completions.create(model=MODEL, messages=messages, stop=["Observation:"])
        turn = {"role": "assistant", "content": out.choices[0].message.content + "Observation:"}  # smolagents' shape
        client.chat.completions.create(model=MODEL, messages=[*messages, turn, {"role": "user", "content": "go on"}])
        fork = [*messages, turn, {"role": "user", "content": "summarize instead"}]  # back to the first call
        client.chat.completions.create(model=MODEL, messages=fork)
        first, second, third = stack.store.read("e-fork")
        assert first.thread_id == second.thread_id == third.thread_id == "main"  # not a new agent
        assert second.reused_prefix_len == len(first.prompt_ids) + len(first.completion_ids)
        # the fork reuses the second call's ids up to the first turn as it was re-sent (+ "Observation:<|im_end|>")
        turn_end = second.reused_prefix_len + len(TOK.encode("Observation:")) + 1
        assert third.reused_prefix_len == turn_end and third.prompt_ids[:turn_end] == second.prompt_ids[:turn_end]
        assert TOK.decode(third.prompt_ids) == chat_template.render(fork)


def test_a_fork_re_sending_an_earlier_forced_call_as_text_reuses_the_prompt_before_the_forced_ids(make_stack) -> None:
    with make_stack(script) as stack:
        client = oai(stack, "e-forkforced")
        messages = user("time?")
        out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required")
        call = out.choices[0].message
        result = {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "noon"}
        client.chat.completions.create(model=MODEL, messages=[*messages, call.model_dump(exclude_none=True), result],
                                       tools=TOOLS)  # fmt: skip
        # a fork from the first call, its forced turn re-sent as text: the forced ids are not kept (nor repeated)
        as_text = {"role": "assistant", "content": "Calling tools:\n[{'function': {'name': 'get_time'}}]"}
        fork = [*messages, as_text, {"role": "user", "content": "Observation: noon"}]
        client.chat.completions.create(model=MODEL, messages=fork, tools=TOOLS)
        first, second, third = stack.store.read("e-forkforced")
        assert second.reused_prefix_len == len(first.prompt_ids) + len(first.completion_ids)
        before_forced = len(first.prompt_ids) - len(TOK.encode(TOOL_CALL_OPEN))
        assert third.reused_prefix_len == before_forced
        assert third.prompt_ids[:before_forced] == second.prompt_ids[:before_forced]
        assert TOK.decode(third.prompt_ids) == chat_template.render(fork, TOOLS, tools_format="qwen3")
        assert {first.thread_id, second.thread_id, third.thread_id} == {"main"}


def test_a_conversation_whose_turn_is_re_sent_verbatim_wins_over_one_re_sent_changed(make_stack) -> None:
    with make_stack(script) as stack:
        client = oai(stack, "e-tie")
        messages = user("CHOICES")
        answer = client.chat.completions.create(model=MODEL, messages=messages, seed=41).choices[0].message.content
        client.chat.completions.create(model=MODEL, messages=messages, seed=42)  # a retry: a later conversation
        follow = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "CHOICES"}]
        client.chat.completions.create(model=MODEL, messages=follow, seed=1)
        first, retry, last = stack.store.read("e-tie")
        assert TOK.decode(retry.completion_ids[:-1]) == "answer 42"  # agrees with "answer 41" for 8 characters
        assert last.reused_prefix_len == len(first.prompt_ids) + len(first.completion_ids)
        assert last.prompt_ids[: last.reused_prefix_len] == first.prompt_ids + first.completion_ids
