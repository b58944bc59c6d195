"""Gradient accumulation for one optimizer step, on the core cell's parameter shardings.

Gradients may arrive from any mesh (the core's or a satellite's) in any order; each is moved onto the
core's shardings (``jax.device_put``: device to device) and summed in float32. With ``ordered=True``
(the default) they are added in slot-index order whatever order they arrive in (an early arrival waits
in a small buffer until the slots before it are in or known empty), so the sum is bit-for-bit the same
for every claim order and split of work among cells that computed the same gradients. ``ordered=False``
adds on arrival (no buffer; equal to float tolerance).

Metrics of each micro-step (``[]`` arrays) are kept as they are and summed on the host, in slot order,
once the step is complete (no device sync per micro-step).
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _to_f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != jnp.float32 else x


# Module-level jits (compiled once per tree structure and sharding): both inputs are on the core's
# shardings, and elementwise ops keep them, so the sum stays there.
_start_sum = jax.jit(lambda grads: jax.tree.map(lambda g: _to_f32(g) + 0, grads))  # a fresh buffer we may donate
_add_into = jax.jit(lambda total, grads: jax.tree.map(lambda t, g: t + _to_f32(g), total, grads), donate_argnums=(0,))


class GradAccumulator:
    """Sums the gradients of slots 0..num_slots-1 onto ``shardings`` (a pytree of NamedSharding)."""

    def __init__(self, shardings, num_slots: int, ordered: bool = True):
        self.shardings = shardings
        self.num_slots = num_slots
        self.ordered = ordered
        self._lock = threading.Lock()
        self._total = None
        self._pending: dict[int, Any] = {}  # ordered mode: arrived early, waiting for lower slots
        self._status = ["missing"] * num_slots  # missing | added | empty
        self._aux: dict[int, dict] = {}
        self._next = 0

    def add(self, index: int, grads, aux: dict | None = None) -> None:
        """Slot ``index``'s gradients (on any mesh) and metrics."""
        grads = jax.device_put(grads, self.shardings)  # cross-mesh: device to device; same mesh: no copy
        with self._lock:
            if not 0 <= index < self.num_slots or self._status[index] != "missing" or index in self._pending:
                raise ValueError(f"slot {index} already added, or outside [0, {self.num_slots})")
            self._aux[index] = aux or {}
            if self.ordered:
                self._pending[index] = grads
                self._flush_locked()
            else:
                self._status[index] = "added"
                self._accumulate_locked(grads)

    def mark_empty(self, index: int) -> None:
        """Slot ``index`` will never have gradients (the step's data ran out before it)."""
        with self._lock:
            if self._status[index] != "missing" or index in self._pending:
                raise ValueError(f"slot {index} has gradients; it cannot be empty")
            self._status[index] = "empty"
            if self.ordered:
                self._flush_locked()

    @property
    def buffered(self) -> int:
        """Gradients waiting in the ordered-mode buffer (a memory gauge: each is one params-sized tree)."""
        with self._lock:
            return len(self._pending)

    def result(self) -> tuple[Any, dict[str, float], int]:
        """(summed grads, summed metrics in float64, number of slots with gradients). Every slot must be
        added or marked empty."""
        with self._lock:
            missing = [i for i, s in enumerate(self._status) if s == "missing"]
            if missing:
                raise ValueError(f"slots {missing} have neither gradients nor an empty mark; the step is not complete")
            if self._total is None:
                raise ValueError("no micro-step of this step produced gradients (every slot is empty)")
            host_aux = jax.device_get([self._aux[i] for i in sorted(self._aux)])
            totals: dict[str, float] = {}
            for aux in host_aux:
                for k, v in aux.items():
                    totals[k] = totals.get(k, 0.0) + float(np.asarray(v, np.float64))
            return self._total, totals, len(self._aux)

    # -- internals --------------------------------------------------------------------------------
    def _flush_locked(self) -> None:
        while self._next < self.num_slots:
            if self._status[self._next] == "empty":
                self._next += 1
            elif self._next in self._pending:
                self._accumulate_locked(self._pending.pop(self._next))
                self._status[self._next] = "added"
                self._next += 1
            else:
                return

    def _accumulate_locked(self, grads) -> None:
        self._total = _start_sum(grads) if self._total is None else _add_into(self._total, grads)
