"""The reference agent harness: a black-box subprocess that solves a task through an OpenAI-compatible API.

Run: ``python -m gyre_jax.rollout.harness --task TASK_JSON --model NAME [--temperature T]
[--max-tokens N] [--seed S]``, with the workspace as the current directory. It reads only
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` from the environment (through the ``openai`` SDK) and
imports nothing from gyre_jax: it re-parses the task JSON itself (schema in tasks.py), so it behaves
like any third-party harness would. Tools: ``read_file(path)`` and ``write_file(path, content)``,
confined to the workspace; files are written as the conversation goes, so a killed harness leaves
its partial work behind. Exit status: 0 when the conversation ended (no tool call, or max_turns
reached), 1 on an API error, 2 on a bad task file or configuration; the reason goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path, PurePosixPath
from typing import Any

import openai

TOOL_NAMES = ("read_file", "write_file")


class TaskFileError(ValueError):
    """The task JSON is unreadable or lacks what the harness needs."""


def load_task(path: str) -> dict[str, Any]:
    """The parts of the task JSON the harness uses, checked (see tasks.py for the full schema)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TaskFileError(f"cannot read task file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise TaskFileError(f"task file {path} must hold a JSON object, got {type(data).__name__}")
    checks = {
        "system": lambda v: isinstance(v, str),
        "instruction": lambda v: isinstance(v, str),
        "tools": lambda v: isinstance(v, list),
        "max_turns": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
        "tool_latency_median_s": lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v >= 0,
        "tool_latency_sigma": lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v >= 0,
    }
    for key, ok in checks.items():
        if key not in data or not ok(data[key]):
            raise TaskFileError(f"task file {path}: field {key!r} is missing or invalid (got {data.get(key)!r})")
    return data


def resolve_in_workspace(workspace: Path, path: Any) -> Path:
    """``workspace / path`` for a relative path that stays inside the workspace; ValueError otherwise."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"'path' must be a non-empty string, got {path!r}")
    pure = PurePosixPath(path)
    if pure.is_absolute() or Path(path).is_absolute():
        raise ValueError(f"path {path!r} is absolute; use a path relative to the workspace, e.g. 'answer.txt'")
    if ".." in pure.parts:
        raise ValueError(f"path {path!r} contains '..'; only paths inside the workspace are allowed")
    root = workspace.resolve()
    target = (root / path).resolve()
    if target != root and root not in target.parents:
        raise ValueError(f"path {path!r} leaves the workspace (through a link)")
    return target


def run_tool(workspace: Path, name: str, arguments: str) -> str:
    """Executes one tool call and returns its result text; every failure is an ``error: ...`` string."""
    if name not in TOOL_NAMES:
        return f"error: unknown tool {name!r}; available tools: {', '.join(TOOL_NAMES)}"
    try:
        args = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError as exc:
        return f"error: arguments of {name} are not valid JSON ({exc})"
    if not isinstance(args, dict):
        return f"error: arguments of {name} must be a JSON object"
    try:
        if name == "read_file":
            target = resolve_in_workspace(workspace, args.get("path"))
            if not target.is_file():
                return f"error: no such file: {args['path']}"
            return target.read_bytes().decode("utf-8", errors="replace")
        content = args.get("content")
        if not isinstance(content, str):
            return f"error: write_file needs a string 'content', got {content!r}"
        target = resolve_in_workspace(workspace, args.get("path"))
        if target == workspace.resolve() or target.is_dir():
            return f"error: {args['path']} is a directory"
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "w", encoding="utf-8") as f:
            f.write(content)
        return "ok"
    except ValueError as exc:
        return f"error: {exc}"
    except OSError as exc:
        return f"error: {name} failed: {exc.strerror or exc}"


def assistant_message_dict(message: Any) -> dict[str, Any]:
    """The assistant message as returned (content, tool calls and any extra fields), as a plain dict."""
    out = message.model_dump(exclude_none=True)
    out["role"] = "assistant"
    out["content"] = message.content
    return out


def tool_latency(rng: random.Random, median_s: float, sigma: float) -> float:
    """Seconds one tool call takes: lognormal(log(median), sigma); 0 when the median is 0."""
    if median_s <= 0:
        return 0.0
    return rng.lognormvariate(math.log(median_s), sigma)


def run(args: argparse.Namespace) -> int:
    try:
        task = load_task(args.task)
    except TaskFileError as exc:
        print(f"harness: {exc}", file=sys.stderr)
        return 2
    try:
        client = openai.OpenAI(max_retries=0, timeout=args.request_timeout)
    except openai.OpenAIError as exc:  # e.g. OPENAI_API_KEY not set
        print(f"harness: cannot create the OpenAI client: {exc}", file=sys.stderr)
        return 2
    workspace = Path.cwd()
    rng = random.Random(args.seed)
    messages: list[dict[str, Any]] = []
    if task["system"]:
        messages.append({"role": "system", "content": task["system"]})
    messages.append({"role": "user", "content": task["instruction"]})
    tools = task["tools"] or openai.NOT_GIVEN

    turns, stop = 0, "max_turns"
    for turns in range(1, task["max_turns"] + 1):
        try:
            response = client.chat.completions.create(
                model=args.model,
                messages=messages,
                tools=tools,
                temperature=args.temperature,
                max_tokens=args.max_tokens,
            )
        except openai.APIError as exc:
            print(f"harness: model call {turns} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        if not response.choices:
            print(f"harness: model call {turns} returned no choices", file=sys.stderr)
            return 1
        message = response.choices[0].message
        messages.append(assistant_message_dict(message))
        calls = message.tool_calls or []
        if not calls:
            stop = "no_tool_call"
            break
        for call in calls:
            time.sleep(tool_latency(rng, task["tool_latency_median_s"], task["tool_latency_sigma"]))
            fn = getattr(call, "function", None)
            if fn is None:
                result = f"error: unsupported tool call type {getattr(call, 'type', None)!r}; only function calls are supported"
            else:
                result = run_tool(workspace, fn.name, fn.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(json.dumps({"turns": turns, "stop": stop}))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", required=True, help="path of the task JSON (outside the workspace)")
    parser.add_argument("--model", required=True, help="model name sent with every request")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=256, help="max_tokens of each model call")
    parser.add_argument("--seed", type=int, default=0, help="seed of the simulated tool latencies")
    parser.add_argument("--request-timeout", type=float, default=3600.0, help="seconds one model call may take")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
