"""Point-to-point array moves between processes (``jax.experimental.transfer``): the sending process offers
the arrays under a number, the receiving one pulls them onto its devices. No program runs on both sides, so
nothing waits in a collective and the bytes cross once.

Every process starts one transfer server at ``initialize`` (``start``) and publishes its address in the
run's control-plane store (``kvstore``); a process pulls from a peer's server over a connection it opens
on first use. A move (``runtime.transfer`` with a ``uuid``) sends, per destination position, the distinct
shards that position needs packed into one ``uint8`` buffer (``pack``), pulls each onto the destination
device at the same mesh position, and unpacks there (``unpack``); a shard that several destination devices
hold (replicated leaves) crosses once and is copied within the destination process.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from gyre_jax.runtime.channel import local_address
from gyre_jax.runtime.watchdog import FOREVER_MS, KV_NAMESPACE, DistributedError, first_line

log = logging.getLogger(__name__)

MODE_ENV = "GYRE_TRANSFER"  # "p2p" (default) or "programs" (the jitted program over both cells; every process alike)
PULL_FAILED = "point-to-point pull failed"  # a lost peer looks like this (process.peer_connection_lost)
Layout = tuple[tuple[tuple[int, ...], Any], ...]  # per piece: (shard shape, dtype)


class _State:
    def __init__(self):
        self.server: Any = None
        self.addresses: dict[int, str] = {}
        self.connections: dict[int, Any] = {}
        self.lock = threading.Lock()
        self.reason = "not started (single process, or initialize was not called)"


_STATE = _State()


def start(client: Any, process_id: int, num_processes: int, store_address: str) -> bool:
    """Starts this process's transfer server and agrees with every other process whether moves go point to
    point (all started one) or by programs (any could not, or ``$GYRE_TRANSFER=programs``). Every process
    calls it once, at the same point of ``initialize``. Returns whether point-to-point moves are on."""
    mine = "off: $GYRE_TRANSFER=programs"
    if os.environ.get(MODE_ENV, "p2p") != "programs":
        try:
            from jax.experimental import transfer as jax_transfer

            host = local_address(store_address)
            backend = jax.local_devices()[0].client
            _STATE.server = jax_transfer.start_transfer_server(backend, f"{host}:0", [f"{host}:0"])
            mine = "ok " + _STATE.server.address()
        except Exception as exc:  # noqa: BLE001 - e.g. a backend without transfer support
            mine = f"off: process {process_id} could not start a transfer server: {first_line(exc)}"
    client.key_value_set(f"{KV_NAMESPACE}/xfer/{process_id}", mine, allow_overwrite=True)
    entries = {p: client.blocking_key_value_get(f"{KV_NAMESPACE}/xfer/{p}", FOREVER_MS) for p in range(num_processes)}
    off = [e for e in entries.values() if not e.startswith("ok ")]
    if off:
        _STATE.addresses, _STATE.reason = {}, off[0][len("off: ") :]
        log.warning("cross-process moves use programs, not point-to-point transfers: %s", _STATE.reason)
        return False
    _STATE.addresses, _STATE.reason = {p: e[3:] for p, e in entries.items()}, ""
    return True


def enabled() -> bool:
    """Whether cross-process moves go point to point (every process of the run started a transfer server)."""
    return bool(_STATE.addresses)


def _connection(process: int) -> Any:
    with _STATE.lock:
        if process not in _STATE.connections:
            _STATE.connections[process] = _STATE.server.connect(_STATE.addresses[process])
        return _STATE.connections[process]


def owner(mesh: Mesh) -> int | None:
    """The one process holding every device of ``mesh``, or None when it spans processes."""
    processes = {d.process_index for d in mesh.devices.flat}
    return processes.pop() if len(processes) == 1 else None


# -- the plan both sides compute ---------------------------------------------------------------------------
def _key(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _primaries(shape: tuple[int, ...], target: NamedSharding) -> dict[Any, tuple[int, tuple[int, ...]]]:
    """Each distinct shard of a leaf on ``target``: its index -> (first mesh position holding it, its shape)."""
    indices = target.devices_indices_map(tuple(shape))
    out: dict[Any, tuple[int, tuple[int, ...]]] = {}
    for k, d in enumerate(target.mesh.devices.flat):
        key = _key(indices[d], shape)
        if key not in out:
            out[key] = (k, tuple(b - a for a, b in key))
    return out


def plan(leaves: Sequence[Any], targets: Sequence[NamedSharding]) -> dict[int, list[tuple[int, Any, tuple, Any]]]:
    """Mesh position -> the pieces sent from there: ``(leaf, shard index, shard shape, dtype)`` in order."""
    by_position: dict[int, list] = defaultdict(list)
    for i, (x, target) in enumerate(zip(leaves, targets)):
        for key, (k, shape) in _primaries(tuple(x.shape), target).items():
            by_position[k].append((i, key, shape, jnp.dtype(x.dtype)))
    return dict(sorted(by_position.items()))


def _as_bytes(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


@jax.jit
def pack(shards: tuple) -> jax.Array:
    """Shards on one device -> one ``uint8[sum of their bytes]`` buffer there (their bytes, in order)."""
    return jnp.concatenate([_as_bytes(x) for x in shards])


@functools.lru_cache(maxsize=256)
def unpack(layout: Layout, out_shardings: tuple | None = None):
    """A jitted ``uint8[n] -> tuple of shards`` (shapes and dtypes as in ``layout``), inverse of ``pack``;
    with ``out_shardings``, its outputs are laid out so (one per piece)."""

    def split(flat):
        out, offset = [], 0
        for shape, dtype in layout:
            dtype = jnp.dtype(dtype)
            width = 1 if dtype == jnp.bool_ else dtype.itemsize
            n = int(np.prod(shape)) * width
            raw = flat[offset : offset + n]
            offset += n
            if dtype == jnp.bool_:
                out.append(raw.reshape(shape) != 0)
            elif width == 1:
                out.append(jax.lax.bitcast_convert_type(raw.reshape(shape), dtype))
            else:
                out.append(jax.lax.bitcast_convert_type(raw.reshape(tuple(shape) + (width,)), dtype))
        return tuple(out)

    return jax.jit(split, out_shardings=out_shardings)


def _nbytes(pieces: list) -> int:
    return sum(int(np.prod(shape)) * (1 if dt == jnp.bool_ else dt.itemsize) for _, _, shape, dt in pieces)


# -- the two sides ---------------------------------------------------------------------------------------
def send(leaves: list[jax.Array], targets: list[NamedSharding], src: Mesh, uuid: int) -> None:
    """Offers ``leaves`` (on ``src``, held by this process) for the pull of move ``uuid`` onto ``targets``
    (a mesh of another process with ``src``'s shape): returns at once; the buffers live until pulled."""
    positions = plan(leaves, targets)
    here: list[dict] = []
    for x, target in zip(leaves, targets):
        laid = NamedSharding(src, target.spec)  # the destination's layout, on our devices (a local move)
        y = x if x.sharding.is_equivalent_to(laid, x.ndim) else jax.device_put(x, laid)
        here.append({s.device: s.data for s in y.addressable_shards})
    flat_src = list(src.devices.flat)
    buffers = []
    for k, pieces in positions.items():
        device = flat_src[k]
        shards = tuple(here[i][device] for i, _, _, _ in pieces)
        buffers.append(pack(shards) if _nbytes(pieces) else jnp.zeros((0,), jnp.uint8, device=device))
    _STATE.server.await_pull(uuid, buffers)


def receive(leaves: list[Any], targets: list[NamedSharding], source: int, uuid: int) -> list[jax.Array]:
    """Pulls move ``uuid`` from process ``source`` onto ``targets`` (this process's mesh); ``leaves`` give
    shapes and dtypes. Returns one array per leaf on its target."""
    positions = plan(leaves, targets)
    dst = targets[0].mesh
    flat_dst = list(dst.devices.flat)
    local = [d for d in flat_dst if d.process_index == jax.process_index()]
    wanted = [
        jax.ShapeDtypeStruct((_nbytes(pieces),), jnp.uint8, sharding=SingleDeviceSharding(flat_dst[k]))
        for k, pieces in positions.items()
    ]
    try:
        flats = _connection(source).pull(uuid, wanted)
    except Exception as exc:  # noqa: BLE001 - the peer may be gone: the watchdog tells
        raise DistributedError(f"{PULL_FAILED}: move {uuid} from process {source}: {first_line(exc)}") from None
    if len(positions) == 1 and all(t.is_fully_replicated for t in targets) and all(d in local for d in flat_dst):
        # every leaf whole on every device (e.g. weights under replicated rules): one local broadcast of the
        # buffer and one program that unpacks it straight onto the targets
        everywhere = jax.device_put(flats[0], NamedSharding(dst, PartitionSpec()))
        (pieces,) = positions.values()
        return list(unpack(tuple((shape, dt.name) for _, _, shape, dt in pieces), tuple(targets))(everywhere))
    by_position = dict(zip(positions, flats))
    indices = [t.devices_indices_map(tuple(x.shape)) for x, t in zip(leaves, targets)]
    primaries = [_primaries(tuple(x.shape), t) for x, t in zip(leaves, targets)]
    unpacked: dict[tuple[int, Any], dict[Any, jax.Array]] = {}  # (position, device) -> {(leaf, key): shard}

    def shard(i: int, device) -> jax.Array:
        key = _key(indices[i][device], tuple(leaves[i].shape))
        k = primaries[i][key][0]
        if (k, device) not in unpacked:
            flat = by_position[k]
            flat = flat if flat_dst[k] == device else jax.device_put(flat, device)
            pieces = positions[k]
            layout = tuple((shape, dt.name) for _, _, shape, dt in pieces)
            parts = unpack(layout)(flat)
            unpacked[(k, device)] = {(j, key_j): part for (j, key_j, _, _), part in zip(pieces, parts)}
        return unpacked[(k, device)][(i, key)]

    out = []
    for i, (x, target) in enumerate(zip(leaves, targets)):
        arrays = [shard(i, d) for d in local]
        out.append(jax.make_array_from_single_device_arrays(tuple(x.shape), target, arrays, dtype=x.dtype))
    return out
