"""Server-sent events: the framing of one event, and `EventStreamResponse`, a stream whose HTTP status waits for
its first chunk (so that a refusal before any output is answered with its own status and JSON error body)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from ninfer.serve.errors import APIError, error_response, internal_error
from ninfer.serve.generation import wait_for_disconnect
from ninfer.serve.request_log import record_error, scope_record

logger = logging.getLogger("ninfer.serve")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"
SSE_DONE = b"data: [DONE]\n\n"


def sse_data(payload: Any) -> bytes:
    """One unnamed SSE event: `data: <json>` and a blank line (OpenAI Chat Completions)."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_event(name: str, payload: Any) -> bytes:
    """One named SSE event: `event: NAME`, `data: <json>` and a blank line (Responses, Anthropic Messages)."""
    return f"event: {name}\n".encode() + sse_data(payload)


class EventStreamResponse(Response):
    """A server-sent-event stream whose status is decided by its first chunk.

    The status line is sent only once `chunks` yields its first piece, so that a refusal before any output (an
    APIError: queue full, queue timeout, context too long) is answered with its own status and JSON error body
    (shape by path) rather than a 200 stream. Once started, `chunks` must report errors in-band (its API's SSE
    error event); an unexpected exception then is logged and the stream is closed. When the client disconnects,
    the stream is cancelled, which closes `chunks` and so cancels the engine request (whatever the ASGI spec
    version: the disconnect is watched here, not left to the server).
    """

    media_type = SSE_MEDIA_TYPE

    def __init__(self, chunks: AsyncIterator[bytes], headers: Mapping[str, str] | None = None):
        self.chunks = chunks
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def stream() -> None:
                await self._stream(scope, send)
                group.cancel_scope.cancel()

            group.start_soon(stream)
            await wait_for_disconnect(receive)
            scope_record(scope).setdefault("finish_reason", "cancelled")
            group.cancel_scope.cancel()

    async def _stream(self, scope: Scope, send: Send) -> None:
        async with contextlib.aclosing(self.chunks) as chunks:
            try:
                first = await anext(chunks, b"")
            except APIError as error:
                await self._send_error(scope, send, error)
                return
            except Exception:
                logger.exception("stream %s failed before its first event", scope.get("path"))
                await self._send_error(scope, send, internal_error())
                return
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            try:
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except Exception:
                logger.exception("stream %s failed", scope.get("path"))
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _send_error(scope: Scope, send: Send, error: APIError) -> None:
        record_error(scope, error)
        response = error_response(scope.get("path", ""), error)
        await response(scope, _no_receive, send)


async def _no_receive() -> dict[str, Any]:
    raise RuntimeError("an error response does not read the request")
