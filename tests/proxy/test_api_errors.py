"""Errors as the real APIs word them: a context overflow, a rate limit and a bad request, through the real ``openai``
and ``anthropic`` SDKs and litellm's exception mapping (what OpenHands, mini-swe-agent and aider see), on every API the
proxy serves. A harness compacts its history only on an overflow it recognises: these tests pin that each client
library maps the proxy's overflow to its own context-window exception, and its 429 to its rate-limit exception.

Also: the refused calls are counted per execution, by why (``ProxyServer.execution_refusals``)."""

from __future__ import annotations

import os

import anthropic
import httpx
import openai
import pytest

from gyre_jax.proxy.errors import ContextOverflow

MAX_CONTEXT = 4096  # the scripted backend's (tests/proxy/conftest.py)
LONG = "x" * (MAX_CONTEXT + 100)  # a byte-tokenizer prompt over the context

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no fetch of its model list at import


@pytest.fixture()
def stack(make_stack):
    with make_stack(lambda request: "ok", max_active_calls=1, max_queued_calls=0) as s:
        yield s


def test_context_overflow_wording_per_api() -> None:
    err = ContextOverflow(5000, 4096)
    assert err.message_for("chat") == (
        "This model's maximum context length is 4096 tokens. However, your messages resulted in 5000 tokens. "
        "Please reduce the length of the messages."
    )
    assert err.message_for("messages") == "prompt is too long: 5000 tokens > 4095 maximum"
    assert err.message_for("responses").startswith("Your input exceeds the context window of this model.")
    assert "your prompt resulted in 5000 tokens" in err.message_for("completions")
    assert err.body("openai", "chat")["error"] == {
        "message": err.message_for("chat"),
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    assert err.body("openai", "responses")["error"]["param"] == "input"
    assert err.body("anthropic", "messages") == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "prompt is too long: 5000 tokens > 4095 maximum"},
    }


def test_openai_sdk_overflow_rate_limit_and_bad_request(stack) -> None:
    key = stack.key("e-openai")
    client = openai.OpenAI(base_url=stack.server.base_url, api_key=key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="gyre-tiny", messages=[{"role": "user", "content": LONG}])
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    assert "This model's maximum context length is 4096 tokens" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="gyre-tiny", prompt=LONG)
    assert info.value.code == "context_length_exceeded" and "your prompt resulted in" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="gyre-tiny", input=LONG)
    assert info.value.code == "context_length_exceeded" and info.value.param == "input"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="gyre-tiny", messages=[{"role": "user", "content": "hi"}], temperature=9)
    assert info.value.code is None and "temperature" in info.value.message
    assert stack.server.execution_refusals("e-openai") == {"context": 3, "admission": 0, "bad_request": 1}
    # a call that fits is served (the server keeps serving), and not counted as refused
    reply = client.chat.completions.create(model="gyre-tiny", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "ok"
    assert stack.server.execution_refusals("e-openai")["context"] == 3


def test_anthropic_sdk_overflow_maps_to_prompt_too_long(stack) -> None:
    key = stack.key("e-anthropic")
    client = anthropic.Anthropic(base_url=stack.server.anthropic_base_url, api_key=key, max_retries=0)
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model="gyre-tiny", max_tokens=16, messages=[{"role": "user", "content": LONG}],
                                   stream=stream)  # fmt: skip
        body = info.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        prompt = int(body["error"]["message"].split()[4])
        assert body["error"]["message"] == f"prompt is too long: {prompt} tokens > {MAX_CONTEXT - 1} maximum"
        assert prompt > MAX_CONTEXT
    assert stack.server.execution_refusals("e-anthropic") == {"context": 2, "admission": 0, "bad_request": 0}


def test_rate_limit_429_maps_to_each_sdks_rate_limit_error(stack) -> None:
    """One call in flight at most and no queue: a second call at once is refused with 429 + Retry-After."""
    import threading

    key = stack.key("e-429")
    hold, release = threading.Event(), threading.Event()
    stack.backend.script = lambda request: (hold.set(), release.wait(30), "slow")[-1]
    first = threading.Thread(
        target=lambda: httpx.post(f"{stack.server.base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"model": "gyre-tiny", "messages": [{"role": "user", "content": "a"}]}, timeout=60)
    )  # fmt: skip
    first.start()
    try:
        assert hold.wait(30)
        client = openai.OpenAI(base_url=stack.server.base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model="gyre-tiny", messages=[{"role": "user", "content": "b"}])
        assert info.value.code == "rate_limit_exceeded" and info.value.type == "requests"
        assert "Rate limit reached for gyre-tiny" in info.value.message
        assert info.value.response.headers["retry-after"] == "1"
        claude = anthropic.Anthropic(base_url=stack.server.anthropic_base_url, api_key=key, max_retries=0)
        with pytest.raises(anthropic.RateLimitError) as ainfo:
            claude.messages.create(model="gyre-tiny", max_tokens=8, messages=[{"role": "user", "content": "c"}])
        assert ainfo.value.body["error"]["type"] == "rate_limit_error"
        litellm = pytest.importorskip("litellm")
        with pytest.raises(litellm.RateLimitError):
            litellm.completion(model="openai/gyre-tiny", api_base=stack.server.base_url, api_key=key, num_retries=0,
                               messages=[{"role": "user", "content": "d"}])  # fmt: skip
    finally:
        release.set()
        first.join(60)
    assert stack.server.execution_refusals("e-429") == {"context": 0, "admission": 3, "bad_request": 0}


def test_litellm_maps_each_apis_overflow_to_context_window_exceeded(stack) -> None:
    """litellm decides ``ContextWindowExceededError`` from the error text (exception_mapping_utils): OpenHands
    condenses its history, mini-swe-agent and aider stop cleanly, only on that exception."""
    litellm = pytest.importorskip("litellm")
    key = stack.key("e-litellm")
    base, messages = stack.server.base_url, [{"role": "user", "content": LONG}]
    with pytest.raises(litellm.ContextWindowExceededError):  # OpenAI chat
        litellm.completion(model="openai/gyre-tiny", api_base=base, api_key=key, messages=messages, num_retries=0)
    with pytest.raises(litellm.ContextWindowExceededError):  # OpenAI chat, streamed
        for _ in litellm.completion(model="openai/gyre-tiny", api_base=base, api_key=key, messages=messages,
                                    num_retries=0, stream=True):  # fmt: skip
            pass
    with pytest.raises(litellm.ContextWindowExceededError):  # OpenAI completions
        litellm.text_completion(model="text-completion-openai/gyre-tiny", api_base=base, api_key=key, prompt=LONG,
                                num_retries=0)  # fmt: skip
    with pytest.raises(litellm.ContextWindowExceededError):  # OpenAI Responses
        litellm.responses(model="openai/gyre-tiny", api_base=base, api_key=key, input=LONG, num_retries=0)
    with pytest.raises(litellm.ContextWindowExceededError):  # Anthropic Messages
        litellm.completion(model="anthropic/gyre-tiny", api_base=stack.server.anthropic_base_url, api_key=key,
                           messages=messages, max_tokens=16, num_retries=0)  # fmt: skip
    # a bad request that is no overflow stays a plain BadRequestError (never misread as an overflow)
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.completion(model="openai/gyre-tiny", api_base=base, api_key=key, temperature=9, num_retries=0,
                           messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert not isinstance(info.value, litellm.ContextWindowExceededError)
    refused = stack.server.execution_refusals("e-litellm")
    assert refused["context"] == 5 and refused["bad_request"] == 1
