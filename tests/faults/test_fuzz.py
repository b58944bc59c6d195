"""Issue 19 item 5: the proxy under fuzzed input. schemathesis against the proxy's own OpenAPI document (every
endpoint, with the execution's key and without), hypothesis message lists / tool schemas with UTF-8 edge cases,
and hand-made hostile bodies (lone surrogates, NULs, huge numbers, 100000 nested arrays, invalid UTF-8, huge
strings): every answer is a 2xx or a 4xx in the route's own error style, the server keeps serving, every record
parses. The long version is benchmarks/faults/fuzz.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, given, settings
from timelimits import scaled

sys.path.insert(0, str(Path(__file__).parent))
import _fuzz_util as fu  # noqa: E402

from gyre_jax.proxy.adapters.anthropic_messages import CountTokensRequest, MessagesRequest  # noqa: E402
from gyre_jax.proxy.adapters.openai_chat import ChatCompletionRequest  # noqa: E402

ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")


@pytest.fixture()
def live(tmp_path):
    with fu.live_proxy(tmp_path) as live:
        yield live


def assert_api_error(path: str, response: httpx.Response, status: int | tuple[int, ...]) -> str:
    """The response is ``status`` with an error body in ``path``'s API style; returns its message."""
    assert response.status_code in ((status,) if isinstance(status, int) else status), response.text
    body = response.json()
    if path in ANTHROPIC:
        assert body["type"] == "error" and isinstance(body["error"]["message"], str), body
        return body["error"]["message"]
    assert isinstance(body["error"]["message"], str) and "type" in body["error"], body
    return body["error"]["message"]


def test_openapi_document_lists_every_mounted_route_with_the_adapters_fields(live):
    document = httpx.get(live.root + "/openapi.json").json()
    assert document["openapi"].startswith("3.")
    mounted = {(m.lower(), r.path) for r in live.server.app.routes if isinstance(r, APIRoute) for m in r.methods}
    documented = {(m, p) for p, ops in document["paths"].items() for m in ops}
    assert mounted == documented  # nothing served undocumented, nothing documented unserved
    schemas = document["components"]["schemas"]
    for path, model in [("/v1/chat/completions", ChatCompletionRequest), ("/v1/messages", MessagesRequest),
                        ("/v1/messages/count_tokens", CountTokensRequest)]:  # fmt: skip
        ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        properties = schemas[ref.rsplit("/", 1)[1]]["properties"]
        assert set(properties) == set(model.model_fields), path  # the fields the adapter reads
        assert properties["model"] == {"type": "string", "enum": [fu.MODEL]}
        assert schemas[ref.rsplit("/", 1)[1]].get("additionalProperties", True) is True  # unknown fields allowed
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert {"200", "400", "401", "404", "409", "413", "429", "503"} <= set(chat["responses"])
    assert chat["security"] == [{"bearer": []}, {"apiKey": []}]
    assert document["components"]["securitySchemes"]["apiKey"] == {
        "type": "apiKey",
        "in": "header",
        "name": "x-api-key",
    }
    assert document["paths"]["/health"]["get"]["security"] == []


def test_schemathesis_finds_no_5xx_and_every_answer_is_documented(live):
    tally = fu.Tally()
    fu.schemathesis_fuzz(live, examples=3, seed=0, tally=tally)
    assert tally.cases >= 30
    assert tally.server_errors == []
    assert tally.nonconforming == []
    assert tally.statuses[401] >= tally.cases // 2  # keyless calls of keyed routes (each checked to be a 401)
    assert fu.check_alive_and_records(live) >= 1


@pytest.mark.parametrize("name", sorted(fu.HOSTILE))
def test_hostile_bodies_are_a_4xx_in_each_apis_style_and_the_server_goes_on(live, name):
    body, status = fu.HOSTILE[name]
    for path in fu.POST_PATHS:
        r = httpx.post(live.root + path, content=body, headers=live.headers("e0"), timeout=scaled(60))
        message = assert_api_error(path, r, status)
        assert "internal error" not in message
    assert fu.check_alive_and_records(live) >= 1


ACCEPTED = {  # valid JSON the proxy must serve: numbers past float/int64, NULs, paired surrogates, a huge string
    "1e400 and 10**400": '{"model": "gyre-tiny", "max_tokens": 1'
    + "0" * 400
    + ', "seed": 1'
    + "0" * 400
    + ', "messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {"name": "f", '
    '"parameters": {"x": 1e400}}}]}',
    "NUL and a paired surrogate": json.dumps(
        {"model": "gyre-tiny", "messages": [{"role": "user", "content": "a\x00b \U0001f600 \u2028"}]}
    ),
    "a string just under the limit": json.dumps(
        {"model": "gyre-tiny", "messages": [{"role": "user", "content": "\u00e9\u4e2d" * 20_000}]}, ensure_ascii=False
    ),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_edge_values_that_are_valid_json_are_served_and_recorded(live, name):
    before = live.store.count("e0")
    r = httpx.post(live.root + "/v1/chat/completions", content=ACCEPTED[name].encode(), headers=live.headers("e0"),
                   timeout=scaled(60))  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "tool_calls")
    assert live.store.count("e0") == before + 1
    assert fu.check_alive_and_records(live) == before + 2


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(drawn=fu.BODY)
def test_generated_messages_and_tools_never_get_a_5xx(shared_live, drawn):
    path, data = fu.generated_body(drawn)
    r = httpx.post(shared_live.root + path, content=data, headers=shared_live.headers("e0"), timeout=scaled(60))
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert_api_error(path, r, r.status_code)


@pytest.fixture(scope="module")
def shared_live(tmp_path_factory):
    with fu.live_proxy(tmp_path_factory.mktemp("fuzz")) as live:
        yield live
    # after every generated case: still serving, records intact (checked in the next test)


def test_after_generated_traffic_the_server_serves_and_every_record_parses(shared_live):
    assert fu.check_alive_and_records(shared_live) >= 1
    assert not [line for line in shared_live.logs if "unexpected error" in line or "Traceback" in line]


@pytest.mark.parametrize(("method", "path", "allow"), [("TRACE", "/v1/models", "GET"), ("DELETE", "/v1/messages", "POST"),
                                                       ("PUT", "/v1/chat/completions", "POST")])  # fmt: skip
def test_an_undeclared_method_is_a_405_naming_the_allowed_ones(live, method, path, allow):
    r = httpx.request(method, live.root + path, headers=live.headers("e0"))
    assert r.status_code == 405 and r.headers["allow"] == allow  # RFC 9110; found by schemathesis' ST204
    assert "Method Not Allowed" in assert_api_error(path, r, 405)
