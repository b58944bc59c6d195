"""Tests for gyre_jax/checkpoint.py: orbax save/restore of the learner's TrainState plus JSON metadata."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyre_jax.checkpoint import Checkpointer, abstract_like
from gyre_jax.config import load_config
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.sharding import init_params, make_mesh
from gyre_jax.rl.learner import Learner, OptimizerConfig, TrainState

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


@pytest.fixture(scope="module")
def learner_and_state():
    """A Learner on a (data=4, fsdp=2) mesh and a TrainState with non-trivial optimizer moments."""
    mesh = make_mesh(jax.devices(), dict(data=4, fsdp=2))
    rules = load_config([]).sharding_rules
    graphdef, params = init_params(CFG, mesh, rules, seed=3)
    learner = Learner(CFG, graphdef, mesh, rules, OptimizerConfig(learning_rate=1e-3))
    state = learner.init_state(params)
    # One AdamW update with a pseudo-gradient (the params themselves): non-zero mu/nu, count 1.
    updates, opt_state = jax.jit(learner.tx.update)(state.params, state.opt_state, state.params)
    new_params = jax.jit(lambda p, u: jax.tree.map(jnp.add, p, u), out_shardings=learner.param_shardings)(
        state.params, updates
    )
    return learner, TrainState(params=new_params, opt_state=opt_state, step=jnp.asarray(7, jnp.int32))


def leaves_with_paths(tree):
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def test_abstract_state_matches_the_live_state(learner_and_state):
    learner, state = learner_and_state
    abstract = learner.abstract_state()
    assert jax.tree.structure(abstract) == jax.tree.structure(state)
    for (path, a), (_, x) in zip(leaves_with_paths(abstract), leaves_with_paths(state)):
        assert (a.shape, a.dtype) == (x.shape, x.dtype), path


def test_abstract_state_carries_the_learner_shardings(learner_and_state):
    learner, _ = learner_and_state
    abstract = learner.abstract_state()
    for (path, a), sh in zip(leaves_with_paths(abstract.params), jax.tree.leaves(learner.param_shardings)):
        assert a.sharding is not None and a.sharding.is_equivalent_to(sh, len(a.shape)), path
    for path, a in leaves_with_paths(abstract.opt_state) + [("step", abstract.step)]:
        assert a.sharding is not None and set(a.sharding.device_set) == set(learner.mesh.devices.flat), path


def test_save_restore_is_bit_identical_and_keeps_shardings(tmp_path, learner_and_state):
    learner, state = learner_and_state
    ckpt = Checkpointer(tmp_path / "checkpoints", max_to_keep=2)
    meta = {
        "policy_version": 7,
        "data_cursor": {"step": 7, "seed": 0},
        "done": ["warm_start"],
        "loss": 0.25,
        "note": None,
    }
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    ckpt.save(7, state, meta)
    assert ckpt.latest_step() == 7

    restored, restored_meta = ckpt.restore(7, learner.abstract_state())
    assert restored_meta == meta
    assert isinstance(restored, TrainState)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for (path, r), (_, x) in zip(leaves_with_paths(restored), leaves_with_paths(state)):
        assert r.dtype == x.dtype and r.shape == x.shape, path
        np.testing.assert_array_equal(np.asarray(r), np.asarray(x), err_msg=path)
        if x.ndim:  # optimizer moments come back sharded as they were saved
            assert r.sharding.is_equivalent_to(x.sharding, r.ndim), (path, r.sharding, x.sharding)
    assert int(restored.step) == 7
    # Parameters come back on the learner's (fsdp-sharded) shardings, not gathered on one device.
    for (path, r), sh in zip(leaves_with_paths(restored.params), jax.tree.leaves(learner.param_shardings)):
        assert r.sharding.is_equivalent_to(sh, r.ndim), (path, r.sharding, sh)
    assert any(
        r.sharding.spec != jax.sharding.PartitionSpec(*(None,) * r.ndim)
        for _, r in leaves_with_paths(restored.params)
        if hasattr(r.sharding, "spec")
    )
    ckpt.close()


def test_restore_onto_shardings_of_a_live_tree(tmp_path, learner_and_state):
    _, state = learner_and_state
    ckpt = Checkpointer(tmp_path / "c")
    ckpt.save(1, state, {"k": 1})
    restored, _ = ckpt.restore(1, abstract_like(state))
    for (path, r), (_, x) in zip(leaves_with_paths(restored), leaves_with_paths(state)):
        np.testing.assert_array_equal(np.asarray(r), np.asarray(x), err_msg=path)
        assert r.sharding.is_equivalent_to(x.sharding, r.ndim), path
    ckpt.close()


def test_latest_step_and_max_to_keep(tmp_path, learner_and_state):
    _, state = learner_and_state
    small = {"w": state.step, "v": jnp.arange(4.0)}
    directory = tmp_path / "keep"
    ckpt = Checkpointer(directory, max_to_keep=2)
    for step in (1, 2, 5, 9):
        ckpt.save(step, jax.tree.map(lambda x, s=step: x + s, small), {"step": step})
    assert ckpt.latest_step() == 9
    assert sorted(ckpt.all_steps()) == [5, 9]
    restored, meta = ckpt.restore(5, abstract_like(small))
    assert meta == {"step": 5}
    np.testing.assert_array_equal(np.asarray(restored["v"]), np.arange(4.0) + 5)
    ckpt.close()
    # A new Checkpointer over the same directory (a resumed run) sees the same steps.
    again = Checkpointer(directory, max_to_keep=2)
    assert again.latest_step() == 9 and sorted(again.all_steps()) == [5, 9]
    again.close()
