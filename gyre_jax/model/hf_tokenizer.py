"""A checkpoint's own tokenizer (``tokenizer.json`` through the ``tokenizers`` library) behind the ByteTokenizer interface.

``HFTokenizer.from_dir(path)`` reads ``tokenizer.json``, ``tokenizer_config.json`` (eos / pad tokens,
the chat template: a string or a named list) or ``chat_template.jinja``, and ``generation_config.json`` (eos ids),
and never imports transformers. A GGUF file's tokenizer is built by ``gguf_tokenizer.gguf_tokenizer`` into the
same class. Encoding
matches ``AutoTokenizer(...)(text, add_special_tokens=False)``: special/added-token strings in the
text become their single ids. ``token_bytes(id)`` undoes the byte-level BPE character mapping (or
SentencePiece ``<0xNN>`` byte fallback), so per-token byte lists are exact even where one character
spans several tokens.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizerImpl

from gyre_jax.model.config import ModelInputError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Tokens that end an assistant turn in Qwen's chat format; added to eos_ids when the vocabulary has them.
TURN_END_TOKENS = ("<|im_end|>", "<|endoftext|>")
# The named special tokens transformers passes to a chat template (``special_tokens_map``).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable character -> byte table (the inverse of byte-level BPE's byte -> character map)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _token_content(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
        return value.get("content")
    return value


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` with the ByteTokenizer interface.

    vocab_size: ids the tokenizer can produce (base vocabulary + added tokens); a model's embedding may
    be larger (Qwen3 pads it): ids past ``vocab_size`` decode to nothing and have no bytes.
    """

    def __init__(
        self,
        tokenizer: _HFTokenizerImpl,
        *,
        eos_token: str | None = None,
        pad_token: str | None = None,
        extra_eos_ids: Sequence[int] = (),
        chat_template: str | None = None,
        chat_templates: dict[str, str] | None = None,
        special_tokens: dict[str, str] | None = None,
        source: str = "<memory>",
    ):
        self._tok = tokenizer
        self.source = source
        self.chat_template = chat_template  # the default chat template (None: the checkpoint has none)
        self.chat_templates = dict(chat_templates or {})  # other named templates (e.g. "tool_use")
        # the named special tokens a chat template sees (bos_token, eos_token, ...), as transformers passes them
        self.special_tokens_map = dict(special_tokens or {})
        self._added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self.special_tokens: tuple[str, ...] = tuple(self._added[i] for i in sorted(self._added))
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        self._byte_level = _uses(decoder, "ByteLevel")
        self._byte_table = byte_level_decoder() if self._byte_level else {}
        self._token_bytes: dict[int, bytes] = {}
        eos: list[int] = []
        for tok in [eos_token] if eos_token else []:
            eos.append(self.token_id(tok))
        eos.extend(int(i) for i in extra_eos_ids)
        eos.extend(i for i in (tokenizer.token_to_id(t) for t in TURN_END_TOKENS) if i is not None)
        self._eos_ids = tuple(dict.fromkeys(i for i in eos if 0 <= i < self.vocab_size))
        if not self._eos_ids:
            raise ModelInputError(f"{source}: no end-of-sequence token: set eos_token in {CONFIG_FILE}")
        if pad_token is not None:
            self._pad_id = self.token_id(pad_token)
        else:
            endoftext = tokenizer.token_to_id("<|endoftext|>")
            self._pad_id = endoftext if endoftext is not None else self._eos_ids[0]

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> HFTokenizer:
        """Reads a checkpoint directory's tokenizer.json (+ tokenizer_config.json, generation_config.json)."""
        path = Path(path)
        file = path / TOKENIZER_FILE
        if not file.is_file():
            raise FileNotFoundError(
                f"{file} not found: a checkpoint tokenizer needs tokenizer.json "
                f"(slow-only tokenizers with just vocab files are not supported)"
            )
        try:
            tokenizer = _HFTokenizerImpl.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises plain Exceptions on bad files
            raise ModelInputError(f"{file} could not be read by the tokenizers library: {exc}") from None
        config = _read_json(path / CONFIG_FILE)
        generation = _read_json(path / GENERATION_CONFIG_FILE)
        eos_from_generation = generation.get("eos_token_id")
        if isinstance(eos_from_generation, int):
            eos_from_generation = [eos_from_generation]
        template = config.get("chat_template")
        named: dict[str, str] = {}
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.pop("default", None)
        if template is None and (path / CHAT_TEMPLATE_FILE).is_file():
            template = (path / CHAT_TEMPLATE_FILE).read_text()
        special = {k: _token_content(config.get(k)) for k in SPECIAL_TOKEN_NAMES}
        return cls(
            tokenizer,
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            extra_eos_ids=eos_from_generation or (),
            chat_template=template,
            chat_templates={k: v for k, v in named.items() if isinstance(k, str) and isinstance(v, str)},
            special_tokens={k: v for k, v in special.items() if isinstance(v, str)},
            source=str(path),
        )

    # -- the tokenizer interface ---------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def id_limit(self) -> int:
        """One past the largest id the tokenizer can produce (base vocabulary and added tokens): a model's
        embedding needs at least this many rows."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @property
    def num_real_tokens(self) -> int:
        return self.vocab_size

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn: the configured eos token, generation_config's, <|im_end|>, <|endoftext|>."""
        return self._eos_ids

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Special tokens are kept; invalid UTF-8 becomes U+FFFD; ids outside the vocabulary decode to nothing."""
        n = self.vocab_size
        return self._tok.decode([int(i) for i in ids if 0 <= int(i) < n], skip_special_tokens=False)

    def token_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(f"{token!r} is not a token of the tokenizer in {self.source}")
        return i

    def token_bytes(self, token_id: int) -> bytes:
        i = int(token_id)
        if i not in self._token_bytes:
            self._token_bytes[i] = self._bytes_of(i)
        return self._token_bytes[i]

    def _bytes_of(self, i: int) -> bytes:
        if i in self._added:
            return self._added[i].encode("utf-8")
        piece = self._tok.id_to_token(i) if 0 <= i < self.vocab_size else None
        if piece is None:
            return b""
        if self._byte_level:
            try:
                return bytes(self._byte_table[c] for c in piece)
            except KeyError:  # not a byte-level piece after all
                return piece.encode("utf-8")
        match = _BYTE_FALLBACK.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece word boundary


class TokenizerMismatchError(ModelInputError):
    """The tokenizer produces ids the model has no embedding row for."""


def check_fits_model(tokenizer: HFTokenizer, vocab_size: int, model_source: str) -> None:
    """Raises TokenizerMismatchError unless every id ``tokenizer`` can produce is < ``vocab_size`` (the model's
    embedding rows; a larger embedding, as Qwen3 pads it, is fine). An id past it would embed as garbage (NaN on
    some backends) and every execution using it would be excluded or trained on nonsense."""
    n = tokenizer.id_limit
    if n > vocab_size:
        raise TokenizerMismatchError(
            f"{tokenizer.source if tokenizer.source.endswith('.gguf') else Path(tokenizer.source) / TOKENIZER_FILE} has {n} token ids (up to {n - 1}) but the model has "
            f"vocab_size={vocab_size} ({model_source}): ids {vocab_size}..{n - 1} have no embedding row. Use the "
            "tokenizer that belongs to these weights"
        )


def _uses(decoder: dict, kind: str) -> bool:
    if decoder.get("type") == kind:
        return True
    return any(_uses(d, kind) for d in decoder.get("decoders") or [])


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelInputError(f"{file} is not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else {}
