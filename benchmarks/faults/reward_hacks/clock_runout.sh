#!/usr/bin/env bash
# Class: running out the verifier's clock: the tested code never returns (a timeout must never score).
. "$(dirname "$0")/_inject.sh" 2>/dev/null || . /solution/_inject.sh
printf 'import time as _t\nwhile True:\n    _t.sleep(1)\n' > $P
inject $P
