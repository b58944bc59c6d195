"""Agent identity on the proxy: normalized system prompts, auxiliary calls, summary continuations, and
token-in/token-out state kept per conversation (so agents sharing a system prompt never overwrite each other's),
through a real ProxyServer with the scripted backend and the real ``openai`` SDK."""

from __future__ import annotations

import itertools
import json
import lzma
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy import agents
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.serving.scripted import SCRIPTED_LOGPROB, ScriptedBackend
from gyre_jax.serving.types import ContextTooLongError, GenerationRequest, SamplingParams

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "harness_traffic"
TOKENIZER = ByteTokenizer()
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {}}}}]


def claude_code_system(call: int, scenario: str = "compact") -> str:
    """The system prompt of a recorded Claude Code call, as the Messages adapter joins its blocks."""
    with lzma.open(CORPUS / "claude_code" / f"{scenario}.jsonl.xz", "rt") as f:
        body = json.loads(f.readlines()[call])["body"]
    return "\n\n".join(block["text"] for block in body["system"])


def test_normalized_system_prompts_drop_per_conversation_noise() -> None:
    main, after_summary = claude_code_system(0), claude_code_system(3)
    assert main != after_summary and "x-anthropic-billing-header" in main  # the header's hash differs
    assert agents.normalize_system(main) == agents.normalize_system(after_summary)
    sub = claude_code_system(1, "subagents")
    assert agents.system_key([{"role": "system", "content": sub}]) != agents.system_key(
        [{"role": "system", "content": main}]
    )
    noisy = "x-trace-id: 5f2a\nYou are a helper.\nSession 3fa85f64-5717-4562-b3fc-2c963f66afa6 on 2026-12-01 at 12:05"
    quiet = "You are a helper.\nSession 0b8e3a1c-0000-4000-8000-000000000000 on Tue Dec 02 2026 at 9:41:07"
    assert agents.normalize_system(noisy) == "You are a helper.\nSession <uuid> on <date> at <time>"
    assert agents.normalize_system(quiet) == "You are a helper.\nSession <uuid> on <date> at <time>"
    assert agents.normalize_system("commit deadbeef42 of cwd /srv/a") != agents.normalize_system("cwd /srv/b")


def test_auxiliary_and_summary_rules() -> None:
    title = [{"role": "system", "content": "You are a title generator. You output ONLY a thread title."},
             {"role": "user", "content": "Generate a title for this conversation:\n"}]  # fmt: skip
    plain = [{"role": "system", "content": "You are a coder."}, {"role": "user", "content": "fix it"}]
    assert agents.is_auxiliary(title, None, tooled_agent_known=False)
    assert not agents.is_auxiliary(title, TOOLS, tooled_agent_known=True)  # offers tools: an agent
    assert not agents.is_auxiliary(plain, None, tooled_agent_known=False)  # aider's main offers no tools either
    assert agents.is_auxiliary(plain, [], tooled_agent_known=True)
    summary = "<analysis>short</analysis>\n<summary>The user wants the parser fixed; tests pass.</summary>"
    continued = [{"role": "user", "content": "Continued from a summary:\nThe user wants the parser fixed; tests pass."}]
    assert agents.quotes(summary, continued) and not agents.quotes("short", continued)
    assert not agents.quotes(summary, [{"role": "user", "content": "The user wants"}])


def test_scripted_backend_contract() -> None:
    backend = ScriptedBackend(TOKENIZER, lambda prompt: prompt.upper()[-3:], max_context=8)
    result = backend.submit(GenerationRequest(prompt_ids=TOKENIZER.encode("abc"))).result()
    end = TOKENIZER.token_id("<|im_end|>")
    assert result.token_ids == TOKENIZER.encode("ABC") + [end] and result.finish_reason == "stop"
    assert result.stop_reason == end and result.logprobs == [SCRIPTED_LOGPROB] * 4 and result.prompt_len == 3
    cut = backend.submit(GenerationRequest(TOKENIZER.encode("abcdef"), SamplingParams(max_tokens=2))).result()
    assert cut.finish_reason == "length" and cut.token_ids == TOKENIZER.encode("DEF")[:2]
    with pytest.raises(ContextTooLongError):
        backend.submit(GenerationRequest(prompt_ids=[1] * 8)).result()
    failing = ScriptedBackend(TOKENIZER, lambda prompt: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.submit(GenerationRequest(prompt_ids=[1])).result()


@pytest.fixture
def proxy(tmp_path) -> Iterator[ProxyServer]:
    """A proxy whose scripted model answers ``reply <call number>: <last user turn>``."""
    numbers = itertools.count()

    def script(prompt: str) -> str:
        return f"reply {next(numbers)}: " + prompt.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0]

    store = RecordStore(tmp_path)
    with ProxyServer(ScriptedBackend(TOKENIZER, script), TOKENIZER, store) as server:
        yield server


def chat(server: ProxyServer, key: str, messages: list[dict]) -> str:
    client = openai.OpenAI(base_url=server.base_url, api_key=key)
    return client.chat.completions.create(model="gyre-tiny", messages=messages, tools=TOOLS).choices[0].message.content


def test_agents_sharing_a_system_prompt_keep_their_own_reuse_state(proxy) -> None:
    """Two sub-agents with one system prompt and one task, interleaved (a parent running both): each call
    continues its own conversation, so every continuing call reuses its prefix (one thread state would have
    been overwritten by the other agent's call)."""
    key = proxy.open_execution("same-system")
    system = {"role": "system", "content": "You are a worker."}
    a = [system, {"role": "user", "content": "task"}]
    b = [system, {"role": "user", "content": "task"}]
    a.append({"role": "assistant", "content": chat(proxy, key, a)})
    b.append({"role": "assistant", "content": chat(proxy, key, b)})
    a.append({"role": "user", "content": "a: go on"})
    b.append({"role": "user", "content": "b: go on"})
    chat(proxy, key, a)
    chat(proxy, key, b)
    records = proxy.record_store.read("same-system")
    assert [r.reused_prefix_len > 0 for r in records] == [False, False, True, True]
    for before, after in ((records[0], records[2]), (records[1], records[3])):
        assert after.prompt_ids[: after.reused_prefix_len] == before.prompt_ids + before.completion_ids


def test_fork_from_an_earlier_call_reuses_it_and_a_summary_continues_the_agent(proxy) -> None:
    """A summary request re-sending the conversation up to an earlier call (Claude Code's /compact) reuses that
    call's ids; the conversation that restarts from the summary, under a system prompt differing only by a
    per-conversation header, is the same agent, and a tool-less call after it is auxiliary."""
    key = proxy.open_execution("fork")
    system = "x-billing: cc=1a2\nYou are the main agent."
    main = [{"role": "system", "content": system}, {"role": "user", "content": "start"}]
    main.append({"role": "assistant", "content": chat(proxy, key, main)})
    fork = main + [{"role": "user", "content": "summarize the conversation"}]
    main.append({"role": "user", "content": "more"})
    main.append({"role": "assistant", "content": chat(proxy, key, main)})
    summary = chat(proxy, key, fork)  # forks from call 0, after call 1 moved the conversation on
    restarted = [{"role": "system", "content": system.replace("1a2", "9f0")},
                 {"role": "user", "content": f"This session continues from a summary:\n{summary}"}]  # fmt: skip
    chat(proxy, key, restarted)
    client = openai.OpenAI(base_url=proxy.base_url, api_key=key)
    client.chat.completions.create(model="gyre-tiny", messages=[{"role": "user", "content": "a title, please"}])
    records = proxy.record_store.read("fork")
    assert [r.reused_prefix_len > 0 for r in records] == [True if i in (1, 2) else False for i in range(5)]
    assert records[2].prompt_ids[: records[2].reused_prefix_len] == records[0].prompt_ids + records[0].completion_ids
    assert [r.thread_id for r in records[:4]] == ["main"] * 4
    assert records[4].agent_kind == "auxiliary" and records[4].thread_id.startswith("main~")
    assert [r.agent_kind for r in records[:4]] == [""] * 4


def test_a_finished_subagents_report_quoted_in_a_new_task_starts_a_new_agent(proxy) -> None:
    """A parent passing a finished sub-agent's report into the task of the next sub-agent of the same type is not
    a summary continuation of the first: only the agent whose answer was recorded last can be continued."""
    key = proxy.open_execution("quoted-report")
    worker = {"role": "system", "content": "You are a worker."}
    main = [{"role": "system", "content": "You are the main agent."}, {"role": "user", "content": "go"}]
    chat(proxy, key, main)
    report = chat(proxy, key, [worker, {"role": "user", "content": "first task, report in one line"}])
    chat(proxy, key, main + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": report}])
    chat(proxy, key, [worker, {"role": "user", "content": f"second task; the first said:\n{report}"}])
    threads = [r.thread_id for r in proxy.record_store.read("quoted-report")]
    assert threads[0] == "main" and len({threads[1], threads[3]}) == 2 and "main" not in (threads[1], threads[3])
    assert (
        threads[2] == "main"
    )  # main again: a new conversation (its "ok" is not what it was answered) repeating its first turn


def test_restated_history_rule() -> None:
    """Rule 2 on its own: the known conversation's messages, system prompts aside, up to an answer of its agent,
    then an assistant turn there (verbatim or changed); a shared first turn alone is no restatement."""
    history = [{"role": "system", "content": "You are a coder."}, {"role": "user", "content": "fix it"}]
    answer = {"role": "assistant", "content": "looking"}
    stuck = {"role": "system", "content": "The agent got stuck; answer from its memory:"}
    changed = {"role": "assistant", "content": "looking\nCalling tools: [...]"}
    then = {"role": "user", "content": "Observation: ok. Now answer the task."}
    assert agents.restates([stuck, history[1], answer, then], history, {2: [answer]})
    assert agents.restates(
        [stuck, history[1], changed, then], history, {2: [answer]}
    )  # a re-send shape build_prompt accepts
    assert agents.restates([history[1], changed], history, {2: [answer]})  # no system prompt at all
    assert not agents.restates(
        [stuck, history[1]], history, {2: [answer]}
    )  # the same task, but no answer of the agent's
    assert not agents.restates([stuck, {"role": "user", "content": "fix that"}, answer, then], history, {2: [answer]})
    assert not agents.restates(
        [stuck, history[1], then, answer], history, {2: [answer]}
    )  # no assistant turn where it answered
    assert not agents.restates(
        [stuck, answer], [history[0], answer], {1: [answer]}
    )  # at least one message repeated first
    other = {"role": "assistant", "content": "another agent's answer"}
    assert not agents.restates([stuck, history[1], other, then], history, {2: [answer]})  # not its answer
    call = {"role": "assistant", "content": "", "tool_calls": [("check", {"word": "ok", "n": 2})]}
    as_text = {
        "role": "assistant",
        "content": "Calling tools:\n[{'name': 'check', 'arguments': {'word': 'ok', 'n': 2}}]",
    }
    assert agents.resends(as_text, call) and agents.resends(call, call)
    assert not agents.resends({"role": "assistant", "content": "Calling tools: check({'word': 'no'})"}, call)
    assert not agents.resends(answer, {"role": "assistant", "content": ""})  # an empty answer: only verbatim


def test_a_final_answer_call_restating_the_history_is_the_agent_never_auxiliary(proxy) -> None:
    """smolagents' shape after its step limit: a new system prompt, no tools, the agent's memory re-sent (its turn
    changed). It is the agent whose history it restates (the main agent's new branch, or a sub-agent's), never an
    auxiliary call (tool-less after a tool-using agent) nor a new agent; a sub-agent given the main agent's task
    restates no answer of the main agent's, so it stays a new agent."""
    key = proxy.open_execution("restated")
    task = {"role": "user", "content": "New task:\ncheck the word"}
    main = [{"role": "system", "content": "You are the main agent."}, task]
    turn = chat(proxy, key, main)
    sub = [{"role": "system", "content": "You are a worker."}, task]
    sub_turn = chat(proxy, key, sub)  # the same first turn, another system prompt: a new agent
    stuck = {"role": "system", "content": "An agent got stuck. Here is the agent's memory:"}
    observation = {"role": "user", "content": "Observation: ok\nNow answer the task."}
    client = openai.OpenAI(base_url=proxy.base_url, api_key=key)
    for own in (turn, sub_turn):
        memory = [stuck, task, {"role": "assistant", "content": own + "\nCalling tools: [...]"}, observation]
        client.chat.completions.create(model="gyre-tiny", messages=memory)  # no tools
    client.chat.completions.create(model="gyre-tiny", messages=[stuck, task, observation])  # restates no answer
    records = proxy.record_store.read("restated")
    threads, kinds = [r.thread_id for r in records], [r.agent_kind for r in records]
    assert threads[:4] == ["main", threads[1], "main", threads[1]] and threads[1].startswith("main~")
    assert kinds[:4] == [""] * 4
    assert kinds[4] == "auxiliary" and threads[4] not in threads[:4]
