"""Hidden test of this task (run by tests/test.sh in the final workspace, the current directory)."""

import subprocess
import sys


def test_task():
    out = subprocess.run([sys.executable, "hello.py"], capture_output=True, text=True).stdout
    assert out.strip() == "Hello, World!"
