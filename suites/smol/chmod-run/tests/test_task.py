"""Hidden test of this task (run by tests/test.sh in the final workspace, the current directory)."""

import os
import subprocess


def test_task():
    assert os.access("run.sh", os.X_OK)
    assert subprocess.run(["./run.sh"], capture_output=True, text=True).stdout.strip() == "running"
