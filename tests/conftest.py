"""Test session setup: 8 virtual CPU devices (so cells are real submeshes), before JAX starts, one XLA
compilation cache for the session, and time limits that scale with the machine's load.

Tests under load (docs/reliability.md): a test's verdict never depends on how busy the machine is (CI's 2 cores,
a laptop compiling, 2 busy processes beside the suite). Wait on events, not on sleeps; a wall-clock bound that
guards a hang is generous on an idle machine and passed through ``timelimits.scaled`` (the measured
``slow_factor``, shown in the session header; ``GYRE_JAX_TEST_SLOW_FACTOR`` sets a floor); a run whose point is
not a timeout gets ``timelimits.run_time_limits()`` (its harness and evaluator limits scaled); a test of a timeout
itself asserts what the expiry must produce, with scaled margins, and whatever must outlive the limit hangs for
``timelimits.HANG_S``. Never assert that something finished within a fixed number of seconds.

The cache is a fresh temporary directory per session, so every session still compiles each program once
(nothing carries over from an older checkout), and the many training subprocesses (``python -m
gyre_jax.train``, 2-process runs) and in-process runs of the same config load what an earlier one compiled
instead of compiling it again. A cached executable is the one XLA compiled for the same program, devices
and options; only the compile is skipped. An outer ``JAX_COMPILATION_CACHE_DIR`` is left as it is.
"""

import atexit
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # shared test modules (layouts.py) import by name

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="gyre-jax-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache_dir, True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir  # read by this process's JAX and inherited by subprocesses
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # the many small programs add up
    # No size bound: a bound turns on JAX's LRU eviction, whose every write globs and stats the whole directory
    # under a file lock, so a session's thousands of entries made the writes quadratic (a cold training run
    # 58 -> 80 s on a 6,000-entry cache). Unbounded, only process 0 of a multi-process run writes; a read racing a
    # write fails to decompress, which JAX reports as a warning and answers by compiling: never a wrong program.

import jax  # noqa: E402
import pytest  # noqa: E402
import timelimits  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_report_header(config):
    m = timelimits.measure()
    return (
        f"time limits: slow_factor {m['factor']:.1f} now (workload contention {m['contention']:.1f} x speed "
        f"{m['speed']:.1f}, load per core {m['load_per_core']:.1f}, floor {m['floor']:g} "
        f"from ${timelimits.ENV}); re-measured every {timelimits.REMEASURE_S:g} s"
    )


@pytest.fixture
def slow_factor() -> float:
    """The current ``timelimits.slow_factor()`` (>= 1): multiply a hang guard's idle-machine bound by it."""
    return timelimits.slow_factor()


# --- parallel runs (pytest-xdist; `-n 2` in pyproject's addopts) -----------------------------------------------
# One work unit per test file, so module fixtures (a multi-process reference run, a trained tiny model) are built
# once; tests/integration is one unit, since its session fixtures (the serving stack, the npm CLIs installed into
# tests/integration/npm) must be built once and by one process. Files with end-to-end (`slow`) tests go first, so
# the long units start early and the short ones fill the tail (longest-first, as a scheduler should).
SHARED_SCOPES = ("tests/integration/",)


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # a serial run keeps pytest's own order
        return
    slow_files = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow_files)  # stable: files stay in order


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # a serial-only environment: no scheduler to make
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:

    class FileScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with a file (or a shared directory of ``SHARED_SCOPES``) as the scope, in
        collection order (the workers' order above; pyproject passes ``--no-loadscope-reorder``)."""

        def _split_scope(self, nodeid: str) -> str:
            return next((scope for scope in SHARED_SCOPES if nodeid.startswith(scope)), nodeid.split("::")[0])

    @pytest.hookimpl(optionalhook=True)  # a run with `-p no:xdist` has no such hook to check it against
    def pytest_xdist_make_scheduler(config, log):
        if config.getoption("dist") == "load":  # the default of `-n N`; an explicit --dist gets xdist's own
            return FileScheduling(config, log)
        return None


# --- memory maps of compiled programs ---------------------------------------------------------------------------
# XLA:CPU maps every compiled kernel into its own memory regions (~3 maps each: code, read-only data, data), and
# they stay mapped while the executable lives in JAX's caches. A test worker that compiles programs for an hour
# (the paged engines' programs add ~100 maps a second) can reach the kernel's vm.max_map_count (65,530 by default);
# then an mmap inside LLVM fails and the worker dies mid-compile (a SIGSEGV in backend_compile_and_load, or an abort
# in the cache's serialize), which also left pytest-xdist waiting for the dead worker's tests. So: when a module
# ends, or a test starts, with many maps, drop JAX's caches and collect, so the executables nothing holds any
# more are freed (the next use of a program loads it from the session's compilation cache).
MAPS_AFTER_MODULE = 10_000  # a module that leaves more than this clears the caches behind it
MAPS_BEFORE_TEST = 40_000  # within a long module: clear before a test once this many are mapped


def _map_count() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to guard
        return 0


def _release_executables() -> None:
    import gc

    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs_after_the_module():
    yield
    if _map_count() > MAPS_AFTER_MODULE:
        _release_executables()


@pytest.fixture(autouse=True)
def _release_compiled_programs_before_a_test():
    if _map_count() > MAPS_BEFORE_TEST:
        _release_executables()
