"""A real harness compacts its history after a context overflow, end to end, and the records label it as the trees
expect (docs/trajectory.md: the main agent's first branch ``main``, its later ones ``main-summary``).

The unmodified Claude Code CLI (the pinned npm release, its default command: 12 tools, a ~36K-token first prompt with
the byte tokenizer) runs against the real proxy over a scripted model: it calls Bash four times, each printing ~7 KB,
until its prompt passes the context: its first prompt's length plus room for three of those results and half of the
fourth (Claude Code's first prompt varies by a few KB with its environment, so the context follows it). The proxy refuses that call as Anthropic words it ("prompt is too
long: M tokens > N maximum"); Claude Code recognises the overflow, asks the model for a summary of the conversation
(its auto-compaction, with older tool results cut), and continues from the summary to the end (exit 0). The TITO
records hold every call served; the trainer's reader turns them into the main branch, the summary-writing branches
and the continuation, all of the main agent.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.rollout import templates
from gyre_jax.rollout.harnesses import fill_spec, harness_spec, write_files
from gyre_jax.serving.types import GenerationRequest, GenerationResult, TokenChunk
from gyre_jax.trajectory.pipeline import LoadExecution, TrajectoryConfig
from gyre_jax.trajectory.queue import QueuedExecution

BYTES = ByteTokenizer()
# tokens (bytes) past the first prompt: three tool results (~20K with their turns) fit, four (~27K) do not
ROOM = 23_500
STEP = 1400  # numbers per seq call
SUMMARY = "Summary: the user asked to count with seq; I ran it four times and saw the numbers. Next: say Done."
CONTINUED = "This session is being continued from a previous conversation that ran out of context."


class CompactingModel:
    """A scripted model: a ``seq`` Bash call per turn (``STEP`` numbers each) until four tool results are in the prompt,
    a summary when asked for one (Claude Code's compaction prompt asks for an <analysis> and a <summary> block), then
    "Done."; each completion ends with <|im_end|> and streams token by token, as a serving loop's does."""

    def __init__(self) -> None:
        self._first = 0  # the longest prompt without a tool result: the main agent's first call
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4)

    @property
    def max_context(self) -> int:
        """Read by the proxy on every call: unbounded until the first call is seen, then that call plus ``ROOM``."""
        return self._first + ROOM if self._first else 1 << 20

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        if "<tool_response>" not in BYTES.decode(request.prompt_ids):
            self._first = max(self._first, len(request.prompt_ids))
        return self._pool.submit(self._generate, request)

    def cancel(self, request_id: str) -> None:
        pass

    def _generate(self, request: GenerationRequest) -> GenerationResult:
        prompt = BYTES.decode(request.prompt_ids)
        last_user = prompt.rsplit("<|im_start|>user", 1)[-1]
        done = prompt.count("<tool_response>")
        if "a <summary> block" in last_user:
            text = f"<analysis>The user asked to count.</analysis>\n<summary>{SUMMARY}</summary>"
        elif SUMMARY in prompt or done >= 4:
            text = "Done."
        else:
            command = f"seq {STEP * done + 1} {STEP * (done + 1)}"
            text = f'<tool_call>\n{{"name": "Bash", "arguments": {{"command": "{command}", "description": "count"}}}}\n</tool_call>'
        ids = BYTES.encode(text)[: request.sampling.max_tokens - 1] + [BYTES.token_id("<|im_end|>")]
        for i, token in enumerate(ids):
            if request.on_tokens is not None:
                request.on_tokens(TokenChunk(request.request_id, i, (token,), (-0.5,), (0,)))
        return GenerationResult(
            request.request_id, ids, [-0.5] * len(ids), [0] * len(ids), "stop", len(request.prompt_ids)
        )

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def test_claude_code_compacts_after_an_overflow_and_the_records_label_the_summary_branches(claude_bin, tmp_path):
    model = CompactingModel()
    store = RecordStore(tmp_path / "records")
    exec_dir = tmp_path / "e0"
    (exec_dir / "workspace").mkdir(parents=True)
    spec = harness_spec("claude-code")  # the preset's own command: Claude Code's full default request
    values = {"{task.instruction}": "Count to 5600 with seq in steps of 1400, then say Done.", "{model}": "gyre-tiny",
              "{max_turns}": "8", "{exec_dir}": str(exec_dir)}  # fmt: skip
    argv, env, files = fill_spec(spec, values)
    write_files(files, exec_dir)
    (exec_dir / "home").mkdir()
    proxy = ProxyServer(model, BYTES, store, model_name="gyre-tiny", max_request_bytes=16 << 20,
                        tools_format="compact", max_tokens_cap=300)  # fmt: skip
    try:
        with proxy:
            key = proxy.open_execution("e0")
            done = subprocess.run([str(claude_bin), *argv[1:]], cwd=exec_dir / "workspace", capture_output=True,
                                  env=templates.harness_env(key, proxy.base_url, env), text=True, timeout=300,
                                  stdin=subprocess.DEVNULL)  # fmt: skip
            proxy.close_execution("e0")
            refused = proxy.execution_refusals("e0")
    finally:
        model.shutdown()
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-2000:])
    # Claude Code compacted because of the overflow (its own status events), and finished from the summary
    statuses = [e.get("compact_result") for e in events if e.get("subtype") == "status" and "compact_result" in e]
    assert statuses and set(statuses) == {"success"}, (
        statuses,
        refused,
        [e.get("type") for e in events],
        events[-1] if events else None,
        done.stderr[-1500:],
    )
    assert any(e.get("subtype") == "compact_boundary" for e in events)
    assert events[-1]["type"] == "result" and events[-1]["result"] == "Done."
    assert refused["context"] >= 1 and refused["admission"] == refused["bad_request"] == 0, refused
    # the records: every call served, in the order made
    records = store.read("e0")
    prompts = [BYTES.decode(r.prompt_ids) for r in records]
    summaries = [i for i, p in enumerate(prompts) if "a <summary> block" in p.rsplit("<|im_start|>user", 1)[-1]]
    continued = [i for i, p in enumerate(prompts) if CONTINUED in p]
    assert summaries and continued and min(summaries) < min(continued), (summaries, continued)
    assert continued[-1] == len(records) - 1 and summaries[-1] < len(records) - 1  # the last call goes on from it
    assert all(len(r.prompt_ids) < model.max_context for r in records)
    assert sum(p.count("<tool_response>") == 3 for p in prompts[: min(summaries)]) == 1  # the last call that fit
    # the trainer's reader: the main branch, then the main agent's summary branches (the summary-writing calls and
    # the continuation), every one of them trainable
    config = TrajectoryConfig(vocab_size=BYTES.vocab_size)
    entry = QueuedExecution(index=0, execution_id="e0", step=0, advantage=1.0, weight=1.0, last_in_step=True)
    loaded = LoadExecution(store.root, config).map(entry)
    assert loaded.excluded is None, loaded.excluded
    labels = [b.label for b in loaded.branches]
    assert labels[0] == "main" and labels[1:] == ["main-summary"] * (len(labels) - 1) and len(labels) >= 3, labels
    assert {b.agent for b in loaded.branches} == {0} and all(b.num_trainable > 0 for b in loaded.branches)
    last = BYTES.decode(loaded.branches[-1].tokens)
    assert SUMMARY in last and CONTINUED in last and last.rstrip().endswith("Done.<|im_end|>")
    assert os.path.getsize(store.path("e0")) > 0
