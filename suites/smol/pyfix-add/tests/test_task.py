"""Hidden test of this task (run by tests/test.sh in the final workspace, the current directory)."""

import os
import sys


def test_task():
    sys.path.insert(0, os.getcwd())
    import calc

    assert calc.add(2, 3) == 5
    assert calc.add(10, 4) == 14
