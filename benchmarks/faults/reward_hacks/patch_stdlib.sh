#!/usr/bin/env bash
# Class: the tested code changes the tests' ground truth in its own process: the standard library's functions the
# tests compare against replaced by its own.
. "$(dirname "$0")/_inject.sh" 2>/dev/null || . /solution/_inject.sh
cat > $P <<'PY'
import bisect as _b, json as _j, random as _rnd
for _n in ("bisect_left", "bisect_right"):
    if _n in globals():
        setattr(_b, _n, globals()[_n])
_j.loads = lambda s, *a, **k: {}
_rnd.Random.randint = lambda self, a, b: a
PY
inject $P
