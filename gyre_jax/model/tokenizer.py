"""The tokenizer interface, the byte-level tokenizer for tiny models, and ``load_tokenizer``.

Every tokenizer has ``encode(text) -> ids``, ``decode(ids) -> text``, ``token_id(token)``, ``eos_ids``,
``pad_id``, ``vocab_size`` and ``token_bytes(id)`` (the raw bytes one id stands for, for per-token
byte lists next to log-probs). ``ByteTokenizer``: ids 0..255 are raw bytes; Qwen3's special/added
tokens follow. Encoding is lossless for any text, and any special-token string that appears in the
text is encoded as its single id (as Hugging Face tokenizers do for added tokens), so a rendered chat
template round-trips exactly: ``decode(encode(s)) == s``. Real checkpoints use their own
``tokenizer.json`` through ``gyre_jax.model.hf_tokenizer.HFTokenizer``, or the tokenizer in a GGUF file's
metadata (``gyre_jax.model.gguf_tokenizer``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Tokenizer(Protocol):
    """What the proxy, the engine and the trainer need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_id(self, token: str) -> int: ...

    def token_bytes(self, token_id: int) -> bytes: ...


def load_tokenizer(kind: str = "byte", path: str | os.PathLike | None = None, gguf_pre: str = "llama.cpp") -> Tokenizer:
    """``kind="byte"``: the ByteTokenizer; ``kind="hf"``: the ``tokenizer.json`` of the checkpoint directory ``path``;
    ``kind="gguf"``: the tokenizer in the metadata of the GGUF file ``path`` (``gguf_pre``: see
    ``gguf_tokenizer.build_tokenizer``)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        if path is None:
            raise ValueError("load_tokenizer(kind='hf') needs path=<checkpoint directory with tokenizer.json>")
        from gyre_jax.model.hf_tokenizer import HFTokenizer

        return HFTokenizer.from_dir(path)
    if kind == "gguf":
        if path is None:
            raise ValueError("load_tokenizer(kind='gguf') needs path=<a .gguf file>")
        from gyre_jax.model.gguf_tokenizer import gguf_tokenizer

        return gguf_tokenizer(path, pre_mode=gguf_pre)
    raise ValueError(f"tokenizer kind {kind!r} is not supported: use 'byte', 'hf' or 'gguf'")


SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)


@dataclass(frozen=True)
class ByteTokenizer:
    """Lossless byte tokenizer: ``vocab_size`` = 256 bytes + special tokens, padded to a multiple of 8."""

    special_tokens: tuple[str, ...] = SPECIAL_TOKENS

    @property
    def num_real_tokens(self) -> int:
        return 256 + len(self.special_tokens)

    @property
    def vocab_size(self) -> int:
        return (self.num_real_tokens + 7) // 8 * 8

    def token_id(self, token: str) -> int:
        try:
            return 256 + self.special_tokens.index(token)
        except ValueError:
            raise KeyError(
                f"{token!r} is not a special token of this tokenizer; known: {self.special_tokens}"
            ) from None

    @property
    def pad_id(self) -> int:
        return self.token_id("<|endoftext|>")

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn."""
        return (self.token_id("<|im_end|>"), self.token_id("<|endoftext|>"))

    def _pattern(self) -> re.Pattern[str]:
        return re.compile("(" + "|".join(re.escape(t) for t in self.special_tokens) + ")")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._pattern().split(text):
            if not piece:
                continue
            if piece in self.special_tokens:
                ids.append(256 + self.special_tokens.index(piece))
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes id ``token_id`` stands for: one raw byte, a special token's UTF-8, or b"" for padding ids."""
        i = int(token_id)
        if 0 <= i < 256:
            return bytes([i])
        if 256 <= i < self.num_real_tokens:
            return self.special_tokens[i - 256].encode("utf-8")
        return b""

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        """Decodes ids to text; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD; ids past the
        real vocabulary (padding rows of the embedding) decode to nothing."""
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                buf.append(i)
                continue
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
            if i < self.num_real_tokens:
                out.append(self.special_tokens[i - 256])
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)
