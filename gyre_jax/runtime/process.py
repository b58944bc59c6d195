"""Process start-up and the control plane: ``jax.distributed`` from the config, fail-fast, host messages.

Every run calls ``initialize(config)`` once, before any JAX computation: it selects the platform and
creates this process's devices (on CPU, ``config.devices.num_cpu_devices`` virtual devices; split over the
processes of a multi-process run), and when ``config.distributed.enabled`` joins the run with
``jax.distributed.initialize`` (the config's coordinator address / process count / id, or JAX's own
detection on Slurm, Open MPI, Cloud TPU and Kubernetes; CPU runs use gloo collectives). See
``docs/multihost.md``.

- **Control plane** (``broadcast_decision``, ``sync``, ``abort``): small host-side messages through the
  run's own key-value store and barriers (``kvstore``: served by process 0, its address handed to every
  process once by a device broadcast; JAX's coordination service has no public client). They never run a
  device program, so a process waiting for process 0's next decision does not block its own devices. ``via="devices"`` uses
  ``multihost_utils.broadcast_one_to_all`` instead.
- **Fail-fast** (``watchdog.Watchdog``): when a peer stops beating, fails, or the coordinator is gone, the
  survivor prints one clear line and exits with ``PEER_LOST_EXIT_CODE`` instead of hanging in a collective;
  an uncaught exception in any process is published, so the others stop at once with its message.

Process-wide state: one ``DistributedRuntime``, made by ``initialize`` and reached by the module-level
helpers.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from gyre_jax.runtime import kvstore, lockstep, p2p
from gyre_jax.runtime.channel import HOST_ENV
from gyre_jax.runtime.watchdog import (
    FAILED_EXIT_CODE,
    FOREVER_MS,
    KV_NAMESPACE,
    PEER_LOST_EXIT_CODE,
    DistributedError,
    Watchdog,
    first_line,
    write_stderr,
)

log = logging.getLogger(__name__)

__all__ = ["PEER_LOST_EXIT_CODE", "FAILED_EXIT_CODE", "DistributedError"]

MAX_DECISION_BYTES = 1 << 20  # JSON bytes of one broadcast decision
_DEVICE_BROADCAST_CAPACITY = 4096  # bytes of a via="devices" broadcast that fit its first (fixed-shape) round


def local_cpu_device_count(config) -> int:
    """Virtual CPU devices this process creates: the run's ``num_cpu_devices`` split over its processes."""
    d = config.distributed
    n = config.devices.num_cpu_devices
    return n // d.num_processes if d.enabled and d.num_processes >= 1 else n


# -- initialization --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands in the run (single-process runs: id 0 of 1)."""

    process_id: int
    num_processes: int
    local_devices: int
    global_devices: int
    platform: str
    store_address: str = ""  # host:port of the run's control-plane store (kvstore; served by process 0)

    @property
    def is_coordinator(self) -> bool:
        return self.process_id == 0


def _backends_started() -> bool:
    """Whether JAX has created its backends (devices) already, through the public config API: a start-up-only
    option refuses a new value once they exist. The option is set back when it accepted one."""
    name = "jax_cpu_get_local_topology_timeout_minutes"
    value = getattr(jax.config, name)
    try:
        jax.config.update(name, value + 1)
    except RuntimeError:
        return True
    jax.config.update(name, value)
    return False


def _configure_platform(platform: str, cpu_devices: int) -> None:
    if _backends_started():  # e.g. a test session that created its devices already
        backend = jax.default_backend()
        if backend != platform or (platform == "cpu" and jax.local_device_count() != cpu_devices):
            raise DistributedError(
                f"JAX already started on {backend} with {jax.local_device_count()} local devices, but the config asks "
                f"for {platform}{f' with {cpu_devices} devices' if platform == 'cpu' else ''}: call "
                f"gyre_jax.runtime.initialize(config) before any JAX computation"
            )
        return
    jax.config.update("jax_platforms", platform)
    if platform == "cpu":
        jax.config.update("jax_num_cpu_devices", cpu_devices)


# What a collective (gloo on CPU), a host channel or a point-to-point pull raises when its peer is gone.
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", p2p.PULL_FAILED)


def peer_connection_lost(exc: BaseException) -> bool:
    """True when ``exc`` says a collective's connection to a peer closed (the peer died), e.g. gloo's
    ``Gloo all-reduce failed: ... Connection closed by peer [127.0.0.1]:60116``."""
    text = str(exc).lower()
    return any(marker in text for marker in _PEER_GONE)


class DistributedRuntime:
    """The process's multi-process state: its ``ProcessInfo``, the control-plane store's client, the watchdog."""

    def __init__(
        self,
        info: ProcessInfo,
        client: Any = None,
        heartbeat_timeout_s: float = 30.0,
        server: kvstore.StoreServer | None = None,
    ):
        self.info = info
        self.client = client  # the run's kvstore.StoreClient (None in a single-process run)
        self._server = server  # process 0: the store every process's client talks to
        self._decisions = 0  # decisions broadcast so far (every process counts the same)
        self._syncs = 0
        self._acked: list[int] = []  # process 0: decisions whose keys may be deleted once every reader acked
        self._closed = False
        self._previous_excepthook = None
        self.watchdog = (
            Watchdog(client, info.process_id, info.num_processes, heartbeat_timeout_s)
            if client is not None and info.num_processes > 1
            else None
        )

    @property
    def multi_process(self) -> bool:
        return self.client is not None and self.info.num_processes > 1

    # control plane ---------------------------------------------------------------------------------------
    def broadcast_decision(self, obj: Any = None, *, via: str = "kv", timeout_s: float | None = None) -> Any:
        if via not in ("kv", "devices"):
            raise ValueError(f"broadcast_decision(via={via!r}): expected 'kv' or 'devices'")
        payload, error = _encode_decision(obj) if self.info.process_id == 0 else (b"", "")
        if not self.multi_process:
            if error:
                raise DistributedError(error)
            return json.loads(payload)
        if via == "kv":
            payload, error = self._broadcast_kv(payload, error, timeout_s)
        else:
            payload, error = _broadcast_devices(payload, error)
        if error:  # raised identically on every process, so that none is left waiting in the next collective
            raise DistributedError(error)
        return json.loads(payload)

    def _broadcast_kv(self, payload: bytes, error: str, timeout_s: float | None) -> tuple[bytes, str]:
        k = self._decisions
        self._decisions += 1
        key = f"{KV_NAMESPACE}/decision/{k}"
        if self.info.process_id == 0:
            self._collect_acked()
            record = json.dumps({"error": error}).encode() if error else b"\x00" + payload
            self.client.key_value_set_bytes(f"{key}/value", record)
            self._acked.append(k)
            return payload, error
        ms = FOREVER_MS if timeout_s is None else int(timeout_s * 1000)
        try:
            record = self.client.blocking_key_value_get_bytes(f"{key}/value", ms)
        except Exception as exc:  # deadline exceeded (the coordinator is alive but slow: the watchdog covers death)
            raise DistributedError(f"no decision #{k} from process 0 within {timeout_s} s: {first_line(exc)}") from None
        self.client.key_value_increment(f"{key}/acks", 1)
        if record[:1] == b"\x00":
            return record[1:], ""
        return b"", json.loads(record)["error"]

    def _collect_acked(self) -> None:
        """Process 0 deletes the keys of earlier decisions every other process has read."""
        keep = []
        for k in self._acked:
            try:
                acks = int(self.client.key_value_try_get(f"{KV_NAMESPACE}/decision/{k}/acks"))
            except Exception:  # no reader has acked yet
                acks = 0
            if acks >= self.info.num_processes - 1:
                self.client.key_value_delete(f"{KV_NAMESPACE}/decision/{k}")
            else:
                keep.append(k)
        self._acked = keep

    def sync(self, name: str, timeout_s: float | None = None) -> None:
        if not self.multi_process:
            return
        k = self._syncs
        self._syncs += 1
        self.client.key_value_set(f"{KV_NAMESPACE}/sync/{k}/{self.info.process_id}", name, allow_overwrite=True)
        ms = FOREVER_MS if timeout_s is None else int(timeout_s * 1000)
        try:
            self.client.wait_at_barrier(f"{KV_NAMESPACE}/sync/{k}/{name}", ms)
        except Exception as exc:
            where = {}
            try:
                where = {
                    int(key.rsplit("/", 1)[1]): v
                    for key, v in self.client.key_value_dir_get(f"{KV_NAMESPACE}/sync/{k}/")
                }
            except Exception:
                pass
            others = {p: n for p, n in where.items() if n != name}
            detail = (
                f"; at their sync #{k} other processes are at {others}: a process skipped or reordered a sync"
                if others
                else "; a process is slower, hung, or took another path"
            )
            raise DistributedError(
                f"sync {name!r} (#{k} of process {self.info.process_id}) did not complete"
                f"{'' if timeout_s is None else f' within {timeout_s} s'}{detail} "
                f"({first_line(exc)})"
            ) from None

    # failure handling ------------------------------------------------------------------------------------
    def abort(self, message: str, exit_code: int = FAILED_EXIT_CODE) -> None:
        """Stops the whole run: publishes ``message`` to the other processes, prints it, exits this process."""
        write_stderr(f"error: process {self.info.process_id}: {message}")
        if self.watchdog is not None:
            self.watchdog.publish_failure(message)
            if self.info.process_id == 0:  # the control-plane store dies with us: give peers time to read it
                time.sleep(min(2 * self.watchdog.interval_s + 0.5, 5.0))
        os._exit(exit_code)

    def _excepthook(self, exc_type, exc, tb) -> None:
        (self._previous_excepthook or sys.__excepthook__)(exc_type, exc, tb)
        if self._closed or issubclass(exc_type, SystemExit):
            return
        if self.watchdog is not None and peer_connection_lost(exc):
            # A collective failed because a peer's connection closed: the peer was killed or crashed, which the
            # watchdog confirms within the heartbeat timeout and reports as a lost peer (its line, exit 75:
            # restart all). Only if it does not is this process's own failure reported (exit 1).
            time.sleep(self.watchdog.timeout_s + 2 * self.watchdog.interval_s + 1.0)
        lines = str(exc).strip().splitlines()
        self.abort(f"uncaught {exc_type.__name__}: {lines[0] if lines else ''}"[:500])

    def install(self) -> None:
        if self.watchdog is not None:
            self.watchdog.start()
            self._previous_excepthook = sys.excepthook
            sys.excepthook = self._excepthook
            atexit.register(self.shutdown)  # after jax's own atexit hook, so it runs first (atexit is LIFO)

    def shutdown(self) -> None:
        """Clean end of this process's part of the run: marks it done, stops the watchdog, leaves the service."""
        if self._closed:
            return
        lockstep.stop_all()  # the peers of a cell this process drives are done with it
        self._closed = True
        if self.watchdog is not None:
            self.watchdog.stop(done=True)
        if self._previous_excepthook is not None and sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_excepthook
        if self.client is not None:
            jax.distributed.shutdown()  # waits for every process to reach it: none needs the store after
            self.client.close()
        if self._server is not None:
            self._server.close()


_RUNTIME: DistributedRuntime | None = None  # the process's runtime once initialize() ran (see the module docstring)


def initialize(config) -> ProcessInfo:
    """Selects the platform, creates this process's devices and, if enabled, joins the multi-process run.

    Call it once, before any JAX computation. Single-process
    configs (``config.distributed.enabled`` false) only set the platform and devices. A multi-process run
    also starts this process's transfer server (``p2p.start``: cross-process moves point to point).
    """
    global _RUNTIME
    d = config.distributed  # checked with the rest of the config (gyre_jax.config.DistributedSection)
    platform = config.devices.platform
    if _RUNTIME is not None:
        raise DistributedError("gyre_jax.runtime.initialize was already called in this process")
    _configure_platform(platform, local_cpu_device_count(config))
    if not d.enabled:
        info = ProcessInfo(0, 1, jax.local_device_count(), jax.device_count(), platform)
        _RUNTIME = DistributedRuntime(info)
        return info

    _join(d, platform)
    client, server = _start_store(d)
    info = ProcessInfo(
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        platform,
        client.address,
    )
    _check_equal_local_devices(client, info)
    _RUNTIME = DistributedRuntime(info, client, float(d.heartbeat_timeout_s), server)
    _RUNTIME.install()
    p2p.start(client, info.process_id, info.num_processes, info.store_address)
    log.info(
        "distributed: process %d of %d, %d local / %d global %s devices, control-plane store %s",
        info.process_id,
        info.num_processes,
        info.local_devices,
        info.global_devices,
        platform,
        info.store_address,
    )
    return info


def _join(d, platform: str) -> None:
    """``jax.distributed.initialize`` from the ``config.distributed`` section ``d`` (or cluster detection)."""
    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # A program on one device of this process (one local device of a cell over processes) is ordered after
        # the device's last enqueued one by a read and a later write of that event, not one atomic step, so two
        # threads dispatching together (a serving loop and a training thread) can fork the chain and let two of
        # the cell's programs run at once here while its other processes run them one after the other; gloo's
        # collectives carry no tag, so they then pair the wrong messages ("65536 vs 4096"). Run such programs
        # inline on the dispatching thread instead (programs over several local devices are gang-scheduled
        # one at a time either way; XLA's flag changes only single-device ones).
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    kwargs = dict(
        coordinator_address=d.coordinator_address or None,
        num_processes=d.num_processes or None,
        process_id=None if d.process_id < 0 else d.process_id,
        local_device_ids=list(d.local_device_ids) or None,
        initialization_timeout=int(d.initialization_timeout_s),
        # JAX's own heartbeat is the backstop; ours (the Watchdog) fires first and says what happened.
        heartbeat_timeout_seconds=int(2 * float(d.heartbeat_timeout_s) + 10),
        shutdown_timeout_seconds=int(d.shutdown_timeout_s),
    )
    try:
        jax.distributed.initialize(**kwargs)
    except ValueError as exc:  # nothing given and no cluster environment detected
        raise DistributedError(
            f"jax.distributed.initialize could not determine the run's processes ({exc}): set "
            f"config.distributed.coordinator_address=HOST:PORT, num_processes and process_id, or launch under "
            f"Slurm (srun), Open MPI (mpirun) or on a Cloud TPU VM so that JAX detects them"
        ) from None
    except Exception as exc:  # e.g. the coordinator never came up within initialization_timeout_s
        raise DistributedError(
            f"joining the run as process {kwargs['process_id']} of {kwargs['num_processes']} via "
            f"{kwargs['coordinator_address'] or 'auto-detection'} failed: {first_line(exc)} (is process 0 running "
            f"and reachable? config.distributed.initialization_timeout_s={d.initialization_timeout_s})"
        ) from None


def _start_store(d) -> tuple[kvstore.StoreClient, kvstore.StoreServer | None]:
    """Process 0 serves the run's control-plane store; every process learns its address and a random secret
    from one device broadcast (a public collective, so only the run's own processes receive them) and
    connects. Call it on every process, right after ``jax.distributed.initialize``."""
    server, payload = None, b""
    if jax.process_index() == 0:
        host = _store_host(d)
        secret = secrets.token_bytes(32)
        loopback = host in ("127.0.0.1", "localhost", "::1")
        server = kvstore.StoreServer(kvstore.Store(jax.process_count()), secret, "127.0.0.1" if loopback else "")
        payload = json.dumps({"address": f"{host}:{server.port}", "secret": secret.hex()}).encode()
    data, _ = _broadcast_devices(payload, "")
    record = json.loads(data)
    return kvstore.StoreClient(record["address"], bytes.fromhex(record["secret"]), jax.process_index()), server


def _store_host(d) -> str:
    """The name other processes reach process 0 at: ``$GYRE_HOST_ADDRESS``, else the coordinator's host (from
    the config or ``$JAX_COORDINATOR_ADDRESS``: process 0 runs the coordinator), else this host's name (the
    way Slurm and MPI launches name it)."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    coordinator = d.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
    if coordinator:
        return coordinator.rsplit(":", 1)[0].strip("[]")
    return socket.gethostname()


def _check_equal_local_devices(client, info: ProcessInfo) -> None:
    """Cells and meshes assume every host has the same number of devices; say so on every process if not."""
    client.key_value_set(
        f"{KV_NAMESPACE}/local_devices/{info.process_id}", str(info.local_devices), allow_overwrite=True
    )
    client.wait_at_barrier(f"{KV_NAMESPACE}/local_devices", FOREVER_MS)
    counts = {int(k.rsplit("/", 1)[1]): int(v) for k, v in client.key_value_dir_get(f"{KV_NAMESPACE}/local_devices/")}
    if len(set(counts.values())) != 1:
        raise DistributedError(
            f"processes have different numbers of local devices {dict(sorted(counts.items()))}: "
            f"every host must contribute the same number (set config.distributed.local_device_ids "
            f"or launch the same number of processes per host)"
        )


def runtime() -> DistributedRuntime:
    """The process's runtime; a single-process one if ``initialize`` was never called (tests, notebooks)."""
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = DistributedRuntime(
            ProcessInfo(
                jax.process_index(),
                jax.process_count(),
                jax.local_device_count(),
                jax.device_count(),
                jax.default_backend(),
            )
        )
    return _RUNTIME


def is_coordinator() -> bool:
    """True on process 0: the process that runs the proxy, the executor, the records and the scheduler."""
    return jax.process_index() == 0


def broadcast_decision(obj: Any = None, *, via: str = "kv", timeout_s: float | None = None) -> Any:
    """Process 0's ``obj`` (JSON-able: a scheduling decision), returned identically on every process.

    Every process must call it at the same point of the program, from one thread (the n-th call on each
    process carries process 0's n-th decision); the argument of other processes is ignored. The value is the JSON round
    trip of ``obj`` on every process, process 0 included (tuples become lists, dict keys strings), so all
    act on exactly the same data. A value that is not JSON-able or is larger than ``MAX_DECISION_BYTES``
    raises ``DistributedError`` on every process.

    ``via="kv"`` (default): through the run's key-value store (``kvstore``); waiting for it runs
    nothing on the devices. ``via="devices"``: ``multihost_utils.broadcast_one_to_all`` on a uint8 array
    with a length prefix, a collective over every device of every process (which also waits for the
    devices' queued work and blocks them until process 0 joins). ``timeout_s`` bounds the wait (kv only).
    """
    return runtime().broadcast_decision(obj, via=via, timeout_s=timeout_s)


def sync(name: str, timeout_s: float | None = None) -> None:
    """Barrier: returns once every process reached its own ``sync`` with this ``name`` (host-side only).

    Like ``broadcast_decision``, call it from one thread: the n-th sync of every process meets the others' n-th.

    Processes at different names (a skipped or reordered sync) or a process that never arrives make it
    raise ``DistributedError`` after ``timeout_s`` (or wait until the watchdog sees a dead peer).
    """
    runtime().sync(name, timeout_s)


def abort(message: str, exit_code: int = FAILED_EXIT_CODE) -> None:
    """Stops the whole run from any process: every process exits, printing ``message``."""
    runtime().abort(message, exit_code)


def add_failure_hook(fn: Callable[[], None]) -> None:
    """``fn()`` runs (bounded, best effort) before this process exits because a peer died or failed.

    Process 0 registers the executor's kill of the harness process groups here, so no harness outlives
    the run. Hooks must not touch JAX (the collectives may be broken).
    """
    rt = runtime()
    if rt.watchdog is not None:
        rt.watchdog.hooks.append(fn)


def shutdown() -> None:
    """Clean end (call after the last collective); also runs at interpreter exit."""
    if _RUNTIME is not None:
        _RUNTIME.shutdown()


def _encode_decision(obj: Any) -> tuple[bytes, str]:
    try:
        payload = json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        return (
            b"",
            f"broadcast_decision: process 0's value is not JSON-able ({exc}); send plain dicts/lists/str/numbers",
        )
    if len(payload) > MAX_DECISION_BYTES:
        return b"", (
            f"broadcast_decision: process 0's value is {len(payload)} bytes as JSON, more than "
            f"{MAX_DECISION_BYTES}: decisions are small control messages; send data through the devices"
        )
    return payload, ""


def _broadcast_devices(payload: bytes, error: str) -> tuple[bytes, str]:
    """Length-prefixed uint8 broadcast from process 0 over all devices (``multihost_utils``).

    Round 1: a fixed ``[_DEVICE_BROADCAST_CAPACITY]`` uint8 array, header int64 ``length`` (``-len`` of
    an error message) + body; round 2 only when the body did not fit: ``[next power of two]`` uint8.
    Fixed shapes keep the number of compiled programs small.
    """
    from jax.experimental import multihost_utils

    body = error.encode() if error else payload
    length = -len(body) if error else len(body)
    first = np.zeros(_DEVICE_BROADCAST_CAPACITY, np.uint8)
    first[:8] = np.frombuffer(np.int64(length).tobytes(), np.uint8)
    head = body[: _DEVICE_BROADCAST_CAPACITY - 8]
    first[8 : 8 + len(head)] = np.frombuffer(head, np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(first))
    n = int(np.frombuffer(got[:8].tobytes(), np.int64)[0])
    size = abs(n)
    if size <= _DEVICE_BROADCAST_CAPACITY - 8:
        data = got[8 : 8 + size].tobytes()
    else:
        second = np.zeros(1 << (size - 1).bit_length(), np.uint8)
        second[: len(body)] = np.frombuffer(body, np.uint8) if body else second[:0]
        data = np.asarray(multihost_utils.broadcast_one_to_all(second))[:size].tobytes()
    return (b"", data.decode()) if n < 0 else (data, "")
