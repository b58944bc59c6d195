"""Task suites from disk: Harbor task directories (written here in the upstream format), the JSONL form, the
train / held-out split, and the one-line refusal of every malformed task."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from gyre_jax.build import make_suite  # the run's builder loads the suite the config names
from gyre_jax.config import ConfigError, load_config
from gyre_jax.rollout.suites import (
    HarborSuite,
    SuiteError,
    dockerfile_workdir,
    load_harbor_task,
    load_tasks,
    materialize_jsonl,
    memory_mb,
)

# An upstream Terminal-Bench 2 / Harbor task, as its authors write them: absolute /app, /tests, /logs paths.
UPSTREAM_TOML = """\
version = "1.0"

[metadata]
author_name = "someone"
difficulty = "easy"
category = "file-operations"
tags = ["bash"]

[verifier]
timeout_sec = 30.0

[agent]
timeout_sec = 120.0

[environment]
build_timeout_sec = 600.0
cpus = 1
memory = "2G"
storage = "10G"
"""
UPSTREAM_TEST_SH = """\
#!/bin/bash
if [ "$(cat /app/greeting.txt 2>/dev/null)" = "hello, world" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def write_upstream_task(root: Path, name: str = "hello-world") -> Path:
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution").mkdir()
    (task / "instruction.md").write_text("Create /app/greeting.txt containing exactly `hello, world`.\n")
    (task / "task.toml").write_text(UPSTREAM_TOML)
    (task / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\nCOPY notes.txt /app/\n")
    (task / "environment" / "notes.txt").write_text("starting file\n")
    (task / "tests" / "test.sh").write_text(UPSTREAM_TEST_SH)
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\necho 'hello, world' > /app/greeting.txt\n")
    return task


def test_an_upstream_task_loads_with_its_fields(tmp_path):
    task = load_harbor_task(write_upstream_task(tmp_path))
    assert task.task_id == task.kind == "hello-world"
    assert task.instruction.startswith("Create /app/greeting.txt")
    assert task.agent_timeout_s == 120.0 and task.verifier_timeout_s == 30.0
    # Harbor's defaults: the internet ("public") for every phase; built from its Dockerfile (no [verifier.requires])
    assert task.environment == {"workdir": "/app", "allow_internet": True, "cpus": 1.0, "memory_mb": 2048,
                                "storage_mb": 10240, "build_timeout_s": 600.0, "agent_internet": True,
                                "verifier_internet": True, "mode": "build"}  # fmt: skip
    assert task.metadata["difficulty"] == "easy" and task.metadata["tags"] == ["bash"]
    assert task.source == str((tmp_path / "hello-world").resolve()) and task.files == {} and task.expected == {}
    again = type(task).from_json(task.to_json())
    assert again == task


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda t: (t / "instruction.md").unlink(), "task bad .*instruction.md is missing"),
        (lambda t: (t / "instruction.md").write_text("  \n"), "task bad .*instruction.md is empty"),
        (lambda t: (t / "task.toml").write_text("[agent\ntimeout_sec = 1"), "task bad .*task.toml is not valid TOML"),
        (lambda t: (t / "task.toml").write_text("[agent]\ntimeout_sec = 'soon'\n"), r"task bad .*\[agent\] timeout_sec='soon'"),
        (lambda t: (t / "task.toml").write_text("[verifier]\ntimeout_sec = -1\n"), r"task bad .*\[verifier\] timeout_sec=-1"),
        (lambda t: (t / "task.toml").write_text("[environment]\nmemory = 'lots'\n"), r"task bad .*\[environment\] memory"),
        (lambda t: (t / "task.toml").write_text("[environment]\ncpus = 0\n"), r"task bad .*\[environment\] cpus=0"),
        (lambda t: (t / "task.toml").write_text("[environment]\nallow_internet = 'yes'\n"), "allow_internet='yes'"),
        (lambda t: (t / "task.toml").write_text("[verifier]\nenv = {A = 1}\n"), r"\[verifier\] env must map"),
        (lambda t: (t / "task.toml").write_text("agent = 3\n"), r"task bad .*\[agent\] must be a table"),
        (lambda t: (t / "tests" / "test.sh").unlink(), "task bad .*tests/test.sh is missing"),
        (lambda t: shutil.rmtree(t / "environment"), "task bad .*environment/ is missing"),
    ],
)  # fmt: skip
def test_every_malformed_task_is_refused_in_one_line_naming_task_and_field(tmp_path, break_it, message):
    write_upstream_task(tmp_path, "good")
    break_it(write_upstream_task(tmp_path, "bad"))
    with pytest.raises(SuiteError, match=message) as info:
        load_tasks(f"harbor:{tmp_path}")
    assert "\n" not in str(info.value)


def test_memory_sizes_and_workdirs():
    assert memory_mb("2G", "m") == 2048 and memory_mb("512M", "m") == 512 and memory_mb(300, "m") == 300
    assert memory_mb("1.5GiB", "m") == 1536
    with pytest.raises(SuiteError, match="memory"):
        memory_mb("-1G", "memory")


def test_dockerfile_workdir(tmp_path):
    f = tmp_path / "Dockerfile"
    assert dockerfile_workdir(f) == "/app"  # no Dockerfile
    f.write_text("FROM x\nWORKDIR /srv\nRUN true\nworkdir project\n")
    assert dockerfile_workdir(f) == "/srv/project"


def test_a_suite_is_a_directory_of_tasks_or_one_task(tmp_path):
    for name in ("b-task", "a-task"):
        write_upstream_task(tmp_path, name)
    (tmp_path / "_shared").mkdir()  # helpers beside tasks are not tasks
    tasks, root = load_tasks(f"harbor:{tmp_path}")
    assert [t.task_id for t in tasks] == ["a-task", "b-task"] and root == tmp_path.resolve()
    assert [t.task_id for t in load_tasks(f"harbor:{tmp_path / 'a-task'}")[0]] == ["a-task"]
    with pytest.raises(SuiteError, match="does not exist"):
        load_tasks(f"harbor:{tmp_path / 'nope'}")
    with pytest.raises(SuiteError, match="expected 'builtin', 'harbor:"):
        load_tasks("git:somewhere")


def test_split_and_epochs_are_seeded_and_disjoint(tmp_path):
    for i in range(8):
        write_upstream_task(tmp_path, f"t{i}")
    tasks, root = load_tasks(f"harbor:{tmp_path}")
    a, b = (
        HarborSuite(tasks, root, seed=3, heldout_fraction=0.25),
        HarborSuite(tasks, root, seed=3, heldout_fraction=0.25),
    )
    assert [t.task_id for t in a.heldout] == [t.task_id for t in b.heldout] and len(a.heldout) == 2
    assert not {t.task_id for t in a.train} & {t.task_id for t in a.heldout}
    step_kinds = [t.kind for s in range(3) for t in a.tasks_for_step(s, 2)]
    assert set(step_kinds) == {t.task_id for t in a.train}  # one epoch of 6 train tasks over 3 steps of 2
    assert [t.task_id for t in a.tasks_for_step(1, 2)] == ["s000001-t0", "s000001-t1"]
    assert a.tasks_for_step(1, 2) == b.tasks_for_step(1, 2)
    with pytest.raises(SuiteError, match="leaves none to train on"):
        HarborSuite(tasks[:1], root, heldout_fraction=0.5)
    with pytest.raises(SuiteError, match="warm-start demonstrations exist only for the builtin suite"):
        a.demonstrations(1, seed=0)


def test_the_jsonl_form_materializes_harbor_directories(tmp_path):
    line = {
        "name": "add-two",
        "instruction": "Write add.py with add(a, b).",
        "files": {"environment/README.md": "add two numbers\n", "tests/test.sh": UPSTREAM_TEST_SH,
                  "solution/solve.sh": "echo ok\n"},
        "task_toml": {"agent": {"timeout_sec": 60}, "metadata": {"difficulty": "easy", "tags": ["py"]},
                      "environment": {"memory_mb": 512, "allow_internet": False}},
    }  # fmt: skip
    suite = tmp_path / "suite.jsonl"
    suite.write_text(json.dumps(line) + "\n\n" + json.dumps({**line, "name": "other"}) + "\n")
    tasks, root = load_tasks(f"jsonl:{suite}")
    assert [t.task_id for t in tasks] == ["add-two", "other"]
    assert tasks[0].agent_timeout_s == 60 and tasks[0].environment["memory_mb"] == 512
    assert tasks[0].metadata == {"difficulty": "easy", "tags": ["py"]}
    assert (root / "add-two" / "environment" / "README.md").read_text() == "add two numbers\n"
    assert materialize_jsonl(suite) == root  # same content: reused


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "line 1: not valid JSON"),
        (json.dumps({"name": "../x", "instruction": "i"}), "line 1: 'name' must be a directory-safe name"),
        (json.dumps({"name": "x", "instruction": 3}), r"line 1 \(task x\): 'instruction' must be a string"),
        (json.dumps({"name": "x", "instruction": "i", "files": {"../up": "t"}}), "file path '../up'"),
        (json.dumps({"name": "x", "instruction": "i", "extra": 1}), r"unknown keys \['extra'\]"),
        (json.dumps({"name": "x", "instruction": "i"}), "task x .*tests/test.sh is missing"),
    ],
)
def test_a_malformed_jsonl_line_is_named(tmp_path, line, message):
    suite = tmp_path / "bad.jsonl"
    suite.write_text(line + "\n")
    with pytest.raises(SuiteError, match=message):
        load_tasks(f"jsonl:{suite}")


def test_the_config_refuses_a_bad_suite_before_any_work(tmp_path):
    write_upstream_task(tmp_path, "good")
    (write_upstream_task(tmp_path, "broken") / "task.toml").write_text("[agent]\ntimeout_sec = 'x'\n")
    with pytest.raises(ConfigError, match=r"config.rollout.suite=.*task broken .*\[agent\] timeout_sec='x'"):
        make_suite(load_config([f"--config.rollout.suite=harbor:{tmp_path}", "--config.warm_start.steps=0"]))
    shutil.rmtree(tmp_path / "broken")
    # (the upstream task is built from its Dockerfile: sandbox "none" would refuse it, build.make_suite says why)
    ok = [f"--config.rollout.suite=harbor:{tmp_path}", "--config.warm_start.steps=0", "--config.rollout.sandbox=bwrap"]
    assert load_config(ok).rollout.suite == f"harbor:{tmp_path}"
    assert [t.task_id for t in make_suite(load_config(ok)).pool()] == ["good"]
    with pytest.raises(ConfigError, match="warm-start demonstrations exist only for the builtin suite"):
        load_config([f"--config.rollout.suite=harbor:{tmp_path}"])
    with pytest.raises(ConfigError, match="needs a held-out split: set config.rollout.heldout_fraction"):
        load_config([*ok, "--config.eval.split=heldout"])
    with pytest.raises(ConfigError, match="heldout_fraction applies to harbor/jsonl suites"):
        load_config(["--config.rollout.heldout_fraction=0.5"])


def test_which_splits_an_evaluation_scores(tmp_path):
    """eval.split='both' (the default): training and held-out tasks where the suite has held-out tasks (the
    builtin suite always; a harbor/jsonl suite with rollout.heldout_fraction > 0), else the training set only."""
    write_upstream_task(tmp_path, "a")
    write_upstream_task(tmp_path, "b")
    harbor = [f"--config.rollout.suite=harbor:{tmp_path}", "--config.warm_start.steps=0"]
    assert load_config([]).eval.split == "both"
    assert load_config([]).eval_splits() == ("train", "heldout")
    assert load_config(["--config.eval.split=heldout"]).eval_splits() == ("heldout",)
    assert load_config(harbor).eval_splits() == ("train",)
    assert load_config([*harbor, "--config.rollout.heldout_fraction=0.5"]).eval_splits() == ("train", "heldout")
    with pytest.raises(ConfigError, match="config.eval.split='both' evaluates the training set, which needs a fixed"):
        load_config(["--config.rollout.num_tasks=0"])
    assert load_config(["--config.rollout.num_tasks=0", "--config.eval.split=heldout"]).eval_splits() == ("heldout",)


def test_instruction_text_is_kept_verbatim(tmp_path):
    task_dir = write_upstream_task(tmp_path)
    text = textwrap.dedent("""\
        # Title

        Implement `f(x)` — with unicode ✓ and a code block:

        ```
        f(1) == 2
        ```
        """)
    (task_dir / "instruction.md").write_text(text)
    assert load_harbor_task(task_dir).instruction == text.strip()
