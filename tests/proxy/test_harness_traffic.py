"""Replays the corpus of real harness traffic (``tests/fixtures/harness_traffic/``) through a real ProxyServer
and checks the agents, labels and prefix reuse the trajectory processor derives against the hand-written truth.

Each scenario's calls (what Claude Code, opencode, mini-swe-agent ... really sent, recorded by
``tests/integration/record_traffic.py``) are re-sent in call order over HTTP, with the scripted backend
returning the completion each call got when it was recorded. Then, from the records alone:

- every call is labelled as the truth says (main, main-summary, subagent, subagent-summary, auxiliary);
- calls are split into agents exactly as the truth groups them;
- every call that continues an earlier call (re-sends its conversation verbatim, then an assistant turn: the one
  returned, or that turn changed) reuses that call's prompt + completion ids (``reused_prefix_len`` at least
  that, and those ids are its prefix), or, where the truth says ``"reuses": "prompt"`` (the turn re-sent as
  other text: smolagents' forced tool call), the prompt ids before its assistant turn; no other call reuses
  anything.

The label table is printed (``pytest -s``) and kept in docs/proxy.md.
"""

from __future__ import annotations

import json
import lzma
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from timelimits import scaled

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy.records import RecordStore, TitoRecord
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.serving.scripted import ScriptedBackend
from gyre_jax.trajectory.branches import BranchBuilder

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "harness_traffic"
SCENARIOS = sorted(CORPUS.glob("*/*.jsonl.xz"))
TOKENIZER = ByteTokenizer()


class Replay:
    """The completion the next backend call returns (calls are replayed one at a time)."""

    def __init__(self) -> None:
        self.completion: str | None = None

    def __call__(self, prompt: str) -> str:
        assert self.completion is not None, "a replayed call reached the backend without a recorded completion"
        text, self.completion = self.completion, None
        return text


@pytest.fixture(scope="module")
def replay_server(tmp_path_factory) -> Iterator[tuple[ProxyServer, Replay, RecordStore]]:
    replay = Replay()
    tokenizer = TOKENIZER
    store = RecordStore(tmp_path_factory.mktemp("records"))
    with ProxyServer(ScriptedBackend(tokenizer, replay), tokenizer, store, max_request_bytes=16 << 20) as proxy:
        yield proxy, replay, store


@dataclass
class Row:
    harness: str
    scenario: str
    calls: int
    labels_right: int
    agents_right: bool
    continuing: int  # calls that continue an earlier call (truth)
    reuse_right: int  # calls whose reuse is as the truth says (all calls)
    problems: list[str]

    def markdown(self) -> str:
        agents = "yes" if self.agents_right else "no"
        return (
            f"| {self.harness} | {self.scenario} | {self.calls} | {self.labels_right}/{self.calls} | {agents} | "
            f"{self.continuing} | {self.reuse_right}/{self.calls} |"
        )


def replay_scenario(proxy: ProxyServer, replay: Replay, path: Path) -> list[TitoRecord]:
    """Re-sends a scenario's recorded calls in order under a fresh execution; returns its records."""
    execution_id = f"{path.parent.name}-{path.name.split('.')[0]}"
    key = proxy.open_execution(execution_id)
    with lzma.open(path, "rt", encoding="utf-8") as f:
        calls = [json.loads(line) for line in f]
    with httpx.Client(base_url=f"http://127.0.0.1:{proxy.port}", timeout=scaled(60)) as client:
        for i, call in enumerate(calls):
            replay.completion = call["completion"]
            headers = {**call["headers"], "x-api-key": key, "authorization": f"Bearer {key}"}
            url = call["path"] + (f"?{call['query']}" if call["query"] else "")
            response = client.post(url, content=json.dumps(call["body"]), headers=headers)
            assert response.status_code == 200, f"{path.name} call {i}: {response.status_code} {response.text[:500]}"
            assert replay.completion is None, f"{path.name} call {i}: its recorded completion was not used"
    proxy.close_execution(execution_id)
    return proxy.record_store.read(execution_id)


def turn_start(prompt_ids: list[int]) -> int:
    """Where a prompt's assistant turn starts: after its last ``<|im_start|>assistant\\n`` (a forced opener follows)."""
    opener = TOKENIZER.encode("<|im_start|>assistant\n")
    starts = [i for i in range(len(prompt_ids) - len(opener) + 1) if prompt_ids[i : i + len(opener)] == opener]
    return starts[-1] + len(opener)


def check(path: Path, records: list[TitoRecord]) -> Row:
    truth = json.loads(path.with_name(path.name.replace(".jsonl.xz", ".truth.json")).read_text())
    expected = truth["calls"]
    problems: list[str] = []
    if len(records) != len(expected):
        problems.append(f"{len(records)} records, the truth has {len(expected)} calls")
    builder = BranchBuilder()
    branches = [builder.add(r) for r in records]
    builder.finish()
    labels_right = 0
    for call, branch in zip(expected, branches):
        if branch.label == call["label"]:
            labels_right += 1
        else:
            problems.append(f"call {call['call']}: labelled {branch.label}, truth {call['label']} ({call['agent']})")
    # Same agent in the truth <=> same agent in the branches (a bijection between the two namings).
    pairs = {(call["agent"], branch.agent) for call, branch in zip(expected, branches)}
    agents_right = len(pairs) == len({a for a, _ in pairs}) == len({b for _, b in pairs})
    if not agents_right:
        problems.append(f"agents split as {sorted(pairs)}")
    reuse_right = 0
    for call, rec in zip(expected, records):
        j = call["continues"]
        if j is None:
            ok = rec.reused_prefix_len == 0
        else:
            before = records[j].prompt_ids + records[j].completion_ids
            if call.get("reuses", "turn") == "prompt":
                before = records[j].prompt_ids[: turn_start(records[j].prompt_ids)]
            ok = rec.reused_prefix_len >= len(before) and rec.prompt_ids[: len(before)] == before
        reuse_right += ok
        if not ok:
            problems.append(f"call {call['call']}: reused {rec.reused_prefix_len} ids, truth: continues {j}")
    continuing = sum(call["continues"] is not None for call in expected)
    return Row(truth["harness"], truth["scenario"], len(expected), labels_right, agents_right, continuing,
               reuse_right, problems)  # fmt: skip


def test_corpus_is_there() -> None:
    harnesses = {p.parent.name for p in SCENARIOS}
    assert {"claude_code", "opencode", "mini_swe_agent", "aider", "smolagents"} <= harnesses, harnesses
    total = sum(p.stat().st_size for p in CORPUS.rglob("*") if p.is_file())
    assert total < 2 * 1024 * 1024, f"the corpus is {total} bytes; keep it under 2 MB"
    for path in SCENARIOS:
        assert path.with_name(path.name.replace(".jsonl.xz", ".truth.json")).exists(), f"{path} has no truth file"


def test_label_table(replay_server) -> None:
    proxy, replay, _ = replay_server
    rows = [check(path, replay_scenario(proxy, replay, path)) for path in SCENARIOS]
    print("\n| harness | scenario | calls | labels right | agents right | continuing calls | reuse right |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(row.markdown())
    problems = [f"{r.harness}/{r.scenario}: {p}" for r in rows for p in r.problems]
    assert not problems, "\n".join(problems)
