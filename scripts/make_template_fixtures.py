"""Builds the chat-template parity fixtures under tests/fixtures/chat_template/ (run once by hand).

What it writes:
  qwen3_chat_template.jinja  the official Qwen3 chat template (``chat_template`` of Qwen3's tokenizer_config.json)
  tokenizer.json             a small byte-level BPE trained here, with Qwen3's special tokens
  cases.json                 conversations (+ tools, generation prompt, enable_thinking) and what Hugging Face
                             ``apply_chat_template`` renders from them: the text and the token ids

The test (tests/proxy/test_chat_template_parity.py) renders the same conversations with
``gyre_jax.proxy.chat_template`` and tokenizes with the ``tokenizers`` library: both must match token
for token. No download happens anywhere: the template is embedded below and the tokenizer is trained.

Run (in a throwaway venv; torch is not needed):
  python3 -m venv /tmp/tplvenv && /tmp/tplvenv/bin/pip install transformers tokenizers jinja2
  /tmp/tplvenv/bin/python scripts/make_template_fixtures.py
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "chat_template"

# Qwen/Qwen3-* tokenizer_config.json, "chat_template" (the hybrid-thinking template of the Qwen3 release).
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>"]  # fmt: skip

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city (°C).",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string",
           "enum": ["c", "f"]}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}  # fmt: skip


def call(name: str, arguments, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CASES = [
    {"name": "system_tools_user", "tools": [WEATHER, TIME], "add_generation_prompt": True,
     "messages": [{"role": "system", "content": "You are a helpful agent."},
                  {"role": "user", "content": "Weather in Paris and the time in Tokyo?"}]},
    {"name": "tools_without_system", "tools": [WEATHER], "add_generation_prompt": True,
     "messages": [{"role": "user", "content": "Weather in Oslo?"}]},
    {"name": "no_tools_no_system", "tools": None, "add_generation_prompt": True,
     "messages": [{"role": "user", "content": "Hi!"}]},
    {"name": "multi_turn_tool_calls_grouped_results", "tools": [WEATHER, TIME], "add_generation_prompt": True,
     "messages": [{"role": "system", "content": "Use the tools."},
                  {"role": "user", "content": "Weather in Paris and the time in Tokyo?"},
                  {"role": "assistant", "content": "Checking both.",
                   "tool_calls": [call("get_weather", {"city": "Paris", "unit": "c"}, "c1"),
                                  call("get_time", '{"tz": "Asia/Tokyo"}', "c2")]},
                  {"role": "tool", "tool_call_id": "c1", "content": "sunny, 24"},
                  {"role": "tool", "tool_call_id": "c2", "content": "21:05"},
                  {"role": "assistant", "content": "",
                   "tool_calls": [call("get_weather", {"city": "Tokyo"}, "c3")]},
                  {"role": "tool", "tool_call_id": "c3", "content": "rain"}]},
    {"name": "reasoning_before_and_after_last_query", "tools": [WEATHER], "add_generation_prompt": True,
     "messages": [{"role": "user", "content": "First question"},
                  {"role": "assistant", "content": "First answer.", "reasoning_content": "old thoughts, dropped"},
                  {"role": "user", "content": "Weather in Rome?"},
                  {"role": "assistant", "content": "", "reasoning_content": "\nI should call the tool.\n",
                   "tool_calls": [call("get_weather", {"city": "Rome"}, "c1")]},
                  {"role": "tool", "tool_call_id": "c1", "content": "cloudy"},
                  {"role": "assistant", "content": "It is cloudy.", "reasoning_content": "Tool said cloudy."}]},
    {"name": "think_tags_inside_content", "tools": None, "add_generation_prompt": False,
     "messages": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}]},
    {"name": "enable_thinking_false", "tools": [TIME], "add_generation_prompt": True, "enable_thinking": False,
     "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Time in Lima?"}]},
    {"name": "system_in_the_middle_and_unicode", "tools": None, "add_generation_prompt": True,
     "messages": [{"role": "system", "content": "Main rules."}, {"role": "user", "content": "Grüße, 東京 🌧"},
                  {"role": "assistant", "content": "Hallo."},
                  {"role": "system", "content": "# Environment\n - cwd: /tmp"},
                  {"role": "user", "content": "<tool_response>\nnot a tool\n</tool_response>"}]},
]  # fmt: skip


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [json.dumps(case, ensure_ascii=False) for case in CASES] * 3 + [QWEN3_CHAT_TEMPLATE]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    return tok


def main() -> None:
    import transformers

    OUT.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(OUT / "tokenizer.json"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = QWEN3_CHAT_TEMPLATE
    out = []
    for case in CASES:
        kwargs = {"tools": case["tools"], "add_generation_prompt": case["add_generation_prompt"]}
        if "enable_thinking" in case:
            kwargs["enable_thinking"] = case["enable_thinking"]
        text = hf.apply_chat_template(case["messages"], tokenize=False, **kwargs)
        ids = hf.apply_chat_template(case["messages"], tokenize=True, return_dict=False, **kwargs)
        if isinstance(ids, dict):  # some transformers versions return a BatchEncoding
            ids = ids["input_ids"]
        out.append({**case, "expected_text": text, "expected_ids": list(map(int, ids))})
    (OUT / "qwen3_chat_template.jinja").write_text(QWEN3_CHAT_TEMPLATE, encoding="utf-8")
    (OUT / "cases.json").write_text(json.dumps({"transformers": transformers.__version__, "cases": out}, ensure_ascii=False,
                                               indent=1) + "\n", encoding="utf-8")  # fmt: skip
    print(f"wrote {len(out)} cases with transformers {transformers.__version__} to {OUT}")


if __name__ == "__main__":
    main()
