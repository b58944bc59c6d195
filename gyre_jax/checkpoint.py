"""Run checkpoints through orbax: the train state (params, optimizer state, step) plus JSON metadata
(policy version, data cursor, seed, what has been done), saved atomically under ``<workdir>/checkpoints``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: str | Path, max_to_keep: int = 2):
        self.directory = Path(directory).resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Writes checkpoint ``step`` and waits until it is complete on disk."""
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                           force=True)
        self._manager.wait_until_finished()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores checkpoint ``step`` onto the shardings given by ``abstract_state`` (ShapeDtypeStructs)."""
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
        )
        return restored["state"], dict(restored["meta"])

    def close(self) -> None:
        self._manager.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) mirroring a tree of arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
