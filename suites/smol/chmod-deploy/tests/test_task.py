"""Hidden test of this task (run by tests/test.sh in the final workspace, the current directory)."""

import os
import subprocess


def test_task():
    assert os.access("deploy.sh", os.X_OK)
    assert subprocess.run(["./deploy.sh"], capture_output=True, text=True).stdout.strip() == "deployed"
