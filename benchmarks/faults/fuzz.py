"""Issue 19 items 5 and 6, long versions: the proxy under fuzzed input, and cross-execution isolation.

``run(quick, seed, workdir)`` returns one row per fault (see the integrator's benchmarks/bench_faults.py):
schemathesis against ``GET /openapi.json`` (every endpoint, positive and negative cases, with the key and without),
hand-made hostile bodies on every POST route, hypothesis-generated message lists / tool schemas with UTF-8 edge
cases, calls of every execution with every other execution's key-less thread names, non-loopback binds, and a
scan of everything written (records, logs) for issued keys. ``quick`` is the CI size (tests/faults/test_fuzz.py
and test_isolation.py run the same drivers, smaller); the long version runs many more generated cases.

    PYTHONPATH=. python -c "import importlib.util as u, pathlib, json; s=u.spec_from_file_location('f',
        'benchmarks/faults/fuzz.py'); m=u.module_from_spec(s); s.loader.exec_module(m);
        print(json.dumps(m.run(True, 0, pathlib.Path('/tmp/fuzz')), indent=1))"
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMMAND = "python benchmarks/bench_faults.py --case fuzz"
KEY = re.compile(rb"gyre-[0-9a-f]{48}")


def _util():
    spec = importlib.util.spec_from_file_location("_fuzz_util", ROOT / "tests" / "faults" / "_fuzz_util.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _row(fault: str, injected: int, ok: bool, printed: str, test: str, needs: str = "") -> dict:
    return {"fault": fault, "injected": injected, "lost": 0, "double_counted": 0, "outcome": "ok" if ok else "fails",
            "printed": printed, "command": f"{COMMAND}  (CI: pytest {test})", "needs": "" if ok else needs}  # fmt: skip


def _fuzz_rows(fu, quick: bool, seed: int, workdir: pathlib.Path, extra: dict) -> list[dict]:
    rows = []
    with fu.live_proxy(workdir / "fuzz") as live:
        t0 = time.monotonic()
        tally = fu.Tally()
        fu.schemathesis_fuzz(live, examples=3 if quick else 60, seed=seed, tally=tally)
        extra["schemathesis"] = {"cases": tally.cases, "statuses": dict(tally.statuses), "s": time.monotonic() - t0,
                                 "server_errors": tally.server_errors[:5], "nonconforming": tally.nonconforming[:5]}  # fmt: skip
        ok = tally.five_xx == 0 and not tally.nonconforming
        rows.append(_row("fuzz: schemathesis, all endpoints", sum(tally.statuses.values()), ok,
                         f"{tally.cases} cases, statuses {dict(sorted(tally.statuses.items()))}, {tally.five_xx} 5xx, "
                         f"{len(tally.nonconforming)} off-schema",
                         "tests/faults/test_fuzz.py::test_schemathesis_finds_no_5xx_and_every_answer_is_documented",
                         "a fix of the proxy's handling of the case in extra.schemathesis"))  # fmt: skip
        hostile = fu.Tally()
        sent = fu.send_hostile(live, hostile)
        rows.append(_row("fuzz: hostile bodies (surrogates, NaN, 10**5000, 100000-deep, bad UTF-8, oversize)", sent,
                         hostile.five_xx == 0 and not hostile.nonconforming,
                         f"statuses {dict(sorted(hostile.statuses.items()))}, {hostile.five_xx} 5xx",
                         "tests/faults/test_fuzz.py::test_hostile_bodies_are_a_4xx_in_each_apis_style_and_the_server_goes_on",
                         "; ".join(hostile.server_errors + hostile.nonconforming)[:200]))  # fmt: skip
        generated = fu.Tally()
        t0 = time.monotonic()
        fu.hypothesis_fuzz(live, examples=25 if quick else 600, seed=seed, tally=generated)
        extra["hypothesis"] = {"cases": generated.cases, "statuses": dict(generated.statuses),
                               "s": time.monotonic() - t0, "server_errors": generated.server_errors[:5]}  # fmt: skip
        records = fu.check_alive_and_records(live)  # raises if the server died or a record does not parse
        rows.append(_row("fuzz: hypothesis message lists, tool schemas, UTF-8 edge cases", generated.cases,
                         generated.five_xx == 0,
                         f"statuses {dict(sorted(generated.statuses.items()))}, {generated.five_xx} 5xx; server alive, "
                         f"{records} records parse",
                         "tests/faults/test_fuzz.py::test_generated_messages_and_tools_never_get_a_5xx",
                         "; ".join(generated.server_errors)[:200]))  # fmt: skip
        extra["records_parsed"] = records
    return rows


def _cross_calls(fu, live, ids: list[str]) -> tuple[int, list[str]]:
    """Every execution calls every POST route naming every other execution's thread; returns (calls, leaks)."""
    calls, leaks = 0, []
    with httpx.Client(timeout=60) as client:
        for e in ids:
            body = {"model": fu.MODEL, "messages": [{"role": "user", "content": f"<secret-{e}>"}]}
            client.post(live.root + "/v1/chat/completions", json=body, headers=live.headers(e))
        threads = {e: live.server.execution_threads(e) for e in ids}
        for e in ids:
            sizes = {o: live.store.path(o).stat().st_size for o in ids}  # before e's calls
            for other in (o for o in ids if o != e):
                names = {"x-gyre-thread-id": threads[other][0], "x-claude-code-session-id": threads[other][0]}
                for path in fu.POST_PATHS:
                    body = {"model": fu.MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "tell"}],
                            "input": "tell", "prompt": "tell"}  # fmt: skip
                    r = client.post(live.root + path, json=body, headers=live.headers(e, **names))
                    calls += 1
                    if f"<secret-{other}>" in r.text or r.status_code != 200:
                        leaks.append(f"{e} -> {other} on {path}: {r.status_code}")
                if live.store.path(other).stat().st_size != sizes[other]:
                    leaks.append(f"{e}'s calls wrote to {other}'s records")
        for e in ids:  # no prompt of e's holds another execution's text
            for record in live.store.read(e):
                prompt = fu.BYTES.decode(record.prompt_ids)
                if any(f"<secret-{o}>" in prompt for o in ids if o != e):
                    leaks.append(f"{e} call {record.call_index} was served another execution's conversation")
    return calls, leaks


def _isolation_rows(fu, quick: bool, workdir: pathlib.Path, extra: dict) -> list[dict]:
    from gyre_jax.proxy.records import RecordStore
    from gyre_jax.proxy.server import ProxyServer
    from gyre_jax.serving.scripted import ScriptedBackend

    ids = [f"iso{i}" for i in range(3 if quick else 12)]
    with fu.live_proxy(workdir / "isolation", tuple(ids)) as live:
        calls, leaks = _cross_calls(fu, live, ids)
        bad_keys = 0
        for e in ids:  # every other key shape, on every endpoint: an altered key never authenticates
            for bad in (live.keys[e][:-1], live.keys[e] + "0", live.keys[e].upper()):
                r = httpx.get(live.root + "/v1/models", headers={"x-api-key": bad})
                bad_keys += r.status_code != 401
        logs = "\n".join(live.logs).encode()
    rows = [_row("isolation: another execution's key and thread names, every endpoint", calls, not leaks and not bad_keys,
                 f"{len(ids)} executions, {calls} cross calls, {len(leaks)} reached another's thread or records, "
                 f"{bad_keys} altered keys accepted",
                 "tests/faults/test_isolation.py::test_a_key_cannot_continue_or_read_another_executions_thread",
                 "; ".join(leaks)[:200])]  # fmt: skip
    extra["isolation_leaks"] = leaks[:10]
    files = [p for p in workdir.rglob("*") if p.is_file()]
    found = [str(p) for p in files if KEY.search(p.read_bytes())] + (["the log"] if KEY.search(logs) else [])
    rows.append(_row("isolation: issued keys in logs, records, results", len(files) + 1, not found,
                     f"{len(files)} files and {len(logs)} bytes of log scanned, {len(found)} hold a key",
                     "tests/faults/test_isolation.py::test_keys_never_reach_logs_records_or_results_and_execution_dirs_are_private",
                     ", ".join(found)[:200]))  # fmt: skip
    hosts = ["0.0.0.0", "::", "", "10.0.0.1", "example.com"]
    refused = 0
    for host in hosts:
        try:
            ProxyServer(ScriptedBackend(fu.BYTES, fu.script), fu.BYTES, RecordStore(workdir / "bind"), host=host)
        except ValueError:
            refused += 1
    rows.append(_row("isolation: non-loopback bind without proxy.allow_remote_bind", len(hosts), refused == len(hosts),
                     f"{refused} of {len(hosts)} refused with 'set config.proxy.allow_remote_bind=True'",
                     "tests/faults/test_isolation.py::test_non_loopback_binds_are_refused_unless_allowed",
                     "ProxyServer to refuse non-loopback hosts"))  # fmt: skip
    return rows


def run(quick: bool, seed: int, workdir: pathlib.Path) -> dict:
    """The fuzz and isolation rows; ``extra`` holds the status counts, timings and the first failures."""
    fu = _util()
    workdir.mkdir(parents=True, exist_ok=True)
    extra: dict = {"quick": quick, "seed": seed}
    t0 = time.monotonic()
    rows = _fuzz_rows(fu, quick, seed, workdir, extra) + _isolation_rows(fu, quick, workdir, extra)
    extra["total_s"] = time.monotonic() - t0
    return {"rows": rows, "extra": extra}
