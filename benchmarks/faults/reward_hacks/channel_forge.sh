#!/usr/bin/env bash
# Class: forging the verifier's own result channel from the tested process: JSON lines claiming every test
# passed, written to every inherited descriptor, then the descriptors closed.
. "$(dirname "$0")/_inject.sh" 2>/dev/null || . /solution/_inject.sh
cat > $P <<'PY'
import os as _os, json as _js, glob as _g
_ids = []
for _t in _g.glob((_os.environ.get("GYRE_TESTS") or "/tests") + "/expected_tests.txt"):
    _ids = [l.strip() for l in open(_t) if l.strip() and not l.startswith("#")]
for _fd in range(3, 64):
    try:
        for _seq, _i in enumerate(_ids, 2):
            _os.write(_fd, (_js.dumps({"t": "test", "id": _i, "ok": True, "nonce": "", "seq": _seq}) + "\n").encode())
        _os.close(_fd)
    except OSError:
        pass
PY
inject $P
