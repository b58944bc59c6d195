"""Multi-process runs: ``jax.distributed`` from the config, the control plane, fail-fast, cells over hosts.

This module owns everything that changes when a run spans processes (one per host on a GPU cluster or a
TPU pod, or several on one machine with virtual CPU devices):

- **Initialization** (``initialize``): platform and per-process devices, then ``jax.distributed.initialize``
  with the config's coordinator address / process count / process id, or with none of them so that JAX
  detects its cluster (Slurm, Open MPI, Cloud TPU, Kubernetes; see ``docs/multihost.md``). CPU runs use
  gloo collectives. ``config.devices.num_cpu_devices`` is the run's total: each of N processes creates
  ``num_cpu_devices / N`` virtual devices.
- **Control plane** (``broadcast_decision``, ``sync``, ``abort``): small host-side messages through the
  JAX coordination service's key-value store and barriers. They never run a device program, so a process
  waiting for process 0's next decision does not block its own devices (a device broadcast would: see
  ``docs/multihost.md``). ``via="devices"`` uses ``multihost_utils.broadcast_one_to_all`` instead.
- **Fail-fast** (``Watchdog``): every process publishes a heartbeat and its state (running / done / failed)
  in the key-value store; when a peer stops beating, fails, or the coordinator is gone, the survivor prints
  one clear line and exits with ``PEER_LOST_EXIT_CODE`` instead of hanging in a collective. An uncaught
  exception in any process is published, so the others stop at once with its message.
- **Cells over hosts** (``make_global_mesh``, ``make_global_cells``): devices ordered by
  ``(process_index, id)``; a cell is a set of whole hosts or a part of one host, never a scattered set.
- **Moving arrays between meshes that span processes** (``publish_to_cells``, ``cell_put``): cross-process
  ``jax.device_put`` between different device sets is not supported on every backend (not on CPU), so
  both are one jitted program over the union of the devices, whose output shards are re-wrapped, without a
  copy, as arrays on the destination meshes.

Process-wide state: one ``DistributedRuntime`` (like ``jax._src.distributed.global_state``), made by
``initialize`` and reached by the module-level helpers.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.elastic.cells import Cell
from gyre_jax.model.sharding import make_mesh

log = logging.getLogger(__name__)

PEER_LOST_EXIT_CODE = 75  # EX_TEMPFAIL: another process died or failed; restart all to resume from the checkpoint
FAILED_EXIT_CODE = 1  # this process raised (its traceback is on stderr) or called abort()
MAX_DECISION_BYTES = 1 << 20  # JSON bytes of one broadcast decision
_DEVICE_BROADCAST_CAPACITY = 4096  # bytes of a via="devices" broadcast that fit its first (fixed-shape) round
_KEY = "gyre"  # key-value store namespace
_FOREVER_MS = 2**31 - 1  # ~24.8 days: "no timeout" for coordination-service waits


class DistributedError(RuntimeError):
    """A multi-process setup or control-plane problem. The message says what was wrong and what to do."""


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
    coordinator_address: str = ""

    @property
    def is_coordinator(self) -> bool:
        return self.process_id == 0


def _configure_platform(platform: str, cpu_devices: int) -> None:
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():  # e.g. a test session that created its devices already
        backend = jax.default_backend()
        if backend != platform or (platform == "cpu" and jax.local_device_count() != cpu_devices):
            raise DistributedError(
                f"JAX already started on {backend} with {jax.local_device_count()} local devices, but the config asks "
                f"for {platform}{f' with {cpu_devices} devices' if platform == 'cpu' else ''}: call "
                f"gyre_jax.distributed.initialize(config) before any JAX computation"
            )
        return
    jax.config.update("jax_platforms", platform)
    if platform == "cpu":
        jax.config.update("jax_num_cpu_devices", cpu_devices)


class DistributedRuntime:
    """The process's multi-process state: its ``ProcessInfo``, the coordination client, the watchdog."""

    def __init__(self, info: ProcessInfo, client: Any = None, heartbeat_timeout_s: float = 30.0):
        self.info = info
        self.client = client  # jax's DistributedRuntimeClient (None in a single-process run)
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
        key = f"{_KEY}/decision/{k}"
        if self.info.process_id == 0:
            self._collect_acked()
            record = json.dumps({"error": error}).encode() if error else b"\x00" + payload
            self.client.key_value_set_bytes(f"{key}/value", record)
            self._acked.append(k)
            return payload, error
        ms = _FOREVER_MS if timeout_s is None else int(timeout_s * 1000)
        try:
            record = self.client.blocking_key_value_get_bytes(f"{key}/value", ms)
        except Exception as exc:  # deadline exceeded (the coordinator is alive but slow: the watchdog covers death)
            raise DistributedError(
                f"no decision #{k} from process 0 within {timeout_s} s: {_first_line(exc)}"
            ) from None
        self.client.key_value_increment(f"{key}/acks", 1)
        if record[:1] == b"\x00":
            return record[1:], ""
        return b"", json.loads(record)["error"]

    def _collect_acked(self) -> None:
        """Process 0 deletes the keys of earlier decisions every other process has read."""
        keep = []
        for k in self._acked:
            try:
                acks = int(self.client.key_value_try_get(f"{_KEY}/decision/{k}/acks"))
            except Exception:  # no reader has acked yet
                acks = 0
            if acks >= self.info.num_processes - 1:
                self.client.key_value_delete(f"{_KEY}/decision/{k}")
            else:
                keep.append(k)
        self._acked = keep

    def sync(self, name: str, timeout_s: float | None = None) -> None:
        if not self.multi_process:
            return
        k = self._syncs
        self._syncs += 1
        self.client.key_value_set(f"{_KEY}/sync/{k}/{self.info.process_id}", name, allow_overwrite=True)
        ms = _FOREVER_MS if timeout_s is None else int(timeout_s * 1000)
        try:
            self.client.wait_at_barrier(f"{_KEY}/sync/{k}/{name}", ms)
        except Exception as exc:
            where = {}
            try:
                where = {int(key.rsplit("/", 1)[1]): v for key, v in self.client.key_value_dir_get(f"{_KEY}/sync/{k}/")}
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
                f"({_first_line(exc)})"
            ) from None

    # failure handling ------------------------------------------------------------------------------------
    def abort(self, message: str, exit_code: int = FAILED_EXIT_CODE) -> None:
        """Stops the whole run: publishes ``message`` to the other processes, prints it, exits this process."""
        _write_stderr(f"error: process {self.info.process_id}: {message}")
        if self.watchdog is not None:
            self.watchdog.publish_failure(message)
            if self.info.process_id == 0:  # the coordination service dies with us: give peers time to read it
                time.sleep(min(2 * self.watchdog.interval_s + 0.5, 5.0))
        os._exit(exit_code)

    def _excepthook(self, exc_type, exc, tb) -> None:
        (self._previous_excepthook or sys.__excepthook__)(exc_type, exc, tb)
        if self._closed or issubclass(exc_type, SystemExit):
            return
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
        self._closed = True
        if self.watchdog is not None:
            self.watchdog.stop(done=True)
        if self._previous_excepthook is not None and sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_excepthook
        if self.client is not None:
            jax.distributed.shutdown()


_RUNTIME: DistributedRuntime | None = None  # the process's runtime once initialize() ran (see the module docstring)


def initialize(config) -> ProcessInfo:
    """Selects the platform, creates this process's devices and, if enabled, joins the multi-process run.

    Call it once, before any JAX computation (it replaces ``train.configure_devices``). Single-process
    configs (``config.distributed.enabled`` false) only set the platform and devices.
    """
    global _RUNTIME
    d = config.distributed  # checked with the rest of the config (gyre_jax.config.DistributedSection)
    platform = config.devices.platform
    if _RUNTIME is not None:
        raise DistributedError("gyre_jax.distributed.initialize was already called in this process")
    _configure_platform(platform, local_cpu_device_count(config))
    if not d.enabled:
        info = ProcessInfo(0, 1, jax.local_device_count(), jax.device_count(), platform)
        _RUNTIME = DistributedRuntime(info)
        return info

    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    heartbeat = float(d.heartbeat_timeout_s)
    kwargs = dict(
        coordinator_address=d.coordinator_address or None,
        num_processes=d.num_processes or None,
        process_id=None if d.process_id < 0 else d.process_id,
        local_device_ids=list(d.local_device_ids) or None,
        initialization_timeout=int(d.initialization_timeout_s),
        # JAX's own heartbeat is the backstop; ours (the Watchdog) fires first and says what happened.
        heartbeat_timeout_seconds=int(2 * heartbeat + 10),
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
            f"{kwargs['coordinator_address'] or 'auto-detection'} failed: {_first_line(exc)} (is process 0 running "
            f"and reachable? config.distributed.initialization_timeout_s={d.initialization_timeout_s})"
        ) from None

    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    info = ProcessInfo(
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        platform,
        jax_distributed.global_state.coordinator_address or "",
    )
    _check_equal_local_devices(client, info)
    _RUNTIME = DistributedRuntime(info, client, heartbeat)
    _RUNTIME.install()
    log.info(
        "distributed: process %d of %d, %d local / %d global %s devices, coordinator %s",
        info.process_id,
        info.num_processes,
        info.local_devices,
        info.global_devices,
        platform,
        info.coordinator_address,
    )
    return info


def _check_equal_local_devices(client, info: ProcessInfo) -> None:
    """Cells and meshes assume every host has the same number of devices; say so on every process if not."""
    client.key_value_set(f"{_KEY}/local_devices/{info.process_id}", str(info.local_devices), allow_overwrite=True)
    client.wait_at_barrier(f"{_KEY}/local_devices", _FOREVER_MS)
    counts = {int(k.rsplit("/", 1)[1]): int(v) for k, v in client.key_value_dir_get(f"{_KEY}/local_devices/")}
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

    ``via="kv"`` (default): through the coordination service's key-value store; waiting for it runs
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


# -- fail-fast watchdog ----------------------------------------------------------------------------------
class Watchdog:
    """A daemon thread: heartbeats in the key-value store; exits the process when a peer is lost.

    Each process writes ``gyre/status/<id>`` = ``{"beat": n, "state": running|done|failed, "message"}``
    every ``interval_s`` and reads all of them. A peer whose beat has not advanced for
    ``heartbeat_timeout_s`` (killed, crashed, hung host), a peer in state ``failed``, or a coordination
    service that cannot be reached (process 0 died) makes this process print one line and
    ``os._exit(PEER_LOST_EXIT_CODE)`` after running the failure hooks. It works while the main thread is
    blocked in a collective, which would otherwise wait forever (or until JAX's own heartbeat timeout).
    """

    def __init__(self, client, process_id: int, num_processes: int, heartbeat_timeout_s: float):
        self.client = client
        self.process_id = process_id
        self.num_processes = num_processes
        self.timeout_s = float(heartbeat_timeout_s)
        self.interval_s = min(max(self.timeout_s / 10, 0.1), 2.0)
        self.hooks: list[Callable[[], None]] = []
        self._beat = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._state, self._message = "running", ""
        self._thread = threading.Thread(target=self._run, name="gyre-distributed-watchdog", daemon=True)

    def start(self) -> None:
        self._publish()
        self._thread.start()

    def stop(self, done: bool) -> None:
        with self._lock:
            if done and self._state == "running":
                self._state = "done"
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.interval_s + 1)
        try:
            self._publish()
        except Exception:  # the service may already be gone; nothing to tell
            pass

    def publish_failure(self, message: str) -> None:
        with self._lock:
            self._state, self._message = "failed", message[:2000]
        try:
            self._publish()
        except Exception:
            pass

    def _publish(self) -> None:
        with self._lock:
            record = json.dumps({"beat": self._beat, "state": self._state, "message": self._message})
        self.client.key_value_set(f"{_KEY}/status/{self.process_id}", record, allow_overwrite=True)

    def _run(self) -> None:
        start = time.monotonic()
        last_seen: dict[int, tuple[int, float]] = {}  # peer -> (beat, local time it last advanced)
        first_error_at = None
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                with self._lock:
                    self._beat += 1
                self._publish()
                statuses = {
                    int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in self.client.key_value_dir_get(f"{_KEY}/status/")
                }
                first_error_at = None
            except Exception as exc:
                if self._stop.is_set():
                    return
                first_error_at = first_error_at or now
                if now - first_error_at >= min(self.timeout_s, 2 * self.interval_s):
                    self._exit(
                        f"lost the coordination service (process 0, the coordinator, died or is unreachable): "
                        f"{_first_line(exc)}"
                    )
                continue
            for peer in range(self.num_processes):
                if peer == self.process_id:
                    continue
                st = statuses.get(peer)
                if st is not None and st["state"] == "failed":
                    self._exit(f"process {peer} failed: {st['message']}")
                if st is not None and st["state"] == "done":
                    continue
                beat = st["beat"] if st is not None else -1
                prev = last_seen.get(peer)
                if prev is None or beat != prev[0]:
                    last_seen[peer] = (beat, now)
                    continue
                silent = now - (prev[1] if st is not None else start)
                if silent > self.timeout_s:
                    self._exit(
                        f"process {peer} stopped responding: no heartbeat for {silent:.1f} s "
                        f"(> config.distributed.heartbeat_timeout_s={self.timeout_s:g}); it was killed, "
                        f"crashed or its host is gone"
                    )

    def _exit(self, reason: str) -> None:
        if self._stop.is_set():
            return
        _write_stderr(
            f"error: gyre-jax process {self.process_id} of {self.num_processes} is stopping: {reason}. "
            f"See that process's log for the cause; restart all processes to resume from the last "
            f"checkpoint (exit code {PEER_LOST_EXIT_CODE})."
        )
        hooks = [threading.Thread(target=_quietly, args=(h,), daemon=True) for h in self.hooks]
        for t in hooks:
            t.start()
        deadline = time.monotonic() + 10.0
        for t in hooks:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        os._exit(PEER_LOST_EXIT_CODE)


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # a failing hook must not keep the process alive
        _write_stderr(f"warning: failure hook {getattr(fn, '__name__', fn)!r} raised {type(exc).__name__}: {exc}")


def _write_stderr(line: str) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    os.write(2, (line.rstrip("\n") + "\n").encode("utf-8", "replace"))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


# -- cells over hosts ------------------------------------------------------------------------------------
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
        raise DistributedError(
            f"processes hold different numbers of devices {dict(sorted(counts.items()))}: cells "
            f"over hosts need the same number on every host"
        )
    return next(iter(counts.values()))


def check_host_aligned(devices: Sequence[jax.Device], group: int, what: str) -> None:
    """Consecutive groups of ``group`` host-ordered devices must each be whole hosts or part of one host."""
    per_host = devices_per_process(devices)
    if group <= 0 or len(devices) % group:
        raise DistributedError(f"{what}: {len(devices)} devices cannot be split into groups of {group}")
    if group % per_host and per_host % group:
        raise DistributedError(
            f"{what} of {group} devices over hosts of {per_host} devices would split a host between groups: a group "
            f"must be whole hosts (a multiple of {per_host} devices) or part of one host (a divisor of {per_host})"
        )


def _inner_group(shape: dict[str, int]) -> int:
    """Devices of one tensor x expert block (the innermost, most communication-heavy mesh axes)."""
    return int(shape.get("tensor", 1)) * int(shape.get("expert", 1))


def make_global_mesh(shape: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The training mesh over all processes' devices, host-ordered (``data`` outermost spans hosts).

    Built on the same device order as ``make_global_cells``, which ``publish_to_cells`` relies on.
    """
    devs = host_ordered(devices)
    check_host_aligned(devs, _inner_group(shape), "a tensor x expert group of the training mesh")
    return make_mesh(devs, shape)


def make_global_cells(devices: Sequence[jax.Device] | None, num_cells: int, shape: dict[str, int]) -> list[Cell]:
    """``num_cells`` equal cells over host-ordered ``devices``; each a set of whole hosts or a part of one host.

    Same ``Cell`` type as ``gyre_jax.elastic.cells.make_cells``; in a single process both give the same
    cells. Raises ``DistributedError`` when a cell would take parts of several hosts or a tensor x expert
    group would straddle hosts.
    """
    devs = host_ordered(devices)
    if num_cells < 1 or len(devs) % num_cells:
        raise DistributedError(f"{len(devs)} devices cannot be split into {num_cells} equal cells")
    size = len(devs) // num_cells
    check_host_aligned(devs, size, "a cell")
    check_host_aligned(devs, _inner_group(shape), "a tensor x expert group of a cell")
    cells = []
    for i in range(num_cells):
        cell_devs = devs[i * size : (i + 1) * size]
        try:
            mesh = make_mesh(cell_devs, shape)
        except ValueError as exc:
            raise DistributedError(f"cell {i}: {exc}") from None
        cells.append(Cell(index=i, devices=cell_devs, mesh=mesh))
    return cells


def cell_processes(cell: Cell) -> tuple[int, ...]:
    """The processes that hold the cell's devices (these must all run the cell's programs)."""
    return tuple(sorted({d.process_index for d in cell.devices}))


# -- moving arrays between meshes that span processes ----------------------------------------------------
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


def cell_put(tree: Any, shardings: Any, *, may_alias: bool | None = None) -> Any:
    """``jax.device_put(tree, shardings)`` between two disjoint meshes, also when they span processes.

    Within one process (or when this process holds every device of both meshes) it is
    ``jax.device_put(tree, shardings, may_alias=may_alias)``; across processes the result is always new
    buffers.
    Across processes, the source and destination meshes must have the same shape and axis names (two
    cells): one jitted program over the pair of meshes copies the source half of a ``[2 * d0, ...]``
    array onto the destination half, and the destination shards are re-wrapped without a copy. Every
    process holding a device of either mesh must call it at the same point; others may call it too (they
    get arrays with no local shards and run nothing). A process that holds none of the source mesh passes
    abstract leaves (``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``) in its place. 0-d leaves travel
    as ``[1]`` arrays. While it runs it costs a zero-filled shard per destination device and a copy on the
    source devices (the source half of the program's output).
    """
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(shardings)
    src, dst = _leaf_mesh(leaves, "cell_put tree"), _leaf_mesh(targets, "cell_put shardings")
    src_devs, dst_devs = list(src.devices.flat), list(dst.devices.flat)
    local = set(jax.local_devices())
    if set(src_devs) | set(dst_devs) <= local:
        if not all(isinstance(x, jax.Array) for x in leaves):
            raise DistributedError(
                "cell_put: abstract (ShapeDtypeStruct) leaves only stand for a mesh this process "
                "does not hold; this process holds both meshes, so pass the arrays"
            )
        return jax.device_put(tree, shardings, may_alias=may_alias)
    if set(src_devs) & set(dst_devs):
        raise DistributedError(
            "cell_put across processes needs disjoint source and destination meshes "
            "(overlapping meshes are not supported yet: publish_to_cells covers the global mesh)"
        )
    if dict(src.shape) != dict(dst.shape) or src.axis_names != dst.axis_names:
        raise DistributedError(
            f"cell_put across processes needs meshes of one shape: {dict(src.shape)} -> "
            f"{dict(dst.shape)} (not supported yet)"
        )
    if not (set(src_devs) | set(dst_devs)) & local:  # this process holds neither mesh: nothing to run
        return jax.tree.unflatten(treedef, [_wrap(x.shape, x.dtype, t, {}) for x, t in zip(leaves, targets)])
    pair = Mesh(np.stack([src.devices, dst.devices]), ("cells",) + tuple(src.axis_names))
    shapes = [tuple(x.shape) if x.shape else (1,) for x in leaves]  # 0-d leaves travel as [1]
    zeros: list = [None] * len(leaves)
    if set(dst_devs) & local:  # our part of the destination half starts as zeros, in the source's layout
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
    result, dst_set = [], set(dst_devs)
    for x, y, target in zip(leaves, jax.tree.leaves(out_leaves), targets):
        shards = {s.device: s.data for s in y.addressable_shards if s.device in dst_set}
        if not x.shape:
            shards = {d: a.reshape(()) for d, a in shards.items()}
        result.append(_wrap(x.shape, x.dtype, target, shards))
    return jax.tree.unflatten(treedef, result)
