"""End to end: ``python -m gyre_jax.train`` as users run it, through the real proxy and harness processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from timelimits import run_time_limits, scaled

REPO = Path(__file__).resolve().parent.parent
# A small version of the default config: same parts, fewer and shorter rollouts.
SMALL = [
    "--config",
    "configs/tiny_cpu.py",
    "--config.warm_start.steps=60",  # enough to learn the tool-call format, so calls chain
    "--config.rollout.tasks_per_step=1",
    "--config.rl.group_size=4",
    "--config.rollout.num_tasks=2",
    "--config.eval.samples_per_task=1",
    "--config.eval.num_tasks=1",  # held-out tasks (the default eval.split='both' scores training and held-out tasks)
    "--config.metrics.progress_bar=false",
]
SMALL_MODEL = ["--config.model.num_layers=1", "--config.model.embed_dim=32", "--config.model.mlp_dim=64",
               "--config.model.head_dim=8"]  # fmt: skip


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the entry point must create its own virtual devices
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _train(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The command line, with the harness and evaluator limits scaled to the machine's load (``args`` may override
    them) and ``timeout`` (a hang guard) scaled too."""
    return subprocess.run(
        [sys.executable, "-m", "gyre_jax.train", *run_time_limits(), *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
    )


def _metric_steps(workdir: Path) -> list[int]:
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [m["step"] for m in lines if m.get("phase") == "train"]


def _checkpoint_steps(workdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _assert_refused_before_work(code: int, stderr: str, key: str, workdir: Path) -> None:
    assert code == 2
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and key in lines[0]
    assert not workdir.exists(), "a bad config must fail before any work (no run directory)"


@pytest.mark.parametrize(
    "override, key",
    [
        ("--config.rl.group_size=1", "rl.group_size"),
        ("--config.rl.group_szie=4", "group_szie"),
        ("--config.mesh.data=3", "mesh"),
        ("--config.schedule.policy=nope", "schedule.policy"),
        ("--config.serving.kv_layout=pages", "serving.kv_layout"),
    ],
)
def test_bad_config_fails_before_work_with_one_line(tmp_path, capsys, override, key):
    """``gyre_jax.train.main`` in this process (a config error returns before JAX or any file is touched); the
    command line itself is exercised by the case below."""
    from gyre_jax.train import main

    code = main(["--config", "configs/tiny_cpu.py", f"--config.workdir={tmp_path / 'w'}", override])
    _assert_refused_before_work(code, capsys.readouterr().err, key, tmp_path / "w")


def test_bad_distributed_config_fails_before_work_with_one_line_from_the_command_line(tmp_path):
    proc = _train(
        "--config", "configs/tiny_cpu.py", f"--config.workdir={tmp_path / 'w'}", "--config.distributed.enabled=true",
        timeout=scaled(120),
    )  # fmt: skip
    _assert_refused_before_work(proc.returncode, proc.stderr, "config.distributed", tmp_path / "w")


def test_a_suite_that_cannot_load_or_does_not_fit_fails_before_work_with_one_line(tmp_path, capsys):
    """The config only names the suite; ``main`` loads it (``build.make_suite``) before any work: a directory that
    is not there, or a suite whose held-out split leaves nothing to train on, is one ``error:`` line, exit 2."""
    from gyre_jax.train import main

    one = {"name": "only", "instruction": "Write a.txt.", "task_toml": {},
           "files": {"environment/README.md": "x\n", "tests/test.sh": "echo 1 > \"$GYRE_LOGS/verifier/reward.txt\"\n"}}  # fmt: skip
    (tmp_path / "one.jsonl").write_text(json.dumps(one) + "\n")
    cases = [
        ([f"--config.rollout.suite=harbor:{tmp_path / 'missing'}"], "does not exist"),
        ([f"--config.rollout.suite=jsonl:{tmp_path / 'one.jsonl'}", "--config.rollout.heldout_fraction=0.5"], "none to train"),
    ]  # fmt: skip
    for overrides, words in cases:
        workdir = tmp_path / "w"
        code = main(["--config.warm_start.steps=0", f"--config.workdir={workdir}", *overrides])
        err = capsys.readouterr().err
        _assert_refused_before_work(code, err, "config.rollout.suite", workdir)
        assert words in err, err


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One fresh run of 2 RL steps (warm start, eval before and after, checkpoints 0 and 2); the tests below read
    it, and the resume test continues a copy of it."""
    workdir = tmp_path_factory.mktemp("two_steps") / "run"
    first = _train(*SMALL, f"--config.workdir={workdir}", "--config.total_steps=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return workdir, first


@pytest.mark.slow
def test_two_rl_steps(two_steps):
    workdir, first = two_steps
    assert _metric_steps(workdir) == [0, 1]
    assert 2 in _checkpoint_steps(workdir)
    assert "step 2/2" in first.stdout
    # Every execution ran through the proxy: TITO records exist and continued calls reuse exact ids.
    records = sorted((workdir / "records").glob("s*.jsonl"))
    assert len(records) == 2 * 4
    evals = sorted((workdir / "records").glob("eval*.jsonl"))
    assert len(evals) == 2 * (2 + 1) * 1, "eval before the first and after the last step: (2 + 1 held-out) x 1 sample"
    for step in (0, 2):
        results = [json.loads(x) for x in (workdir / "results" / f"eval_{step:06d}.jsonl").read_text().splitlines()]
        assert sorted(r["eval_split"] for r in results) == ["heldout", "train", "train"]
        assert all(("-heldout-" in r["execution_id"]) == (r["eval_split"] == "heldout") for r in results)
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    evals_logged = [(m["step"], m["eval_split"], m["eval_executions"]) for m in lines if m.get("phase") == "eval"]
    assert evals_logged == [(0, "train", 2), (0, "heldout", 1), (2, "train", 2), (2, "heldout", 1)]
    continued = 0
    for path in records:
        calls = [json.loads(line) for line in path.read_text().splitlines()]
        assert calls and [c["call_index"] for c in calls] == list(range(len(calls)))
        for prev, cur in zip(calls, calls[1:]):
            if cur["reused_prefix_len"]:
                continued += 1
                assert cur["prompt_ids"][: len(prev["prompt_ids"]) + len(prev["completion_ids"])] == (
                    prev["prompt_ids"] + prev["completion_ids"]
                )
    assert continued > 0, "some executions made several calls, each continuing the previous one's exact ids"
    # the serving side's reuse: continuing calls were decoded from their session's KV, never past their prompt
    cached = [json.loads(line)["cached_prompt_tokens"] for path in records for line in path.read_text().splitlines()]
    assert any(cached)
    results = [json.loads(line) for line in (workdir / "results" / "step_000000.jsonl").read_text().splitlines()]
    assert len(results) == 4 and all(r["status"] in ("finished", "timeout", "crashed") for r in results)
    assert (workdir / "tensorboard").is_dir() and any((workdir / "tensorboard").iterdir())


@pytest.mark.slow
def test_the_step_profile_splits_each_step_of_the_run(two_steps, tmp_path):
    """``gyre_jax.sim.step_profile`` on the run: each cell's parts add up to the step's window, the windows follow
    each other and match the controller's own ``step_s``, the compute parts did work; then the benchmark on the same
    run directory (``bench_step_profile.py --run-dir``) writes its JSON, with each part's rate against a measured
    roofline, and the Gantt. Never asserts a speed."""
    from gyre_jax.sim.step_profile import PARTS, step_profiles

    workdir, _ = two_steps
    profiles = step_profiles(workdir, resolution_s=0.002)
    assert [p.step for p in profiles] == [0, 1]
    assert profiles[1].t_start == profiles[0].t_end
    metrics = {m["step"]: m for m in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
               if m.get("phase") == "train"}  # fmt: skip
    # the controller's step_s runs from the previous optimizer step's end to this one's: ours from publish to publish
    assert abs(profiles[1].window_s - metrics[1]["step_s"]) < 0.5, (profiles[1].window_s, metrics[1]["step_s"])
    for p in profiles:
        assert set(p.seconds) == {"cell0", "cell1"}
        for cell, sec in p.seconds.items():
            assert set(sec) == set(PARTS) and min(sec.values()) >= 0
            assert abs(sum(sec.values()) - p.window_s) <= 0.004, (cell, sec, p.window_s)
        total = {part: sum(s[part] for s in p.seconds.values()) for part in PARTS}
        assert total["training"] > 0 and total["decode"] > 0 and total["prefill"] > 0 and total["harness"] > 0, total
        assert total["optimizer"] > 0 and p.seconds["cell1"]["optimizer"] == 0  # the core's (cell 0)
        assert p.work["micro_steps"] >= 1 and p.work["training_flops"] > 0 and p.work["prefill_tokens"] > 0
        assert p.work["decode_tokens"] >= p.work["decode_steps"] > 0
        assert abs(sum(b - a for a, b, _ in p.segments["cell0"]) - sum(p.seconds["cell0"].values())) < 1e-6
    out = tmp_path / "profile.json"
    env = dict(_env(), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "benchmarks/bench_step_profile.py", "--run-dir", str(workdir), "--out",
                           str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(300))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [s["step"] for s in report["steps"]] == [0, 1] and report["run_wall_s"] is None
    used = report["rooflines"]["used"]
    assert used["matmul_flops_per_s"] > 0 and used["read_bytes_per_s"] > 0
    rates = report["steps"][1]["rates"]
    assert set(rates) == {"training", "prefill", "decode", "optimizer"}
    assert rates["training"]["work"] == profiles[1].work["training_flops"] and rates["training"]["rate"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| cell | prefill | decode |" in done.stdout


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_run_resumes(two_steps, tmp_path):
    """Resumes a copy of the 2-step run with a long ``total_steps``, SIGTERMs it after its first RL step, then
    resumes again to one step more: the resume path (no warm start redone, no step dropped or repeated) and the
    SIGTERM path (a checkpoint at the step cursor) on one run, without a second warm start."""
    workdir = tmp_path / "run"
    shutil.copytree(two_steps[0], workdir)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gyre_jax.train",
            *run_time_limits(),
            *SMALL,
            f"--config.workdir={workdir}",
            "--config.total_steps=50",
        ],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + scaled(400)
        while time.monotonic() < deadline:
            if len(_metric_steps(workdir)) > 2:  # an RL step of the resumed run finished
                break
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.5)
        else:
            pytest.fail("no RL step finished in time")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=scaled(180))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "resumed" in err and "at step 2" in err
    assert "warm start" not in err  # the warm start is part of checkpoint 0, never redone
    assert "stopped at step" in err
    done = _metric_steps(workdir)
    assert done == list(range(len(done))) and len(done) >= 3, "a resumed run neither drops nor repeats a step"
    assert _checkpoint_steps(workdir)[-1] == len(done), "the checkpoint cursor is the next step to run"
    again = _train(*SMALL, f"--config.workdir={workdir}", f"--config.total_steps={len(done) + 1}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed" in again.stderr and f"at step {len(done)}" in again.stderr
    assert _metric_steps(workdir) == list(range(len(done) + 1))
    assert len(done) + 1 in _checkpoint_steps(workdir)
    meta = json.loads((workdir / "checkpoints" / str(len(done) + 1) / "meta" / "metadata").read_text())
    assert meta["next_step"] == len(done) + 1 and meta["policy_version"] <= len(done) + 1


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["async", "elastic"])
def test_async_and_elastic_policies_run_end_to_end_with_a_timeline(tmp_path, policy):
    """``--config.schedule.policy=P`` on 8 virtual CPU devices (colocated is the default, run above)."""
    workdir = tmp_path / "run"
    proc = _train(
        *SMALL,
        f"--config.workdir={workdir}",
        "--config.total_steps=2",
        "--config.eval.samples_per_task=0",
        "--config.warm_start.steps=0",
        f"--config.schedule.policy={policy}",
        "--config.rollout.tool_latency_median_s=0.1",
        *SMALL_MODEL,  # the policies' wiring, not learning: the least to compile
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _metric_steps(workdir) == [0, 1]
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    for m in (m for m in metrics if m.get("phase") == "train"):
        assert m["policy"] == policy and m["executions"] == 4
        assert 0.0 <= m["idle_fraction/cell0"] <= 1.0 and 0.0 <= m["idle_fraction/cell1"] <= 1.0
    from gyre_jax.elastic.timeline import load_timeline

    tl = load_timeline(workdir / "timeline" / "step000000.json")
    assert tl.cells == ["cell0", "cell1"]
    assert any(s.name == "training" for s in tl.roles[0]), "the core trains"
    assert len(tl.optimizer_steps) == 2 and len(tl.executions) == 2 * 4
    if policy == "async":  # a fixed split: cell 1 never leaves serving
        assert {s.name for s in tl.roles[1]} == {"serving"}


@pytest.mark.slow
def test_the_paged_kv_layout_serves_an_elastic_run_end_to_end(tmp_path):
    """``--config.serving.kv_layout=paged``: every cell serves from one page pool (slots and cached sessions), and
    elastic switches move sessions between the cells' pools."""
    workdir = tmp_path / "run"
    proc = _train(
        *SMALL,
        f"--config.workdir={workdir}",
        "--config.total_steps=2",
        "--config.eval.samples_per_task=0",
        "--config.warm_start.steps=0",
        "--config.schedule.policy=elastic",
        "--config.serving.kv_layout=paged",
        "--config.serving.kv_pages=256",
        "--config.rollout.tool_latency_median_s=0.1",
        *SMALL_MODEL,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _metric_steps(workdir) == [0, 1]
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if m.get("phase") == "train"]
    assert all(m["executions"] == 4 for m in train)
