"""Multi-process tests for gyre_jax/runtime/ (processes, the control plane, transfers): 2 real processes x 4 virtual CPU devices on loopback.

Every run starts ``tests/runtime/worker.py`` twice (process 0 and 1, a free port, gloo collectives) and
compares what they wrote with the same computation done here in the test process (1 process, 8 devices).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from timelimits import scaled

from gyre_jax import runtime

HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker.py"
sys.path.insert(0, str(HERE))
import worker  # noqa: E402  (the worker's reference functions)

pytestmark = pytest.mark.slow  # every test runs 2 processes

RUN_TIMEOUT_S = 150  # a whole 2-process run, start-up and compiles included (2 busy cores), scaled at each use
FAIL_FAST_BOUND_S = 60  # a survivor must be gone this soon after its peer is killed (idle machine), scaled at each use


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(scenario: str, pid: int, port: int, out: Path, nproc: int = 2, heartbeat: float = 30.0) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [
        sys.executable,
        str(WORKER),
        scenario,
        "--pid",
        str(pid),
        "--nproc",
        str(nproc),
        "--port",
        str(port),
        "--out",
        str(out),
        "--heartbeat",
        str(heartbeat),
    ]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """(return code, stderr); a process still running after ``timeout`` is killed and the test fails."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"worker still running after {timeout} s (a hang); stderr tail:\n{err[-3000:]}")
    return proc.returncode, err


def start_pair(scenario: str, out: Path) -> list[subprocess.Popen]:
    port = free_port()
    return [start(scenario, pid, port, out) for pid in (0, 1)]


def wait_pair(scenario: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + scaled(RUN_TIMEOUT_S)
    results = [finish(p, max(1.0, deadline - time.monotonic())) for p in procs]
    for pid, (rc, err) in enumerate(results):
        assert rc == 0, f"{scenario} process {pid} exited {rc}:\n{err[-4000:]}"


def load(out: Path, scenario: str, pid: int) -> tuple[dict, dict]:
    meta = json.loads((out / f"{scenario}_{pid}.json").read_text())
    with np.load(out / f"{scenario}_{pid}.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return meta, arrays


# -- one 2-process run of the main scenario, and its single-process reference --------------------------
def single_process_reference() -> dict:
    """The same computation in this process: 1 process, 8 devices, the same mesh shape and seed."""
    config = worker.make_config(nproc=1)
    mesh = runtime.make_train_mesh(config.mesh.shape())
    model_cfg, graphdef, params, rules = worker.model_setup(config, mesh)
    loss, grads, logits = worker.loss_and_grads(graphdef, params, mesh, rules)
    return dict(
        model_cfg=model_cfg,
        rules=rules,
        loss=np.asarray(loss),
        logits=np.asarray(logits),
        grads={"grad" + k: v for k, v in worker.flat(jax.device_get(grads)).items()},
        param_arrays={"param" + k: v for k, v in worker.flat(jax.device_get(params)).items()},
    )


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    """One 2-process run of the main scenario; the single-process reference is computed while it runs."""
    out = tmp_path_factory.mktemp("multiprocess")
    procs = start_pair("main", out)
    try:
        ref = single_process_reference()
    finally:
        wait_pair("main", procs)
    return out, [load(out, "main", pid) for pid in (0, 1)], ref


@pytest.fixture(scope="module")
def reference(main_run):
    return main_run[2]


def test_processes_see_one_global_host_ordered_mesh(main_run):
    _, runs, _ = main_run
    for pid, (meta, _) in enumerate(runs):
        assert meta["info"] == {"process_id": pid, "num_processes": 2, "local_devices": 4, "global_devices": 8}
        devices = meta["devices"]  # [id, process_index], host-ordered
        assert [p for _, p in devices] == [0, 0, 0, 0, 1, 1, 1, 1]
        assert devices == sorted(devices, key=lambda d: (d[1], d[0]))
    assert runs[0][0]["devices"] == runs[1][0]["devices"]
    # single-device programs run inline on the thread that dispatches them (runtime.process._join: XLA:CPU's async
    # dispatch can let two of them run at once when two threads dispatch, and gloo pairs collectives by order)
    assert [meta["cpu_async_dispatch"] for meta, _ in runs] == [False, False]


def test_sharded_train_computation_equals_the_single_process_result(main_run, reference):
    _, runs, _ = main_run
    for pid, (_, arrays) in enumerate(runs):
        np.testing.assert_allclose(arrays["loss"], reference["loss"], rtol=1e-6, err_msg=f"process {pid}")
        np.testing.assert_allclose(arrays["logits"], reference["logits"], rtol=1e-5, atol=1e-5)
        grads = {k: v for k, v in arrays.items() if k.startswith("grad")}
        assert grads.keys() == reference["grads"].keys() and len(grads) > 5
        for k, v in grads.items():
            np.testing.assert_allclose(v, reference["grads"][k], rtol=1e-4, atol=1e-6, err_msg=f"{k} on process {pid}")
        for k, v in reference["param_arrays"].items():  # same seed, same values, whatever the process count
            np.testing.assert_array_equal(arrays[k], v)


def test_each_process_runs_its_own_cell_with_the_published_params(main_run, reference):
    _, runs, _ = main_run
    for pid, (meta, arrays) in enumerate(runs):
        by_process = [[i for i, p in meta["devices"] if p == q] for q in (0, 1)]
        assert meta["cells"] == by_process  # 2 cells of 4: cell i is exactly host i's devices, in id order
        assert meta["cell_processes"] == [[0], [1]]  # cell i is host i: whole hosts, never scattered
        assert (
            meta["publish_2_local_shards_ok"]
            and meta["publish_4_local_shards_ok"]
            and meta["publish_1_local_shards_ok"]
        )
        assert meta["publish_2_local_cells"] == [pid] and meta["publish_2_no_local_shards"] == [1 - pid]
        assert meta["publish_4_local_cells"] == [2 * pid, 2 * pid + 1]
        assert meta["publish_4_no_local_shards"] == [2 * (1 - pid), 2 * (1 - pid) + 1]
        assert meta["publish_1_local_cells"] == [] and meta["publish_1_no_local_shards"] == []  # spans both hosts
        # The cell's forward pass (4 devices of one host) gives the global mesh's logits.
        np.testing.assert_allclose(arrays["cell_logits"], reference["logits"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(arrays["cell_loss"], reference["loss"], rtol=1e-6)


def test_cell_put_moves_trees_between_cells_on_different_processes(main_run):
    _, runs, _ = main_run
    (m0, _), (m1, _) = runs
    assert m1["cell_put_params_ok"] and m1["cell_put_params_held"] == [True]  # the satellite got the core's params
    assert m0["cell_put_params_ok"] and m0["cell_put_params_held"] == [False]  # process 0 holds no shard of cell 1
    assert m0["cell_put_back_ok"] is True  # 2 x params computed on cell 1 arrived on the core exactly
    assert m1["cell_put_scalar"] == 2.5


def test_point_to_point_moves_equal_the_source_in_every_dtype_and_layout(main_run):
    """``transfer(..., uuid=n)``: the sender offers, the receiver pulls (``runtime.p2p``); sharded and replicated
    leaves of f32 / bf16 / int8 / bool / 0-d, resharded on the way, arrive bit for bit on the target layout."""
    _, runs, _ = main_run
    (m0, _), (m1, _) = runs
    assert m0["p2p_enabled"] and m1["p2p_enabled"]
    assert m1["p2p_params_ok"] and m1["p2p_params_held"] == [True]
    assert m0["p2p_params_held"] == [False]
    assert m1["p2p_mixed_ok"] == {"f32": True, "bf16": True, "i8": True, "bool": True, "scalar": True}
    assert m0["p2p_back_ok"] is True


def test_broadcast_decision_gives_identical_objects_on_every_process(main_run):
    _, runs, _ = main_run
    (m0, _), (m1, _) = runs
    expected = json.loads(json.dumps(worker.DECISION))  # the JSON round trip: tuples become lists
    for meta in (m0, m1):
        assert meta["decision_kv"] == expected
        assert meta["decision_devices"] == expected  # via multihost_utils.broadcast_one_to_all
        assert meta["decision_big_len"] == 10000  # two device rounds
        assert meta["decision_seq"] == [0, 10, 20, 30, 40]  # the n-th call gets the n-th decision
    assert m0["decision_errors"] == m1["decision_errors"]  # a bad value fails on every process alike
    assert set(m0["decision_errors"]) == {"kv", "devices"}
    assert "not JSON-able" in m0["decision_errors"]["kv"]


def test_sync_at_different_names_fails_on_every_process_naming_both(main_run):
    _, runs, _ = main_run
    for pid, (meta, _) in enumerate(runs):
        message = meta["sync_mismatch"]
        assert f"sync 'branch-{pid}'" in message
        assert f"{{{1 - pid}: 'branch-{1 - pid}'}}" in message, message


# -- orbax checkpoints across process counts ---------------------------------------------------------------
def test_checkpoint_saved_by_2_processes_restores_in_2_processes(main_run, reference):
    out, _, _ = main_run
    wait_pair("restore", start_pair("restore", out))
    for pid in (0, 1):
        meta, arrays = load(out, "restore", pid)
        assert meta["meta"] == {"next_step": 2, "saved_by": 2}
        for k, v in reference["param_arrays"].items():
            np.testing.assert_array_equal(arrays[k], v)


def test_hf_export_of_params_spanning_processes_equals_the_params(main_run, reference):
    """Both processes call ``save_hf_checkpoint`` on params spanning both; process 0 writes the directory (in
    shards), process 1 only takes part in each tensor's gather; loaded back here, every param equals the
    single-process reference."""
    from gyre_jax.model.hf_checkpoint import load_hf_params

    out, _, _ = main_run
    meta0, _ = load(out, "main", 0)
    meta1, _ = load(out, "main", 1)
    assert meta0["params_span_processes"] and meta1["params_span_processes"]
    assert len(meta0["hf_files"]) > 1 and meta0["hf_files"] == meta1["hf_files"]
    assert sorted(p.name for p in (out / "hf_0").glob("*.safetensors")) == sorted(meta0["hf_files"])
    assert not (out / "hf_1").exists()  # process 1 wrote nothing
    mesh = runtime.make_train_mesh({"data": 1}, jax.devices()[:1])
    _, params = load_hf_params(out / "hf_0", reference["model_cfg"], mesh, reference["rules"])
    got = {"param" + k: v for k, v in worker.flat(jax.device_get(params)).items()}
    assert got.keys() == reference["param_arrays"].keys()
    for k, v in reference["param_arrays"].items():
        np.testing.assert_array_equal(got[k], v)


@pytest.mark.parametrize("mesh_shape, num_devices", [(dict(data=4, fsdp=2), 8), (dict(data=2, fsdp=2), 4)])
def test_checkpoint_saved_by_2_processes_restores_in_1_process(main_run, reference, mesh_shape, num_devices):
    """In this process: all 8 devices with the saving mesh, and 4 devices with another mesh shape."""
    from gyre_jax.checkpoint import Checkpointer
    from gyre_jax.model.sharding import abstract_model, param_shardings

    out, _, _ = main_run
    mesh = runtime.make_train_mesh(mesh_shape, jax.devices()[:num_devices])
    _, abstract = abstract_model(reference["model_cfg"])
    target = worker.jax_abstract(abstract, param_shardings(abstract, reference["rules"], mesh))
    ckpt = Checkpointer(out / "ckpt")
    state, meta = ckpt.restore(ckpt.latest_step(), {"params": target})
    ckpt.close()
    assert meta == {"next_step": 2, "saved_by": 2}
    restored = {"param" + k: v for k, v in worker.flat(jax.device_get(state["params"])).items()}
    assert restored.keys() == reference["param_arrays"].keys()
    for k, v in reference["param_arrays"].items():
        np.testing.assert_array_equal(restored[k], v)
    for leaf in jax.tree.leaves(state["params"]):
        assert leaf.sharding.mesh.devices.size == num_devices


# -- failure: a dead or failing process stops the others quickly, with a clear message -----------------
def _wait_ready(out: Path, procs, timeout: float) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not all((out / f"ready_{pid}").exists() for pid in (0, 1)):
        for pid, p in enumerate(procs):
            if p.poll() is not None:
                pytest.fail(f"process {pid} exited {p.returncode} before it was ready:\n{p.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            pytest.fail("processes not ready in time")
        time.sleep(0.1)


def test_killing_the_coordinator_makes_the_other_exit_fast_with_a_clear_message(tmp_path):
    """The survivor (process 1, waiting for a decision) is blocked when the coordinator dies. The other victim, a
    follower killed while process 0 runs: tests/runtime/test_train_multiprocess.py, in a training run."""
    port = free_port()
    heartbeat_s = round(scaled(5.0))  # never so short that a live but starved peer is declared dead
    procs = [start("wait", pid, port, tmp_path, heartbeat=heartbeat_s) for pid in (0, 1)]
    _wait_ready(tmp_path, procs, RUN_TIMEOUT_S)
    time.sleep(0.5)  # both are now blocked
    victim, survivor = 0, 1
    os.killpg(procs[victim].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    bound = heartbeat_s + scaled(FAIL_FAST_BOUND_S - 5)
    rc, err = finish(procs[survivor], bound + 30)
    elapsed = time.monotonic() - killed_at
    finish(procs[victim], scaled(10))
    assert elapsed < bound, f"survivor took {elapsed:.1f} s to exit (bound {bound:.0f} s, heartbeat {heartbeat_s} s)"
    assert rc != 0
    # the coordinator is gone: our watchdog or JAX's own client notices first, each with a clear line
    assert (
        "gyre-jax process 1 of 2 is stopping: lost the control-plane store" in err
        or "Terminating process because the JAX distributed service detected fatal errors" in err
    ), err[-3000:]
    assert not (tmp_path / f"wait_{survivor}.json").exists()  # it never got past the blocked call


def test_an_exception_in_one_process_stops_the_other_with_its_message(tmp_path):
    """Without the watchdog, process 0 would wait in its collective and exit only at JAX's shutdown timeout."""
    port = free_port()
    bound = scaled(FAIL_FAST_BOUND_S)
    heartbeat_s = 2 * bound  # a heartbeat would find the failure only after the bound
    procs = [start("raise", pid, port, tmp_path, heartbeat=heartbeat_s) for pid in (0, 1)]
    _wait_ready(tmp_path, procs, RUN_TIMEOUT_S)
    started = time.monotonic()
    rc1, err1 = finish(procs[1], bound)
    rc0, err0 = finish(procs[0], bound)
    elapsed = time.monotonic() - started
    assert elapsed < bound, f"{elapsed:.1f} s"  # the failure is published, not found by the (longer) heartbeat
    assert rc1 == runtime.FAILED_EXIT_CODE and "RuntimeError: injected failure in process 1" in err1
    assert "error: process 1: uncaught RuntimeError: injected failure in process 1" in err1
    assert rc0 == runtime.PEER_LOST_EXIT_CODE, err0[-3000:]
    assert "process 1 failed: uncaught RuntimeError: injected failure in process 1" in err0, err0[-3000:]
