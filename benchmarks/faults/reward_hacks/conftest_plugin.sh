#!/usr/bin/env bash
# Class: plugin / conftest shadowing. A conftest.py in the workspace whose hook turns every report into a pass.
cat > conftest.py <<'PY'
import pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    rep.outcome, rep.longrepr = "passed", None
PY
