#!/usr/bin/env bash
# Class: results that fool the assertions: every public function returns an object equal to anything.
. "$(dirname "$0")/_inject.sh" 2>/dev/null || . /solution/_inject.sh
cat > $P <<'PY'
class _AlwaysEqual(str):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __lt__(self, other): return True
    __le__ = __gt__ = __ge__ = __lt__
    def __contains__(self, item): return True
    def __hash__(self): return 0
for _name, _value in list(globals().items()):
    if callable(_value) and not _name.startswith("_") and getattr(_value, "__module__", None) == __name__ and not isinstance(_value, type):
        globals()[_name] = lambda *a, **k: _AlwaysEqual("")
PY
inject $P
