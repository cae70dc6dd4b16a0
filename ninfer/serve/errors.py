"""Errors answered to clients: `APIError`, and its body in the shape of the API a path belongs to.

OpenAI's `{"error": {message, type, param, code}}` everywhere except `/v1/messages*`, which gets Anthropic's
`{"type": "error", "error": {type, message}}`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse

ANTHROPIC_PATH_PREFIX = "/v1/messages"

# OpenAI's `error.type` by status (OpenAI itself uses invalid_request_error for every 4xx but 429)
OPENAI_ERROR_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
                      429: "rate_limit_error"}
# Anthropic's `error.type` by status (docs.anthropic.com "Errors")
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


# seconds a 429 or 503 asks the client to wait (Retry-After): a retry rejoins the queue at its back, so waiting
# longer gains the client nothing; the queue's bound, not the client's patience, protects the server
RETRY_AFTER_SECONDS = 1
RETRY_STATUSES = (429, 503)


class APIError(Exception):
    """An error answered to the client: HTTP `status`, a `message` the user can act on, the OpenAI-style `type`
    (default by status: invalid_request_error for 4xx, rate_limit_error for 429, server_error for 5xx), a
    machine-readable `code` (e.g. "model_not_found", "context_length_exceeded") and the request field at fault
    (`param`, e.g. "messages[2].role"), or None. A message that does not name its param is prefixed with it.
    `retry_after`: whole seconds for the Retry-After header (default RETRY_AFTER_SECONDS for 429 and 503, else
    none)."""

    def __init__(self, status: int, message: str, *, type: str | None = None, code: str | None = None,
                 param: str | None = None, retry_after: int | None = None):
        if param and param not in message:
            message = f"{param}: {message}"
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or OPENAI_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.code = code
        self.param = param
        if retry_after is None and status in RETRY_STATUSES:
            retry_after = RETRY_AFTER_SECONDS
        self.retry_after = retry_after


def openai_error_body(error: APIError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    kind = ANTHROPIC_ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_body(path: str, error: APIError) -> dict[str, Any]:
    """The error in the body shape of the API that `path` belongs to (Anthropic for /v1/messages*, else OpenAI)."""
    return anthropic_error_body(error) if path.startswith(ANTHROPIC_PATH_PREFIX) else openai_error_body(error)


def error_response(path: str, error: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The error's JSON response in its API's shape, with `headers` and, when the error has one, Retry-After."""
    headers = dict(headers or {})
    if error.retry_after is not None:
        headers.setdefault("Retry-After", str(error.retry_after))
    return JSONResponse(error_body(path, error), status_code=error.status, headers=headers)


def internal_error() -> APIError:
    """The 500 answered for an unexpected exception (which is logged with its traceback, never sent)."""
    return APIError(500, "internal server error; the server logged the details and keeps running",
                    code="internal_error")
