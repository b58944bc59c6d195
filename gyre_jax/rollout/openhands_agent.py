"""A headless OpenHands agent, the ``openhands`` harness preset's program (written to each execution's directory).

It runs in its own virtual environment with ``openhands-sdk`` and ``openhands-tools`` (the pinned release of
``harnesses.OPENHANDS_SDK_VERSION``; both need Python >= 3.12), never in gyre-jax's: gyre-jax only writes this file
and runs it. The file is a template like every preset file: it holds no braces. The agent is the SDK's default CLI agent (terminal, file editor and task tracker tools, the default
summarizing condenser) on the task's instruction, in the current directory (the workspace), talking to the proxy
through litellm's OpenAI chat provider (``--model openai/NAME``, ``--base-url``; the key is ``OPENAI_API_KEY``).
A context overflow reaches it worded as OpenAI words it, so litellm raises ``ContextWindowExceededError`` and the
agent condenses its history and goes on (docs/proxy.md, "Errors as the real APIs word them").

Exit status: 0 when the conversation ends (finished or out of iterations), 1 on an error.

Usage: python openhands_agent.py --model openai/NAME --base-url URL --instruction-file FILE
       [--max-iterations N] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="litellm model name, e.g. openai/gyre-tiny")
    parser.add_argument("--base-url", required=True, help="the proxy's OpenAI base URL")
    parser.add_argument("--instruction-file", required=True)
    parser.add_argument("--max-iterations", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=0, help="completion budget per call (0: the server's)")
    args = parser.parse_args(argv)
    if sys.version_info < (3, 12):
        version = sys.version.split()[0]
        print("openhands-sdk needs Python >= 3.12; this is " + version + " (" + sys.executable + ")", file=sys.stderr)
        return 1
    from openhands.sdk import LLM, Conversation
    from openhands.tools.preset.default import get_default_agent

    with open(args.instruction_file, encoding="utf-8") as f:
        instruction = f.read()
    llm = LLM(
        model=args.model,
        base_url=args.base_url,
        api_key=os.environ["OPENAI_API_KEY"],
        usage_id="agent",
        num_retries=2,
        max_output_tokens=args.max_tokens or None,
    )
    agent = get_default_agent(llm=llm, cli_mode=True)
    conversation = Conversation(agent=agent, workspace=os.getcwd(), max_iteration_per_run=args.max_iterations)
    conversation.send_message(instruction)
    conversation.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
