"""A checkpoint's own Jinja chat template, rendered exactly as transformers' ``apply_chat_template`` renders it.

What transformers does (``utils/chat_template_utils.py`` and ``PreTrainedTokenizerBase.apply_chat_template``,
5.x), reproduced here without importing transformers:

- the template is compiled in a ``jinja2.sandbox.ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
  ``lstrip_blocks``, the ``loopcontrols`` extension and the ``{% generation %}`` / ``{% endgeneration %}`` tag
  (its body is rendered as is; ``render_with_generation_spans`` also reports where each body landed), a ``tojson``
  filter that does not escape HTML (``ensure_ascii=False``, ``indent``, ``separators``, ``sort_keys``), and the
  globals ``raise_exception`` (raises ``TemplateError``), ``strftime_now``, ``dict`` and a ``namespace`` that
  refuses underscore names;
- each message drops its keys whose value is None; a message with ``reasoning_content`` / ``thinking`` /
  ``reasoning`` gets it under both ``thinking`` and ``reasoning_content``;
- the template sees ``messages``, ``tools`` (None when absent), ``documents``, ``add_generation_prompt``, the
  tokenizer's named special tokens (``bos_token``, ``eos_token``, ...) and every extra keyword
  (``enable_thinking``, ``date_string`` ...), extra keywords overriding special tokens;
- a named set of templates picks ``tool_use`` when tools are given and it exists, else ``default``.

``TemplateError`` from the template (``raise_exception``) or a Jinja error while rendering becomes a ``ValueError``
naming the template, so the proxy answers such a conversation with a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' ``tojson`` filter: ``json.dumps`` without Jinja's HTML escaping."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=32)
def compile_template(source: str):
    """The compiled template (cached by its text), in an environment configured as transformers configures it."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body; records where it landed while tracking."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(track_generation=self.track)
            self._tracking: ContextVar = ContextVar("gyre_generation_tracker", default=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation", []), [], [], body).set_lineno(lineno)

        def _generation(self, caller):
            text = caller()
            tracking = self._tracking.get()
            if tracking is not None:
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

        @contextmanager
        def track(self, blocks: list[str], spans: list[tuple[int, int]]):
            token = self._tracking.set((blocks, spans))
            try:
                yield
            finally:
                self._tracking.reset(token)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """Plain JSON-like data (what the sandboxed template may see), as transformers' ``_plain_template_data``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: None-valued keys dropped, reasoning aliased."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError(f"a chat message must be an object, got {type(message).__name__}")
        m = {k: v for k, v in _plain(message).items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


@dataclass(frozen=True)
class JinjaChatTemplate:
    """A chat template's text (``source``) with the named special tokens it is rendered with.

    ``name`` says where the template came from (a file, GGUF metadata) for error messages; ``named`` holds other
    templates of a named set (``tool_use`` ...), picked as transformers picks them.
    """

    source: str
    special_tokens: tuple[tuple[str, str], ...] = ()
    name: str = "chat template"
    named: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, source: str, special_tokens: Mapping[str, str] | None = None, name: str = "chat template",
           named: Mapping[str, str] | None = None) -> JinjaChatTemplate:  # fmt: skip
        return cls(source, tuple(sorted((special_tokens or {}).items())), name, tuple(sorted((named or {}).items())))

    def pick(self, tools: list[dict] | None) -> str:
        """The template text for a call: the ``tool_use`` template of a named set when tools are given."""
        named = dict(self.named)
        if tools and "tool_use" in named:
            return named["tool_use"]
        return self.source

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        documents: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """``apply_chat_template(messages, tools=tools, documents=documents, add_generation_prompt=...,
        tokenize=False, **kwargs)``."""
        return self.render_with_generation_spans(messages, tools, add_generation_prompt, documents, **kwargs)[0]

    def render_with_generation_spans(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        documents: list[dict] | None = None,
        **kwargs: Any,
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of its ``{% generation %}`` blocks (transformers'
        ``return_assistant_tokens_mask`` spans)."""
        import jinja2

        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ValueError("tools must be JSON schema objects")
        if documents is not None and not all(isinstance(d, Mapping) for d in documents):
            raise ValueError("documents must be a list of objects with 'title' and 'text' keys")
        template = compile_template(self.pick(tools))
        variables = {**dict(self.special_tokens), **_plain(kwargs)}
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        try:
            with template.environment.track_generation(blocks, spans):
                for block in template.generate(
                    messages=template_messages(messages),
                    tools=_plain(list(tools)) if tools is not None else None,
                    documents=_plain(documents),
                    add_generation_prompt=add_generation_prompt,
                    **variables,
                ):
                    blocks.append(block)
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"the {self.name} refused the conversation: {exc}") from None
        except (TypeError, KeyError, AttributeError, IndexError) as exc:
            raise ValueError(f"the {self.name} could not render the conversation: {exc}") from None
        return "".join(blocks), spans


def check_template(source: str, name: str = "chat template") -> None:
    """Raises ValueError (naming ``name``) if ``source`` is not a valid Jinja template."""
    import jinja2

    try:
        compile_template(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"the {name} is not a valid Jinja template: {exc} (line {exc.lineno})") from None
