"""One process of a multi-process test run (started by tests/runtime/test_multiprocess.py).

    python tests/runtime/worker.py SCENARIO --pid P --nproc N --port PORT --out DIR [--heartbeat S]

Each process joins the run through ``gyre_jax.runtime.initialize(config)`` with the tiny CPU config
(``num_cpu_devices=8`` split over the processes), does the scenario's work and writes what it saw to
``DIR/<scenario>_<pid>.json`` (and arrays to ``.npz``) for the test to compare with a single-process run.
Scenarios: ``main`` (global mesh compute, decisions, syncs, cells, publish, cell_put, checkpoint save, HF
export),
``restore`` (restore that checkpoint), ``wait`` (block in a sync or a decision until killed from outside),
``raise`` (process 1 raises while process 0 runs device collectives).

The functions above ``main()`` are imported by the test to compute the single-process reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
BATCH, SEQ, SEED = 8, 32, 0


def make_config(nproc: int = 1, pid: int = 0, port: int = 0, heartbeat_s: float = 30.0):
    """The tiny CPU config (8 devices in all) with a ``distributed`` section for ``nproc`` processes."""
    import dataclasses

    from gyre_jax import config as config_lib

    sys.path.insert(0, str(REPO / "tests"))
    from layouts import EIGHT_DEVICES
    from timelimits import scaled

    config = config_lib.load_config(["--config", str(REPO / "configs" / "tiny_cpu.py"), *EIGHT_DEVICES])
    d = config_lib.DistributedSection(
        enabled=nproc > 1,
        coordinator_address=f"127.0.0.1:{port}" if nproc > 1 else "",
        num_processes=nproc if nproc > 1 else 0,
        process_id=pid if nproc > 1 else -1,
        initialization_timeout_s=scaled(60.0),
        heartbeat_timeout_s=heartbeat_s,
        shutdown_timeout_s=scaled(30.0),
    )
    return dataclasses.replace(config, distributed=d)  # validated as it is built


def cell_shape(config) -> dict[str, int]:
    """``config.cells`` as a mesh shape (its axis sizes only)."""
    return config.cells.shape()


def make_tokens() -> np.ndarray:
    """tokens: [BATCH, SEQ] int32, fixed."""
    return np.random.default_rng(1234).integers(0, 256, size=(BATCH, SEQ)).astype(np.int32)


def model_setup(config, mesh):
    """(model_cfg, graphdef, params on ``mesh``, rules)."""
    from gyre_jax.model.sharding import init_params

    model_cfg = config.model_config()
    rules = tuple(tuple(r) for r in config.sharding_rules)
    graphdef, params = init_params(model_cfg, mesh, rules, SEED)
    return model_cfg, graphdef, params, rules


def loss_and_grads(graphdef, params, mesh, rules, with_grads: bool = True):
    """Next-token cross-entropy of the fixed batch on ``mesh``: (loss [], grads like params or None, logits [B, T, V])."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from gyre_jax.model.sharding import logical_sharding

    tokens_np = make_tokens()
    positions_np = np.broadcast_to(np.arange(SEQ, dtype=np.int32), tokens_np.shape)
    batch_sharding = logical_sharding(("batch", None), rules, mesh, tokens_np.shape)
    tokens = jax.make_array_from_callback(tokens_np.shape, batch_sharding, lambda idx: tokens_np[idx])
    positions = jax.make_array_from_callback(tokens_np.shape, batch_sharding, lambda idx: positions_np[idx])

    def loss_fn(p, tok, pos):
        model = nnx.merge(graphdef, p)
        mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))[None].repeat(tok.shape[0], 0)  # [B, T, T] causal
        logits, _ = model(tok, pos, mask)  # [B, T, V] float32
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp, tok[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]
        return nll.mean(), logits

    replicated = NamedSharding(mesh, PartitionSpec())
    if not with_grads:
        loss, logits = jax.jit(loss_fn, out_shardings=(replicated, replicated))(params, tokens, positions)
        return loss, None, logits
    step = jax.jit(
        jax.value_and_grad(loss_fn, has_aux=True),
        out_shardings=((replicated, replicated), jax.tree.map(lambda x: x.sharding, params)),
    )
    (loss, logits), grads = step(params, tokens, positions)
    return loss, grads, logits


def to_host(tree):
    """Every leaf as a full numpy array on every process (one jitted all-gather to replicated shardings)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    leaves, treedef = jax.tree.flatten(tree)
    if all(x.is_fully_addressable for x in leaves):
        return jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves])
    full = jax.jit(lambda xs: xs, out_shardings=[NamedSharding(x.sharding.mesh, PartitionSpec()) for x in leaves])(
        leaves
    )
    return jax.tree.unflatten(treedef, [np.asarray(x.addressable_data(0)) for x in full])


def flat(tree) -> dict[str, np.ndarray]:
    import jax

    return {jax.tree_util.keystr(path): np.asarray(v) for path, v in jax.tree_util.tree_leaves_with_path(tree)}


def shards_match(tree, host_tree) -> bool:
    """Every locally held shard of ``tree`` equals the same slice of the full host copy."""
    import jax

    return all(
        np.array_equal(np.asarray(s.data), h[s.index])
        for x, h in zip(jax.tree.leaves(tree), jax.tree.leaves(host_tree))
        for s in x.addressable_shards
    )


DECISION = {"step": 3, "roles": {"cell0": "training", "cell1": "serving"}, "order": (1, 0), "eta": 0.5, "note": "é"}


# -- scenarios -------------------------------------------------------------------------------------------
def scenario_main(args, info, config, out: dict) -> None:
    import jax

    from gyre_jax import runtime
    from gyre_jax.checkpoint import Checkpointer
    from gyre_jax.model.sharding import abstract_model, param_shardings

    t0 = time.perf_counter()
    lap = lambda name: out.setdefault("seconds", {}).__setitem__(name, round(time.perf_counter() - t0, 2))  # noqa: E731
    out["devices"] = [[d.id, d.process_index] for d in runtime.cells.host_ordered()]
    out["cpu_async_dispatch"] = bool(jax.config.values["jax_cpu_enable_async_dispatch"])
    mesh = runtime.make_train_mesh(config.mesh.shape())
    model_cfg, graphdef, params, rules = model_setup(config, mesh)
    loss, grads, logits = loss_and_grads(graphdef, params, mesh, rules)
    host_params, host_grads, host_loss, host_logits = to_host((params, grads, loss, logits))
    arrays = {"loss": host_loss, "logits": host_logits}
    arrays.update({"grad" + k: v for k, v in flat(host_grads).items()})
    arrays.update({"param" + k: v for k, v in flat(host_params).items()})

    lap("compute")
    # Decisions: process 0's value on every process, through the key-value store and through the devices.
    mine = DECISION if info.process_id == 0 else {"ignored": info.process_id}
    out["decision_kv"] = runtime.broadcast_decision(mine)
    out["decision_devices"] = runtime.broadcast_decision(mine, via="devices")
    big = {"blob": "x" * 10000} if info.process_id == 0 else None  # > the first round's 4 KiB: two rounds
    out["decision_big_len"] = len(runtime.broadcast_decision(big, via="devices")["blob"])
    out["decision_seq"] = [runtime.broadcast_decision(i * 10 if info.process_id == 0 else None) for i in range(5)]
    errors = {}
    for via in ("kv", "devices"):
        try:
            runtime.broadcast_decision({1, 2} if info.process_id == 0 else None, via=via)
        except runtime.DistributedError as exc:
            errors[via] = str(exc)
    out["decision_errors"] = errors

    lap("decisions")
    # Syncs: matching names pass; different names fail on every process with both names in the message.
    runtime.sync("after-decisions")
    try:
        # the other process must have reached its own (mismatched) sync before this one gives up, loaded or not
        from timelimits import scaled

        runtime.sync(f"branch-{info.process_id}", timeout_s=scaled(3))
        out["sync_mismatch"] = "no error"
    except runtime.DistributedError as exc:
        out["sync_mismatch"] = str(exc)
    runtime.sync("after-mismatch")

    lap("syncs")
    # Cells over hosts.
    cells = runtime.make_cells(None, config.cells.num_cells, cell_shape(config))
    out["cells"] = [[d.id for d in c.devices] for c in cells]
    out["cell_processes"] = [list(c.processes) for c in cells]
    _, abstract = abstract_model(model_cfg)

    # publish_to_cells: the global params onto every cell; each process then runs its own cell(s).
    for num_cells, shape in ((2, cell_shape(config)), (4, dict(data=2)), (1, config.mesh.shape())):
        layout = runtime.make_cells(None, num_cells, shape)
        published = runtime.publish_to_cells(params, [param_shardings(abstract, rules, c.mesh) for c in layout])
        key = f"publish_{num_cells}"
        out[key + "_local_shards_ok"] = all(shards_match(p, host_params) for p in published)
        out[key + "_local_cells"] = [
            c.index for c, p in zip(layout, published) if all(x.is_fully_addressable for x in jax.tree.leaves(p))
        ]
        out[key + "_no_local_shards"] = [
            c.index for c, p in zip(layout, published) if all(not x.addressable_shards for x in jax.tree.leaves(p))
        ]
        if num_cells == 2:  # each process runs its own cell: the same forward pass as on the global mesh
            own = layout[info.process_id]
            cell_loss, _, cell_logits = loss_and_grads(
                graphdef, published[info.process_id], own.mesh, rules, with_grads=False
            )
            arrays["cell_loss"] = np.asarray(cell_loss)
            arrays["cell_logits"] = np.asarray(cell_logits)
            per_cell = published
    lap("publish")

    # cell_put across processes: the core's params (cell 0, process 0) -> the satellite (cell 1, process 1),
    # and a tree computed on the satellite (like its gradients) back to the core. A process describes a
    # cell it does not hold with abstract leaves (ShapeDtypeStruct + sharding).
    shardings = [param_shardings(abstract, rules, c.mesh) for c in cells]
    snap = runtime.transfer(per_cell[0], shardings[1])
    out["cell_put_params_ok"] = shards_match(snap, host_params)
    out["cell_put_params_held"] = sorted({bool(x.addressable_shards) for x in jax.tree.leaves(snap)})
    if info.process_id == 1:
        from_satellite = jax.jit(lambda t: jax.tree.map(lambda x: 2 * x, t))(snap)  # computed on cell 1
    else:
        from_satellite = jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), per_cell[1], shardings[1]
        )
    at_core = runtime.transfer(from_satellite, shardings[0])
    if info.process_id == 0:
        out["cell_put_back_ok"] = all(
            np.array_equal(np.asarray(a), 2 * h) for a, h in zip(jax.tree.leaves(at_core), jax.tree.leaves(host_params))
        )
    on_core = jax.sharding.NamedSharding(cells[0].mesh, jax.sharding.PartitionSpec())
    scalar = (
        jax.device_put(np.float32(2.5), on_core)
        if info.process_id == 0
        else jax.ShapeDtypeStruct((), np.float32, sharding=on_core)
    )
    moved = runtime.transfer(scalar, jax.sharding.NamedSharding(cells[1].mesh, jax.sharding.PartitionSpec()))
    if info.process_id == 1:
        out["cell_put_scalar"] = float(np.asarray(moved.addressable_data(0)))

    _p2p_moves(info.process_id, cells, shardings, per_cell, host_params, out)
    lap("cell_put")
    # Orbax: every process writes its shards of one checkpoint.
    ckpt = Checkpointer(Path(args.out) / "ckpt", max_to_keep=2)
    ckpt.save(1, {"params": params}, {"next_step": 2, "saved_by": info.num_processes})
    ckpt.close()
    runtime.sync("checkpoint-written")
    lap("checkpoint")
    # Hugging Face export of params spanning both processes: each tensor gathered, process 0 writes.
    from gyre_jax.model.hf_checkpoint import save_hf_checkpoint

    out["params_span_processes"] = any(not x.is_fully_addressable for x in jax.tree.leaves(params))
    files = save_hf_checkpoint(Path(args.out) / f"hf_{info.process_id}", model_cfg, params, max_shard_bytes=200_000)
    out["hf_files"] = [f.name for f in files]
    runtime.sync("hf-written")
    lap("hf_export")
    out["arrays"] = arrays


def scenario_restore(args, info, config, out: dict) -> None:
    """Restore the ``main`` scenario's checkpoint onto the global mesh; write the params it holds."""
    from gyre_jax import runtime
    from gyre_jax.checkpoint import Checkpointer
    from gyre_jax.model.sharding import abstract_model, param_shardings

    mesh = runtime.make_train_mesh(config.mesh.shape())
    rules = tuple(tuple(r) for r in config.sharding_rules)
    _, abstract = abstract_model(config.model_config())
    target = jax_abstract(abstract, param_shardings(abstract, rules, mesh))
    ckpt = Checkpointer(Path(args.out) / "ckpt", max_to_keep=2)
    state, meta = ckpt.restore(ckpt.latest_step(), {"params": target})
    ckpt.close()
    out["meta"] = meta
    out["arrays"] = {"param" + k: v for k, v in flat(to_host(state["params"])).items()}


def jax_abstract(abstract, shardings):
    """ShapeDtypeStructs with ``shardings``: an orbax restore target."""
    import jax

    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def scenario_wait(args, info, config, out: dict) -> None:
    """Report ready, then block in a host barrier (process 0) or a decision wait (others) until killed."""
    from gyre_jax import runtime

    runtime.sync("ready")
    (Path(args.out) / f"ready_{info.process_id}").write_text("1")
    if info.process_id == 0:
        runtime.sync("never-reached-by-the-killed-process")
    else:
        runtime.broadcast_decision(None)  # process 0 never sends it
    out["unexpected"] = "returned"


def scenario_raise(args, info, config, out: dict) -> None:
    """Process 1 raises mid-run; process 0 keeps running jitted collectives over the global mesh."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from gyre_jax import runtime

    mesh = runtime.make_train_mesh(config.mesh.shape())
    x = jax.make_array_from_callback(
        (64, 8), NamedSharding(mesh, PartitionSpec(("data", "fsdp"))), lambda idx: np.ones((64, 8), np.float32)[idx]
    )
    total = jax.jit(lambda a: jnp.sum(a * a), out_shardings=NamedSharding(mesh, PartitionSpec()))
    total(x).block_until_ready()
    runtime.sync("ready")
    (Path(args.out) / f"ready_{info.process_id}").write_text("1")
    if info.process_id == 1:
        time.sleep(1.0)
        raise RuntimeError("injected failure in process 1")
    for _ in range(100000):
        total(x).block_until_ready()
    out["unexpected"] = "returned"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["main", "restore", "wait", "raise"])
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--heartbeat", type=float, default=30.0)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))

    from gyre_jax import runtime

    config = make_config(args.nproc, args.pid, args.port, args.heartbeat)
    info = runtime.initialize(config)
    out: dict = {
        "info": {
            "process_id": info.process_id,
            "num_processes": info.num_processes,
            "local_devices": info.local_devices,
            "global_devices": info.global_devices,
        }
    }
    {"main": scenario_main, "restore": scenario_restore, "wait": scenario_wait, "raise": scenario_raise}[args.scenario](
        args, info, config, out
    )
    arrays = out.pop("arrays", {})
    np.savez(Path(args.out) / f"{args.scenario}_{info.process_id}.npz", **arrays)
    (Path(args.out) / f"{args.scenario}_{info.process_id}.json").write_text(json.dumps(out, indent=1, sort_keys=True))
    runtime.shutdown()
    return 0


def _p2p_moves(pid: int, cells, shardings, per_cell, host_params, out: dict) -> None:
    """The same moves point to point (``uuid``), plus sharded leaves of several dtypes, resharded on the way."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from gyre_jax import runtime
    from gyre_jax.runtime import p2p

    out["p2p_enabled"] = p2p.enabled()
    snap = runtime.transfer(per_cell[0], shardings[1], uuid=101)
    out["p2p_params_ok"] = shards_match(snap, host_params)
    out["p2p_params_held"] = sorted({bool(x.addressable_shards) for x in jax.tree.leaves(snap)})
    axis = cells[0].mesh.axis_names[0]
    values = {
        "f32": np.arange(32 * 6, dtype=np.float32).reshape(32, 6) / 7,
        "bf16": (np.arange(16 * 4).reshape(16, 4) / 3).astype(jax.numpy.bfloat16),
        "i8": (np.arange(8 * 3).reshape(8, 3) - 12).astype(np.int8),
        "bool": np.arange(8) % 3 == 0,
        "scalar": np.float32(-1.25),
    }
    src_specs = {
        "f32": PartitionSpec(axis),
        "bf16": PartitionSpec(),
        "i8": PartitionSpec(axis),
        "bool": PartitionSpec(axis),
    }
    dst_specs = {
        "f32": PartitionSpec(axis),
        "bf16": PartitionSpec(axis),
        "i8": PartitionSpec(),
        "bool": PartitionSpec(axis),
    }

    def spec(specs, k):
        return specs.get(k, PartitionSpec())

    src = {k: NamedSharding(cells[0].mesh, spec(src_specs, k)) for k in values}
    dst = {k: NamedSharding(cells[1].mesh, spec(dst_specs, k)) for k in values}
    tree = (
        {k: jax.device_put(v, src[k]) for k, v in values.items()}
        if pid == 0
        else {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype, sharding=src[k]) for k, v in values.items()}
    )
    moved = runtime.transfer(tree, dst, uuid=102)
    if pid == 1:
        out["p2p_mixed_ok"] = {
            k: bool(
                moved[k].sharding == dst[k]
                and moved[k].dtype == np.asarray(v).dtype
                and np.array_equal(np.asarray(moved[k]), np.asarray(v))
            )
            for k, v in values.items()
        }
    # and back: computed on the satellite, pulled by the core's process
    if pid == 1:
        back = jax.jit(lambda t: jax.tree.map(lambda x: 2 * x, t))(snap)
    else:
        back = jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), per_cell[1], shardings[1]
        )
    at_core = runtime.transfer(back, shardings[0], uuid=103)
    if pid == 0:
        out["p2p_back_ok"] = all(
            np.array_equal(np.asarray(a), 2 * h) for a, h in zip(jax.tree.leaves(at_core), jax.tree.leaves(host_params))
        )


if __name__ == "__main__":
    sys.exit(main())
