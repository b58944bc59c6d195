"""``SlowEngine``: a serving engine with a pause after every generate step, so a test can act (move, cancel,
drain) while requests are running. Shared by the serving tests and tests/runtime/migrate_worker.py."""

from __future__ import annotations

import time


class SlowEngine:
    """The wrapped engine with a pause after every generate step, so a test can act while requests are running."""

    def __init__(self, engine, step_s: float = 0.02):
        self._engine, self._step_s = engine, step_s

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, params, **kw):
        out = self._engine.generate(params, **kw)
        time.sleep(self._step_s)
        return out
