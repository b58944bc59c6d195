"""``python -m gyre_jax.evaluate``, ``serve`` and ``export`` driven through their command lines on one tiny run
(trained once for the module: 1 RL step, evaluations before and after it).

- evaluate: the run's checkpoint 1 evaluated by the command equals the run's own evaluation after step 1 (same
  executions, rewards, and every record's token ids and log-probs); its report holds the intervals, pass@k,
  exclusions and the per-task table;
- export: the HF directory read back by the project's own loader gives the checkpoint's logits (float32: exact), its
  tokenizer.json tokenizes as the run's byte tokenizer, its chat template renders as the proxy did;
- serve: the ``openai`` and ``anthropic`` SDKs (plain, streamed, tools, the Responses API) and mini-swe-agent (a
  real CLI) answered by ``serve``, every call recorded; SIGINT stops it with status 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# The tiny run: a 1-layer model, 1 RL step of 1 task x 4, evaluation of 2 training + 2 held-out tasks, 1 sample.
# rollout.timeout_s is generous: on a loaded machine the first calls compile the serving programs.
TRAIN = [
    "--config", "configs/tiny_cpu.py", "--config.warm_start.steps=20", "--config.rollout.tasks_per_step=1",
    "--config.rl.group_size=4", "--config.rollout.num_tasks=2", "--config.eval.samples_per_task=1",
    "--config.eval.num_tasks=2", "--config.metrics.progress_bar=false", "--config.model.num_layers=1",
    "--config.model.embed_dim=32", "--config.model.mlp_dim=64", "--config.model.head_dim=8",
    "--config.total_steps=1", "--config.rollout.timeout_s=300",
]  # fmt: skip


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "GYRE_PROGRESS")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _cli(module: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("commands") / "run"
    done = _cli("gyre_jax.train", *TRAIN, f"--config.workdir={workdir}")
    assert done.returncode == 0, done.stderr[-4000:]
    return workdir


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- evaluate ----------------------------------------------------------------------------------------------
def test_evaluate_equals_the_in_run_evaluation(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    done = _cli("gyre_jax.evaluate", "--run", str(run_dir), "--step", "1", "--out", str(out), "--k", "1")
    assert done.returncode == 0, done.stderr[-4000:]
    in_run = _jsonl(run_dir / "results" / "eval_000001.jsonl")
    ours = _jsonl(out / "results.jsonl")
    assert [r["execution_id"] for r in ours] == [r["execution_id"] for r in in_run] and len(ours) == 4
    for a, b in zip(in_run, ours):
        assert (a["eval_split"], a["status"], a["reward"], a["excluded"]) == (b["eval_split"], b["status"],
                                                                             b["reward"], b["excluded"])  # fmt: skip
        assert a["status"] == "finished", a  # no timeout: the comparison is about the policy, not the machine
        calls_run = _jsonl(run_dir / "records" / f"{a['execution_id']}.jsonl")
        calls_ours = _jsonl(out / "records" / f"{a['execution_id']}.jsonl")
        assert len(calls_run) == len(calls_ours) >= 1
        for x, y in zip(calls_run, calls_ours):  # the same tokens, sampled with the same log-probs (float32 rounding:
            # a prompt prefilled in other chunks or batched beside other prompts rounds differently in the last bits)
            assert (x["prompt_ids"], x["completion_ids"]) == (y["prompt_ids"], y["completion_ids"])
            np.testing.assert_allclose(y["completion_logprobs"], x["completion_logprobs"], rtol=1e-5, atol=1e-5)
            assert x["policy_versions"] == y["policy_versions"] == [1] * len(x["completion_ids"])
    report = json.loads((out / "evaluation.json").read_text())
    metrics = [m for m in _jsonl(run_dir / "metrics.jsonl") if m.get("phase") == "eval" and m["step"] == 1]
    assert {m["eval_split"] for m in metrics} == set(report["splits"]) == {"train", "heldout"}
    for m in metrics:
        split = report["splits"][m["eval_split"]]
        assert split["reward_mean"] == pytest.approx(m["eval_reward_mean"])
        assert split["pass_rate"] == pytest.approx(m["eval_pass_rate"])
        assert split["pass_rate_ci"] == m["eval_pass_rate_ci"] and split["reward_mean_ci"] == m["eval_reward_ci"]
        assert split["executions"] == 2 and split["tasks"] == 2 and len(split["per_task"]) == 2
        assert split["pass_at_k"]["1"] == {"value": pytest.approx(split["pass_rate"]), "tasks": 2}
        assert split["exclusions"] == {} and split["excluded"] == 0
        lo, hi = split["reward_mean_ci"]
        assert lo <= split["reward_mean"] <= hi
    assert report["policy_version"] == 1 and report["source"]["step"] == 1
    assert "pass rate" in done.stdout and "95% [" in done.stdout and "pass@1" in done.stdout
    # progress without a terminal: plain lines, never a bar
    assert "evaluation after 1 RL steps: started (4 executions)" in done.stderr and "\r" not in done.stderr
    assert "evaluation after 1 RL steps: done 4/4 executions" in done.stderr


def test_evaluate_refuses_bad_arguments_before_any_work(run_dir: Path, tmp_path: Path, capsys) -> None:
    """Each refusal through ``evaluate.main`` in this process (the command's own code: nothing before the refusals
    starts the runtime), the last also as the real command (its exit code and stderr line)."""
    from gyre_jax import evaluate

    cases = [
        (["--run", str(run_dir), "--step", "7"], "no checkpoint of step 7; it keeps steps [0, 1]"),
        (["--run", str(tmp_path)], "config.json not found"),
        (["--run", str(run_dir), "--checkpoint", "x.gguf"], "not both"),
        (["--run", str(run_dir), "--k", "3"], "each k must be in [1, 1]"),
        (["--run", str(run_dir), "--config.rl.group_size=1"], "config.rl.group_size=1 must be >= 2"),
        (["--run", str(run_dir), "--bogus"], "unrecognized argument '--bogus'"),
    ]
    for args, message in cases:
        assert evaluate.main([*args, "--out", str(tmp_path / "never")]) == 2, args
        stderr = capsys.readouterr().err
        assert stderr.strip().splitlines()[-1].startswith("error: ") and message in stderr, stderr
        assert not (tmp_path / "never").exists()
    done = _cli("gyre_jax.evaluate", *cases[-1][0], "--out", str(tmp_path / "never"), timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error: "), done.stderr
    assert cases[-1][1] in done.stderr and not (tmp_path / "never").exists()


# -- export ------------------------------------------------------------------------------------------------
def test_export_reads_back_with_the_checkpoints_logits(run_dir: Path, tmp_path: Path) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tokenizers import Tokenizer

    from gyre_jax.commands import PolicySource, load_config
    from gyre_jax.export import export_model_config, restore_params
    from gyre_jax.model.attention import segment_causal_mask
    from gyre_jax.model.hf_checkpoint import load_hf_checkpoint
    from gyre_jax.model.sharding import abstract_model, make_mesh
    from gyre_jax.model.tokenizer import ByteTokenizer
    from gyre_jax.proxy import chat_template
    from gyre_jax.proxy.jinja_template import JinjaChatTemplate

    out = tmp_path / "hf"
    done = _cli("gyre_jax.export", "--run", str(run_dir), "--step", "1", "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "logits relative error 0.00e+00" in done.stdout, done.stdout  # float32: the weights round-trip exactly
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json", "generation_config.json"}  # fmt: skip
    # Independently of the command's own check: the checkpoint's params vs the export read back.
    config = load_config(PolicySource(run=run_dir, step=1), None, [])
    cfg = export_model_config(config)
    params = restore_params(config, cfg, run_dir, 1)
    mesh = make_mesh(jax.devices()[:1], {})
    _, graphdef2, params2 = load_hf_checkpoint(out, mesh, config.sharding_rules, dtype="float32")
    tokenizer = ByteTokenizer()
    messages = [{"role": "user", "content": "Copy input.txt to answer.txt, ✓ <tool_call>"}]
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
              "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]  # fmt: skip
    ids = tokenizer.encode(chat_template.render(messages, tools, tools_format="compact"))
    tokens = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    mask = segment_causal_mask(jnp.ones_like(tokens))
    want = np.asarray(nnx.merge(abstract_model(cfg)[0], params)(tokens, positions, mask)[0])
    got = np.asarray(nnx.merge(graphdef2, params2)(tokens, positions, mask)[0])
    np.testing.assert_array_equal(got, want)
    # The tokenizer and the chat template a transformers user gets are the run's own.
    hf_tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = chat_template.render(messages, tools, tools_format="compact") + "Ünïcödé\x00\n<|im_end|>"
    assert hf_tok.encode(text, add_special_tokens=False).ids == tokenizer.encode(text)
    assert hf_tok.decode(tokenizer.encode(text), skip_special_tokens=False) == text
    template = json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    rendered = JinjaChatTemplate.of(template).render(messages, tools, add_generation_prompt=True)
    assert rendered == chat_template.render(messages, tools, tools_format="compact")


def test_export_refuses_gguf_for_a_model_not_from_gguf(run_dir: Path, tmp_path: Path) -> None:
    done = _cli("gyre_jax.export", "--run", str(run_dir), "--format", "gguf", "--out", str(tmp_path / "m.gguf"),
                timeout=120)  # fmt: skip
    assert done.returncode == 2 and "--format gguf needs a model that came from a GGUF file" in done.stderr
    assert not (tmp_path / "m.gguf").exists()


# -- serve -------------------------------------------------------------------------------------------------
def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"serve exited with {proc.returncode}"
        assert time.monotonic() < deadline, "serve did not start in time"
        time.sleep(0.5)
    return json.loads(path.read_text())


def test_serve_answers_the_sdks_and_a_cli(run_dir: Path, tmp_path: Path) -> None:
    import anthropic
    import openai

    info_path, records = tmp_path / "serve.json", tmp_path / "records"
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "gyre_jax.serve", "--run", str(run_dir), "--info", str(info_path),
                             "--records", str(records), "--max-tokens", "16"], cwd=REPO, env=_env(), stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:
        info = _wait_for(info_path, proc, timeout=900)
        key, model = info["api_key"], info["model"]
        oa = openai.OpenAI(base_url=info["base_url"], api_key=key, max_retries=0, timeout=300)
        assert [m.id for m in oa.models.list()] == [model]
        chat = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8)
        assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
        stream = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count"}], stream=True,
                                            max_tokens=8)  # fmt: skip
        chunks = list(stream)
        assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
        tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object",
                  "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]  # fmt: skip
        forced = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "Read a.txt"}],
                                            tools=tools, tool_choice="required", max_tokens=16)  # fmt: skip
        assert forced.choices[0].message.tool_calls or forced.choices[0].finish_reason == "length"
        response = oa.responses.create(model=model, input="Hello", max_output_tokens=8)
        assert response.status in ("completed", "incomplete")
        an = anthropic.Anthropic(base_url=info["anthropic_base_url"], api_key=key, max_retries=0, timeout=300)
        message = an.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
        assert message.stop_reason in ("end_turn", "max_tokens", "stop_sequence") and message.usage.output_tokens >= 1
        with an.messages.stream(model=model, max_tokens=8, messages=[{"role": "user", "content": "Go"}]) as s:
            final = s.get_final_message()
        assert final.usage.output_tokens >= 1
        # A real CLI: mini-swe-agent through the OpenAI API, with the preset's short config.
        work = tmp_path / "mini"
        work.mkdir()
        mini_yaml = (REPO / "gyre_jax" / "rollout" / "harness_configs" / "mini_swe_agent.yaml").read_text()
        mini_yaml = mini_yaml.replace("{max_turns}", "2").replace("{base_url}", info["base_url"])
        (work / "mini.yaml").write_text(mini_yaml.replace("{max_tokens}", "16"))
        env = {**_env(), "OPENAI_API_KEY": key, "MSWEA_COST_TRACKING": "ignore_errors", "HOME": str(work),
               "LITELLM_LOCAL_MODEL_COST_MAP": "True", "MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1"}  # fmt: skip
        mini = subprocess.run([sys.executable, "-m", "minisweagent", "-m", f"openai/{model}", "-t", "Write hi to a.txt",
                               "--yolo", "--exit-immediately", "-c", str(work / "mini.yaml"), "-o",
                               str(work / "trajectory.json")], cwd=work, env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        trajectory = json.loads((work / "trajectory.json").read_text())
        served = [m for m in trajectory["messages"] if isinstance(m.get("extra"), dict) and "response" in m["extra"]]
        assert served, (mini.stdout[-2000:], mini.stderr[-2000:])
        recorded = _jsonl(records / "serve.jsonl")
        apis = [r["api"] for r in recorded]
        # the SDK calls above (chat x3, responses, messages x2) and mini's, each recorded once
        assert apis[:6] == ["chat", "chat", "chat", "responses", "messages", "messages"]
        assert apis[6:] == ["chat"] * len(served)
        assert recorded[-1]["completion_ids"] and recorded[-1]["policy_versions"] == [1] * len(
            recorded[-1]["completion_ids"]
        )
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert code == 0, text[-3000:]
    assert "OPENAI_BASE_URL=" in text and "stopping" in text
