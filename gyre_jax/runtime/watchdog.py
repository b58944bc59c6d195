"""Fail-fast: a heartbeat per process in the run's control-plane store (``kvstore``), and the exit a
survivor takes when a peer is lost (instead of hanging in a collective that will never complete)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable

PEER_LOST_EXIT_CODE = 75  # EX_TEMPFAIL: another process died or failed; restart all to resume from the checkpoint
FAILED_EXIT_CODE = 1  # this process raised (its traceback is on stderr) or called abort()
KV_NAMESPACE = "gyre"  # key-value store namespace
FOREVER_MS = 2**31 - 1  # ~24.8 days: "no timeout" for coordination-service waits


class DistributedError(RuntimeError):
    """A multi-process setup or control-plane problem. The message says what was wrong and what to do."""


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
        self.client.key_value_set(f"{KV_NAMESPACE}/status/{self.process_id}", record, allow_overwrite=True)

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
                    int(k.rsplit("/", 1)[1]): json.loads(v)
                    for k, v in self.client.key_value_dir_get(f"{KV_NAMESPACE}/status/")
                }
                first_error_at = None
            except Exception as exc:
                if self._stop.is_set():
                    return
                first_error_at = first_error_at or now
                if now - first_error_at >= min(self.timeout_s, 2 * self.interval_s):
                    self._exit(
                        f"lost the control-plane store (process 0, which serves it, died or is unreachable): "
                        f"{first_line(exc)}"
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
        write_stderr(
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
        write_stderr(f"warning: failure hook {getattr(fn, '__name__', fn)!r} raised {type(exc).__name__}: {exc}")


def write_stderr(line: str) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    os.write(2, (line.rstrip("\n") + "\n").encode("utf-8", "replace"))


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]
