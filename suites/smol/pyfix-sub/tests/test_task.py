"""Hidden test of this task (run by tests/test.sh in the final workspace, the current directory)."""

import os
import sys


def test_task():
    sys.path.insert(0, os.getcwd())
    import mathx

    assert mathx.sub(9, 3) == 6
    assert mathx.sub(10, 4) == 6
