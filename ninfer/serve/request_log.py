"""The request log: one JSON line per request with its ids, status, token counts and timings, never prompt or
answer text.

Each request carries its record, a dict in its ASGI scope (`scope_record`); the middleware and the routes add to it
as the request goes (`record_of(request).update(id=…, stream=…)`, `record_result`, `record_error`), and the app's
guard writes it to the `RequestLog` once the request has ended.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastapi import Request as HTTPRequest
from starlette.types import Scope

from ninfer.engine import Result
from ninfer.serve.errors import APIError

RECORD_KEY = "ninfer_record"  # scope["state"][RECORD_KEY]: the request's log record
# every line has these keys (None when they do not apply), in this order
LOG_FIELDS = ("time", "id", "method", "endpoint", "status", "stream", "thinking", "prompt_tokens",
              "completion_tokens", "cached_tokens", "queue_seconds", "prefill_seconds", "decode_seconds",
              "total_seconds", "finish_reason", "tool_calls", "speculative", "error_code", "error_type")


class RequestLog:
    """An append-only JSONL file, one object per request, flushed on every line; safe across threads."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._lock = threading.Lock()

    def write(self, record: Mapping[str, Any]) -> None:
        """Append the record's LOG_FIELDS as one line."""
        line = json.dumps({key: record.get(key) for key in LOG_FIELDS}, ensure_ascii=False, separators=(",", ":"),
                          default=str)
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def scope_record(scope: Scope) -> dict[str, Any]:
    """The log record of the request whose ASGI scope this is (created empty on first use)."""
    return scope.setdefault("state", {}).setdefault(RECORD_KEY, {})


def record_of(request: HTTPRequest) -> dict[str, Any]:
    """This request's log record; routes add fields such as `id`, `stream`, `thinking` to it."""
    return scope_record(request.scope)


def record_error(scope: Scope, error: APIError) -> None:
    """Note the error answered to the request (its code and type) in the request's log record."""
    scope_record(scope).update(error_code=error.code, error_type=error.type)


def record_result(request: HTTPRequest, result: Result) -> None:
    """Add a finished generation's token counts, timings and finish reason to the request's log record."""
    stats = result.stats
    record_of(request).update(
        prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
        cached_tokens=result.cached_tokens, queue_seconds=stats.queue_seconds, prefill_seconds=stats.prefill_seconds,
        decode_seconds=stats.decode_seconds, finish_reason=result.finish_reason, tool_calls=len(result.tool_calls),
        speculative=stats.speculation.as_dict() if stats.speculation is not None else None)
