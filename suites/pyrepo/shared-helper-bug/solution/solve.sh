#!/usr/bin/env bash
# Oracle: the shared helper pads a one-digit fraction on the wrong side ("5" -> "05" cents).
set -euo pipefail
python3 - <<'EOF'
import pathlib

p = pathlib.Path("legacy/util.py")
s = p.read_text()
old = 'int(frac.zfill(2) if frac else "0")'
assert s.count(old) == 1
p.write_text(s.replace(old, 'int(frac.ljust(2, "0") if frac else "0")'))
EOF
