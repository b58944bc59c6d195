"""Llama and Qwen2 families from Hugging Face checkpoints: config mapping, logits vs transformers (fixtures made by
tests/fixtures/model/make_llama_fixtures.py), Llama 3 rope, sharded loads, save -> load, the per-family parameters."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gyre_jax.model import hf_params
from gyre_jax.model.attention import segment_causal_mask
from gyre_jax.model.config import PRESETS, ConfigMismatchError, ModelConfig
from gyre_jax.model.hf_checkpoint import SafetensorsDir, load_hf_checkpoint, read_hf_config, save_hf_checkpoint
from gyre_jax.model.positional_embeddings import default_inv_freq, rope_frequencies
from gyre_jax.model.sharding import RULES_DATA, RULES_FSDP_TENSOR, abstract_model, init_params, make_mesh

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "model"
REL_TOL = 1e-5  # float32 rounding over 2 layers (measured ~1e-6)


def rel_err(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def logits_of(graphdef, params, ids: np.ndarray) -> np.ndarray:
    b, t = ids.shape
    logits, _ = nnx.merge(graphdef, params)(
        jnp.asarray(ids, jnp.int32),
        jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
        segment_causal_mask(jnp.ones((b, t), jnp.int32)),
    )
    return np.asarray(logits)


def one_device():
    return make_mesh(jax.devices()[:1], {})


@pytest.mark.parametrize("name", ["llama_tiny", "qwen2_tiny"])
def test_logits_match_transformers(name) -> None:
    cfg, graphdef, params = load_hf_checkpoint(FIXTURES / name, one_device(), RULES_DATA)
    gold = np.load(FIXTURES / f"{name}_golden.npz")
    logits = logits_of(graphdef, params, gold["input_ids"])
    assert logits.shape == gold["logits"].shape
    assert rel_err(logits, gold["logits"]) < REL_TOL
    assert np.std(gold["logits"]) > 0.3
    attn = params["layers"][0]["attn"]
    assert "q_norm" not in attn and "k_norm" not in attn  # neither family has q/k norm
    if name == "qwen2_tiny":
        assert cfg.family == "qwen2" and cfg.qkv_bias and not cfg.o_bias and cfg.tie_embeddings
        assert "b" in attn["q_proj"] and "b" not in attn["o_proj"]
    else:
        assert cfg.family == "llama" and cfg.qkv_bias and cfg.o_bias and not cfg.tie_embeddings
        assert cfg.rope_type == "llama3" and cfg.head_dim * cfg.num_heads != cfg.embed_dim


def test_llama3_rope_touches_all_three_bands_and_differs_from_default() -> None:
    cfg = ModelConfig.from_hf_config(read_hf_config(FIXTURES / "llama_tiny"))
    inv_freq, scale = rope_frequencies(cfg)
    base = default_inv_freq(cfg.head_dim, cfg.rope_theta)
    ratio = base / inv_freq
    assert scale == 1.0
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(cfg.rope_factor)  # kept / divided by the factor
    assert np.any((ratio > 1.0) & (ratio < cfg.rope_factor))  # smoothed in between
    # and the logits depend on it: the same weights with plain RoPE give other logits
    _, graphdef, params = load_hf_checkpoint(FIXTURES / "llama_tiny", one_device(), RULES_DATA)
    plain, _ = abstract_model(dataclasses.replace(cfg, rope_type="default"))
    gold = np.load(FIXTURES / "llama_tiny_golden.npz")
    assert rel_err(logits_of(plain, params, gold["input_ids"]), gold["logits"]) > 1e-3


@pytest.mark.parametrize("name", ["llama_tiny", "qwen2_tiny"])
def test_same_logits_sharded_over_8_devices(name) -> None:
    mesh = make_mesh(jax.devices(), dict(fsdp=4, tensor=2))
    _, graphdef, params = load_hf_checkpoint(FIXTURES / name, mesh, RULES_FSDP_TENSOR)
    gold = np.load(FIXTURES / f"{name}_golden.npz")
    assert rel_err(logits_of(graphdef, params, gold["input_ids"]), gold["logits"]) < REL_TOL
    assert params["layers"][0]["attn"]["q_proj"]["w"].sharding.spec == jax.sharding.PartitionSpec(
        "fsdp", "tensor", None
    )


@pytest.mark.parametrize("name", ["llama_tiny", "qwen2_tiny"])
def test_save_writes_the_family_and_loads_back_bit_identical(name, tmp_path) -> None:
    cfg, graphdef, params = load_hf_checkpoint(FIXTURES / name, one_device(), RULES_DATA)
    save_hf_checkpoint(tmp_path, cfg, params, dtype="bfloat16", base_config=read_hf_config(FIXTURES / name))
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == cfg.family
    assert written["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[cfg.family]]
    if name == "llama_tiny":
        assert written["rope_scaling"]["rope_type"] == "llama3" and written["head_dim"] == 16
    else:
        assert "attention_bias" not in written  # Qwen2's q/k/v biases are not optional
    with SafetensorsDir(FIXTURES / name) as a, SafetensorsDir(tmp_path) as b:  # the bf16 files transformers wrote
        assert a.names() == b.names()
        for n in a.names():
            assert a.read(n, ()).tobytes() == b.read(n, ()).tobytes(), n
    cfg2, _, params2 = load_hf_checkpoint(tmp_path, one_device(), RULES_DATA)
    assert cfg2 == cfg
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_hf_config_keys_of_llama_and_qwen2() -> None:
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "mlp_bias": False,
        "max_position_embeddings": 131072,
    }  # Llama 3.1 8B's config.json (transformers 4.x spelling)
    cfg = ModelConfig.from_hf_config(llama)
    assert (cfg.family, cfg.head_dim, cfg.num_kv_heads, cfg.rope_type, cfg.rope_original_max_position) == (
        "llama",
        128,
        8,
        "llama3",
        8192,
    )
    assert not cfg.qk_norm and not cfg.qkv_bias
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    # LlamaConfig: num_key_value_heads absent or null = multi-head attention
    assert ModelConfig.from_hf_config({**llama, "num_key_value_heads": None}).num_kv_heads == 32
    no_kv = {k: v for k, v in llama.items() if k != "num_key_value_heads"}
    assert ModelConfig.from_hf_config(no_kv).num_kv_heads == 32
    with pytest.raises(ConfigMismatchError, match="mlp_bias=true"):
        ModelConfig.from_hf_config({**llama, "mlp_bias": True})
    with pytest.raises(ConfigMismatchError, match="'low_freq_factor'"):
        rope = {k: v for k, v in llama["rope_scaling"].items() if k != "low_freq_factor"}
        ModelConfig.from_hf_config({**llama, "rope_scaling": rope})
    qwen2 = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": 21,
    }  # Qwen2.5-0.5B's
    cfg = ModelConfig.from_hf_config(qwen2)
    assert (cfg.family, cfg.head_dim, cfg.qkv_bias, cfg.o_bias, cfg.attention_bias) == ("qwen2", 64, True, False, False)
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    with pytest.raises(ConfigMismatchError, match="sliding-window"):
        ModelConfig.from_hf_config({**qwen2, "use_sliding_window": True})


def test_family_rules_and_parameter_counts() -> None:
    with pytest.raises(ValueError, match="family='mistral' must be one of"):
        dataclasses.replace(PRESETS["tiny"], family="mistral")
    with pytest.raises(ValueError, match="attention_bias must be False"):
        dataclasses.replace(PRESETS["tiny"], family="qwen2", attention_bias=True)
    with pytest.raises(ValueError, match="mixture of experts is Qwen3-MoE's"):
        dataclasses.replace(PRESETS["tiny_moe"], family="llama")
    with pytest.raises(ValueError, match="rope_original_max_position >= 1"):
        dataclasses.replace(PRESETS["tiny"], family="llama", rope_type="llama3", rope_factor=8.0)
    for family, attention_bias in (("qwen3", False), ("qwen3", True), ("llama", True), ("qwen2", False)):
        cfg = dataclasses.replace(PRESETS["tiny"], family=family, attention_bias=attention_bias)
        _, state = abstract_model(cfg)
        counted = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
        assert counted == cfg.num_params, family
        assert set(hf_params.param_specs(cfg)) == {
            tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
        }
    smol = PRESETS["smollm2_135m"]
    assert smol.family == "llama" and 134e6 < smol.num_params < 136e6  # SmolLM2-135M


def test_random_init_llama_trains_a_step() -> None:
    """A random-init Llama-family model (a config, no checkpoint) is the same decoder: gradients flow."""
    cfg = dataclasses.replace(PRESETS["tiny"], family="llama", rope_type="llama3", rope_factor=4.0,
                              rope_original_max_position=64)  # fmt: skip
    graphdef, params = init_params(cfg, one_device(), RULES_DATA, seed=0)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)

    def loss(p):
        logits, _ = nnx.merge(graphdef, p)(ids, jnp.broadcast_to(jnp.arange(12), (2, 12)),
                                           segment_causal_mask(jnp.ones((2, 12), jnp.int32)))  # fmt: skip
        return -jnp.mean(jax.nn.log_softmax(logits[:, :-1])[..., ids[:, 1:]])

    value, grads = jax.value_and_grad(loss)(params)
    assert np.isfinite(float(value))
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
