"""The Jinja path (``gyre_jax.proxy.jinja_template``) equals transformers' ``apply_chat_template`` on published chat
templates: the rendered text exactly, and the token ids of the SmolLM2 GGUF tokenizer (ours from the metadata,
theirs from transformers' GGUF conversion) token for token. Fixtures: tests/fixtures/templates/ (cases.json made by
make_fixtures.py there, by hand, with transformers; each template's source in cases.json["templates"])."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from gyre_jax.proxy.jinja_template import JinjaChatTemplate, check_template

FIXTURES = Path(__file__).parents[1] / "fixtures" / "templates"
DATA = json.loads((FIXTURES / "cases.json").read_text("utf-8"))
CONVERSATIONS = {c["name"]: c for c in DATA["conversations"]}


@functools.cache
def template_text(name: str, gguf_path: str | None = None) -> str:
    file = DATA["templates"][name]["file"]
    if file.startswith("gguf:"):
        from gyre_jax.model.gguf_tokenizer import read_gguf_tokenizer

        return read_gguf_tokenizer(gguf_path).chat_template
    return (FIXTURES / file).read_text("utf-8")


def render(entry: dict, gguf_path: str | None) -> str:
    conv = CONVERSATIONS[entry["case"]]
    template = JinjaChatTemplate.of(template_text(entry["template"], gguf_path), name=entry["template"])
    return template.render(conv["messages"], conv.get("tools"), conv["add_generation_prompt"], **entry["kwargs"])


def test_fixtures_cover_six_published_templates_with_tools_and_multi_turn():
    rendered = [e for e in DATA["cases"] if "expected_text" in e and not DATA["templates"][e["template"]]["edited"]]
    names = {e["template"] for e in rendered}
    assert len(names) >= 6  # published templates, verbatim (DeepSeek's copy is edited: tested, not counted)
    with_tools = {e["template"] for e in rendered if CONVERSATIONS[e["case"]].get("tools")}
    with_results = {e["template"] for e in rendered if e["case"] == "tool_call_and_result"}
    multi_turn = {e["template"] for e in rendered if e["case"] in ("multi_turn", "tool_round_trip_then_answer")}
    assert len(with_tools) >= 5 and len(with_results) >= 5 and len(multi_turn) >= 6
    # the tools really are in the text, and so are the tool results (templates that ignore tools do exist)
    tool_names = {
        e["template"] for e in rendered if e["case"] == "tools_offered" and "get_weather" in e["expected_text"]
    }
    assert len(tool_names) >= 5
    for name, src in DATA["templates"].items():
        assert src["source"] and (src["file"].startswith("gguf:") or (FIXTURES / src["file"]).is_file()), name


@pytest.mark.parametrize("entry", DATA["cases"], ids=[f"{e['template']}-{e['case']}" for e in DATA["cases"]])
def test_render_equals_apply_chat_template(entry, request):
    gguf_path = None
    if DATA["templates"][entry["template"]]["file"].startswith("gguf:"):
        gguf_path = request.getfixturevalue("smollm2_gguf")
    if "expected_error" in entry:
        message = entry["expected_error"].split(": ", 1)[1]
        with pytest.raises(ValueError, match="refused the conversation|could not render") as err:
            render(entry, gguf_path)
        if entry["expected_error"].startswith("TemplateError"):
            assert message in str(err.value)
        return
    assert render(entry, gguf_path) == entry["expected_text"]


@pytest.mark.parametrize(
    "entry", [e for e in DATA["cases"] if "expected_ids" in e], ids=lambda e: f"{e['template']}-{e['case']}"
)
def test_ids_equal_apply_chat_template(entry, smollm2_gguf, smollm2_tokenizer_transformers):
    """transformers tokenized with its GGUF conversion: our tokenizer in that reading (``pre_mode="transformers"``;
    the model's own reading differs from it on 4 of these texts, see test_gguf_tokenizer.py)."""
    assert smollm2_tokenizer_transformers.encode(render(entry, smollm2_gguf)) == entry["expected_ids"]


def test_environment_matches_transformers():
    """The pieces of transformers' environment a template can reach: tojson without HTML escaping and with its
    options, raise_exception, strftime_now, loop controls, namespace, trim/lstrip blocks, special tokens and extra
    keywords (keywords override special tokens), None-valued keys dropped, reasoning aliased."""
    source = (
        "{%- for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{{ m | tojson }}|{{ m.thinking if m.thinking is defined else '-' }}|\n"
        "{%- endfor %}\n"
        "  {% if x is defined %}{{ {'a': '<&>', 'b': [1, 2]} | tojson(indent=1, sort_keys=true) }}{% endif %}\n"
        "{{ bos_token }}{{ eos_token }}{% set ns = namespace(n=0) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}"
        "{{ strftime_now('%Y') | length }}{{ dict(k=1) | tojson }}"
    )
    t = JinjaChatTemplate.of(source, {"bos_token": "<s>", "eos_token": "</s>"})
    messages = [{"role": "user", "content": "é<b>", "name": None}, {"role": "skip"},
                {"role": "assistant", "content": "ok", "reasoning": "because"}]  # fmt: skip
    text = t.render(messages, x=1, eos_token="<eot>")
    # what transformers 5.25's render_jinja_template gives for the same input (checked by hand in the .refvenv)
    assert text == (
        '{"role": "user", "content": "é<b>"}|-|{"thinking": "because", "role": "assistant", "content": "ok", '
        '"reasoning": "because", "reasoning_content": "because"}|because|{\n "a": "<&>",\n "b": [\n  1,\n  2\n ]\n}'
        '<s><eot>14{"k": 1}'
    )
    with pytest.raises(ValueError, match="refused the conversation: no"):
        JinjaChatTemplate.of("{{ raise_exception('no') }}").render([])
    with pytest.raises(ValueError, match="underscore"):
        JinjaChatTemplate.of("{% set ns = namespace() %}{% set ns._x = 1 %}").render([])
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        check_template("{% for %}", "test template")


def test_generation_spans_and_named_templates():
    """``{% generation %}`` blocks render their body and report where it landed; a named set picks tool_use
    when tools are given."""
    source = "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}" \
             "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"  # fmt: skip
    t = JinjaChatTemplate.of(source, named={"tool_use": "TOOLS {{ tools | length }}"})
    text, spans = t.render_with_generation_spans([{"role": "user", "content": "a"}, {"role": "assistant", "content": "bc"},
                                                 {"role": "assistant", "content": "d"}])  # fmt: skip
    assert text == "<user>a<assistant>bc<assistant>d"
    assert [text[s:e] for s, e in spans] == ["bc", "d"]
    assert t.render([], tools=[{"type": "function", "function": {"name": "f"}}]) == "TOOLS 1"
    assert t.render([{"role": "user", "content": "x"}], documents=[{"title": "t", "text": "x"}]) == "<user>x"
