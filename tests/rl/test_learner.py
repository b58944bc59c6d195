"""Tests for gyre_jax/rl/learner.py: summed micro-step gradients, skipped non-finite steps, learning direction.

Every micro-batch here has the same shape ([4, 32]) so the learner's jitted functions compile once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyre_jax.config import load_config
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.sharding import init_params, make_mesh
from gyre_jax.rl.learner import Learner, OptimizerConfig, token_logprobs
from gyre_jax.rl.losses import GSPOParams, LossConfig
from gyre_jax.trajectory.batch import make_micro_batches, replace
from gyre_jax.trajectory.branches import Branch

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
ROWS, MULTIPLE = 4, 32  # every micro-batch: [4, 32]


@pytest.fixture(scope="module")
def setup():
    mesh = make_mesh(jax.devices(), dict(data=4, fsdp=2))
    rules = load_config([]).sharding_rules
    graphdef, params = init_params(CFG, mesh, rules, seed=0)
    wide = LossConfig(params=GSPOParams(clip_low=0.2, clip_high=0.28))  # GSPO with a wide clip range
    learner = Learner(CFG, graphdef, mesh, rules, OptimizerConfig(learning_rate=3e-3), wide)
    logprob_fn = jax.jit(lambda p, mb: token_logprobs(graphdef, p, mb))
    return learner, params, logprob_fn


def fresh_state(learner, params):
    """A new TrainState on copies of ``params`` (``Learner.step`` donates the state it is given)."""
    return learner.init_state(jax.tree.map(jnp.copy, params))


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def make_branches(seed: int) -> list[Branch]:
    """Four branches (<= 33 tokens): prompt, completion, tool output, completion (temperature 0.7)."""
    rng = np.random.default_rng(seed)
    branches = []
    for i in range(4):
        parts = [
            (rng.integers(3, 8), False),
            (rng.integers(3, 9), True),
            (rng.integers(1, 5), False),
            (rng.integers(2, 9), True),
        ]
        b = Branch(execution_id=f"e{i}", thread_id="main", label="main")
        for n, trainable in parts:
            b._append(
                rng.integers(0, 256, int(n)).tolist(),
                trainable=trainable,
                logprobs=[0.0] * int(n),
                temperature=0.7,
                versions=[0] * int(n),
            )
        assert len(b.tokens) - 1 <= MULTIPLE
        branches.append(b)
    return branches


def batches(branches, advantages, weights, groups):
    """One [4, 32] micro-batch per group of branch indices (short groups padded with empty rows)."""
    return [
        make_micro_batches(
            [branches[i] for i in g], [advantages[i] for i in g], [weights[i] for i in g], ROWS, multiple=MULTIPLE
        )[0]
        for g in groups
    ]


def set_behaviour_logprobs(branches, logprob_fn, params, noise: float, seed: int, shifts=(0.0,) * 4) -> None:
    """Writes on-policy log-probs of every trainable token into the branches, minus ``shifts[i]`` (so branch
    i's log-ratio is about ``shifts[i]``) plus per-token noise."""
    mb = batches(branches, [0.0] * 4, [0.0] * 4, [[0, 1, 2, 3]])[0]
    logp = np.asarray(logprob_fn(params, mb))
    rng = np.random.default_rng(seed)
    for row, b in enumerate(branches):
        n = len(b.tokens) - 1
        lp = logp[row, :n] - shifts[row] + noise * rng.normal(size=n)
        b.logprobs = [0.0] + [float(x) if tr else 0.0 for x, tr in zip(lp, b.trainable[1:])]


@pytest.fixture(scope="module")
def off_policy(setup):
    learner, params, logprob_fn = setup
    branches = make_branches(seed=1)
    # Ratios spread around 1; sequences 0 (A > 0, ratio ~1.6) and 3 (A < 0, ratio ~0.6) are clipped.
    set_behaviour_logprobs(branches, logprob_fn, params, noise=0.1, seed=2, shifts=(0.5, 0.05, -0.05, -0.5))
    advantages = [1.0, -0.5, 0.8, -1.2]
    weights = [0.25] * 4  # the global normalization: each sequence counts once in the step
    return branches, advantages, weights


def test_step_is_independent_of_micro_batch_order_and_split(setup, off_policy):
    learner, params, _ = setup
    branches, adv, w = off_policy
    big = batches(branches, adv, w, [[0, 1, 2, 3]])
    splits = {
        "two": batches(branches, adv, w, [[0, 1], [2, 3]]),
        "two-reversed": batches(branches, adv, w, [[2, 3], [0, 1]]),
        "three-shuffled": batches(branches, adv, w, [[3], [1, 0], [2]]),
    }
    # Summed micro-step gradients equal the gradient of the single big micro-batch.
    g_big, aux_big = learner.micro_step(params, big[0])
    g_big = host(g_big)
    scale = max(np.abs(x).max() for x in jax.tree.leaves(g_big))
    assert scale > 0
    for name, mbs in splits.items():
        total = None
        loss = 0.0
        for mb in mbs:
            g, aux = learner.micro_step(params, mb)
            g = host(g)
            loss += float(aux["loss"])
            total = g if total is None else jax.tree.map(np.add, total, g)
        assert loss == pytest.approx(float(aux_big["loss"]), rel=1e-5, abs=1e-7), name
        for a, b in zip(jax.tree.leaves(total), jax.tree.leaves(g_big)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * scale, err_msg=name)

    # One optimizer step gives the same parameters and metrics whatever the split and order.
    ref_state, ref_metrics = learner.step(fresh_state(learner, params), big)
    ref = host(ref_state)
    assert ref_metrics["skipped"] == 0 and int(ref.step) == 1
    assert ref_metrics["clip_fraction"] == pytest.approx(0.5)  # sequences 0 and 3, weight 0.25 each
    moved = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(host(params))))
    assert moved > 1e-3  # the step really changes the weights (lr 3e-3)
    for name, mbs in splits.items():
        state, metrics = learner.step(fresh_state(learner, params), mbs)
        got = host(state)
        assert int(got.step) == 1
        for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(ref.params)):
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-6, err_msg=name)
        for k in ("loss", "clip_fraction", "ratio_mean", "logprob_gap", "grad_norm"):
            assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-4, abs=1e-7), (name, k)
    # Sharding of the parameters is kept through the step.
    for a, b in zip(jax.tree.leaves(ref_state.params), jax.tree.leaves(learner.param_shardings)):
        assert a.sharding.is_equivalent_to(b, a.ndim)


@pytest.mark.parametrize("field", ["old_logprobs", "advantages"])
def test_non_finite_micro_batch_skips_the_step(setup, off_policy, field):
    learner, params, _ = setup
    branches, adv, w = off_policy
    good, bad = batches(branches, adv, w, [[0, 1], [2, 3]])
    if field == "old_logprobs":
        values = bad.old_logprobs.copy()
        row, col = np.argwhere(bad.loss_mask > 0)[0]
        values[row, col] = np.nan
    else:
        values = bad.advantages.copy()
        values[1] = np.nan
    bad = replace(bad, **{field: values})
    state = fresh_state(learner, params)
    before = host(state)
    state, metrics = learner.step(state, [good, bad])
    after = host(state)
    assert metrics["skipped"] == 1
    assert not np.isfinite(metrics["grad_norm"])
    assert int(after.step) == int(before.step) == 0
    for a, b in zip(jax.tree.leaves(after.params), jax.tree.leaves(before.params)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(after.opt_state), jax.tree.leaves(before.opt_state)):
        np.testing.assert_array_equal(a, b)
    # The state is still usable: a finite step afterwards applies normally.
    state, metrics = learner.step(state, [good])
    assert metrics["skipped"] == 0 and int(state.step) == 1
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(host(state.params)))


def _seq_mean_logprobs(logprob_fn, params, mb) -> np.ndarray:
    logp = np.asarray(logprob_fn(params, mb))
    return (logp * mb.loss_mask).sum(1) / np.maximum(mb.loss_mask.sum(1), 1)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_rl_steps_move_sampled_tokens_in_the_advantage_direction(setup, sign):
    learner, params, logprob_fn = setup
    branches = make_branches(seed=5)
    adv = [sign * a for a in (1.0, 0.5, 2.0, 1.5)]
    state = fresh_state(learner, params)
    start = None
    for i in range(3):
        # On-policy: behaviour log-probs are the current policy's own (computed by token_logprobs).
        set_behaviour_logprobs(branches, logprob_fn, state.params, noise=0.0, seed=0)
        (mb,) = batches(branches, adv, [0.25] * 4, [[0, 1, 2, 3]])
        if start is None:
            start = _seq_mean_logprobs(logprob_fn, state.params, mb)
        state, metrics = learner.step(state, [mb])
        assert metrics["skipped"] == 0
        assert metrics["logprob_gap"] < 1e-5, i
        assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        assert metrics["clip_fraction"] == 0.0
    assert int(state.step) == 3
    end = _seq_mean_logprobs(logprob_fn, state.params, mb)
    change = sign * (end - start)
    assert np.all(change > 0), (start, end)  # every sequence moved in the direction of its advantage
    assert change.mean() > 0.05


def test_init_state_keeps_param_shardings(setup):
    learner, params, _ = setup
    state = fresh_state(learner, params)
    for a, sh in zip(jax.tree.leaves(state.params), jax.tree.leaves(learner.param_shardings)):
        assert a.sharding.is_equivalent_to(sh, a.ndim)
    assert int(state.step) == 0


def test_init_state_shards_optimizer_moments_like_params(setup):
    learner, params, _ = setup
    state = fresh_state(learner, params)
    adam = state.opt_state[1][0]  # chain(clip_by_global_norm, adamw): ScaleByAdamState
    for moments in (adam.mu, adam.nu):
        for a, sh in zip(jax.tree.leaves(moments), jax.tree.leaves(learner.param_shardings)):
            assert a.sharding.is_equivalent_to(sh, a.ndim), (a.sharding, sh)


def test_off_policy_mask_counts_reach_the_step_metrics(setup):
    """is_token_mask / is_sequence_mask on a learner: the step's metrics carry the masked-token fraction and
    the masked-sequence count computed from the micro-batch's own ratios, whatever the micro-batch split."""
    base, params, logprob_fn = setup
    token_cap, seq_cap = 1.2, 1.3
    masks = LossConfig("grpo", is_token_mask=token_cap, is_sequence_mask=seq_cap)
    learner = Learner(CFG, base.graphdef, base.mesh, base.rules, OptimizerConfig(learning_rate=3e-3), masks)
    branches = make_branches(seed=1)
    set_behaviour_logprobs(branches, logprob_fn, params, noise=0.15, seed=2, shifts=(0.5, 0.05, -0.05, -0.5))
    adv, w = [1.0, -0.5, 0.8, -1.2], [0.25] * 4
    (whole,) = batches(branches, adv, w, [[0, 1, 2, 3]])
    trainable = whole.loss_mask > 0
    log_r = np.where(trainable, np.asarray(logprob_fn(params, whole)) - whole.old_logprobs, 0.0)
    want_tokens = np.sum(trainable & (np.abs(log_r) > np.log(token_cap))) / np.sum(trainable)
    seq_mean = log_r.sum(1) / np.maximum(trainable.sum(1), 1)  # one sequence per row here
    want_seqs = float(np.sum(np.abs(seq_mean) > np.log(seq_cap)))
    assert 0 < want_tokens < 1 and want_seqs == 2.0  # rows 0 and 3 (shifts +-0.5)
    for groups in ([[0, 1, 2, 3]], [[0, 1], [2, 3]]):
        _, metrics = learner.step(fresh_state(learner, params), batches(branches, adv, w, groups))
        assert metrics["skipped"] == 0
        assert metrics["is_masked_token_fraction"] == pytest.approx(want_tokens, rel=1e-6)
        assert metrics["is_masked_sequences"] == pytest.approx(want_seqs)
    _, plain = base.step(fresh_state(base, params), [whole])
    assert "is_masked_token_fraction" not in plain and "is_masked_sequences" not in plain
