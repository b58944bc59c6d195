"""Golden parity with Hugging Face transformers (fixtures from scripts/make_model_fixtures.py; no torch here),
the same logits under several sharding rule sets, checkpoint round trips and checkpoint mismatch errors."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

from gyre_jax.model import hf_params
from gyre_jax.model.attention import cache_causal_mask, init_cache, segment_causal_mask
from gyre_jax.model.config import ConfigMismatchError, ModelConfig
from gyre_jax.model.hf_checkpoint import (
    CheckpointMismatchError,
    SafetensorsDir,
    load_hf_checkpoint,
    load_hf_params,
    read_hf_config,
    save_hf_checkpoint,
)
from gyre_jax.model.positional_embeddings import rope_frequencies
from gyre_jax.model.sharding import RULES_DATA, RULES_EXPERT, RULES_FSDP_TENSOR, abstract_model, make_mesh

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "model"
DENSE, MOE = FIXTURES / "qwen3_dense", FIXTURES / "qwen3_moe"
REL_TOL = 1e-4


def rel_err(got, want) -> float:
    """max |got - want| / max |want|."""
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def golden(name: str) -> dict:
    return dict(np.load(FIXTURES / f"{name}_golden.npz"))


def single_mesh():
    return make_mesh(jax.devices()[:1], {})


@functools.partial(jax.jit, static_argnums=(0,))
def _forward(graphdef, params, tokens, positions, mask):
    logits, _, aux = nnx.merge(graphdef, params)(tokens, positions, mask, return_aux=True)
    return logits, aux


def causal_logits(graphdef, params, ids: np.ndarray):
    b, t = ids.shape
    return _forward(
        graphdef,
        params,
        jnp.asarray(ids, jnp.int32),
        jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
        segment_causal_mask(jnp.ones((b, t), jnp.int32)),
    )


@pytest.fixture(scope="module")
def loaded():
    """name -> (cfg, graphdef, params) on one device."""
    out = {}
    for name, path in (("qwen3_dense", DENSE), ("qwen3_moe", MOE)):
        out[name] = load_hf_checkpoint(path, single_mesh(), RULES_DATA)
    return out


# -- golden parity ---------------------------------------------------------------------------------


def test_fixture_configs_map_to_the_expected_architectures(loaded) -> None:
    dense, moe = loaded["qwen3_dense"][0], loaded["qwen3_moe"][0]
    assert not dense.is_moe and dense.tie_embeddings and dense.head_dim * dense.num_heads != dense.embed_dim
    assert moe.num_experts == 8 and moe.num_experts_per_tok == 2 and moe.norm_topk_prob and moe.attention_bias
    assert [moe.is_moe_layer(i) for i in range(moe.num_layers)] == [True, False, True]  # mlp_only_layers=[1]
    assert moe.rope_type == "yarn" and not moe.tie_embeddings
    assert len(list(MOE.glob("*.safetensors"))) > 1 and (MOE / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("name", ["qwen3_dense", "qwen3_moe"])
def test_logits_match_hugging_face(name, loaded) -> None:
    cfg, graphdef, params = loaded[name]
    gold = golden(name)
    logits, aux = causal_logits(graphdef, params, gold["input_ids"])
    assert logits.shape == gold["logits"].shape and logits.dtype == jnp.float32
    assert rel_err(logits, gold["logits"]) < REL_TOL
    assert np.std(gold["logits"]) > 0.3  # the fixture's logits are far from trivial
    if cfg.is_moe:
        assert rel_err(aux.router_logits, gold["router_logits"]) < REL_TOL
        np.testing.assert_allclose(float(aux.load_balancing_loss), float(gold["aux_loss"]), rtol=1e-5)
    else:
        assert aux.router_logits is None and float(aux.load_balancing_loss) == 0.0


def test_moe_dense_implementation_matches_hugging_face_too(loaded) -> None:
    cfg, graphdef, params = loaded["qwen3_moe"]
    graphdef2, _ = abstract_model(dataclasses.replace(cfg, moe_impl="dense"))
    gold = golden("qwen3_moe")
    logits, _ = causal_logits(graphdef2, params, gold["input_ids"])
    assert rel_err(logits, gold["logits"]) < REL_TOL


def test_packed_row_matches_hugging_face_rows(loaded) -> None:
    """Both golden rows packed into one row (segment ids, positions restarting) give HF's per-row logits."""
    _, graphdef, params = loaded["qwen3_moe"]
    gold = golden("qwen3_moe")
    ids = gold["input_ids"]
    b, t = ids.shape
    packed = ids.reshape(1, b * t)
    segments = np.repeat(np.arange(1, b + 1), t)[None].astype(np.int32)
    positions = np.tile(np.arange(t), b)[None].astype(np.int32)
    logits, _ = _forward(
        graphdef, params, jnp.asarray(packed), jnp.asarray(positions), segment_causal_mask(jnp.asarray(segments))
    )
    assert rel_err(np.asarray(logits).reshape(b, t, -1), gold["logits"]) < REL_TOL


def test_cached_prefill_and_decode_match_hugging_face(loaded) -> None:
    """Serving path: prefill a prefix into the KV cache, then decode one token at a time."""
    cfg, graphdef, params = loaded["qwen3_dense"]
    gold = golden("qwen3_dense")
    ids = gold["input_ids"]
    b, t = ids.shape
    s = t + 4
    step = jax.jit(lambda p, tokens, pos, cache: nnx.merge(graphdef, p)(tokens, pos, cache_causal_mask(pos, s), cache))
    cache = init_cache(cfg, b, s)
    out = []
    for start, size in ((0, 9), (9, 1), (10, 1), (11, 5)):
        pos = jnp.broadcast_to(jnp.arange(start, start + size, dtype=jnp.int32), (b, size))
        logits, cache = step(params, jnp.asarray(ids[:, start : start + size]), pos, cache)
        out.append(np.asarray(logits))
    assert rel_err(np.concatenate(out, axis=1), gold["logits"]) < REL_TOL


def test_rope_frequencies_match_hugging_face() -> None:
    cases = json.loads((FIXTURES / "rope_golden.json").read_text())
    assert set(cases) == {"linear", "yarn", "yarn_small"}
    for name, case in cases.items():
        hf = dict(
            case["config"],
            model_type="qwen3",
            architectures=["Qwen3ForCausalLM"],
            vocab_size=16,
            intermediate_size=8,
            num_hidden_layers=1,
            num_key_value_heads=case["config"]["num_attention_heads"],
        )
        cfg = ModelConfig.from_hf_config(hf)
        inv_freq, scaling = rope_frequencies(cfg)
        np.testing.assert_allclose(inv_freq, case["inv_freq"], rtol=2e-6, err_msg=name)
        assert scaling == pytest.approx(case["attention_scaling"], rel=1e-6), name


# -- the same logits under different sharding rule sets --------------------------------------------

RULE_CASES = {
    "dense/data8": ("qwen3_dense", RULES_DATA, dict(data=8)),
    "dense/fsdp4_tensor2": ("qwen3_dense", RULES_FSDP_TENSOR, dict(fsdp=4, tensor=2)),
    "moe/data8": ("qwen3_moe", RULES_DATA, dict(data=8)),
    "moe/fsdp2_tensor2_data2": ("qwen3_moe", RULES_FSDP_TENSOR, dict(data=2, fsdp=2, tensor=2)),
    "moe/expert4_fsdp2": ("qwen3_moe", RULES_EXPERT, dict(fsdp=2, expert=4)),
    "moe/expert8_dense_impl": ("qwen3_moe", RULES_EXPERT, dict(expert=8)),
}


@pytest.mark.parametrize("case", sorted(RULE_CASES))
def test_same_logits_under_each_rule_set_on_8_devices(case, loaded) -> None:
    name, rules, shape = RULE_CASES[case]
    path = DENSE if name == "qwen3_dense" else MOE
    mesh = make_mesh(jax.devices(), shape)
    overrides = dict(moe_impl="dense") if case.endswith("dense_impl") else {}
    cfg, graphdef, params = load_hf_checkpoint(path, mesh, rules, **overrides)
    gold = golden(name)
    ids = np.concatenate([gold["input_ids"]] * 4)  # batch 8: splits over every batch axis
    logits, aux = causal_logits(graphdef, params, ids)
    assert rel_err(logits, np.concatenate([gold["logits"]] * 4)) < REL_TOL
    if cfg.is_moe:
        np.testing.assert_allclose(float(aux.load_balancing_loss), float(gold["aux_loss"]), rtol=1e-5)
    # the rule set really split the weights as intended
    layer0 = params["layers"][0]
    q = layer0["attn"]["q_proj"]["w"].sharding.spec
    if rules is RULES_DATA:
        assert all(x.sharding.spec == P(*([None] * x.ndim)) for x in jax.tree.leaves(params))
    elif rules is RULES_FSDP_TENSOR:
        assert q == P("fsdp", "tensor", None)
    if rules is RULES_EXPERT:
        want = P("expert", "fsdp", None) if shape.get("fsdp") else P("expert", None, None)
        assert layer0["moe"]["gate_proj"].sharding.spec == want
        assert layer0["moe"]["down_proj"].sharding.spec[0] == "expert"
    for x in jax.tree.leaves(params):
        assert set(x.sharding.device_set) == set(jax.devices())


# -- round trip ------------------------------------------------------------------------------------


def _tensors(path: Path) -> dict[str, np.ndarray]:
    with SafetensorsDir(path) as ckpt:
        return {n: ckpt.read(n, ()) for n in ckpt.names()}


@pytest.mark.parametrize("name", ["qwen3_dense", "qwen3_moe"])
def test_load_save_load_is_bit_identical(name, tmp_path, loaded) -> None:
    cfg, graphdef, params = loaded[name]
    src = DENSE if name == "qwen3_dense" else MOE
    # fp32 params (from bf16 files) -> fp32 files -> the same fp32 params
    save_hf_checkpoint(tmp_path / "f32", cfg, params, tokenizer_dir=src, base_config=read_hf_config(src))
    cfg2, _, params2 = load_hf_checkpoint(
        tmp_path / "f32", make_mesh(jax.devices()[:4], dict(fsdp=2, tensor=2)), RULES_FSDP_TENSOR
    )
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
    # stored as bf16 again: every tensor is bit-identical to the one transformers wrote
    files = save_hf_checkpoint(tmp_path / "bf16", cfg2, params2, dtype="bfloat16", max_shard_bytes=30_000)
    assert len(files) > 1 and (tmp_path / "bf16" / "model.safetensors.index.json").is_file()
    original, ours = _tensors(src), _tensors(tmp_path / "bf16")
    assert sorted(original) == sorted(ours)
    for key in original:
        assert ours[key].dtype == original[key].dtype == ml_dtypes.bfloat16, key
        np.testing.assert_array_equal(ours[key].view(np.uint16), original[key].view(np.uint16), err_msg=key)
    # the saved directory is a complete checkpoint: config and tokenizer files
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "f32" / f).is_file()
    saved = read_hf_config(tmp_path / "bf16")
    assert saved["torch_dtype"] == "bfloat16" and saved["model_type"] == read_hf_config(src)["model_type"]


def test_bf16_params_round_trip_bit_identically(tmp_path) -> None:
    mesh = make_mesh(jax.devices()[:2], dict(fsdp=2))
    cfg, _, params = load_hf_checkpoint(MOE, mesh, RULES_FSDP_TENSOR, param_dtype="bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    save_hf_checkpoint(tmp_path, cfg, params)
    _, _, again = load_hf_checkpoint(tmp_path, mesh, RULES_FSDP_TENSOR, param_dtype="bfloat16")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


# -- mismatched checkpoints ------------------------------------------------------------------------


def _edited_dense(tmp_path: Path, edit) -> Path:
    """A copy of the dense fixture whose tensors went through ``edit(dict) -> dict``."""
    out = tmp_path / "ckpt"
    shutil.copytree(DENSE, out)
    tensors = edit(_tensors(DENSE))
    (out / "model.safetensors").unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _load_error(path: Path) -> str:
    with pytest.raises(CheckpointMismatchError) as info:
        load_hf_checkpoint(path, single_mesh(), RULES_DATA)
    return str(info.value)


def test_missing_tensor_is_named(tmp_path) -> None:
    def drop(t):
        del t["model.layers.1.self_attn.k_norm.weight"]
        del t["model.norm.weight"]
        return t

    message = _load_error(_edited_dense(tmp_path, drop))
    assert "missing tensors [model.layers.1.self_attn.k_norm.weight, model.norm.weight] (2)" in message
    assert "unexpected" not in message and "wrong shapes" not in message


def test_extra_and_misshaped_tensors_are_named(tmp_path) -> None:
    def edit(t):
        t["model.layers.2.mlp.up_proj.weight"] = np.zeros((4, 4), ml_dtypes.bfloat16)
        t["model.layers.0.mlp.gate_proj.weight"] = t["model.layers.0.mlp.gate_proj.weight"][:, :16].copy()
        return t

    message = _load_error(_edited_dense(tmp_path, edit))
    assert "unexpected tensors [model.layers.2.mlp.up_proj.weight] (1)" in message
    assert "model.layers.0.mlp.gate_proj.weight: [64, 16] != expected [64, 32]" in message
    assert "missing" not in message


def test_untied_lm_head_in_a_tied_checkpoint_is_reported_unless_ignored(tmp_path) -> None:
    def add_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
        return t

    path = _edited_dense(tmp_path, add_head)
    assert "unexpected tensors [lm_head.weight]" in _load_error(path)
    cfg, _, _ = load_hf_checkpoint(path, single_mesh(), RULES_DATA, ignore_unexpected=["lm_head.weight"])
    assert cfg.tie_embeddings


def test_config_for_other_weights_fails_before_reading_them(tmp_path) -> None:
    out = tmp_path / "ckpt"
    shutil.copytree(DENSE, out)
    config = read_hf_config(out)
    config["num_hidden_layers"] = 3
    config["hidden_size"] = 48
    (out / "config.json").write_text(json.dumps(config))
    message = _load_error(out)
    assert "missing tensors [model.layers.2." in message and "wrong shapes" in message


def test_unsupported_or_broken_directories_fail_clearly(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(tmp_path, single_mesh(), RULES_DATA)
    out = tmp_path / "other"
    shutil.copytree(DENSE, out)
    config = read_hf_config(out)
    (out / "config.json").write_text(json.dumps(dict(config, model_type="gemma3", architectures=["Gemma3ForCausalLM"])))
    with pytest.raises(ConfigMismatchError, match="model_type='gemma3' is not supported"):
        load_hf_checkpoint(out, single_mesh(), RULES_DATA)
    # Qwen3 weights under a Llama config.json: Llama has no q/k norm, so those tensors are unexpected
    (out / "config.json").write_text(json.dumps(dict(config, model_type="llama", architectures=["LlamaForCausalLM"])))
    with pytest.raises(
        CheckpointMismatchError, match=r"LlamaForCausalLM.*unexpected tensors \[model.layers.0.self_attn.k_norm"
    ):
        load_hf_checkpoint(out, single_mesh(), RULES_DATA)
    (out / "config.json").write_text(json.dumps(dict(config, use_sliding_window=True)))
    with pytest.raises(ConfigMismatchError, match="sliding-window attention is not supported yet"):
        load_hf_checkpoint(out, single_mesh(), RULES_DATA)
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors file"):
        load_hf_checkpoint(out, single_mesh(), RULES_DATA)
    moe = tmp_path / "moe"
    shutil.copytree(MOE, moe)
    next(iter(sorted(moe.glob("model-*.safetensors")))).unlink()
    with pytest.raises(FileNotFoundError, match="listed in model.safetensors.index.json but does not exist"):
        load_hf_checkpoint(moe, single_mesh(), RULES_DATA)


def test_hub_style_config_keys_are_understood() -> None:
    """transformers 4.x configs (as on the Hub): rope_theta / rope_scaling at top level, num_experts."""
    hf = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    cfg = ModelConfig.from_hf_config(hf, dtype="bfloat16")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_mlp_dim, cfg.rope_theta) == (128, 8, 768, 1e6)
    assert cfg.rope_type == "yarn" and cfg.rope_factor == 4.0 and cfg.yarn_attention_factor == pytest.approx(1.1386294)
    assert cfg.dtype == "bfloat16" and cfg.num_moe_layers == 48
    assert 30.0e9 < cfg.num_params < 30.8e9 and 3.0e9 < cfg.num_active_params < 3.5e9  # "30B-A3B"
    back = ModelConfig.from_hf_config(cfg.to_hf_config(), dtype="bfloat16")
    assert back == cfg


# -- block reads: each device reads only its block ------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_read_block_reads_exactly_the_block(data) -> None:
    """read_block(spec, reader, index) == (our full array)[index], reading no more than the rows the block covers."""
    e, h, d = data.draw(st.sampled_from([(6, 2, 4), (4, 3, 2), (8, 4, 2)]))
    spec = hf_params.ParamSpec(("q",), ("q.weight",), "linear", in_dims=(e,), out_dims=(h, d))
    if data.draw(st.booleans()):
        spec = hf_params.ParamSpec(("o",), ("o.weight",), "linear", in_dims=(h, d), out_dims=(e,))
    if data.draw(st.booleans()):
        spec = hf_params.ParamSpec(("x",), ("x.0", "x.1", "x.2"), "stacked", spec.in_dims, spec.out_dims)
    rng = np.random.default_rng(0)
    hf = {name: rng.normal(size=spec.hf_shape).astype(np.float32) for name in spec.hf_names}
    n_out, n_in = len(spec.out_dims), len(spec.in_dims)

    def ours_of(w):  # [out, in] -> in_dims + out_dims
        return np.transpose(
            w.reshape(spec.out_dims + spec.in_dims), tuple(range(n_out, n_out + n_in)) + tuple(range(n_out))
        )

    stacked = spec.layout == "stacked"
    full = np.stack([ours_of(hf[n]) for n in spec.hf_names]) if stacked else ours_of(hf[spec.hf_names[0]])
    for j, name in enumerate(spec.hf_names):  # to_hf inverts the layout
        np.testing.assert_array_equal(hf_params.to_hf(spec, full[j] if stacked else full), hf[name])
    index = []
    for n in spec.shape:
        a = data.draw(st.integers(0, n - 1))
        b = data.draw(st.integers(a + 1, n))
        index.append(slice(a, b))
    read = []

    def reader(name, idx):
        block = hf[name][idx]
        read.append(block.size)
        return block

    got = hf_params.read_block(spec, reader, index)
    np.testing.assert_array_equal(got, full[tuple(index)])
    # no more than the block's rows/columns times the trailing dims of each flattened group
    bound = 1
    dims = spec.shape[1:] if spec.layout == "stacked" else spec.shape
    idx = index[1:] if spec.layout == "stacked" else index
    for group in (spec.in_dims, spec.out_dims):
        k = len(group)
        first, rest = idx[0], group[1:]
        bound *= (first.stop - first.start) * int(np.prod(rest))
        idx, dims = idx[k:], dims[k:]
    assert max(read) <= bound


def test_loader_reads_only_each_devices_blocks(monkeypatch) -> None:
    """Sharded over 8 devices, the loader reads each tensor's blocks, never a whole large tensor per device."""
    calls: list[tuple[str, int]] = []
    original = SafetensorsDir.read

    def counting(self, name, index):
        out = original(self, name, index)
        calls.append((name, out.size))
        return out

    monkeypatch.setattr(SafetensorsDir, "read", counting)
    cfg = ModelConfig.from_hf_config(read_hf_config(DENSE))
    load_hf_params(DENSE, cfg, make_mesh(jax.devices(), dict(fsdp=4, tensor=2)), RULES_FSDP_TENSOR)
    table = [size for name, size in calls if name == "model.embed_tokens.weight"]
    assert len(table) == 8 and all(size == cfg.vocab_size * cfg.embed_dim // 8 for size in table)
    q = [size for name, size in calls if name == "model.layers.0.self_attn.q_proj.weight"]
    assert len(q) == 8 and all(size == cfg.embed_dim * cfg.num_heads * cfg.head_dim // 8 for size in q)
