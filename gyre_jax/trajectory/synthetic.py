"""Synthetic TITO records shaped like long-horizon agent runs, for benchmarks and tests.

One execution is a main agent working through ``num_calls`` model calls: each call's completion
(policy tokens) is followed by a tool output; the prompt of the next call extends the previous one,
so the main thread is one long branch. On top of that, as in real coding-agent runs:

- context compaction: when the context passes ``context_limit`` tokens the agent asks for a summary
  (a call that continues the branch) and restarts from ``system prompt + summary``: a new branch
  that shares only the system prompt (``main-summary``);
- sub-agents: every ``subagent_every`` calls the main agent starts a sub-agent with its own system
  prompt that makes ``subagent_calls`` calls; its result comes back as the tool output
  (``subagent``). With ``thread_metadata`` the sub-agent's calls carry their own thread id (like
  ``X-Gyre-Thread-Id``); without it they share the main thread (like Claude Code's session id) and
  labels come from structure;
- retries: with probability ``retry_prob`` a call is sent again with the same prompt and the agent
  goes on from the second answer: the first answer is a short dead-end branch sharing the whole
  prompt (the most shared prefix a fork can have).

Token ids: ``MESSAGE_END`` closes every message (the role of ``<|im_end|>``); content tokens are
drawn from ``[16, vocab_size)``. Everything is a function of ``(shape, seed)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from gyre_jax.proxy.records import RecordStore, TitoRecord

MESSAGE_END = 2
ASSISTANT_HEADER = (1, 3, 4)  # "<|im_start|>assistant\n"
_FIRST_CONTENT_ID = 16


@dataclass(frozen=True)
class TraceShape:
    """The shape of one synthetic execution (lengths in tokens; ranges are inclusive ``(low, high)``)."""

    num_calls: int = 80
    system_len: int = 600
    task_len: int = 150
    completion_len: tuple[int, int] = (30, 250)
    tool_output_len: tuple[int, int] = (40, 600)
    context_limit: int = 6000
    summary_len: int = 400
    subagent_every: int = 20
    subagent_calls: int = 8
    subagent_system_len: int = 400
    retry_prob: float = 0.05
    thread_metadata: bool = True
    vocab_size: int = 272

    def with_(self, **changes) -> TraceShape:
        return replace(self, **changes)


class _Gen:
    def __init__(self, execution_id: str, shape: TraceShape, seed: int):
        self.eid, self.shape = execution_id, shape
        self.rng = np.random.default_rng(seed)
        self.records: list[TitoRecord] = []
        self.version = 0

    def content(self, n: int) -> list[int]:
        return self.rng.integers(_FIRST_CONTENT_ID, self.shape.vocab_size, int(n)).tolist()

    def message(self, n: int) -> list[int]:
        return self.content(n) + [MESSAGE_END]

    def between(self, lo_hi: tuple[int, int]) -> int:
        return int(self.rng.integers(lo_hi[0], lo_hi[1] + 1))

    def call(self, thread: str, prompt: list[int], completion_len: int) -> list[int]:
        completion = self.message(completion_len)
        n = len(completion)
        self.records.append(
            TitoRecord(
                execution_id=self.eid,
                call_index=len(self.records),
                thread_id=thread,
                request_id=f"r{len(self.records)}",
                prompt_ids=list(prompt),
                completion_ids=completion,
                completion_logprobs=np.round(-self.rng.exponential(1.0, n), 4).tolist(),
                policy_versions=[self.version] * n,
                finish_reason="stop",
                temperature=1.0,
                reused_prefix_len=0,
                t_start=0.0,
                t_end=0.0,
                model="synthetic",
            )
        )
        return completion

    def turn(self, thread: str, context: list[int]) -> list[int]:
        """One call with a possible retry: returns the context extended by the kept completion."""
        prompt = context + list(ASSISTANT_HEADER)
        completion = self.call(thread, prompt, self.between(self.shape.completion_len))
        if self.rng.random() < self.shape.retry_prob:
            completion = self.call(thread, prompt, self.between(self.shape.completion_len))
        return prompt + completion

    def subagent(self, k: int, main_thread: str) -> list[int]:
        s = self.shape
        thread = f"sub-{k}" if s.thread_metadata else main_thread
        context = self.message(s.subagent_system_len) + self.message(s.task_len)
        for _ in range(s.subagent_calls):
            context = self.turn(thread, context)
            context = context + self.message(self.between(s.tool_output_len))
        return self.content(self.between(s.completion_len))  # the sub-agent's result, as the main agent's tool output

    def run(self) -> list[TitoRecord]:
        s = self.shape
        main = "main"
        system = self.message(s.system_len)
        context = system + self.message(s.task_len)
        subagents = 0
        for i in range(s.num_calls):
            context = self.turn(main, context)
            if s.subagent_every > 0 and (i + 1) % s.subagent_every == 0:
                context = context + self.subagent(subagents, main) + [MESSAGE_END]
                subagents += 1
            else:
                context = context + self.message(self.between(s.tool_output_len))
            if len(context) > s.context_limit:
                summary = self.call(main, context + self.message(20) + list(ASSISTANT_HEADER), s.summary_len)
                context = system + summary
            if i % 10 == 9:
                self.version += 1
        return self.records


def generate_execution(execution_id: str, shape: TraceShape = TraceShape(), seed: int = 0) -> list[TitoRecord]:
    """The records of one synthetic execution, in call order."""
    return _Gen(execution_id, shape, seed).run()


def write_executions(
    store: RecordStore, execution_ids: list[str], shape: TraceShape = TraceShape(), seed: int = 0
) -> int:
    """Writes synthetic executions to ``store`` (one record file each); returns the number of records."""
    total = 0
    for i, eid in enumerate(execution_ids):
        path = store.path(eid)
        records = generate_execution(eid, shape, seed * 1_000_003 + i)
        with open(path, "w", encoding="utf-8") as f:  # one write per file: much faster than fsync per record
            f.write("".join(r.to_json() + "\n" for r in records))
        total += len(records)
    return total
