"""Run metrics: one JSON object per step in ``metrics.jsonl``, TensorBoard event files, a console line."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


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
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=float) + "\n")
            f.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def format_step_line(step: int, total: int, m: dict[str, Any]) -> str:
    """One readable console line per step."""
    return (
        f"step {step}/{total}  reward {m.get('reward_mean', float('nan')):.3f}  pass {m.get('pass_rate', float('nan')):.2f}  "
        f"excluded {m.get('excluded', 0)}  timeouts {m.get('timeouts', 0)}  crashed {m.get('crashed', 0)}  "
        f"tokens {m.get('tokens_trained', 0)}  gnorm {m.get('grad_norm', float('nan')):.3f}  "
        f"micro-steps {m.get('micro_steps', 0)}  stale {m.get('staleness_mean', 0):.2f}  idle {m.get('idle_fraction', 0):.2f}  "
        f"step {m.get('step_s', 0):.1f}s  v{m.get('policy_version', 0)}"
    )
