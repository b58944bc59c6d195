"""Tests for gyre_jax/elastic/timeline.py (the trace format the simulator and the controller share) and
experiments/plot_timeline.py (its Gantt chart)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from timelimits import scaled

from gyre_jax.elastic.policies import Role
from gyre_jax.elastic.timeline import TimelineWriter, load_timeline, parse_events

REPO = Path(__file__).resolve().parents[2]


def _write(path, close=True):
    tl = TimelineWriter(path, ["cell0", "cell1"], source="controller", t0=1000.0)
    tl.role(1000.0, 0, Role.SERVING, reason="start")
    tl.role(1000.0, 1, "serving", reason="start")
    tl.execution_started(1001.0, "e0", step=0, cell=1)
    tl.waterlevel(1001.0, 2, 1, 0)
    tl.role(1010.0, 0, Role.SWITCHING, reason="finished", to=Role.TRAINING)
    tl.execution_ended(1012.0, "e0", "timeout", cell=1)
    tl.role(1018.5, 0, Role.TRAINING, reason="switched")
    tl.micro_step(1019.0, 1021.0, 0, step=0, flops=3.0)
    tl.optimizer_step(1021.0, 1022.0, 0, step=0, version=1)
    tl.waterlevel(1022.0, 2, 2, 2)
    if close:
        tl.close(1030.0)
    return tl


def test_round_trip_through_a_file(tmp_path):
    path = tmp_path / "timeline.json"
    _write(path)
    data = json.loads(path.read_text())  # a complete JSON array: chrome://tracing and Perfetto open it
    assert isinstance(data, list) and data[0]["name"] == "gyre_timeline"
    tl = load_timeline(path)
    assert tl.source == "controller" and tl.t0 == 1000.0 and tl.cells == ["cell0", "cell1"]
    assert [(s.name, s.start, s.end) for s in tl.roles[0]] == [
        ("serving", 0.0, 10.0),
        ("switching", 10.0, 18.5),
        ("training", 18.5, 30.0),
    ]
    assert tl.roles[0][1].args == {"reason": "finished", "to": "training"}
    assert [(s.name, s.start, s.end) for s in tl.roles[1]] == [("serving", 0.0, 30.0)]
    assert [(s.start, s.end, s.args["flops"]) for s in tl.micro_steps[0]] == [(19.0, 21.0, 3.0)]
    assert tl.optimizer_steps[0].args == {"step": 0, "version": 1, "cell": 0}
    e0 = tl.executions["e0"]
    assert (e0.start, e0.end, e0.args["status"], e0.args["cell"]) == (1.0, 12.0, "timeout", 1)
    assert [w["outstanding"] for _, w in tl.waterlevel] == [2, 0]
    assert tl.t_end == 30.0
    frac = tl.busy_fraction()
    assert frac["serving"] == pytest.approx((10 + 30) / 60) and frac["micro_step"] == pytest.approx(2 / 60)


def test_a_file_cut_short_by_a_crash_still_loads(tmp_path):
    path = tmp_path / "timeline.json"
    tl = _write(path, close=False)
    tl.flush()
    text = path.read_text()
    assert not text.rstrip().endswith("]")
    torn = text + '{"ph": "X", "name": "micro_st'  # a write interrupted mid-line
    path.write_text(torn)
    loaded = load_timeline(path)
    assert loaded.roles[0][-1].name == "training" and loaded.roles[0][-1].end == 22.0  # open span: to the last event
    assert len(parse_events(torn)) == len(parse_events(text))


def test_in_memory_events_and_bad_input():
    tl = TimelineWriter(None, ["a"], source="sim")
    tl.role(0.0, 0, "serving")
    tl.close(5.0)
    assert load_timeline(tl.events).roles[0][0].end == 5.0
    with pytest.raises(ValueError, match="unknown role 'idle'"):
        TimelineWriter(None, ["a"], source="sim").role(0.0, 0, "idle")
    with pytest.raises(ValueError, match="cell 3 out of range"):
        TimelineWriter(None, ["a"], source="sim").micro_step(0.0, 1.0, 3, step=0)
    with pytest.raises(RuntimeError, match="closed"):
        tl.instant(6.0, "late")
    with pytest.raises(ValueError, match="not a gyre timeline"):
        load_timeline([{"ph": "X", "name": "foo", "ts": 0, "dur": 1}])
    with pytest.raises(FileNotFoundError, match="timeline .* not found"):
        load_timeline("/nonexistent/timeline.json")


def test_plot_script_draws_a_gantt_chart(tmp_path):
    path = tmp_path / "timeline.json"
    _write(path)
    out = tmp_path / "gantt.png"
    proc = subprocess.run(
        [sys.executable, str(REPO / "experiments" / "plot_timeline.py"), str(path), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    bad = subprocess.run(
        [sys.executable, str(REPO / "experiments" / "plot_timeline.py"), str(tmp_path / "none.json")],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert bad.returncode == 2 and "not found" in bad.stderr
