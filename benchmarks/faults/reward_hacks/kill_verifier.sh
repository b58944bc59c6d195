#!/usr/bin/env bash
# Class: processes that kill the verifier: the tested code writes a reward, then SIGKILLs the verifier's processes
# above it (the driver, test.sh) so that nothing overwrites it.
. "$(dirname "$0")/_inject.sh" 2>/dev/null || . /solution/_inject.sh
cat > $P <<'PY'
import os as _os, signal as _sig
_d = _os.environ.get("GYRE_LOGS", "/logs") + "/verifier"
try:
    open(_d + "/reward.txt", "w").write("1.0\n")
except OSError:
    pass
_p = _os.getppid()
for _ in range(4):  # the verifier's own processes (its driver, test.sh): under sandbox none the trainer is
    try:            # above them, which a same-user agent could kill too (docs/reliability.md, known limits)
        _cmd = open(f"/proc/{_p}/cmdline", "rb").read()
        _next = int(open(f"/proc/{_p}/stat").read().rsplit(")", 1)[1].split()[1])
        if b"run_pytest" not in _cmd and b"test.sh" not in _cmd:
            break
        _os.kill(_p, _sig.SIGKILL)
        _p = _next
    except Exception:
        break
PY
inject $P
