"""How small Claude Code's requests get with command-line flags: runs the real CLI (the ``claude-code`` preset of
gyre_jax/rollout/harnesses.py, plus each variant's extra flags) against the real proxy over a scripted backend
with the byte tokenizer (1 token per byte), on the reversal task, and prints per variant: the first request's
rendered prompt in tokens, the request body in bytes, the number of tools offered, the calls made, and whether
the agent did the task (answer.txt holds the reversal after its scripted Bash tool call).

Run: ``PYTHONPATH=$PWD python scripts/measure_claude_request.py [--claude PATH]`` (default: ``claude`` on PATH,
else tests/integration/npm/node_modules/.bin/claude). Offline; a few seconds per variant.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.rollout import templates
from gyre_jax.rollout.harnesses import CLAUDE_CODE_SMALL_CMD, fill_spec, harness_spec, write_files
from gyre_jax.serving.types import GenerationRequest, GenerationResult, TokenChunk

BYTES = ByteTokenizer()
REPO = Path(__file__).resolve().parents[1]
INSTRUCTION = "Write input.txt reversed to answer.txt."
# The scripted model: the first turn calls Bash to do the task, every later turn answers "Done.".
TOOL_TURN = '<tool_call>\n{"name": "Bash", "arguments": {"command": "rev input.txt > answer.txt", "description": "reverse"}}\n</tool_call>'
SHORT_SYSTEM = "You are a coding agent. Use the tools to do the task in the current directory, then say Done."
VARIANTS = {
    "preset (default flags)": [],
    "--tools Bash,Read,Write,Edit": ["--tools", "Bash,Read,Write,Edit"],
    "--tools Bash": ["--tools", "Bash"],
    "--system-prompt SHORT --tools Bash": ["--system-prompt", SHORT_SYSTEM, "--tools", "Bash"],
    "--bare --system-prompt SHORT --tools Bash": ["--bare", "--system-prompt", SHORT_SYSTEM, "--tools", "Bash"],
    "--bare --system-prompt SHORT --tools Bash,Read,Write,Edit --disable-slash-commands --strict-mcp-config --setting-sources ''": [
        "--bare", "--system-prompt", SHORT_SYSTEM, "--tools", "Bash,Read,Write,Edit", "--disable-slash-commands",
        "--strict-mcp-config", "--setting-sources", ""],
    "harness_cmd = CLAUDE_CODE_SMALL_CMD": None,
}  # fmt: skip


class ScriptedBackend:
    """Completes each prompt with ``TOOL_TURN`` (no tool result in the prompt yet) or ``Done.``, then <|im_end|>."""

    def __init__(self) -> None:
        self.max_context = 1 << 20  # tokens: any prompt fits
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4)
        self._lock = threading.Lock()

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        return self._pool.submit(self._generate, request)

    def cancel(self, request_id: str) -> None:
        pass

    def _generate(self, request: GenerationRequest) -> GenerationResult:
        prompt = BYTES.decode(request.prompt_ids)
        last_turn = prompt.rsplit("<|im_start|>user", 1)[-1]
        text = "Done." if "<tool_response>" in last_turn or "tool_result" in last_turn else TOOL_TURN
        ids = BYTES.encode(text)[: request.sampling.max_tokens - 1] + [BYTES.token_id("<|im_end|>")]
        for i, token in enumerate(ids):
            if request.on_tokens is not None:
                request.on_tokens(TokenChunk(request.request_id, i, (token,), (-0.5,), (0,)))
        return GenerationResult(
            request.request_id, ids, [-0.5] * len(ids), [0] * len(ids), "stop", len(request.prompt_ids)
        )

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def run_variant(
    proxy: ProxyServer, store: RecordStore, claude: str, root: Path, name: str, extra: list[str] | None
) -> dict:
    """One Claude Code run of the preset + ``extra`` flags (None: the preset with ``CLAUDE_CODE_SMALL_CMD``); the
    measurements of its first request."""
    execution_id = f"v{len(list(root.iterdir()))}"
    exec_dir = root / execution_id
    (exec_dir / "workspace").mkdir(parents=True)
    (exec_dir / "workspace" / "input.txt").write_text("12345\n")
    spec = harness_spec("claude-code", cmd=CLAUDE_CODE_SMALL_CMD if extra is None else "")
    values = {
        "{task.instruction}": INSTRUCTION,
        "{model}": "gyre-tiny",
        "{max_turns}": "4",
        "{exec_dir}": str(exec_dir),
    }
    argv, env, files = fill_spec(spec, values)
    write_files(files, exec_dir)
    key = proxy.open_execution(execution_id)
    full_env = templates.harness_env(key, proxy.base_url, env)
    bodies_before = len(proxy_bodies)
    done = subprocess.run([claude, *argv[1:], *(extra or [])], cwd=exec_dir / "workspace", env=full_env, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
    proxy.close_execution(execution_id)
    records = store.read(execution_id)
    answer = exec_dir / "workspace" / "answer.txt"
    first = records[0] if records else None
    body = proxy_bodies[bodies_before] if len(proxy_bodies) > bodies_before else {}
    return {
        "variant": name,
        "exit": done.returncode,
        "calls": len(records),
        "first_prompt_tokens": len(first.prompt_ids) if first else None,
        "first_body_bytes": body.get("bytes"),
        "tools": body.get("tools"),
        "system_chars": body.get("system_chars"),
        "did_task": answer.exists() and answer.read_text().strip() == "54321",
        "stderr": done.stderr.strip()[-300:] if done.returncode else "",
    }


proxy_bodies: list[dict] = []  # per request seen by the proxy: size of the body, tools, system text


def spy_requests(proxy: ProxyServer) -> None:
    """Wraps the proxy's ASGI app to note each /v1/messages body's size, tool count and system length."""
    app = proxy.app

    async def spy(scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith("/messages"):
            return await app(scope, receive, send)
        chunks = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        data = json.loads(raw)
        system = data.get("system") or ""
        system_text = system if isinstance(system, str) else "".join(b.get("text", "") for b in system)
        tools = [t.get("name") for t in data.get("tools") or []]
        proxy_bodies.append({"bytes": len(raw), "tools": tools, "system_chars": len(system_text)})
        sent = False

        async def replay():
            nonlocal sent
            if sent:  # the body is read: from now on the real channel (a streamed reply listens for a disconnect)
                return await receive()
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}

        return await app(scope, replay, send)

    proxy.app = spy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    local = REPO / "tests" / "integration" / "npm" / "node_modules" / ".bin" / "claude"
    parser.add_argument("--claude", default=shutil.which("claude") or str(local))
    parser.add_argument("--tools-format", default="qwen3", help="the proxy's tools_format: qwen3 (default) or compact")
    args = parser.parse_args()
    version = subprocess.run([args.claude, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    print(
        f"claude {version}; tools_format {args.tools_format}; byte tokenizer (1 token per byte of the rendered prompt)"
    )
    backend = ScriptedBackend()
    with tempfile.TemporaryDirectory() as tmp:
        store = RecordStore(Path(tmp) / "records")
        root = Path(tmp) / "executions"
        root.mkdir()
        proxy = ProxyServer(backend, BYTES, store, model_name="gyre-tiny", max_request_bytes=16 << 20,
                            tools_format=args.tools_format, max_tokens_cap=200)  # fmt: skip
        spy_requests(proxy)
        with proxy:
            for name, extra in VARIANTS.items():
                print(json.dumps(run_variant(proxy, store, args.claude, root, name, extra)), flush=True)
    backend.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
