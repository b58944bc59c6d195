"""A suite's declared train / held-out split (task.toml ``[metadata] split``): kept whatever the seed, refused
when partial or empty; the bundled `smol` suite declares one (suites/smol)."""

from pathlib import Path

import pytest

from gyre_jax.rollout.suites import HarborSuite, SuiteError, load_tasks

SMOL = Path(__file__).resolve().parents[2] / "suites" / "smol"


def _suite(root: Path, splits: dict[str, str | None]) -> Path:
    for name, split in splits.items():
        d = root / name
        (d / "environment").mkdir(parents=True)
        (d / "tests").mkdir()
        (d / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
        (d / "instruction.md").write_text(f"do {name}\n")
        meta = f'[metadata]\nsplit = "{split}"\n' if split is not None else ""
        (d / "task.toml").write_text(meta)
    return root


def test_smol_declared_split_is_the_same_for_every_seed():
    tasks, root = load_tasks(f"harbor:{SMOL}")
    declared = {t.task_id for t in tasks if t.metadata["split"] == "heldout"}
    assert len(tasks) == 39 and len(declared) == 13
    for seed in (0, 1, 2):
        suite = HarborSuite(tasks, root, seed=seed, heldout_fraction=0.25)
        assert {t.task_id for t in suite.heldout} == declared
        assert {t.task_id for t in suite.train} == {t.task_id for t in tasks} - declared
    # without a held-out fraction every task trains, as before
    assert len(HarborSuite(tasks, root, seed=0, heldout_fraction=0.0).train) == 39


def test_undeclared_suite_keeps_the_seeded_split(tmp_path):
    tasks, root = load_tasks(f"harbor:{_suite(tmp_path, {f't{i}': None for i in range(8)})}")
    splits = {frozenset(t.task_id for t in HarborSuite(tasks, root, seed=s, heldout_fraction=0.25).heldout)
              for s in range(6)}  # fmt: skip
    assert all(len(s) == 2 for s in splits) and len(splits) > 1


@pytest.mark.parametrize(
    "splits, message",
    [
        ({"a": "train", "b": None, "c": "heldout"}, "every task must"),
        ({"a": "train", "b": "test", "c": "heldout"}, "split='test'"),
        ({"a": "train", "b": "train"}, "0 held-out task(s) of 2"),
        ({"a": "heldout", "b": "heldout"}, "2 held-out task(s) of 2"),
    ],
)
def test_bad_declared_split_is_refused(tmp_path, splits, message):
    tasks, root = load_tasks(f"harbor:{_suite(tmp_path, splits)}")
    with pytest.raises(SuiteError) as err:
        HarborSuite(tasks, root, seed=0, heldout_fraction=0.3)
    assert message in str(err.value)
