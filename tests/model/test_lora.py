"""Tests for gyre_jax/model/lora.py: the adapter in every model family, the base/adapter split, merging, the PEFT
tensors, and the full-rank identity (a LoRA of rank = the full dimension, alpha = rank, A orthogonal and B = 0 has
exactly the full fine-tuning gradient on every adapted weight)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gyre_jax.config import ConfigError, load_config
from gyre_jax.model import lora
from gyre_jax.model.attention import segment_mask
from gyre_jax.model.config import LoraConfig, ModelConfig
from gyre_jax.model.modules import Transformer
from gyre_jax.model.sharding import init_params, make_mesh
from gyre_jax.rl.losses import GSPOParams, LossConfig
from gyre_jax.rl.micro_step import GradWorker
from gyre_jax.trajectory.batch import make_micro_batches
from gyre_jax.trajectory.branches import Branch

# Every input dimension of every projection is 64 (embed, heads x head_dim, mlp, expert mlp): rank 64 is full rank.
SQUARE = ModelConfig(
    vocab_size=272, num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=64, rope_theta=1e4
)
SQUARE_MOE = dataclasses.replace(SQUARE, num_experts=4, num_experts_per_tok=2, moe_mlp_dim=64, norm_topk_prob=True)
FAMILIES = {
    "qwen3": SQUARE,
    "qwen3_moe_ragged": SQUARE_MOE,
    "qwen3_moe_dense": dataclasses.replace(SQUARE_MOE, moe_impl="dense"),
    "llama": dataclasses.replace(SQUARE, family="llama", tie_embeddings=False),
    "qwen2": dataclasses.replace(SQUARE, family="qwen2"),
    "qwen3_scan": dataclasses.replace(SQUARE, scan_layers=True),
}


def with_lora(cfg: ModelConfig, rank: int = 4, alpha: float = 8.0) -> ModelConfig:
    targets = ("all",) if cfg.is_moe else ("attention", "mlp")
    return dataclasses.replace(cfg, lora=LoraConfig(rank=rank, alpha=alpha, targets=targets))


def build(cfg: ModelConfig, seed: int = 0):
    with nnx.use_eager_sharding(False):
        return nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))


def forward(graphdef, params, cfg):
    tokens = (jnp.arange(24).reshape(2, 12) * 7) % 250
    positions = jnp.tile(jnp.arange(12), (2, 1))
    return nnx.merge(graphdef, params)(tokens, positions, segment_mask(cfg, jnp.ones((2, 12), jnp.int32)))[0]


def perturbed(adapter, scale: float = 0.05, seed: int = 1):
    leaves, treedef = jax.tree.flatten(adapter)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_adapter_starts_as_the_base_and_merges_exactly(name):
    base_cfg = FAMILIES[name]
    cfg = with_lora(base_cfg)
    g0, plain = build(base_cfg)
    g1, full = build(cfg)
    adapter, base = lora.split(full)
    # the seed's base weights are the same with and without an adapter; B starts at zero, A does not
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(a, b)
    assert sum(x.size for x in jax.tree.leaves(adapter)) == cfg.num_lora_params > 0
    flat = {k: v for k, v in lora._flat(adapter).items()}
    assert all(np.all(np.asarray(v.get_value()) == 0) for k, v in flat.items() if k[-1] == "b")
    assert all(np.std(np.asarray(v.get_value())) > 0 for k, v in flat.items() if k[-1] == "a")
    np.testing.assert_array_equal(forward(g1, full, cfg), forward(g0, plain, base_cfg))
    # a trained adapter changes the output; merging it into the weights gives the same function
    moved = lora.combine(base, perturbed(adapter))
    out = forward(g1, moved, cfg)
    assert float(jnp.max(jnp.abs(out - forward(g0, plain, base_cfg)))) > 0.1
    merged_cfg, merged = lora.merged_params(cfg, moved)
    assert merged_cfg == base_cfg and lora.num_leaves(lora.split(merged)[0]) == 0
    np.testing.assert_allclose(forward(g0, merged, base_cfg), out, rtol=0, atol=2e-5)


def test_adapter_shards_by_the_weights_logical_axes():
    cfg = with_lora(SQUARE_MOE)
    mesh = make_mesh(jax.devices(), dict(data=2, fsdp=2, tensor=2))
    rules = load_config([]).sharding_rules
    _, params = init_params(cfg, mesh, rules, seed=0)
    flat = lora._flat(lora.split(params)[0])
    q_a, q_b = (
        flat[("layers", "0", "attn", "q_proj", "lora", "a")],
        flat[("layers", "0", "attn", "q_proj", "lora", "b")],
    )
    rule = dict(rules)
    assert q_a.get_value().sharding.spec[0] == rule["embed"]  # A [E, r]: embed as W's input
    assert q_b.get_value().sharding.spec[1] == rule["heads"]  # B [r, H, D]: heads as W's output
    assert q_a.get_value().sharding.spec[1] is None and q_b.get_value().sharding.spec[0] is None  # rank replicated
    expert_b = flat[("layers", "0", "moe", "down_proj_lora", "b")].get_value()
    assert expert_b.shape == (4, cfg.lora.rank, 64) and expert_b.sharding.spec[2] == rule["embed"]


def _micro_batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    branches = []
    for i in range(4):
        b = Branch(execution_id=f"e{i}", thread_id="main", label="main")
        for n, trainable in ((5, False), (7, True), (3, False), (6, True)):
            b._append(rng.integers(0, 256, n).tolist(), trainable=trainable, logprobs=[-3.0] * n, temperature=1.0,
                      versions=[0] * n)  # fmt: skip
        branches.append(b)
    return make_micro_batches(branches, [1.0, -0.5, 0.8, -1.2], [0.25] * 4, 4, multiple=32)[0]


def _orthogonal_adapter(adapter, seed: int):
    """Every A [..., in, r] (r = in) an orthogonal matrix, every B zero."""

    def one(path, var):
        value = var.get_value()
        if str(getattr(path[-1], "key", path[-1])) == "b":
            return var.replace(jnp.zeros_like(value))
        return var.replace(_orthogonal(value.shape, seed + len(str(path))))

    return jax.tree_util.tree_map_with_path(one, adapter, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _orthogonal(shape, seed: int) -> jax.Array:
    """An array of ``shape`` [*batch, *in, r] whose every [prod(in), r] slice (per batch index) is orthogonal."""
    rank = shape[-1]
    rng = np.random.default_rng(seed)
    batch = shape[0] if len(shape) > 2 and np.prod(shape[1:-1]) == rank else 1
    mats = [np.linalg.qr(rng.normal(size=(rank, rank)))[0] for _ in range(batch)]
    return jnp.asarray(np.stack(mats).reshape(shape), jnp.float32)


@pytest.mark.parametrize("name", ["qwen3_moe_ragged", "llama"])
def test_full_rank_lora_reproduces_the_full_finetuning_gradient(name):
    """rank = every input dimension (64), alpha = rank (scale 1), A orthogonal, B = 0: the model is the base, the
    adapter's gradient is dL/dB = A^T G (G: the full fine-tuning gradient of W) and dL/dA = 0, so the update it
    makes to the effective weight, scale A dB, is exactly G: same direction (and size) on every adapted weight."""
    base_cfg = FAMILIES[name]
    rank = 64
    cfg = dataclasses.replace(base_cfg, lora=LoraConfig(rank=rank, alpha=float(rank), targets=("all",)))
    if not base_cfg.is_moe:
        cfg = dataclasses.replace(cfg, lora=LoraConfig(rank=rank, alpha=float(rank), targets=("attention", "mlp")))
    mesh = make_mesh(jax.devices()[:1], dict(data=1))
    rules = load_config([]).sharding_rules
    graphdef0, plain = init_params(base_cfg, mesh, rules, seed=3)
    graphdef1, full = init_params(cfg, mesh, rules, seed=3)
    adapter = _orthogonal_adapter(lora.split(full)[0], seed=7)
    loss_cfg = LossConfig(params=GSPOParams(clip_low=0.2, clip_high=0.28))
    mb = _micro_batch()

    full_ft = GradWorker(base_cfg, graphdef0, mesh, rules, loss_cfg, name="full")
    grads_w, aux_w = full_ft.micro_step(full_ft.snapshot(plain), mb)
    lora_worker = GradWorker(cfg, graphdef1, mesh, rules, loss_cfg, name="lora")
    lora_worker.set_base(full)
    grads_ab, aux_ab = lora_worker.micro_step(lora_worker.snapshot(adapter), mb)
    assert float(aux_ab["loss"]) == pytest.approx(float(aux_w["loss"]), rel=1e-6)  # B = 0: the model is the base

    # the effective update of each adapted weight: scale * A @ dL/dB (lora.deltas computes scale * A @ B)
    flat_g = lora._flat(grads_ab)
    assert all(float(jnp.max(jnp.abs(v.get_value()))) == 0.0 for k, v in flat_g.items() if k[-1] == "a")

    def a_and_grad_b(path, var):
        key = tuple(str(getattr(k, "key", k)) for k in path)
        return var if key[-1] == "b" else var.replace(lora._flat(adapter)[key].get_value())

    effective = lora.deltas(cfg, lora.combine(lora.split(full)[1], jax.tree_util.tree_map_with_path(
        a_and_grad_b, grads_ab, is_leaf=lambda x: isinstance(x, nnx.Variable))))  # fmt: skip
    flat_w = lora._flat(grads_w)
    assert len(effective) == sum(1 for k in lora._flat(adapter) if k[-1] == "a") > 0
    for path, eff in effective.items():
        g = np.asarray(flat_w[path].get_value()).ravel()
        e = np.asarray(eff).ravel()
        assert np.linalg.norm(g) > 0, path
        cosine = float(g @ e / (np.linalg.norm(g) * np.linalg.norm(e)))
        assert cosine > 1 - 1e-5, (path, cosine)
        np.testing.assert_allclose(e, g, rtol=0, atol=1e-4 * np.abs(g).max(), err_msg=str(path))


def test_a_lower_rank_adapter_does_not_reproduce_it():
    """The identity above needs full rank: at rank 8 the effective update is a projection of G (cosine < 1)."""
    cfg = dataclasses.replace(SQUARE, lora=LoraConfig(rank=8, alpha=8.0, targets=("attention", "mlp")))
    mesh = make_mesh(jax.devices()[:1], dict(data=1))
    rules = load_config([]).sharding_rules
    graphdef0, plain = init_params(SQUARE, mesh, rules, seed=3)
    graphdef1, full = init_params(cfg, mesh, rules, seed=3)
    adapter = lora.split(full)[0]
    mb = _micro_batch()
    grads_w, _ = GradWorker(SQUARE, graphdef0, mesh, rules, name="f").micro_step(plain, mb)
    worker = GradWorker(cfg, graphdef1, mesh, rules, name="l")
    worker.set_base(full)
    grads_ab, _ = worker.micro_step(worker.snapshot(adapter), mb)
    a_flat = lora._flat(adapter)
    tree = jax.tree_util.tree_map_with_path(
        lambda p, v: v if str(getattr(p[-1], "key", p[-1])) == "b" else v.replace(
            a_flat[tuple(str(getattr(k, "key", k)) for k in p)].get_value()),
        grads_ab, is_leaf=lambda x: isinstance(x, nnx.Variable))  # fmt: skip
    eff = lora.deltas(cfg, lora.combine(lora.split(full)[1], tree))
    q = ("layers", "0", "attn", "q_proj", "w")
    g, e = np.asarray(lora._flat(grads_w)[q].get_value()).ravel(), np.asarray(eff[q]).ravel()
    assert float(g @ e / (np.linalg.norm(g) * np.linalg.norm(e))) < 0.9


def test_peft_tensors_and_config():
    cfg = with_lora(dataclasses.replace(SQUARE, num_heads=2, head_dim=16), rank=4)  # q out 32, o in 32
    _, full = build(cfg)
    tensors = lora.peft_tensors(cfg, lora.combine(lora.split(full)[1], perturbed(lora.split(full)[0])))
    prefix = "base_model.model.model.layers.1."
    assert tensors[prefix + "self_attn.q_proj.lora_A.weight"].shape == (4, 64)  # [r, in]
    assert tensors[prefix + "self_attn.q_proj.lora_B.weight"].shape == (32, 4)  # [out, r]
    assert tensors[prefix + "self_attn.o_proj.lora_A.weight"].shape == (4, 32)
    assert tensors[prefix + "mlp.down_proj.lora_B.weight"].shape == (64, 4)
    assert len(tensors) == 2 * 7 * cfg.num_layers
    conf = lora.peft_config(cfg, "base")
    assert conf["r"] == 4 and conf["lora_alpha"] == 8.0 and conf["peft_type"] == "LORA"
    assert conf["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    json.dumps(conf)
    # the stacked layer layout writes the same tensors
    stacked_cfg = dataclasses.replace(cfg, scan_layers=True)
    _, stacked = build(stacked_cfg)
    per_layer = lora.peft_tensors(cfg, full)
    for k, v in lora.peft_tensors(stacked_cfg, stacked).items():
        np.testing.assert_array_equal(v, per_layer[k])
    moe = with_lora(SQUARE_MOE)
    with pytest.raises(NotImplementedError, match="MoE experts"):
        lora.peft_tensors(moe, build(moe)[1])


@pytest.mark.parametrize(
    "override, message",
    [
        ("--config.model.lora.rank=-1", "config.model.lora.rank=-1 must be >= 0"),
        ("--config.model.lora.alpha=0", "config.model.lora.alpha=0.0 must be > 0"),
        ("--config.model.lora.dropout=0.1", "not supported yet"),
        ("--config.model.lora.targets=('qkv',)", "must name some of"),
        ("--config.model.lora.targets=('experts',)", "adapt no weight of this model"),
    ],
)
def test_bad_lora_config_is_one_line(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(["--config.model.lora.rank=8", override])


def test_lora_config_round_trips_through_config_json():
    config = load_config(["--config.model.lora.rank=8", "--config.model.lora.targets=('attention',)"])
    assert config.model_config().lora == LoraConfig(rank=8, targets=("attention",))
    again = ModelConfig.from_config_dict(json.loads(json.dumps(config.to_dict()))["model"])
    assert again.lora == LoraConfig(rank=8, targets=("attention",)) and again.num_lora_params == 2 * 8 * (
        (128 + 128) + 2 * (128 + 64) + (128 + 128)
    )
