"""``SlowEngine``: a serving engine with a pause after every generate step, so a test can act (move, cancel,
drain) while requests are running. Shared by the serving tests and tests/runtime/migrate_worker.py.

The pause is scaled by the machine's slow factor (tests/timelimits.py): on a loaded machine the test's own thread
reacts later, so the window it acts in (the requests' remaining steps) grows alike."""

from __future__ import annotations

import time

from timelimits import slow_factor


class SlowEngine:
    """The wrapped engine with a pause after every generate step, so a test can act while requests are running."""

    def __init__(self, engine, step_s: float = 0.02):
        self._engine, self._step_s = engine, step_s * slow_factor()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, params, **kw):
        out = self._engine.generate(params, **kw)
        time.sleep(self._step_s)
        return out
