"""Issue 19 item 6: one execution cannot reach another's threads or records through the proxy; keys are
unguessable and never written to logs, records or results; the proxy refuses a non-loopback bind unless asked;
execution directories are private (0700). Workspaces inside the bwrap sandbox (each execution sees only its own)
are tested in tests/rollout/test_sandbox.py::test_two_executions_see_only_their_own_workspace."""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

import httpx
import pytest
from timelimits import scaled

sys.path.insert(0, str(Path(__file__).parent))
import _fuzz_util as fu  # noqa: E402

from gyre_jax.config.base import ConfigError  # noqa: E402
from gyre_jax.config.rollout import ProxySection  # noqa: E402
from gyre_jax.proxy import identity  # noqa: E402
from gyre_jax.proxy.records import RecordStore  # noqa: E402
from gyre_jax.proxy.server import ProxyServer  # noqa: E402
from gyre_jax.rollout.executor import ExecutionSpec, Executor  # noqa: E402
from gyre_jax.rollout.tasks import INPUT_FILE, Task  # noqa: E402
from gyre_jax.serving.scripted import ScriptedBackend  # noqa: E402

SECRET = "zq-secret-of-e0"  # text only execution e0 ever sends
MSG = [{"role": "user", "content": f"{SECRET} question"}]
BODIES = {  # path -> (a first call, its continuation given the first call's answer)
    "/v1/chat/completions": (
        {"model": fu.MODEL, "messages": MSG},
        lambda answer: {"model": fu.MODEL, "messages": [*MSG, {"role": "assistant", "content": answer},
                                                         {"role": "user", "content": "next"}]},
    ),
    "/v1/messages": (
        {"model": fu.MODEL, "max_tokens": 16, "messages": MSG},
        lambda answer: {"model": fu.MODEL, "max_tokens": 16, "messages": [*MSG, {"role": "assistant", "content": answer},
                                                                           {"role": "user", "content": "next"}]},
    ),
    "/v1/responses": (
        {"model": fu.MODEL, "input": MSG},
        lambda answer: {"model": fu.MODEL, "input": [*MSG, {"role": "assistant", "content": answer},
                                                     {"role": "user", "content": "next"}]},
    ),
    "/v1/completions": ({"model": fu.MODEL, "prompt": f"{SECRET} raw"}, lambda answer: {"model": fu.MODEL, "prompt": "x"}),
}  # fmt: skip


def answer_text(path: str, body: dict) -> str:
    if path == "/v1/chat/completions":
        return body["choices"][0]["message"]["content"]
    if path == "/v1/messages":
        return body["content"][0]["text"]
    if path == "/v1/responses":
        return body["output"][-1]["content"][0]["text"]
    return body["choices"][0]["text"]


def all_endpoints(live: fu.Live, headers: dict[str, str]) -> dict[str, int]:
    """Status of one call to every endpoint that takes a key, with ``headers``."""
    statuses = {"GET /v1/models": httpx.get(live.root + "/v1/models", headers=headers).status_code}
    for path, (first, _) in BODIES.items():
        statuses[f"POST {path}"] = httpx.post(
            live.root + path, json=first, headers=headers, timeout=scaled(30)
        ).status_code
    count = {"model": fu.MODEL, "messages": MSG}
    statuses["POST count_tokens"] = httpx.post(
        live.root + "/v1/messages/count_tokens", json=count, headers=headers
    ).status_code
    return statuses


@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_key_cannot_continue_or_read_another_executions_thread(tmp_path, path):
    first, follow = BODIES[path]
    with fu.live_proxy(tmp_path, ("e0", "e1")) as live:
        r = httpx.post(live.root + path, json=first, headers=live.headers("e0", **{"x-gyre-thread-id": "t0"}))
        assert r.status_code == 200, r.text
        answer = answer_text(path, r.json())
        [own] = live.store.read("e0")
        e0_file = live.store.path("e0").read_bytes()
        # the same continuation, naming e0's thread in every thread header: from e0 it continues (control) ...
        names = {"x-gyre-thread-id": own.thread_id, "x-claude-code-session-id": own.thread_id}
        r0 = httpx.post(live.root + path, json=follow(answer), headers=live.headers("e0", **names))
        # ... from e1 it starts e1's own conversation, in e1's record file only
        e0_threads = live.server.execution_threads("e0")
        r1 = httpx.post(live.root + path, json=follow(answer), headers=live.headers("e1", **names))
        assert r0.status_code == 200 and r1.status_code == 200, (r0.text, r1.text)
        assert SECRET not in r1.text
        e0_records, [theirs] = live.store.read("e0"), live.store.read("e1")
        assert live.store.path("e0").read_bytes().startswith(e0_file) and len(e0_records) == 2
        if path != "/v1/completions":  # a chat API continues a conversation by its tokens (TITO)
            assert e0_records[1].reused_prefix_len > 0  # the control: e0's own key continues its thread
        assert theirs.execution_id == "e1" and theirs.call_index == 0 and theirs.reused_prefix_len == 0
        # a call of e1 naming e0's thread and sending nothing of e0's sees nothing of e0's
        fresh = {"model": fu.MODEL, "messages": [{"role": "user", "content": "what came before?"}], "max_tokens": 16,
                 "input": "what came before?", "prompt": "what came before?"}  # fmt: skip
        r2 = httpx.post(live.root + path, json=fresh, headers=live.headers("e1", **names))
        assert r2.status_code == 200 and SECRET not in r2.text
        last = live.store.read("e1")[-1]
        assert SECRET not in fu.BYTES.decode(last.prompt_ids) and last.reused_prefix_len == 0
        assert live.server.execution_threads("e0") == e0_threads  # e1's calls changed nothing of e0's live state


def test_every_endpoint_refuses_unknown_altered_and_ended_keys(tmp_path):
    with fu.live_proxy(tmp_path, ("e0", "e1")) as live:
        key, other = live.keys["e0"], live.keys["e1"]
        # e1's key ending in e0's last two characters (when they are e1's own, that is e1's valid key: one of
        # e1's characters changed instead)
        mixed = other[:-2] + key[-2:] if key[-2:] != other[-2:] else other[:-1] + ("0" if other[-1] != "0" else "1")
        for bad in ("gyre-", "gyre-" + "0" * 48, key[:-1], key + "0", key.upper(), mixed):
            statuses = all_endpoints(live, {"authorization": f"Bearer {bad}", "x-api-key": bad})
            assert set(statuses.values()) == {401}, (bad, statuses)
        assert set(all_endpoints(live, {}).values()) == {401}
        assert set(all_endpoints(live, live.headers("e0")).values()) == {200}
        live.server.close_execution("e0")
        assert set(all_endpoints(live, live.headers("e0")).values()) == {409}
        assert set(all_endpoints(live, {"x-api-key": key}).values()) == {409}
        assert set(all_endpoints(live, live.headers("e1")).values()) == {200}  # the other execution goes on
        assert live.store.count("e0") == 4 and live.store.count("e1") == 4  # one record per model call, each its own
        for path in ("records", "e1"):  # nothing on the wire reads records or names other executions
            r = httpx.get(f"{live.root}/v1/{path}", headers=live.headers("e1"))
            assert r.status_code == 404


def test_keys_are_192_random_bits_from_secrets(tmp_path, monkeypatch):
    executions = identity.Executions(RecordStore(tmp_path))
    keys = [executions.open(f"e{i}") for i in range(2000)]
    assert len(set(keys)) == len(keys)
    assert all(re.fullmatch(r"gyre-[0-9a-f]{48}", k) for k in keys)
    counts = collections.Counter("".join(k[5:] for k in keys))  # 96000 hex digits, 6000 expected of each
    assert len(counts) == 16 and all(5500 < c < 6500 for c in counts.values()), counts
    asked = []

    def spy(nbytes):
        asked.append(nbytes)
        return "f" * (2 * nbytes)

    monkeypatch.setattr(identity.secrets, "token_hex", spy)  # the source: the OS CSPRNG, 24 bytes a key
    assert executions.open("spied") == "gyre-" + "f" * 48 and asked == [24]


HARNESS = r"""
import os, sys, openai
client = openai.OpenAI()
reply = client.chat.completions.create(model=sys.argv[1], messages=[{"role": "user", "content": "hi"}])
open("answer.txt", "w").write(open("input.txt").read().upper())
print("answered", reply.choices[0].message.content, flush=True)
"""


def test_keys_never_reach_logs_records_or_results_and_execution_dirs_are_private(tmp_path):
    with fu.live_proxy(tmp_path, ("e-direct",)) as live:
        key = live.keys["e-direct"]
        for headers in (live.headers("e-direct"), {"x-api-key": key}, {"authorization": f"Bearer {key}x"}):
            all_endpoints(live, headers)  # successes, and 401s that name no key
        executor = Executor(live.server, live.server.base_url, tmp_path / "executions", model_name=fu.MODEL,
                            timeout_s=60, max_parallel=2, temperature=1.0, max_tokens=16, evaluator_timeout_s=30,
                            harness_cmd=[sys.executable, "-c", HARNESS, "{model}"])  # fmt: skip
        tasks = [Task(task_id=f"t{i}", kind="upper", system="", instruction="upper", files={INPUT_FILE: "ab"},
                      expected={"answer.txt": "AB"}, tools=[], max_turns=1, tool_latency_median_s=0.0,
                      tool_latency_sigma=0.0) for i in range(2)]  # fmt: skip
        results = executor.run([ExecutionSpec(f"x{i}", t, t.task_id, seed=i) for i, t in enumerate(tasks)])
        assert [r.reward for r in results] == [1.0, 1.0], results
        assert [live.store.count(r.execution_id) for r in results] == [1, 1]  # each harness called with its key
        live.server.close_execution("e-direct")
        all_endpoints(live, live.headers("e-direct"))  # 409s
        logs = "\n".join(live.logs)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "result.json" for p in written) and any(p.suffix == ".jsonl" for p in written)
    hex_keys = re.compile(rb"gyre-[0-9a-f]{48}")
    for path in written:
        data = path.read_bytes()
        assert not hex_keys.search(data), path  # no issued key (the executor's, given to harnesses, included)
    assert live.logs and not hex_keys.search(logs.encode()) and key[5:] not in logs
    for r in results:
        assert (tmp_path / "executions" / r.execution_id).stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.168.1.5", "example.com"])
def test_non_loopback_binds_are_refused_unless_allowed(tmp_path, host):
    backend = ScriptedBackend(fu.BYTES, fu.script)
    with pytest.raises(ValueError, match="allow_remote_bind"):
        ProxyServer(backend, fu.BYTES, RecordStore(tmp_path), host=host)
    ProxyServer(backend, fu.BYTES, RecordStore(tmp_path), host=host, allow_remote_bind=True)  # asked for: built
    with pytest.raises(ConfigError, match="allow_remote_bind"):
        ProxySection(host=host)
    assert ProxySection(host=host, allow_remote_bind=True).host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_binds_serve(tmp_path, host):
    if host == "::1" and not Path("/proc/net/if_inet6").exists():
        pytest.skip("no IPv6 loopback on this machine")
    with fu.live_proxy(tmp_path, ("e0",), host=host) as live:
        assert httpx.get(live.server.anthropic_base_url + "/health").status_code == 200
    assert ProxySection(host=host).host == host


@pytest.mark.parametrize("header", identity.THREAD_HEADERS)
def test_an_oversized_thread_id_is_refused_and_nothing_is_recorded(tmp_path, header):
    """A thread id is stored in every record of its calls: one over the bound is a 400 naming the header, the
    call is not recorded, and the next call is served."""
    body = {"model": fu.MODEL, "messages": MSG}
    with fu.live_proxy(tmp_path, ("e0",)) as live:
        long_id = "t" * (identity.MAX_THREAD_ID_CHARS + 1)
        r = httpx.post(live.root + "/v1/chat/completions", json=body, headers=live.headers("e0", **{header: long_id}))
        assert r.status_code == 400 and header in r.json()["error"]["message"], r.text
        assert live.store.read("e0") == []
        ok_id = "t" * identity.MAX_THREAD_ID_CHARS
        r = httpx.post(live.root + "/v1/chat/completions", json=body, headers=live.headers("e0", **{header: ok_id}))
        assert r.status_code == 200, r.text
        [record] = live.store.read("e0")
        assert record.thread_id.startswith(ok_id) and record.call_index == 0
