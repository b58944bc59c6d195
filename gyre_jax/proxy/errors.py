"""Errors the proxy answers to a client: one exception type, rendered as an OpenAI or an Anthropic error body.

OpenAI form: ``{"error": {"message", "type", "param", "code"}}``. Anthropic form:
``{"type": "error", "error": {"type", "message"}}`` (the type follows the HTTP status, see
``ANTHROPIC_ERROR_TYPES``). Every message says what was wrong and what to do.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from fastapi.responses import JSONResponse

Api = Literal["openai", "anthropic"]  # the error body style a client understands

ANTHROPIC_ERROR_TYPES = {  # HTTP status -> Anthropic error type
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


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
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.error_type = error_type
        self.headers = headers  # extra response headers (``Retry-After`` of a 429 / 503)

    def body(self, api: Api = "openai") -> dict[str, Any]:
        if api == "anthropic":
            default = "api_error" if self.status >= 500 else "invalid_request_error"
            return {
                "type": "error",
                "error": {"type": ANTHROPIC_ERROR_TYPES.get(self.status, default), "message": self.message},
            }
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def response(self, api: Api = "openai") -> JSONResponse:
        return JSONResponse(self.body(api), status_code=self.status, headers=self.headers)


def internal_error() -> ProxyError:
    return ProxyError(
        500,
        "internal error in the proxy while serving this call; the call was not recorded. Retry it; if it "
        "repeats, the traceback is in the proxy's log.",
        error_type="server_error",
        code="internal_error",
    )


def execution_ended(execution_id: str, detail: str = "has ended") -> ProxyError:
    """409 for a call of an execution that ``close_execution`` ended (``detail`` says when)."""
    return ProxyError(409, f"execution {execution_id!r} {detail}", code="execution_ended")


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
