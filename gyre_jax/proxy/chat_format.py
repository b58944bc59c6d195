"""A model's chat format: how a conversation is rendered to text (its chat template) and how the model writes
tool calls (its tool-call family), so the proxy serves any checkpoint's own format.

``ChatFormat.render`` is either the checkpoint's own Jinja template (``jinja_template.JinjaChatTemplate``: exactly
``apply_chat_template``) or the built-in Qwen3 renderer (``chat_template.render``, ``tools_format`` "qwen3" or the
tiny models' "compact"), which equals the official Qwen3 template on every fixture (a proven-equal fast path,
tests/proxy/test_chat_format.py). Messages reach a Jinja template as transformers' templates expect them (and as
vLLM passes them): text content parts joined into one string, tool-call ``arguments`` as an object (the OpenAI
wire's JSON string parsed).

``ToolCallFormat`` is a tool-call family: where a call starts in generated text (``open``, what a stream holds
back), the text a forced ``tool_choice`` starts the turn with, and the parse of a completion into content and
calls. Families (``TOOL_FORMATS``), detected from the template text by ``detect_tool_format``:

| family | the model writes | templates |
|---|---|---|
| ``hermes`` | ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (several blocks) | Qwen2.5, Qwen3, Hermes, SmolLM3, the built-in formats |
| ``llama3_json`` | the whole turn is ``{"name": ..., "parameters": {...}}`` (``;``-separated for several) | Llama 3.1 / 3.2 / 3.3 |
| ``mistral`` | ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` | Mistral 7B v0.3, Nemo, Small |
| ``deepseek`` | ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...`` | DeepSeek V3 / R1 and R1 distills |

A template none of these match (SmolLM2's ChatML, Gemma, Phi: they render no tools) gets ``hermes``, the default:
``<tool_call>`` blocks the model writes are parsed, nothing else is. ``tokenizer.tool_format`` in the config
overrides the detection.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gyre_jax.proxy import chat_template
from gyre_jax.proxy.jinja_template import JinjaChatTemplate

ParseResult = tuple[str, list[dict], list[str]]  # content, OpenAI tool calls, errors


def _call(name: str, args: dict, call_id: str | None = None) -> dict:
    return {
        "id": call_id or "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": name, "arguments": chat_template.tojson(args)},
    }


def _json_call(raw: str, args_keys: tuple[str, ...] = ("arguments",)) -> tuple[dict | None, str | None]:
    """A tool call from a JSON object ``{"name": str, <args key>: object}``: (call, None) or (None, error)."""
    try:
        obj = json.loads(raw)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError("expected an object with a string 'name'")
        key = next((k for k in args_keys if k in obj), args_keys[0])
        args = obj.get(key, {})
        if not isinstance(args, dict):
            raise ValueError(f"'{key}' must be an object")
    except (ValueError, json.JSONDecodeError) as exc:
        return None, f"unparseable tool call {raw[:80]!r}: {exc}"
    return _call(obj["name"], args), None


def _parse_hermes(body: str) -> ParseResult:
    calls, errors, kept, pos = [], [], [], 0
    for match in re.finditer(r"<tool_call>(.*?)</tool_call>", body, re.S):
        call, error = _json_call(match.group(1).strip())
        if call is None:
            errors.append(error)
            continue
        kept.append(body[pos : match.start()])
        pos = match.end()
        calls.append(call)
    kept.append(body[pos:])
    return ("".join(kept).strip("\n") if calls else body), calls, errors


def _parse_llama3(body: str) -> ParseResult:
    text = body.strip()
    if text.startswith("<|python_tag|>"):
        text = text[len("<|python_tag|>") :].strip()
    if not text.startswith("{"):
        return body, [], []
    calls, pos, decoder = [], 0, json.JSONDecoder()
    while pos < len(text):  # one JSON object, or several separated by ";"
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            return body, [], [f"unparseable tool call {text[pos : pos + 80]!r}: {exc}"]
        call, error = _json_call(json.dumps(obj), ("parameters", "arguments"))
        if call is None:
            return body, [], [error]
        calls.append(call)
        pos = end
        while pos < len(text) and text[pos] in " \n\t;":
            pos += 1
    return "", calls, []


def _parse_mistral(body: str) -> ParseResult:
    start = body.find("[TOOL_CALLS]")
    if start < 0:
        return body, [], []
    raw = body[start + len("[TOOL_CALLS]") :].strip()
    try:
        items = json.loads(raw)
        items = items if isinstance(items, list) else [items]
    except json.JSONDecodeError as exc:
        return body, [], [f"unparseable tool calls {raw[:80]!r}: {exc}"]
    calls = []
    for item in items:
        call, error = _json_call(json.dumps(item))
        if call is None:
            return body, [], [error]
        # Mistral's templates require 9-character alphanumeric call ids: the model's own, else a new one
        given = item.get("id") if isinstance(item, dict) else None
        ok = isinstance(given, str) and len(given) == 9 and given.isalnum()
        call["id"] = given if ok else uuid.uuid4().hex[:9]
        calls.append(call)
    return body[:start].strip("\n"), calls, []


_DS_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(\w+)<｜tool▁sep｜>(.*?)\n```(?:json)?\n(.*?)\n```<｜tool▁call▁end｜>", re.S
)


def _parse_deepseek(body: str) -> ParseResult:
    start = body.find("<｜tool▁calls▁begin｜>")
    if start < 0:
        return body, [], []
    calls, errors = [], []
    for match in _DS_CALL.finditer(body, start):
        call, error = _json_call(json.dumps({"name": match.group(2).strip(), "arguments": _loads(match.group(3))}))
        if call is None:
            errors.append(error)
        else:
            calls.append(call)
    if not calls:
        return body, [], errors or [f"unparseable tool calls {body[start : start + 80]!r}"]
    return body[:start].strip("\n"), calls, errors


def _loads(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw  # reported by _json_call as "'arguments' must be an object"


@dataclass(frozen=True)
class ToolCallFormat:
    """One tool-call family (see the module docstring)."""

    name: str
    open: str  # generated text from which a stream holds back (the parse decides at the end)
    call_open: str  # a forced tool_choice starts the turn with this, then the function name
    call_args: str  # ... then this after a known name (the arguments object follows)
    parse_body: Callable[[str], ParseResult] = field(repr=False)
    closings: tuple[str, ...] = ()  # what a forced call stopped right after its arguments may lack

    def forced(self, name: str | None) -> str:
        """The forced opener: up to the name (``name`` None: the model writes it) or up to the arguments."""
        return self.call_open if name is None else self.call_open + name + self.call_args

    def parse(self, body: str) -> ParseResult:
        return self.parse_body(body)


HERMES = ToolCallFormat("hermes", "<tool_call>", '<tool_call>\n{"name": "', '", "arguments": ', _parse_hermes,
                        ("\n</tool_call>", "}\n</tool_call>"))  # fmt: skip
LLAMA3_JSON = ToolCallFormat("llama3_json", '{"name"', '{"name": "', '", "parameters": ', _parse_llama3, ("}",))
MISTRAL = ToolCallFormat("mistral", "[TOOL_CALLS]", '[TOOL_CALLS][{"name": "', '", "arguments": ', _parse_mistral,
                         ("}]", "]"))  # fmt: skip
DEEPSEEK = ToolCallFormat("deepseek", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>",
                          "\n```json\n", _parse_deepseek, ("\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",))  # fmt: skip
TOOL_FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, DEEPSEEK)}


def detect_tool_format(template: str | None) -> ToolCallFormat:
    """The tool-call family a template's text shows (``hermes`` when none does: the documented default)."""
    text = template or ""
    if "<tool_call>" in text:
        return HERMES
    if "[TOOL_CALLS]" in text:
        return MISTRAL
    if "tool▁calls▁begin" in text:
        return DEEPSEEK
    if '"parameters": ' in text and ("<|start_header_id|>" in text or "ipython" in text):
        return LLAMA3_JSON
    return HERMES


def template_message(message: dict) -> dict:
    """An internal (OpenAI chat) message as a Hugging Face template expects it: text parts joined, tool-call
    arguments as objects."""
    out = dict(message)
    if isinstance(out.get("content"), list):
        out["content"] = chat_template._content_text(out["content"])
    calls = out.get("tool_calls")
    if calls:
        fixed = []
        for call in calls:
            call = dict(call)
            fn = dict(call.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    fn["arguments"] = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    pass  # not JSON: the template gets the string as sent
            call["function"] = fn
            fixed.append(call)
        out["tool_calls"] = fixed
    return out


@dataclass(frozen=True)
class ChatFormat:
    """How one model's conversations become text and its completions become messages (module docstring)."""

    template: JinjaChatTemplate | None = None  # None: the built-in Qwen3 renderer
    tools_format: str = "qwen3"  # the built-in renderer's tools block: qwen3 | compact
    tool_calls: ToolCallFormat = HERMES

    @property
    def name(self) -> str:
        return self.template.name if self.template is not None else f"built-in {self.tools_format} format"

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
    ) -> str:
        """The conversation's text (``apply_chat_template(..., tokenize=False)``); ValueError if it cannot be
        rendered (a 400 in the proxy)."""
        if self.template is None:
            return chat_template.render(messages, tools, add_generation_prompt, enable_thinking, self.tools_format)
        kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        msgs = [template_message(m) for m in messages]
        return self.template.render(msgs, tools or None, add_generation_prompt, **kwargs)


def builtin(tools_format: str = "qwen3") -> ChatFormat:
    if tools_format not in chat_template.TOOLS_FORMATS:
        raise ValueError(f"unknown tools_format {tools_format!r}: expected one of {chat_template.TOOLS_FORMATS}")
    return ChatFormat(None, tools_format, HERMES)


def of(fmt: ChatFormat | str) -> ChatFormat:
    """A ChatFormat, or the built-in one a ``tools_format`` string names."""
    return fmt if isinstance(fmt, ChatFormat) else builtin(fmt)


def from_template(
    source: str,
    special_tokens: dict[str, str] | None = None,
    name: str = "chat template",
    named: dict[str, str] | None = None,
    tool_format: str = "auto",
) -> ChatFormat:
    """The format of a checkpoint's own Jinja template (``tool_format`` "auto": detected from its text)."""
    from gyre_jax.proxy.jinja_template import check_template

    check_template(source, name)
    if tool_format == "auto":
        calls = detect_tool_format(source + "".join((named or {}).values()))
    elif tool_format in TOOL_FORMATS:
        calls = TOOL_FORMATS[tool_format]
    else:
        raise ValueError(f"tool_format={tool_format!r} must be 'auto' or one of {sorted(TOOL_FORMATS)}")
    return ChatFormat(JinjaChatTemplate.of(source, special_tokens, name, named), "qwen3", calls)


def for_tokenizer(tokenizer: Any, chat_template_source: str = "", tools_format: str = "compact",
                  tool_format: str = "auto") -> ChatFormat:  # fmt: skip
    """The chat format a run serves with: ``chat_template_source`` (a template's text) if given, else the
    tokenizer's own template (a GGUF file's or tokenizer_config.json's), else the built-in renderer with
    ``tools_format`` (the byte tokenizer of the tiny models)."""
    own = getattr(tokenizer, "chat_template", None)
    source = chat_template_source or own
    if not source:
        return builtin(tools_format)
    name = (
        "configured chat template" if chat_template_source else f"chat template of {getattr(tokenizer, 'source', '?')}"
    )
    named = {} if chat_template_source else getattr(tokenizer, "chat_templates", {})
    special = getattr(tokenizer, "special_tokens_map", {})
    return from_template(source, special, name, named, tool_format)


def template_override(value: str) -> str:
    """The template text a ``tokenizer.chat_template`` setting names: a ``.jinja`` file's text, a
    ``tokenizer_config.json``'s ``chat_template`` (its ``default`` if named), or the value itself ("" and "builtin"
    as they are). Read by the run's builder, never by the config."""
    from pathlib import Path

    if value in ("", "builtin") or "\n" in value or not value.endswith((".jinja", ".json")):
        return value
    path = Path(value)
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix != ".json":
            return text
        template = json.loads(text).get("chat_template")
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(
            f"config.tokenizer.chat_template={value!r}: cannot read a chat template from it: {exc}"
        ) from None
    if isinstance(template, list):
        template = next(
            (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
        )
    if not isinstance(template, str):
        raise ValueError(f"config.tokenizer.chat_template={value!r} holds no chat_template string")
    return template


def for_settings(tokenizer: Any, chat_template: str = "", tools_format: str = "compact",
                 tool_format: str = "auto") -> ChatFormat:  # fmt: skip
    """The chat format a run serves with, from its ``tokenizer`` config section's settings (``chat_template``:
    "" = the tokenizer's own, "builtin", a file or the text; see ``template_override``)."""
    if chat_template == "builtin":
        return builtin(tools_format)
    return for_tokenizer(tokenizer, template_override(chat_template), tools_format, tool_format)
