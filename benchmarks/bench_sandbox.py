"""Sandbox overheads: process start under bwrap vs bare, and one HTTP request through the proxy bridge vs direct.

Part 1, start: wall time of running ``true`` to its exit (``subprocess.run``), median of ``--starts`` runs:
bare; under bwrap with network "none" (the argv ``BwrapSandbox.prepare`` builds: read-only system, hidden
paths, own namespaces); under bwrap with network "proxy" (the same plus the in-sandbox forwarder, a Python
process, started before ``true``).

Part 2, request latency: a real HTTP server on the host (``http.server``, a 2-byte answer); one client script
times ``--requests`` GETs (median), once on the host against the server directly and once inside a bwrap
sandbox with network "proxy" (forwarder on 127.0.0.1:PORT -> Unix socket -> host bridge -> server), in
``--rounds`` alternating rounds (median of the round medians). Both with a new connection per request and
with one kept-alive connection.

    python benchmarks/bench_sandbox.py                   # prints a table, writes benchmarks/results/sandbox.json
    python benchmarks/bench_sandbox.py --starts 5 --requests 10 --out /tmp/sandbox_smoke.json
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gyre_jax.rollout.sandbox import Launch, Mount
from gyre_jax.rollout.sandbox.bwrap import BwrapSandbox

ROOT = Path(__file__).resolve().parents[1]

CLIENT = r"""
import http.client, json, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
def fresh():
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/"); conn.getresponse().read(); conn.close()
kept = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
def keepalive():
    kept.request("GET", "/"); kept.getresponse().read()
out = {}
for name, fn in (("new_connection", fresh), ("keep_alive", keepalive)):
    fn()  # warm-up (connection set-up for keep_alive, first bridge thread)
    times = []
    for _ in range(n):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    out[name] = times
print(json.dumps(out))
"""


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no delayed-ACK wait between them

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1000.0


def _time_run(argv: list[str], env: dict[str, str], cwd: Path, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        subprocess.run(argv, env=env, cwd=cwd, check=True, stdin=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return times


def bench_start(sandbox: BwrapSandbox, workspace: Path, n: int) -> dict[str, float]:
    env = {"PATH": "/usr/bin:/bin"}
    rows = {"bare": _median_ms(_time_run(["true"], env, workspace, n))}
    for network in ("none", "proxy"):
        spec = Launch(["true"], "/app", env, (Mount(workspace, "/app", True),), network)
        prepared = sandbox.prepare(spec)
        rows[f"bwrap, network {network}"] = _median_ms(_time_run(prepared.argv, prepared.env, prepared.cwd, n))
        prepared.cleanup()
    return rows


def _client(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> dict[str, list[float]]:
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the benchmark client failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def bench_requests(
    sandbox: BwrapSandbox, workspace: Path, port: int, n: int, rounds: int
) -> dict[str, dict[str, float]]:
    """Median request time per kind, direct and through the bridge: the median over ``rounds`` alternating
    rounds of the median of ``n`` requests (the machine is shared: alternating spreads its noise evenly)."""
    argv = [sys.executable, "-c", CLIENT, str(port), str(n)]
    env = {"PATH": "/usr/bin:/bin"}
    medians: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        direct = _client(argv, env)
        prepared = sandbox.prepare(Launch(argv, "/app", env, (Mount(workspace, "/app", True),), "proxy"))
        bridged = _client(prepared.argv, prepared.env, prepared.cwd)
        prepared.cleanup()
        for kind in direct:
            row = medians.setdefault(kind, {"direct_ms": [], "bridge_ms": []})
            row["direct_ms"].append(_median_ms(direct[kind]))
            row["bridge_ms"].append(_median_ms(bridged[kind]))
    return {kind: {k: statistics.median(v) for k, v in row.items()} | {"rounds": row} for kind, row in medians.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--starts", type=int, default=20, help="runs of `true` per variant (median)")
    ap.add_argument("--requests", type=int, default=50, help="requests per variant and round (median)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating direct/bridge rounds (median of medians)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sandbox.json")
    args = ap.parse_args(argv)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state = Path(tempfile.mkdtemp(prefix="gyre-bench-sandbox-"))
    workspace = state / "workspace"
    workspace.mkdir()
    sandbox = BwrapSandbox(("127.0.0.1", server.server_port), [], state / "state")
    try:
        sandbox.check()
        start = bench_start(sandbox, workspace, args.starts)
        requests = bench_requests(sandbox, workspace, server.server_port, args.requests, args.rounds)
    finally:
        sandbox.close()
        server.shutdown()
        shutil.rmtree(state, ignore_errors=True)
    bwrap_version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    print(f"process start, `true` to exit (median of {args.starts}):")
    for name, ms in start.items():
        print(f"  {name:<24} {ms:8.2f} ms")
    print(f"one GET through the proxy bridge vs direct (median of {args.rounds} rounds of medians of {args.requests}):")
    print(f"  {'':<16} {'direct':>10} {'bridge':>10} {'added':>10}")
    for kind, row in requests.items():
        added = row["bridge_ms"] - row["direct_ms"]
        print(f"  {kind:<16} {row['direct_ms']:8.3f} ms {row['bridge_ms']:8.3f} ms {added:8.3f} ms")
    report = {"benchmark": "sandbox", "python": platform.python_version(), "bwrap": bwrap_version,
              "cpus": len(os.sched_getaffinity(0)), "starts": args.starts, "requests": args.requests, "rounds": args.rounds,
              "start_median_ms": start, "request_median_ms": requests}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
