"""Cells: the device list split into equal submeshes that serve or train, and the training mesh.

Devices are ordered by ``(process_index, id)`` (each host's devices contiguous); a cell is one contiguous
slice of that order, so it is a set of whole hosts or a part of one host, never a scattered set, and a
tensor x expert group never straddles a cell or a host. One process or many: the same functions.
``CellLayout`` is what any process needs to address a cell's arrays (parameter and KV page shardings)
without building its serving engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh

from gyre_jax.model.sharding import abstract_model, make_mesh, param_shardings
from gyre_jax.runtime.watchdog import DistributedError
from gyre_jax.serving.engine import kv_pages_shardings


class CellError(DistributedError, ValueError):
    """The devices cannot be split into the cells (or the training mesh) asked for."""


@dataclass
class Cell:
    """Cell ``index``: its devices (host-ordered) and its mesh."""

    index: int
    devices: tuple[jax.Device, ...]
    mesh: Mesh

    @property
    def name(self) -> str:
        return f"cell{self.index}"

    @property
    def processes(self) -> tuple[int, ...]:
        """The processes that hold the cell's devices (these all run the cell's programs: a cell over several runs
        in lockstep, driven by the first, ``runtime.lockstep``)."""
        return tuple(sorted({d.process_index for d in self.devices}))


def host_ordered(devices: Sequence[jax.Device] | None = None) -> tuple[jax.Device, ...]:
    """``devices`` (default: all) ordered by ``(process_index, id)``: each host's devices contiguous."""
    devices = jax.devices() if devices is None else devices
    return tuple(sorted(devices, key=lambda d: (d.process_index, d.id)))


def devices_per_process(devices: Sequence[jax.Device]) -> int:
    """The number of ``devices`` on each process; ``DistributedError`` if processes hold different numbers."""
    counts: dict[int, int] = {}
    for d in devices:
        counts[d.process_index] = counts.get(d.process_index, 0) + 1
    if len(set(counts.values())) != 1:
        raise CellError(
            f"processes hold different numbers of devices {dict(sorted(counts.items()))}: cells "
            f"over hosts need the same number on every host"
        )
    return next(iter(counts.values()))


def check_host_aligned(devices: Sequence[jax.Device], group: int, what: str) -> None:
    """Consecutive groups of ``group`` host-ordered devices must each be whole hosts or part of one host."""
    per_host = devices_per_process(devices)
    if group <= 0 or len(devices) % group:
        raise CellError(f"{what}: {len(devices)} devices cannot be split into groups of {group}")
    if group % per_host and per_host % group:
        raise CellError(
            f"{what} of {group} devices over hosts of {per_host} devices would split a host between groups: a group "
            f"must be whole hosts (a multiple of {per_host} devices) or part of one host (a divisor of {per_host})"
        )


def _inner_group(shape: dict[str, int]) -> int:
    """Devices of one tensor x expert block (the innermost, most communication-heavy mesh axes)."""
    return int(shape.get("tensor", 1)) * int(shape.get("expert", 1))


def make_train_mesh(shape: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The training mesh over ``devices`` (default: every process's), host-ordered (``data`` outermost spans
    hosts); the same device order as ``make_cells``, which ``transfer.publish_to_cells`` relies on."""
    devs = host_ordered(devices)
    check_host_aligned(devs, _inner_group(shape), "a tensor x expert group of the training mesh")
    return make_mesh(devs, shape)


def make_cells(devices: Sequence[jax.Device] | None, num_cells: int, shape: dict[str, int]) -> list[Cell]:
    """``num_cells`` equal cells over host-ordered ``devices`` (default: all), each a mesh of ``shape``.

    Raises ``DistributedError`` when the devices do not split evenly, or a cell would take parts of several
    hosts, or a tensor x expert group would straddle hosts.
    """
    devs = host_ordered(devices)
    if num_cells < 1 or len(devs) % num_cells:
        raise CellError(f"{len(devs)} devices cannot be split into {num_cells} equal cells")
    size = len(devs) // num_cells
    check_host_aligned(devs, size, "a cell")
    check_host_aligned(devs, _inner_group(shape), "a tensor x expert group of a cell")
    cells = []
    for i in range(num_cells):
        cell_devs = devs[i * size : (i + 1) * size]
        try:
            mesh = make_mesh(cell_devs, shape)
        except ValueError as exc:
            raise CellError(f"cell {i}: {exc}") from None
        cells.append(Cell(index=i, devices=cell_devs, mesh=mesh))
    return cells


@dataclass(frozen=True)
class CellLayout:
    """How a cell's arrays are laid out, for any process (no engine needed): its parameter shardings (serving
    and training use the same rules on the same mesh) and the shardings of a KV page array."""

    cell: Cell
    param_shardings: Any  # params pytree of NamedSharding on the cell's mesh
    model_cfg: Any  # ModelConfig: the KV page shape
    rules: Any
    page_size: int

    @classmethod
    def of(cls, cell: Cell, model_cfg: Any, rules: Any, page_size: int) -> CellLayout:
        abstract = abstract_model(model_cfg)[1]
        return cls(cell, param_shardings(abstract, rules, cell.mesh), model_cfg, rules, page_size)

    def kv_pages_shardings(self, num_pages: int) -> Any:
        """``KVPages`` of ``NamedSharding``: a [num_pages, page_size, K, D] page array per layer on this cell."""
        return kv_pages_shardings(self.model_cfg, self.cell.mesh, self.rules, self.page_size, num_pages)
