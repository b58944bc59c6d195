"""Hidden test of this task (run by tests/test.sh in the final workspace, the current directory)."""

import os
import sys


def test_task():
    sys.path.insert(0, os.getcwd())
    import double

    assert double.double(3) == 6
    assert double.double(-5) == -10
