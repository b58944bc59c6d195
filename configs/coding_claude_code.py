"""Real coding tasks through Claude Code: configs/coding_cpu.py with the Claude Code CLI as the harness.

Run: python -m gyre_jax.train --config configs/coding_claude_code.py [--config.total_steps=2 ...]
Needs the Claude Code CLI on PATH (`npm install -g @anthropic-ai/claude-code@2.1.332`, the pinned version; the
run fails at start naming this command when it is missing) and bubblewrap, as coding_cpu.py.

Claude Code runs unmodified in print mode against the proxy's Anthropic Messages API, inside bwrap (its state
under the execution's own home). Its default request is about 49 KB (a long system prompt and 12 tool
schemas); the tiny byte-level model here reads 4K tokens, so this config runs it with the small command of the
claude-code preset (`harnesses.CLAUDE_CODE_SMALL_CMD`: `--bare`, the Bash, Read and Edit tools, a one-line
system prompt; about 800 prompt tokens with the compact tool format, measured in docs/harnesses.md). With a
real model and tokenizer, drop `harness_cmd` to run Claude Code's full default.
"""

from pathlib import Path

from gyre_jax import config as config_lib
from gyre_jax.rollout.harnesses import CLAUDE_CODE_SMALL_CMD


def get_config():
    c = config_lib.base_config(Path(__file__).with_name("coding_cpu.py"))
    c.workdir = "runs/coding_claude_code"
    c.rollout.harness = "claude-code"
    c.rollout.harness_cmd = CLAUDE_CODE_SMALL_CMD
    c.rollout.max_turns = 3  # Claude Code's --max-turns
    return c
