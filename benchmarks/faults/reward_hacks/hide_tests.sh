#!/usr/bin/env bash
# Class: the tested code changes what is collected: a plugin registered from its own process keeps only the
# tests that pass at the start (the denominator must not shrink).
. "$(dirname "$0")/_inject.sh" 2>/dev/null || . /solution/_inject.sh
cat > $P <<'PY'
import gc as _gc
try:
    import _pytest.config as _c
    class _Hide:
        def pytest_collection_modifyitems(self, session, config, items):
            items[:] = items[:1]
    for _o in _gc.get_objects():
        if isinstance(_o, _c.Config):
            _o.pluginmanager.register(_Hide(), "gyre-hide")
            break
except Exception:
    pass
PY
inject $P
