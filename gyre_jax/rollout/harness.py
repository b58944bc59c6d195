"""The reference agent harness: a black-box subprocess that solves a task through an OpenAI-compatible API.

Run: ``python -m gyre_jax.rollout.harness --task TASK_JSON --model NAME [--temperature T]
[--max-tokens N] [--seed S]``, with the workspace as the current directory. It reads only
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` from the environment, as the ``openai`` SDK does, and
imports nothing from gyre_jax: it re-parses the task JSON itself (schema in tasks.py), so it behaves
like any third-party harness would. It speaks HTTP with the standard library (``ChatClient``) rather
than through the ``openai`` SDK, whose import alone costs ~1.3 s of CPU per process: one harness
process runs per execution, so that was most of a tiny run's rollout time on a small machine (the SDKs
themselves are tested against the proxy in tests/integration). Tools: ``read_file(path)`` and ``write_file(path, content)``,
confined to the workspace; files are written as the conversation goes, so a killed harness leaves
its partial work behind. Exit status: 0 when the conversation ended (no tool call, or max_turns
reached), 1 on an API error, 2 on a bad task file or configuration; the reason goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath
from typing import Any

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


# The openai SDK's exception class per HTTP status, so a failure reads the same as through the SDK.
STATUS_ERRORS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
}


class APIError(Exception):
    """A failed model call; ``kind`` is the openai SDK's name for the failure (e.g. ``RateLimitError``)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class ChatClient:
    """``POST {base_url}/chat/completions`` with a bearer key: the one call the harness makes, no retries
    (the proxy, not the client, decides about retries). Configured from the environment like the SDK:
    ``OPENAI_BASE_URL`` (default ``https://api.openai.com/v1``) and ``OPENAI_API_KEY`` (required)."""

    def __init__(self, timeout_s: float, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        self.api_key = env.get("OPENAI_API_KEY", "")
        if not self.api_key:
            raise ValueError("OPENAI_API_KEY is not set; set it to the key the API expects (any string for the proxy)")
        self.base_url = (env.get("OPENAI_BASE_URL") or "https://api.openai.com/v1").rstrip("/")
        self.timeout_s = timeout_s

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat completion for ``body`` as a dict; ``APIError`` on any failure."""
        request = urllib.request.Request(
            f"{self.base_url}/chat/completions",
            data=json.dumps(body).encode("utf-8"),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            kind = "InternalServerError" if exc.code >= 500 else STATUS_ERRORS.get(exc.code, "APIStatusError")
            raise APIError(kind, f"Error code: {exc.code} - {exc.read().decode('utf-8', 'replace')[:2000]}") from None
        except TimeoutError as exc:
            raise APIError("APITimeoutError", f"Request timed out after {self.timeout_s:g}s: {exc}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise APIError("APIConnectionError", f"Connection error: {getattr(exc, 'reason', exc)}") from None
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise APIError("APIResponseValidationError", f"the response is not JSON ({exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("choices", []), list):
            raise APIError("APIResponseValidationError", f"the response is not a chat completion: {raw[:500]!r}")
        return data


def assistant_message_dict(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as returned (content, tool calls and any extra fields) without null fields,
    as the conversation's next assistant turn."""
    out = {k: v for k, v in message.items() if v is not None}
    out["role"] = "assistant"
    out["content"] = message.get("content")
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
        client = ChatClient(args.request_timeout)
    except ValueError as exc:  # OPENAI_API_KEY not set
        print(f"harness: cannot create the OpenAI client: {exc}", file=sys.stderr)
        return 2
    workspace = Path.cwd()
    rng = random.Random(args.seed)
    messages: list[dict[str, Any]] = []
    if task["system"]:
        messages.append({"role": "system", "content": task["system"]})
    messages.append({"role": "user", "content": task["instruction"]})
    request = {"model": args.model, "temperature": args.temperature, "max_tokens": args.max_tokens}
    if task["tools"]:
        request["tools"] = task["tools"]

    turns, stop = 0, "max_turns"
    for turns in range(1, task["max_turns"] + 1):
        try:
            response = client.create({**request, "messages": messages})
        except APIError as exc:
            print(f"harness: model call {turns} failed: {exc.kind}: {exc}", file=sys.stderr)
            return 1
        choices = response.get("choices") or []
        if not choices or not isinstance(choices[0].get("message"), dict):
            print(f"harness: model call {turns} returned no choices", file=sys.stderr)
            return 1
        message = choices[0]["message"]
        messages.append(assistant_message_dict(message))
        calls = message.get("tool_calls") or []
        if not calls:
            stop = "no_tool_call"
            break
        for call in calls:
            time.sleep(tool_latency(rng, task["tool_latency_median_s"], task["tool_latency_sigma"]))
            call = call if isinstance(call, dict) else {}
            fn = call.get("function")
            if not isinstance(fn, dict):
                kind = call.get("type")
                result = f"error: unsupported tool call type {kind!r}; only function calls are supported"
            else:
                result = run_tool(workspace, fn.get("name"), fn.get("arguments"))
            messages.append({"role": "tool", "tool_call_id": call.get("id"), "content": result})
    print(json.dumps({"turns": turns, "stop": stop}))
    return 0


def harness_arg_parser(description: str, max_tokens: int) -> argparse.ArgumentParser:
    """The command line every built-in harness takes (the executor's ``harness_cmd`` passes these flags)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--task", required=True, help="path of the task JSON (outside the workspace)")
    parser.add_argument("--model", required=True, help="model name sent with every request")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="max_tokens of each model call")
    parser.add_argument("--seed", type=int, default=0, help="seed of the simulated tool latencies")
    parser.add_argument("--request-timeout", type=float, default=3600.0, help="seconds one model call may take")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return harness_arg_parser(__doc__.split("\n\n")[0], max_tokens=256).parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
