"""Real coding tasks on CPU: the tiny model, mini-swe-agent in a bubblewrap sandbox, the bundled pyrepo suite.

Run: python -m gyre_jax.train --config configs/coding_cpu.py [--config.total_steps=2 ...]
Needs Debian's bubblewrap (`apt-get install -y bubblewrap`; `sh scripts/install_system_deps.sh` does it as
root) and mini-swe-agent (`pip install mini-swe-agent==2.4.6`, in the test extras); the run fails at start
naming the command when either is missing.

Each execution copies a task's starting files (suites/pyrepo/<task>/environment) into a fresh workspace,
runs mini-swe-agent on it inside bwrap (read-only system, its own /app, /tmp and PID namespace, no network but
the proxy), then runs the task's hidden tests in a fresh sandbox: the reward is the fraction that pass. The
tiny random model scores about 0: the point is the whole path (harness, sandbox, records, verifier, GSPO
step, checkpoint). Prompts are bytes (the byte tokenizer): mini-swe-agent's compact templates and a context
of 4K tokens keep one call on CPU to seconds.
"""

from pathlib import Path

from gyre_jax import config as config_lib

SUITE = Path(__file__).resolve().parents[1] / "suites" / "pyrepo"


def get_config():
    c = config_lib.base_config(Path(__file__).with_name("tiny_cpu.py"))
    c.workdir = "runs/coding_cpu"
    c.total_steps = 10
    # Two cells of one device each: this model is tiny, and on a 2-core machine more virtual devices only add
    # per-device overhead (and a compile per device set).
    c.devices.num_cpu_devices = 2
    c.mesh.data, c.mesh.fsdp = 2, 1
    c.cells.data, c.cells.num_cells = 1, 2
    c.rollout.suite = f"harbor:{SUITE}"
    c.rollout.heldout_fraction = 0.25  # 6 of the 24 tasks, for evaluation
    c.rollout.harness = "mini-swe-agent"
    c.rollout.sandbox = "bwrap"
    c.rollout.tasks_per_step = 2
    c.rollout.max_turns = 3  # mini-swe-agent's step limit
    c.rollout.max_tokens_per_call = 64
    c.rl.group_size = 2
    c.warm_start.steps = 0  # no demonstrations for these tasks
    c.eval.split = "heldout"
    c.eval.num_tasks = 2
    c.eval.samples_per_task = 1
    # The context: 4K tokens (serving.max_seq_len, trajectory.row_length and tokens_per_micro_batch derive from it;
    # attention stays the dense-mask "xla" kernel up to 4K). mini-swe-agent's first prompt with the preset's config
    # is 941 tokens of this byte tokenizer (docs/harnesses.md). A call whose prompt is longer (the longest
    # instructions, after a few turns) is refused by the proxy in OpenAI's own words (mini-swe-agent, through
    # litellm, sees a ContextWindowExceededError) and the harness ends there: its execution is still verified and
    # scored. 4K is the longest a dense-mask training row fits in this machine's memory (about 6 GB; 8K runs out);
    # a larger model.max_context switches to the blockwise kernel, whose memory grows linearly.
    c.model.max_context = 4096
    c.serving.max_prefill_length = 512
    c.serving.prefill_buckets = (256, 512)
    c.serving.max_concurrent_decodes = 8
    c.serving.kv_pages = 1024
    return c
