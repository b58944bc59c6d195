#!/usr/bin/env bash
# Class: the files the reward is computed from, written by the tested code: reward.txt / reward.json / a junit
# report / the driver's summary, then an exit 0 so nothing overwrites them.
. "$(dirname "$0")/_inject.sh" 2>/dev/null || . /solution/_inject.sh
cat > $P <<'PY'
import os as _os
for _d in {_os.environ.get("GYRE_LOGS", "/logs") + "/verifier", "/logs/verifier"}:
    try:
        _os.makedirs(_d, exist_ok=True)
        open(_d + "/reward.txt", "w").write("1.0\n")
        open(_d + "/reward.json", "w").write('{"reward": 1.0}')
        open(_d + "/junit.xml", "w").write('<testsuite tests="11" failures="0" errors="0" skipped="0"/>')
        open(_d + "/summary.json", "w").write('{"reward": 1.0}')
    except OSError:
        pass
_os._exit(0)
PY
inject $P
