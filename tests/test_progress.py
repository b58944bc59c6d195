"""``gyre_jax.progress``: a bar on a terminal (a real pty), plain lines without one, a heartbeat while nothing
finishes, nothing at all for a wait shorter than its delay."""

from __future__ import annotations

import fcntl
import logging
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from gyre_jax.progress import Progress, fmt_time, resolve_mode

REPO = Path(__file__).resolve().parent.parent

# A child that counts 6 items with a progress line/bar, the way the run's waits do.
CHILD = """
import logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
from gyre_jax.progress import Progress
with Progress("eval demo", total=6, unit="executions", interval_s=0.2) as p:
    for i in range(6):
        time.sleep(0.15)
        p.update(1, detail=f"reward {i / 10:.2f}")
print("finished", flush=True)
"""


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_plain_lines_counts_rate_time_left(caplog) -> None:
    clock = FakeClock()
    caplog.set_level(logging.INFO, logger="gyre_jax.progress")
    p = Progress("evaluation", total=10, unit="executions", mode="lines", interval_s=5.0, clock=clock)
    clock.t += 2.0
    p.update(2, detail="reward 0.50")  # 2 s after the start line: not due yet
    assert p.lines == 1
    clock.t += 3.0
    p.update(2)  # 5 s: due; 4/10 in 5 s -> 0.8/s, 6 left -> 7.5 s
    assert p.lines == 2
    p.close()
    messages = [r.getMessage() for r in caplog.records if r.name == "gyre_jax.progress"]
    assert messages[0] == "evaluation: started (10 executions)"
    assert messages[1].startswith("evaluation: 4/10 executions (40%)  0.80 executions/s  elapsed 0:05  left ~0:08")
    assert messages[1].endswith("reward 0.50")
    assert messages[2] == "evaluation: done 4/10 executions in 0:05 (0.80 executions/s)"
    assert not any("\r" in m for m in messages)


def test_heartbeat_when_nothing_finishes(caplog) -> None:
    """A wait where nothing finishes still says so every ``interval_s`` (never silent)."""
    clock = FakeClock()
    caplog.set_level(logging.INFO, logger="gyre_jax.progress")
    with Progress("waiting", total=3, unit="executions", mode="lines", interval_s=4.0, clock=clock) as p:
        assert p.lines == 1
        for beat in (2, 3):
            clock.t += 4.0
            _wait_for(lambda b=beat: p.lines >= b)  # the ticker thread writes it
        assert p.lines == 3
    messages = [r.getMessage() for r in caplog.records if r.name == "gyre_jax.progress"]
    assert messages[1] == "waiting: 0/3 executions (0%)  0.00 executions/s  elapsed 0:04  left ~?"
    assert messages[2].startswith("waiting: 0/3 executions (0%)  0.00 executions/s  elapsed 0:08")


def test_unknown_total_uses_the_last_duration(caplog) -> None:
    clock = FakeClock()
    caplog.set_level(logging.INFO, logger="gyre_jax.progress")
    with Progress("checkpoint 40", mode="lines", estimate_s=30.0, interval_s=5.0, clock=clock) as p:
        clock.t += 12.0
        _wait_for(lambda: p.lines >= 2)
    messages = [r.getMessage() for r in caplog.records if r.name == "gyre_jax.progress"]
    assert messages[1] == "checkpoint 40: waiting  elapsed 0:12  left ~0:18"
    assert messages[-1] == "checkpoint 40: done in 12.0s"


def test_delay_hides_short_waits(caplog) -> None:
    caplog.set_level(logging.INFO, logger="gyre_jax.progress")
    clock = FakeClock()
    with Progress("quick", total=2, mode="lines", delay_s=2.0, clock=clock) as p:
        p.update(2)
    assert p.lines == 0 and not [r for r in caplog.records if r.name == "gyre_jax.progress"]
    with Progress("slow", total=2, mode="lines", delay_s=2.0, interval_s=5.0, clock=clock) as p:
        p.update(1)
        clock.t += 3.0
        _wait_for(lambda: p.lines >= 1)  # shown once the delay passed, with what is done so far
    messages = [r.getMessage() for r in caplog.records if r.name == "gyre_jax.progress"]
    assert messages[0].startswith("slow: started (2 it) 0:03 ago: 1/2 it (50%)")
    assert messages[-1].startswith("slow: done 1/2 it in 0:03")


def test_mode_resolution(monkeypatch) -> None:
    class Tty:
        def isatty(self) -> bool:
            return True

    class Pipe:
        def isatty(self) -> bool:
            return False

    monkeypatch.delenv("GYRE_PROGRESS", raising=False)
    assert resolve_mode(None, Tty()) == "bar" and resolve_mode(None, Pipe()) == "lines"
    assert resolve_mode("bar", Pipe()) == "lines"  # never a bar into a log
    assert resolve_mode("lines", Tty()) == "lines" and resolve_mode("off", Tty()) == "off"
    monkeypatch.setenv("GYRE_PROGRESS", "lines")
    assert resolve_mode(None, Tty()) == "lines"
    monkeypatch.setenv("GYRE_PROGRESS", "fancy")
    with pytest.raises(ValueError, match="GYRE_PROGRESS"):
        resolve_mode(None, Tty())
    assert fmt_time(75) == "1:15" and fmt_time(3725) == "1:02:05" and fmt_time(float("inf")) == "?"


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GYRE_PROGRESS"}
    env["PYTHONPATH"] = str(REPO)
    return env


def test_terminal_gets_a_bar_and_a_pipe_gets_lines() -> None:
    # On a pty: tqdm redraws one line with carriage returns, shows the bar, the counts and the time left.
    pid, fd = pty.fork()
    if pid == 0:  # the child: stdin/stdout/stderr are the pty, 120 columns wide
        try:
            fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
            os.execve(sys.executable, [sys.executable, "-c", CHILD], _child_env())
        finally:
            os._exit(127)  # never back into pytest
    chunks = []
    reader = threading.Thread(target=lambda: _read_all(fd, chunks), daemon=True)
    reader.start()
    _, status = os.waitpid(pid, 0)
    reader.join(30)
    tty_out = b"".join(chunks).decode("utf-8", "replace")
    assert os.waitstatus_to_exitcode(status) == 0, tty_out
    assert "\r" in tty_out and "eval demo:" in tty_out and "finished" in tty_out
    assert "|" in tty_out and "/6 executions" in tty_out and "<" in tty_out  # bar, counts, elapsed<remaining
    assert "executions/s" in tty_out
    assert "eval demo: done 6/6 executions" in tty_out  # the summary line after the bar is gone
    # Through a pipe (a log, CI): plain lines only, one per event.
    done = subprocess.run([sys.executable, "-c", CHILD], env=_child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "gyre_jax.progress" in line]
    assert "\r" not in done.stderr and "|" not in done.stderr
    assert lines[0] == "INFO gyre_jax.progress: eval demo: started (6 executions)"
    assert lines[-1].startswith("INFO gyre_jax.progress: eval demo: done 6/6 executions in 0:0")
    assert 2 <= len(lines) <= 12  # at most one per interval (0.2 s over ~0.9 s of work), never one per redraw
    assert all("/6 executions" in line and "executions/s" in line and "left ~" in line for line in lines[1:-1])


def _read_all(fd: int, chunks: list[bytes]) -> None:
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:  # the child closed the pty
            return
        if not data:
            return
        chunks.append(data)
