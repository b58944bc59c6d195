"""Live replies: a streamed turn's tokens turned into text deltas as the serving loop samples them.

``TextStream`` detokenizes incrementally and safely: it never emits half a UTF-8 character (text whose
decoding still ends in U+FFFD is held until the next token completes it, or until the end) and never the
text of a stop id. ``ReplySplitter`` splits a chat completion's text into reasoning and content deltas as
``parse_completion`` will split the whole: the ``<think>`` block streams as reasoning, what follows as
content, and from a ``<tool_call>`` opener on the text is held back (the parsed calls go out at the end).
With stop strings, ``TextStream`` holds back the text a stop string could still cut off (see there), so no
delta goes past the committed cut. ``LiveReply`` joins them for one turn (a forced tool call's opener
first) and, at the end, reconciles what was streamed with the committed parse,
so that what the client accumulated from the deltas is exactly the committed completion.

Rules at the end (``ReplySplitter.finish``): the committed parse is the one of the whole text (as a
non-streamed call gets) whenever each streamed part is a prefix of it, which is the normal case; the close
then sends the rest of each part. Otherwise (a ``<think>`` block cut off by the token budget, a stray
``</think>`` in content, newlines streamed before a tool call that the whole-text parse strips) the
committed parse is the streamed view: the streamed parts, then what the splitter still held.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gyre_jax.proxy.chat_template import ParsedCompletion
from gyre_jax.proxy.turns import parse_text

logger = logging.getLogger(__name__)

THINK_OPEN, THINK_CLOSE, CALL_OPEN = "<think>", "</think>", "<tool_call>"
REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to


def held_tail(text: str, marker: str) -> int:
    """Length of the longest proper suffix of ``text`` that is a prefix of ``marker`` (it may become the marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class TextStream:
    """Token ids in, complete text out: ``feed(ids) -> new text``, ``finish(final_text) -> the rest``.

    ``decode`` maps ids to text (the tokenizer's); ids in ``skip_ids`` (stop ids) are never decoded. Only the
    ids since the last clean boundary (a decoding with no trailing U+FFFD) are decoded again per call, so
    the cost per token stays small. ``prefix``: text the completion starts with that no id makes (a forced
    tool call's opener), counted as already emitted.

    With ``stops`` (the request's stop strings, matched in the generated text only) the text goes out only up
    to a whole-token boundary (a clean boundary after one of the ids) that no stop string can cut off: before
    the earliest stop string found, and at least ``len(longest stop) - 1`` characters before the end (a stop
    string completed by later tokens starts there at the earliest). A stop string starting inside a token
    drops that whole token from the committed text (``turns.committed_text``), so the text of the token the
    boundary falls in is held too. What is held goes out in ``finish``, up to the committed cut.
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        skip_ids: Sequence[int] = (),
        stops: Sequence[str] = (),
        prefix: str = "",
    ) -> None:
        self._decode = decode
        self._skip = frozenset(int(i) for i in skip_ids)
        self._window: list[int] = []  # ids since the last clean boundary
        self._sent = 0  # characters of decode(window) already emitted
        self.text = prefix  # everything emitted so far
        self._stops = tuple(stops)
        self._hold = max((len(stop) for stop in self._stops), default=1) - 1
        self._held = ""  # with stops: clean text decoded and not emitted yet
        self._bounds: list[int] = []  # with stops: offsets in _held where a token ends at a clean boundary

    def feed(self, ids: Sequence[int]) -> str:
        kept = [int(i) for i in ids if int(i) not in self._skip]
        if self._stops:
            return self._feed_held(kept)
        self._window.extend(kept)
        if not self._window:
            return ""
        text = self._decode(self._window)
        safe = len(text.rstrip(REPLACEMENT))
        out = text[self._sent : safe] if safe > self._sent else ""
        if safe == len(text):
            self._window, self._sent = [], 0
        else:
            self._sent = max(self._sent, safe)
        self.text += out
        return out

    def _feed_held(self, ids: list[int]) -> str:
        """``feed`` with stop strings: token by token, emitting only what no stop string can cut off."""
        for token_id in ids:
            self._window.append(token_id)
            text = self._decode(self._window)
            if not text.endswith(REPLACEMENT):
                self._held += text
                self._bounds.append(len(self._held))
                self._window = []
        found = [self._held.find(stop) for stop in self._stops]
        limit = min([at for at in found if at >= 0] + [len(self._held) - self._hold])
        cut = max((bound for bound in self._bounds if bound <= limit), default=0)
        out, self._held = self._held[:cut], self._held[cut:]
        self._bounds = [bound - cut for bound in self._bounds if bound > cut]
        self.text += out
        return out

    def finish(self, final_text: str) -> str:
        """The rest of the text, given the completion's committed text (``turns.committed_text``: the prefix, then
        the kept ids decoded)."""
        if final_text.startswith(self.text):
            rest = final_text[len(self.text) :]
        else:  # a tokenizer whose decoding is not additive at character boundaries: keep what was streamed
            logger.warning("streamed text is not a prefix of the decoded completion; closing with the held bytes")
            rest = "" if self._stops else self._decode(self._window)[self._sent :] if self._window else ""
        self.text += rest
        self._window, self._sent, self._held, self._bounds = [], 0, "", []
        return rest


class ReplySplitter:
    """A chat completion's text, fed in pieces, split into (reasoning, content) deltas; see the module rules.

    ``parse_tools`` False: tool-call text is plain content (nothing is held back for it). ``call_open``: where
    the model's tool-call family starts a call (``chat_format.ToolCallFormat.open``).
    """

    def __init__(self, parse_tools: bool = True, call_open: str = CALL_OPEN) -> None:
        self.parse_tools = parse_tools
        self.call_open = call_open
        self.mode = "start"  # start | think | after_think | content | calls
        self.thought = False  # a <think> block opened the completion
        self.buf = ""  # text seen and not emitted yet
        self.reasoning = ""  # emitted reasoning
        self.content = ""  # emitted content

    def feed(self, text: str) -> tuple[str, str]:
        """New (reasoning, content) text for ``text`` appended to the completion."""
        r0, c0 = len(self.reasoning), len(self.content)
        self.buf += text
        while self._advance():
            pass
        return self.reasoning[r0:], self.content[c0:]

    def _advance(self) -> bool:
        """One state transition (or the emission that ends a call); True if another may follow."""
        buf = self.buf
        if self.mode == "start":
            if buf.startswith(THINK_OPEN):
                self.buf, self.mode, self.thought = buf[len(THINK_OPEN) :], "think", True
                return True
            if THINK_OPEN.startswith(buf):
                return False  # still possibly "<think>"
            self.mode = "content"
            return True
        if self.mode == "think":
            if not self.reasoning:
                buf = self.buf = buf.lstrip("\n")
            end = buf.find(THINK_CLOSE)
            if end >= 0:
                self.reasoning += buf[:end].rstrip("\n")
                self.buf, self.mode = buf[end + len(THINK_CLOSE) :], "after_think"
                return True
            self._emit_reasoning(len(buf[: len(buf) - held_tail(buf, THINK_CLOSE)].rstrip("\n")))
            return False
        if self.mode == "after_think":
            self.buf = buf.lstrip("\n")
            if self.buf:
                self.mode = "content"
            return bool(self.buf)
        if self.mode == "content":
            if self.parse_tools and (start := buf.find(self.call_open)) >= 0:
                self._emit_content(len(buf[:start].rstrip("\n")))
                self.mode = "calls"
                return False
            keep = held_tail(buf, self.call_open) if self.parse_tools else 0
            self._emit_content(len(buf[: len(buf) - keep].rstrip("\n")) if self.parse_tools else len(buf))
        return False

    def _emit_reasoning(self, n: int) -> None:
        self.reasoning += self.buf[:n]
        self.buf = self.buf[n:]

    def _emit_content(self, n: int) -> None:
        self.content += self.buf[:n]
        self.buf = self.buf[n:]

    def finish(self, whole: ParsedCompletion) -> tuple[ParsedCompletion, str, str]:
        """(committed parse, reasoning rest, content rest), given ``whole``, the parse of the whole text."""
        reasoning = whole.reasoning or ""
        if (
            reasoning.startswith(self.reasoning)
            and (whole.reasoning is not None) == self.thought
            and whole.content.startswith(self.content)
        ):
            return whole, reasoning[len(self.reasoning) :], whole.content[len(self.content) :]
        return self._streamed_view()

    def _streamed_view(self) -> tuple[ParsedCompletion, str, str]:
        """The committed parse when the whole-text parse disagrees with what was streamed: the streamed parts,
        then what is still held (an open <think> block's text as reasoning; held tool calls parsed)."""
        rest_reasoning, rest_content, calls, errors = "", "", [], []
        if self.mode == "think":
            rest_reasoning = self.buf.rstrip("\n")
        elif self.mode == "calls":
            held = parse_text(self.buf, self.parse_tools)
            rest_content, calls, errors = held.content, held.tool_calls, held.tool_call_errors
        elif self.mode != "after_think":
            rest_content = self.buf
        parsed = ParsedCompletion(
            content=self.content + rest_content,
            reasoning=self.reasoning + rest_reasoning if self.thought else None,
            tool_calls=calls,
            tool_call_errors=errors,
        )
        return parsed, rest_reasoning, rest_content


@dataclass(frozen=True)
class Pieces:
    """New text of a streamed turn: ``text`` raw (every character, reasoning and tool-call text included),
    ``reasoning`` and ``content`` as a chat reply splits it (for a raw completion, ``content == text``)."""

    text: str = ""
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.text or self.reasoning or self.content)


class LiveReply:
    """One streamed turn's text as its tokens arrive: ``feed(ids) -> Pieces``; ``finish`` reconciles at the end.

    ``chat``: split into reasoning / content (a chat turn) or not (a raw completion). ``stops``: the request's
    stop strings (``TextStream``). ``forced``: the text a ``tool_choice`` forced the completion to start with;
    ``start`` gives its pieces (the first delta: a tool call's opener, which a chat reply holds back and sends
    parsed as the tool call at the end).
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        stop_ids: Sequence[int],
        chat: bool,
        parse_tools: bool,
        stops: Sequence[str] = (),
        forced: str = "",
        call_open: str = CALL_OPEN,
    ) -> None:
        self.text = TextStream(decode, stop_ids, stops, prefix=forced)
        self.splitter = ReplySplitter(parse_tools, call_open) if chat else None
        self.tokens = 0  # token ids fed so far
        self.forced = forced

    def start(self) -> Pieces:
        """The pieces of the forced text (empty if none): sent before any token."""
        if not self.forced:
            return Pieces()
        if self.splitter is None:
            return Pieces(self.forced, "", self.forced)
        reasoning, content = self.splitter.feed(self.forced)
        return Pieces(self.forced, reasoning, content)

    def feed(self, ids: Sequence[int]) -> Pieces:
        self.tokens += len(ids)
        text = self.text.feed(ids)
        if self.splitter is None:
            return Pieces(text, "", text)
        reasoning, content = self.splitter.feed(text)
        return Pieces(text, reasoning, content)

    def finish(
        self, ids: Sequence[int], final_text: str, whole: ParsedCompletion | None
    ) -> tuple[Pieces, ParsedCompletion | None]:
        """(the closing pieces, the committed parse) given the completion's ids [N] (those not fed yet are fed
        here: tokens a backend did not stream), its whole text and its parse (None for a raw completion)."""
        late = self.feed(ids[self.tokens :])
        rest = self.text.finish(final_text)
        if self.splitter is None or whole is None:
            return Pieces(late.text + rest, "", late.content + rest), whole
        reasoning, content = self.splitter.feed(rest)
        parsed, rest_reasoning, rest_content = self.splitter.finish(whole)
        closing = Pieces(late.text + rest, late.reasoning + reasoning + rest_reasoning,
                         late.content + content + rest_content)  # fmt: skip
        return closing, parsed
