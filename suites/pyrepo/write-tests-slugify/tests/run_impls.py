"""Driver (not a test): run one pytest file against several implementations in one process.

usage: python run_impls.py TEST_FILE IMPLS_DIR WORK_DIR  -> prints JSON {impl: {"rc": int, "out": str}}

Each implementation is copied as slugify.py next to a copy of TEST_FILE in WORK_DIR/<impl>/ and the tests are
run there with pytest.main; the modules are dropped from sys.modules between runs so nothing leaks.
"""

import contextlib
import io
import json
import os
import shutil
import sys
from pathlib import Path

import pytest


def run_one(test_file, impl_file, work):
    work.mkdir(parents=True)
    shutil.copy(test_file, work / "test_slugify.py")
    shutil.copy(impl_file, work / "slugify.py")
    for name in [n for n in sys.modules if n in ("slugify", "test_slugify")]:
        del sys.modules[name]
    out = io.StringIO()
    old_cwd = os.getcwd()
    os.chdir(work)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(work), "test_slugify.py"])
    finally:
        os.chdir(old_cwd)
    return {"rc": int(rc), "out": out.getvalue()[-3000:]}


def main(test_file, impls_dir, work_dir):
    results = {}
    for impl in sorted(Path(impls_dir).glob("*.py")):
        results[impl.stem] = run_one(Path(test_file), impl, Path(work_dir) / impl.stem)
    print(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:4])
