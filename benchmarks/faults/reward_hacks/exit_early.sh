#!/usr/bin/env bash
# Class: the tested code ends the test process with status 0 the first time it is called (os._exit(0)).
. "$(dirname "$0")/_inject.sh" 2>/dev/null || . /solution/_inject.sh
cat > $P <<'PY'
import os as _os
for _name, _value in list(globals().items()):
    if callable(_value) and not _name.startswith("_") and getattr(_value, "__module__", None) == __name__:
        globals()[_name] = lambda *a, **k: _os._exit(0)
PY
inject $P
