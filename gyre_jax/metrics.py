"""Run metrics: one JSON object per step in ``metrics.jsonl``, TensorBoard event files, a console line.

Metrics are skipped, not fatal, when the disk is full: a line that cannot be written whole is left out (a
warning names the step) and the run goes on; ``read_metrics`` skips a torn last line.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from gyre_jax.disk import DiskFull, append_whole

logger = logging.getLogger(__name__)


class MetricsWriter:
    def __init__(self, workdir: str | Path, tensorboard: bool = True):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.path = self.workdir / "metrics.jsonl"
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.workdir / "tensorboard"))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        try:
            append_whole(self.path, (json.dumps(record, default=float) + "\n").encode("utf-8"), fsync=False)
        except DiskFull as exc:
            logger.warning("metrics of step %d not written: %s", step, exc)
            return
        if self._tb is not None:
            try:
                for key, value in metrics.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                        self._tb.add_scalar(key, value, step)
                self._tb.flush()
            except OSError as exc:
                logger.warning("tensorboard events of step %d not written: %s", step, exc)

    def close(self) -> None:
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError as exc:
                logger.warning("tensorboard events not flushed at close: %s", exc)


def read_metrics(path: str | Path) -> list[dict]:
    """The metrics records of ``metrics.jsonl``; a torn last line (no newline: a cut-off write) is skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                logger.warning("%s: skipped a torn last line (%d characters without a newline)", path, len(line))
                break
            if line.strip():
                out.append(json.loads(line))
    return out


def _counted(m: dict[str, Any], keys: dict[str, str]) -> str:
    """``"N"`` or ``"N (what n, ...)"``: the sum of ``m[key]`` over ``keys`` (key -> what), the nonzero ones named."""
    counts = {what: int(m.get(key, 0) or 0) for key, what in keys.items()}
    named = ", ".join(f"{what} {n}" for what, n in counts.items() if n)
    return f"{sum(counts.values())} ({named})" if named else str(sum(counts.values()))


REFUSED = {"refused_context": "context", "refused_admission": "admission", "refused_bad_request": "bad request"}


def format_step_line(step: int, total: int, m: dict[str, Any]) -> str:
    """One readable console line per step: nothing refused or left out in silence (``refused``: model calls the
    proxy refused, by why; ``left out``: executions the trajectory pipeline did not train on, by why; ``trained``:
    executions with tokens in the step's micro-batches)."""
    left_out = {k: k.removeprefix("left_out/").replace("_", " ") for k in sorted(m) if k.startswith("left_out/")}
    trained = f"trained {m['executions_trained']}  " if "executions_trained" in m else ""
    return (
        f"step {step}/{total}  reward {m.get('reward_mean', float('nan')):.3f}  pass {m.get('pass_rate', float('nan')):.2f}  "
        f"excluded {m.get('excluded', 0)}  timeouts {m.get('timeouts', 0)}  crashed {m.get('crashed', 0)}  "
        f"refused {_counted(m, REFUSED)}  left out {_counted(m, left_out)}  {trained}"
        f"tokens {m.get('tokens_trained', 0)}  gnorm {m.get('grad_norm', float('nan')):.3f}  "
        f"micro-steps {m.get('micro_steps', 0)}  stale {m.get('staleness_mean', 0):.2f}  idle {m.get('idle_fraction', 0):.2f}  "
        f"step {m.get('step_s', 0):.1f}s  v{m.get('policy_version', 0)}"
    )
