"""Tests for gyre_jax/rollout/sandbox/: real bwrap sandboxes, a real HTTP server behind the proxy bridge, real
process groups killed on timeout, real cgroup limits; docker's refusal and the exact `docker run` argv.

The run directory of the bwrap tests lives in /var/tmp, not in pytest's tmp_path: a sandbox gets its own
empty /tmp, so a run directory under /tmp would be invisible inside whether or not ``hide`` works.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
from timelimits import scaled

from gyre_jax.rollout.process_group import ProcessGroups
from gyre_jax.rollout.sandbox import SANDBOXES, Launch, Limits, Mount, SandboxUnavailable, make_sandbox
from gyre_jax.rollout.sandbox.base import FORWARD_SCRIPT, PROXY_SOCKET_INSIDE, REPO_ROOT, NoneSandbox
from gyre_jax.rollout.sandbox.bwrap import BwrapSandbox
from gyre_jax.rollout.sandbox.docker import CLIENT_ENV, FORWARD_INSIDE, REPO_INSIDE, DockerSandbox, image_tag

PY = sys.executable
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}


@pytest.fixture(scope="module")
def bwrap_ok() -> None:
    if shutil.which("bwrap") is None:
        if os.geteuid() == 0:
            pytest.fail("bwrap is not installed; CI installs it: apt-get install -y bubblewrap")
        pytest.skip("bwrap is not installed and this is not root (install: sudo apt-get install -y bubblewrap)")
    BwrapSandbox(None, [], Path(tempfile.gettempdir())).check()


@pytest.fixture
def run_dir(bwrap_ok):
    """A run directory (hidden from sandboxes) with two executions' workspaces and the records."""
    root = Path(tempfile.mkdtemp(prefix="gyre-sbtest-run-", dir="/var/tmp"))
    for name in ("A", "B"):
        (root / name / "workspace").mkdir(parents=True)
        (root / name / "workspace" / "seed.txt").write_text(f"seed of {name}")
    (root / "records").mkdir()
    (root / "records" / "calls.jsonl").write_text('{"secret": true}\n')
    yield root
    shutil.rmtree(root, ignore_errors=True)


def make(run_dir: Path, proxy: tuple[str, int] | None = None, **kw) -> BwrapSandbox:
    return BwrapSandbox(proxy, [run_dir], run_dir / "state", **kw)


def launch(workspace: Path, argv: list[str], network: str = "none", **kw) -> Launch:
    kw.setdefault("env", dict(BASE_ENV))
    return Launch(argv=argv, cwd="/app", mounts=(Mount(workspace, "/app", writable=True),), network=network, **kw)


def run(sandbox, spec: Launch, timeout: float = 30.0) -> subprocess.CompletedProcess:
    prepared = sandbox.prepare(spec)
    try:
        return subprocess.run(prepared.argv, env=prepared.env, cwd=prepared.cwd, capture_output=True, text=True,
                              timeout=scaled(timeout), stdin=subprocess.DEVNULL)  # fmt: skip
    finally:
        prepared.cleanup()


PROBE = r"""
import json, os, sys
run_dir, other = sys.argv[1], sys.argv[2]
out = {}
def attempt(name, fn):
    try:
        out[name] = fn()
    except OSError as exc:
        out[name] = "error: " + type(exc).__name__
attempt("run_dir", lambda: sorted(os.listdir(run_dir)))
attempt("other_ws", lambda: sorted(os.listdir(os.path.join(run_dir, other, "workspace"))))
attempt("records", lambda: open(os.path.join(run_dir, "records", "calls.jsonl")).read())
attempt("home", lambda: sorted(os.listdir(os.path.expanduser("~"))))
attempt("own_seed", lambda: open("/app/seed.txt").read())
attempt("own_write", lambda: open("/app/mine.txt", "w").write(os.environ["WHO"]))
attempt("tmp_write", lambda: open("/tmp/t.txt", "w").write("x"))
attempt("tmp_list", lambda: sorted(os.listdir("/tmp")))
for path in ("/new_file", "/usr/new_file", "/etc/new_file", "/var/new_file"):
    attempt("write " + path, lambda: open(path, "w").write("x"))
attempt("run", lambda: sorted(os.listdir("/run")))
attempt("visible", lambda: sorted(os.listdir(sys.argv[3])))
print(json.dumps(out))
"""


def kept_in_tmp() -> list[str]:
    """What the sandbox's own /tmp shows besides what the process writes: the top directories of this checkout
    and interpreter when they live in /tmp (bound back read-only; e.g. a CI clone in /tmp)."""
    paths = (os.path.realpath(p) for p in (REPO_ROOT, sys.prefix, sys.base_prefix))
    return sorted({Path(p).relative_to("/tmp").parts[0] for p in paths if p.startswith("/tmp/")})


def test_two_executions_see_only_their_own_workspace(run_dir):
    visible = Path(tempfile.mkdtemp(prefix="gyre-sbtest-visible-", dir="/var/tmp"))  # not hidden: the control
    (visible / "v.txt").write_text("v")
    sandbox = make(run_dir)
    try:
        procs = {}
        for me, other in (("A", "B"), ("B", "A")):
            env = {**BASE_ENV, "WHO": me, "HOME": str(Path.home())}
            prepared = sandbox.prepare(launch(run_dir / me / "workspace", [PY, "-c", PROBE, str(run_dir), other, str(visible)], env=env))  # fmt: skip
            procs[me] = (prepared, subprocess.Popen(prepared.argv, env=prepared.env, cwd=prepared.cwd,
                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
        seen = {}
        for me, (prepared, proc) in procs.items():
            out, err = proc.communicate(timeout=scaled(30))
            prepared.cleanup()
            assert proc.returncode == 0, err
            seen[me] = json.loads(out)
    finally:
        sandbox.close()
        shutil.rmtree(visible, ignore_errors=True)
    home = Path(os.path.realpath(Path.home()))
    kept = [Path(os.path.realpath(p)) for p in (sys.prefix, sys.base_prefix, REPO_ROOT)]
    # $HOME is an empty tmpfs inside, but for the interpreter and checkout bound back (e.g. ~/.pyenv/versions/X)
    home_inside = sorted({p.relative_to(home).parts[0] for p in kept if p.is_relative_to(home) and p != home})
    for me in ("A", "B"):
        s = seen[me]
        assert s["run_dir"] == []  # an empty tmpfs over the hidden run dir
        assert s["other_ws"].startswith("error: FileNotFound") and s["records"].startswith("error: FileNotFound")
        assert s["home"] == home_inside  # none of the host's dotfiles, keys, caches
        assert s["own_seed"] == f"seed of {me}" and s["own_write"] == 1
        assert s["tmp_write"] == 1 and s["tmp_list"] == sorted(["t.txt", *kept_in_tmp()])  # its own /tmp
        for path in ("/new_file", "/usr/new_file", "/etc/new_file", "/var/new_file"):
            assert s["write " + path] == "error: OSError", path  # EROFS: the system is read-only
        assert set(s["run"]) <= {"systemd"}  # not the host's /run (daemon sockets) but its own tmpfs
        assert s["visible"] == ["v.txt"]  # what is not hidden is visible (the control for run_dir)
        assert (run_dir / me / "workspace" / "mine.txt").read_text() == me  # writes land in its own workspace


def test_a_hidden_dir_inside_a_kept_one_stays_hidden(run_dir):
    # e.g. $HOME hidden, the checkout under it kept (the interpreter and code), the run dir inside the checkout
    home = run_dir / "home"
    (home / "proj" / "runs" / "r1").mkdir(parents=True)
    (home / "proj" / "code.py").write_text("x")
    (home / ".ssh").mkdir()
    sandbox = BwrapSandbox(None, [home, home / "proj" / "runs"], run_dir / "state", keep=[home / "proj"])
    ls = "import os, sys; print([sorted(os.listdir(p)) for p in sys.argv[1:]])"
    done = run(sandbox, launch(run_dir / "A" / "workspace", [PY, "-c", ls, str(home), str(home / "proj"),
                                                          str(home / "proj" / "runs")]))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[['proj'], ['code.py', 'runs'], []]"


def test_a_checkout_and_interpreter_in_tmp_are_bound_back_and_its_run_dir_stays_hidden(run_dir):
    # e.g. CI cloning into /tmp/ci_clone with its venv inside: the sandbox's own /tmp must not hide them
    proj = Path(tempfile.mkdtemp(prefix="gyre-checkout-", dir="/tmp"))
    try:
        (proj / "runs" / "r1").mkdir(parents=True)
        (proj / "code.py").write_text("x")
        sandbox = BwrapSandbox(None, [proj / "runs"], run_dir / "state", keep=[proj])
        ls = "import os, sys; print([sorted(os.listdir(p)) for p in sys.argv[1:]])"
        done = run(sandbox, launch(run_dir / "A" / "workspace", [PY, "-c", ls, str(proj), str(proj / "runs"), "/tmp"]))
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"[['code.py', 'runs'], [], {sorted([proj.name, *kept_in_tmp()])}]"
    finally:
        shutil.rmtree(proj)


def test_root_in_the_sandbox_cannot_undo_the_read_only_system_or_the_hiding(run_dir):
    escape = f"grep CapEff /proc/self/status; mount -o remount,bind,rw /usr && echo REMOUNTED; umount {run_dir} && echo UNMOUNTED; ls {run_dir}"  # fmt: skip
    done = run(make(run_dir), launch(run_dir / "A" / "workspace", ["sh", "-c", escape]))
    assert "REMOUNTED" not in done.stdout and "UNMOUNTED" not in done.stdout
    assert done.stdout.splitlines()[0].split() == ["CapEff:", "0000000000000000"]
    assert "records" not in done.stdout


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    acked = threading.Event()

    def log_message(self, *args) -> None:
        pass

    def _send(self, body: bytes, close: bool = False) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/ack":
            type(self).acked.set()
            self._send(b"ok")
        elif self.path == "/stream":  # chunk 1, then chunk 2 only once the client has acked chunk 1
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"6\r\nfirst\n\r\n")
            self.wfile.flush()
            last = b"after-ack\n" if type(self).acked.wait(scaled(10)) else b"no-ack-in-10s\n"
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(last), last))
        else:
            self._send(
                f"{self.server.server_port} {self.path}".encode(), close=self.headers.get("Connection") == "close"
            )


@pytest.fixture
def servers():
    """Two real HTTP servers on the host: the stand-in proxy and another one that must stay unreachable."""
    started = []
    for _ in range(2):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("H", (_Handler,), {"acked": threading.Event()}))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
    yield [s.server_port for s in started]
    for server in started:
        server.shutdown()
        server.server_close()


CLIENT = r"""
import http.client, json, socket, sys, threading
port, other, limit = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])  # limit: a hang guard, scaled
out = {"get": [None] * 8}
def get(i):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=limit)
    conn.request("GET", f"/get/{i}")
    out["get"][i] = conn.getresponse().read().decode()
threads = [threading.Thread(target=get, args=(i,)) for i in range(8)]
for t in threads: t.start()
for t in threads: t.join()
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=limit)
conn.request("GET", "/stream")
resp = conn.getresponse()
out["chunked"] = resp.getheader("Transfer-Encoding")
first = resp.readline().decode()
ack = http.client.HTTPConnection("127.0.0.1", port, timeout=limit)
ack.request("GET", "/ack"); ack.getresponse().read()
out["stream"] = first + resp.read().decode()
raw = socket.create_connection(("127.0.0.1", port), timeout=limit)  # request, half-close, read to EOF
raw.sendall(b"GET /half HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
raw.shutdown(socket.SHUT_WR)
data = b""
while chunk := raw.recv(4096): data += chunk
out["half"] = data.decode().split("\r\n\r\n", 1)[1]
for name, p in (("other", other), ("proxy_again", port)):
    try:
        socket.create_connection(("127.0.0.1", p), timeout=limit).close(); out[name] = "connected"
    except OSError as exc:
        out[name] = type(exc).__name__
print(json.dumps(out))
"""


def test_proxy_network_reaches_only_the_proxy_and_none_reaches_nothing(run_dir, servers):
    port, other = servers
    sandbox = make(run_dir, ("127.0.0.1", port))
    ws = run_dir / "A" / "workspace"
    try:
        done = run(sandbox, launch(ws, [PY, "-c", CLIENT, str(port), str(other), str(scaled(20))], network="proxy"))
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        assert out["get"] == [f"{port} /get/{i}" for i in range(8)]  # concurrent requests, each its own answer
        assert out["chunked"] == "chunked" and out["stream"] == "first\nafter-ack\n"  # streamed, not buffered
        assert out["half"] == f"{port} /half"
        assert out["other"] == "ConnectionRefusedError" and out["proxy_again"] == "connected"
        probe = "import socket, sys\ntry:\n    socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5)\n    print('connected')\nexcept OSError as e:\n    print(type(e).__name__)"  # fmt: skip
        none = run(sandbox, launch(ws, [PY, "-c", probe, str(port)], network="none"))
        assert none.stdout.strip() == "ConnectionRefusedError", none.stderr
        internet = launch(ws, [PY, "-c", probe, str(other)], network="proxy", limits=Limits(allow_internet=True))
        assert sandbox.prepare(internet).applied["network"] == "host"  # the task asked for the internet
        assert run(sandbox, internet).stdout.strip() == "connected"  # the host network is shared
    finally:
        sandbox.close()
    assert not (run_dir / "state" / "proxy.sock").exists()  # close() removes the bridge socket


class _ChatHandler(http.server.BaseHTTPRequestHandler):
    """A stand-in proxy speaking the OpenAI chat API: streams the words of the last user message back."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        words = body["messages"][-1]["content"].split()
        key = self.headers.get("Authorization", "")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i, word in enumerate([*words, key]):
            delta = {"content": word + " "} if i else {"role": "assistant", "content": word + " "}
            chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                     "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}  # fmt: skip
            event = f"data: {json.dumps(chunk)}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        done = b"data: [DONE]\n\n"
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


SDK_CLIENT = r"""
import openai
client = openai.OpenAI()
for i in range(2):  # the second call reuses the kept-alive connection through the bridge
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"one two {i}"}],
                                            stream=True)
    print("".join(c.choices[0].delta.content or "" for c in stream).strip())
"""


def test_openai_sdk_streams_through_the_bridge(run_dir):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ChatHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_port
    sandbox = make(run_dir, ("127.0.0.1", port))
    env = {**BASE_ENV, "OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1", "OPENAI_API_KEY": "key-e0"}
    try:
        done = run(sandbox, launch(run_dir / "A" / "workspace", [PY, "-c", SDK_CLIENT], network="proxy", env=env))
    finally:
        sandbox.close()
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["one two 0 Bearer key-e0", "one two 1 Bearer key-e0"]


DAEMON = r"""
set -e
setsid bash -c '(exec -a "$0-daemon" sleep 1000 &) ; exit 0' "$MARKER" &
for i in $(seq 2000); do
  if pgrep -f -- "$MARKER-daemon" > /dev/null; then echo up > daemon.txt; break; fi
  sleep 0.05
done
sleep 3600
"""


def _marked(marker: str) -> list[int]:
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes() and int(cmdline.parent.name) != os.getpid():
                pids.append(int(cmdline.parent.name))
        except OSError:
            pass
    return pids


def _run_daemon_harness(sandbox, workspace: Path, marker: str, log_dir: Path) -> str:
    prepared = sandbox.prepare(launch(workspace, ["bash", "-c", DAEMON], env={**BASE_ENV, "MARKER": marker}))
    try:
        # the timeout under test; scaled, so the daemon is up (daemon.txt) before it hits, loaded or not
        timeout_s = scaled(3.0)
        status, *_ = ProcessGroups(kill_grace_s=0.5).run(
            "e", prepared.argv, prepared.cwd, prepared.env, log_dir, timeout_s
        )
    finally:
        prepared.cleanup()
    return status


def _gone(marker: str, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + scaled(within_s)
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _marked(marker)


def test_timeout_kill_ends_setsid_double_forked_daemons(run_dir, tmp_path):
    ws = run_dir / "A" / "workspace"
    # Without a sandbox the daemon leaves the process group; the executor's sweep of the processes marked
    # with its launch (process_group.sweep) kills it all the same.
    marker = f"gyre-daemon-{uuid.uuid4().hex}"
    assert _run_daemon_harness(NoneSandbox(), ws, marker, tmp_path) == "timeout"
    survivors = [] if _gone(marker) else _marked(marker)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert (ws / "daemon.txt").read_text() == "up\n" and survivors == []
    (ws / "daemon.txt").unlink()
    sandbox = make(run_dir)
    marker = f"gyre-daemon-{uuid.uuid4().hex}"
    try:
        assert _run_daemon_harness(sandbox, ws, marker, tmp_path) == "timeout"
        assert (ws / "daemon.txt").read_text() == "up\n"  # it was running inside when the timeout hit
        survivors = [] if _gone(marker) else _marked(marker)
    finally:
        sandbox.close()
        for pid in _marked(marker):  # leave nothing behind, even when the test fails
            os.kill(pid, signal.SIGKILL)
    assert survivors == [], f"processes {survivors} survived the kill"


def test_launch_env_is_the_whole_environment(run_dir, servers, monkeypatch):
    monkeypatch.setenv("GYRE_SECRET_TEST", "do-not-leak")
    sandbox = make(run_dir, ("127.0.0.1", servers[0]))
    ws = run_dir / "A" / "workspace"
    try:
        for network in ("none", "proxy"):  # "proxy" runs through the forwarder (a Python process)
            done = run(sandbox, launch(ws, ["env", "-0"], network=network, env={**BASE_ENV, "ONLY": "this"}))
            assert done.returncode == 0, done.stderr
            env = dict(item.split("=", 1) for item in done.stdout.split("\0") if item)
            assert env == {**BASE_ENV, "ONLY": "this", "PWD": "/app"}, network  # bwrap --chdir sets PWD
    finally:
        sandbox.close()


ALLOC = "import sys; b = bytearray(int(sys.argv[1]) * 2**20); b[::4096] = b'x' * len(b[::4096]); print('survived')"


def test_memory_and_cpu_limits_through_a_cgroup(run_dir):
    sandbox = make(run_dir)
    ws = run_dir / "A" / "workspace"
    limits = Limits(cpus=0.5, memory_mb=96)
    prepared = sandbox.prepare(launch(ws, [PY, "-c", ALLOC, "192"], limits=limits))
    try:
        applied = prepared.applied
        assert applied["cpus"] == 0.5 and applied["memory_mb"] == 96
        if not applied["limits"].startswith("cgroup"):
            assert any(n.startswith("memory_mb") for n in applied["not_applied"])
            pytest.skip(f"no writable cgroup on this machine: {applied['not_applied']}")
        assert applied["not_applied"] == [] and applied["limits"] in ("cgroup-v1", "cgroup-v2")
        cgroups = [Path(p) for p in applied["cgroups"]]
        big = subprocess.run(
            prepared.argv, env=prepared.env, cwd=prepared.cwd, capture_output=True, text=True, timeout=scaled(60)
        )
        assert big.returncode != 0 and "survived" not in big.stdout  # 2x the limit: killed
        if applied["limits"] == "cgroup-v1":
            quota = next(
                int((d / "cpu.cfs_quota_us").read_text()) for d in cgroups if (d / "cpu.cfs_quota_us").exists()
            )
            assert quota == 50_000
    finally:
        prepared.cleanup()
    assert not any(d.exists() for d in cgroups)  # cleanup removes the cgroups
    small = run(sandbox, launch(ws, [PY, "-c", ALLOC, "24"], limits=limits))  # a quarter of the limit: fine
    assert small.returncode == 0 and small.stdout.strip() == "survived", small.stderr


def test_cpus_fall_back_to_affinity_without_a_cgroup(run_dir):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("CPU affinity can only limit below the CPUs there are; this process has 1")
    sandbox = make(run_dir, use_cgroups=False)
    read = "print(open('/proc/self/status').read().split('Cpus_allowed_list:')[1].split()[0])"
    done = run(sandbox, launch(run_dir / "A" / "workspace", [PY, "-c", read], limits=Limits(cpus=1, memory_mb=64)))
    prepared = sandbox.prepare(launch(run_dir / "A" / "workspace", ["true"], limits=Limits(cpus=1, memory_mb=64)))
    assert prepared.applied["limits"] == "affinity" and len(prepared.applied["cpu_list"]) == 1
    assert any(n.startswith("memory_mb: no writable cgroup") for n in prepared.applied["not_applied"])
    assert done.returncode == 0 and done.stdout.strip().isdigit(), done.stderr  # one CPU, not "0-1"
    env = run(sandbox, launch(run_dir / "A" / "workspace", ["env", "-0"], limits=Limits(cpus=1))).stdout
    assert dict(i.split("=", 1) for i in env.split("\0") if i) == {**BASE_ENV, "PWD": "/app"}  # the wrapper adds none


def test_bad_launches_are_refused_with_what_to_do(tmp_path):
    for bad, match in (
        (lambda: Limits(cpus=0), "positive number of CPUs"),
        (lambda: Limits(memory_mb=1.5), "positive integer"),
        (lambda: Mount(tmp_path, "app"), "absolute path"),
        (lambda: Launch(["true"], "/app", {}, (), "internet"), "network='internet' must be one of"),
        (lambda: Launch(["true"], "/app", {}, (Mount(tmp_path / "nope", "/app"),), "none"), "does not exist"),
        (lambda: Launch([], "/app", {}, (), "none"), "non-empty list"),
    ):
        with pytest.raises(ValueError, match=match):
            bad()
    sandbox = BwrapSandbox(None, [], tmp_path)
    with pytest.raises(ValueError, match="proxy_address=None"):
        sandbox.prepare(Launch(["true"], "/app", {}, (), "proxy"))


def test_forwarder_exits_with_its_childs_status(tmp_path):
    sock = tmp_path / "s.sock"
    sock.touch()  # forward.py only checks that the socket exists before it starts the command
    base = [PY, "-I", "-S", str(FORWARD_SCRIPT), "--port", "0", "--socket", str(sock), "--"]
    assert subprocess.run([*base, "sh", "-c", "exit 7"], timeout=scaled(30)).returncode == 7
    assert subprocess.run([*base, "sh", "-c", "kill -TERM $$"], timeout=scaled(30)).returncode == -signal.SIGTERM
    nope = [PY, "-I", "-S", str(FORWARD_SCRIPT), "--port", "0", "--socket", str(tmp_path / "nope"), "--", "true"]
    missing = subprocess.run(nope, capture_output=True, text=True, timeout=scaled(30))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_check_says_what_is_missing_and_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap, no docker
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        make_sandbox("bwrap", proxy_address=None, state_dir=tmp_path).check()
    with pytest.raises(SandboxUnavailable, match="`docker` is not on PATH"):
        make_sandbox("docker", proxy_address=None, state_dir=tmp_path).check()
    fake = tmp_path / "docker"  # a docker CLI whose daemon is not running
    fake.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?' >&2\nexit 1\n")  # fmt: skip
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailable) as info:
        make_sandbox("docker", proxy_address=None, state_dir=tmp_path).check()
    assert str(info.value) == (
        "config.rollout.sandbox='docker' needs a running Docker daemon: `docker info` failed: Cannot connect to the "
        "Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?; start dockerd, or use sandbox='bwrap'"
    )
    with pytest.raises(ValueError, match="not one of"):
        make_sandbox("podman", proxy_address=None, state_dir=tmp_path)
    assert SANDBOXES == ("none", "bwrap", "docker")


def test_real_docker_cli_without_a_daemon_is_refused(tmp_path):
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker CLI on this machine")
    if subprocess.run([docker, "info"], capture_output=True, timeout=scaled(30)).returncode == 0:
        pytest.skip("a Docker daemon is running here; the refusal cannot be seen")
    with pytest.raises(
        SandboxUnavailable, match=r"needs a running Docker daemon: `docker info` failed: .+; start dockerd"
    ):
        make_sandbox("docker", proxy_address=None, state_dir=tmp_path).check()


def test_docker_run_argv(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    context = tmp_path / "environment"
    context.mkdir()
    (context / "Dockerfile").write_text("FROM python:3.11-slim\n")
    ws, tests = tmp_path / "ws", tmp_path / "tests"
    ws.mkdir(), tests.mkdir()
    built = []
    sandbox = DockerSandbox(("127.0.0.1", 8123), [], tmp_path / "state", build=lambda *a: built.append(a))
    spec = Launch(argv=["claude", "-p", "fix it"], cwd="/app", env={"PATH": "/usr/bin", "OPENAI_API_KEY": "k"},
                  mounts=(Mount(ws, "/app", writable=True), Mount(tests, "/tests")), network="proxy",
                  limits=Limits(cpus=1.5, memory_mb=2048), image_context=context)  # fmt: skip
    try:
        prepared = sandbox.prepare(spec)
        again = sandbox.prepare(spec)
    finally:
        sandbox.close()
    tag = image_tag(context)
    docker = str(bin_dir / "docker")
    assert built == [(docker, context.resolve(), tag)]  # built once per context
    name = prepared.applied["container"]
    sock = tmp_path / "state" / "proxy.sock"
    assert prepared.argv == [
        docker, "run", "--rm", "--init", "-i", "--name", name, "--network", "none", "--cpus", "1.5",
        "--memory", "2048m", "--memory-swap", "2048m", "-v", f"{ws}:/app", "-v", f"{tests}:/tests:ro",
        "-v", f"{REPO_ROOT}:{REPO_INSIDE}:ro", "-v", f"{sock}:{PROXY_SOCKET_INSIDE}", "-w", "/app",
        "-e", "PATH=/usr/bin", "-e", "OPENAI_API_KEY=k", "-e", f"PYTHONPATH={REPO_INSIDE}", tag,
        "python3", "-I", "-S", FORWARD_INSIDE, "--port", "8123", "--socket", PROXY_SOCKET_INSIDE, "--unset=LC_CTYPE",
        "--", "claude", "-p", "fix it",
    ]  # fmt: skip
    assert again.applied["container"] != name  # one container per execution
    assert prepared.applied == {"backend": "docker", "image": tag, "container": name, "network": "proxy", "cpus": 1.5,
                                "memory_mb": 2048, "allow_internet": False, "limits": "docker", "not_applied": []}  # fmt: skip
    # the docker client's own environment: what it needs, nothing of the launch's or this process's secrets
    assert prepared.env["PATH"] == str(bin_dir) and set(prepared.env) <= set(CLIENT_ENV)
    assert prepared.cwd == tmp_path / "state"
    (context / "Dockerfile").write_text("FROM python:3.12-slim\n")
    assert image_tag(context) != tag  # a changed context is a new image
    with pytest.raises(ValueError, match="image_context"):
        DockerSandbox(None, [], tmp_path).prepare(Launch(["true"], "/app", {}, (), "none"))


def test_none_backend_runs_the_launch_unchanged(tmp_path):
    sandbox = make_sandbox("none", proxy_address=("127.0.0.1", 1), state_dir=tmp_path)
    mount = Mount(tmp_path, "/app", writable=True)
    assert sandbox.path(mount) == str(tmp_path) and not sandbox.maps_paths
    prepared = sandbox.prepare(Launch(["true"], str(tmp_path), {"A": "1"}, (mount,), "proxy", Limits(cpus=2)))
    assert (prepared.argv, prepared.env, prepared.cwd) == (["true"], {"A": "1"}, tmp_path)
    assert prepared.applied["backend"] == "none" and prepared.applied["network"] == "host"
    assert prepared.applied["not_applied"][0] == "cpus: sandbox='none' applies no limits"
    sandbox.close()
