"""Errors the proxy answers to a client: one exception type, rendered as an OpenAI or an Anthropic error body.

OpenAI form: ``{"error": {"message", "type", "param", "code"}}``. Anthropic form:
``{"type": "error", "error": {"type", "message"}}`` (the type follows the HTTP status, see
``ANTHROPIC_ERROR_TYPES``). Every message says what was wrong and what to do.

The errors a harness acts on are worded as the real APIs word them, because SDKs and litellm (OpenHands,
mini-swe-agent, aider ...) recognise them by status, type, code and message text, and harnesses compact their
history only on a context overflow they recognise (docs/proxy.md, "Errors as the real APIs word them"):

- a prompt over the context (``ContextOverflow``, 400): OpenAI chat "This model's maximum context length is N
  tokens. However, your messages resulted in M tokens. ..." with code ``context_length_exceeded`` (completions:
  "your prompt"; Responses: "Your input exceeds the context window of this model. ..." first); Anthropic
  ``invalid_request_error`` "prompt is too long: M tokens > N maximum" (what Claude Code parses to compact);
- too many calls at once (``rate_limited``, 429 + ``Retry-After``): OpenAI type ``requests``, code
  ``rate_limit_exceeded``, "Rate limit reached for ..."; Anthropic ``rate_limit_error``;
- any other bad request: 400 ``invalid_request_error`` in both.

``REFUSAL_KINDS`` names why a model call was refused, for the per-execution counts (``refusal_kind``).
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from fastapi.responses import JSONResponse

Api = Literal["openai", "anthropic"]  # the error body style a client understands
Endpoint = Literal["chat", "completions", "responses", "messages"]  # the API a call came through (TurnRequest.api)
# Why a model call of an execution was refused (``refusal_kind``): its prompt is over the context, the proxy's
# admission was full (429), or anything else the client sent wrong (4xx).
REFUSAL_KINDS = ("context", "admission", "bad_request")

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

    def message_for(self, endpoint: Endpoint | None = None) -> str:
        """The message as the API of ``endpoint`` words it (the same for every API unless a subclass says)."""
        return self.message

    def param_for(self, endpoint: Endpoint | None = None) -> str | None:
        return self.param

    def body(self, api: Api = "openai", endpoint: Endpoint | None = None) -> dict[str, Any]:
        """The error body in ``api``'s style, worded for ``endpoint`` (None: the generic wording)."""
        message = self.message_for(endpoint)
        if api == "anthropic":
            default = "api_error" if self.status >= 500 else "invalid_request_error"
            return {
                "type": "error",
                "error": {"type": ANTHROPIC_ERROR_TYPES.get(self.status, default), "message": message},
            }
        param = self.param_for(endpoint)
        return {"error": {"message": message, "type": self.error_type, "param": param, "code": self.code}}

    def response(self, api: Api = "openai") -> JSONResponse:
        return JSONResponse(self.body(api), status_code=self.status, headers=self.headers)


class ContextOverflow(ProxyError):
    """400: a prompt of ``prompt_tokens`` does not fit the model's context of ``max_context`` tokens (a prompt needs
    room for one completion token: at most ``max_context - 1``), worded per API (module docstring); ``detail`` says
    more when a serving backend refused a prompt that the count alone would have let through."""

    def __init__(self, prompt_tokens: int, max_context: int, detail: str = "") -> None:
        self.prompt_tokens = int(prompt_tokens)
        self.max_context = int(max_context)
        self.detail = detail
        super().__init__(400, "", code="context_length_exceeded", param="messages")
        self.message = self.message_for("chat")

    def message_for(self, endpoint: Endpoint | None = None) -> str:
        n, m = self.max_context, self.prompt_tokens
        more = f" ({self.detail})" if self.detail else ""
        if endpoint == "messages":  # Anthropic's own wording; Claude Code parses the two numbers
            return f"prompt is too long: {m} tokens > {n - 1} maximum{more}"
        if endpoint == "completions":
            return (
                f"This model's maximum context length is {n} tokens. However, your prompt resulted in {m} tokens{more}. "
                "Please reduce the length of the prompt."
            )
        if endpoint == "responses":
            return (
                "Your input exceeds the context window of this model. This model's maximum context length is "
                f"{n} tokens. However, your input resulted in {m} tokens{more}. Please adjust your input and try again."
            )
        return (
            f"This model's maximum context length is {n} tokens. However, your messages resulted in {m} tokens{more}. "
            "Please reduce the length of the messages."
        )

    def param_for(self, endpoint: Endpoint | None = None) -> str | None:
        return {"completions": "prompt", "responses": "input"}.get(endpoint or "", "messages")


def rate_limited(model: str, detail: str, retry_after_s: int) -> ProxyError:
    """429 with ``Retry-After``, worded as OpenAI's rate limits ("Rate limit reached for ..."; type ``requests``,
    code ``rate_limit_exceeded``; Anthropic: ``rate_limit_error``): every SDK and litellm retry it after the time
    it names. ``detail`` says which limit and how to raise it."""
    return ProxyError(
        429,
        f"Rate limit reached for {model} on {detail}. Please try again in {retry_after_s}s.",
        error_type="requests",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


def refusal_kind(err: ProxyError) -> str | None:
    """Why ``err`` refused a model call (one of ``REFUSAL_KINDS``), or None if it is no refusal of what the client
    sent (a server error, the execution having ended, a missing key)."""
    if err.code == "context_length_exceeded":
        return "context"
    if err.status == 429:
        return "admission"
    if 400 <= err.status < 500 and err.status not in (401, 403, 409, 499):
        return "bad_request"
    return None


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
