"""``model.logprobs.target_logprobs`` in chunks equals the whole-logits computation (values and gradients), the
learner's micro-step gives the same loss and gradients with ``logits_chunk`` set, and the chunked backward holds
less memory (XLA's compiled memory analysis: compile only, nothing timed). ``build.setup`` takes the compute
fields (remat, kernels, chunking) of the run config for a Hugging Face checkpoint too."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gyre_jax.model.config import COMPUTE_FIELDS, ModelConfig
from gyre_jax.model.logprobs import target_logprobs
from gyre_jax.model.modules import Transformer

CFG = ModelConfig(
    vocab_size=300, num_layers=1, embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, rope_theta=1e4
)
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "model" / "qwen3_dense"


def _inputs(b: int, t: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, t)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, t)), jnp.int32)
    temperature = jnp.asarray(rng.uniform(0.5, 1.5, (b, t)), jnp.float32)
    return tokens, targets, temperature


def _split(cfg: ModelConfig):
    with nnx.use_eager_sharding(False):
        return nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))


def _loss(chunk: int, tie: bool, linear: bool = False, dtype: str = "float32"):
    graphdef, params = _split(dataclasses.replace(CFG, tie_embeddings=tie, dtype=dtype))

    def loss(p, tokens, targets, temperature):
        model = nnx.merge(graphdef, p)
        t = tokens.shape[1]
        positions = jnp.broadcast_to(jnp.arange(t), tokens.shape)
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (tokens.shape[0], t, t))
        hidden, _ = model(tokens, positions, mask, head=False)
        logp = target_logprobs(model.linear_head() if linear else model.head, hidden, targets, temperature, chunk)
        return jnp.sum(logp * jnp.linspace(0.1, 1.0, t)), logp  # position-dependent weights: order matters

    return params, jax.jit(jax.value_and_grad(loss, has_aux=True))


@pytest.mark.parametrize("chunk, tie", [(7, True), (16, False), (64, True)])
def test_chunked_target_logprobs_equal_the_whole_logits_values_and_gradients(chunk, tie):
    params, whole = _loss(0, tie)
    _, chunked = _loss(chunk, tie)
    args = _inputs(2, 45)  # 45 tokens: not a multiple of any chunk (the padded tail is dropped)
    (lw, pw), gw = whole(params, *args)
    (lc, pc), gc = chunked(params, *args)
    assert pc.shape == (2, 45)
    np.testing.assert_allclose(np.asarray(pc), np.asarray(pw), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(lc), float(lw), rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(gw), jax.tree.leaves(gc)):
        scale = float(np.max(np.abs(np.asarray(a)))) or 1.0
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))
    # the logits head really was trained through the chunks (a zero gradient would make the check vacuous)
    assert max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(gc)) > 1e-3


@pytest.mark.parametrize("chunk, tie", [(0, True), (0, False), (16, True), (7, False)])
def test_the_linear_heads_own_backward_equals_jax_autodiff_of_the_head(chunk, tie):
    """``Transformer.linear_head`` (``logprobs.linear_logprobs``' custom VJP: logits recomputed, the softmax gradient
    formed once) gives the log-probs and every parameter gradient of JAX's autodiff through ``model.head``."""
    params, reference = _loss(0, tie)
    _, linear = _loss(chunk, tie, linear=True)
    args = _inputs(2, 45, seed=3)
    (lr, pr), gr = reference(params, *args)
    (ll, pl), gl = linear(params, *args)
    np.testing.assert_allclose(np.asarray(pl), np.asarray(pr), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(ll), float(lr), rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(gr), jax.tree.leaves(gl)):
        scale = float(np.max(np.abs(np.asarray(a)))) or 1.0
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))
    head = "embedder" if tie else "lm_head"
    assert any(head in jax.tree_util.keystr(p) and float(np.max(np.abs(np.asarray(x)))) > 1e-3
               for p, x in jax.tree_util.tree_leaves_with_path(gl))  # fmt: skip


def test_the_linear_head_in_bfloat16_compute_stays_close_to_autodiff():
    params, reference = _loss(0, True, dtype="bfloat16")
    _, linear = _loss(0, True, linear=True, dtype="bfloat16")
    args = _inputs(2, 33, seed=4)
    (_, pr), gr = reference(params, *args)
    (_, pl), gl = linear(params, *args)
    np.testing.assert_allclose(np.asarray(pl), np.asarray(pr), rtol=2e-2, atol=2e-2)
    for a, b in zip(jax.tree.leaves(gr), jax.tree.leaves(gl)):
        assert a.dtype == b.dtype
        scale = float(np.max(np.abs(np.asarray(a, np.float32)))) or 1.0
        np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), atol=3e-2 * scale)


def test_the_chunked_backward_holds_a_fraction_of_the_whole_logits_memory():
    from gyre_jax.model.attention import tree_mask

    cfg = dataclasses.replace(CFG, vocab_size=8192, attention_impl="blockwise")  # attention's memory linear in T

    def temp_bytes(chunk: int) -> int:
        graphdef, params = _split(cfg)

        def loss(p, tokens, targets, temperature):
            model = nnx.merge(graphdef, p)
            t = tokens.shape[1]
            positions = jnp.broadcast_to(jnp.arange(t), tokens.shape)
            mask = tree_mask(cfg, jnp.ones_like(tokens), jnp.full_like(tokens, t))  # one causal row
            hidden, _ = model(tokens, positions, mask, head=False)
            return jnp.sum(target_logprobs(model.head, hidden, targets, temperature, chunk))

        shapes = (jax.ShapeDtypeStruct((1, 1024), jnp.int32),) * 2 + (jax.ShapeDtypeStruct((1, 1024), jnp.float32),)
        analysis = jax.jit(jax.grad(loss)).lower(params, *shapes).compile().memory_analysis()
        if analysis is None:
            pytest.skip("this backend's compiled memory_analysis() is None")
        return analysis.temp_size_in_bytes

    whole, chunked = temp_bytes(0), temp_bytes(128)
    logits_bytes = 1024 * 8192 * 4  # one [T, V] float32 copy: 32 MiB
    assert whole >= 3 * logits_bytes, whole  # the logits, their softmax and gradients are live at once
    # about 4 copies of one chunk's [128, V] logits: 1/8 of the whole logits here, ~16 MiB
    assert chunked < whole / 6 and chunked < logits_bytes, (whole, chunked)


def test_the_learner_micro_step_with_logits_chunk_gives_the_same_loss_and_gradients():
    from gyre_jax.config import load_config
    from gyre_jax.model.sharding import init_params, make_mesh
    from gyre_jax.rl.micro_step import GradWorker
    from gyre_jax.trajectory.batch import MicroBatch

    mesh = make_mesh(jax.devices()[:2], dict(data=2))
    rules = load_config([]).sharding_rules
    b, t = 2, 40
    tokens, targets, temperature = _inputs(b, t, seed=1)
    seg = np.ones((b, t), np.int32)
    mb = MicroBatch(
        tokens=np.asarray(tokens), positions=np.tile(np.arange(t, dtype=np.int32), (b, 1)), segment_ids=seg,
        subtree_end=np.full((b, t), t, np.int32), targets=np.asarray(targets),
        loss_mask=np.ones((b, t), np.float32) / (b * t), old_logprobs=np.full((b, t), -5.0, np.float32),
        temperature=np.asarray(temperature), seq_index=np.tile(np.arange(b, dtype=np.int32)[:, None], (1, t)),
        advantages=np.array([1.0, -1.0], np.float32), seq_weights=np.ones(b, np.float32),
    )  # fmt: skip
    out = {}
    for chunk in (0, 16):
        cfg = dataclasses.replace(CFG, logits_chunk=chunk)
        graphdef, params = init_params(cfg, mesh, rules, seed=0)
        worker = GradWorker(cfg, graphdef, mesh, rules)
        out[chunk] = {kind: worker.micro_step(params, mb, kind=kind) for kind in ("rl", "sft")}
    for kind in ("rl", "sft"):
        (g0, m0), (g1, m1) = out[0][kind], out[16][kind]
        np.testing.assert_allclose(float(m1["loss"]), float(m0["loss"]), rtol=1e-5)
        for a, c in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
            scale = float(np.max(np.abs(np.asarray(a)))) or 1.0
            np.testing.assert_allclose(np.asarray(c), np.asarray(a), atol=1e-5 * scale)


def test_a_run_from_a_hugging_face_checkpoint_computes_as_its_run_config_says(tmp_path):
    """remat, dtypes, kernels and chunking are the run config's (the checkpoint's config.json has none of them)."""
    from gyre_jax import build
    from gyre_jax import config as config_lib

    compute = {"remat_policy": "full", "attention_impl": "blockwise", "attention_block_q": 32, "logits_chunk": 64}
    config = config_lib.load_config(
        [f"--config.workdir={tmp_path}", f"--config.model.checkpoint_dir={FIXTURE}", "--config.tokenizer.kind=hf",
         "--config.warm_start.steps=0", *(f"--config.model.{k}={v}" for k, v in compute.items())]
    )  # fmt: skip
    model_cfg = build.setup(config).model_cfg
    assert model_cfg.embed_dim == 32  # the architecture is the checkpoint's
    for name in COMPUTE_FIELDS:
        assert getattr(model_cfg, name) == getattr(config.model, name), name
    assert {k: getattr(model_cfg, k) for k in compute} == compute
