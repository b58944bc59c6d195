"""Every move of arrays between cells: ``transfer`` (one pytree onto another mesh's shardings) and
``publish_to_cells`` (one pytree from the global mesh onto every cell).

Within one process a move is ``jax.device_put`` (device to device). Across processes, cross-process
``jax.device_put`` between different device sets is not supported on every backend (not on CPU), so a
move is one jitted program over the union of the devices, whose output shards are re-wrapped, without a
copy, as arrays on the destination mesh; every process holding a device of either side runs it at the
same point (``runtime.remote`` keeps that order).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.runtime import lockstep, p2p
from gyre_jax.runtime.watchdog import DistributedError


def _identity(tree):
    return tree


@functools.lru_cache(maxsize=64)
def _jitted_identity(out_shardings_leaves: tuple, treedef) -> Callable:
    return jax.jit(_identity, out_shardings=jax.tree.unflatten(treedef, list(out_shardings_leaves)))


def _mirror_first_half(tree):
    """Every leaf ``[2 * d0, ...]`` -> its first half written to both halves (the destination half)."""

    def one(x):
        h = x.shape[0] // 2
        return jnp.concatenate([x[:h], x[:h]], axis=0)

    return jax.tree.map(one, tree)


@functools.lru_cache(maxsize=64)
def _jitted_mirror(out_shardings_leaves: tuple, treedef) -> Callable:
    return jax.jit(_mirror_first_half, out_shardings=jax.tree.unflatten(treedef, list(out_shardings_leaves)))


def _zeros(shapes_dtypes: tuple) -> list[jax.Array]:
    return [jnp.zeros(shape, dtype) for shape, dtype in shapes_dtypes]


@functools.lru_cache(maxsize=64)
def _jitted_zeros(shapes_dtypes: tuple, shardings: tuple) -> Callable:
    return jax.jit(functools.partial(_zeros, shapes_dtypes), out_shardings=list(shardings))


def _leaf_mesh(leaves: Sequence[Any], what: str) -> Mesh:
    """The one mesh of ``leaves`` (NamedShardings, or arrays / ShapeDtypeStructs carrying one)."""
    shardings = [x if isinstance(x, jax.sharding.Sharding) else getattr(x, "sharding", None) for x in leaves]
    if not leaves or not all(isinstance(s, NamedSharding) for s in shardings):
        raise DistributedError(f"{what}: every leaf must be (or carry) a NamedSharding")
    meshes = {s.mesh for s in shardings}
    if len(meshes) != 1:
        raise DistributedError(f"{what}: the leaves live on {len(meshes)} different meshes; expected one")
    return meshes.pop()


def _wrap(shape, dtype, sharding: NamedSharding, shards_by_device: dict) -> jax.Array:
    """An array on ``sharding`` from already-placed per-device buffers (zero copy); none for other processes."""
    local = [shards_by_device[d] for d in sharding.mesh.devices.flat if d in shards_by_device]
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, local, dtype=dtype)


def _stack_spec(spec: PartitionSpec, ndim: int, axis: str) -> PartitionSpec:
    """``spec`` of a ``[d0, ...]`` array -> spec of ``[k * d0, ...]`` with ``axis`` outermost on dim 0."""
    entries = list(spec) + [None] * (ndim - len(spec))
    first = entries[0]
    inner = () if first is None else (first,) if isinstance(first, str) else tuple(first)
    return PartitionSpec((axis,) + inner, *entries[1:])


def publish_to_cells(params: Any, cell_shardings: Sequence[Any]) -> list[Any]:
    """Copies ``params`` (on a mesh over all the cells' devices) onto every cell: one pytree per cell.

    ``cell_shardings[i]`` is a pytree like ``params`` of ``NamedSharding`` on cell ``i``'s mesh; all cells
    use the same specs (equal cells, same rules). One jitted program over the union of the devices writes
    each cell's layout (XLA's collectives move the data device to device); its output shards are then
    re-wrapped without a copy as one array per cell. Every process must call it at the same point. On a
    process that holds none of a cell's devices, that cell's arrays have no local shards.

    The params' mesh must list the devices in the order of the cells (``make_global_mesh`` and
    ``make_global_cells`` do): jit needs one device order for its input and output.
    """
    leaves, treedef = jax.tree.flatten(params)
    if not cell_shardings:
        raise DistributedError("publish_to_cells: no cells given")
    per_cell = [treedef.flatten_up_to(s) for s in cell_shardings]
    source = _leaf_mesh(leaves, "publish_to_cells params")
    cell_meshes = [_leaf_mesh(s, f"publish_to_cells cell_shardings[{i}]") for i, s in enumerate(per_cell)]
    shape = dict(cell_meshes[0].shape)
    if any(dict(m.shape) != shape or m.axis_names != cell_meshes[0].axis_names for m in cell_meshes):
        raise DistributedError("publish_to_cells: the cells' meshes differ in shape or axis names (cells are equal)")
    order = [d for m in cell_meshes for d in m.devices.flat]
    if len(set(order)) != len(order):
        raise DistributedError("publish_to_cells: the cells share devices (cells are disjoint)")
    if tuple(order) != tuple(source.devices.flat):
        same_set = set(order) == set(source.devices.flat)
        raise DistributedError(
            "publish_to_cells: the params' mesh must cover exactly the cells' devices, in the cells' order "
            + (
                "(same devices, other order: build both with make_global_mesh / make_global_cells)"
                if same_set
                else f"(params on {source.devices.size} devices, cells on {len(order)})"
            )
        )
    for i, s in enumerate(per_cell[1:], start=1):
        if [x.spec for x in s] != [x.spec for x in per_cell[0]]:
            raise DistributedError(f"publish_to_cells: cell {i}'s specs differ from cell 0's (cells share one layout)")
    stacked = Mesh(np.stack([m.devices for m in cell_meshes]), ("cells",) + tuple(cell_meshes[0].axis_names))
    outs = tuple(NamedSharding(stacked, s.spec) for s in per_cell[0])  # replicated over "cells": a copy per cell
    out_leaves = jax.tree.leaves(_jitted_identity(outs, treedef)(params))
    result = []
    for targets in per_cell:
        cell_leaves = []
        for x, target in zip(out_leaves, targets):
            shards = {s.device: s.data for s in x.addressable_shards}
            cell_leaves.append(_wrap(x.shape, x.dtype, target, shards))
        result.append(jax.tree.unflatten(treedef, cell_leaves))
    return result


def transfer(tree: Any, shardings: Any, *, may_alias: bool | None = None, uuid: int | None = None) -> Any:
    """``tree`` onto ``shardings`` (a pytree of ``NamedSharding`` like ``tree``): the one way arrays move
    between cells, whichever processes hold them.

    When this process drives a cell over several processes that either side touches (``runtime.lockstep``), the
    move is a lockstep call: the cell's other processes run their part of it too, in the cell's order. Otherwise
    (and on those processes) it is ``move``."""
    leaves = jax.tree.leaves(tree)
    group = lockstep.driving(
        _leaf_mesh(leaves, "transfer tree"), _leaf_mesh(jax.tree.leaves(shardings), "transfer shardings")
    )
    if group is not None:
        return group.call(None, f"{__name__}:move", tree, shardings, may_alias=may_alias, uuid=uuid, local=move)
    return move(tree, shardings, may_alias=may_alias, uuid=uuid)


def move(tree: Any, shardings: Any, *, may_alias: bool | None = None, uuid: int | None = None) -> Any:
    """``transfer`` as this process's part (see ``transfer``).

    When this process holds every device of both meshes it is ``jax.device_put(tree, shardings,
    may_alias=may_alias)`` (device to device). Across processes the source and destination meshes must be
    disjoint and have the same shape and axis names (two cells): one jitted program over the pair of meshes
    copies the source half of a ``[2 * d0, ...]`` array onto the destination half, and the destination
    shards are re-wrapped without a copy (always new buffers). Every process holding a device of either
    mesh must call it at the same point; others may call it too (they get arrays with no local shards and
    run nothing). A process that holds none of the source mesh passes abstract leaves
    (``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``) in its place. 0-d leaves travel as ``[1]``
    arrays. While it runs it costs a zero-filled shard per destination device and a copy on the source
    devices (the source half of the program's output).

    With ``uuid`` (a number unique in the run that both sides pass: ``remote.TransferLog`` gives them), each
    mesh held by one process and point-to-point moves on (``p2p.enabled``), the move goes point to point
    instead (``runtime.p2p``): the source process offers its shards and returns at once, the destination
    process pulls them (the bytes cross once; no program runs on both sides, so there is nothing to keep in
    order). The source side's result then has no local shards.
    """
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(shardings)
    src, dst = _leaf_mesh(leaves, "transfer tree"), _leaf_mesh(targets, "transfer shardings")
    src_devs, dst_devs = set(src.devices.flat), set(dst.devices.flat)
    local = set(jax.local_devices())
    if src_devs | dst_devs <= local:
        if not all(isinstance(x, jax.Array) for x in leaves):
            raise DistributedError(
                "transfer: abstract (ShapeDtypeStruct) leaves only stand for a mesh this process "
                "does not hold; this process holds both meshes, so pass the arrays"
            )
        return jax.device_put(tree, shardings, may_alias=may_alias)
    if src_devs == dst_devs:  # one cell over several processes: each process holding it runs this same move
        return jax.device_put(tree, shardings, may_alias=may_alias)
    if src_devs & dst_devs:
        raise DistributedError(
            "transfer across processes needs disjoint source and destination meshes "
            "(overlapping meshes are not supported yet: publish_to_cells covers the global mesh)"
        )
    if dict(src.shape) != dict(dst.shape) or src.axis_names != dst.axis_names:
        raise DistributedError(
            f"transfer across processes needs meshes of one shape: {dict(src.shape)} -> "
            f"{dict(dst.shape)} (not supported yet)"
        )

    def nothing_here() -> Any:  # the result on a process that holds no destination device
        return jax.tree.unflatten(treedef, [_wrap(x.shape, x.dtype, t, {}) for x, t in zip(leaves, targets)])

    if not (src_devs | dst_devs) & local:  # this process holds neither mesh: nothing to run
        return nothing_here()
    source = p2p.owner(src)
    if uuid is not None and p2p.enabled() and source is not None and p2p.owner(dst) is not None:
        if src_devs & local:
            p2p.send(leaves, targets, src, uuid)
            return nothing_here()
        return jax.tree.unflatten(treedef, p2p.receive(leaves, targets, source, uuid))
    out = _cross_process_copy(leaves, targets, treedef, src, dst, local)
    return jax.tree.unflatten(treedef, out)


def _cross_process_copy(leaves: list, targets: list, treedef, src: Mesh, dst: Mesh, local: set) -> list[jax.Array]:
    """``transfer``'s program over the pair of meshes: ``[2 * d0, ...]`` arrays whose first half is the
    source (our shards, or nothing for an abstract leaf) and second half our zero-filled destination shards;
    the program mirrors the first half onto the second; the destination shards come back as arrays."""
    pair = Mesh(np.stack([src.devices, dst.devices]), ("cells",) + tuple(src.axis_names))
    shapes = [tuple(x.shape) if x.shape else (1,) for x in leaves]  # 0-d leaves travel as [1]
    dst_set = set(dst.devices.flat)
    zeros: list = [None] * len(leaves)
    if dst_set & local:  # our part of the destination half starts as zeros, in the source's layout
        zeros = _jitted_zeros(
            tuple((shape, jnp.dtype(x.dtype)) for shape, x in zip(shapes, leaves)),
            tuple(NamedSharding(dst, x.sharding.spec if x.shape else PartitionSpec()) for x in leaves),
        )()
    ins, outs = [], []
    for x, target, shape, zero in zip(leaves, targets, shapes, zeros):
        held = x.addressable_shards if isinstance(x, jax.Array) else ()  # abstract leaf: a mesh this process lacks
        shards = {s.device: (s.data if x.shape else s.data.reshape(1)) for s in held}
        if zero is not None:
            shards.update({s.device: s.data for s in zero.addressable_shards})
        big = (2 * shape[0],) + shape[1:]  # [2 * d0, ...]: source half, then destination half
        ins.append(_wrap(big, x.dtype, NamedSharding(pair, _stack_spec(x.sharding.spec, len(shape), "cells")), shards))
        outs.append(NamedSharding(pair, _stack_spec(target.spec, len(shape), "cells")))
    out_leaves = _jitted_mirror(tuple(outs), treedef)(jax.tree.unflatten(treedef, ins))
    result = []
    for x, y, target in zip(leaves, jax.tree.leaves(out_leaves), targets):
        shards = {s.device: s.data for s in y.addressable_shards if s.device in dst_set}
        if not x.shape:
            shards = {d: a.reshape(()) for d, a in shards.items()}
        result.append(_wrap(x.shape, x.dtype, target, shards))
    return result


def abstract_on(layout: Sequence[tuple[tuple[int, ...], Any, PartitionSpec]], mesh: Mesh, like: Any) -> Any:
    """``ShapeDtypeStruct`` leaves (with shardings on ``mesh``) standing for a tree this process does not hold,
    from its ``layout`` (``describe``), structured like ``like``: ``transfer``'s source on the receiving side."""
    treedef = jax.tree.structure(like)
    leaves = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec)) for shape, dtype, spec in layout]
    return jax.tree.unflatten(treedef, leaves)


def describe(tree: Any) -> list[tuple[tuple[int, ...], Any, PartitionSpec]]:
    """(shape, dtype, partition spec) of each leaf of a tree of arrays: what another process needs to take
    part in its ``transfer`` (host data; see ``abstract_on``)."""
    return [(tuple(x.shape), x.dtype, x.sharding.spec) for x in jax.tree.leaves(tree)]
