"""Hidden test of this task (run by tests/test.sh in the final workspace, the current directory)."""

from pathlib import Path


def test_task():
    assert Path("build").is_dir()
