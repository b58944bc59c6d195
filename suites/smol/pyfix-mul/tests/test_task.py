"""Hidden test of this task (run by tests/test.sh in the final workspace, the current directory)."""

import os
import sys


def test_task():
    sys.path.insert(0, os.getcwd())
    import ops

    assert ops.mul(3, 4) == 12
    assert ops.mul(10, 4) == 40
