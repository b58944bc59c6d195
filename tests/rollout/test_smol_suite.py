"""The `smol` suite (suites/smol, calibrated to SmolLM2-135M-Instruct) and its harness overrides
(gyre_jax/rollout/harness_configs/mini_small.yaml): oracles and starts through the real executor, bwrap and
verifier; the committed task directories equal what their generator writes; mini's own parser reads the actions
a small model writes the way the config says."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from timelimits import scaled

from gyre_jax.rollout.suites import load_tasks

REPO = Path(__file__).resolve().parents[2]
SMOL = REPO / "suites" / "smol"
MINI_SMALL = REPO / "gyre_jax" / "rollout" / "harness_configs" / "mini_small.yaml"


def _generator():
    spec = importlib.util.spec_from_file_location("generate_tasks", SMOL / "generate_tasks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("bwrap") is None and os.geteuid() != 0, reason="bwrap is missing and this is not root")
def test_every_oracle_scores_1_and_every_start_0(tmp_path):
    tasks, _ = load_tasks(f"harbor:{SMOL}")
    assert len(tasks) == 39
    done = subprocess.run([sys.executable, "-m", "gyre_jax.rollout.check_suite", "suites/smol", "--sandbox", "bwrap",
                           "--max-start", "0.01", "--json", str(tmp_path / "rows.json")], cwd=REPO,
                          capture_output=True, text=True, timeout=scaled(900))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert len(rows) == 39 and all(r["oracle"] == 1.0 and r["start"] == 0.0 for r in rows)


def test_committed_tasks_are_what_the_generator_writes(tmp_path, monkeypatch):
    """Every file but the (ruff-formatted) hidden test module is byte-equal to a fresh generation, and the
    test module holds the same test body."""
    gen = _generator()
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    for t in gen.tasks():
        gen.write(t)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    committed = sorted(p.relative_to(SMOL) for p in SMOL.rglob("*") if p.is_file() and p.name != "generate_tasks.py"
                       and "__pycache__" not in p.parts)  # fmt: skip
    assert fresh == committed
    for rel in fresh:
        if rel.name == "test_task.py":
            assert (SMOL / rel).read_text().count("assert ") == (tmp_path / rel).read_text().count("assert ")
        else:
            assert (SMOL / rel).read_bytes() == (tmp_path / rel).read_bytes(), rel
            assert os.access(SMOL / rel, os.X_OK) == os.access(tmp_path / rel, os.X_OK), rel


def test_declared_split_pairs_each_family():
    tasks, _ = load_tasks(f"harbor:{SMOL}")
    families: dict[str, list[str]] = {}
    for t in tasks:
        families.setdefault(t.metadata["category"], []).append(t.metadata["split"])
    assert len(families) == 13 and all(sorted(s) == ["heldout", "train", "train"] for s in families.values())


def test_mini_parses_a_small_models_replies_as_configured():
    from minisweagent.exceptions import FormatError
    from minisweagent.models.utils.actions_text import parse_regex_actions

    config = yaml.safe_load(MINI_SMALL.read_text())
    assert config["model"]["model_class"] == "litellm_textbased"
    regex, error = config["model"]["action_regex"], config["model"]["format_error_template"]

    def parse(reply: str) -> list[dict]:
        return parse_regex_actions(reply, action_regex=regex, format_error_template=error)

    # the first fenced block is the action, whatever follows it
    assert parse("Here:\n```bash\nmkdir out\n```\nThen:\n```\nls\n```\n") == [{"command": "mkdir out"}]
    # a block cut by max_tokens counts up to the cut
    assert parse("```sh\nrm old.log\necho do") == [{"command": "rm old.log\necho do"}]
    with pytest.raises(FormatError):
        parse("You can use the rm command to delete it.")
