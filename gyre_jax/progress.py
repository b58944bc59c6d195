"""Progress of the long waits (warm start, a step's rollouts, evaluations, role switches, checkpoint writes, the
oracle check, benchmarks): counts, rate and time left, as a bar on a terminal and as plain lines elsewhere.

``Progress(desc, total, unit)`` is a context manager; ``update(n)`` counts what finished, ``note(text)`` sets a
short detail shown beside the counts (a loss, what is being waited on); ``detail_fn`` computes it at each redraw
or line instead (a step's rollouts, read from the run's live view). ``delay_s``: a wait that ends sooner shows
nothing (a checkpoint write of a tiny model). Where it draws:

- on a terminal (``stream.isatty()``) a ``tqdm`` bar, redrawn every second by a small thread even when nothing
  finishes (the elapsed time and the time left keep moving), removed when the wait ends; the wait's summary
  line is then logged;
- anywhere else (logs, CI, a pipe) one plain line per event through the ``gyre_jax.progress`` logger (printed to
  the stream where no logging is configured): a
  ``started`` line, then at most one line every ``interval_s`` seconds, written when something finished or, if
  nothing did, as a heartbeat once ``interval_s`` passed without a line (a wait is never silent for longer), and
  a ``done`` line. No bar characters, no carriage returns.

``mode`` forces one way: "bar", "lines" or "off" (the environment variable ``GYRE_PROGRESS`` does the same for
every wait; ``config.metrics.progress_bar=false`` passes "lines"). A wait whose amount is unknown (``total``
None: a checkpoint write) shows its elapsed time, and as its time left the last same wait's duration
(``estimate_s``) minus the time elapsed.

Line format (plain mode; counts are integers, rates per second, times in seconds or m:ss / h:mm:ss):

    evaluation after 40 steps: started (512 executions)
    evaluation after 40 steps: 37/512 executions (7%)  1.85 executions/s  elapsed 0:20  left ~4:17  reward 0.51
    evaluation after 40 steps: done 512/512 executions in 4:31 (1.89 executions/s)
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

log = logging.getLogger("gyre_jax.progress")

MODES = ("bar", "lines", "off")
DEFAULT_INTERVAL_S = 5.0  # plain mode: at most one line, and at least one line, per this many seconds


def fmt_time(seconds: float) -> str:
    """``seconds`` as m:ss or h:mm:ss (``?`` when unknown)."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def resolve_mode(mode: str | None, stream: IO[str]) -> str:
    """The mode a wait uses: ``mode`` if given, else ``$GYRE_PROGRESS``, else "bar" on a terminal and "lines"
    elsewhere. A "bar" asked for where ``stream`` is not a terminal becomes "lines" (no bar spam in logs)."""
    chosen = mode or os.environ.get("GYRE_PROGRESS") or ""
    if chosen and chosen not in MODES:
        raise ValueError(f"progress mode {chosen!r} is not one of {MODES} (GYRE_PROGRESS or mode=)")
    tty = bool(getattr(stream, "isatty", lambda: False)())
    if chosen == "off":
        return "off"
    if chosen == "lines" or not tty:
        return "lines"
    return "bar"


class Progress:
    """One long wait (see the module docstring). Thread-safe: ``update`` and ``note`` may come from any thread.

    ``total``: how many ``unit`` the wait is (None: unknown; then ``estimate_s`` is its expected duration).
    ``interval_s``: plain mode's line spacing and heartbeat. ``stream``: where a bar draws (stderr)."""

    def __init__(
        self,
        desc: str,
        total: int | None = None,
        unit: str = "it",
        *,
        mode: str | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        estimate_s: float | None = None,
        delay_s: float = 0.0,
        detail_fn: Callable[[], str] | None = None,
        stream: IO[str] | None = None,
        clock=time.monotonic,
    ):
        if interval_s <= 0 or delay_s < 0:
            raise ValueError(f"interval_s={interval_s} must be > 0 and delay_s={delay_s} >= 0")
        self.desc = desc
        self.total = total
        self.unit = unit
        self.interval_s = interval_s
        self.estimate_s = estimate_s
        self.delay_s = delay_s
        self.detail_fn = detail_fn
        self.stream = stream if stream is not None else sys.stderr
        self.mode = resolve_mode(mode, self.stream)
        self.clock = clock
        self.n = 0
        self.detail = ""
        self.lines = 0  # plain lines written (tests read it)
        self._lock = threading.Lock()
        self._t0 = clock()
        self._last_line = self._t0
        self._last_n = 0
        self._closed = False
        self._stop = threading.Event()
        self._bar = None
        self._shown = False  # drawn yet (a wait shorter than ``delay_s`` never is)
        self._ticker: threading.Thread | None = None
        if self.mode == "off":
            return
        if delay_s == 0:
            self._show()
        self._ticker = threading.Thread(target=self._tick, name=f"progress-{desc[:20]}", daemon=True)
        self._ticker.start()

    # -- counting -------------------------------------------------------------------------------------------
    def update(self, n: int = 1, detail: str | None = None) -> None:
        """``n`` more ``unit`` done (and the detail shown beside the counts, if given)."""
        with self._lock:
            if self._closed:
                return
            self.n += n
            if detail is not None:
                self.detail = detail
            if self._bar is not None:
                self._bar.update(n)
                self._bar.set_postfix_str(self.detail, refresh=False)
            elif self._shown and self.mode == "lines" and self.clock() - self._last_line >= self.interval_s:
                self._line(self._status())

    def set(self, n: int, detail: str | None = None) -> None:
        """The count is ``n`` now (for a wait whose count is read, not counted)."""
        with self._lock:
            delta = n - self.n
        if delta or detail is not None:
            self.update(delta, detail)

    def note(self, detail: str) -> None:
        """Sets the detail shown beside the counts (no count changes)."""
        self.update(0, detail)

    @property
    def elapsed_s(self) -> float:
        return self.clock() - self._t0

    def rate(self) -> float:
        """``unit`` per second so far (0 before the first one)."""
        elapsed = self.elapsed_s
        return self.n / elapsed if elapsed > 0 else 0.0

    def left_s(self) -> float:
        """Seconds left: the remaining count at the rate so far, or the estimate minus the elapsed time (inf:
        unknown)."""
        elapsed = self.elapsed_s
        if self.total is not None:
            if self.n <= 0 or elapsed <= 0:
                return math.inf
            return max(0.0, (self.total - self.n) / (self.n / elapsed))
        if self.estimate_s is not None:
            return max(0.0, self.estimate_s - elapsed)
        return math.inf

    def _status(self) -> str:
        self._refresh_detail()
        elapsed = self.elapsed_s
        if self.total is not None:
            pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
            counts = f"{self.n}/{self.total} {self.unit}{pct}  {self.rate():.2f} {self.unit}/s"
        else:
            counts = f"{self.n} {self.unit}" if self.n else "waiting"
        text = f"{counts}  elapsed {fmt_time(elapsed)}  left ~{fmt_time(self.left_s())}"
        return f"{text}  {self.detail}" if self.detail else text

    # -- drawing --------------------------------------------------------------------------------------------
    def _refresh_detail(self) -> None:
        """``detail_fn``'s text as the detail (a failing one is shown as such, never raised into the wait)."""
        if self.detail_fn is not None:
            try:
                self.detail = self.detail_fn()
            except Exception as exc:  # noqa: BLE001 - progress must never break the work it reports on
                self.detail = f"(detail unavailable: {type(exc).__name__})"

    def _show(self) -> None:
        """Starts drawing: the bar, or the ``started`` line (caller holds the lock, or is the constructor)."""
        self._shown = True
        if self.mode == "bar":
            from tqdm import tqdm

            width = _columns(self.stream)  # a terminal that reports no size (0 columns) gets 100
            self._bar = tqdm(total=self.total, initial=self.n, desc=self.desc, unit=f" {self.unit}", file=self.stream,
                             leave=False, dynamic_ncols=width > 0, ncols=None if width > 0 else 100, mininterval=0.2,
                             bar_format=_BAR_FORMAT if self.total else _SPIN_FORMAT)  # fmt: skip
            self._bar.set_postfix_str(self.detail, refresh=True)
            return
        started = f"started ({self.total} {self.unit})" if self.total is not None else "started"
        if self.elapsed_s >= 1.0:
            started += f" {fmt_time(self.elapsed_s)} ago: {self._status()}"
        self._line(started)

    def _line(self, text: str) -> None:
        """One plain line (caller holds the lock, or is the constructor): logged, or printed to the stream when
        nothing would show a log line (a command that configured no logging)."""
        if log.hasHandlers() and log.isEnabledFor(logging.INFO):
            log.info("%s: %s", self.desc, text)
        else:
            print(f"{self.desc}: {text}", file=self.stream, flush=True)
        self.lines += 1
        self._last_line = self.clock()
        self._last_n = self.n

    def _tick(self) -> None:
        """The bar's redraw (every second) or plain mode's heartbeat (after ``interval_s`` without a line)."""
        period = 1.0 if self.mode == "bar" else min(1.0, self.interval_s / 2)
        period = min(period, self.delay_s) if self.delay_s > 0 else period
        while not self._stop.wait(period):
            with self._lock:
                if self._closed:
                    return
                if not self._shown:
                    if self.elapsed_s >= self.delay_s:
                        self._show()
                elif self._bar is not None:
                    self._refresh_detail()
                    self._bar.set_postfix_str(self.detail, refresh=False)
                    self._bar.refresh()
                elif self.clock() - self._last_line >= self.interval_s:
                    self._line(self._status())

    def close(self, summary: str | None = None) -> None:
        """Ends the wait: the bar is removed, and one ``done`` line (with ``summary``) is logged."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join()
        if self.mode == "off" or not self._shown:
            return
        if self._bar is not None:
            self._bar.close()
        elapsed = self.elapsed_s
        counts = f"{self.n}/{self.total} {self.unit}" if self.total is not None else f"{self.n} {self.unit}"
        rate = f" ({self.n / elapsed:.2f} {self.unit}/s)" if self.n and elapsed > 0 else ""
        text = f"done {counts} in {fmt_time(elapsed)}{rate}" if (self.n or self.total) else f"done in {elapsed:.1f}s"
        with self._lock:
            self._line(f"{text}  {summary}" if summary else text)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(None if exc_type is None else f"stopped: {exc_type.__name__}")


_BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}{unit} [{elapsed}<{remaining}, {rate_fmt}]{postfix}"
_SPIN_FORMAT = "{desc}: {n_fmt}{unit} [{elapsed}]{postfix}"


def _columns(stream: IO[str]) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


class Durations:
    """The last duration of each kind of wait, for the time left of the next one (``Progress.estimate_s``)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def get(self, kind: str) -> float | None:
        with self._lock:
            return self._last.get(kind)

    def put(self, kind: str, seconds: float) -> None:
        with self._lock:
            self._last[kind] = seconds
