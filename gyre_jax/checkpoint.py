"""Run checkpoints through orbax: the train state (params, optimizer state, step) plus JSON metadata
(policy version, data cursor, seed, what has been done), saved atomically under ``<workdir>/checkpoints``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from gyre_jax.disk import DiskFull, is_disk_full
from gyre_jax.faultpoints import kill_point
from gyre_jax.progress import Progress

PROGRESS_DELAY_S = 2.0  # a checkpoint written faster than this shows no progress


class Checkpointer:
    """``primary_only``: in a multi-process run, only process 0 saves and restores (its state lives on its own
    devices: the core cell); the other processes take no part. ``processes``: the processes that hold the state
    (a core cell over several hosts), which all save and restore together, each writing its own shards (the first
    is the primary); ``(0,)`` is ``primary_only``. Otherwise every process writes its shards."""

    def __init__(
        self,
        directory: str | Path,
        max_to_keep: int = 2,
        primary_only: bool = False,
        processes: tuple[int, ...] | None = None,
    ):
        self.directory = Path(directory).resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        extra = {}
        processes = (0,) if primary_only and processes is None else processes
        # Orbax refuses arrays held by one process of several ("host local"): process 0 saves a host copy
        # (same on-disk arrays; ``restore`` puts them back on the given shardings).
        self._host_copy = processes is not None and len(processes) == 1 and jax.process_count() > 1
        if processes is not None and jax.process_count() > 1:  # barriers in the key-value store, not on devices
            extra["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
                primary_host=processes[0],
                active_processes=set(processes),
                barrier_sync_key_prefix="core" + "-".join(map(str, processes)),
            )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=not extra,  # made above
            enable_async_checkpointing=False,
            **extra,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
        self._last_save_s: float | None = None  # the last save's duration: the next one's time left

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Writes checkpoint ``step`` and waits until it is complete on disk (with progress when it lasts: its size,
        and the last save's duration as the time left)."""
        kill_point("checkpoint")
        size = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(state))
        progress = Progress(f"checkpoint {step} ({size / 2**20:.1f} MiB)", delay_s=PROGRESS_DELAY_S,
                            estimate_s=self._last_save_s)  # fmt: skip
        t0 = time.perf_counter()
        try:
            if self._host_copy:
                state = jax.device_get(state)
            self._manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                force=True,
            )
            self._manager.wait_until_finished()
        except Exception as exc:
            progress.close("failed")
            if is_disk_full(exc):  # orbax never finalized it: ``latest_step`` does not see it
                raise DiskFull(self.directory / str(step)) from exc
            raise
        progress.close()
        self._last_save_s = time.perf_counter() - t0

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores checkpoint ``step`` onto the shardings given by ``abstract_state`` (ShapeDtypeStructs)."""
        target = abstract_state
        if self._host_copy:
            target = jax.tree.map(lambda a: np.empty(a.shape, a.dtype), abstract_state)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        )
        state = restored["state"]
        if self._host_copy:
            state = jax.device_put(state, jax.tree.map(lambda a: a.sharding, abstract_state))
        return state, dict(restored["meta"])

    def saved_paths(self, step: int) -> list[tuple[str, ...]]:
        """The key path of every array of checkpoint ``step``'s state, from its metadata (no array is read)."""
        saved = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "state").tree
        leaves = jax.tree_util.tree_flatten_with_path(saved)[0]
        return [tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path) for path, _ in leaves]

    def restore_as_saved(self, step: int) -> tuple[Any, dict]:
        """Restores checkpoint ``step`` as host numpy arrays of the saved shapes and dtypes, without the model
        (``gyre_jax.audit`` checks a run directory with it): every array is read back, not only its metadata."""
        path = self.directory / str(step)
        with ocp.StandardCheckpointer() as arrays:
            saved = arrays.metadata(path / "state").item_metadata.tree
            one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), saved)
            state = jax.tree.map(np.asarray, arrays.restore(path / "state", target))
        with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as json_item:
            meta = json_item.restore(path / "meta")
        return state, dict(meta)

    def close(self) -> None:
        self._manager.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) mirroring a tree of arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
