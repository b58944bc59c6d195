"""Chat formats on published templates (tests/fixtures/templates/): the built-in Qwen3 renderer is a proven-equal
fast path of the Jinja path, tool calls parse per family, and token-in/token-out holds for any template: a
continuing call reuses the previous call's ids exactly and its text is the template's own; a template that drops
earlier reasoning (Qwen3) makes the continuing call a fork the trajectory tree sees as a branch, with every record
keeping the ids the model produced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from timelimits import scaled

from gyre_jax.proxy import chat_format, tito
from gyre_jax.proxy.chat_format import TOOL_FORMATS, ChatFormat, detect_tool_format
from gyre_jax.proxy.chat_template import parse_completion
from gyre_jax.proxy.jinja_template import JinjaChatTemplate
from gyre_jax.proxy.records import TitoRecord
from gyre_jax.proxy.turns import returned_message
from gyre_jax.trajectory.branches import build_branches

FIXTURES = Path(__file__).parents[1] / "fixtures" / "templates"
DATA = json.loads((FIXTURES / "cases.json").read_text("utf-8"))
CONVERSATIONS = {c["name"]: c for c in DATA["conversations"]}
QWEN3_OFFICIAL = (Path(__file__).parents[1] / "fixtures" / "chat_template" / "qwen3_chat_template.jinja").read_text()


def jinja(name: str, gguf: str | None = None) -> ChatFormat:
    src = DATA["templates"][name]
    if src["file"].startswith("gguf:"):
        from gyre_jax.model.gguf_tokenizer import read_gguf_tokenizer

        text = read_gguf_tokenizer(gguf).chat_template
    else:
        text = (FIXTURES / src["file"]).read_text("utf-8")
    return chat_format.from_template(text, src["special_tokens"] or {}, name)


# -- the fast path -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", [e for e in DATA["cases"] if e["template"] == "qwen3" and "expected_text" in e],
                         ids=lambda e: e["case"])  # fmt: skip
def test_builtin_qwen3_equals_the_jinja_path(entry):
    """The hand-written renderer = transformers on the published Qwen3 template (both revisions) on every fixture
    conversation, and = our Jinja path (the fast path is proven equal, not assumed)."""
    conv = CONVERSATIONS[entry["case"]]
    thinking = entry["kwargs"].get("enable_thinking")
    args = (conv["messages"], conv.get("tools"), conv["add_generation_prompt"], thinking)
    fast = chat_format.builtin("qwen3").render(*args)
    assert fast == entry["expected_text"]
    assert fast == chat_format.from_template(QWEN3_OFFICIAL, name="qwen3 (newer revision)").render(*args)


# -- tool-call families ------------------------------------------------------------------------------------------


def test_families_are_detected_from_the_templates():
    expected = {"qwen3": "hermes", "qwen2.5": "hermes", "hermes3": "hermes", "llama3.1": "llama3_json",
                "llama3.2": "llama3_json", "mistral-nemo": "mistral", "deepseek-r1-distill": "deepseek",
                "gemma2": "hermes", "phi3.5": "hermes"}  # fmt: skip
    for name, family in expected.items():
        text = (FIXTURES / DATA["templates"][name]["file"]).read_text("utf-8")
        assert detect_tool_format(text).name == family, name
    assert detect_tool_format(None).name == "hermes"  # the default


@pytest.mark.parametrize(
    "family,text,content,calls",
    [
        ("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "Sure.", [("f", {"a": 1})]),
        ("llama3_json", '{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),
        ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": "x"}}', "",
         [("f", {}), ("g", {"b": "x"})]),
        ("llama3_json", "Plain answer {not json}", "Plain answer {not json}", []),
        ("mistral", 'Ok[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "id": "abcDEF123"}]', "Ok", [("f", {"a": 1})]),
        ("deepseek", "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n"
         '{"a": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Let me check.", [("f", {"a": 1})]),
        ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ],
)  # fmt: skip
def test_tool_calls_parse_per_family(family, text, content, calls):
    parsed = parse_completion("<think>\nhm\n</think>\n\n" + text, TOOL_FORMATS[family].parse)
    assert parsed.reasoning == "hm" and parsed.content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == calls
    if family == "mistral":
        assert parsed.tool_calls[0]["id"] == "abcDEF123"  # the template needs 9-character ids: the model's own
    if not calls and "tool_call" in text:
        assert parsed.tool_call_errors


def test_forced_openers_follow_the_family():
    from gyre_jax.proxy.sampling import forced_prefix

    tools = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]
    named = {"type": "function", "function": {"name": "g"}}
    assert forced_prefix(named, tools, TOOL_FORMATS["llama3_json"]) == '{"name": "g", "parameters": '
    assert forced_prefix("required", tools, TOOL_FORMATS["mistral"]) == '[TOOL_CALLS][{"name": "'
    assert forced_prefix(named, tools, TOOL_FORMATS["hermes"]) == forced_prefix(named, tools)  # the built-in one


# -- token-in/token-out on any template --------------------------------------------------------------------------

END = {"qwen3": "<|im_end|>", "qwen2.5": "<|im_end|>", "hermes3": "<|im_end|>", "smollm2": "<|im_end|>",
       "llama3.1": "<|eot_id|>", "llama3.2": "<|eot_id|>", "mistral-nemo": "</s>", "phi3.5": "<|end|>",
       "gemma2": "<end_of_turn>", "deepseek-r1-distill": "<｜end▁of▁sentence｜>"}  # fmt: skip
CALL_TEXT = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Zürich"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Zürich"}, "id": "abc123def"}]',
}
SYSTEM = {"role": "system", "content": "You are a careful coding agent."}
USER = {"role": "user", "content": "What's the weather in Zürich?"}
WEATHER = CONVERSATIONS["tools_offered"]["tools"][:1]


def tokenizer_for(name: str, gguf: str):
    """The SmolLM2 GGUF vocabulary with the template's end-of-turn token added as a special token (a stand-in for
    the model's own tokenizer: the template's end token is one id that ends the turn, as in the real one)."""
    from tokenizers import AddedToken

    from gyre_jax.model.gguf_tokenizer import build_tokenizer, read_gguf_tokenizer
    from gyre_jax.model.hf_tokenizer import HFTokenizer

    tok = build_tokenizer(read_gguf_tokenizer(gguf))
    specials = ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|begin_of_text|>", "</s>", "<s>",
                "[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[AVAILABLE_TOOLS]",
                "[/AVAILABLE_TOOLS]", "<|end|>", "<|user|>", "<|assistant|>", "<end_of_turn>", "<start_of_turn>",
                "<bos>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
                "<tool_call>", "</tool_call>"]  # fmt: skip
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    return HFTokenizer(tok, eos_token=END[name], source=f"smollm2+{name}")


def serve(tok, fmt: ChatFormat, messages, tools, state, completion_text: str, enable_thinking=None, index=0):
    """One call as the proxy serves it: TITO prompt, the model's completion ids (its text + the end token), the
    record and the thread state the next call continues."""
    build = tito.build_prompt(tok, messages, tools, state, enable_thinking, fmt)
    completion = tok.encode(completion_text) + [tok.eos_ids[0]]
    message = returned_message(parse_completion(completion_text, fmt.tool_calls.parse))
    record = TitoRecord(execution_id="e", call_index=index, thread_id="main", request_id=f"r{index}",
                        prompt_ids=build.prompt_ids, completion_ids=completion,
                        completion_logprobs=[-0.5] * len(completion), policy_versions=[0] * len(completion),
                        finish_reason="stop", temperature=1.0, reused_prefix_len=build.reused_prefix_len,
                        t_start=0.0, t_end=0.0)  # fmt: skip
    new_state = tito.ThreadState([tito.normalize_message(m) for m in messages], tito.tools_key(tools),
                                 build.prompt_ids, completion, tito.normalize_message(message), True,
                                 returned_message=message)  # fmt: skip
    return build, record, new_state, message


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5", "hermes3", "llama3.1", "llama3.2", "mistral-nemo"])
def test_tool_loop_reuses_the_previous_ids_and_serves_the_templates_text(name, smollm2_gguf):
    """A tool call, its result, then the answer: each call's prompt starts with the previous prompt + completion
    ids verbatim (reused_prefix_len), decodes to exactly the template's rendering of the conversation, and the
    trajectory tree has one branch whose trainable tokens are exactly the completions."""
    fmt, tok = jinja(name), tokenizer_for(name, smollm2_gguf)
    kwargs = {"date_string": "26 Jul 2024"} if name.startswith("llama") else {}
    fmt = ChatFormat(JinjaChatTemplate.of(fmt.template.source, {**dict(fmt.template.special_tokens),
                     **kwargs}, name), fmt.tools_format, fmt.tool_calls)  # fmt: skip
    # Mistral Nemo writes the system prompt into the user turn only while that is the last message (any later
    # message re-renders it: test_a_template_that_moves_the_system_prompt_re_renders)
    messages = [USER] if name == "mistral-nemo" else [SYSTEM, USER]
    b1, r1, s1, m1 = serve(tok, fmt, messages, WEATHER, None, CALL_TEXT[fmt.tool_calls.name])
    assert b1.prompt_ids == tok.encode(fmt.render(messages, WEATHER)) and m1["tool_calls"]
    m1 = {**m1, "content": m1["content"] or ""}  # re-sent as clients send it (the older Qwen3 template needs a string)
    result = {"role": "tool", "tool_call_id": m1["tool_calls"][0]["id"], "content": '{"temp_c": 21}'}
    messages = [*messages, m1, result]
    b2, r2, s2, m2 = serve(tok, fmt, messages, WEATHER, s1, "It is 21 °C in Zürich.", index=1)
    assert b2.continued and b2.reused_prefix_len == len(r1.prompt_ids) + len(r1.completion_ids)
    assert b2.prompt_ids[: b2.reused_prefix_len] == r1.prompt_ids + r1.completion_ids
    assert tok.decode(b2.prompt_ids) == fmt.render(messages, WEATHER)  # the template's own text
    (branch,) = build_branches([r1, r2])
    assert branch.tokens == r2.prompt_ids + r2.completion_ids
    trained = [t for t, keep in zip(branch.tokens, branch.trainable) if keep]
    assert trained == r1.completion_ids + r2.completion_ids


@pytest.mark.parametrize("name", ["smollm2", "phi3.5", "gemma2", "llama3.1", "qwen2.5"])
def test_multi_turn_chat_reuses_the_previous_ids(name, smollm2_gguf):
    """Plain multi-turn chat (templates without tools included): the second call continues the first."""
    fmt, tok = jinja(name, smollm2_gguf), tokenizer_for(name, smollm2_gguf)
    first = [{"role": "user", "content": "List three primes."}]
    _, r1, s1, m1 = serve(tok, fmt, first, None, None, "2, 3 and 5.")
    messages = [*first, m1, {"role": "user", "content": "And their sum?"}]
    b2, r2, _, _ = serve(tok, fmt, messages, None, s1, "10.", index=1)
    assert b2.continued and b2.prompt_ids[: b2.reused_prefix_len] == r1.prompt_ids + r1.completion_ids
    assert b2.reused_prefix_len == len(r1.prompt_ids) + len(r1.completion_ids)
    assert tok.decode(b2.prompt_ids) == fmt.render(messages)
    assert len(build_branches([r1, r2])) == 1


@pytest.mark.parametrize("name", ["qwen3", "deepseek-r1-distill"])
def test_a_template_that_drops_reasoning_makes_a_branch(name, smollm2_gguf):
    """Qwen3 drops the <think> block of turns before the last user query; DeepSeek-R1's template drops every
    earlier turn's. The continuing call is served exactly the template's re-rendering (no thinking), its leading
    ids reused as far as the text agrees (the first call's prompt); the first record keeps the thinking ids the
    model produced, trained once on its own branch; the tree has two branches and no trained id was served as
    other text. A Qwen3 tool loop (no new user query) keeps the thinking and continues (one branch)."""
    fmt, tok = jinja(name), tokenizer_for(name, smollm2_gguf)
    think = "<think>\nTwo plus two is four.\n</think>\n\n" if name == "qwen3" else "Two plus two is four.\n</think>\n\n"
    first = [{"role": "user", "content": "2+2?"}]
    b1, r1, s1, m1 = serve(tok, fmt, first, None, None, think + "4")
    assert m1["reasoning_content"] == "Two plus two is four." and m1["content"] == "4"
    client_m1 = {"role": "assistant", "content": "4"}  # an OpenAI client re-sends no reasoning
    messages = [*first, client_m1, {"role": "user", "content": "3+3?"}]
    b2, r2, _, _ = serve(tok, fmt, messages, None, s1, think.replace("Two plus two is four", "Six") + "6", index=1)
    # reused: the first prompt, up to the generation prompt's "<think>\n" that DeepSeek's re-rendering lacks
    opener = "" if name == "qwen3" else "<think>\n</think>"  # llama.cpp's DeepSeek copy closes an empty think
    assert not b2.continued and 0 < b2.reused_prefix_len <= len(r1.prompt_ids)
    assert tok.decode(r1.prompt_ids[: b2.reused_prefix_len]) == tok.decode(r1.prompt_ids).removesuffix(opener)
    assert b2.prompt_ids[: b2.reused_prefix_len] == r1.prompt_ids[: b2.reused_prefix_len]
    served = tok.decode(b2.prompt_ids)
    assert served == fmt.render(messages) and "Two plus two" not in served
    assert "Two plus two" in tok.decode(r1.completion_ids)  # the record keeps what the model produced
    branches = build_branches([r1, r2])
    assert len(branches) == 2 and [b.label for b in branches] == ["main", "main-summary"]
    for branch, record in zip(branches, (r1, r2)):
        trained = [t for t, keep in zip(branch.tokens, branch.trainable) if keep]
        assert trained == record.completion_ids  # each completion trained once, on the ids it was served with
        assert branch.tokens == record.prompt_ids + record.completion_ids
    if name == "qwen3":  # the same turn followed by a tool result (no new query): thinking kept, one branch
        result = {"role": "tool", "tool_call_id": "x", "content": "ok"}
        b3 = tito.build_prompt(tok, [*first, client_m1, result], None, s1, None, fmt)
        assert b3.continued and b3.prompt_ids[: b3.reused_prefix_len] == r1.prompt_ids + r1.completion_ids


def test_a_template_that_moves_the_system_prompt_re_renders(smollm2_gguf):
    """Mistral Nemo writes the system prompt into the user turn only while it is the last message: the next call
    re-renders the history, so it is the template's text, forked from the first call where the text differs."""
    fmt, tok = jinja("mistral-nemo"), tokenizer_for("mistral-nemo", smollm2_gguf)
    first = [SYSTEM, {"role": "user", "content": "Hi"}]
    _, r1, s1, m1 = serve(tok, fmt, first, None, None, "Hello!")
    messages = [*first, m1, {"role": "user", "content": "Bye"}]
    b2, r2, _, _ = serve(tok, fmt, messages, None, s1, "Bye!", index=1)
    assert not b2.continued and 0 < b2.reused_prefix_len < len(r1.prompt_ids)
    assert tok.decode(b2.prompt_ids) == fmt.render(messages)
    assert len(build_branches([r1, r2])) == 2


def test_render_errors_are_value_errors():
    fmt = chat_format.from_template((FIXTURES / "google-gemma-2-2b-it.jinja").read_text(), name="gemma2")
    with pytest.raises(ValueError, match="System role not supported"):
        fmt.render([SYSTEM, USER])
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        chat_format.from_template("{% if %}", name="broken")
    with pytest.raises(ValueError, match="tool_format='xml'"):
        chat_format.from_template("{{ messages }}", tool_format="xml")


# -- configuration -------------------------------------------------------------------------------------------------


def test_settings_pick_the_checkpoints_own_template_or_an_override(smollm2_tokenizer, tmp_path):
    """``tokenizer.chat_template`` "": the GGUF's own template (SmolLM2's ChatML: no tool family of its own, so
    the hermes default); "builtin": the hand-written renderer; a .jinja file or a tokenizer_config.json: that."""
    own = chat_format.for_settings(smollm2_tokenizer)
    assert own.template is not None and own.tool_calls.name == "hermes" and "SmolLM" in own.render([USER])
    assert chat_format.for_settings(smollm2_tokenizer, "builtin", "qwen3").template is None
    jinja_file = tmp_path / "llama.jinja"
    jinja_file.write_text((FIXTURES / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text())
    llama = chat_format.for_settings(smollm2_tokenizer, str(jinja_file))
    assert llama.tool_calls.name == "llama3_json" and "<|start_header_id|>" in llama.render([USER])
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": [{"name": "default", "template": "D{{ messages|length }}"},
                                                    {"name": "tool_use", "template": "T"}]}))  # fmt: skip
    assert chat_format.for_settings(smollm2_tokenizer, str(config)).render([USER]) == "D1"
    with pytest.raises(ValueError, match="cannot read a chat template"):
        chat_format.for_settings(smollm2_tokenizer, str(tmp_path / "missing.jinja"))
    from gyre_jax.model.tokenizer import ByteTokenizer

    assert chat_format.for_settings(ByteTokenizer()) == chat_format.builtin("compact")  # the tiny models' format


def test_tokenizer_section_checks():
    from gyre_jax.config.base import ConfigError
    from gyre_jax.config.rollout import TokenizerSection

    assert TokenizerSection(kind="gguf", path="x.gguf", tool_format="mistral").kind == "gguf"
    for kwargs, message in [
        ({"tool_format": "xml"}, "config.tokenizer.tool_format='xml' must be one of"),
        ({"gguf_pre": "hf"}, "config.tokenizer.gguf_pre='hf'"),
        ({"path": "x.gguf"}, "tokenizer.kind='byte' reads no file"),
        ({"chat_template": "/nowhere/t.jinja"}, "names no file"),
    ]:
        with pytest.raises(ConfigError, match=message):
            TokenizerSection(**kwargs)


# -- through a real ProxyServer ------------------------------------------------------------------------------------


def test_proxy_serves_a_checkpoint_template_token_in_token_out(make_stack, smollm2_gguf):
    """The real proxy with Llama 3.1's template and a GGUF tokenizer, driven by the openai SDK: the tool call is
    parsed in Llama's JSON form (streamed too), every record decodes to what the client got, and the call with the
    tool result continues the first call's ids and is served exactly the template's text."""
    import openai

    fmt, tok = jinja("llama3.1"), tokenizer_for("llama3.1", smollm2_gguf)

    def script(request):
        text = tok.decode(request.prompt_ids)
        return "It is 21 °C." if "<|start_header_id|>ipython" in text else CALL_TEXT["llama3_json"]

    with make_stack(script, tokenizer=tok, tools_format=fmt) as stack:
        sdk = openai.OpenAI(base_url=stack.server.base_url, api_key=stack.key("e1"), max_retries=0, timeout=scaled(20))
        messages = [SYSTEM, USER]
        first = sdk.chat.completions.create(model="gyre-tiny", messages=messages, tools=WEATHER)
        call = first.choices[0].message.tool_calls[0]
        assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Zürich"}
        streamed = sdk.chat.completions.create(model="gyre-tiny", messages=messages, tools=WEATHER, stream=True)
        names = [d.function.name for c in streamed for d in (c.choices[0].delta.tool_calls or []) if d.function.name]
        assert names == ["get_weather"]
        messages = [*messages, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]  # fmt: skip
        second = sdk.chat.completions.create(model="gyre-tiny", messages=messages, tools=WEATHER)
        assert second.choices[0].message.content == "It is 21 °C."
        r1, _, r2 = stack.store.read("e1")
    assert tok.decode(r1.prompt_ids) == fmt.render([SYSTEM, USER], WEATHER)
    assert tok.decode(r1.completion_ids[:-1]) == CALL_TEXT["llama3_json"]
    assert r2.reused_prefix_len == len(r1.prompt_ids) + len(r1.completion_ids)
    assert r2.prompt_ids[: r2.reused_prefix_len] == r1.prompt_ids + r1.completion_ids
    sent = [*messages[:2], {**messages[2], "tool_calls": [{**messages[2]["tool_calls"][0]}]}, messages[3]]
    assert tok.decode(r2.prompt_ids) == fmt.render(sent, WEATHER)
