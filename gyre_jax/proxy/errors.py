"""Errors the proxy answers to a client: one exception type, rendered as an OpenAI or an Anthropic error body.

OpenAI form: ``{"error": {"message", "type", "param", "code"}}``. Anthropic form:
``{"type": "error", "error": {"type", "message"}}`` (the type follows the HTTP status, see
``anthropic_api.ERROR_TYPES``). Every message says what was wrong and what to do.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from fastapi.responses import JSONResponse

from gyre_jax.proxy import anthropic_api

Api = Literal["openai", "anthropic"]


class ProxyError(Exception):
    """An error answered to the client with HTTP ``status`` and an error body in the client's API style."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        error_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.error_type = error_type

    def body(self, api: Api = "openai") -> dict[str, Any]:
        if api == "anthropic":
            return anthropic_api.error_body(self.status, self.message)
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def response(self, api: Api = "openai") -> JSONResponse:
        return JSONResponse(self.body(api), status_code=self.status)


def internal_error() -> ProxyError:
    return ProxyError(
        500,
        "internal error in the proxy while serving this call; the call was not recorded. Retry it; if it "
        "repeats, the traceback is in the proxy's log.",
        error_type="server_error",
        code="internal_error",
    )


def validation_error(exc: pydantic.ValidationError, what: str, docs: str) -> ProxyError:
    """400 naming the first few invalid fields, e.g. ``temperature: Input should be a valid number``."""
    errors = exc.errors(include_url=False)
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    param = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
    return ProxyError(400, f"invalid {what}: " + "; ".join(parts) + more + f". See {docs}.", param=param)
