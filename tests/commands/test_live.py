"""The live view: ``elastic.live.LiveState`` (fed by the timeline and the driver, read without blocking them), its
routes on the proxy (``proxy/live.py``: loopback or the run's key), and the page in a real headless browser
(Debian's chromium) during a real elastic run: it renders, updates, and shows the cells' roles changing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gyre_jax.elastic.events import StepBegan
from gyre_jax.elastic.live import LiveState
from gyre_jax.elastic.state import Cells as RoleCells
from gyre_jax.elastic.state import Role, Waterlevel, cluster_state
from gyre_jax.elastic.timeline import TimelineWriter
from gyre_jax.proxy.live import LiveRoutes

REPO = Path(__file__).resolve().parents[2]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


class Books:
    """The ledger's books ``cluster_state`` reads (``state.RolloutBooks``)."""

    def __init__(self) -> None:
        self.wl = Waterlevel(dispatched=8, started=6, finished=2)
        self.batch_size = 8
        self.undispatched = 0

    def step_counts(self, step: int) -> tuple[int, int]:
        return 8, 2

    def due_outstanding(self, version: int) -> int:
        return 6


def _fed_live(t0: float = 1000.0) -> tuple[LiveState, TimelineWriter]:
    live = LiveState(["cell0", "cell1"], total_steps=3, policy="elastic", t0=t0)
    tl = TimelineWriter(None, ["cell0", "cell1"], source="run", t0=t0, listener=live.timeline_event)
    for c in (0, 1):
        tl.role(t0, c, "serving", reason="start")
    tl.execution_started(t0 + 1, "s0-a", step=0, cell=1)
    tl.execution_started(t0 + 1, "s0-b", step=0, cell=0)
    tl.waterlevel(t0 + 1, 8, 6, 0)
    tl.execution_ended(t0 + 3, "s0-a", "finished")
    tl.execution_ended(t0 + 4, "s0-b", "timeout")
    tl.role(t0 + 4, 0, "switching", reason="finished", to="training")
    tl.role(t0 + 5, 0, "training", reason="switched in 1.000s")
    tl.micro_step(t0 + 5, t0 + 6, 0, 0, slot=0, work=1e9)
    return live, tl


def test_live_state_folds_the_timeline_and_the_decisions() -> None:
    live, tl = _fed_live()
    roles = RoleCells([Role.TRAINING, Role.SERVING], [4, 4])
    state = cluster_state(1006.0, 0, roles, Books(), _facts())
    live.decision(StepBegan(0, 1006.0, executions=8), state)
    roles.role[0] = Role.SERVING  # the driver's lists change after the decision: the published copy must not
    view = live.snapshot()
    assert [s["role"] for s in view["roles"][0]] == ["serving", "switching", "training"]
    assert view["roles"][0][1]["to"] == "training" and view["roles"][0][0]["end"] == pytest.approx(4.0)
    assert view["roles"][0][2]["end"] is None and [s["role"] for s in view["roles"][1]] == ["serving"]
    assert view["micro_steps"][0] == [{"start": 5.0, "end": 6.0, "step": 0, "slot": 0}]
    assert view["step_counts"] == {"in_flight": 0, "finished": 1, "timeout": 1, "crashed": 0}
    assert view["waterlevel"] == [[1.0, 8, 6, 0]]
    assert view["state"]["roles"] == ["training", "serving"] and view["state"]["step_finished"] == 2
    assert view["event"] == "step_began" and view["cells"] == ["cell0", "cell1"]
    # A step ends: the window moves to it and the counts restart; spans that ended before the window go.
    tl.optimizer_step(1006.0, 1006.5, 0, 0, 1)
    live.step_done(0, {"reward_mean": 0.5, "loss": 0.1, "pass_rate": 0.25})
    tl.optimizer_step(1010.0, 1010.5, 0, 1, 2)
    view = live.snapshot()
    assert view["window_start"] == pytest.approx(6.5)
    assert all(s["end"] is None or s["end"] >= 6.5 for spans in view["roles"] for s in spans)
    assert view["executions"] == [] and view["step_counts"]["finished"] == 0
    assert view["steps"] == [{"step": 1, "reward_mean": 0.5, "pass_rate": 0.25, "loss": 0.1, "grad_norm": None,
                              "step_s": None, "policy_version": None, "excluded": None, "timeouts": None}]  # fmt: skip
    json.dumps(view)  # the served form


def _facts():
    from gyre_jax.elastic.state import TrainingFacts

    return TrainingFacts(processed=2, ready=1, in_flight=1)


def test_readers_never_hold_up_the_writers() -> None:
    """A reader snapshotting as fast as it can while the controller's thread writes 8K events: the writer
    finishes, and every snapshot the reader got is consistent (spans in order, counts never negative)."""
    live, tl = _fed_live()
    stop, seen, problems = threading.Event(), [0], []

    def read() -> None:
        while not stop.is_set():
            v = live.snapshot()
            seen[0] += 1
            if v["step_counts"]["in_flight"] < 0 or any(
                a["start"] > b["start"] for spans in v["roles"] for a, b in zip(spans, spans[1:])
            ):
                problems.append(v)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    t = 1010.0
    for i in range(2000):
        t += 0.01
        tl.execution_started(t, f"e{i}", step=1, cell=i % 2)
        tl.waterlevel(t, i + 1, i + 1, i)
        tl.role(t, 1, "serving" if i % 2 else "training", reason="x")
        tl.execution_ended(t, f"e{i}", "finished")
    stop.set()
    reader.join(30)
    assert not problems and seen[0] > 0
    view = live.snapshot()
    assert view["step_counts"]["finished"] == 2001 and len(view["waterlevel"]) <= 600


def test_the_routes_serve_loopback_or_the_run_key() -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    live, _ = _fed_live()
    app = FastAPI()
    LiveRoutes(live.snapshot, key="s3cret")(app)
    client = TestClient(app)  # its client address ("testclient") is not loopback: a remote reader
    assert client.get("/live/state").status_code == 403
    assert client.get("/live/state?key=wrong").status_code == 403
    ok = client.get("/live/state?key=s3cret")
    assert ok.status_code == 200 and ok.json()["cells"] == ["cell0", "cell1"]
    assert client.get("/live", headers={"Authorization": "Bearer s3cret"}).text.startswith("<!doctype html>")
    assert client.get("/live/trace?key=s3cret").status_code == 404  # no timeline file
    no_key = FastAPI()
    LiveRoutes(live.snapshot, key=None)(no_key)
    refused = TestClient(no_key).get("/live")
    assert refused.status_code == 403 and "open it on the run's machine" in refused.json()["error"]["message"]
    local = FastAPI()
    LiveRoutes(live.snapshot, key=None)(local)
    assert TestClient(local, client=("127.0.0.1", 5000)).get("/live/state").status_code == 200


# -- the page in a real browser during a real run ------------------------------------------------------------
RUN = [
    "--config", "configs/tiny_cpu.py", "--config.warm_start.steps=0", "--config.rollout.tasks_per_step=2",
    "--config.rl.group_size=4", "--config.rollout.num_tasks=4", "--config.eval.samples_per_task=0",
    "--config.metrics.progress_bar=false", "--config.model.num_layers=1", "--config.model.embed_dim=32",
    "--config.model.mlp_dim=64", "--config.model.head_dim=8", "--config.schedule.policy=elastic",
    "--config.rollout.tool_latency_median_s=0.3", "--config.rollout.timeout_s=300", "--config.total_steps=6",
]  # fmt: skip


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("chromium is needed for the live view's browser test: sh scripts/install_system_deps.sh (as root)")
    return path


def dump_dom(browser: str, url: str, profile: Path) -> str:
    """The page's DOM after its scripts ran (a fresh headless chromium; virtual time lets two polls happen)."""
    done = subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=2500",
                           "--dump-dom", url], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def screenshot(browser: str, url: str, profile: Path, out: Path) -> None:
    done = subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=2500",
                           "--hide-scrollbars", "--window-size=1400,1050", f"--screenshot={out}", url],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and out.is_file(), done.stderr[-2000:]


def _view(dom: str) -> dict | None:
    """What the page shows, read from its DOM: updates, step, phase, the current role of each cell, and the roles
    of each cell's Gantt spans; None when it is not the page (the run ended while the browser loaded it)."""
    if 'id="phase"' not in dom:
        return None
    roles = dict(re.findall(r'class="role \w+ cell-role" data-cell="(\d+)" data-role="(\w+)"', dom))
    spans: dict[str, list[str]] = {}
    for role, cell in re.findall(r'data-role="(\w+)" data-cell="(\d+)" class="role-span"', dom):
        spans.setdefault(cell, []).append(role)
    updates = re.search(r'id="updates" data-updates="(\d+)"', dom)
    step = re.search(r'id="step">([^<]*)<', dom)
    return {"updates": int(updates.group(1)) if updates else 0, "step": step.group(1) if step else "",
            "roles": roles, "spans": spans, "phase": re.search(r'id="phase">([^<]*)<', dom).group(1)}  # fmt: skip


@pytest.mark.slow
def test_the_page_in_a_browser_during_an_elastic_run(tmp_path: Path) -> None:
    browser = chromium()
    workdir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    log = open(tmp_path / "train.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "gyre_jax.train", *RUN, f"--config.workdir={workdir}"], cwd=REPO,
                            env={**env, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    views: list[dict] = []
    try:
        url = None
        deadline = time.monotonic() + 600
        while url is None:
            assert proc.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never logged its live view"
            found = re.search(r"live view of the cells: (http://\S+/live)", (tmp_path / "train.log").read_text())
            url = found.group(1) if found else None
            time.sleep(0.5)
        k = 0
        while proc.poll() is None and len(views) < 60:
            k += 1
            view = _view(dump_dom(browser, url, tmp_path / f"profile{k}"))
            if view is not None:
                views.append(view)
            if len(views) == 2 and not (tmp_path / "live.png").exists():
                screenshot(browser, url, tmp_path / "profile-shot", tmp_path / "live.png")
    finally:
        code = proc.wait(timeout=900)
        log.close()
    assert code == 0, (tmp_path / "train.log").read_text()[-3000:]
    assert len(views) >= 3, views
    # It renders: the page fetched the state and drew both cells.
    assert all(v["updates"] >= 1 and set(v["roles"]) == {"0", "1"} for v in views), views
    # It updates: the step shown moves on during the run.
    steps = [v["step"] for v in views]
    assert len(set(steps)) >= 2 and steps[-1] != "0/6", steps
    # The cells' roles change: a cell's Gantt row shows it serving and training; and the role shown for the cells
    # was not the same in every view.
    assert any({"serving", "training"} <= set(roles) for v in views for roles in v["spans"].values()), views
    assert len({tuple(sorted(v["roles"].items())) for v in views}) >= 2, [v["roles"] for v in views]
    assert (tmp_path / "live.png").stat().st_size > 10_000
