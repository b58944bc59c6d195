#!/usr/bin/env bash
# Class: configuration shadowing (pytest.ini, pyproject.toml, setup.cfg, tox.ini): load a forging plugin from the
# workspace and collect nothing that could fail.
cat > wsplugin.py <<'PY'
import pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
PY
for f in pytest.ini tox.ini; do printf '[pytest]\naddopts = -p wsplugin -p no:gyre_pytest_guard\npython_files = none_*\n' > $f; done
printf '[tool:pytest]\naddopts = -p wsplugin\npython_files = none_*\n' > setup.cfg
printf '[tool.pytest.ini_options]\naddopts = "-p wsplugin"\npython_files = ["none_*"]\n' > pyproject.toml
