"""Per-row sampling: greedy, top-k/top-p truncation, sampled frequencies, behaviour log-probs, key handling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gyre_jax.serving.sampling import advance, key_for_seed, sample, split_keys

V = 16
_sample = jax.jit(sample)


def _rows(n: int, seed: int = 0, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(n, V)) * scale).astype(np.float32)


def _keys(n: int, seed: int = 0) -> jax.Array:
    """[n, 2] uint32 raw key data, all distinct."""
    return jax.random.key_data(jax.random.split(jax.random.key(seed), n))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def _call(logits, keys, temperature, top_k, top_p):
    n = logits.shape[0]
    tokens, logprobs = _sample(
        jnp.asarray(logits),
        keys,
        jnp.broadcast_to(jnp.float32(temperature), (n,)),
        jnp.broadcast_to(jnp.int32(top_k), (n,)),
        jnp.broadcast_to(jnp.float32(top_p), (n,)),
    )
    return np.asarray(tokens), np.asarray(logprobs)


def test_greedy_picks_argmax_with_the_temperature_one_logprob() -> None:
    logits = _rows(64)
    tokens, logprobs = _call(logits, _keys(64), 0.0, 0, 1.0)
    assert tokens.dtype == np.int32 and logprobs.dtype == np.float32
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    want = _log_softmax(logits)[np.arange(64), tokens]
    np.testing.assert_allclose(logprobs, want, atol=1e-5)
    # greedy ignores truncation settings and keys
    tokens2, logprobs2 = _call(logits, _keys(64, seed=99), 0.0, 3, 0.5)
    np.testing.assert_array_equal(tokens2, tokens)
    np.testing.assert_allclose(logprobs2, logprobs, atol=1e-6)


def test_top_k_one_and_tiny_top_p_are_argmax() -> None:
    logits = _rows(128, seed=1, scale=0.3)  # flat rows: an untruncated sample would rarely be the argmax
    keys = _keys(128, seed=7)
    for temperature in (0.7, 1.0, 3.0):
        tokens, logprobs = _call(logits, keys, temperature, 1, 1.0)
        np.testing.assert_array_equal(tokens, logits.argmax(-1))
        # the log-prob is of the scaled distribution *before* truncation (so not 0)
        np.testing.assert_allclose(logprobs, _log_softmax(logits / temperature)[np.arange(128), tokens], atol=1e-5)
        tokens, _ = _call(logits, keys, temperature, 0, 1e-6)
        np.testing.assert_array_equal(tokens, logits.argmax(-1))
    untruncated, _ = _call(logits, keys, 1.0, 0, 1.0)
    assert np.mean(untruncated == logits.argmax(-1)) < 0.5  # so the checks above are not vacuous


def _frequencies(row: np.ndarray, n: int, temperature: float, top_k: int, top_p: float, seed: int) -> np.ndarray:
    logits = np.broadcast_to(row, (n, V))
    tokens, logprobs = _call(logits, _keys(n, seed=seed), temperature, top_k, top_p)
    np.testing.assert_allclose(logprobs, _log_softmax(row / temperature)[tokens], atol=1e-5)
    return np.bincount(tokens, minlength=V) / n


def _assert_close_to(freq: np.ndarray, probs: np.ndarray, n: int) -> None:
    """Chi-square-style check: every bin within 5 standard errors, and a total chi^2 far below failure level."""
    se = np.sqrt(np.maximum(probs * (1 - probs), 1e-12) / n)
    assert np.all(np.abs(freq - probs) <= 5 * se + 1e-9), (freq, probs)
    support = probs > 0
    chi2 = n * np.sum((freq[support] - probs[support]) ** 2 / probs[support])
    assert chi2 < 3 * support.sum() + 30, chi2
    assert np.all(freq[~support] == 0)


def test_sampled_frequencies_match_softmax() -> None:
    row = _rows(1, seed=2, scale=1.0)[0]
    n = 20000
    probs = np.exp(_log_softmax(row))
    _assert_close_to(_frequencies(row, n, 1.0, 0, 1.0, seed=0), probs, n)
    probs_t = np.exp(_log_softmax(row / 0.5))
    _assert_close_to(_frequencies(row, n, 0.5, 0, 1.0, seed=1), probs_t, n)


def test_top_k_and_top_p_renormalize_over_the_kept_tokens() -> None:
    row = _rows(1, seed=3, scale=1.0)[0]
    n = 20000
    probs = np.exp(_log_softmax(row))
    order = np.argsort(-probs)
    # top-k = 4: the 4 most likely tokens, renormalized
    keep = np.zeros(V, bool)
    keep[order[:4]] = True
    _assert_close_to(_frequencies(row, n, 1.0, 4, 1.0, seed=2), np.where(keep, probs, 0) / probs[keep].sum(), n)
    # top-p: the smallest prefix of the sorted tokens whose mass reaches p
    cum = np.cumsum(probs[order])
    p = float((cum[2] + cum[3]) / 2)  # strictly between the mass of 3 and 4 tokens -> 4 kept
    keep = np.zeros(V, bool)
    keep[order[:4]] = True
    _assert_close_to(_frequencies(row, n, 1.0, 0, p, seed=3), np.where(keep, probs, 0) / probs[keep].sum(), n)


def test_rows_have_independent_settings() -> None:
    logits = _rows(3, seed=4, scale=0.3)
    keys = _keys(3, seed=11)
    temperature = jnp.asarray([0.0, 1.0, 2.0], jnp.float32)
    top_k = jnp.asarray([0, 1, 0], jnp.int32)
    top_p = jnp.asarray([1.0, 1.0, 1.0], jnp.float32)
    tokens, logprobs = (np.asarray(x) for x in _sample(jnp.asarray(logits), keys, temperature, top_k, top_p))
    assert tokens[0] == logits[0].argmax() and tokens[1] == logits[1].argmax()
    want = [
        _log_softmax(logits[0])[tokens[0]],
        _log_softmax(logits[1])[tokens[1]],
        _log_softmax(logits[2] / 2.0)[tokens[2]],
    ]
    np.testing.assert_allclose(logprobs, want, atol=1e-5)


def test_same_key_same_token_and_split_keys() -> None:
    row = _rows(1, seed=5, scale=0.1)
    k = key_for_seed(1234)
    assert k.shape == (2,) and k.dtype == jnp.uint32
    np.testing.assert_array_equal(k, key_for_seed(1234))
    assert not np.array_equal(k, key_for_seed(1235))
    first = _call(row, k[None], 1.0, 0, 1.0)
    for _ in range(3):
        again = _call(row, key_for_seed(1234)[None], 1.0, 0, 1.0)
        np.testing.assert_array_equal(again[0], first[0])
        np.testing.assert_array_equal(again[1], first[1])
    # a row's token depends on its own key only, not on the other rows in the batch
    batch = np.concatenate([_rows(5, seed=6), row])
    keys = jnp.concatenate([_keys(5, seed=50), k[None]])
    tokens, _ = _call(batch, keys, 1.0, 0, 1.0)
    assert tokens[-1] == first[0][0]
    # different keys give different draws on a near-flat row
    many, _ = _call(np.broadcast_to(row, (64, V)), _keys(64, seed=100), 1.0, 0, 1.0)
    assert len(set(many.tolist())) > 4

    keys = _keys(4, seed=20)
    nxt, use = split_keys(keys)
    assert nxt.shape == use.shape == (4, 2) and nxt.dtype == jnp.uint32
    np.testing.assert_array_equal(split_keys(keys)[0], nxt)  # deterministic
    all_keys = {tuple(x) for x in np.concatenate([np.asarray(keys), np.asarray(nxt), np.asarray(use)]).tolist()}
    assert len(all_keys) == 12  # fresh keys, none reused


def test_key_for_seed_distinguishes_seeds_beyond_32_bits() -> None:
    """``key_for_seed`` reduces seeds mod 2**63, so 64-bit seeds are meant to be accepted; with x64 disabled
    ``jax.random.key`` keeps only the low 32 bits, and seeds that differ above bit 31 get the same key
    (seed 2**32 samples exactly like seed 0)."""
    keys = {s: tuple(np.asarray(key_for_seed(s)).tolist()) for s in (0, 7, 2**32, 2**32 + 7, 2**40, 2**62)}
    assert len(set(keys.values())) == len(keys), keys


def test_untruncated_rows_draw_from_the_whole_distribution_whether_or_not_other_rows_truncate() -> None:
    """``top_k <= 0`` and ``top_p >= 1``: the token is ``categorical(key, logits / T)`` over every token, the same
    in a batch where no row truncates (no vocabulary sort runs) and in one where other rows do."""
    n = 64
    logits = _rows(n, seed=3, scale=4.0)
    keys = _keys(n, seed=5)
    want = np.asarray(jax.vmap(lambda k, r: jax.random.categorical(jax.random.wrap_key_data(k), r))(keys, logits / 0.8))
    alone, _ = _call(logits, keys, 0.8, 0, 1.0)
    np.testing.assert_array_equal(alone, want)
    top_k = jnp.asarray([0, 2] * (n // 2), jnp.int32)  # every other row truncates to its top 2
    mixed, _ = _sample(jnp.asarray(logits), keys, jnp.full((n,), 0.8), top_k, jnp.ones((n,), jnp.float32))
    mixed = np.asarray(mixed)
    np.testing.assert_array_equal(mixed[::2], want[::2])
    top2 = np.argsort(-logits, axis=-1)[:, :2]
    assert all(t in top2[i] for i, t in enumerate(mixed) if i % 2)


def test_advance_is_sample_on_split_keys_and_greedy_rows_keep_their_keys() -> None:
    """``advance`` (a decode step's sampling): sampled rows draw what ``sample`` draws from the split keys and
    advance to the next keys; greedy rows take the argmax and keep their key, whether or not the batch holds a
    sampled row (the all-greedy batch takes the branch that splits nothing)."""
    step = jax.jit(advance)
    logits = jnp.asarray(_rows(6, seed=9))
    keys = _keys(6, seed=30)
    temperature = jnp.asarray([0.0, 1.0, 0.7, 0.0, 1.0, 0.0], jnp.float32)
    top_k = jnp.asarray([0, 0, 5, 0, 0, 3], jnp.int32)
    top_p = jnp.asarray([1.0, 0.9, 1.0, 1.0, 1.0, 0.5], jnp.float32)
    tokens, logprobs, nxt = step(logits, keys, temperature, top_k, top_p)
    want_next, use = split_keys(keys)
    want_tokens, want_logprobs = sample(logits, use, temperature, top_k, top_p)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-6)
    greedy = np.asarray(temperature) <= 0
    np.testing.assert_array_equal(np.asarray(nxt)[greedy], np.asarray(keys)[greedy])
    np.testing.assert_array_equal(np.asarray(nxt)[~greedy], np.asarray(want_next)[~greedy])

    zeros = jnp.zeros(6, jnp.float32)
    tokens, logprobs, nxt = step(logits, keys, zeros, jnp.zeros(6, jnp.int32), jnp.ones(6, jnp.float32))
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), axis=-1))
    np.testing.assert_allclose(logprobs, _log_softmax(np.asarray(logits)).max(axis=-1), atol=1e-5)
    np.testing.assert_array_equal(nxt, keys)
