"""``gyre_jax.export``'s tokenizer and chat template for the byte-tokenizer models: ``tokenizer.json`` tokenizes and
decodes exactly as ``ByteTokenizer``; the written Jinja template renders exactly what the proxy's built-in renderer
renders (both tools formats) on every fixture conversation. (The command itself, on a real run: tests/commands.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_jax.export import byte_chat_template, byte_tokenizer_json
from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy import chat_template
from gyre_jax.proxy.jinja_template import JinjaChatTemplate

CASES = json.loads((Path(__file__).parent / "fixtures" / "chat_template" / "cases.json").read_text())["cases"]


def test_the_tokenizer_json_is_the_byte_tokenizer() -> None:
    ours, theirs = ByteTokenizer(), byte_tokenizer_json()
    texts = ["", "plain ascii", "Ünïcödé ✓ 日本語 \U0001f600", "\x00\x01\t\r\n\x7f", "a<|im_start|>user\nhi<|im_end|>b",
             "<tool_call>\n{\"name\": \"f\"}\n</tool_call><think></think><|endoftext|>", "  two  spaces  "]  # fmt: skip
    for text in texts:
        ids = ours.encode(text)
        assert theirs.encode(text, add_special_tokens=False).ids == ids, text
        assert theirs.decode(ids, skip_special_tokens=False) == text
    assert theirs.get_vocab_size() == ours.num_real_tokens  # the model's extra rows (padding) have no token


@pytest.mark.parametrize("tools_format", ["qwen3", "compact"])
def test_the_chat_template_renders_as_the_proxy(tools_format: str) -> None:
    template = JinjaChatTemplate.of(byte_chat_template(tools_format))
    checked = 0
    for case in CASES:
        kwargs = {k: case[k] for k in ("enable_thinking",) if k in case}
        for generation in (True, False):
            want = chat_template.render(case["messages"], case.get("tools"), add_generation_prompt=generation,
                                        tools_format=tools_format, **kwargs)  # fmt: skip
            got = template.render(case["messages"], case.get("tools"), add_generation_prompt=generation, **kwargs)
            assert got == want, case["name"]
            checked += 1
    assert checked >= 10 and any(case.get("tools") for case in CASES)
