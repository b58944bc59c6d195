"""The sampling policy through a real ProxyServer (real ``openai`` / ``anthropic`` SDKs): under ``policy`` the run's
values are served whatever the harness asks, under ``client`` the harness's; either way the record keeps what
the client sent, and no legitimate request produces a record the trainer's reader rejects."""

from __future__ import annotations

import itertools

import anthropic
import numpy as np
import openai
import pytest

from gyre_jax.config import ConfigError, load_config
from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.sampling import SamplingPolicy
from gyre_jax.trajectory.pipeline import LoadExecution, SelectBranches, TrajectoryConfig
from gyre_jax.trajectory.queue import QueuedExecution
from gyre_jax.trajectory.reader import iter_records

TOK = ByteTokenizer()
MODEL = "gyre-tiny"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
RUN = SamplingPolicy.policy(0.7)


def script(request) -> str:
    prompt = TOK.decode(request.prompt_ids)
    return "{}}\n</tool_call>" if prompt.endswith('"arguments": ') else "Thought: ok\nObservation: done"


def test_policy_serves_the_runs_values_and_records_what_the_client_asked(make_stack) -> None:
    with make_stack(script, sampling=RUN) as stack:
        client = openai.OpenAI(base_url=stack.server.base_url, api_key=stack.key("e-pol"), max_retries=0)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=0,
                                       top_p=0.25, seed=3, stop=["Observation:"])  # fmt: skip
        served = stack.backend.requests[0].sampling
        assert (served.temperature, served.top_p, served.top_k) == (0.7, 1.0, 0)
        assert served.stop_strings == ("Observation:",) and served.seed == 3  # the conversation's shape: the client's
        (rec,) = stack.store.read("e-pol")
        assert rec.temperature == 0.7
        assert rec.client_sampling == {"temperature": 0.0, "top_p": 0.25, "seed": 3, "stop": ["Observation:"]}


def test_client_serves_the_clients_values(make_stack) -> None:
    with make_stack(script, sampling=SamplingPolicy.client()) as stack:
        key = stack.key("e-cli")
        client = anthropic.Anthropic(base_url=stack.server.anthropic_base_url, api_key=key, max_retries=0)
        # (the anthropic SDK 2.x has no sampling arguments; clients send them in the body)
        client.messages.create(model=MODEL, max_tokens=32, messages=[{"role": "user", "content": "x"}],
                               extra_body={"temperature": 0, "top_k": 5, "top_p": 0.5})  # fmt: skip
        served = stack.backend.requests[0].sampling
        assert (served.temperature, served.top_p, served.top_k) == (0.0, 0.5, 5)
        (rec,) = stack.store.read("e-cli")
        assert rec.temperature == 0.0 and rec.client_sampling == {"temperature": 0.0, "top_p": 0.5, "top_k": 5}


EDGES = {
    "temperature": [None, 0, 1e-6, 2],
    "top_p": [None, 1e-6, 1],
    "top_k": [None, 0, 1, 2**40],  # Anthropic's; the OpenAI APIs ignore it (sent in the body all the same)
    "seed": [None, -1, 2**63 - 1],
    "stop": [None, "", ["", "\n"], ["Observation:", "Thought", "x", "ok"]],
    "max_tokens": [None, 1],
}


def edge_requests():
    """Every sampling field at its edge values (each value at least once, combined round-robin), per API."""
    width = max(len(v) for v in EDGES.values())
    for i in range(width):
        fields = {k: v[i % len(v)] for k, v in EDGES.items()}
        yield {k: v for k, v in fields.items() if v is not None}
    yield {"n": 3, "temperature": 0}
    yield {"tool_choice": "required", "temperature": 0, "stop": "}"}


def call(stack, api: str, execution_id: str, fields: dict) -> None:
    key = stack.key(execution_id)
    messages = [{"role": "user", "content": "go"}]
    tool_choice = fields.pop("tool_choice", None)
    if api != "messages" and "top_k" in fields:
        fields["extra_body"] = {"top_k": fields.pop("top_k")}
    if api == "chat":
        client = openai.OpenAI(base_url=stack.server.base_url, api_key=key, max_retries=0)
        extra = {"tools": TOOLS, "tool_choice": tool_choice} if tool_choice else {}
        client.chat.completions.create(model=MODEL, messages=messages, **fields, **extra)
    elif api == "completions":
        client = openai.OpenAI(base_url=stack.server.base_url, api_key=key, max_retries=0)
        client.completions.create(model=MODEL, prompt="go", **fields)
    else:
        client = anthropic.Anthropic(base_url=stack.server.anthropic_base_url, api_key=key, max_retries=0)
        fields.pop("n", None), fields.pop("seed", None)
        stop = fields.pop("stop", None)
        if stop is not None:
            fields["stop_sequences"] = [stop] if isinstance(stop, str) else stop
        extra = {"tool_choice": {"type": "any"}, "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
        max_tokens = fields.pop("max_tokens", 32)
        stop = fields.pop("stop_sequences", None)
        client.messages.create(model=MODEL, messages=messages, max_tokens=max_tokens, extra_body=fields,
                               **({"stop_sequences": stop} if stop is not None else {}),
                               **(extra if tool_choice else {}))  # fmt: skip


@pytest.mark.parametrize("policy", [RUN, SamplingPolicy.client()], ids=["policy", "client"])
def test_no_legitimate_request_makes_a_record_the_trainer_rejects(make_stack, tmp_path, policy) -> None:
    counter = itertools.count()
    with make_stack(script, sampling=policy) as stack:
        executions = []
        for api in ("chat", "completions", "messages"):
            for fields in edge_requests():
                execution_id = f"e{next(counter)}"
                call(stack, api, execution_id, dict(fields))
                executions.append((execution_id, fields))
        config = TrajectoryConfig(vocab_size=TOK.vocab_size, message_end_id=TOK.token_id("<|im_end|>"))
        load, select = LoadExecution(stack.store.root, config), SelectBranches(config)
        for index, (execution_id, fields) in enumerate(executions):
            records = list(iter_records(stack.store.path(execution_id), execution_id, TOK.vocab_size))
            assert records and all(r.temperature >= 0 for r in records)
            entry = QueuedExecution(index, execution_id, 0, 1.0, 1.0, False)
            loaded = load.map(entry)
            assert loaded.excluded is None, loaded.excluded
            for branch in loaded.branches:  # no 0 temperature where the loss divides by it
                arrays = branch.arrays()
                assert np.all(arrays.temperature[arrays.trainable] > 0)
            selected = select.map(loaded)
            greedy = policy.mode == "client" and fields.get("temperature") == 0
            assert loaded.greedy_calls == (len(records) if greedy else 0)
            if greedy:  # kept, read and counted; nothing of it trained, under a named reason
                assert "every call was greedy" in selected.excluded
            else:
                assert selected.excluded is None and selected.selection.num_selected >= 1
            if policy.mode == "policy":
                assert {r.temperature for r in records} == {0.7}


def test_the_sampling_mode_is_checked_at_config_load_and_reaches_the_runs_proxy(tmp_path) -> None:
    from gyre_jax import build

    built = {}
    for mode in ("policy", "client"):
        config = load_config([f"--config.proxy.sampling={mode}", "--config.rollout.temperature=0.6"])
        assert config.proxy.sampling == mode
        built[mode] = build.make_proxy(config, None, TOK, RecordStore(tmp_path / mode))._pipeline.sampling  # noqa: SLF001
    assert built == {"policy": SamplingPolicy.policy(0.6), "client": SamplingPolicy.client()}
    assert load_config([]).proxy.sampling == "policy"
    with pytest.raises(ConfigError, match=r"config.proxy.sampling='greedy' must be one of \('policy', 'client'\)"):
        load_config(["--config.proxy.sampling=greedy"])
    with pytest.raises(ValueError, match="must be > 0"):
        SamplingPolicy.policy(0.0)
