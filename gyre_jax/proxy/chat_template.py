"""The built-in Qwen3 chat format: render messages + tools to text, and parse model output back.

A checkpoint's own template goes through ``chat_format.ChatFormat`` (Jinja, ``jinja_template``); this renderer is
its proven-equal fast path for the official Qwen3 template and the tiny models' format (``compact`` tools).

``render`` follows the Qwen3 Jinja template (system prompt with ``<tools>``, ``<tool_call>`` JSON
blocks, tool results grouped into one user turn inside ``<tool_response>``, thinking kept only after
the last user query). ``parse_completion`` turns generated text into content, reasoning and tool
calls. The proxy never re-tokenizes an assistant turn the model produced (token-in/token-out, ``tito``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


TOOLS_FORMATS = ("qwen3", "compact")


def _compact_signature(tool: dict) -> str:
    """``name(arg: type, opt?: type) - description``: one line per tool, for tiny byte-level models."""
    fn = tool.get("function", tool)
    params = fn.get("parameters") or {}
    required = set(params.get("required") or [])
    args = []
    for name, spec in (params.get("properties") or {}).items():
        kind = spec.get("type", "any") if isinstance(spec, dict) else "any"
        args.append(f"{name}{'' if name in required else '?'}: {kind}")
    description = fn.get("description") or ""
    return f"{fn.get('name', '')}({', '.join(args)})" + (f" - {description}" if description else "")


def tools_block(tools: list[dict], tools_format: str) -> str:
    """The text the system turn carries about ``tools`` (after the system prompt, before ``<|im_end|>``)."""
    if tools_format == "qwen3":
        return _TOOLS_PREAMBLE + "".join("\n" + tojson(t) for t in tools) + _TOOLS_POSTAMBLE
    if tools_format == "compact":
        lines = "".join(_compact_signature(t) + "\n" for t in tools)
        return (
            "# Tools\n<tools>\n"
            + lines
            + '</tools>\nCall a tool as <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call>'
        )
    raise ValueError(f"unknown tools_format {tools_format!r}: expected one of {TOOLS_FORMATS}")


def tojson(x: Any) -> str:
    """Jinja's ``tojson`` as Hugging Face's chat templates define it."""
    return json.dumps(x, ensure_ascii=False)


def _content_text(content: Any) -> str:
    """OpenAI content may be a string, None, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                raise ValueError(f"unsupported content part {part!r}: only text parts are supported")
        return "".join(parts)
    raise ValueError(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def _is_tool_response_turn(message: dict) -> bool:
    text = _content_text(message.get("content"))
    return text.startswith("<tool_response>") and text.endswith("</tool_response>")


def _last_query_index(messages: list[dict]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        m = messages[index]
        if m.get("role") == "user" and not _is_tool_response_turn(m):
            return index
    return len(messages) - 1


def _render_tool_call(call: dict) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    args_text = args if isinstance(args, str) else tojson(args)
    return '<tool_call>\n{"name": "' + str(fn.get("name", "")) + '", "arguments": ' + args_text + "}\n</tool_call>"


def _system_head(messages: list[dict], tools: list[dict] | None, tools_format: str) -> tuple[list[str], str, int]:
    """The system turn: (its segments, the text that prefixes the first message's segment, the first index left).

    With tools but no system message, the tools' system turn belongs to the first message's segment.
    """
    has_system = bool(messages) and messages[0].get("role") == "system"
    if not tools:
        if has_system:
            return [IM_START + "system\n" + _content_text(messages[0].get("content")) + IM_END + "\n"], "", 1
        return [], "", 0
    head = IM_START + "system\n"
    if has_system:
        head += _content_text(messages[0].get("content")) + "\n\n"
    head += tools_block(tools, tools_format) + IM_END + "\n"
    return ([head], "", 1) if has_system else ([], head, 0)


def _render_assistant(message: dict, is_last: bool, after_last_query: bool) -> str:
    """An assistant turn: thinking (kept after the last user query), content, then its tool calls."""
    content = _content_text(message.get("content"))
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
    if after_last_query and (is_last or reasoning):
        text = IM_START + "assistant\n<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
    else:
        text = IM_START + "assistant\n" + content
    for k, call in enumerate(message.get("tool_calls") or []):
        if (k == 0 and content) or k > 0:
            text += "\n"
        text += _render_tool_call(call)
    return text + IM_END + "\n"


def _render_message(messages: list[dict], index: int, last_query: int) -> str:
    """The text segment of ``messages[index]``; consecutive tool results share one user turn."""
    m = messages[index]
    role = m.get("role")
    if role == "user" or role == "system":
        return IM_START + role + "\n" + _content_text(m.get("content")) + IM_END + "\n"
    if role == "assistant":
        return _render_assistant(m, index == len(messages) - 1, index > last_query)
    if role == "tool":
        text = ""
        if index == 0 or messages[index - 1].get("role") != "tool":
            text += IM_START + "user"
        text += "\n<tool_response>\n" + _content_text(m.get("content")) + "\n</tool_response>"
        if index == len(messages) - 1 or messages[index + 1].get("role") != "tool":
            text += IM_END + "\n"
        return text
    raise ValueError(f"unknown message role {role!r}: expected system, user, assistant or tool")


def render_segments(messages: list[dict], tools: list[dict] | None = None, tools_format: str = "qwen3") -> list[str]:
    """Renders each message to its text segment (same length as ``messages``), with full context.

    ``"".join(segments)`` equals the Qwen3 template's output without the generation prompt. With
    ``tools_format="compact"`` the tools are listed as one-line signatures instead of JSON schemas (the
    chat format of the tiny byte-level models, where every byte is a token); all else is identical.
    """
    if not messages and not tools:
        return []
    segments, prefix, start = _system_head(messages, tools, tools_format)
    last_query = _last_query_index(messages)
    for index in range(start, len(messages)):
        segments.append(prefix + _render_message(messages, index, last_query))
        prefix = ""
    if prefix:  # tools but no messages at all
        segments.append(prefix)
    return segments


def generation_prompt(enable_thinking: bool | None = None) -> str:
    text = IM_START + "assistant\n"
    if enable_thinking is False:
        text += "<think>\n\n</think>\n\n"
    return text


def render(
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    tools_format: str = "qwen3",
) -> str:
    """The whole prompt text, as ``tokenizer.apply_chat_template(..., tokenize=False)`` gives it."""
    text = "".join(render_segments(messages, tools, tools_format))
    if add_generation_prompt:
        text += generation_prompt(enable_thinking)
    return text


@dataclass
class ParsedCompletion:
    """A completion split into what the API returns."""

    content: str
    reasoning: str | None = None
    tool_calls: list[dict] = field(
        default_factory=list
    )  # OpenAI form: {"id", "type", "function": {"name", "arguments": str}}
    tool_call_errors: list[str] = field(default_factory=list)


_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_completion(text: str, parse_body=None) -> ParsedCompletion:
    """Splits generated text (special tokens decoded as text, stop token removed) into parts.

    A tool-call block whose body is not a JSON object with a string ``name`` stays in the
    content and is reported in ``tool_call_errors``: the harness sees what the model wrote.
    ``parse_body`` (``chat_format.ToolCallFormat.parse``): the tool-call family's parse of the text after the
    reasoning, ``(content, calls, errors)``; None: ``<tool_call>`` blocks (hermes).
    """
    reasoning = None
    body = text
    if "</think>" in body:
        head, body = body.split("</think>", 1)
        reasoning = head.split("<think>")[-1].strip("\n")
        body = body.lstrip("\n")
    if parse_body is not None:
        content, calls, errors = parse_body(body)
        return ParsedCompletion(content=content, reasoning=reasoning, tool_calls=calls, tool_call_errors=errors)
    calls: list[dict] = []
    errors: list[str] = []
    kept: list[str] = []
    pos = 0
    for match in _TOOL_CALL_RE.finditer(body):
        raw = match.group(1).strip()
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise ValueError("expected an object with a string 'name'")
            args = obj.get("arguments", {})
            if not isinstance(args, dict):
                raise ValueError("'arguments' must be an object")
        except (ValueError, json.JSONDecodeError) as exc:
            errors.append(f"unparseable tool call {raw[:80]!r}: {exc}")
            continue
        kept.append(body[pos : match.start()])
        pos = match.end()
        calls.append(
            {
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {"name": obj["name"], "arguments": tojson(args)},
            }
        )
    kept.append(body[pos:])
    content = "".join(kept).strip("\n") if calls else body
    return ParsedCompletion(content=content, reasoning=reasoning, tool_calls=calls, tool_call_errors=errors)
