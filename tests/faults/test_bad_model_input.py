"""Bad model input (issue 19 item 8): each broken checkpoint fails at start with one line naming the file and what is
wrong, through the loading functions the trainer calls (and once through ``python -m gyre_jax.train``: exit 2, one
``error:`` line, no traceback); a run whose steps train nothing stops with exit 3 instead of ending as if it trained."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from timelimits import run_time_limits, scaled

from gyre_jax import config as config_lib
from gyre_jax.model.config import ModelConfig, ModelInputError
from gyre_jax.model.hf_checkpoint import load_hf_params, read_model_config
from gyre_jax.model.hf_config import model_kwargs
from gyre_jax.model.hf_tokenizer import HFTokenizer, check_fits_model
from gyre_jax.rollout.executor import ExecutionResult
from gyre_jax.run import EXIT_UNTRAINED, UntrainedSteps, untrained_reason

_spec = importlib.util.spec_from_file_location("_model_util", Path(__file__).with_name("_model_util.py"))
mu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mu)

REPO = mu.REPO
RULES = config_lib.default_config().sharding_rules
ONE_DEVICE = ["--config.devices.num_cpu_devices=1", "--config.mesh.data=1", "--config.mesh.fsdp=1",
              "--config.cells.num_cells=1", "--config.cells.data=1"]  # fmt: skip


def _load(ckpt: Path) -> ModelConfig:
    """What ``build.setup`` does with a checkpoint directory: config, tokenizer against it, then the weights."""
    cfg = read_model_config(ckpt)
    check_fits_model(HFTokenizer.from_dir(ckpt), cfg.vocab_size, str(ckpt / "config.json"))
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), ("data", "fsdp", "tensor", "expert"))
    load_hf_params(ckpt, cfg, mesh, RULES)
    return cfg


@pytest.mark.parametrize("name", [n for n, (_, words) in mu.BAD_INPUTS.items() if words])
def test_a_bad_checkpoint_fails_with_one_line_naming_the_file_and_the_fault(tmp_path, name):
    make, words = mu.BAD_INPUTS[name]
    ckpt = mu.copy_fixture(tmp_path / "ckpt")
    make(ckpt)
    with pytest.raises(ModelInputError) as info:
        _load(ckpt)
    message = str(info.value)
    assert "\n" not in message
    assert str(ckpt) in message  # the directory or the file in it
    for word in words:
        assert word in message, (word, message)


def test_missing_keys_take_transformers_defaults():
    hf = json.loads((mu.FIXTURE / "config.json").read_text())
    dense = {k: v for k, v in hf.items() if k not in ("head_dim", "num_key_value_heads")}
    kw = model_kwargs(dense)
    assert (kw["head_dim"], kw["num_kv_heads"]) == (128, 32)  # Qwen3Config's defaults, not hidden // heads
    assert model_kwargs({**dense, "num_key_value_heads": None})["num_kv_heads"] == 4  # null: num_attention_heads
    moe = {**dense, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 16}  # fmt: skip
    kw = model_kwargs(moe)
    assert (kw["head_dim"], kw["num_kv_heads"]) == (32 // 4, 4)  # Qwen3-MoE: no head_dim field; 4 kv heads
    # an older YaRN spelling: the pre-scaling length is max_position_embeddings, as in transformers
    yarn = {**hf, "rope_parameters": None, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    assert model_kwargs(yarn)["rope_original_max_position"] == hf["max_position_embeddings"] == 512
    no_max = {k: v for k, v in yarn.items() if k != "max_position_embeddings"}
    assert model_kwargs(no_max)["rope_original_max_position"] == 32768  # its default too


def test_the_older_yarn_spelling_loads(tmp_path):
    ckpt = mu.copy_fixture(tmp_path / "ckpt")
    mu.yarn_without_original_max(ckpt)
    cfg = _load(ckpt)
    assert cfg.rope_type == "yarn" and cfg.rope_original_max_position == 512 and cfg.rope_factor == 4.0


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _train(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gyre_jax.train", f"--config.workdir={workdir}", "--config.warm_start.steps=0",
           "--config.eval.samples_per_task=0", "--config.rollout.tasks_per_step=1", "--config.rl.group_size=2",
           "--config.metrics.progress_bar=false", *ONE_DEVICE, *run_time_limits(), *args]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=scaled(300))


def test_through_the_cli_a_tokenizer_larger_than_the_vocabulary_exits_2_with_one_line(tmp_path):
    ckpt = mu.copy_fixture(tmp_path / "ckpt")
    mu.big_tokenizer(ckpt)
    proc = _train(tmp_path / "run", f"--config.model.checkpoint_dir={ckpt}", "--config.tokenizer.kind=hf")
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and str(ckpt / "tokenizer.json") in last, last
    assert "369 token ids" in last and "vocab_size=352" in last
    assert "Traceback" not in proc.stderr and "done:" not in proc.stdout
    assert not (tmp_path / "run" / "checkpoints").exists()  # failed before any work


@pytest.mark.slow
def test_a_run_where_every_execution_is_excluded_stops_with_exit_3(tmp_path):
    """The harness deletes its workspace: the evaluator raises, every execution is excluded (never scored 0)."""
    workdir = tmp_path / "run"
    proc = _train(
        workdir,
        "--config.total_steps=6",
        "--config.rollout.harness=command",
        "--config.rollout.harness_cmd=sh -c 'rm -rf {workspace}'",
        "--config.rl.max_untrained_steps=2",
    )
    assert proc.returncode == EXIT_UNTRAINED == 3, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stopping: 2 consecutive RL steps (1..2) trained nothing: every execution excluded "
                           "(2: evaluator_error 2)"), last  # fmt: skip
    assert "config.rl.max_untrained_steps=2" in last and "done:" not in proc.stdout
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("step ")] == ["1/6", "2/6"]
    results = [json.loads(x) for x in (workdir / "results" / "step_000001.jsonl").read_text().splitlines()]
    assert all(r["excluded"] and r["exclusion_kind"] == "evaluator_error" for r in results) and len(results) == 2
    assert "2" in [p.name for p in (workdir / "checkpoints").iterdir()]  # kept: the same command resumes


def _result(eid: str, excluded: bool, kind: str | None = "evaluator_error") -> ExecutionResult:
    return ExecutionResult(eid, "t", "g", "finished", None if excluded else 0.5, excluded,
                           "evaluator raised ValueError: x" if excluded else None, 0, 1.0, "/w",
                           kind if excluded else None)  # fmt: skip


def test_untrained_steps_count_faults_only_and_reset():
    ok = [_result("a", False), _result("b", True)]
    excluded = [_result("a", True), _result("b", True, "evaluator_timeout")]
    nan = {"skipped": 1.0, "loss": math.nan, "grad_norm": math.nan}
    assert untrained_reason(ok, {}) is None  # some executions scored: not a fault
    assert untrained_reason(excluded, {"optimizer_skipped": 1}).startswith("every execution excluded (2: ")
    assert untrained_reason(ok, nan).startswith("optimizer step skipped for a non-finite loss")
    assert "non-finite gradients" in untrained_reason(ok, {"skipped": 1.0, "loss": 0.1, "grad_norm": math.inf})
    guard = UntrainedSteps(3)
    assert guard.observe(0, excluded, {}) is None and guard.observe(1, ok, nan) is None
    assert guard.observe(2, ok, {"skipped": 0.0, "loss": 0.1}) is None  # trained: the count starts over
    assert guard.observe(3, ok, nan) is None and guard.observe(4, ok, nan) is None
    line = guard.observe(5, excluded, {})
    assert line.startswith("stopping: 3 consecutive RL steps (4..6) trained nothing: optimizer step skipped for a "
                           "non-finite loss (loss nan, grad norm nan); every execution excluded (2: ")  # fmt: skip
    off = UntrainedSteps(0)
    assert all(off.observe(i, excluded, {}) is None for i in range(10)) and off.at_end(10) is None
    short = UntrainedSteps(3)  # a run shorter than the limit that never trained still ends non-zero
    short.observe(0, excluded, {})
    assert short.at_end(1).startswith("the run ended, but: 1 consecutive RL steps (1..1)") and short.at_end(2) is None


def test_max_untrained_steps_is_validated():
    with pytest.raises(config_lib.ConfigError, match="config.rl.max_untrained_steps=-1 must be >= 0"):
        config_lib.load_config(["--config.rl.max_untrained_steps=-1"])
    assert config_lib.default_config().rl.max_untrained_steps == 3
