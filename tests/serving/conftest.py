"""Shared serving fixtures: one tiny model on a 4-device cell submesh, one Engine (compiled once per session),
and an uncached reference decoder to compare the engine and the loop against."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gyre_jax.config import load_config
from gyre_jax.model.attention import segment_causal_mask
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.sharding import init_params, make_mesh
from gyre_jax.serving.engine import Engine

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
SLOTS = 4
MAX_SEQ_LEN = 128
MAX_PREFILL = 64
BUCKETS = (16, 32, 64)
DECODE_WINDOWS = (64,)  # generate attends over 64 cache positions while every slot fits, else all 128
DECODE_SLOT_BUCKETS = (2,)  # ... and steps slots 0-1 only while the others are empty (slots split over 4 devices)
REF_LEN = MAX_SEQ_LEN  # the reference pads every sequence to this length (one compile)


@functools.partial(jax.jit, static_argnums=(0,))
def _ref_logits(graphdef, params, tokens, segment_ids):
    """tokens, segment_ids: [1, L] -> log_softmax(logits) [1, L, V], full causal pass without a cache."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits, _ = nnx.merge(graphdef, params)(tokens, positions, segment_causal_mask(segment_ids))
    return jax.nn.log_softmax(logits, axis=-1)


class Reference:
    """Greedy decoding with the uncached model (one full forward per token)."""

    def __init__(self, graphdef):
        self.graphdef = graphdef
        self._memo: dict = {}

    def logprobs(self, params, ids: list[int]) -> np.ndarray:
        """ids: [n] (n <= REF_LEN) -> log_softmax(logits) [n, V] of the uncached causal forward."""
        n = len(ids)
        assert 0 < n <= REF_LEN
        tokens = np.zeros((1, REF_LEN), np.int32)
        tokens[0, :n] = ids
        seg = (np.arange(REF_LEN) < n).astype(np.int32)[None]
        return np.asarray(_ref_logits(self.graphdef, params, jnp.asarray(tokens), jnp.asarray(seg)))[0, :n]

    def greedy(self, params, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        """Step-by-step greedy: n tokens and their log-probs (temperature 1)."""
        key = (id(params), tuple(prompt), n)
        if key not in self._memo:
            ids, lps = list(prompt), []
            for _ in range(n):
                lp = self.logprobs(params, ids)[-1]
                tok = int(np.argmax(lp))
                ids.append(tok)
                lps.append(float(lp[tok]))
            self._memo[key] = (ids[len(prompt) :], lps)
        return self._memo[key]

    def check_teacher_forced(self, params, prompt: list[int], tokens: list[int], logprobs: list[float]) -> None:
        """Asserts ``tokens`` is the greedy continuation of ``prompt`` (argmax at every step, one forward)."""
        lp = self.logprobs(params, list(prompt) + list(tokens))[len(prompt) - 1 : -1]  # [len(tokens), V]
        np.testing.assert_array_equal(tokens, lp.argmax(-1))
        np.testing.assert_allclose(logprobs, lp[np.arange(len(tokens)), tokens], atol=1e-4, rtol=0)


@pytest.fixture(scope="session")
def rules():
    return tuple((k, v) for k, v in load_config([]).sharding_rules)


@pytest.fixture(scope="session")
def cell_mesh():
    return make_mesh(jax.devices()[4:8], dict(data=4))


@pytest.fixture(scope="session")
def model_params(cell_mesh, rules):
    """(graphdef, params, other params of the same layout) on the cell mesh.

    The second set is a cheap transformation of the first (every weight rolled by one row), made with the
    same shardings, so it stands for "new weights after a training step" without a second init compile."""
    graphdef, params = init_params(CFG, cell_mesh, rules, seed=0)
    shardings = jax.tree.map(lambda x: x.sharding, params)
    params_b = jax.jit(lambda p: jax.tree.map(lambda x: jnp.roll(x, 1, axis=0) * 1.1, p), out_shardings=shardings)(
        params
    )
    return graphdef, params, params_b


@pytest.fixture(scope="session")
def engine(model_params, cell_mesh, rules):
    return Engine(
        CFG,
        model_params[0],
        cell_mesh,
        rules,
        max_concurrent_decodes=SLOTS,
        max_seq_len=MAX_SEQ_LEN,
        max_prefill_length=MAX_PREFILL,
        prefill_buckets=BUCKETS,
        decode_windows=DECODE_WINDOWS,
        decode_slot_buckets=DECODE_SLOT_BUCKETS,
    )


@pytest.fixture(scope="session")
def reference(model_params):
    return Reference(model_params[0])


@pytest.fixture(scope="session")
def prompts():
    """Prompts of mixed lengths (three prefill buckets)."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, size=n).tolist() for n in (5, 13, 1, 22, 9, 40, 3, 16)]


@pytest.fixture(scope="session")
def other_mesh():
    """A second cell on the other 4 devices: KV and sessions migrate to it device to device."""
    return make_mesh(jax.devices()[0:4], dict(data=4))


@pytest.fixture(scope="session")
def other_engine(model_params, other_mesh, rules):
    """The same model's engine on ``other_mesh`` (same layout as ``engine``), with params resharded onto it."""
    graphdef, params, params_b = model_params
    eng = Engine(
        CFG,
        graphdef,
        other_mesh,
        rules,
        max_concurrent_decodes=SLOTS,
        max_seq_len=MAX_SEQ_LEN,
        max_prefill_length=MAX_PREFILL,
        prefill_buckets=BUCKETS,
        decode_windows=DECODE_WINDOWS,
    )
    shardings = jax.tree.map(lambda x: jax.sharding.NamedSharding(other_mesh, x.sharding.spec), params)
    return eng, jax.device_put(params, shardings), jax.device_put(params_b, shardings)
