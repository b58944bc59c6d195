"""Records the corpus of real harness traffic under ``tests/fixtures/harness_traffic/<harness>/``.

Each scenario drives a real, unmodified CLI against the real ``ProxyServer`` whose backend is a
``ScriptedBackend``: the completion of every call is chosen by the scenario's script from what the
request carries (markers in its last or first user turn), so the CLI starts exactly the sub-agents, tool
calls and summaries the scenario names. For each model call the proxy received it stores, in call order,
one JSON line of ``<scenario>.jsonl.xz``:

    {"path": "/v1/messages", "query": "beta=true", "headers": {...}, "body": {...}, "completion": "..." | null}

``headers`` are all request headers except credentials and transport ones (``x-api-key``,
``authorization``, ``host``, ``content-length``, ``connection``, ``accept-encoding``); ``body`` is the JSON
body as sent; ``completion`` the scripted text the backend returned (null for calls that reach no model,
e.g. token counting). Lines are ordered as the backend was called, so a sequential replay
(``tests/proxy/test_harness_traffic.py``) sees every call after the calls it continues. The hand-written
truth of each scenario is ``<scenario>.truth.json`` (labels, agents, continuations); the recorder writes a
draft, ``<scenario>.truth.draft.json``, from what the script answered, to check the truth against.

Run (offline; needs the npm CLIs of ``tests/integration/npm`` installed (``npm install --no-save`` there) and
mini-swe-agent and smolagents in the venv):

    PYTHONPATH=$PWD python tests/integration/record_traffic.py [--only claude_code/subagents ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextvars
import itertools
import json
import lzma
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.serving.scripted import ScriptedBackend

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OUT = REPO / "tests" / "fixtures" / "harness_traffic"
NPM_BIN = HERE / "npm" / "node_modules" / ".bin"
MODEL = "gyre-tiny"
DROP_HEADERS = {"x-api-key", "authorization", "host", "content-length", "connection", "accept-encoding", "cookie"}
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


# -- reading a rendered prompt ------------------------------------------------------------------------------------


def turns(prompt: str) -> list[tuple[str, str]]:
    """The ``(role, text)`` turns of a rendered Qwen3 prompt (tool responses are user turns)."""
    out = []
    for part in prompt.split(IM_START)[1:]:
        role, _, text = part.partition("\n")
        out.append((role, text.split(IM_END)[0]))
    return out


def first_user(prompt: str) -> str:
    return next((t for r, t in turns(prompt) if r == "user"), "")


def last_user(prompt: str) -> str:
    return next((t for r, t in reversed(turns(prompt)) if r == "user"), "")


def system(prompt: str) -> str:
    return next((t for r, t in turns(prompt)[:1] if r == "system"), "")


def tool_call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# -- a script: rules over the prompt, each naming the agent it answers for ----------------------------------------


@dataclass
class Rule:
    """``when(prompt)`` -> this rule answers ``reply`` for ``agent`` with the ``label`` the truth gives it."""

    agent: str
    label: str
    when: Callable[[str], bool]
    reply: str


@dataclass
class Script:
    rules: list[Rule]
    answered: list[tuple[str, str]] = field(default_factory=list)  # (agent, label) of each call, in call order

    def __call__(self, prompt: str) -> str:
        opened = prompt.rsplit(IM_START + "assistant\n", 1)[-1]  # what a forced tool_choice opened the turn with
        for rule in self.rules:
            if rule.when(prompt):
                self.answered.append((rule.agent, rule.label))
                return rule.reply[len(opened) :] if opened and rule.reply.startswith(opened) else rule.reply
        raise RuntimeError(f"no rule of the script matches the call; its last user turn: {last_user(prompt)[-400:]!r}")


def in_last(marker: str) -> Callable[[str], bool]:
    return lambda p: marker in last_user(p)


def in_first(marker: str) -> Callable[[str], bool]:
    return lambda p: marker in first_user(p)


def in_system(marker: str) -> Callable[[str], bool]:
    return lambda p: marker in system(p)


# -- capture: what the proxy received, with the completion the backend returned ----------------------------------

_slot: contextvars.ContextVar[dict | None] = contextvars.ContextVar("record_traffic_slot", default=None)


class Capture:
    """ASGI middleware: keeps each HTTP request's path, headers and body; the backend fills in its completion."""

    def __init__(self, app, sink: list[dict], counter) -> None:
        self.app, self.sink, self.counter = app, sink, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []

        async def read():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        slot = {"seq": next(self.counter), "completion": None}
        _slot.set(slot)
        await self.app(scope, read, send)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        self.sink.append({
            "seq": slot["seq"],
            "path": scope["path"],
            "query": scope["query_string"].decode(),
            "headers": {k: v for k, v in sorted(headers.items()) if k not in DROP_HEADERS},
            "body": json.loads(b"".join(chunks) or b"null"),
            "completion": slot["completion"],
            "agent": slot.get("agent"),
            "label": slot.get("label"),
        })  # fmt: skip


class Recorder:
    """The real proxy over a scripted backend (byte tokenizer), capturing every call it receives."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.calls: list[dict] = []
        self.counter = itertools.count()
        self.script: Script | None = None
        self.lock = threading.Lock()
        tokenizer = ByteTokenizer()
        self.backend = ScriptedBackend(tokenizer, self._answer)
        self.proxy = ProxyServer(self.backend, tokenizer, RecordStore(workdir / "records"), model_name=MODEL,
                                 max_request_bytes=16 << 20)  # fmt: skip
        self.proxy.app.add_middleware(Capture, sink=self.calls, counter=self.counter)

    def _answer(self, prompt: str) -> str:
        with self.lock:
            assert self.script is not None
            text = self.script(prompt)
            agent, label = self.script.answered[-1]
            slot = _slot.get()
            if slot is not None:
                slot.update(seq=next(self.counter), completion=text, agent=agent, label=label)
        return text

    def scenario(self, name: str, script: Script) -> tuple[str, Path]:
        """Opens an execution for a scenario: its API key and a fresh directory for HOME and the workspace."""
        self.calls.clear()
        self.script = script
        root = self.workdir / name.replace("/", "_")
        (root / "home").mkdir(parents=True)
        (root / "ws").mkdir()
        return self.proxy.open_execution(name.replace("/", "_")), root

    def save(self, harness: str, scenario: str, out: Path) -> None:
        calls = sorted(self.calls, key=lambda c: c["seq"])
        if not any(c["completion"] is not None for c in calls):
            print(f"{harness}/{scenario}: NOT SAVED: no call reached the model (see the CLI's output above)")
            return
        folder = out / harness
        folder.mkdir(parents=True, exist_ok=True)
        with lzma.open(folder / f"{scenario}.jsonl.xz", "wt", encoding="utf-8", preset=9) as f:
            for call in calls:
                f.write(json.dumps({k: call[k] for k in ("path", "query", "headers", "body", "completion")}) + "\n")
        model_calls = [c for c in calls if c["completion"] is not None]
        draft = {
            "harness": harness,
            "scenario": scenario,
            "calls": [
                {"call": i, "label": c["label"], "agent": c["agent"], "continues": continues(model_calls, i)}
                for i, c in enumerate(model_calls)
            ],
        }
        (folder / f"{scenario}.truth.draft.json").write_text(json.dumps(draft, indent=1) + "\n")
        print(f"{harness}/{scenario}: {len(calls)} requests, {len(model_calls)} model calls", flush=True)


def wire_messages(body: dict) -> list:
    """A request's conversation as sent, with the wire's cache markers dropped and text content as blocks."""

    def blocks(content):
        if isinstance(content, str):
            return [{"type": "text", "text": content}]
        return [
            {k: v for k, v in b.items() if k != "cache_control"} if isinstance(b, dict) else b for b in content or []
        ]

    system = body.get("system") or body.get("instructions")
    head = [{"role": "system", "content": blocks(system)}] if system else []
    items = body.get("messages") or body.get("input") or []
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    return head + [{**m, "content": blocks(m.get("content"))} if "content" in m else m for m in items]


def continues(calls: list[dict], i: int) -> int | None:
    """The latest earlier call whose conversation call ``i`` re-sends first, verbatim, followed by an assistant
    turn (the one the earlier call was answered with), else None. Compared at the wire level (JSON as sent)."""
    mine = wire_messages(calls[i]["body"])
    for j in range(i - 1, -1, -1):
        theirs = wire_messages(calls[j]["body"])
        if len(mine) > len(theirs) and mine[: len(theirs)] == theirs and mine[len(theirs)].get("role") == "assistant":
            return j
    return None


# -- running CLIs --------------------------------------------------------------------------------------------------


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 240) -> None:
    env = {**os.environ, "PWD": str(cwd), **env}  # some CLIs take the working directory from $PWD
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    tail = (done.stdout[-1500:] + "\n" + done.stderr[-1500:]).strip()
    print(f"  $ {' '.join(cmd[:4])} ... -> {done.returncode}\n    {tail[-600:]}", flush=True)


def claude_env(recorder: Recorder, key: str, root: Path) -> dict[str, str]:
    return {"ANTHROPIC_BASE_URL": recorder.proxy.anthropic_base_url, "ANTHROPIC_API_KEY": key,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "IS_SANDBOX": "1", "HOME": str(root / "home"),
            "DISABLE_AUTOUPDATER": "1", "TERM": "dumb"}  # fmt: skip


def claude(*args: str) -> list[str]:
    return [str(NPM_BIN / "claude"), "-p", *args, "--model", MODEL, "--dangerously-skip-permissions",
            "--output-format", "stream-json", "--verbose"]  # fmt: skip


def agent(prompt: str, background: bool) -> str:
    return tool_call("Agent", description="scripted task", prompt=prompt, subagent_type="general-purpose",
                     run_in_background=background)  # fmt: skip


def claude_subagents(recorder: Recorder, out: Path) -> None:
    """Main starts a foreground sub-agent, then a nested one (which starts its own), then a background one."""
    script = Script([
        # results first: a result turn may quote the task that produced it
        Rule("inner", "subagent", in_last("TASK-INNER"), "INNER-RESULT: inner done."),
        Rule("nest", "subagent", in_last("INNER-RESULT"), "NEST-RESULT: nest done."),
        Rule("nest", "subagent", in_last("TASK-NEST"), agent("TASK-INNER: answer at once.", background=False)),
        Rule("fg", "subagent", in_last("TASK-FG"), "FG-RESULT: fg done."),
        Rule("bg", "subagent", in_last("TASK-BG"), "BG-RESULT: bg done."),
        Rule("main", "main", in_last("BG-RESULT"), "All sub-agents reported. Done."),
        Rule("main", "main", in_last("NEST-RESULT"), agent("TASK-BG: answer at once.", background=True)),
        Rule("main", "main", in_last("FG-RESULT"), agent("TASK-NEST: start one agent of your own.", background=False)),
        Rule("main", "main", in_last("SCENARIO-SUBAGENTS"), agent("TASK-FG: answer at once.", background=False)),
        Rule("main", "main", in_first("SCENARIO-SUBAGENTS"), "Waiting for the background agent."),
    ])  # fmt: skip
    key, root = recorder.scenario("claude_code/subagents", script)
    run(claude("SCENARIO-SUBAGENTS: use sub-agents as told."), root / "ws", claude_env(recorder, key, root))
    recorder.save("claude_code", "subagents", out)


def claude_parallel(recorder: Recorder, out: Path) -> None:
    """Main starts two background sub-agents in one turn; each runs a Bash command, then answers (interleaved
    conversations with one system prompt); main hears of each when it ends."""
    both = agent("TASK-P1: run the check.", background=True) + "\n" + agent("TASK-P2: run the check.", background=True)
    script = Script([
        Rule("main", "main", in_last("RESULT-P"), "Noted."),
        Rule("p1", "subagent", in_last("CHECK-P1"), "RESULT-P1: p1 done."),
        Rule("p2", "subagent", in_last("CHECK-P2"), "RESULT-P2: p2 done."),
        Rule("p1", "subagent", in_last("TASK-P1"), tool_call("Bash", command="echo CHECK-P1", description="check")),
        Rule("p2", "subagent", in_last("TASK-P2"), tool_call("Bash", command="echo CHECK-P2", description="check")),
        Rule("main", "main", in_last("SCENARIO-PARALLEL"), both),
        Rule("main", "main", in_first("SCENARIO-PARALLEL"), "Waiting for both agents."),
    ])  # fmt: skip
    key, root = recorder.scenario("claude_code/parallel", script)
    run(claude("SCENARIO-PARALLEL: run two agents at once."), root / "ws", claude_env(recorder, key, root))
    recorder.save("claude_code", "parallel", out)


def claude_compact(recorder: Recorder, out: Path) -> None:
    """A turn with a tool call, then ``/compact`` (``--continue``), then one more turn after the summary."""
    summary = "<analysis>The user ran two checks.</analysis>\n<summary>SUMMARY-TEXT: the user asked for a check; it ran.</summary>"
    script = Script([
        Rule("main", "main-summary", in_last("SCENARIO-COMPACT second"), "SECOND-ANSWER: done."),
        Rule("main", "main", in_last("FIRST-CHECK"), "FIRST-ANSWER: checked."),
        Rule("main", "main", in_last("SCENARIO-COMPACT first"), tool_call("Bash", command="echo FIRST-CHECK",
                                                                          description="check")),
        Rule("main", "main-summary", lambda p: "summary" in last_user(p).lower(), summary),
    ])  # fmt: skip
    key, root = recorder.scenario("claude_code/compact", script)
    env = claude_env(recorder, key, root)
    run(claude("SCENARIO-COMPACT first turn: run the check."), root / "ws", env)
    run(claude("--continue", "/compact"), root / "ws", env)
    run(claude("--continue", "SCENARIO-COMPACT second turn: answer."), root / "ws", env)
    recorder.save("claude_code", "compact", out)


def opencode_config(recorder: Recorder, key: str, root: Path) -> dict[str, str]:
    """opencode pointed at the proxy as an OpenAI-compatible provider (config in the workspace), offline."""
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"gyre": {"npm": "@ai-sdk/openai-compatible", "name": "gyre",
                              "options": {"baseURL": recorder.proxy.base_url, "apiKey": key},
                              "models": {MODEL: {"name": MODEL, "tool_call": True}}}},
        "model": f"gyre/{MODEL}",
        "small_model": f"gyre/{MODEL}",
        "autoupdate": False,
        "share": "disabled",
    }  # fmt: skip
    (root / "ws" / "opencode.json").write_text(json.dumps(config))
    return {"HOME": str(root / "home"), "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "TERM": "dumb", "NO_COLOR": "1",
            "OPENCODE_CONFIG": str(root / "ws" / "opencode.json")}  # fmt: skip


def opencode_subagent(recorder: Recorder, out: Path) -> None:
    """opencode's title call, then the agent calls a tool, starts a sub-agent (its ``task`` tool) and answers."""
    script = Script([
        Rule("title", "auxiliary", in_system("You are a title generator"), "Scripted task"),
        Rule("main", "main", in_last("OC-SUBRESULT"), "OC-DONE: all done."),
        Rule("sub", "subagent", in_last("OC-SUBTASK"), "OC-SUBRESULT: sub done."),
        Rule("main", "main", in_last("OC-CHECK"), tool_call("task", description="scripted task",
                                                           prompt="OC-SUBTASK: answer at once.",
                                                           subagent_type="general")),
        Rule("main", "main", in_last("SCENARIO-OPENCODE"), tool_call("bash", command="echo OC-CHECK",
                                                                    description="check")),
    ])  # fmt: skip
    key, root = recorder.scenario("opencode/subagent", script)
    env = opencode_config(recorder, key, root)
    run(
        [str(NPM_BIN / "opencode"), "run", "--model", f"gyre/{MODEL}", "SCENARIO-OPENCODE: run the check."],
        root / "ws",
        env,
    )
    recorder.save("opencode", "subagent", out)


def mini_swe_agent_steps(recorder: Recorder, out: Path) -> None:
    """mini-swe-agent (litellm, OpenAI chat with a ``bash`` tool): one command, then it submits."""
    script = Script([
        Rule("main", "main", in_last("MINI-CHECK"), tool_call("bash", command="echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")),
        Rule("main", "main", in_last("SCENARIO-MINI"), tool_call("bash", command="echo MINI-CHECK")),
    ])  # fmt: skip
    key, root = recorder.scenario("mini_swe_agent/steps", script)
    mini = shutil.which("mini", path=str(Path(sys.executable).parent))
    assert mini is not None, "mini-swe-agent is a test dependency: pip install -e '.[test]'"
    cmd = [mini, "-m", f"openai/{MODEL}", "-t", "SCENARIO-MINI: run the check.", "--yolo", "--exit-immediately",
           "-o", str(root / "trajectory.json"), "-c", "mini.yaml", "-c",
           f"model.model_kwargs.api_base={recorder.proxy.base_url}", "-c", f"model.model_kwargs.api_key={key}",
           "-c", "agent.step_limit=5", "-c", "agent.cost_limit=0"]  # fmt: skip
    env = {"MSWEA_COST_TRACKING": "ignore_errors", "LITELLM_LOCAL_MODEL_COST_MAP": "True", "HOME": str(root / "home"),
           "MSWEA_CONFIGURED": "true", "TERM": "dumb", "OPENAI_API_KEY": key}  # fmt: skip
    run(cmd, root / "ws", env)
    recorder.save("mini_swe_agent", "steps", out)


def aider_python() -> Path:
    """aider's interpreter: ``$AIDER_PYTHON``, else aider in the venv running this script (aider pins ~100
    packages, so it usually lives in a venv of its own: ``tests/integration/requirements-aider.txt``)."""
    python = Path(os.environ.get("AIDER_PYTHON", sys.executable))
    check = subprocess.run([str(python), "-m", "aider", "--version"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, f"aider is not importable by {python}; set AIDER_PYTHON to a venv with aider-chat"
    return python


def aider_edit(recorder: Recorder, out: Path) -> None:
    """aider (no tools: whole-file edits in text) writes a file, then asks for a commit message (auxiliary)."""
    script = Script([
        Rule("commit", "auxiliary", in_system("commit message"), "Add the answer file"),
        Rule("main", "main", in_last("SCENARIO-AIDER"), "answer.txt\n```\nAIDER-ANSWER\n```"),
    ])  # fmt: skip
    key, root = recorder.scenario("aider/edit", script)
    ws, home = root / "ws", root / "home"
    subprocess.run(["git", "init", "-q"], cwd=ws, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "init"],
                   cwd=ws, check=True)  # fmt: skip
    info = {"max_input_tokens": 65536, "max_output_tokens": 4096, "input_cost_per_token": 0.0,
            "output_cost_per_token": 0.0, "litellm_provider": "openai", "mode": "chat"}  # fmt: skip
    (home / ".aider" / "caches").mkdir(parents=True)
    (home / ".aider" / "caches" / "model_prices_and_context_window.json").write_text(
        json.dumps({f"openai/{MODEL}": info, MODEL: info})
    )
    cmd = [str(aider_python()), "-m", "aider", "--model", f"openai/{MODEL}", "--openai-api-base",
           recorder.proxy.base_url, "--openai-api-key", key, "--message", "SCENARIO-AIDER: write answer.txt.",
           "--yes-always", "--analytics-disable", "--no-check-update", "--no-show-model-warnings",
           "--no-show-release-notes", "--no-pretty", "--no-fancy-input", "--map-tokens", "0", "--no-detect-urls",
           "--edit-format", "whole", "--git-commit-verify"]  # fmt: skip
    env = {"HOME": str(home), "LITELLM_LOCAL_MODEL_COST_MAP": "True", "TERM": "dumb", "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    run(cmd, ws, env)
    recorder.save("aider", "edit", out)


CODEX_CONFIG = """model = "{model}"
model_provider = "gyre"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.gyre]
name = "gyre"
base_url = "{base_url}"
env_key = "OPENAI_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
"""


def codex_answer(recorder: Recorder, out: Path) -> None:
    """Codex CLI (``codex exec``, OpenAI Responses API, ``store: false``): runs a command with its
    ``exec_command`` tool, then answers."""
    script = Script([
        Rule("main", "main", in_last("CODEX-CHECK"), "CODEX-DONE: checked."),
        Rule("main", "main", in_last("SCENARIO-CODEX"), tool_call("exec_command", cmd="echo CODEX-CHECK")),
    ])  # fmt: skip
    key, root = recorder.scenario("codex/answer", script)
    (root / "codex_home").mkdir()
    (root / "codex_home" / "config.toml").write_text(CODEX_CONFIG.format(model=MODEL, base_url=recorder.proxy.base_url))
    cmd = [str(NPM_BIN / "codex"), "exec", "--skip-git-repo-check", "--ephemeral", "--json",
           "SCENARIO-CODEX: run the check."]  # fmt: skip
    env = {"CODEX_HOME": str(root / "codex_home"), "HOME": str(root / "home"), "OPENAI_API_KEY": key, "TERM": "dumb"}
    run(cmd, root / "ws", env)
    recorder.save("codex", "answer", out)


SMOLAGENTS_DRIVER = """import os, sys
from smolagents import CodeAgent, OpenAIModel, ToolCallingAgent, tool


@tool
def check(word: str) -> str:
    \"\"\"Checks a word.

    Args:
        word: the word to check
    \"\"\"
    return "SMOL-CHECKED " + word


model = OpenAIModel(model_id=sys.argv[2], api_base=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"])
agent = (CodeAgent if sys.argv[1] == "code" else ToolCallingAgent)(tools=[check], model=model, max_steps=int(sys.argv[4]))
print("FINAL ANSWER:", agent.run(sys.argv[3]))
"""


def smolagents_run(kind: str, limit: bool = False) -> Callable[[Recorder, Path], None]:
    """smolagents' CodeAgent (``code``) or ToolCallingAgent (``tool``, every call ``tool_choice="required"``): one
    step that calls its ``check`` tool, then its final answer. smolagents re-sends the model's turn changed: the
    CodeAgent's with the stop string the proxy cut (``</code>``) appended, the ToolCallingAgent's forced tool call
    as text; both continue their conversation. With ``limit`` the agent may take one step only (``max_steps=1``)
    and never answers in it, so smolagents makes its final-answer call: a new system prompt ("got stuck") over the
    agent's memory re-sent (its turns included), answered in prose."""

    def scenario(recorder: Recorder, out: Path) -> None:
        if kind == "code":
            step = "Thought: check first.\n<code>\nprint(check('ok'))\n</code>"
            final = "Thought: checked.\n<code>\nfinal_answer('SMOL-DONE')\n</code>"
        else:
            step, final = tool_call("check", word="ok"), tool_call("final_answer", answer="SMOL-DONE")
        script = Script([
            Rule("main", "main-summary", in_system("got stuck and failed"), "SMOL-DONE (from the memory)"),
            Rule("main", "main", in_last("SMOL-CHECKED"), final),
            Rule("main", "main", in_first("SCENARIO-SMOL"), step),
        ])  # fmt: skip
        key, root = recorder.scenario(f"smolagents/{kind}" + ("_limit" if limit else ""), script)
        (root / "driver.py").write_text(SMOLAGENTS_DRIVER)  # a file: smolagents' @tool reads its function's source
        env = {"OPENAI_BASE_URL": recorder.proxy.base_url, "OPENAI_API_KEY": key, "HOME": str(root / "home")}
        task = "SCENARIO-SMOL: check the word, then answer."
        run([sys.executable, str(root / "driver.py"), kind, MODEL, task, "1" if limit else "3"], root / "ws", env)
        recorder.save("smolagents", f"{kind}_agent" + ("_limit" if limit else ""), out)

    return scenario


SCENARIOS: dict[str, Callable[[Recorder, Path], None]] = {
    "claude_code/subagents": claude_subagents,
    "claude_code/compact": claude_compact,
    "claude_code/parallel": claude_parallel,
    "opencode/subagent": opencode_subagent,
    "mini_swe_agent/steps": mini_swe_agent_steps,
    "aider/edit": aider_edit,
    "codex/answer": codex_answer,
    "smolagents/code_agent": smolagents_run("code"),
    "smolagents/tool_agent": smolagents_run("tool"),
    "smolagents/code_agent_limit": smolagents_run("code", limit=True),
    "smolagents/tool_agent_limit": smolagents_run("tool", limit=True),
}
DEFAULT = tuple(SCENARIOS)  # recorded when --only names none


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help=f"some of {list(SCENARIOS)} (default: {DEFAULT})")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    names = args.only or list(DEFAULT)
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; known: {list(SCENARIOS)}")
    workdir = Path(tempfile.mkdtemp(prefix="record_traffic_"))
    recorder = Recorder(workdir)
    recorder.proxy.start()
    try:
        for name in names:
            SCENARIOS[name](recorder, args.out)
    finally:
        recorder.proxy.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
