"""Cells: the device list split into equal, contiguous submeshes that serve or train.

A cell is a real ``jax.sharding.Mesh`` over its own devices; tensor groups never span cells because
every cell mesh is built from one contiguous slice of the device list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
from jax.sharding import Mesh

from gyre_jax.model.sharding import make_mesh


@dataclass
class Cell:
    index: int
    devices: tuple[jax.Device, ...]
    mesh: Mesh

    @property
    def name(self) -> str:
        return f"cell{self.index}"


def make_cells(devices: Sequence[jax.Device], num_cells: int, shape: dict[str, int]) -> list[Cell]:
    """``num_cells`` cells of ``len(devices) // num_cells`` contiguous devices, each a mesh of ``shape``."""
    if num_cells < 1 or len(devices) % num_cells:
        raise ValueError(f"{len(devices)} devices cannot be split into {num_cells} equal cells")
    size = len(devices) // num_cells
    cells = []
    for i in range(num_cells):
        devs = tuple(devices[i * size : (i + 1) * size])
        cells.append(Cell(index=i, devices=devs, mesh=make_mesh(devs, shape)))
    return cells
