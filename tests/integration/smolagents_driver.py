"""Runs one smolagents agent (unmodified, PyPI) on a task against an OpenAI-compatible server: the harness
command of ``test_clis.py``'s smolagents tests.

    python smolagents_driver.py {code|tool} MODEL "TASK" LOG.jsonl [--max-steps N] [--max-tokens N]

The server and key come from ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (set by the executor). Each model
call's reply, as smolagents received it (``ChatMessage``: content, tool calls, completion tokens), is
appended to ``LOG.jsonl`` before the agent acts on it, so a test can compare it with the proxy's records.
Exits 0 when ``agent.run`` returns (after a final answer, or after ``--max-steps`` steps and the final
answer smolagents then asks for).
"""

from __future__ import annotations

import argparse
import json
import os

from smolagents import CodeAgent, OpenAIModel, ToolCallingAgent


class LoggingModel(OpenAIModel):
    """``OpenAIModel`` that appends every reply it hands the agent to a JSON-lines file."""

    def __init__(self, log_path: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.log_path = log_path

    def generate(self, messages, stop_sequences=None, response_format=None, tools_to_call_from=None, **kwargs):
        message = super().generate(messages, stop_sequences, response_format, tools_to_call_from, **kwargs)
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
        usage = getattr(message.raw, "usage", None)
        entry = {"content": message.content, "tool_calls": calls, "stop_sequences": stop_sequences,
                 "completion_tokens": getattr(usage, "completion_tokens", None)}  # fmt: skip
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        return message


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("agent", choices=("code", "tool"))
    parser.add_argument("model")
    parser.add_argument("task")
    parser.add_argument("log")
    parser.add_argument("--max-steps", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    model = LoggingModel(args.log, model_id=args.model, api_base=os.environ["OPENAI_BASE_URL"],
                         api_key=os.environ["OPENAI_API_KEY"], max_tokens=args.max_tokens)  # fmt: skip
    agent_cls = CodeAgent if args.agent == "code" else ToolCallingAgent
    agent = agent_cls(tools=[], model=model, max_steps=args.max_steps, verbosity_level=1)
    answer = agent.run(args.task)
    print(f"FINAL ANSWER: {answer!r}")


if __name__ == "__main__":
    main()
