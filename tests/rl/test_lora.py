"""LoRA in the learner and the run: only the adapter trains (optimizer state only for it), the base is held once
per cell, satellites take adapter snapshots, a rank-8 run trains end to end under the three scheduling policies, and
a resumed run continues from exactly the adapter, optimizer state and base it stopped with."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyre_jax import config as config_lib
from gyre_jax.checkpoint import Checkpointer
from gyre_jax.model import lora
from gyre_jax.model.config import LoraConfig, ModelConfig
from gyre_jax.model.sharding import init_params, make_mesh
from gyre_jax.rl.learner import Learner, OptimizerConfig, token_logprobs
from gyre_jax.rl.losses import GSPOParams, LossConfig
from gyre_jax.trajectory.batch import make_micro_batches
from gyre_jax.trajectory.branches import Branch

CFG = ModelConfig(
    vocab_size=272, num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, rope_theta=1e4
)
LORA = dataclasses.replace(CFG, lora=LoraConfig(rank=8, alpha=16.0))


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def pointers(tree) -> list[int]:
    """Every shard's device buffer address: equal lists = the very same buffers, nothing copied."""
    return [s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) for s in x.addressable_shards]


def micro_batches(seed: int = 0, groups=((0, 1, 2, 3),)):
    rng = np.random.default_rng(seed)
    branches = []
    for i in range(4):
        b = Branch(execution_id=f"e{i}", thread_id="main", label="main")
        for n, trainable in ((5, False), (7, True), (3, False), (6, True)):
            b._append(rng.integers(0, 256, n).tolist(), trainable=trainable, logprobs=[-5.5] * n, temperature=1.0,
                      versions=[0] * n)  # fmt: skip
        branches.append(b)
    adv, w = [1.0, -0.5, 0.8, -1.2], [0.25] * 4
    return [
        make_micro_batches([branches[i] for i in g], [adv[i] for i in g], [w[i] for i in g], 4, multiple=32)[0]
        for g in groups
    ]


@pytest.fixture(scope="module")
def setup():
    mesh = make_mesh(jax.devices()[:4], dict(data=2, fsdp=2))
    rules = config_lib.load_config([]).sharding_rules
    graphdef, params = init_params(LORA, mesh, rules, seed=0)
    wide = LossConfig(params=GSPOParams(clip_low=0.2, clip_high=0.28))
    learner = Learner(LORA, graphdef, mesh, rules, OptimizerConfig(learning_rate=1e-2), wide)
    return learner, graphdef, params, mesh, rules


def test_only_the_adapter_trains_and_holds_optimizer_state(setup):
    learner, graphdef, params, _, _ = setup
    adapter, base = lora.split(params)
    state = learner.init_state(jax.tree.map(jnp.copy, params))
    assert jax.tree.structure(state.params) == jax.tree.structure(adapter)
    n_adapter = sum(x.size for x in jax.tree.leaves(state.params))
    assert n_adapter == LORA.num_lora_params < 0.25 * CFG.num_params  # 18% at this tiny size
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.size > 1]
    assert sum(x.size for x in moments) == 2 * n_adapter  # Adam's two moments, of the adapter only
    base_before, base_ptrs = host(learner.base), pointers(learner.base)
    mbs = micro_batches()
    logp0 = np.asarray(token_logprobs(graphdef, learner.full_params(state.params), mbs[0]))
    state, metrics = learner.step(state, mbs)
    assert metrics["skipped"] == 0 and metrics["grad_norm"] > 0 and int(state.step) == 1
    moved = max(
        float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(host(state.params)), jax.tree.leaves(host(adapter)))
    )
    assert moved > 1e-3
    for a, b in zip(jax.tree.leaves(host(learner.base)), jax.tree.leaves(base_before)):
        np.testing.assert_array_equal(a, b)  # the base never changes
    assert pointers(learner.base) == base_ptrs  # and is the same buffers (nothing copied or donated)
    logp1 = np.asarray(token_logprobs(graphdef, learner.full_params(state.params), mbs[0]))
    assert float(np.abs(logp1 - logp0).max()) > 1e-4  # base + adapter is a new policy


def test_a_satellite_computes_the_same_step_from_adapter_snapshots(setup):
    learner, _, params, _, _ = setup
    mbs = micro_batches(seed=1, groups=((0, 1), (2, 3), (1,), (3,)))
    alone, m_alone = learner.step(learner.init_state(jax.tree.map(jnp.copy, params)), mbs)
    satellite = learner.make_satellite(make_mesh(jax.devices()[4:], dict(data=4)), "sat")
    assert satellite.base is None
    shared, m_shared = learner.step(learner.init_state(jax.tree.map(jnp.copy, params)), mbs, satellites=[satellite])
    assert satellite.base is not None  # it took the base once; every snapshot after that is an adapter
    assert lora.nbytes(satellite.snapshot(shared.params)) == lora.nbytes(lora.split(params)[0])
    for a, b in zip(jax.tree.leaves(host(shared.params)), jax.tree.leaves(host(alone.params))):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert m_shared["grad_norm"] == pytest.approx(m_alone["grad_norm"], rel=1e-5)


def test_switches_move_the_adapter_as_one_array_and_serve_base_plus_adapter(setup, monkeypatch):
    """A satellite's snapshot and a serving cell's placement of an adapter move ONE array (``lora.Packed``); the cell
    unpacks it on arrival and serves its base's leaves and the adapter's as flat leaves of the whole model state
    (``Flattened`` with a plain ``PyTreeDef``: the serving programs slice nothing, so they compile no more kernels
    than without LoRA), exactly base + adapter."""
    from gyre_jax.runtime import local as local_module
    from gyre_jax.runtime.cells import Cell, CellLayout
    from gyre_jax.runtime.local import LocalCell
    from gyre_jax.serving.programs import Flattened

    learner, graphdef, params, _, rules = setup
    adapter, base = lora.split(params)
    adapter = jax.tree.map(lambda x: x + 0.01, adapter)  # B != 0: the adapter changes the model
    adapter_bytes = lora.nbytes(adapter)
    devices = jax.devices()[4:6]
    satellite = learner.make_satellite(make_mesh(devices, dict(data=2)), "sat")
    satellite.set_base(base)
    snap = satellite.snapshot(adapter)
    assert isinstance(snap, lora.Packed) and len(jax.tree.leaves(snap)) == 1 and lora.nbytes(snap) == adapter_bytes

    moves, transfer = [], local_module.transfer  # what each placement hands to the transfer: its arrays' bytes

    def counting_transfer(x, *args, **kw):
        moves.append([leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(x)])
        return transfer(x, *args, **kw)

    monkeypatch.setattr(local_module, "transfer", counting_transfer)
    cell = Cell(1, tuple(devices), make_mesh(devices, dict(data=2)))
    local = LocalCell(cell, CellLayout.of(cell, LORA, rules, page_size=16), None, None, make_loop=lambda p, v: None)
    expected = lora.combine(base, adapter)
    published = lora.publication(adapter)  # what the trainer hands every receiver of a version: packed once
    assert isinstance(published, lora.Packed) and published.source is adapter
    snap_of_published = satellite.snapshot(published)
    assert isinstance(snap_of_published, lora.Packed) and snap_of_published.source is None  # only the buffer moved
    np.testing.assert_array_equal(host(snap_of_published.buffer), host(snap.buffer))
    # the first weights carry the base; a switch carries the adapter only, as a tree or packed once by the trainer
    for given, model in ((params, params), (adapter, expected), (published, expected)):
        moves.clear()
        served = local.place(given)
        assert moves[-1] == [adapter_bytes]  # the adapter moved as one array (after the base, the first time)
        assert isinstance(served, Flattened) and served.treedef == jax.tree.structure(expected)
        assert all(x.devices() == set(devices) for x in served.leaves)
        unflatten = served.treedef.unflatten
        whole = jax.jit(lambda leaves, unflatten=unflatten: unflatten(leaves))(served.leaves)  # as a program does
        for got, want in zip(jax.tree.leaves(host(whole)), jax.tree.leaves(host(model))):
            np.testing.assert_array_equal(got, want)


def test_a_policy_version_is_packed_once_for_every_receiver(setup, monkeypatch):
    """The trainer packs the adapter once per policy version (``lora.publication``) and hands that to every serving
    cell it publishes to and every satellite snapshot: no receiver flattens and packs the tree again; a new version
    is packed anew."""
    from gyre_jax.elastic import training as training_module
    from gyre_jax.elastic.training import CellTraining
    from gyre_jax.runtime.cells import Cell, CellLayout
    from gyre_jax.runtime.local import LocalCell

    learner, _, params, _, rules = setup
    packs, publication = [], lora.publication

    def counting(tree):
        packs.append(tree)
        return publication(tree)

    monkeypatch.setattr(training_module.lora, "publication", counting)
    served: list[tuple[object, int]] = []
    handles = []
    for i, devices in enumerate((jax.devices()[4:6], jax.devices()[6:8])):
        cell = Cell(i + 1, tuple(devices), make_mesh(devices, dict(data=2)))
        handle = LocalCell(cell, CellLayout.of(cell, LORA, rules, page_size=16), None, None,
                           make_loop=lambda p, v: served.append((p, v)))  # fmt: skip
        handle.set_weights(params, 0)  # the base arrives once, with the first weights
        handles.append(handle)
    state = learner.init_state(jax.tree.map(jnp.copy, params))
    training = CellTraining(learner, state, [])
    served.clear()
    training.publish(handles)
    training.publish(handles)  # the same version again (a role switch back to serving): still one pack
    assert len(packs) == 1 and packs[0] is state.params and [v for _, v in served] == [0, 0, 0, 0]
    want = host(lora.combine(learner.base, state.params))
    for flat, _ in served:
        for got, w in zip(host(flat.leaves), jax.tree.leaves(want)):
            np.testing.assert_array_equal(got, w)
    training.state, _ = learner.step(state, micro_batches())  # a new version
    training.publish(handles)
    assert len(packs) == 2 and packs[1] is training.state.params and served[-1][1] == 1


def test_a_worker_without_its_base_says_so(setup):
    learner, _, params, mesh, _ = setup
    worker = learner.make_satellite(mesh, "bare")
    with pytest.raises(RuntimeError, match="holds no base weights yet"):
        worker.micro_step(worker.snapshot(lora.split(params)[0]), micro_batches()[0])


# -- the run ----------------------------------------------------------------------------------------------------
SMALL_MODEL = ["--config.model.num_layers=1", "--config.model.embed_dim=32", "--config.model.mlp_dim=64",
               "--config.model.head_dim=8"]  # fmt: skip
MOE = ["--config.model.num_experts=4", "--config.model.num_experts_per_tok=2", "--config.model.moe_mlp_dim=32",
       "--config.model.lora.targets=('all',)"]  # fmt: skip


def _config(workdir, policy: str, steps: int, *extra: str):
    return config_lib.load_config(
        [
            f"--config.workdir={workdir}",
            f"--config.total_steps={steps}",
            "--config.warm_start.steps=0",
            "--config.eval.samples_per_task=0",
            f"--config.schedule.policy={policy}",
            "--config.rollout.tasks_per_step=1",
            "--config.rl.group_size=4",
            "--config.rollout.num_tasks=2",
            "--config.rollout.tool_latency_median_s=0.1",
            "--config.rollout.max_tokens_per_call=24",
            "--config.rollout.timeout_s=600",  # the first calls compile the serving programs: slow on a loaded CPU
            "--config.metrics.progress_bar=False",
            "--config.metrics.tensorboard=False",
            "--config.model.lora.rank=8",
            *SMALL_MODEL,
            *extra,
        ]
    )


def _check_cells_hold_one_base(run) -> None:
    """Every cell's serving base is its worker's (the same buffers), and the core's is the learner's."""
    learner = run.controller.training.learner
    for handle in run.cells.handles:
        assert handle.base is not None and pointers(handle.base) == pointers(handle.worker.base), handle.name
    assert pointers(run.cells.handles[0].base) == pointers(learner.base)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["colocated", "async", "elastic"])
def test_a_rank_8_run_trains_end_to_end(tmp_path, policy):
    """Two RL steps through the proxy and harness processes. The elastic run is a MoE with an adapter on every expert:
    its load-balancing term gives the adapter a gradient even when every reward is equal (an untrained model earns
    none), so the step is seen to move the adapter and the cells to serve it."""
    from gyre_jax.train import build_run

    config = _config(tmp_path, policy, 2, *(MOE if policy == "elastic" else ()))
    run = build_run(config)
    try:
        _check_cells_hold_one_base(run)
        start = host(run.state.params)
        assert run.run() == 2
        _check_cells_hold_one_base(run)
        end = host(run.state.params)
        version = int(run.state.step)
        if policy == "elastic":
            assert max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(end), jax.tree.leaves(start))) > 0
    finally:
        run.close()
    assert version == 2
    train = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in train if m.get("phase") == "train"]
    assert [m["step"] for m in train] == [0, 1] and all(m["executions"] == 4 and not m["skipped"] for m in train)
    if policy == "elastic":
        assert all(m["grad_norm"] > 0 for m in train)
    # the checkpoint holds the adapter and its optimizer state; the base by reference
    state, meta = Checkpointer(tmp_path / "checkpoints").restore_as_saved(2)
    assert meta["lora_base"] == {"init_seed": config.seed} and meta["policy_version"] == 2
    paths = [
        "/".join(str(getattr(k, "key", k)) for k in p)
        for p, _ in jax.tree_util.tree_flatten_with_path(state["params"])[0]
    ]
    assert paths and all("/lora/" in p or "_lora/" in p for p in paths)
    model_cfg = config.model_config()
    assert sum(x.size for x in jax.tree.leaves(state["params"])) == model_cfg.num_lora_params


@pytest.mark.slow
def test_a_resumed_lora_run_continues_exactly(tmp_path):
    """Stop after 2 steps, resume: the restored adapter and optimizer state are the saved ones bit for bit, the base is
    rebuilt from its reference (the init seed) bit for bit, the cells serve that base + adapter, and the run goes on
    from step 2; a config with another base is refused in one line."""
    from gyre_jax.model.config import ModelInputError
    from gyre_jax.train import build_run

    run = build_run(_config(tmp_path, "colocated", 2))
    try:
        assert run.run() == 2
        saved = host(run.state)
        base = host(run.controller.training.learner.base)
    finally:
        run.close()
    run = build_run(_config(tmp_path, "colocated", 3))
    try:
        restored = host(run.state)
        assert int(restored.step) == int(saved.step) == 2
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(jax.tree.leaves(host(run.controller.training.learner.base)), jax.tree.leaves(base)):
            np.testing.assert_array_equal(a, b)
        _check_cells_hold_one_base(run)
        for handle in run.cells.handles:
            assert handle.policy_version == 2
        assert run.run() == 3
    finally:
        run.close()
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if m.get("phase") == "train"] == [0, 1, 2]
    with pytest.raises(ModelInputError, match="LoRA base"):
        build_run(_config(tmp_path, "colocated", 4, "--config.seed=5"))
