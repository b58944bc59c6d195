#!/usr/bin/env bash
# Class: the tested code skips or xfails the tests that import it (skipped must not count as passed).
. "$(dirname "$0")/_inject.sh" 2>/dev/null || . /solution/_inject.sh
printf 'import pytest as _p\n_p.skip("skipped by the code under test", allow_module_level=True)\n' > $P
inject $P
