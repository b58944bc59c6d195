"""Terminal-Bench 2 and Harbor tasks as published (issue 48): every task.toml key loads, a Dockerfile is applied
without a daemon (a cached layer over the host, a writable layer per execution, one session for the harness and the
verifier), the verifier runs with the task's network and in the state the agent left, what cannot run here is
refused or excluded with its cause (never scored 0), and sandbox "none" leaves the trainer's interpreter alone.

Fixtures: tests/fixtures/harbor/tb2 (six unmodified Terminal-Bench 2 tasks), cookbook (Harbor's simple-task,
multi-reward and skills recipes, unmodified) and cookbook-offline (the same with pytest from PyPI instead of uv
from astral.sh). The whole 89-task set is read from ../shared/data/terminal-bench-2 when present."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from gyre_jax.build import make_suite
from gyre_jax.config import ConfigError, load_config
from gyre_jax.rollout import environments
from gyre_jax.rollout.sandbox.dockerfile import parse
from gyre_jax.rollout.sandbox.environment import Host, Reachability, base_image, task_needs
from gyre_jax.rollout.suites import SuiteError, load_harbor_task, load_tasks, suite_warnings
from gyre_jax.rollout.verifier import train_reward

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "harbor"
# ../shared/data beside the checkout (or two levels up, from a worktree such as /work/wt/<name>)
_BESIDE = [p / "shared" / "data" / "terminal-bench-2" for p in (REPO.parent, REPO.parent.parent)]
TB2_ALL = next((p for p in _BESIDE if p.is_dir()), _BESIDE[0])
HOST = Host("debian", "12", "bookworm", {"3.11": "/usr", "3.13": "/opt/py313"})


class FixedReach(Reachability):
    """Reachability with fixed answers: only ``reachable`` hosts answer (no network in unit tests)."""

    def __init__(self, reachable=("pypi.org", "deb.debian.org")) -> None:
        super().__init__()
        self.reachable = set(reachable)

    def _connect(self, endpoint):
        return endpoint[0] in self.reachable


def check_suite(*args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gyre_jax.rollout.check_suite", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def can_build() -> str:
    """Why task environments cannot be built here ("" when they can)."""
    if os.geteuid() != 0:
        return "task environments need root (overlayfs mounts)"
    for tool in ("bwrap", "unshare", "nsenter", "setpriv"):
        if shutil.which(tool) is None:
            return f"{tool} is missing"
    return ""


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=4):
            return True
    except OSError:
        return False


# -- the Dockerfile and task.toml as published ------------------------------------------------------------------


def test_a_dockerfile_is_read_into_steps_and_what_needs_docker_is_refused_by_line():
    df = parse(
        textwrap.dedent("""\
        # comment
        ARG PY=3.13
        FROM python:${PY}-slim-bookworm
        ENV A=1 B="two words"
        WORKDIR /app
        RUN apt-get update && \\
            apt-get install -y curl
        COPY --chown=0:0 src/ ./src/
        WORKDIR sub
        CMD ["python", "x.py"]
        """)
    )
    assert (
        df.base == "python:3.13-slim-bookworm" and df.workdir == "/app/sub" and df.env == {"A": "1", "B": "two words"}
    )
    assert [s.kind for s in df.steps] == ["ENV", "ENV", "WORKDIR", "RUN", "COPY", "WORKDIR"]
    assert df.steps[3].args[0].split() == "apt-get update && apt-get install -y curl".split()
    assert df.steps[3].lineno == 6
    assert df.refusals == [] and "CMD has no effect" in df.notes[0]
    bad = parse("FROM ubuntu:24.04 AS build\nRUN make\nFROM ubuntu:24.04\nCOPY --from=ghcr.io/astral-sh/uv:0.8 /uv /bin/\n"
                "USER app\nRUN <<EOF\necho hi\nEOF\n")  # fmt: skip
    assert len(bad.refusals) == 4 and "line 3" in bad.refusals[0] and "multi-stage" in bad.refusals[0]
    assert "COPY --from=ghcr.io/astral-sh/uv:0.8 needs that image" in bad.refusals[1]
    assert "USER app" in bad.refusals[2] and "heredocs" in bad.refusals[3]


def test_base_images_are_approximated_by_this_host_or_refused_with_the_reason():
    assert base_image("python:3.13-slim-bookworm", HOST).approximated == ""
    assert base_image("python:3.13-slim-bookworm", HOST).python_prefix == "/opt/py313"
    assert "debian 12" in base_image("ubuntu:24.04", HOST).approximated
    assert base_image("debian:bookworm-slim", HOST).approximated == ""
    assert "no Python 3.12 on this machine" in base_image("python:3.12-slim", HOST)
    assert "only debian, ubuntu and python" in base_image("alpine:3.19", HOST)
    assert "not Debian or Ubuntu" in base_image("ubuntu:24.04", Host("fedora", "40", "", {}))


def test_every_terminal_bench_2_task_and_harbor_recipe_loads():
    for root, count in ((FIXTURES / "tb2", 6), (FIXTURES / "cookbook", 3), (FIXTURES / "cookbook-offline", 3)):
        tasks, _ = load_tasks(f"harbor:{root}")
        assert len(tasks) == count and suite_warnings(tasks) == []
        assert all(t.environment["mode"] == "build" and t.environment["allow_internet"] for t in tasks)
    tb2 = {t.task_id: t for t in load_tasks(f"harbor:{FIXTURES / 'tb2'}")[0]}
    cancel = tb2["cancel-async-tasks"].environment
    assert cancel["docker_image"] == "alexgshaw/cancel-async-tasks:20251031" and cancel["memory_mb"] == 2048
    assert cancel["storage_mb"] == 10240 and cancel["build_timeout_s"] == 600.0 and cancel["verifier_internet"]
    skills = load_harbor_task(FIXTURES / "cookbook" / "skills")
    assert skills.environment["skills_dir"] == "/skills"
    if not TB2_ALL.is_dir():
        pytest.skip(f"the whole Terminal-Bench 2 set is not here ({TB2_ALL}); its six fixtures loaded")
    everything, _ = load_tasks(f"harbor:{TB2_ALL}")
    assert len(everything) == 89 and suite_warnings(everything) == []


def test_an_unknown_key_is_a_warning_and_a_bad_value_one_error_line(tmp_path):
    task = tmp_path / "suite" / "t"
    shutil.copytree(FIXTURES / "cookbook" / "simple-task", task)
    toml = task / "task.toml"
    toml.write_text("future_key = 1\n" + toml.read_text() + "\n[agent.extra]\nx = 1\n")
    [loaded], _ = load_tasks(f"harbor:{tmp_path / 'suite'}")
    assert suite_warnings([loaded]) == [f"task t: task.toml has keys gyre-jax does not know (ignored): "
                                        f"{['agent.extra', 'future_key']}"]  # fmt: skip
    for bad, message in (("[environment]\nnetwork_mode = 'lan'\n", "network_mode='lan' must be one of"),
                         ("[environment]\ndocker_image = 3\n", "docker_image must be a non-empty string"),
                         ("[environment]\nstorage = 'huge'\n", "storage must be a positive number"),
                         ("[verifier]\nreward_key = ''\n", "reward_key must be a non-empty string"),
                         ("[solution]\nenv = {K = 1}\n", r"\[solution\] env must map names to strings")):  # fmt: skip
        toml.write_text(bad)
        with pytest.raises(SuiteError, match=message) as info:
            load_tasks(f"harbor:{tmp_path / 'suite'}")
        assert "\n" not in str(info.value) and "task t" in str(info.value)
    done = check_suite(str(tmp_path / "suite"), timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: task t") and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match=r"config.rollout.suite=.*task t .*reward_key"):
        toml.write_text("[verifier]\nreward_key = ''\n")
        make_suite(load_config([f"--config.rollout.suite=harbor:{tmp_path / 'suite'}", "--config.warm_start.steps=0"]))


def test_named_rewards_train_by_a_documented_rule():
    assert train_reward({"reward": 0.5, "style": 1.0}, None) == 0.5  # "reward" when present
    assert train_reward({"correctness": 1, "performance": 0}, None) == 0.5  # else the mean of the named rewards
    assert train_reward({"correctness": 1, "performance": 0}, "correctness") == 1.0  # a task's [verifier] reward_key
    with pytest.raises(ValueError, match="under 'speed'"):
        train_reward({"correctness": 1}, "speed")
    with pytest.raises(ValueError, match="named numbers"):
        train_reward({"correctness": "yes"}, None)


def test_what_a_task_needs_here_and_why_it_is_refused():
    tb2 = {t.task_id: t for t in load_tasks(f"harbor:{FIXTURES / 'tb2'}")[0]}
    reach = FixedReach()

    def refused(name: str, sandbox: str = "bwrap") -> list[str]:
        task = tb2[name]
        return environments.problems(task, sandbox, task_needs(Path(task.source), HOST, reach), oracle=True)

    [line] = refused("cancel-async-tasks")
    assert "verifier: tests/test.sh line 8: host astral.sh:443 is not reachable" in line
    [line] = refused("fix-code-vulnerability")
    assert "environment: environment/Dockerfile line 9: host github.com:443 is not reachable" in line
    assert any("oracle: solution/solve.sh" in r and "huggingface.co" in r for r in refused("hf-model-inference"))
    assert refused("largest-eigenval") == [] and refused("headless-terminal") == []
    # Under sandbox "none" a task built from its Dockerfile is refused: nothing of it may touch this machine
    assert "built only by sandbox 'bwrap' or 'docker'" in refused("largest-eigenval", "none")[0]
    # The published recipes need the uv installer's host; with it reachable they need nothing missing
    simple = load_harbor_task(FIXTURES / "cookbook" / "simple-task")
    needs = task_needs(Path(simple.source), HOST, reach)
    assert [n.what for n in needs if not n.has] == ["host astral.sh:443"]
    assert environments.problems(simple, "bwrap", task_needs(Path(simple.source), HOST,
                                                             FixedReach(["astral.sh"]))) == []  # fmt: skip


# -- environments built and run (root, bwrap, overlayfs) -----------------------------------------------------------

SERVER_TASK = {
    "instruction.md": "Start the state server and create /server-out/done.\n",
    "task.toml": "version = '1.0'\n[verifier]\ntimeout_sec = 60.0\n[agent]\ntimeout_sec = 60.0\n"
                 "[environment]\nallow_internet = false\n",
    "environment/Dockerfile": "FROM debian:bookworm-slim\nENV GREETING=hello\nRUN mkdir -p /srv/made && "
                              "echo by-run > /srv/made/x\nWORKDIR /app\nCOPY data.txt ./\n",
    "environment/data.txt": "copied\n",
    # the oracle: a file in the image's root (writable), and two daemons that must still be up for the verifier, as
    # in a container (docker exec kills nothing): one detached with setsid, one a plain background job of the
    # oracle's own process group (which the executor used to kill when the oracle exited)
    "solution/solve.sh": "#!/bin/bash\nmkdir -p /server-out && echo \"$GREETING\" > /server-out/done\n"
                         "setsid nohup sh -c 'while true; do date +%s%N > /tmp/alive; sleep 0.1; done' "
                         ">/dev/null 2>&1 < /dev/null &\n"
                         "sh -c 'while true; do date +%s%N > /tmp/alive2; sleep 0.1; done' >/dev/null 2>&1 &\n",
    "tests/test.sh": "#!/bin/bash\nok=1\n[ \"$(cat /srv/made/x)\" = by-run ] || ok=0\n"
                     "[ \"$(cat /app/data.txt)\" = copied ] || ok=0\n[ \"$GREETING\" = hello ] || ok=0\n"
                     "[ \"$(cat /server-out/done 2>/dev/null)\" = hello ] || ok=0\n"
                     # a daemon is alive when its file changes within 20 s (polled: a loaded machine may starve it)
                     "changes() {\n  a=''; i=0\n  while [ $i -lt 200 ]; do\n    b=$(cat \"$1\" 2>/dev/null)\n"
                     "    if [ -n \"$b\" ]; then\n      if [ -z \"$a\" ]; then a=$b; elif [ \"$b\" != \"$a\" ]; then "
                     "return 0; fi\n    fi\n    sleep 0.1; i=$((i+1))\n  done\n  return 1\n}\n"
                     "if [ $ok = 1 ]; then changes /tmp/alive || ok=0; fi\n"
                     "if [ $ok = 1 ]; then changes /tmp/alive2 || ok=0; fi\n"
                     "if [ \"$(cat /etc/hostname 2>/dev/null)\" = never ]; then ok=0; fi\n"
                     "echo $ok > /logs/verifier/reward.txt\n",
}  # fmt: skip


def write_task(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.slow
def test_a_dockerfile_environment_is_built_once_and_the_verifier_sees_what_the_agent_left(tmp_path):
    why = can_build()
    if why:
        pytest.skip(why)
    suite = tmp_path / "suite"
    write_task(suite / "state-server", SERVER_TASK)
    cache = tmp_path / "layers"
    env = {**os.environ, "GYRE_ENV_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-m", "gyre_jax.rollout.check_suite", str(suite), "--json",
                           str(tmp_path / "rows.json"), "--workdir", str(tmp_path / "runs"), "--keep"], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    [row] = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert row["oracle"] == 1.0 and row["start"] == 0.0, row  # RUN, COPY, ENV, root writes and the daemon: all seen
    assert row["sandbox"]["environment"] == "session" and row["sandbox"]["network"] == "none"
    assert not Path("/srv/made").exists() and not Path("/server-out").exists()  # nothing reached this machine
    layers = [p for p in cache.iterdir() if p.name.startswith("layer-") and p.is_dir()]
    assert len(layers) == 1 and (layers[0] / "upper" / "srv" / "made" / "x").read_text() == "by-run\n"
    again = subprocess.run([sys.executable, "-m", "gyre_jax.rollout.check_suite", str(suite)], cwd=REPO,
                           capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert again.returncode == 0 and "cached" in again.stdout, again.stdout


@pytest.mark.slow
def test_a_failing_task_keeps_its_run_and_explains_itself(tmp_path):
    why = can_build()
    if why:
        pytest.skip(why)
    files = {**SERVER_TASK, "solution/solve.sh": "#!/bin/bash\necho 'the oracle ran' && uvx-missing-tool\n",
             "tests/test.sh": "#!/bin/bash\nnot-installed-runner /tests\necho 0 > /logs/verifier/reward.txt\n"}  # fmt: skip
    write_task(tmp_path / "suite" / "broken", files)
    done = subprocess.run([sys.executable, "-m", "gyre_jax.rollout.check_suite", str(tmp_path / "suite"), "--workdir",
                           str(tmp_path / "runs")], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "GYRE_ENV_CACHE": str(tmp_path / "layers")})  # fmt: skip
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    # the verifier's runner is missing: excluded with the cause, never the 0 it wrote
    assert "FAIL broken: excluded: " in out and "'not-installed-runner', which this environment lacks" in out
    assert "--- verifier/test.stderr (last lines)" in out and "the oracle ran" in out
    kept = Path(out.split("run directory kept: ")[1].split()[0])
    assert kept.is_dir() and (kept / "oracle" / "broken" / "verifier" / "test.stderr").is_file()


@pytest.mark.slow
def test_harbor_recipes_run_simple_multi_reward_and_skills(tmp_path):
    why = can_build()
    if why or not (reachable("deb.debian.org", 80) and reachable("pypi.org", 443)):
        pytest.skip(why or "the Debian and PyPI registries are not reachable from here")
    done = check_suite(str(FIXTURES / "cookbook-offline"), "--parallel", "2", "--json", str(tmp_path / "rows.json"),
                       "--workdir", str(tmp_path / "runs"), "--keep")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["task"]: r for r in json.loads((tmp_path / "rows.json").read_text())["rows"]}
    assert {t: (r["oracle"], r["start"]) for t, r in rows.items()} == {
        "multi-reward": (1.0, 0.0), "simple-task": (1.0, 0.0), "skills": (1.0, 0.0)}  # fmt: skip
    named = json.loads((Path(rows["multi-reward"]["oracle_dir"]) / "verifier/logs/verifier/reward.json").read_text())
    assert named == {"correctness": 1, "performance": 1}  # two named rewards; the mean trains (no "reward" key)
    skill = Path(rows["skills"]["oracle_dir"]) / "harness/home/.claude/skills/generate-greeting/SKILL.md"
    assert skill.is_file()  # skills_dir copied to the harness's skills directory, as Harbor does
    published = check_suite(str(FIXTURES / "cookbook"), "--preflight")  # as published: uv from astral.sh
    assert published.returncode == 0 and published.stdout.count("REFUSED") == (
        0 if reachable("astral.sh", 443) else 3), published.stdout  # fmt: skip


# -- sandbox "none" ------------------------------------------------------------------------------------------------


def probe_wheel(folder: Path) -> Path:
    """A tiny wheel (gyre_freeze_probe 1.0) made by hand: installing it needs no network."""
    wheel = folder / "gyre_freeze_probe-1.0-py3-none-any.whl"
    info = "gyre_freeze_probe-1.0.dist-info"
    files = {"gyre_freeze_probe/__init__.py": "VALUE = 1\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: gyre-freeze-probe\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}  # fmt: skip
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n")
    return wheel


def freeze() -> str:
    return subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip


def test_sandbox_none_leaves_the_trainers_interpreter_unchanged(tmp_path):
    wheel = probe_wheel(tmp_path)
    test_sh = (f"#!/bin/bash\npython3 -m pip install --no-index --no-deps --force-reinstall {wheel} "
               "> \"$GYRE_LOGS/verifier/pip.txt\" 2>&1\n"
               "python3 -c 'import gyre_freeze_probe' && echo 1 > \"$GYRE_LOGS/verifier/reward.txt\"\n")  # fmt: skip
    task = write_task(tmp_path / "suite" / "installs", {
        "instruction.md": "nothing\n", "environment/keep.txt": "x\n", "tests/test.sh": test_sh,
        "task.toml": "[verifier.requires]\ncommands = ['bash', 'python3']\n[environment]\nallow_internet = false\n",
        "solution/solve.sh": "true\n"})  # fmt: skip
    before = freeze()
    # check_suite refuses it under "none" (its test.sh installs software), and every TB2 task (built from a Dockerfile)
    done = check_suite(str(tmp_path / "suite"), "--sandbox", "none", timeout=300)
    assert done.returncode == 0 and "NOT RUN installs: refused" in done.stdout and "installs software" in done.stdout
    done = check_suite(str(FIXTURES / "tb2"), "--sandbox", "none", timeout=300)
    assert done.returncode == 0 and done.stdout.count("NOT RUN") >= 6, done.stdout
    # ... and a verifier run anyway under "none" installs into its own directory, never the trainer's interpreter
    from gyre_jax.rollout.check_suite import KeysOnly
    from gyre_jax.rollout.executor import ExecutionSpec, Executor
    from gyre_jax.rollout.sandbox import make_sandbox

    box = make_sandbox("none", proxy_address=None, state_dir=tmp_path / "state")
    executor = Executor(KeysOnly(), "http://127.0.0.1:9/v1", tmp_path / "runs", model_name="m", timeout_s=60,
                        max_parallel=1, temperature=1.0, max_tokens=1, harness_cmd=["true"], sandbox=box,
                        network="none", evaluator_timeout_s=120)  # fmt: skip
    [result] = executor.run([ExecutionSpec("e0", load_harbor_task(task), "installs", seed=0)])
    log = (tmp_path / "runs" / "e0" / "verifier" / "logs" / "verifier" / "pip.txt").read_text()
    assert "Successfully installed gyre-freeze-probe-1.0" in log and result.reward == 1.0, (result, log)
    assert freeze() == before
    assert subprocess.run([sys.executable, "-c", "import gyre_freeze_probe"], capture_output=True).returncode != 0
