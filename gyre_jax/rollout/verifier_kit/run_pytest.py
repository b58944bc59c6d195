"""The trusted driver of a pytest verifier (gyre-jax's verifier kit): a task's ``tests/test.sh`` ends with

    exec python3 -I "$GYRE_VERIFIER/run_pytest.py" --tests "$TESTS" --workspace "$WS" --logs "$LOGS/verifier"

It runs pytest over ``--tests`` in a child process (the workspace as its current directory and last on its
``sys.path``, the plugin ``gyre_pytest_guard`` loaded before collection, third-party plugin autoloading off, no
configuration file of the workspace read), reads each test's outcome from the plugin over a pipe whose lines
carry a secret nonce, and when the child has ended (or ``--timeout`` passed: tests not finished by then failed)
kills every process the child started (this driver is their subreaper: however they detach, they are its
descendants) before it writes, into ``--logs``, files no other process can then touch:

    reward.txt       tests passed / tests expected (the ids in ``--expected`` when that file exists, else those
                     collected); a test not reported, skipped or erroring in any phase is not passed
    suspect.txt      one line per sign of tampering (the guard's findings, forged or missing channel lines,
                     tests not declared, an exit 0 before pytest finished): the execution is flagged
                     ``reward_suspect`` (excluded by default)
    unavailable.txt  instead of a reward when pytest could not run: not importable, dead before its plugin
                     started, a usage or internal error before any test ran, nothing collected without an
                     error. The execution is then excluded (``evaluator_unavailable``), never scored 0
    summary.json     the counts and each test's outcome
    pytest.log       pytest's output

Standard library only (run with ``-I``: no environment variable, current directory or user site applies).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
MAX_CHANNEL_BYTES = 8 << 20  # what is kept of the report channel: a flood cannot fill the driver's memory
CONTROL_FILES = ("reward.txt", "reward.json", "suspect.txt", "unavailable.txt", "summary.json")
EXIT_UNAVAILABLE = 3
# Passed through from test.sh's environment (the verifier's: PATH, HOME, locale, the task's [verifier] env);
# anything that changes how Python or the loader start is not.
DROPPED_PREFIXES = ("PYTHON", "PYTEST", "LD_", "GYRE_REPORT", "GYRE_NONCE")
DROPPED_NAMES = ("BASH_ENV", "ENV", "PERL5OPT", "NODE_OPTIONS")


def become_subreaper() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def descendants(root: int) -> list[int]:
    """The live processes below ``root`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, stack = [], [root]
    while stack:
        for pid in children.get(stack.pop(), []):
            out.append(pid)
            stack.append(pid)
    return out


def kill_descendants() -> None:
    """SIGKILLs every descendant and reaps them, until none is left (orphans reparent to this subreaper)."""
    for _ in range(100):
        live = descendants(os.getpid())
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.01)
        if not live:
            return


def child_env(workspace: str, tests: str, kit: str, report_fd: int, nonce_fd: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(DROPPED_PREFIXES) and k not in DROPPED_NAMES}
    env.update(PYTHONPATH=kit, PYTHONSAFEPATH="1", PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1",
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", GYRE_WORKSPACE=workspace, GYRE_TESTS=tests,
               GYRE_REPORT_FD=str(report_fd), GYRE_NONCE_FD=str(nonce_fd))  # fmt: skip
    return env


def read_channel(proc: subprocess.Popen, fd: int, deadline: float) -> tuple[bytes, bool, bool]:
    """What the plugin wrote until the child exits or the deadline; (data, timed out, flooded)."""
    data, flooded = bytearray(), False
    while proc.poll() is None:
        if time.monotonic() >= deadline:
            return bytes(data), True, flooded
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            chunk = os.read(fd, 65536)
            if len(data) < MAX_CHANNEL_BYTES:
                data += chunk
            else:
                flooded = True
    return bytes(data), False, flooded


def drain(fd: int, data: bytes) -> tuple[bytes, bool]:
    """The rest of the channel once every writer is dead (EOF); (data, flooded)."""
    buf, flooded = bytearray(data), False
    os.set_blocking(fd, False)
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        if len(buf) < MAX_CHANNEL_BYTES:
            buf += chunk
        else:
            flooded = True
    os.close(fd)
    return bytes(buf), flooded


def parse_channel(data: bytes, nonce: str) -> dict:
    """The guard's events from the channel's bytes: {"started", "finish", "items", "collect_errors", "tests",
    "suspect"}; lines without the nonce, out of sequence or repeated are signs of tampering."""
    out = {"started": None, "finish": None, "items": [], "collect_errors": [], "tests": {}, "suspect": []}
    seq, foreign = 0, 0
    for raw in data.splitlines():
        try:
            event = json.loads(raw)
            ok_line = isinstance(event, dict) and secrets.compare_digest(str(event.get("nonce", "")), nonce)
        except (ValueError, TypeError):
            ok_line = False
        if not ok_line:
            foreign += 1
            continue
        if event.get("seq") != seq + 1:
            out["suspect"].append(
                f"the report channel's sequence broke at {seq} -> {event.get('seq')!r} (lines replayed or injected)"
            )
        seq = event.get("seq") if isinstance(event.get("seq"), int) else seq + 1
        kind, test_id = event.get("t"), str(event.get("id"))
        if kind == "start":
            out["started"] = event
        elif kind == "finish":
            out["finish"] = event.get("status")
        elif kind == "item":
            out["items"].append(test_id)
        elif kind == "collect_error":
            out["collect_errors"].append(test_id)
        elif kind == "tamper":
            out["suspect"].append(str(event.get("why")))
        elif kind == "test":
            if test_id in out["tests"]:
                out["suspect"].append(f"test {test_id} was reported twice")
            out["tests"][test_id] = event.get("ok") is True
    if foreign:
        out["suspect"].append(
            f"{foreign} line(s) on the report channel were not written by the guard (no or a wrong nonce)"
        )
    return out


def judge(data: bytes, nonce: str, expected: list[str] | None, returncode: int | None, timed_out: bool,
          flooded: bool, log_tail: str) -> dict:  # fmt: skip
    """The verdict from the channel: {"reward": float | None, "unavailable": str | None, "suspect": [str],
    "tests": {id: ok}, ...}."""
    ev = parse_channel(data, nonce)
    items, collect_errors, tests, suspect, finish = (
        ev[k] for k in ("items", "collect_errors", "tests", "suspect", "finish")
    )
    if flooded:
        suspect.append(f"the report channel was flooded past {MAX_CHANNEL_BYTES} bytes")
    verdict = {"reward": None, "unavailable": None, "suspect": suspect, "tests": tests, "collected": len(items),
               "collect_errors": collect_errors, "returncode": returncode, "timed_out": timed_out,
               "pytest_status": finish}  # fmt: skip
    if ev["started"] is None:
        how = "within the time limit" if timed_out else f"(exit status {returncode})"
        verdict["unavailable"] = f"pytest did not start {how}: {log_tail}"
        return verdict
    if finish in (3, 4) and not tests and not collect_errors:
        verdict["unavailable"] = (
            f"pytest stopped with status {finish} (internal or usage error) before any test: {log_tail}"
        )
        return verdict
    if not items and not collect_errors and not timed_out and finish is not None:
        verdict["unavailable"] = f"pytest collected no test and reported no error (status {finish}): {log_tail}"
        return verdict
    if finish is None and returncode == 0 and not timed_out:
        suspect.append(
            "the test process exited with status 0 before pytest finished (os._exit / sys.exit from the code under test)"
        )
    if expected is not None:
        undeclared = sorted(set(items) - set(expected))
        if undeclared:
            suspect.append(f"{len(undeclared)} collected test(s) are not in the expected list: {undeclared[:5]}")
    want = expected if expected is not None else items
    passed = sum(tests.get(t) is True for t in want)
    # nothing to count: nothing was collected because the workspace's code broke the import
    verdict.update(reward=round(passed / len(want), 4) if want else 0.0, expected=len(want), passed=passed)
    return verdict


def reset_logs(logs: Path) -> None:
    """A real directory at ``logs`` without any control file (whatever the tested code left there)."""
    if logs.is_symlink() or (logs.exists() and not logs.is_dir()):
        logs.unlink()
    logs.mkdir(parents=True, exist_ok=True)
    for name in CONTROL_FILES:
        path = logs / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)


def write(logs: Path, name: str, text: str) -> None:
    fd = os.open(logs / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def tail(path: Path, limit: int = 600) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return " ".join(f.read().decode("utf-8", "replace").split())
    except OSError:
        return ""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", required=True)
    parser.add_argument("--workspace", required=True)
    parser.add_argument("--logs", required=True)
    parser.add_argument("--expected", default="", help="a file of expected test ids, one per line (if it exists)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        help="seconds for pytest (default: GYRE_VERIFIER_TIMEOUT_S x 0.8, else 600)",
    )
    parser.add_argument("pytest_args", nargs="*")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    become_subreaper()
    kit = str(Path(__file__).resolve().parent)
    tests, workspace, logs = os.path.abspath(args.tests), os.path.abspath(args.workspace), Path(args.logs)
    budget = args.timeout or 0.8 * float(os.environ.get("GYRE_VERIFIER_TIMEOUT_S") or 750)
    expected = None
    if args.expected and os.path.isfile(args.expected):
        with open(args.expected, encoding="utf-8") as f:
            expected = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    reset_logs(logs)
    nonce = secrets.token_hex(16)
    report_r, report_w = os.pipe()
    nonce_r, nonce_w = os.pipe()
    os.write(nonce_w, nonce.encode())
    os.close(nonce_w)
    work = Path(tempfile.mkdtemp(prefix="gyre-pytest-"))
    (work / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")  # no configuration of the workspace applies
    cmd = [sys.executable, "-m", "pytest", "-p", "gyre_pytest_guard", "-p", "no:cacheprovider", "-c",
           str(work / "pytest.ini"), "--rootdir", tests, "--basetemp", str(work / "tmp"), "-q", *args.pytest_args,
           tests]  # fmt: skip
    env = child_env(workspace, tests, kit, report_w, nonce_r)
    with open(logs / "pytest.log", "wb") as log:
        try:
            proc = subprocess.Popen(cmd, cwd=workspace, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, pass_fds=(report_w, nonce_r), start_new_session=True)  # fmt: skip
        except OSError as exc:
            reset_logs(logs)
            write(logs, "unavailable.txt", f"cannot start {sys.executable} -m pytest: {exc}\n")
            return EXIT_UNAVAILABLE
    os.close(report_w)
    os.close(nonce_r)
    data, timed_out, flooded = read_channel(proc, report_r, time.monotonic() + budget)
    kill_descendants()  # the child (on timeout) and everything it started, however detached
    data, flooded_late = drain(report_r, data)
    returncode = proc.wait() if proc.returncode is None else proc.returncode
    verdict = judge(data, nonce, expected, returncode, timed_out, flooded or flooded_late, tail(logs / "pytest.log"))
    shutil.rmtree(work, ignore_errors=True)
    reset_logs(logs)  # nothing is left running: what is written now stays as written
    write(logs, "summary.json", json.dumps(verdict, indent=1) + "\n")
    if verdict["unavailable"]:
        write(logs, "unavailable.txt", verdict["unavailable"] + "\n")
        print(f"verifier unavailable: {verdict['unavailable']}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if verdict["suspect"]:
        write(logs, "suspect.txt", "".join(line + "\n" for line in verdict["suspect"]))
    write(logs, "reward.txt", f"{verdict['reward']}\n")
    note = " (timed out: unfinished tests failed)" if timed_out else ""
    print(f"reward {verdict['reward']}: {verdict.get('passed')}/{verdict.get('expected')} tests passed{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
