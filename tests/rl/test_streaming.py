"""Tests for the streaming optimizer step (gyre_jax/rl/learner.py with microstep_queue.py, accumulator.py,
micro_step.py): claim order, streaming arrival, core + satellite on disjoint submeshes, failures, NaN skip,
the objective variants inside the learner, and the learning-rate schedule.

Every micro-batch has shape [2, 32] (the big one [8, 32]), so each learner compiles its micro-step twice.
"""

from __future__ import annotations

import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from timelimits import scaled

from gyre_jax.checkpoint import Checkpointer
from gyre_jax.config import load_config
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.sharding import init_params, make_mesh
from gyre_jax.rl.learner import Learner, OptimizerConfig, learning_rate_schedule, token_logprobs
from gyre_jax.rl.losses import GRPOParams, GSPOParams, LossConfig
from gyre_jax.rl.microstep_queue import MicroStepQueue
from gyre_jax.runtime.cells import make_cells
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
NUM, ROWS, LEN = 8, 2, 32  # 8 branches -> 4 micro-batches of [2, 32]
OPT = OptimizerConfig(learning_rate=3e-3)
WIDE = GSPOParams(clip_low=0.2, clip_high=0.28)  # GSPO with a wide clip range: most sequences carry gradient
GROUPS = [[0, 1], [2, 3], [4, 5], [6, 7]]


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def copy_tree(tree):
    return jax.tree.map(jnp.copy, tree)


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(host(a)), jax.tree.leaves(host(b))))


def assert_params_close(a, b) -> None:
    """Params after one AdamW step from the same start, from gradients equal to float tolerance. Adam's first
    update is about lr * sign(g), so a weight whose gradient is ~0 may move by a fraction of lr on float noise
    alone: 99.9% of the weights must agree to 2e-6, all to 1% of the learning rate."""
    diffs = np.concatenate([np.abs(x - y).ravel() for x, y in zip(jax.tree.leaves(host(a)), jax.tree.leaves(host(b)))])
    assert np.mean(diffs <= 2e-6) >= 0.999 and diffs.max() <= 1e-2 * OPT.learning_rate, (
        np.mean(diffs <= 2e-6),
        diffs.max(),
    )


def make_branches(seed: int) -> list[Branch]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(NUM):
        b = Branch(execution_id=f"e{i}", thread_id="main", label="main")
        for n, trainable in [
            (rng.integers(3, 8), False),
            (rng.integers(3, 9), True),
            (rng.integers(1, 5), False),
            (rng.integers(2, 9), True),
        ]:
            b._append(
                rng.integers(0, 256, int(n)).tolist(),
                trainable=trainable,
                logprobs=[0.0] * int(n),
                temperature=0.7,
                versions=[0] * int(n),
            )
        out.append(b)
    return out


def batches(branches, adv, w, groups):
    return [
        make_micro_batches([branches[i] for i in g], [adv[i] for i in g], [w[i] for i in g], len(g), multiple=LEN)[0]
        for g in groups
    ]


@pytest.fixture(scope="module")
def base():
    mesh = make_mesh(jax.devices(), dict(data=4, fsdp=2))
    rules = load_config([]).sharding_rules
    graphdef, params = init_params(CFG, mesh, rules, seed=0)
    logprob_fn = jax.jit(lambda p, mb: token_logprobs(graphdef, p, mb))
    return mesh, rules, graphdef, params, logprob_fn


@pytest.fixture(scope="module")
def data(base):
    """Off-policy behaviour log-probs (ratios spread around 1), advantages of both signs, weights 1/8."""
    _, _, _, params, logprob_fn = base
    branches = make_branches(seed=1)
    (full,) = batches(branches, [0.0] * NUM, [0.0] * NUM, [list(range(NUM))])
    logp = np.asarray(logprob_fn(params, full))
    rng = np.random.default_rng(2)
    shifts = [0.5, -0.35, 0.05, -0.05, 0.45, -0.5, 0.3, -0.25]  # sequence log-ratio ~ shift
    for row, b in enumerate(branches):
        n = len(b.tokens) - 1
        lp = logp[row, :n] - shifts[row] + 0.05 * rng.normal(size=n)
        b.logprobs = [0.0] + [float(x) if tr else 0.0 for x, tr in zip(lp, b.trainable[1:])]
    adv = [1.0, -0.5, 0.8, -1.2, 0.3, 1.5, -0.9, -1.0]
    w = [1.0 / NUM] * NUM
    return branches, adv, w


@pytest.fixture(scope="module")
def learner(base):
    mesh, rules, graphdef, _, _ = base
    return Learner(CFG, graphdef, mesh, rules, OPT, LossConfig(params=WIDE))


def fresh(learner, params):
    return learner.init_state(copy_tree(params))


def stream_in_order(learner, state, mbs, order, satellites=(), **kw):
    """Runs a streamed step whose producer puts micro-batch ``order[k]`` (at its own slot) only after the k
    previous ones completed: the claim order is exactly ``order`` and the step runs before its data exists.
    Returns (state, metrics, filled-slot counts seen when each micro-step completed)."""
    queue = MicroStepQueue(len(mbs))
    seen = []
    errors = []

    def produce():
        try:
            for k, i in enumerate(order):
                queue.put(mbs[i], index=i)
                deadline = time.monotonic() + scaled(120)
                while queue.counts()["done"] < k + 1:
                    if time.monotonic() > deadline:
                        raise TimeoutError("the step did not compute a micro-step before all its data existed")
                    time.sleep(0.001)
                seen.append(len(queue.filled()))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            queue.abort(e)

    th = threading.Thread(target=produce)
    th.start()
    state, metrics = learner.stream_step(state, queue, satellites=satellites, **kw)
    th.join()
    assert not errors, errors
    return state, metrics, seen


def test_any_claim_order_gives_identical_params_equal_to_one_big_batch(base, data, learner):
    _, _, _, params, _ = base
    branches, adv, w = data
    mbs = batches(branches, adv, w, GROUPS)
    (big,) = batches(branches, adv, w, [list(range(NUM))])
    ref_state, ref_m = learner.step(fresh(learner, params), [big])
    assert ref_m["skipped"] == 0 and 0.0 < ref_m["clip_fraction"] < 1.0  # some sequences clipped, some not
    assert max_diff(ref_state.params, params) > 1e-3  # the step really moves the weights
    results = {}
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]):
        state, m, seen = stream_in_order(learner, fresh(learner, params), mbs, order)
        # Streaming: the k-th micro-step completed while only k slots had been filled.
        assert seen == [1, 2, 3, 4]
        assert m["micro_steps"] == 4 and m["micro_steps_core"] == 4 and int(state.step) == 1
        results[tuple(order)] = (host(state), m)
    first_state, first_m = results[(0, 1, 2, 3)]
    for order, (st, m) in results.items():
        for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(first_state)):
            np.testing.assert_array_equal(a, b, err_msg=str(order))  # bit-identical: ordered accumulation
        for k in ("loss", "grad_norm", "clip_fraction", "ratio_mean", "logprob_gap"):
            assert m[k] == first_m[k], (order, k)
    # Equal, to float tolerance, to one big micro-batch of the same data.
    assert_params_close(first_state.params, ref_state.params)
    for k in ("loss", "clip_fraction", "ratio_mean", "logprob_gap", "grad_norm"):
        assert first_m[k] == pytest.approx(ref_m[k], rel=1e-4, abs=1e-7), k


@pytest.fixture(scope="module")
def cells(base):
    """Core learner on cell 0 (devices 0-3), a satellite on cell 1 (devices 4-7)."""
    _, rules, graphdef, params, _ = base
    cell0, cell1 = make_cells(jax.devices(), 2, dict(data=4))
    core = Learner(CFG, graphdef, cell0.mesh, rules, OPT, LossConfig(params=WIDE))
    satellite = core.make_satellite(cell1.mesh, "cell1")
    assert not set(cell0.mesh.devices.flat) & set(cell1.mesh.devices.flat)
    return core, satellite


def gate_first_micro_step(worker, barrier):
    """Makes ``worker``'s first micro-step wait until the other worker also holds a claim (so both work)."""
    original = worker.micro_step
    calls = []

    def gated(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            barrier.wait(timeout=scaled(120))
        return original(*args, **kw)

    worker.micro_step = gated  # an instance attribute over the class method; ``undo`` removes it

    def undo():
        vars(worker).pop("micro_step", None)

    return undo


def test_core_and_satellite_on_disjoint_submeshes_give_the_core_only_result(base, data, cells):
    _, _, _, params, _ = base
    branches, adv, w = data
    core, satellite = cells
    mbs = batches(branches, adv, w, GROUPS)
    alone, alone_m = core.step(fresh(core, params), mbs)
    barrier = threading.Barrier(2)
    undo = [gate_first_micro_step(core.worker, barrier), gate_first_micro_step(satellite, barrier)]
    try:
        both, both_m = core.step(fresh(core, params), mbs, satellites=[satellite])
    finally:
        for u in undo:
            u()
    assert both_m["micro_steps"] == 4 and both_m["worker_errors"] == 0
    assert 1 <= both_m["micro_steps_core"] <= 3  # the satellite computed the others
    assert_params_close(both.params, alone.params)
    assert both_m["loss"] == pytest.approx(alone_m["loss"], rel=1e-5)
    # The new params stay on the core cell's devices and shardings.
    core_devices = set(core.mesh.devices.flat)
    for leaf, sh in zip(jax.tree.leaves(both.params), jax.tree.leaves(core.param_shardings)):
        assert leaf.sharding.is_equivalent_to(sh, leaf.ndim) and set(leaf.sharding.device_set) == core_devices


def test_a_failing_satellite_gives_its_claim_back_and_the_core_finishes(base, data, cells, caplog):
    _, _, _, params, _ = base
    branches, adv, w = data
    core, satellite = cells
    mbs = batches(branches, adv, w, GROUPS)
    alone, _ = core.step(fresh(core, params), mbs)

    def broken(*args, **kw):
        raise RuntimeError("satellite lost its devices")

    satellite.micro_step = broken
    barrier = threading.Barrier(2)
    undo = gate_first_micro_step(core.worker, barrier)
    orig_snapshot = satellite.snapshot

    def snapshot_then_meet(p):
        out = orig_snapshot(p)
        barrier.wait(timeout=scaled(120))  # the core holds slot 0; the satellite will claim slot 1 and fail on it
        return out

    satellite.snapshot = snapshot_then_meet
    try:
        with caplog.at_level(logging.ERROR, logger="gyre_jax.learner"):
            state, m = core.step(fresh(core, params), mbs, satellites=[satellite])
    finally:
        undo()
        del satellite.micro_step, satellite.snapshot
    assert m["worker_errors"] == 1 and m["micro_steps_released"] == 1 and m["micro_steps_core"] == 4
    assert any("satellite cell1 failed" in r.getMessage() for r in caplog.records)
    for a, b in zip(jax.tree.leaves(host(state.params)), jax.tree.leaves(host(alone.params))):
        np.testing.assert_array_equal(a, b)


def test_a_failure_on_the_core_aborts_the_step_and_leaves_the_state_usable(base, data, learner):
    _, _, _, params, _ = base
    branches, adv, w = data
    mbs = batches(branches, adv, w, GROUPS)
    bad = replace(mbs[2], targets=mbs[2].targets[:, :5])  # mismatched shapes: the micro-step cannot run
    state = fresh(learner, params)
    before = host(state)
    with pytest.raises((TypeError, ValueError)):
        learner.step(state, [mbs[0], mbs[1], bad, mbs[3]])
    for a, b in zip(jax.tree.leaves(host(state)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)
    state, m = learner.step(state, mbs)
    assert m["skipped"] == 0 and int(state.step) == 1


def test_non_finite_step_is_skipped_logged_counted_and_never_checkpointed(base, data, learner, tmp_path, caplog):
    _, _, _, params, _ = base
    branches, adv, w = data
    mbs = batches(branches, adv, w, GROUPS)
    poisoned = replace(mbs[3], advantages=np.array([np.inf, 0.5], np.float32))
    state, m = learner.step(fresh(learner, params), mbs)  # one good step: non-trivial optimizer moments
    before = host(state)
    skipped_before = learner.skipped_steps
    with caplog.at_level(logging.ERROR, logger="gyre_jax.learner"):
        state, m = learner.step(state, [mbs[0], mbs[1], mbs[2], poisoned])
    assert m["skipped"] == 1 and m["skipped_total"] == skipped_before + 1 == learner.skipped_steps
    assert any("optimizer step skipped: non-finite" in r.getMessage() for r in caplog.records)
    # Saving after the skipped step writes exactly the previous state (orbax on disk), and it restores.
    ckpt = Checkpointer(tmp_path / "ckpt", max_to_keep=2)
    ckpt.save(2, state, {"next_step": 2})
    restored, _ = ckpt.restore(2, learner.abstract_state())
    ckpt.close()
    for a, b, c in zip(jax.tree.leaves(host(restored)), jax.tree.leaves(host(state)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, c)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(host(restored)))


def test_grad_scale_applies_the_step_normalization_at_the_end(base, data, learner):
    """Weights 1/branches per execution + grad_scale = 1/executions == weights already normalized."""
    _, _, _, params, _ = base
    branches, adv, w = data
    normalized, m_n = learner.step(fresh(learner, params), batches(branches, adv, w, GROUPS))
    scaled, m_s = learner.step(
        fresh(learner, params), batches(branches, adv, [1.0] * NUM, GROUPS), grad_scale=1.0 / NUM
    )
    assert_params_close(normalized.params, scaled.params)
    assert m_s["loss"] == pytest.approx(m_n["loss"], rel=1e-5)
    assert m_s["grad_norm"] == pytest.approx(m_n["grad_norm"], rel=1e-5)


@pytest.fixture(scope="module")
def variants(base):
    mesh, rules, graphdef, _, _ = base
    make = lambda **kw: Learner(CFG, graphdef, mesh, rules, OPT, LossConfig(**kw))  # noqa: E731
    return {
        "gspo_token": make(loss="gspo_token", params=WIDE),
        "grpo": make(loss="grpo"),
        "kl": make(params=WIDE, kl_coef=0.5),
        "recompute": make(params=WIDE, recompute_behaviour=True),
    }


def assert_grads_close(a, b, rel=1e-5):
    a, b = host(a), host(b)
    scale = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(b))
    assert scale > 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=rel * scale)


def test_gspo_token_learner_equals_gspo_learner_on_per_sequence_advantages(base, data, learner, variants):
    _, _, _, params, _ = base
    branches, adv, w = data
    for mb in batches(branches, adv, w, GROUPS[1:3]):  # unclipped sequences (and one clipped, in group 2)
        ga, ma = learner.micro_step(params, mb)
        gb, mb_ = variants["gspo_token"].micro_step(params, mb)
        assert_grads_close(gb, ga)
        for k in ("loss", "clip_fraction", "ratio_mean", "weight_sum"):
            assert float(mb_[k]) == pytest.approx(float(ma[k]), rel=1e-5, abs=1e-7), k


def test_kl_term_vanishes_at_the_reference_and_pulls_towards_it_elsewhere(base, data, learner, variants):
    _, _, _, params, _ = base
    branches, adv, w = data
    kl = variants["kl"]
    mb = batches(branches, adv, w, GROUPS)[1]  # sequences inside the clip range: a non-zero policy gradient
    g_plain, _ = learner.micro_step(params, mb)
    g_same, aux_same = kl.micro_step(params, mb, ref_params=params)
    assert float(aux_same["kl"]) == 0.0
    assert_grads_close(g_same, g_plain)  # k3 has zero gradient where pi = pi_ref
    ref = jax.tree.map(lambda x: x * 1.05, params)
    g_far, aux_far = kl.micro_step(params, mb, ref_params=ref)
    assert float(aux_far["kl"]) > 1e-6
    assert max_diff(g_far, g_plain) > 1e-6
    with pytest.raises(ValueError, match="ref_params"):
        kl.micro_step(params, mb)
    state, m = kl.step(fresh(kl, params), batches(branches, adv, w, GROUPS), ref_params=ref)
    assert m["skipped"] == 0 and m["kl"] > 0


def test_recomputed_behaviour_trains_on_policy_and_still_reports_the_gap(base, data, learner, variants):
    _, _, _, params, logprob_fn = base
    branches, adv, w = data
    mb = batches(branches, adv, w, GROUPS)[1]
    g_rec, aux = variants["recompute"].micro_step(params, mb)
    assert float(aux["ratio_mean"]) == pytest.approx(float(aux["weight_sum"]), rel=1e-6)
    assert float(aux["clip_fraction"]) == 0.0
    assert float(aux["logprob_gap_sum"]) > 0.05  # the recorded behaviour is off-policy
    on_policy = replace(mb, old_logprobs=np.asarray(logprob_fn(params, mb)) * mb.loss_mask)
    g_on, aux_on = learner.micro_step(params, on_policy)
    assert_grads_close(g_rec, g_on)


def test_grpo_learner_equals_gspo_on_policy_and_differs_off_policy(base, data, learner, variants):
    """On-policy (every ratio 1, nothing clipped) GRPO's gradient is sum_i w_i / n_i sum_t -A_i dlog pi_t,
    which is GSPO's too; off-policy the token-level and sequence-level ratios (and clip ranges) differ."""
    _, _, _, params, logprob_fn = base
    branches, adv, w = data
    mb = batches(branches, adv, w, GROUPS)[2]
    on_policy = replace(mb, old_logprobs=np.asarray(logprob_fn(params, mb)) * mb.loss_mask)
    g_grpo, aux = variants["grpo"].micro_step(params, on_policy)
    g_gspo, _ = learner.micro_step(params, on_policy)
    assert float(aux["clip_fraction"]) == 0.0
    assert_grads_close(g_grpo, g_gspo)
    g_grpo_off, aux_off = variants["grpo"].micro_step(params, mb)
    g_gspo_off, _ = learner.micro_step(params, mb)
    assert float(aux_off["clip_fraction"]) > 0.0  # row 4: log-ratio ~0.45 with A > 0 leaves the range
    assert max_diff(g_grpo_off, g_gspo_off) > 1e-5


def test_learning_rate_schedules_and_errors():
    cos = learning_rate_schedule(
        OptimizerConfig(1e-3, warmup_steps=2, schedule="cosine", decay_steps=10, min_lr_ratio=0.1)
    )
    assert float(cos(0)) == 0.0 and float(cos(1)) == pytest.approx(5e-4)
    assert float(cos(2)) == pytest.approx(1e-3) and float(cos(7)) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5), rel=1e-5)
    assert float(cos(12)) == pytest.approx(1e-4, rel=1e-5) and float(cos(100)) == pytest.approx(1e-4, rel=1e-5)
    lin = learning_rate_schedule(OptimizerConfig(1e-3, schedule="linear", decay_steps=4))
    assert [round(float(lin(i)), 8) for i in (0, 2, 4, 9)] == [1e-3, 5e-4, 0.0, 0.0]
    const = learning_rate_schedule(OptimizerConfig(1e-3, warmup_steps=4))
    assert float(const(2)) == pytest.approx(5e-4) and float(const(50)) == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="decay_steps"):
        OptimizerConfig(1e-3, schedule="cosine")
    with pytest.raises(ValueError, match="schedule"):
        OptimizerConfig(1e-3, schedule="step")
    cfg = load_config(["--config.optimizer.schedule=linear", "--config.optimizer.decay_steps=3"]).optimizer
    assert isinstance(cfg, OptimizerConfig) and cfg.schedule == "linear" and cfg.decay_steps == 3


def test_learner_from_the_run_config(base):
    from gyre_jax.config import load_config as load

    mesh, rules, graphdef, _, _ = base
    c = load(
        [
            "--config.rl.loss=grpo",
            "--config.rl.clip_low=0.2",
            "--config.rl.clip_high=0.28",
            "--config.rl.kl_coef=0.01",
            "--config.optimizer.schedule=cosine",
            "--config.optimizer.decay_steps=40",
        ]
    )
    learner = Learner(CFG, graphdef, mesh, rules, c.optimizer, loss_cfg=c.loss_config())
    assert learner.loss_cfg.loss == "grpo" and learner.loss_cfg.params == GRPOParams(0.2, 0.28)
    assert learner.worker.loss_cfg is learner.loss_cfg  # the objective its micro-steps compute
    assert learner.loss_cfg.kl_coef == 0.01 and not learner.loss_cfg.recompute_behaviour
    d = load([])
    default = Learner(CFG, graphdef, mesh, rules, d.optimizer, loss_cfg=d.loss_config())
    assert default.loss_cfg == Learner(CFG, graphdef, mesh, rules, OPT).loss_cfg  # gspo, 3e-4 / 4e-4, no KL
    assert default.loss_cfg.params == GSPOParams(3e-4, 4e-4)


def test_rl_loss_grpo_alone_trains_with_grpos_documented_clip_range(base, data):
    """``--config.rl.loss=grpo`` and no clip keys: the learner built as the run builds it (train.py:
    ``Learner(..., loss_cfg=config.loss_config())``) clips at GRPO's 0.2 / 0.28 (docs/learner.md's loss table),
    not at GSPO's 3e-4 / 4e-4 (on main before the loss registry it did the latter). Every trainable token's ratio
    is exp(0.1) here: inside GRPO's range, outside GSPO's."""
    mesh, rules, graphdef, params, logprob_fn = base
    branches, adv, w = data
    mb = batches(branches, adv, w, GROUPS)[1]  # A = 0.8 and -1.2
    shifted = replace(mb, old_logprobs=((np.asarray(logprob_fn(params, mb)) - 0.1) * mb.loss_mask).astype(np.float32))
    c = load_config(["--config.rl.loss=grpo"])
    _, aux = Learner(CFG, graphdef, mesh, rules, c.optimizer, loss_cfg=c.loss_config()).micro_step(params, shifted)
    assert float(aux["clip_fraction"]) == 0.0
    assert float(aux["ratio_mean"]) == pytest.approx(np.exp(0.1) * float(aux["weight_sum"]), rel=1e-4)
    # The same micro-batch under GSPO's range is clipped: the case tells the two ranges apart.
    narrow = load_config(["--config.rl.loss=grpo", "--config.rl.clip_low=3e-4", "--config.rl.clip_high=4e-4"])
    learner = Learner(CFG, graphdef, mesh, rules, narrow.optimizer, loss_cfg=narrow.loss_config())
    _, aux_narrow = learner.micro_step(params, shifted)
    assert float(aux_narrow["clip_fraction"]) > 0.0


def test_the_warm_start_schedule_decays_over_the_steps_after_its_warmup():
    w = load_config(
        ["--config.warm_start.steps=12", "--config.warm_start.warmup_steps=2", "--config.warm_start.schedule=cosine",
         "--config.warm_start.min_lr_ratio=0.1", "--config.warm_start.learning_rate=1e-3"]
    ).warm_start  # fmt: skip
    lr = learning_rate_schedule(w.optimizer(grad_clip_norm=1.0))
    assert float(lr(2)) == pytest.approx(1e-3) and float(lr(7)) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5), rel=1e-5)
    assert float(lr(11)) > 1e-4 and float(lr(12)) == pytest.approx(1e-4, rel=1e-5)  # the floor at the last step
    flat = learning_rate_schedule(load_config(["--config.warm_start.warmup_steps=2"]).warm_start.optimizer(1.0))
    assert float(flat(11)) == pytest.approx(3e-3)  # the default: constant after the warmup
