"""Single-process tests for gyre_jax/runtime/ (process start-up and the control plane, cells): config validation, cells over hosts (with stand-in devices
for hosts this machine does not have), and the array movers on this process's 8 virtual devices.

The multi-process behaviour (2 real processes) is in test_multiprocess.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gyre_jax import config as config_lib
from gyre_jax import runtime

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fakes import hosts  # noqa: E402
from layouts import EIGHT_DEVICES  # noqa: E402


def tiny_config(**section):
    """The default config with these ``distributed`` keys (values of any type, as a hand-written file could hold);
    the section is checked as the config is built (``gyre_jax.config.DistributedSection``)."""
    values = config_lib.load_config(EIGHT_DEVICES).to_dict()
    values["distributed"].update(section)
    return config_lib.RunConfig.from_config_dict(values)


# -- config ----------------------------------------------------------------------------------------------
def test_defaults_and_a_full_multi_process_section_are_valid():
    assert tiny_config().distributed == config_lib.DistributedSection()
    tiny_config(
        enabled=True, coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1, heartbeat_timeout_s=5.0
    )
    values = config_lib.load_config(EIGHT_DEVICES).to_dict()
    del values["distributed"]  # a config without the section is a single-process config
    assert config_lib.RunConfig.from_config_dict(values).distributed.enabled is False


@pytest.mark.parametrize(
    "section, message",
    [
        (dict(enabled="yes"), "config.distributed.enabled='yes' must be true or false"),
        (dict(enabled=True, coordinator_address="localhost", num_processes=2, process_id=0), "must be 'host:port'"),
        (dict(enabled=True, coordinator_address="h:70000", num_processes=2, process_id=0), "port in [1, 65535]"),
        (dict(enabled=True, num_processes=-1), "num_processes=-1 must be >= 1, or 0 to auto-detect"),
        (dict(enabled=True, num_processes=2, process_id=-2), "process_id=-2 must be >= 0, or -1"),
        (dict(enabled=True, num_processes=2, process_id=2), "process_id=2 must be < num_processes=2"),
        (dict(local_device_ids=(0, 0)), "must be distinct device ids"),
        (dict(heartbeat_timeout_s=0.0), "config.distributed.heartbeat_timeout_s=0.0 must be a number of seconds >= 1"),
        (dict(initialization_timeout_s=True), "initialization_timeout_s=True must be a number"),
        (dict(enabled=True), "num_processes must be set on cpu"),
        (
            dict(enabled=True, num_processes=3),
            "num_cpu_devices=8 (the run's total) must be a multiple of config.distributed.num_processes=3",
        ),
        (dict(enabled=True, num_processes=2, local_device_ids=(0,)), "leave it () on cpu"),
        (dict(num_processes=2, process_id=1), "config.distributed.enabled is false; set enabled=true"),
        (dict(coordinatoraddress="h:1"), "unknown config key 'distributed.coordinatoraddress'"),
    ],
)
def test_bad_values_fail_with_one_line_naming_the_key(section, message):
    with pytest.raises(ValueError) as err:  # a config_lib.ConfigError
        tiny_config(**section)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_each_process_gets_its_share_of_the_virtual_cpu_devices():
    assert runtime.process.local_cpu_device_count(tiny_config()) == 8
    assert runtime.process.local_cpu_device_count(tiny_config(enabled=True, num_processes=2, process_id=0)) == 4
    assert runtime.process.local_cpu_device_count(tiny_config(enabled=True, num_processes=8, process_id=7)) == 1


def test_initialize_single_process_in_a_started_jax(monkeypatch):
    monkeypatch.setattr(runtime.process, "_RUNTIME", None)
    info = runtime.initialize(tiny_config())  # this test session already runs JAX on 8 CPU devices
    assert info == runtime.ProcessInfo(process_id=0, num_processes=1, local_devices=8, global_devices=8, platform="cpu")
    assert info.is_coordinator and runtime.is_coordinator()
    with pytest.raises(runtime.DistributedError, match="already called"):
        runtime.initialize(tiny_config())


def test_initialize_after_jax_started_with_other_devices_says_to_call_it_first(monkeypatch):
    monkeypatch.setattr(runtime.process, "_RUNTIME", None)
    config = tiny_config(enabled=True, coordinator_address="127.0.0.1:1", num_processes=2, process_id=0)
    with pytest.raises(
        runtime.DistributedError,
        match=r"JAX already started on cpu with 8 local devices, but the "
        r"config asks for cpu with 4 devices: call gyre_jax.runtime.initialize\(config\) before",
    ):
        runtime.initialize(config)
    with pytest.raises(config_lib.ConfigError, match="num_processes must be set on cpu"):  # refused before
        tiny_config(enabled=True)


# -- control plane in one process ------------------------------------------------------------------------
def test_single_process_decisions_are_the_json_round_trip():
    value = {"roles": {0: "serving"}, "order": (2, 1), "x": 1.5}
    got = runtime.broadcast_decision(value)
    assert got == json.loads(json.dumps(value)) == {"roles": {"0": "serving"}, "order": [2, 1], "x": 1.5}
    assert runtime.broadcast_decision(None) is None
    with pytest.raises(runtime.DistributedError, match="not JSON-able"):
        runtime.broadcast_decision({"s": {1, 2}})
    with pytest.raises(runtime.DistributedError, match="not JSON-able"):
        runtime.broadcast_decision(float("nan"))
    with pytest.raises(runtime.DistributedError, match="more than 1048576: decisions are small control messages"):
        runtime.broadcast_decision("x" * (runtime.process.MAX_DECISION_BYTES + 1))
    with pytest.raises(ValueError, match="expected 'kv' or 'devices'"):
        runtime.broadcast_decision(1, via="pigeon")
    runtime.sync("nothing to wait for")  # one process: returns at once


# -- cells over hosts --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "num_hosts, per_host, num_cells, shape, hosts_per_cell",
    [
        (4, 8, 4, dict(expert=8), [[0], [1], [2], [3]]),  # a cell per host
        (4, 8, 2, dict(data=2, tensor=8), [[0, 1], [2, 3]]),  # cells of whole hosts
        (2, 8, 8, dict(tensor=2), [[0]] * 4 + [[1]] * 4),  # parts of one host
        (8, 4, 4, dict(expert=8), [[0, 1], [2, 3], [4, 5], [6, 7]]),  # TPU v5p-64: 2 hosts of 4 chips per cell
    ],
)
def test_cells_are_whole_hosts_or_part_of_one_host(num_hosts, per_host, num_cells, shape, hosts_per_cell):
    devices = hosts(num_hosts, per_host)
    cells = runtime.make_cells(devices, num_cells, shape)
    assert [list(c.processes) for c in cells] == hosts_per_cell
    ordered = runtime.cells.host_ordered(devices)
    size = len(devices) // num_cells
    for i, cell in enumerate(cells):
        assert cell.devices == ordered[i * size : (i + 1) * size]
        assert [d.id for d in cell.devices] == sorted(d.id for d in cell.devices)
        assert cell.mesh.devices.size == size
    assert sorted(d.id for c in cells for d in c.devices) == sorted(d.id for d in devices)


def test_global_mesh_puts_hosts_on_the_outer_axis_and_tensor_groups_inside_a_host():
    mesh = runtime.make_train_mesh(dict(data=4, tensor=8), hosts(4, 8))
    for row in range(4):  # every data index is one host; its tensor group is that host's 8 GPUs
        assert {d.process_index for d in mesh.devices[row].flat} == {row}


@pytest.mark.parametrize(
    "devices, num_cells, shape, message",
    [
        (hosts(3, 4), 2, dict(data=6), "a cell of 6 devices over hosts of 4 devices would split a host between groups"),
        (hosts(2, 6), 3, dict(data=4), "a cell of 4 devices over hosts of 6 devices would split a host"),
        (hosts(2, 6), 1, dict(data=3, tensor=4), "a tensor x expert group of a cell of 4 devices over hosts of 6"),
        (hosts(2, 4)[:7], 1, dict(data=7), "processes hold different numbers of devices"),
        (hosts(2, 4), 3, dict(data=2), "8 devices cannot be split into 3 equal cells"),
        (hosts(2, 4), 2, dict(data=8), "cell 0: mesh shape"),
    ],
)
def test_scattered_or_uneven_cells_fail_clearly(devices, num_cells, shape, message):
    with pytest.raises(runtime.DistributedError, match=message.replace("(", r"\(")):
        runtime.make_cells(devices, num_cells, shape)


# -- moving arrays ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_params():
    """A real tiny model's params on the global 8-device mesh (data=4, fsdp=2)."""
    from gyre_jax.model.config import TINY
    from gyre_jax.model.sharding import (
        RULES_FSDP_TENSOR,
        abstract_model,
        init_params,
        param_shardings,
    )

    mesh = runtime.make_train_mesh(dict(data=4, fsdp=2))
    _, params = init_params(TINY, mesh, RULES_FSDP_TENSOR, seed=0)
    _, abstract = abstract_model(TINY)
    return params, lambda m: param_shardings(abstract, RULES_FSDP_TENSOR, m)


@pytest.mark.parametrize("num_cells, shape", [(2, dict(data=4)), (4, dict(data=2)), (2, dict(fsdp=4)), (8, dict())])
def test_publish_to_cells_equals_device_put_onto_each_cell(tiny_params, num_cells, shape):
    params, shardings_on = tiny_params
    cells = runtime.make_cells(None, num_cells, shape)
    targets = [shardings_on(c.mesh) for c in cells]
    published = runtime.publish_to_cells(params, targets)
    assert len(published) == num_cells
    for cell, got, target in zip(cells, published, targets):
        want = jax.device_put(params, target)
        for g, w, t in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(target)):
            assert g.sharding == t and g.devices() == set(cell.devices)
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
            assert [s.index for s in g.addressable_shards] == [s.index for s in w.addressable_shards]


def test_publish_to_cells_rejects_meshes_that_do_not_line_up(tiny_params):
    params, shardings_on = tiny_params
    cells = runtime.make_cells(None, 2, dict(data=4))
    reversed_cells = cells[::-1]
    with pytest.raises(runtime.DistributedError, match="same devices, other order"):
        runtime.publish_to_cells(params, [shardings_on(c.mesh) for c in reversed_cells])
    with pytest.raises(runtime.DistributedError, match="params on 8 devices, cells on 4"):
        runtime.publish_to_cells(params, [shardings_on(cells[0].mesh)])
    replicated = jax.tree.map(lambda s: NamedSharding(s.mesh, P()), shardings_on(cells[1].mesh))
    with pytest.raises(runtime.DistributedError, match="cell 1's specs differ"):
        runtime.publish_to_cells(params, [shardings_on(cells[0].mesh), replicated])
    other = runtime.make_cells(None, 2, dict(fsdp=4))
    with pytest.raises(runtime.DistributedError, match="cells' meshes differ in shape"):
        runtime.publish_to_cells(params, [shardings_on(cells[0].mesh), shardings_on(other[1].mesh)])
    with pytest.raises(runtime.DistributedError, match="no cells given"):
        runtime.publish_to_cells(params, [])


def test_cell_put_in_one_process_is_device_put(tiny_params):
    params, shardings_on = tiny_params
    cells = runtime.make_cells(None, 2, dict(data=4))
    on_core = jax.device_put(params, shardings_on(cells[0].mesh))
    moved = runtime.transfer(on_core, shardings_on(cells[1].mesh))
    for m, p in zip(jax.tree.leaves(moved), jax.tree.leaves(params)):
        assert m.devices() == set(cells[1].devices)
        np.testing.assert_array_equal(np.asarray(m), np.asarray(p))
    copy = runtime.transfer(on_core, shardings_on(cells[0].mesh), may_alias=False)  # same mesh: a fresh copy
    for c, o in zip(jax.tree.leaves(copy), jax.tree.leaves(on_core)):
        assert (
            c.addressable_shards[0].data.unsafe_buffer_pointer() != o.addressable_shards[0].data.unsafe_buffer_pointer()
        )
        np.testing.assert_array_equal(np.asarray(c), np.asarray(o))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), on_core)
    with pytest.raises(runtime.DistributedError, match="this process holds both meshes, so pass the arrays"):
        runtime.transfer(abstract, shardings_on(cells[1].mesh))
    with pytest.raises(runtime.DistributedError, match="must be \\(or carry\\) a NamedSharding"):
        runtime.transfer(jnp.ones(3), jax.devices()[0])


def test_a_collective_whose_peer_closed_its_connection_is_a_lost_peer_not_this_process_failing():
    """gloo's error when the process at the other end died (seen when a follower was SIGKILLed during the warm
    start's all-reduce): the leader then waits for its watchdog's lost-peer exit (75) instead of exiting 1."""
    from gyre_jax.runtime.process import peer_connection_lost

    gloo = jax.errors.JaxRuntimeError(
        "UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by "
        "peer [127.0.0.1]:60116"
    )
    assert peer_connection_lost(gloo)
    assert peer_connection_lost(OSError("[Errno 104] Connection reset by peer"))
    assert not peer_connection_lost(ValueError("operands could not be broadcast together with shapes (2,) (3,)"))
    assert not peer_connection_lost(RuntimeError("Gloo all-reduce failed: invalid argument"))
