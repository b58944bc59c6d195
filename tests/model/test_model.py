"""The Qwen3-style decoder: cached == uncached forward, packing == separate rows, GQA layout and size, RoPE."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_jax.model.attention import cache_causal_mask, init_cache, segment_causal_mask, write_cache
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.modules import Transformer
from gyre_jax.model.positional_embeddings import apply_rope

CFG = ModelConfig(
    vocab_size=272,
    num_layers=2,
    embed_dim=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    mlp_dim=128,
    rope_theta=10000.0,
)


@functools.partial(jax.jit, static_argnums=(0,))
def _forward(graphdef, state, tokens, positions, mask, cache):
    """tokens, positions: [B, T]; mask: [B, T, S] -> (logits [B, T, V], cache)."""
    return nnx.merge(graphdef, state)(tokens, positions, mask, cache)


def forward(model_split, tokens, positions, mask, cache=None):
    graphdef, state = model_split
    return _forward(
        graphdef, state, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), jnp.asarray(mask), cache
    )


@pytest.fixture(scope="module")
def model_split():
    return nnx.split(new_model(CFG))


def new_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    with nnx.use_eager_sharding(False):  # no mesh here: logical axis annotations stay metadata
        return Transformer(cfg, rngs=nnx.Rngs(seed))


def causal(batch: int, t: int) -> jax.Array:
    return segment_causal_mask(jnp.ones((batch, t), jnp.int32))


# -- masks and cache writes ------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=12, max_size=12), min_size=2, max_size=2))
def test_segment_causal_mask_matches_its_definition(rows: list[list[int]]) -> None:
    """One shape (so one compile); segment ids need not be sorted or contiguous."""
    seg = np.asarray(rows, np.int32)
    mask = np.asarray(segment_causal_mask(jnp.asarray(seg)))
    b, t = seg.shape
    assert mask.shape == (b, t, t)
    for i in range(b):
        for q in range(t):
            for k in range(t):
                assert mask[i, q, k] == (k <= q and seg[i, q] == seg[i, k] and seg[i, q] != 0)


def test_cache_causal_mask_and_write_cache() -> None:
    positions = jnp.asarray([[3, 4], [0, 1]], jnp.int32)
    mask = np.asarray(cache_causal_mask(positions, 6))
    np.testing.assert_array_equal(mask[0, 0], [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(mask[0, 1], [1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(mask[1, 0], [1, 0, 0, 0, 0, 0])

    cache = jnp.zeros((2, 4, 1, 1))
    new = jnp.asarray([[1.0, 2.0], [3.0, 4.0]])[:, :, None, None]
    out = np.asarray(write_cache(cache, new, jnp.asarray([[1, 4], [0, 2]])))[:, :, 0, 0]  # position 4 >= S: dropped
    np.testing.assert_array_equal(out, [[0, 1, 0, 0], [3, 0, 4, 0]])


# -- forward equivalences --------------------------------------------------------------------------


def test_cached_chunked_forward_equals_full_causal_forward(model_split) -> None:
    rng = np.random.default_rng(0)
    b, t, s = 2, 24, 32
    tokens = rng.integers(0, CFG.vocab_size, size=(b, t))
    positions = np.broadcast_to(np.arange(t), (b, t))
    full, none_cache = forward(model_split, tokens, positions, causal(b, t))
    assert none_cache is None and full.shape == (b, t, CFG.vocab_size) and full.dtype == jnp.float32

    cache = init_cache(CFG, b, s)
    chunks, start = [], 0
    for size in (5, 1, 11, 7):  # prefill-like chunk, a decode step, more chunks
        pos = positions[:, start : start + size]
        logits, cache = forward(
            model_split, tokens[:, start : start + size], pos, cache_causal_mask(jnp.asarray(pos), s), cache
        )
        chunks.append(logits)
        start += size
    assert start == t
    assert len(cache) == CFG.num_layers and cache[0].k.shape == (b, s, CFG.num_kv_heads, CFG.head_dim)
    np.testing.assert_allclose(np.concatenate(chunks, axis=1), full, atol=1e-4, rtol=0)
    # cache slots past the written positions are untouched
    assert not np.any(np.asarray(cache[0].k[:, t:]))
    # sanity: the logits depend on context (a model ignoring the cache would fail the check above)
    alone, _ = forward(model_split, tokens[:, -1:], positions[:, -1:], causal(b, 1))
    assert np.max(np.abs(np.asarray(alone[:, 0]) - np.asarray(full[:, -1]))) > 1e-2


def test_packed_row_equals_sequences_run_alone(model_split) -> None:
    rng = np.random.default_rng(1)
    la, lb, t = 7, 9, 20
    a = rng.integers(0, CFG.vocab_size, size=la)
    b = rng.integers(0, CFG.vocab_size, size=lb)
    tokens = np.concatenate([a, b, np.zeros(t - la - lb, np.int64)])[None]
    segs = np.asarray([[1] * la + [2] * lb + [0] * (t - la - lb)], np.int32)
    positions = np.asarray([list(range(la)) + list(range(lb)) + list(range(t - la - lb))], np.int32)
    packed, _ = forward(model_split, tokens, positions, segment_causal_mask(jnp.asarray(segs)))
    packed = np.asarray(packed)
    assert np.all(np.isfinite(packed))  # padding rows attend to nothing and must not produce NaN

    alone_a, _ = forward(model_split, a[None], np.arange(la)[None], causal(1, la))
    alone_b, _ = forward(model_split, b[None], np.arange(lb)[None], causal(1, lb))
    np.testing.assert_allclose(packed[0, :la], alone_a[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed[0, la : la + lb], alone_b[0], atol=1e-5, rtol=0)


def test_logits_are_invariant_to_a_shift_of_all_positions(model_split) -> None:
    """RoPE only encodes relative positions, so shifting every position by a constant changes nothing."""
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, CFG.vocab_size, size=(1, 12))
    positions = np.arange(12)[None]
    base, _ = forward(model_split, tokens, positions, causal(1, 12))
    shifted, _ = forward(model_split, tokens, positions + 37, causal(1, 12))
    np.testing.assert_allclose(shifted, base, atol=1e-4, rtol=0)


# -- GQA layout and parameter count ----------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        CFG,
        dataclasses.replace(CFG, tie_embeddings=False),
        dataclasses.replace(CFG, num_kv_heads=1, num_layers=3),
        dataclasses.replace(CFG, num_kv_heads=4, mlp_dim=96, vocab_size=264),
        dataclasses.replace(CFG, attention_bias=True, tie_embeddings=False),
        dataclasses.replace(
            CFG, num_layers=3, num_experts=4, num_experts_per_tok=2, moe_mlp_dim=24, mlp_only_layers=(1,)
        ),
        dataclasses.replace(
            CFG, num_layers=4, num_experts=6, num_experts_per_tok=1, moe_mlp_dim=8, decoder_sparse_step=2
        ),
    ],
)
def test_num_params_matches_the_initialized_model(cfg: ModelConfig) -> None:
    model = nnx.eval_shape(lambda: new_model(cfg))
    sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert sum(sizes) == cfg.num_params
    attn = model.layers[0].attn
    e, h, k, d = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    assert attn.q_proj.w.shape == (e, h, d)
    assert attn.k_proj.w.shape == attn.v_proj.w.shape == (e, k, d)
    assert attn.o_proj.w.shape == (h, d, e)
    assert hasattr(model, "lm_head") == (not cfg.tie_embeddings)
    for i, layer in enumerate(model.layers):
        assert hasattr(layer, "moe") == cfg.is_moe_layer(i) != hasattr(layer, "mlp")
    active = sum(sizes) - sum(
        int(np.prod(layer.moe.gate_proj.shape)) * 3 * (1 - cfg.num_experts_per_tok / cfg.num_experts)
        for layer in model.layers
        if hasattr(layer, "moe")
    )
    assert cfg.num_active_params == int(round(active))


# -- memory and precision options ------------------------------------------------------------------


def _nll(graphdef, state, tokens):
    b, t = tokens.shape
    logits, _ = nnx.merge(graphdef, state)(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), causal(b, t))
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], axis=-1))


@pytest.fixture(scope="module")
def reference_grads(model_split):
    graphdef, state = model_split
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, CFG.vocab_size, size=(2, 16)), jnp.int32)
    return tokens, jax.jit(jax.value_and_grad(_nll, argnums=1), static_argnums=0)(graphdef, state, tokens)


@pytest.mark.parametrize("policy", ["full", "dots_no_batch"])
def test_rematerialization_keeps_loss_and_gradients(policy, model_split, reference_grads) -> None:
    _, state = model_split
    tokens, (loss, grads) = reference_grads
    graphdef = nnx.split(nnx.eval_shape(lambda: new_model(dataclasses.replace(CFG, remat_policy=policy))))[0]
    fn = jax.jit(jax.value_and_grad(_nll, argnums=1), static_argnums=0)
    loss_r, grads_r = fn(graphdef, state, tokens)
    assert "remat" in str(jax.make_jaxpr(lambda s: _nll(graphdef, s, tokens))(state))  # remat is really in the graph
    np.testing.assert_allclose(float(loss_r), float(loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_r), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)  # fusion reorders sums


def test_bf16_compute_on_fp32_master_weights(model_split, reference_grads) -> None:
    """dtype=bfloat16, param_dtype=float32: weights and gradients stay fp32, logits are fp32 and close to fp32 compute."""
    _, state = model_split
    tokens, (loss, _) = reference_grads
    cfg = dataclasses.replace(CFG, dtype="bfloat16")
    graphdef = nnx.split(nnx.eval_shape(lambda: new_model(cfg)))[0]
    loss_bf16, grads = jax.jit(jax.value_and_grad(_nll, argnums=1), static_argnums=0)(graphdef, state, tokens)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    assert abs(float(loss_bf16) - float(loss)) < 2e-2 * abs(float(loss))
    logits, _ = forward((graphdef, state), tokens, np.broadcast_to(np.arange(16), (2, 16)), causal(2, 16))
    full, _ = forward(model_split, tokens, np.broadcast_to(np.arange(16), (2, 16)), causal(2, 16))
    assert logits.dtype == jnp.float32
    err = float(jnp.max(jnp.abs(logits - full)) / jnp.max(jnp.abs(full)))
    assert 1e-5 < err < 5e-2  # really computed in bf16, and still close


def test_gqa_equals_mha_with_each_kv_head_repeated_for_its_query_group(model_split) -> None:
    """Query head i reads kv head i // (num_heads / num_kv_heads)."""
    graphdef, state = model_split
    group = CFG.num_heads // CFG.num_kv_heads
    mha_cfg = dataclasses.replace(CFG, num_kv_heads=CFG.num_heads)
    mha_graphdef, mha_state = nnx.split(new_model(mha_cfg))
    gqa = nnx.to_pure_dict(state)
    mha = nnx.to_pure_dict(mha_state)

    def copy(src, dst):
        for key, value in src.items():
            if isinstance(value, dict):
                copy(value, dst[key])
            else:
                dst[key] = value

    copy(gqa, mha)
    for i in range(CFG.num_layers):
        for proj in ("k_proj", "v_proj"):
            mha["layers"][i]["attn"][proj]["w"] = jnp.repeat(gqa["layers"][i]["attn"][proj]["w"], group, axis=1)
    nnx.replace_by_pure_dict(mha_state, mha)

    rng = np.random.default_rng(3)
    tokens = rng.integers(0, CFG.vocab_size, size=(2, 10))
    positions = np.broadcast_to(np.arange(10), (2, 10))
    want, _ = forward(model_split, tokens, positions, causal(2, 10))
    got, _ = forward((mha_graphdef, mha_state), tokens, positions, causal(2, 10))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


# -- RoPE ------------------------------------------------------------------------------------------

_QK = np.random.default_rng(4).normal(size=(2, 1, 1, 1, 32)).astype(np.float32)


def _rope_at(x: np.ndarray, position: int, theta: float = 10000.0) -> np.ndarray:
    return np.asarray(apply_rope(jnp.asarray(x), jnp.asarray([[position]], jnp.int32), theta))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 300), st.integers(0, 300), st.integers(1, 200))
def test_rope_dot_product_depends_only_on_the_position_difference(m: int, n: int, shift: int) -> None:
    q, k = _QK
    dot = float(np.sum(_rope_at(q, m) * _rope_at(k, n)))
    dot_shifted = float(np.sum(_rope_at(q, m + shift) * _rope_at(k, n + shift)))
    scale = float(np.linalg.norm(q) * np.linalg.norm(k))
    assert abs(dot - dot_shifted) <= 1e-4 * scale


def test_rope_is_a_rotation_identity_at_zero_and_position_sensitive() -> None:
    q, k = _QK
    np.testing.assert_allclose(_rope_at(q, 0), q, atol=1e-6)
    for p in (1, 7, 250):
        np.testing.assert_allclose(np.linalg.norm(_rope_at(q, p)), np.linalg.norm(q), rtol=1e-5)
    d0 = float(np.sum(_rope_at(q, 5) * _rope_at(k, 5)))
    d3 = float(np.sum(_rope_at(q, 8) * _rope_at(k, 5)))
    assert abs(d0 - float(np.sum(q * k))) < 1e-4 * float(np.linalg.norm(q) * np.linalg.norm(k))
    assert abs(d3 - d0) > 1e-3  # a different offset gives a different score
    # "rotate half" convention: dims i and i + D/2 form a pair rotated by position * theta^(-2i/D)
    x = np.zeros((1, 1, 1, 32), np.float32)
    x[..., 0] = 1.0
    out = _rope_at(x, 3)
    np.testing.assert_allclose(out[..., 0], np.cos(3.0), atol=1e-6)
    np.testing.assert_allclose(out[..., 16], np.sin(3.0), atol=1e-6)
    np.testing.assert_allclose(np.delete(out, [0, 16], axis=-1), 0.0, atol=1e-7)
