"""Hidden test of this task (run by tests/test.sh in the final workspace, the current directory)."""

import os
import sys


def test_task():
    sys.path.insert(0, os.getcwd())
    import square

    assert square.square(3) == 9
    assert square.square(-4) == 16
