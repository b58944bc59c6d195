"""Tests for gyre_jax/rl/accumulator.py: ordered (bit-exact) and arrival-order sums, across meshes."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from gyre_jax.model.sharding import make_mesh
from gyre_jax.rl.accumulator import GradAccumulator

N = 5


@pytest.fixture(scope="module")
def meshes():
    devices = jax.devices()
    core = make_mesh(devices[:4], dict(data=2, fsdp=2))
    satellite = make_mesh(devices[4:], dict(data=4))
    return core, satellite


def shardings_on(mesh):
    return {"w": NamedSharding(mesh, PartitionSpec("fsdp", None)), "b": NamedSharding(mesh, PartitionSpec())}


def grads_list(mesh):
    """N gradient trees whose float32 sum depends on the order of addition (values of very different scale)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(N):
        scale = 10.0 ** rng.integers(-4, 5, size=(8, 6))
        tree = {
            "w": (rng.normal(size=(8, 6)) * scale).astype(np.float32),
            "b": rng.normal(size=(3,)).astype(np.float32),
        }
        out.append(jax.device_put(tree, shardings_on(mesh)))
    return out


def run(acc, grads, order):
    for i in order:
        acc.add(i, grads[i], {"loss": jnp.float32(i + 0.5)})
    total, aux, n = acc.result()
    return jax.tree.map(np.asarray, total), aux, n


def test_ordered_sum_is_bit_identical_for_every_arrival_order(meshes):
    core, _ = meshes
    grads = grads_list(core)
    ref, aux_ref, _ = run(GradAccumulator(shardings_on(core), N), grads, range(N))
    want = sum(np.asarray(g["w"], np.float64) for g in grads)
    np.testing.assert_allclose(ref["w"], want, rtol=1e-5)
    assert aux_ref["loss"] == pytest.approx(sum(i + 0.5 for i in range(N)))
    arrival_differs = False
    for order in itertools.permutations(range(N)):
        got, aux, n = run(GradAccumulator(shardings_on(core), N), grads, order)
        assert n == N and aux == aux_ref
        np.testing.assert_array_equal(got["w"], ref["w"])
        np.testing.assert_array_equal(got["b"], ref["b"])
        unordered, _, _ = run(GradAccumulator(shardings_on(core), N, ordered=False), grads, order)
        np.testing.assert_allclose(unordered["w"], ref["w"], rtol=1e-5, atol=1e-3)
        arrival_differs |= not np.array_equal(unordered["w"], ref["w"])
    # The values are chosen so that float32 addition order matters: ordering is what makes the sum exact.
    assert arrival_differs


def test_gradients_from_another_mesh_land_on_the_core_shardings(meshes):
    core, satellite = meshes
    core_grads, sat_grads = grads_list(core), grads_list(satellite)
    mixed = [sat_grads[i] if i % 2 else core_grads[i] for i in range(N)]
    got, _, _ = run(GradAccumulator(shardings_on(core), N), mixed, [4, 1, 3, 0, 2])
    ref, _, _ = run(GradAccumulator(shardings_on(core), N), core_grads, range(N))
    np.testing.assert_array_equal(got["w"], ref["w"])
    acc = GradAccumulator(shardings_on(core), N)
    for i in range(N):
        acc.add(i, sat_grads[i])
    total, _, _ = acc.result()
    for leaf, sh in zip(jax.tree.leaves(total), jax.tree.leaves(shardings_on(core))):
        assert leaf.sharding.is_equivalent_to(sh, leaf.ndim) and leaf.dtype == jnp.float32


def test_buffer_holds_only_early_arrivals_and_empty_slots_release_it(meshes):
    core, _ = meshes
    grads = grads_list(core)
    acc = GradAccumulator(shardings_on(core), N)
    acc.add(2, grads[2])
    acc.add(4, grads[4])
    assert acc.buffered == 2  # waiting for slots 0, 1 (and 3)
    acc.add(0, grads[0])
    assert acc.buffered == 2
    with pytest.raises(ValueError, match="not complete"):
        acc.result()
    acc.mark_empty(1)  # slot 1's data never came
    assert acc.buffered == 1  # 2 was added; 4 waits for 3
    acc.mark_empty(3)
    assert acc.buffered == 0
    total, _, n = acc.result()
    assert n == 3
    want = sum(np.asarray(grads[i]["w"], np.float64) for i in (0, 2, 4))
    np.testing.assert_allclose(np.asarray(total["w"]), want, rtol=1e-5)


def test_misuse_is_refused(meshes):
    core, _ = meshes
    grads = grads_list(core)
    acc = GradAccumulator(shardings_on(core), 2)
    acc.add(1, grads[1])
    with pytest.raises(ValueError, match="already added"):
        acc.add(1, grads[1])
    with pytest.raises(ValueError, match="cannot be empty"):
        acc.mark_empty(1)
    with pytest.raises(ValueError, match="outside"):
        acc.add(5, grads[0])
    empty = GradAccumulator(shardings_on(core), 1)
    empty.mark_empty(0)
    with pytest.raises(ValueError, match="every slot is empty"):
        empty.result()
