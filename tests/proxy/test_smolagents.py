"""smolagents (CodeAgent and ToolCallingAgent, unmodified) against the real proxy with a scripted model: both reach
their final answer through ``stop`` and ``tool_choice="required"``, every continuing call reuses the previous
ids although smolagents re-sends the model's turn changed, and the records load in the trainer's reader."""

from __future__ import annotations

import pytest

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.trajectory.pipeline import LoadExecution, SelectBranches, TrajectoryConfig
from gyre_jax.trajectory.queue import QueuedExecution

smolagents = pytest.importorskip("smolagents")

TOK = ByteTokenizer()


@smolagents.tool
def get_weather(city: str) -> str:
    """The weather of a city.

    Args:
        city: the city
    """
    return f"sunny in {city}"


def code_script(request) -> str:
    """CodeAgent: look the weather up, then answer (smolagents cuts at its stop strings, e.g. "</code>")."""
    if "sunny in Paris" in TOK.decode(request.prompt_ids):
        return "Thought: done.\n<code>\nfinal_answer('sunny')\n</code>\nObservation: (never seen)"
    return "Thought: look.\n<code>\nprint(get_weather('Paris'))\n</code>\nObservation: (never seen)"


def tool_script(request) -> str:
    """ToolCallingAgent: the rest of a call after the forced opener ``<tool_call>\\n{"name": "``."""
    if "sunny in Paris" in TOK.decode(request.prompt_ids):
        return 'final_answer", "arguments": {"answer": "sunny"}}\n</tool_call>'
    return 'get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("kind", ["CodeAgent", "ToolCallingAgent"])
def test_smolagents_runs_to_its_answer_with_reuse(make_stack, kind) -> None:
    script = code_script if kind == "CodeAgent" else tool_script
    with make_stack(script) as stack:
        stack.backend.max_context = 64_000  # smolagents' system prompts are long in bytes
        model = smolagents.OpenAIServerModel(model_id="gyre-tiny", api_base=stack.server.base_url,
                                             api_key=stack.key(kind))  # fmt: skip
        agent = getattr(smolagents, kind)(tools=[get_weather], model=model, max_steps=4, verbosity_level=0)
        assert str(agent.run("What is the weather in Paris?")) == "sunny"
        first, second = stack.store.read(kind)
        assert first.client_sampling["stop"] and second.reused_prefix_len > 0.9 * len(first.prompt_ids)
        assert first.thread_id == second.thread_id == "main"  # the re-sent turn continues the agent's conversation
        if kind == "CodeAgent":  # the turn re-sent with "</code>" appended: the completion's ids are reused too
            assert second.reused_prefix_len == len(first.prompt_ids) + len(first.completion_ids)
        else:
            assert first.client_sampling["tool_choice"] == "required"
        config = TrajectoryConfig(vocab_size=TOK.vocab_size, message_end_id=TOK.token_id("<|im_end|>"))
        loaded = LoadExecution(stack.store.root, config).map(QueuedExecution(0, kind, 0, 1.0, 1.0, True))
        assert loaded.excluded is None and SelectBranches(config).map(loaded).excluded is None
