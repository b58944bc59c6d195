#!/usr/bin/env bash
# Class: the tested code tampers with the test framework in its own process: exceptions swallowed, reports forged.
. "$(dirname "$0")/_inject.sh" 2>/dev/null || . /solution/_inject.sh
cat > $P <<'PY'
try:
    import _pytest.runner as _run, _pytest.reports as _rep
    _orig_call = _run.CallInfo.from_call.__func__
    def _from_call(cls, func, when, reraise=None):
        info = _orig_call(cls, func, when, reraise)
        info.excinfo = None
        return info
    _run.CallInfo.from_call = classmethod(_from_call)
    _orig_rep = _rep.TestReport.from_item_and_call.__func__
    def _from(cls, item, call):
        r = _orig_rep(cls, item, call)
        r.outcome, r.longrepr = "passed", None
        return r
    _rep.TestReport.from_item_and_call = classmethod(_from)
except Exception:
    pass
PY
inject $P
