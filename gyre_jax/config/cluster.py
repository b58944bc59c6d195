"""Config sections of where a run computes: ``devices``, the training ``mesh``, the ``cells``, ``distributed``.

Each section checks its own values; how they fit together (mesh size = devices, cells split the mesh,
processes split the CPU devices) is checked by ``gyre_jax.config.run.validate``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre_jax.config.base import Section, require
from gyre_jax.model.rules import ALL_MESH_AXES, CONTEXT_AXIS, EXPERT_AXIS, MESH_AXES

PLATFORMS = ("cpu", "gpu", "tpu")
OPTIONAL_MESH_AXES = (EXPERT_AXIS,)  # size 1 by default: MoE experts are split over it when > 1
AXES = ALL_MESH_AXES


@dataclass(frozen=True)
class DevicesSection(Section):
    """The platform; on CPU, the virtual devices created before JAX starts (the run's total)."""

    _path = "devices"
    platform: str = "cpu"  # cpu | gpu | tpu
    # 2: the default tiny run on a laptop; more virtual devices on a 2-core machine only add per-device overhead
    # (tests and configs that exercise multi-device cells set 8: 2 cells of 4)
    num_cpu_devices: int = 2
    # memory of one accelerator in GiB: the budget `python -m gyre_jax.plan` checks the cells against (0: unknown)
    memory_gib: float = 0.0

    def __post_init__(self):
        self.check_types()
        require(self.platform in PLATFORMS, f"config.devices.platform={self.platform!r} must be one of {PLATFORMS}")
        require(self.num_cpu_devices >= 1, f"config.devices.num_cpu_devices={self.num_cpu_devices} must be >= 1")
        require(self.memory_gib >= 0, f"config.devices.memory_gib={self.memory_gib} must be >= 0 (0: unknown)")


@dataclass(frozen=True)
class _Axes(Section):
    """A mesh's axis sizes (``data``, ``fsdp``, ``tensor``; ``expert`` when > 1)."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1  # MoE experts split over it (1: the mesh has no expert axis)

    def __post_init__(self):
        self.check_types()
        for axis in AXES:
            require(getattr(self, axis) >= 1, f"config.{self.key(axis)}={getattr(self, axis)} must be >= 1")

    @property
    def num_devices(self) -> int:
        return self.data * self.fsdp * self.tensor * self.expert

    def shape(self, context: int = 1) -> dict[str, int]:
        """The mesh shape for ``make_mesh``: ``{data, fsdp, tensor}``, plus ``expert`` when it is > 1. With
        ``context`` > 1 (``model.context_parallel``) a ``context`` axis of that size is carved out of ``data``
        (``data / context`` rows of context shards; ``run.validate`` checks that it divides)."""
        out = {a: getattr(self, a) for a in AXES if a in MESH_AXES or getattr(self, a) > 1}
        if context > 1:
            out["data"] //= context
            out[CONTEXT_AXIS] = context
        return out


@dataclass(frozen=True)
class MeshSection(_Axes):
    """The training mesh over all devices (axis sizes multiply to the device count)."""

    _path = "mesh"
    data: int = 2


@dataclass(frozen=True)
class CellsSection(_Axes):
    """The device list split into ``num_cells`` equal, contiguous cells; each serves with this mesh."""

    _path = "cells"
    num_cells: int = 2
    sessions_per_cell: int = 0  # executions a serving cell holds at once (0 = serving.max_concurrent_decodes)

    def __post_init__(self):
        super().__post_init__()
        require(self.num_cells >= 1, f"config.cells.num_cells={self.num_cells} must be >= 1")
        require(
            self.sessions_per_cell >= 0,
            f"config.cells.sessions_per_cell={self.sessions_per_cell} must be >= 0 (0 = serving.max_concurrent_decodes)",
        )


@dataclass(frozen=True)
class DistributedSection(Section):
    """Multi-process runs (docs/multihost.md): ``jax.distributed`` from these keys, or auto-detected (Slurm, TPU)."""

    _path = "distributed"
    enabled: bool = False  # True: this is one of num_processes processes of one run (jax.distributed)
    coordinator_address: str = ""  # "host:port" of process 0; "" = JAX_COORDINATOR_ADDRESS or cluster auto-detection
    num_processes: int = 0  # 0 = auto-detect (Slurm / Open MPI / Cloud TPU); required on cpu
    process_id: int = -1  # -1 = auto-detect
    local_device_ids: tuple[int, ...] = ()  # GPU ids this process uses; () = all visible (one process per host)
    initialization_timeout_s: float = 300.0  # how long processes wait for each other at start
    heartbeat_timeout_s: float = 30.0  # a peer silent this long is declared dead and every process exits
    shutdown_timeout_s: float = 60.0  # how long a finishing process waits for the others at the end

    def __post_init__(self):
        self.check_types()
        if self.coordinator_address:
            host, sep, port = self.coordinator_address.rpartition(":")
            require(
                bool(sep) and bool(host) and port.isdigit() and 0 < int(port) < 65536,
                f"config.distributed.coordinator_address={self.coordinator_address!r} must be 'host:port' with a "
                f"port in [1, 65535] (the address of process 0), or '' to auto-detect",
            )
        n, pid = self.num_processes, self.process_id
        require(n >= 0, f"config.distributed.num_processes={n} must be >= 1, or 0 to auto-detect")
        require(pid >= -1, f"config.distributed.process_id={pid} must be >= 0, or -1 to auto-detect")
        require(
            n < 1 or pid < n,
            f"config.distributed.process_id={pid} must be < num_processes={n} (ids are 0 .. N-1)",
        )
        ids = self.local_device_ids
        require(
            all(i >= 0 for i in ids) and len(set(ids)) == len(ids),
            f"config.distributed.local_device_ids={ids!r} must be distinct device ids >= 0, or () for all",
        )
        for key in ("initialization_timeout_s", "heartbeat_timeout_s", "shutdown_timeout_s"):
            value = getattr(self, key)
            require(value >= 1, f"config.distributed.{key}={value!r} must be a number of seconds >= 1")
        require(
            self.enabled or (n in (0, 1) and pid in (-1, 0)),
            f"config.distributed.num_processes={n}, process_id={pid} describe a multi-process run but "
            f"config.distributed.enabled is false; set enabled=true",
        )
