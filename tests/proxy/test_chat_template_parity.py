"""Golden parity with Hugging Face: our Qwen3 renderer + the ``tokenizers`` library give, token for token, what
``apply_chat_template`` gave with the official Qwen3 Jinja template (fixtures made by
scripts/make_template_fixtures.py: system + tools, multi-turn tool calls, grouped tool results, reasoning
before/after the last user query, <think> inside content, enable_thinking=False, a mid-conversation system turn)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from gyre_jax.proxy import chat_template, tito

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_template"
CASES = json.loads((FIXTURES / "cases.json").read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(FIXTURES / "tokenizer.json"))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_render_matches_apply_chat_template(case: dict, tokenizer: Tokenizer) -> None:
    text = chat_template.render(case["messages"], case["tools"], add_generation_prompt=case["add_generation_prompt"],
                                enable_thinking=case.get("enable_thinking"))  # fmt: skip
    assert text == case["expected_text"]
    assert tokenizer.encode(text, add_special_tokens=False).ids == case["expected_ids"]


def test_fixture_template_is_the_one_the_script_embeds() -> None:
    """The committed template file is what the cases were rendered with (guards hand edits of either)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_fixtures", FIXTURES.parents[2] / "scripts" / "make_template_fixtures.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (FIXTURES / "qwen3_chat_template.jinja").read_text(encoding="utf-8") == module.QWEN3_CHAT_TEMPLATE
    assert [c["name"] for c in CASES] == [c["name"] for c in module.CASES]


def test_tito_continuation_tokens_are_a_prefix_of_the_full_rendering(tokenizer: Tokenizer) -> None:
    """Appending only new messages to the previous prompt + completion gives the text the template renders for the
    whole conversation (the ids differ only where BPE merges would cross the turn boundary; text is identical)."""
    case = next(c for c in CASES if c["name"] == "multi_turn_tool_calls_grouped_results")

    class Tok:
        eos_ids = (tokenizer.token_to_id("<|im_end|>"),)

        def encode(self, text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False).ids

        def decode(self, ids) -> str:
            return tokenizer.decode(list(ids), skip_special_tokens=False)

        def token_id(self, token: str) -> int:
            return tokenizer.token_to_id(token)

    tok = Tok()
    messages, tools = case["messages"], case["tools"]
    first = tito.build_prompt(tok, messages[:2], tools, None)
    completion = tok.encode(tito.assistant_completion_text(messages[2])) + [tok.token_id("<|im_end|>")]
    state = tito.ThreadState(messages=[tito.normalize_message(m) for m in messages[:2]], tools_key=tito.tools_key(tools),
                             prompt_ids=first.prompt_ids, completion_ids=completion,
                             returned=tito.normalize_message(messages[2]), finished=True)  # fmt: skip
    second = tito.build_prompt(tok, messages, tools, state)
    assert second.continued and second.prompt_ids[: second.reused_prefix_len] == first.prompt_ids + completion
    assert tok.decode(second.prompt_ids) == case["expected_text"]
