"""The long-horizon harness: a black-box subprocess that works through a ``longlog`` task in 100+ model calls.

Run: ``python -m gyre_jax.rollout.long_harness --task TASK_JSON --model NAME [--temperature T]
[--max-tokens N] [--seed S]`` with the workspace as the current directory; like the reference harness
(harness.py, whose helpers it imports) it reads only ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` and speaks the
OpenAI chat API over HTTP (harness.py's ``ChatClient``). The sizes come from the task's ``metadata.long_horizon``
(``tasks.LongTaskParams``).

What it does, as agent harnesses do over long tasks (docs/tasks.md, "longlog"):

- **Reads in pieces.** The main agent reads every log file in pieces of ``read_chars``: each piece is one
  model call whose prompt ends with that piece (an observation, sent as a user turn). Tool calls the model
  makes itself (``read_file``, ``write_file``) are executed and answered first.
- **Compacts.** Before a conversation's context (the last call's prompt + completion tokens, from ``usage``)
  would pass ``compact_tokens``, it asks the agent for a summary, then starts a new conversation: the same
  system prompt, the task and the summary quoted in the first user turn (the proxy labels it the same agent's
  summary continuation: ``main-summary``). A summary without a line of 20+ characters (nothing the proxy
  could recognize as quoted) is asked for again, at most ``SUMMARY_TRIES`` times.
- **Spawns sub-agents.** Every ``subagent_every``-th file is read by a sub-agent: a separate conversation
  with its own system prompt and the tools, which reads the file in pieces and reports; the main agent then
  gets the report as a user turn.
- **Answers.** Last, the main agent is asked for the number; unless the model wrote answer.txt with a tool
  call, the harness writes the answer's first line there.

The call budget is the task's ``max_turns``: at the budget the harness stops and writes what it has. Exit
status: 0 when it finished (or ran out of budget), 1 on an API error, 2 on a bad task file or configuration.
The last line of stdout is a JSON summary (calls, summaries, sub-agents, the largest context).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre_jax.rollout.harness import (
    APIError,
    ChatClient,
    TaskFileError,
    assistant_message_dict,
    harness_arg_parser,
    load_task,
    resolve_in_workspace,
    run_tool,
    tool_latency,
)

SUMMARY_TRIES = 5
MIN_LINE_CHARS = 20  # the proxy's MIN_QUOTE_CHARS: a summary needs a line this long to be recognized as quoted
TEMPLATE_TOKENS = 64  # room for the chat template's tokens around one more turn (the compaction check)
_TAG = re.compile(r"</?[A-Za-z][\w-]*>")
SUMMARY_REQUEST = "Your context is nearly full. Summarize your progress and your tally so far, in full sentences."
SUMMARY_AGAIN = "That summary is too short. Write it again as full sentences on one line."
FINAL_REQUEST = "Every file is read. Reply with the number of ERROR lines only."
REPORT_REQUEST = "The file is read. Report its number of ERROR lines in one sentence."
LONG_PARAMS = ("files", "file_chars", "read_chars", "system_chars", "compact_tokens", "subagent_every")


class BudgetExhausted(Exception):
    """The task's call budget (``max_turns``) is used up."""


class NoChoices(Exception):
    """A model call answered without a choice."""


@dataclass
class Run:
    """What the whole execution shares: the client, the task, the call budget and counters."""

    client: Any
    model: str
    temperature: float
    max_tokens: int
    task: dict[str, Any]
    params: dict[str, int]
    workspace: Path
    rng: random.Random
    calls: int = 0
    summaries: int = 0
    subagents: int = 0
    max_context: int = 0
    answer_written: bool = False
    log: list[str] = field(default_factory=list)


class Conversation:
    """One conversation (an agent's context): its messages, and its size after the last call, in tokens."""

    def __init__(self, run: Run, system: str, first_user: str) -> None:
        self.run = run
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": first_user},
        ]
        self.context_tokens = 0

    def call(self) -> dict[str, Any]:
        """One model call on the messages; appends the answer (and the results of its tool calls); returns it."""
        run = self.run
        if run.calls >= run.task["max_turns"]:
            raise BudgetExhausted
        run.calls += 1
        body = {"model": run.model, "messages": self.messages, "tools": run.task["tools"],
                "temperature": run.temperature, "max_tokens": run.max_tokens}  # fmt: skip
        response = run.client.create(body)
        choices = response.get("choices") or []
        if not choices or not isinstance(choices[0].get("message"), dict):
            raise NoChoices(f"model call {run.calls} returned no choices")
        message = choices[0]["message"]
        self.messages.append(assistant_message_dict(message))
        usage = response.get("usage") or {}
        tokens = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
        self.context_tokens = tokens or _chars(self.messages)
        run.max_context = max(run.max_context, self.context_tokens)
        for tool_call in message.get("tool_calls") or []:
            tool_call = tool_call if isinstance(tool_call, dict) else {}
            self.messages.append(
                {"role": "tool", "tool_call_id": tool_call.get("id"), "content": self._tool(tool_call)}
            )
        return message

    def _tool(self, tool_call: dict[str, Any]) -> str:
        fn = tool_call.get("function")
        if not isinstance(fn, dict):
            return f"error: unsupported tool call type {tool_call.get('type')!r}; only function calls are supported"
        time.sleep(
            tool_latency(self.run.rng, self.run.task["tool_latency_median_s"], self.run.task["tool_latency_sigma"])
        )
        name, arguments = fn.get("name"), fn.get("arguments") or ""
        if name == "read_file":
            return read_piece_tool(self.run.workspace, arguments, self.run.params["read_chars"])
        result = run_tool(self.run.workspace, name, arguments)
        if name == "write_file" and result == "ok" and '"answer.txt"' in arguments:
            self.run.answer_written = True
        return result

    def say(self, text: str) -> dict[str, Any]:
        """Appends a user turn (an observation or a request) and makes the call."""
        self.messages.append({"role": "user", "content": text})
        return self.call()

    def fits(self, more_chars: int) -> bool:
        """Whether one more turn of ``more_chars`` characters and an answer stay within ``compact_tokens``."""
        need = self.context_tokens + more_chars + self.run.max_tokens + TEMPLATE_TOKENS
        return need <= self.run.params["compact_tokens"]


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def _chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m.get("content") or "")) for m in messages)


def quotable(text: str) -> bool:
    """Whether ``text`` has a line of ``MIN_LINE_CHARS``+ characters once tags are removed (the proxy's rule)."""
    return any(len(line.strip()) >= MIN_LINE_CHARS for line in _TAG.sub("\n", text).splitlines())


def read_piece(workspace: Path, path: str, offset: int, limit: int) -> str:
    """``limit`` characters of ``path`` from ``offset`` (a tool's output)."""
    text = resolve_in_workspace(workspace, path).read_text(encoding="utf-8", errors="replace")
    return text[offset : offset + limit]


def read_piece_tool(workspace: Path, arguments: str, default_limit: int) -> str:
    """The ``read_file(path, offset=0, limit)`` tool the model may call; failures are ``error: ...`` strings."""
    try:
        args = json.loads(arguments or "{}")
        if not isinstance(args, dict):
            return "error: arguments of read_file must be a JSON object"
        offset, limit = int(args.get("offset", 0)), int(args.get("limit", default_limit))
        target = resolve_in_workspace(workspace, args.get("path"))
        if not target.is_file():
            return f"error: no such file: {args.get('path')}"
        return read_piece(workspace, str(args["path"]), max(0, offset), max(0, min(limit, default_limit)))
    except (ValueError, TypeError) as exc:
        return f"error: {exc}"


def observation(path: str, offset: int, piece: str) -> str:
    return f"read_file({path}, offset={offset}) ->\n{piece}"


def compact(conv: Conversation, system: str, task_text: str) -> Conversation:
    """Asks ``conv``'s agent for a summary (again while it has no quotable line) and returns the new
    conversation that starts from it."""
    message = conv.say(SUMMARY_REQUEST)
    for _ in range(SUMMARY_TRIES - 1):
        if quotable(_content(message)) and not message.get("tool_calls"):
            break
        message = conv.say(SUMMARY_AGAIN)
    conv.run.summaries += 1
    summary = _content(message)
    return Conversation(conv.run, system, f"{task_text}\n\nSummary of your work so far:\n{summary}")


def read_file_in(conv: Conversation, path: str, system: str, task_text: str) -> Conversation:
    """Reads ``path`` piece by piece in ``conv`` (compacting when needed); returns the conversation it ends in."""
    size, step = conv.run.params["file_chars"], conv.run.params["read_chars"]
    for offset in range(0, size, step):
        piece = read_piece(conv.run.workspace, path, offset, step)
        text = observation(path, offset, piece)
        if not conv.fits(len(text)):
            conv = compact(conv, system, task_text)
        conv.say(text)
    return conv


def subagent(run: Run, path: str) -> str:
    """A sub-agent reads ``path`` in its own conversation and reports; returns its report."""
    run.subagents += 1
    system = run.task["metadata"]["long_horizon"]["subagent_system"]
    task_text = f"Count the ERROR lines of {path}."
    conv = read_file_in(Conversation(run, system, task_text), path, system, task_text)
    if not conv.fits(len(REPORT_REQUEST)):
        conv = compact(conv, system, task_text)
    return _content(conv.say(REPORT_REQUEST))


def work(run: Run) -> str:
    """The main agent's whole task; returns its last answer's text."""
    system, task_text = run.task["system"], run.task["instruction"]
    conv = Conversation(run, system, task_text)
    conv.call()  # the agent's plan, before any read
    paths = sorted(p for p in run.task["files"])
    every = run.params["subagent_every"]
    for index, path in enumerate(paths, start=1):
        if every and index % every == 0:
            report = f"Sub-agent report for {path}:\n{subagent(run, path)}"
            if not conv.fits(len(report)):
                conv = compact(conv, system, task_text)
            conv.say(report)
        else:
            conv = read_file_in(conv, path, system, task_text)
    if not conv.fits(len(FINAL_REQUEST)):
        conv = compact(conv, system, task_text)
    return _content(conv.say(FINAL_REQUEST))


def long_params(task: dict[str, Any]) -> dict[str, int]:
    """The task's ``metadata.long_horizon`` sizes, checked (TaskFileError otherwise)."""
    meta = task.get("metadata", {}).get("long_horizon") if isinstance(task.get("metadata"), dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("subagent_system"), str):
        raise TaskFileError("the task has no metadata.long_horizon (is it a 'longlog' task? see tasks.LongTaskParams)")
    bad = [k for k in LONG_PARAMS if not isinstance(meta.get(k), int) or meta[k] < 0]
    if bad or meta["read_chars"] < 1:
        raise TaskFileError(f"metadata.long_horizon has missing or invalid sizes {bad or ['read_chars']}: {meta!r}")
    if not isinstance(task.get("files"), dict) or not task["files"]:
        raise TaskFileError("a longlog task lists its log files in 'files'")
    return {k: meta[k] for k in LONG_PARAMS}


def run(args: argparse.Namespace) -> int:
    try:
        task = load_task(args.task)
        params = long_params(task)
        client = ChatClient(args.request_timeout)
    except TaskFileError as exc:
        print(f"long_harness: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # OPENAI_API_KEY not set
        print(f"long_harness: cannot create the OpenAI client: {exc}", file=sys.stderr)
        return 2
    state = Run(
        client, args.model, args.temperature, args.max_tokens, task, params, Path.cwd(), random.Random(args.seed)
    )
    stop = "done"
    answer = ""
    try:
        answer = work(state)
    except BudgetExhausted:
        stop = "max_turns"
    except (APIError, NoChoices) as exc:
        kind = exc.kind if isinstance(exc, APIError) else type(exc).__name__
        print(f"long_harness: model call {state.calls} failed: {kind}: {exc}", file=sys.stderr)
        return 1
    if not state.answer_written:
        lines = answer.strip().splitlines()
        (Path.cwd() / "answer.txt").write_text(lines[0] if lines else "", encoding="utf-8")
    summary = {"calls": state.calls, "summaries": state.summaries, "subagents": state.subagents,
               "max_context_tokens": state.max_context, "stop": stop}  # fmt: skip
    print(json.dumps(summary))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return harness_arg_parser(__doc__.split("\n\n")[0], max_tokens=64).parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
