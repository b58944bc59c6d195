"""HFTokenizer: a checkpoint's tokenizer.json gives the ids, decodes and token bytes transformers gives
(golden fixtures from scripts/make_model_fixtures.py), behind the ByteTokenizer interface."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_jax.model.hf_tokenizer import HFTokenizer
from gyre_jax.model.tokenizer import ByteTokenizer, load_tokenizer

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "model"
GOLDEN = json.loads((FIXTURES / "tokenizer_golden.json").read_text())
TOK = HFTokenizer.from_dir(FIXTURES / "qwen3_dense")


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: repr(c["text"][:20]))
def test_encode_and_decode_match_transformers(case) -> None:
    assert TOK.encode(case["text"]) == case["ids"]
    assert TOK.decode(case["ids"]) == case["decoded"]


def test_special_and_added_tokens_are_single_ids() -> None:
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</tool_call>"):
        assert TOK.encode(token) == [TOK.token_id(token)]
        assert TOK.decode([TOK.token_id(token)]) == token
    assert set(TOK.special_tokens) >= {"<|im_start|>", "<|im_end|>", "<tool_call>"}


def test_named_ids_sizes_and_chat_template() -> None:
    assert TOK.vocab_size == GOLDEN["vocab_size"] == TOK.num_real_tokens
    assert TOK.eos_ids[0] == TOK.token_id(GOLDEN["eos_token"]) == TOK.token_id("<|im_end|>")
    assert TOK.token_id("<|endoftext|>") in TOK.eos_ids
    assert TOK.pad_id == TOK.token_id(GOLDEN["pad_token"])
    assert TOK.chat_template and "<|im_start|>" in TOK.chat_template
    with pytest.raises(KeyError, match="not a token"):
        TOK.token_id("<|nope|>")


def test_token_bytes_match_the_byte_level_vocabulary() -> None:
    want = [bytes.fromhex(h) for h in GOLDEN["token_bytes_hex"]]
    assert [TOK.token_bytes(i) for i in range(TOK.vocab_size)] == want
    assert TOK.token_bytes(TOK.vocab_size + 3) == b""  # a padding row of the embedding


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_token_bytes_concatenate_to_the_utf8_text(text: str) -> None:
    """Byte-level BPE is lossless: the ids' bytes are exactly the (NFC-normalized) text, even when one
    character is split over several tokens."""
    import unicodedata

    ids = TOK.encode(text)
    normalized = unicodedata.normalize("NFC", text)
    assert b"".join(TOK.token_bytes(i) for i in ids) == normalized.encode("utf-8")
    assert TOK.decode(ids) == normalized


def test_decode_of_out_of_vocabulary_and_cut_characters() -> None:
    ids = TOK.encode("é")
    assert len(ids) == 2  # the fixture's tiny vocabulary splits é into its two bytes
    assert TOK.decode(ids[:1]) == "\ufffd"
    assert TOK.decode([*TOK.encode("ab"), TOK.vocab_size + 1]) == "ab"


def test_load_tokenizer_dispatch_and_errors(tmp_path) -> None:
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert load_tokenizer("hf", FIXTURES / "qwen3_moe").encode("Hello world") == GOLDEN["cases"][0]["ids"]
    with pytest.raises(ValueError, match="needs path"):
        load_tokenizer("hf")
    with pytest.raises(ValueError, match="'sentencepiece' is not supported"):
        load_tokenizer("sentencepiece")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not be read"):
        HFTokenizer.from_dir(tmp_path)


def test_hub_style_tokenizer_config_with_inline_template(tmp_path) -> None:
    """transformers 4.x writes the chat template and eos as dicts inside tokenizer_config.json."""
    shutil.copyfile(FIXTURES / "qwen3_dense" / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": {"content": "<|endoftext|>", "special": True},
                "pad_token": "<|endoftext|>",
                "chat_template": "{{ messages }}",
            }
        )
    )
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.chat_template == "{{ messages }}"
    assert tok.eos_ids[0] == tok.token_id("<|endoftext|>") and tok.token_id("<|im_end|>") in tok.eos_ids
