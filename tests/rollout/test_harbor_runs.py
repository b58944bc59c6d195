"""Harbor tasks run by the real executor in the bwrap sandbox, scored by their own tests/test.sh in a fresh
sandbox: an upstream-format task unchanged, what the harness and the verifier can see, every way a verifier
can fail (each excluded with its kind, never scored 0), and the oracle check of the bundled suite."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from timelimits import scaled

from gyre_jax.rollout.check_suite import KeysOnly
from gyre_jax.rollout.executor import ExecutionSpec, Executor
from gyre_jax.rollout.sandbox import make_sandbox
from gyre_jax.rollout.suites import load_harbor_task, load_tasks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_suites import write_upstream_task  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

if shutil.which("bwrap") is None:
    if os.geteuid() == 0:
        pytest.fail("bwrap is missing: `sh scripts/install_system_deps.sh` installs it (apt-get install -y bubblewrap)")
    pytestmark = pytest.mark.skip(reason="bwrap is missing and this is not root: sudo apt-get install -y bubblewrap")


def run(tmp_path: Path, task, cmd: list[str], env: dict[str, str] | None = None, suite_root: Path | None = None):
    root = tmp_path / "run"
    sandbox = make_sandbox("bwrap", proxy_address=None, hide=[root, suite_root or Path(task.source).parent],
                           state_dir=tmp_path / "state")  # fmt: skip
    executor = Executor(KeysOnly(), "http://127.0.0.1:9/v1", root / "executions", model_name="m", timeout_s=scaled(30),
                        max_parallel=1, temperature=1.0, max_tokens=8, harness_cmd=cmd, extra_env=env or {},
                        sandbox=sandbox, network="none", evaluator_timeout_s=scaled(20))  # fmt: skip
    try:
        [result] = executor.run([ExecutionSpec("e0", task, task.task_id, seed=0)])
    finally:
        sandbox.close()
    return result, root / "executions" / "e0"


def test_an_upstream_task_runs_unchanged_in_bwrap(tmp_path):
    task = load_harbor_task(write_upstream_task(tmp_path / "suite"))
    solved, exec_dir = run(tmp_path / "a", task, ["sh", "-c", "echo 'hello, world' > /app/greeting.txt"])
    assert solved.status == "finished" and solved.reward == 1.0, solved
    assert (exec_dir / "workspace" / "notes.txt").read_text() == "starting file\n"  # environment/ minus Dockerfile
    assert not (exec_dir / "workspace" / "Dockerfile").exists()
    assert (exec_dir / "verifier" / "logs" / "verifier" / "reward.txt").read_text().strip() == "1"
    applied = solved.sandbox
    # no allow_internet / network_mode in its task.toml: Harbor's default, the internet (the host's network)
    assert applied["backend"] == "bwrap" and applied["network"] == "host" and applied["memory_mb"] == 2048
    assert applied["environment"] == "session"  # built from its Dockerfile, harness and verifier in one session
    assert applied["cpus"] == 1.0 and applied["limits"] in ("cgroup-v1", "cgroup-v2", "affinity", "none")
    untouched, _ = run(tmp_path / "b", task, ["true"])
    assert untouched.status == "finished" and untouched.reward == 0.0 and not untouched.excluded


def test_the_harness_sees_neither_tests_nor_solution_and_the_verifier_none_of_its_environment(tmp_path):
    task_dir = write_upstream_task(tmp_path / "suite")
    (task_dir / "tests" / "test.sh").write_text(
        "#!/bin/bash\nenv > /logs/verifier/env.txt\nls /app > /logs/verifier/app.txt\n"
        "echo 0.5 > /logs/verifier/reward.txt\n"
    )
    task = load_harbor_task(task_dir)
    look = (f"ls /tests /solution {task_dir} {task_dir / 'tests'} > /app/looked.txt 2>&1; "
            "cat /gyre/task.json > /app/task_seen.json; echo $GYRE_SECRET > /app/secret.txt")  # fmt: skip
    result, exec_dir = run(tmp_path / "r", task, ["sh", "-c", look], env={"GYRE_SECRET": "s3cret"})
    assert result.reward == 0.5, result
    looked = (exec_dir / "workspace" / "looked.txt").read_text()
    assert "No such file" in looked and "test.sh" not in looked and "solve.sh" not in looked, looked
    assert json.loads((exec_dir / "workspace" / "task_seen.json").read_text())["instruction"] == task.instruction
    assert (exec_dir / "workspace" / "secret.txt").read_text().strip() == "s3cret"  # the harness had it ...
    env = (exec_dir / "verifier" / "logs" / "verifier" / "env.txt").read_text()
    assert "s3cret" not in env and "OPENAI_API_KEY" not in env and "ANTHROPIC" not in env  # ... the verifier not
    assert "GYRE_TESTS=/tests" in env and "GYRE_WORKSPACE=/app" in env
    assert "looked.txt" in (exec_dir / "verifier" / "logs" / "verifier" / "app.txt").read_text()


@pytest.mark.parametrize(
    ("script", "kind", "reason"),
    [
        ("true", "evaluator_error", "wrote no reward"),
        ("echo many > /logs/verifier/reward.txt", "evaluator_error", "expected a number"),
        ("echo nan > /logs/verifier/reward.txt", "evaluator_bad_value", "nan"),
        ("echo 1.5 > /logs/verifier/reward.txt", "evaluator_bad_value", "1.5"),
        ('echo \'{"score": "high"}\' > /logs/verifier/reward.json', "evaluator_error", "reward.json holds"),
        ("sleep 30; echo 1 > /logs/verifier/reward.txt", "evaluator_timeout", "exceeded 1.0 s"),
    ],
)
def test_a_failing_verifier_excludes_the_execution_with_its_kind(tmp_path, script, kind, reason):
    limit = float(round(scaled(1.0)))  # the verifier's limit: only the hanging script reaches it, loaded or not
    script = script.replace("sleep 30;", "sleep 3600;")  # ... and that one outlives it however far it is scaled
    reason = reason.replace("exceeded 1.0 s", f"exceeded {limit} s")
    task_dir = write_upstream_task(tmp_path / "suite")
    (task_dir / "tests" / "test.sh").write_text(f"#!/bin/bash\n{script}\n")
    toml = (task_dir / "task.toml").read_text()
    (task_dir / "task.toml").write_text(
        toml.replace("[verifier]\ntimeout_sec = 30.0", f"[verifier]\ntimeout_sec = {limit}")
    )
    result, _ = run(tmp_path / "r", load_harbor_task(task_dir), ["true"])
    assert result.excluded and result.reward is None and result.exclusion_kind == kind, result
    assert reason in result.exclusion_reason


def test_reward_json_is_read(tmp_path):
    task_dir = write_upstream_task(tmp_path / "suite")
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\necho '{\"reward\": 0.25}' > /logs/verifier/reward.json\n")
    result, _ = run(tmp_path / "r", load_harbor_task(task_dir), ["true"])
    assert result.reward == 0.25


def check_suite(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gyre_jax.rollout.check_suite", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=scaled(900))  # fmt: skip


def test_check_suite_fails_a_wrong_oracle_and_a_solved_start(tmp_path):
    write_upstream_task(tmp_path, "good")
    bad = write_upstream_task(tmp_path, "wrong-oracle")
    (bad / "solution" / "solve.sh").write_text("echo 'hello' > /app/greeting.txt\n")
    easy = write_upstream_task(tmp_path, "solved-start")
    (easy / "environment" / "greeting.txt").write_text("hello, world\n")  # in the image only if COPY'd (Docker's rule)
    (easy / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\nCOPY . /app/\n")
    done = check_suite(str(tmp_path), "--json", str(tmp_path / "rows.json"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL wrong-oracle: the oracle scored 0.0" in done.stdout
    assert "FAIL solved-start: the starting state scored 1.0" in done.stdout
    assert "FAIL good" not in done.stdout
    rows = {r["task"]: r for r in json.loads((tmp_path / "rows.json").read_text())["rows"]}
    assert rows["good"]["oracle"] == 1.0 and rows["good"]["start"] == 0.0


def test_every_oracle_of_the_bundled_suite_scores_1_and_every_start_below_0_2(tmp_path):
    """The bundled suite through the real executor, bwrap and verifier (the issue's oracle check)."""
    tasks, _ = load_tasks(f"harbor:{REPO / 'suites' / 'pyrepo'}")
    assert len(tasks) >= 24
    done = check_suite("suites/pyrepo", "--sandbox", "bwrap", "--json", str(tmp_path / "rows.json"))
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert len(rows) == len(tasks)
    assert all(r["oracle"] == 1.0 and r["start"] < 0.2 for r in rows)
    assert {r["sandbox"]["backend"] for r in rows} == {"bwrap"}


ISOLATION_HARNESS = r"""
import json, os, socket, subprocess, sys, time, urllib.request
out = {"key": os.environ["OPENAI_API_KEY"], "base_url": os.environ["OPENAI_BASE_URL"]}
other = sys.argv[1]
def can_read(path):
    try:
        return sorted(os.listdir(path)) if os.path.isdir(path) else open(path).read()
    except OSError as exc:
        return None
out["other_workspace"] = can_read(other)
out["records"] = can_read(sys.argv[2])
environs = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            environs.append(open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace"))
        except OSError:
            pass
out["keys_seen"] = sorted({k for e in environs for k in e.split("\0") if k.startswith("OPENAI_API_KEY=")})
out["proxy"] = urllib.request.urlopen(os.environ["OPENAI_BASE_URL"] + "/models", timeout=60).read().decode()
def reach(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False
out["other_port"] = reach(int(sys.argv[3]))
subprocess.Popen(["setsid", "bash", "-c", "(exec -a gyre-daemon-" + out["key"] + " sleep 3600 &)"])
for _ in range(600):  # until the daemon shows (an event, not a fixed delay), for at most a minute
    out["daemon_started"] = any(
        b"gyre-daemon-" in open(f"/proc/{p}/cmdline", "rb").read() for p in os.listdir("/proc") if p.isdigit()
    )
    if out["daemon_started"]:
        break
    time.sleep(0.1)
json.dump(out, open("isolation.json", "w"))
time.sleep(3600)
"""


def test_concurrent_executions_are_isolated_and_a_timeout_leaves_nothing(tmp_path):
    """Two harness processes at once through the executor in bwrap, with network "proxy" to a real HTTP server
    standing in for the proxy: neither sees the other's workspace, the run's records or the other's key; only
    the proxy answers; each leaves a setsid'd daemon and is killed at its timeout, and nothing survives."""
    import http.server
    import threading

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = b'{"data": [{"id": "m"}]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), Models) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    proxy, other = servers
    root = tmp_path / "run"
    (root / "records").mkdir(parents=True)
    (root / "records" / "e0.jsonl").write_text("secret record\n")
    base_url = f"http://127.0.0.1:{proxy.server_address[1]}/v1"

    class Keys:
        def open_execution(self, execution_id):
            return f"key-{execution_id}"

        def close_execution(self, execution_id):
            return None

    sandbox = make_sandbox("bwrap", proxy_address=proxy.server_address, hide=[root], state_dir=tmp_path / "state")
    cmd = [sys.executable, "-c", ISOLATION_HARNESS, "{task.instruction}", str(root / "records"),
           str(other.server_address[1])]  # fmt: skip
    executor = Executor(Keys(), base_url, root / "executions", model_name="m", timeout_s=scaled(8), max_parallel=2,
                        temperature=1.0, max_tokens=8, harness_cmd=cmd, sandbox=sandbox, kill_grace_s=0.5)  # fmt: skip
    tasks = [replace_instruction(str(root / "executions" / other_id / "workspace")) for other_id in ("e1", "e0")]
    try:
        results = executor.run([ExecutionSpec(f"e{i}", t, f"g{i}", seed=i) for i, t in enumerate(tasks)])
    finally:
        sandbox.close()
        for s in servers:
            s.shutdown()
    for i, r in enumerate(results):
        assert r.status == "timeout" and r.sandbox["network"] == "proxy", r
        seen = json.loads((root / "executions" / f"e{i}" / "workspace" / "isolation.json").read_text())
        assert seen["key"] == f"key-e{i}" and seen["base_url"] == base_url
        assert seen["other_workspace"] is None and seen["records"] is None, seen
        assert seen["keys_seen"] == [f"OPENAI_API_KEY=key-e{i}"], seen  # its own process only
        assert json.loads(seen["proxy"]) == {"data": [{"id": "m"}]} and seen["other_port"] is False
        assert seen["daemon_started"] is True
    deadline = time.monotonic() + scaled(5)  # killed at once; gone from /proc once reaped
    while left := [p for p in Path("/proc").iterdir() if p.name.isdigit() and b"gyre-daemon-key-e" in _cmdline(p)]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, "a daemon of a timed-out harness survived"


def replace_instruction(other_workspace: str):
    from gyre_jax.rollout.tasks import ANSWER_FILE, INPUT_FILE, Task

    return Task(task_id="t", kind="upper", system="", instruction=other_workspace, files={INPUT_FILE: "ab"},
                expected={ANSWER_FILE: "AB"}, tools=[], max_turns=1, tool_latency_median_s=0.0,
                tool_latency_sigma=0.0)  # fmt: skip


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""
