"""The proxy's own OpenAPI 3.1 document, served at ``GET /openapi.json``.

Built from what the server mounts (``ProxyServer`` registers one ``Operation`` per route it serves, so the
document cannot drift from the routes) and from the adapters' own pydantic request schemas (the fields each
adapter reads, with their types and bounds; unknown fields allowed, as the adapters ignore them). Errors are
documented in the style of the route's API: ``{"error": {...}}`` (OpenAI) or ``{"type": "error", "error":
{...}}`` (Anthropic), see ``errors.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pydantic
from pydantic.json_schema import models_json_schema

from gyre_jax.proxy.errors import Api
from gyre_jax.proxy.identity import THREAD_HEADERS

OPENAPI_VERSION = "3.1.0"
SECURITY = [{"bearer": []}, {"apiKey": []}]  # either header names the execution's key

ERROR_STATUSES = {  # status -> what it means on this proxy (the description of every response that can carry it)
    400: "bad input: invalid JSON, a field of the wrong type or value, an unsupported feature, a prompt too long",
    401: "missing or unknown API key",
    404: "the request names a model this proxy does not serve",
    409: "the key's execution has ended",
    413: "the request body is larger than the proxy's max_request_bytes",
    429: "refused by admission control (too many calls); retry after the Retry-After header",
    503: "refused: the proxy or its backend is overloaded or shutting down; retry after the Retry-After header",
}
SSE_EVENT = {  # one server-sent event (its data a JSON document or "[DONE]"); keep-alives are comments or pings
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer"}},
}  # fmt: skip
AUTH_STATUSES = (401, 409)
BODY_STATUSES = (400, 404, 413, 429, 503)


@dataclass(frozen=True)
class Operation:
    """One route the proxy serves: ``method`` ("get" | "post"), ``path``, the pydantic model of its JSON body
    (None: no body), the error ``style`` of its API, whether it needs the execution's key (``auth``), whether it
    may answer an SSE stream (``streams``) and its optional query flags (``query``, e.g. ``("beta",)``)."""

    method: str
    path: str
    summary: str
    request: type[pydantic.BaseModel] | None = None
    style: Api = "openai"
    auth: bool = True
    streams: bool = False
    query: tuple[str, ...] = ()


def _error_schemas() -> dict[str, Any]:
    nullable = {"anyOf": [{"type": "string"}, {"type": "null"}]}
    openai = {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": nullable,
                    "code": nullable,
                },  # fmt: skip
            }
        },
    }
    anthropic = {
        "type": "object",
        "required": ["type", "error"],
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            },
        },
    }
    return {"OpenAIError": openai, "AnthropicError": anthropic}


def _responses(op: Operation) -> dict[str, Any]:
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if op.streams:
        ok["text/event-stream"] = {"schema": SSE_EVENT}
    responses: dict[str, Any] = {"200": {"description": "success", "content": ok}}
    statuses = (AUTH_STATUSES if op.auth else ()) + (BODY_STATUSES if op.request is not None else ())
    ref = {"$ref": "#/components/schemas/" + ("AnthropicError" if op.style == "anthropic" else "OpenAIError")}
    for status in sorted(statuses):
        responses[str(status)] = {
            "description": ERROR_STATUSES[status],
            "content": {"application/json": {"schema": ref}},
        }
    return responses


def _parameters(op: Operation) -> list[dict[str, Any]]:
    params = [{"name": q, "in": "query", "required": False, "schema": {"type": "string"}} for q in op.query]
    if op.request is not None:  # a model call: the thread it belongs to (identity.thread_base)
        params += [{"name": h, "in": "header", "required": False, "schema": {"type": "string"}} for h in THREAD_HEADERS]
    return params


def document(operations: Sequence[Operation], model_name: str, title: str = "gyre-jax proxy") -> dict[str, Any]:
    """The OpenAPI document (a JSON-able dict) of ``operations``; request bodies are the adapters' schemas, their
    nested models under ``components/schemas``, with ``model`` the one name this proxy serves (any other is 404)."""
    models = sorted({op.request for op in operations if op.request is not None}, key=lambda m: m.__name__)
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    schemas = {**defs.get("$defs", {}), **_error_schemas()}
    for model in models:
        if "model" in schemas[model.__name__].get("properties", {}):
            schemas[model.__name__]["properties"]["model"] = {"type": "string", "enum": [model_name]}
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        entry: dict[str, Any] = {"summary": op.summary, "operationId": f"{op.method}{op.path.replace('/', '_')}",
                                 "responses": _responses(op), "security": SECURITY if op.auth else []}  # fmt: skip
        if _parameters(op):
            entry["parameters"] = _parameters(op)
        if op.request is not None:
            schema = refs[(op.request, "validation")]
            entry["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
        paths.setdefault(op.path, {})[op.method] = entry
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": "1"},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "the key issued to the execution"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
    }
