"""ByteTokenizer: lossless round trip, special tokens as single ids, vocab padding, forgiving decode."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_jax.model.tokenizer import SPECIAL_TOKENS, ByteTokenizer

TOK = ByteTokenizer()

# Text interleaved with special-token strings (and fragments of them), so the splitter is exercised.
_pieces = st.one_of(
    st.text(max_size=20),
    st.sampled_from(SPECIAL_TOKENS),
    st.sampled_from(["<|", "|>", "<|im_", "</", "<think", "think>", "\ufffd", "é", "日本", "🙂"]),
)
mixed_text = st.lists(_pieces, max_size=12).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_round_trip_of_random_unicode_text(text: str) -> None:
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text
    assert all(0 <= i < TOK.num_real_tokens for i in ids)
    if not any(t in text for t in SPECIAL_TOKENS):
        assert ids == list(text.encode("utf-8"))  # plain text is exactly its UTF-8 bytes


@settings(max_examples=300, deadline=None)
@given(mixed_text)
def test_round_trip_with_special_tokens_mixed_in(text: str) -> None:
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text
    # every occurrence of a special-token string became exactly one id (no two of ours can overlap)
    for index, token in enumerate(SPECIAL_TOKENS):
        assert ids.count(256 + index) == text.count(token)


@pytest.mark.parametrize("index,token", list(enumerate(SPECIAL_TOKENS)))
def test_special_tokens_encode_to_single_ids(index: int, token: str) -> None:
    assert TOK.encode(token) == [256 + index]
    assert TOK.token_id(token) == 256 + index
    assert TOK.decode([256 + index]) == token
    assert TOK.encode("a" + token + "b") == [ord("a"), 256 + index, ord("b")]


def test_named_ids_and_unknown_token() -> None:
    assert TOK.pad_id == TOK.encode("<|endoftext|>")[0]
    assert TOK.eos_ids == (TOK.encode("<|im_end|>")[0], TOK.encode("<|endoftext|>")[0])
    with pytest.raises(KeyError, match="not a special token"):
        TOK.token_id("<|nope|>")


def test_chat_template_round_trips_with_one_id_per_marker() -> None:
    text = "<|im_start|>user\nhi 🙂<|im_end|>\n<|im_start|>assistant\n<think>\nok</think>\n<tool_call>{}</tool_call><|im_end|>"
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text
    assert ids.count(TOK.token_id("<|im_start|>")) == 2
    assert ids.count(TOK.token_id("<|im_end|>")) == 2
    assert ids[0] == TOK.token_id("<|im_start|>")


@pytest.mark.parametrize(
    "specials,num_real,vocab",
    [
        (SPECIAL_TOKENS, 265, 272),
        ((), 256, 256),
        (("<a>",), 257, 264),
        (tuple(f"<{i}>" for i in range(8)), 264, 264),
        (tuple(f"<{i}>" for i in range(9)), 265, 272),
    ],
)
def test_vocab_size_is_real_tokens_padded_to_a_multiple_of_8(specials, num_real, vocab) -> None:
    tok = ByteTokenizer(special_tokens=specials)
    assert tok.num_real_tokens == num_real
    assert tok.vocab_size == vocab
    assert tok.vocab_size % 8 == 0 and tok.vocab_size - 8 < tok.num_real_tokens <= tok.vocab_size


def test_default_vocab_matches_the_tiny_model() -> None:
    from gyre_jax.model.config import TINY

    assert TOK.vocab_size == TINY.vocab_size == 272


def test_decode_of_invalid_utf8_does_not_raise() -> None:
    assert TOK.decode([0xFF, 0xFE]) == "\ufffd\ufffd"
    e_acute = list("é".encode())  # [0xC3, 0xA9]
    assert TOK.decode(e_acute[:1]) == "\ufffd"  # a cut multi-byte character
    # a cut character right before a special token is replaced, the special token survives
    assert TOK.decode(e_acute[:1] + [TOK.token_id("<|im_end|>")] + e_acute) == "\ufffd<|im_end|>é"
    # padding ids (past the real vocabulary) decode to nothing
    assert TOK.decode([ord("a"), TOK.num_real_tokens, TOK.vocab_size - 1, ord("b")]) == "ab"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, TOK.vocab_size - 1), max_size=64))
def test_decode_of_any_ids_returns_text(ids: list[int]) -> None:
    text = TOK.decode(ids)
    assert isinstance(text, str)
    # decoding is stable: re-encoding valid output and decoding again gives the same text
    assert TOK.decode(TOK.encode(text)) == text


def test_token_bytes_of_every_id() -> None:
    assert TOK.token_bytes(ord("a")) == b"a" and TOK.token_bytes(0xFF) == b"\xff"
    assert TOK.token_bytes(TOK.token_id("<|im_end|>")) == b"<|im_end|>"
    assert TOK.token_bytes(TOK.num_real_tokens) == b""  # padding rows of the embedding
    text = "hé<think>🙂"
    assert b"".join(TOK.token_bytes(i) for i in TOK.encode(text)) == text.encode("utf-8")
