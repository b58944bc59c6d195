"""A GGUF checkpoint's own tokenizer and chat template, from the file's metadata (``tokenizer.*`` keys).

``read_gguf_tokenizer(path)`` reads only the metadata (tokens, merges, token types, special ids, the chat
template(s)); it never touches a tensor. ``gguf_tokenizer(path)`` builds a Hugging Face ``tokenizers`` object from
it behind the ``HFTokenizer`` interface, so the proxy, engine and trainer use it exactly as a ``tokenizer.json``.

Supported vocabularies (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE (SmolLM2, Llama 3, Qwen2/3, ...). By default the pre-tokenizer follows llama.cpp's
  reading of ``tokenizer.ggml.pre`` (``PRE_TOKENIZERS`` below), which reproduces the model's own
  ``tokenizer.json`` (SmolLM2's ``smollm``: each digit split off, then GPT-2's regex). transformers' GGUF
  conversion ignores ``tokenizer.ggml.pre`` and splits with GPT-2's regex alone; ``pre_mode="transformers"``
  does the same and then equals it token for token (tests/proxy/test_gguf_tokenizer.py). The two differ only
  where GPT-2's regex would join a digit to what precedes it in one piece (``">\n\n2"``: SmolLM2's own tokenizer
  gives ``"\n\n"`` then ``"2"``, transformers' conversion ``"\n"``, ``"\n"``, ``"2"``).
- ``llama``: SentencePiece-style BPE with byte fallback (Llama 2, Mistral v0.1-0.3), merges derived from the
  scores as transformers' ``GGUFTokenizerSkeleton`` derives them.

Token types (llama.cpp's ``LLAMA_TOKEN_TYPE_*``): 3 (control) tokens become special added tokens (encoded from
their text as one id, as ``tokenizer.json`` added tokens are); 4 (user-defined) become plain added tokens.

This module keeps its own GGUF metadata reading (tokenizer and template only); the GGUF tensor loader lives
beside it in ``gyre_jax/model/`` and may later share one reader.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from gyre_jax.model.config import ModelInputError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by ``tokenizer.ggml.pre``.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {  # pre -> the regex splits applied in order (then byte-level)
    "default": (_GPT2,),
    "gpt-2": (_GPT2,),
    "gpt2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),
    "starcoder": (r"\p{N}", _GPT2),
    "refact": (r"\p{N}", _GPT2),
    "codeshell": (r"\p{N}", _GPT2),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "smaug-bpe": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
}


@dataclass(frozen=True)
class GGUFTokenizerData:
    """The ``tokenizer.*`` metadata of a GGUF file (ids as the file numbers them)."""

    source: str
    architecture: str
    model: str  # tokenizer.ggml.model: gpt2 | llama | ...
    pre: str  # tokenizer.ggml.pre ("default" when absent)
    tokens: list[str]
    token_types: list[int]
    merges: list[str]  # "a b" pairs, highest priority first (gpt2; may be empty for llama)
    scores: list[float] | None
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    eot_id: int | None = None  # end of turn (Llama 3's <|eot_id|>), when the file names one
    eom_id: int | None = None
    add_bos: bool | None = None
    add_space_prefix: bool | None = None
    chat_template: str | None = None  # tokenizer.chat_template
    chat_templates: dict[str, str] = field(default_factory=dict)  # tokenizer.chat_template.<name> (e.g. tool_use)

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None or not 0 <= token_id < len(self.tokens) else self.tokens[token_id]


# GGUF metadata value types (gguf's GGUFValueType) -> struct format of a scalar
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Header:
    """A GGUF file's metadata key/values, read straight from its header (the tensors are never touched).

    ``gguf.GGUFReader`` would do, but it indexes every tensor and wraps each of the ~100K vocabulary strings in
    numpy views first (8 s for SmolLM2 on this machine); this reads the same values in a fraction of a second."""

    def __init__(self, path: Path):
        import struct

        self.values: dict[str, object] = {}
        with open(path, "rb") as f:
            head = f.read(24)
            if len(head) < 24 or head[:4] != b"GGUF":
                raise ValueError("no GGUF magic at the start of the file")
            version, _, n_kv = struct.unpack("<IQQ", head[4:])
            if version < 2:
                raise ValueError(f"GGUF version {version} is not supported (2 and later are)")
            self._f, self._struct = f, struct
            for _ in range(n_kv):
                key = self._string()
                self.values[key] = self._value(self._u32())

    def _read(self, n: int) -> bytes:
        data = self._f.read(n)
        if len(data) != n:
            raise ValueError("the metadata ends early (a truncated file)")
        return data

    def _u32(self) -> int:
        return self._struct.unpack("<I", self._read(4))[0]

    def _string(self) -> str:
        (n,) = self._struct.unpack("<Q", self._read(8))
        return self._read(n).decode("utf-8", errors="replace")

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, (n,) = self._u32(), self._struct.unpack("<Q", self._read(8))
            if item in _SCALARS:
                fmt = _SCALARS[item]
                size = self._struct.calcsize("<" + fmt)
                return list(self._struct.unpack(f"<{n}{fmt}", self._read(n * size)))
            return [self._value(item) for _ in range(n)]
        if kind in _SCALARS:
            fmt = "<" + _SCALARS[kind]
            return self._struct.unpack(fmt, self._read(self._struct.calcsize(fmt)))[0]
        raise ValueError(f"unknown metadata value type {kind}")


def read_gguf_tokenizer(path: str | os.PathLike) -> GGUFTokenizerData:
    """Reads the tokenizer and chat-template metadata of the GGUF file ``path`` (no tensor is read)."""
    path = Path(path)
    if not path.is_file():
        raise ModelInputError(f"{path}: no such GGUF file (config.tokenizer.path or the model's GGUF path)")
    try:
        meta = _Header(path).values
    except (ValueError, OSError) as exc:
        raise ModelInputError(f"{path} could not be read as a GGUF file: {exc}") from None
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise ModelInputError(
            f"{path} has no tokenizer in its metadata (tokenizer.ggml.model / tokenizer.ggml.tokens): use a "
            "tokenizer.json directory (config.tokenizer.kind='hf')"
        )
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [1] * n
    templates = {
        key[len("tokenizer.chat_template.") :]: str(value)
        for key, value in meta.items()
        if key.startswith("tokenizer.chat_template.")
    }

    def token_id(key: str) -> int | None:
        value = meta.get(key)
        return int(value) if value is not None and 0 <= int(value) < n else None

    scores = meta.get("tokenizer.ggml.scores")
    template = meta.get("tokenizer.chat_template")
    return GGUFTokenizerData(
        source=str(path),
        architecture=str(meta.get("general.architecture", "")),
        model=str(model),
        pre=str(meta.get("tokenizer.ggml.pre", "default")),
        tokens=[str(t) for t in tokens],
        token_types=[int(t) for t in types],
        merges=[str(m) for m in (meta.get("tokenizer.ggml.merges") or [])],
        scores=None if scores is None else [float(s) for s in scores],
        bos_id=token_id("tokenizer.ggml.bos_token_id"),
        eos_id=token_id("tokenizer.ggml.eos_token_id"),
        unk_id=token_id("tokenizer.ggml.unknown_token_id"),
        pad_id=token_id("tokenizer.ggml.padding_token_id"),
        eot_id=token_id("tokenizer.ggml.eot_token_id"),
        eom_id=token_id("tokenizer.ggml.eom_token_id"),
        add_bos=meta.get("tokenizer.ggml.add_bos_token"),
        add_space_prefix=meta.get("tokenizer.ggml.add_space_prefix"),
        chat_template=None if template is None else str(template),
        chat_templates=templates,
    )


def _added_tokens(data: GGUFTokenizerData):
    from tokenizers import AddedToken

    special = [
        AddedToken(t, normalized=False, special=True) for t, k in zip(data.tokens, data.token_types) if k == CONTROL
    ]
    plain = [AddedToken(t, normalized=False, special=False) for t, k in zip(data.tokens, data.token_types) if k == USER_DEFINED]  # fmt: skip
    return special, plain


PRE_MODES = ("llama.cpp", "transformers")  # whose reading of tokenizer.ggml.pre a gpt2 vocabulary follows


def _byte_level_bpe(data: GGUFTokenizerData, pre_mode: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    splits = PRE_TOKENIZERS.get(data.pre) if pre_mode == "llama.cpp" else (_GPT2,)
    if splits is None:
        raise ModelInputError(
            f"{data.source}: tokenizer.ggml.pre={data.pre!r} is not a pre-tokenizer this reader knows "
            f"({sorted(PRE_TOKENIZERS)}); use the checkpoint's tokenizer.json (config.tokenizer.kind='hf')"
        )
    vocab = {t: i for i, t in enumerate(data.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in data.merges]
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    steps = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges of a SentencePiece BPE vocabulary from its scores, as transformers' GGUFTokenizerSkeleton builds them:
    every split of every piece into two known pieces, ordered by the piece's score (then the halves' scores)."""
    score = {t: s for t, s in zip(tokens, scores)}
    merges = []
    for piece, piece_score in score.items():
        local = [
            (piece[:i], piece[i:], piece_score)
            for i in range(1, len(piece))
            if piece[:i] in score and piece[i:] in score
        ]
        local.sort(key=lambda x: (score[x[0]], score[x[1]]), reverse=True)
        merges.extend(local)
    merges.sort(key=lambda x: x[2], reverse=True)  # stable: equal scores keep their order
    return [(a, b) for a, b, _ in merges]


def _sentencepiece_bpe(data: GGUFTokenizerData):
    from tokenizers import Tokenizer, decoders, models, normalizers

    if data.scores is None:
        raise ModelInputError(f"{data.source}: a 'llama' vocabulary needs tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(data.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in data.merges] if data.merges else _spm_merges(data.tokens, data.scores)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=data.token(data.unk_id), fuse_unk=True, byte_fallback=True))
    prefix = data.add_space_prefix is not False
    steps = ([normalizers.Prepend("\u2581")] if prefix else []) + [normalizers.Replace(" ", "\u2581")]
    tok.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(dec + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return tok


def build_tokenizer(data: GGUFTokenizerData, pre_mode: str = "llama.cpp"):
    """A ``tokenizers.Tokenizer`` equal to the vocabulary the GGUF metadata describes (see the module docstring).

    ``pre_mode`` (gpt2 vocabularies): ``"llama.cpp"`` splits as llama.cpp reads ``tokenizer.ggml.pre`` (the
    model's own tokenizer); ``"transformers"`` splits with GPT-2's regex alone, as transformers' GGUF conversion
    does whatever the file says."""
    if pre_mode not in PRE_MODES:
        raise ValueError(f"pre_mode={pre_mode!r} must be one of {PRE_MODES}")
    if data.model == "gpt2":
        tok = _byte_level_bpe(data, pre_mode)
    elif data.model == "llama":
        tok = _sentencepiece_bpe(data)
    else:
        raise ModelInputError(
            f"{data.source}: tokenizer.ggml.model={data.model!r} is not supported (gpt2 and llama are); use the "
            "checkpoint's tokenizer.json (config.tokenizer.kind='hf')"
        )
    special, plain = _added_tokens(data)
    if special:
        tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)
    return tok


def special_tokens_map(data: GGUFTokenizerData) -> dict[str, str]:
    """The named special tokens a chat template sees (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``)."""
    named = {"bos_token": data.bos_id, "eos_token": data.eos_id, "unk_token": data.unk_id, "pad_token": data.pad_id}
    return {name: data.tokens[i] for name, i in named.items() if i is not None}


def gguf_tokenizer(path: str | os.PathLike, pre_mode: str = "llama.cpp"):
    """The GGUF file's own tokenizer (``HFTokenizer``), its chat template(s) and named special tokens attached
    (``pre_mode``: see ``build_tokenizer``)."""
    from gyre_jax.model.hf_tokenizer import HFTokenizer

    data = read_gguf_tokenizer(path)
    extra_eos = [i for i in (data.eot_id, data.eom_id) if i is not None]
    return HFTokenizer(
        build_tokenizer(data, pre_mode),
        eos_token=data.token(data.eos_id),
        pad_token=data.token(data.pad_id),
        extra_eos_ids=extra_eos,
        chat_template=data.chat_template,
        chat_templates=data.chat_templates,
        special_tokens=special_tokens_map(data),
        source=data.source,
    )
