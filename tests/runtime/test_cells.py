"""Tests for gyre_jax/runtime/cells.py: equal, contiguous, disjoint cell submeshes of the device list."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from gyre_jax.runtime.cells import make_cells


@pytest.mark.parametrize(
    "num_cells, shape",
    [
        (1, dict(data=4, fsdp=2)),
        (2, dict(data=4)),
        (2, dict(data=2, fsdp=2)),
        (4, dict(fsdp=2)),
        (8, dict()),
    ],
)
def test_cells_are_disjoint_contiguous_submeshes_of_the_right_shape(num_cells, shape):
    devices = jax.devices()
    assert len(devices) == 8
    cells = make_cells(devices, num_cells, shape)
    size = len(devices) // num_cells
    assert [c.index for c in cells] == list(range(num_cells))
    assert [c.name for c in cells] == [f"cell{i}" for i in range(num_cells)]
    expected_shape = {"data": shape.get("data", 1), "fsdp": shape.get("fsdp", 1), "tensor": shape.get("tensor", 1)}
    for i, cell in enumerate(cells):
        assert cell.devices == tuple(devices[i * size : (i + 1) * size])  # a contiguous slice, in order
        assert dict(cell.mesh.shape) == expected_shape
        assert tuple(cell.mesh.axis_names) == ("data", "fsdp", "tensor")
        assert list(cell.mesh.devices.flat) == list(cell.devices)
    all_devices = [d for c in cells for d in c.devices]
    assert len(set(all_devices)) == len(all_devices) == len(devices)  # disjoint and covering
    assert set(all_devices) == set(devices)


def test_arrays_on_a_cell_mesh_live_only_on_that_cells_devices():
    cells = make_cells(jax.devices(), 2, dict(data=4))
    for cell in cells:
        x = jax.device_put(np.arange(8.0), NamedSharding(cell.mesh, PartitionSpec("data")))
        assert x.devices() == set(cell.devices)
        np.testing.assert_array_equal(np.asarray(x), np.arange(8.0))


@pytest.mark.parametrize("num_cells", [0, 3, 5, -1])
def test_cells_must_divide_the_devices(num_cells):
    with pytest.raises(ValueError, match=f"{num_cells} equal cells"):
        make_cells(jax.devices(), num_cells, dict(data=1))


def test_cell_shape_must_match_the_cell_size():
    with pytest.raises(ValueError, match="needs 8 devices, got 4"):
        make_cells(jax.devices(), 2, dict(data=8))
