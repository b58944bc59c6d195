"""The ablation scripts and the speed benchmark run end to end on small settings and write what they say."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from timelimits import scaled

REPO = Path(__file__).resolve().parents[2]


def _run(args, timeout=300):
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=scaled(timeout), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_ablate_scheduling_quick(tmp_path):
    out = _run(["experiments/ablate_scheduling.py", "--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "ablate_scheduling.json").read_text())
    row = report["summary"]["presets"]["tiny"]
    runs = report["runs"]
    assert row["elastic_vs_colocated"] == runs["tiny/colocated"]["step_time_s"] / runs["tiny/elastic"]["step_time_s"]
    assert {
        "tiny/colocated",
        "tiny/async-half",
        "tiny/elastic",
        "tiny/elastic-eta0",
        "tiny/async-half-nostream",
    } <= set(runs)
    assert all(0 < r["busy_fraction"] <= 1 for r in runs.values())
    for png in ("speedups.png", "utilization.png", "gantt_tiny.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    assert "| tiny |" in out and "| tiny |" in (tmp_path / "summary.md").read_text()


def test_ablate_traj_cap_quick(tmp_path):
    _run(["experiments/ablate_traj_cap.py", "--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "ablate_traj_cap.json").read_text())
    d = report["presets"]["tiny"]
    shares = [d["work_shares"]["caps"][c]["flops_share"] for c in ("J=1", "J=3", "J=5", "uncapped")]
    assert shares == sorted(shares) and shares[-1] == 1.0 and shares[0] < 0.5  # the caps bite in the quick shape
    el = d["runs"]["elastic"]
    assert el["J=1"]["training_flops"] < el["J=5"]["training_flops"] < el["uncapped"]["training_flops"]
    assert el["J=1"]["step_time_s"] <= el["uncapped"]["step_time_s"]
    assert (tmp_path / "traj_cap.png").read_bytes()[:4] == b"\x89PNG"


def test_ablate_traj_cap_reads_measured_ratios(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps(
            {
                "training": {
                    "variants": [
                        {"name": "uncapped", "packing": "plain", "step_time_vs_uncapped": 1.0},
                        {"name": "J=5", "packing": "plain", "step_time_vs_uncapped": 0.7},
                        {"name": "J=5 tree", "packing": "tree", "step_time_vs_uncapped": 0.5},
                    ]
                }
            }
        )
    )
    _run(["experiments/ablate_traj_cap.py", "--quick", "--measured", str(bench), "--out", str(tmp_path / "o")])
    report = json.loads((tmp_path / "o" / "ablate_traj_cap.json").read_text())
    el = report["presets"]["tiny"]["runs"]["elastic"]
    assert report["measured_ratios"] == {"uncapped": 1.0, "J=5": 0.7}
    assert abs(el["J=5 (measured)"]["training_flops_vs_uncapped"] - 0.7) < 1e-9


def test_speed_benchmark_writes_its_table(tmp_path):
    out = tmp_path / "speed.json"
    text = _run(
        ["-m", "gyre_jax.sim.bench", "--preset", "tiny", "--steps", "3", "--baseline-steps", "2", "--out", str(out)]
    )
    report = json.loads(out.read_text())
    assert report["deterministic"] is True and len(report["rows"]) == 5
    assert report["rows"][-1]["segments"] == 40 and report["rows"][-1]["events"] > report["rows"][-2]["events"]
    assert "per-call baseline" in text


def test_ablate_elastic_ideal_quick(tmp_path):
    out = _run(["experiments/ablate_elastic_ideal.py", "--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "elastic_vs_ideal.json").read_text())
    rows, runs = report["summary"]["tiny"], report["runs"]
    best = min((r for k, r in runs.items() if k.startswith("tiny/eta1/async-")), key=lambda r: r["step_time_s"])
    partial = runs["tiny/eta1/+ partial rollouts"]
    assert partial["partial_rollouts"] and partial["drop_staleness"] == 2
    assert runs["tiny/eta1/+ longest first"]["policy_options"] == partial["policy_options"] == {"dispatch_staleness": 1}
    row = rows["+ partial rollouts (eta=1)"]
    assert row["speedup_vs_async_best_same_eta"] == best["step_time_s"] / partial["step_time_s"]
    assert row["busy"] == partial["busy_fraction"] and row["token_staleness_max"] <= 2
    assert "+ group streaming (eta=2)" not in rows and "+ longest first (eta=2)" in rows
    assert "| tiny | + longest first (eta=1) |" in out and "| tiny |" in (tmp_path / "summary.md").read_text()
