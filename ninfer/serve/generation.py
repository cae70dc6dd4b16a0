"""Running a request on the engine for an HTTP client: the engine's events with its refusals as APIErrors, a whole
generation that is cancelled when the client hangs up, and the errors a stream reports after it has started."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import Response
from starlette.types import Receive

from ninfer.engine import (
    EngineClosedError,
    Finished,
    PromptTooLongError,
    QueueFullError,
    QueueTimeoutError,
    Request,
    Result,
)
from ninfer.errors import NinferError
from ninfer.sampling import SamplingError
from ninfer.serve.errors import APIError, internal_error
from ninfer.serve.request_log import record_error, record_of, record_result
from ninfer.serve.state import ServerState

logger = logging.getLogger("ninfer.serve")


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready; the engine request has been cancelled."""


async def engine_events(state: ServerState, request: Request) -> AsyncIterator[Any]:
    """The engine's events for `request` (ReasoningDelta / ContentDelta / ToolCall, then Finished), with its
    refusals as APIErrors: 429 server_overloaded (queue full), 503 request_queue_timeout (waited too long),
    400 context_length_exceeded, 503 server_shutting_down, 500 engine_error (another NinferError).
    Closing this generator (or cancelling its consumer) cancels the request."""
    try:
        async with contextlib.aclosing(state.engine.generate(request)) as events:
            async for event in events:
                yield event
    except QueueFullError as exc:
        raise APIError(429, f"the server is busy ({exc}); retry later",
                       code="server_overloaded") from None
    except QueueTimeoutError as exc:
        raise APIError(503, f"the request waited too long for a free slot: {exc}; retry later",
                       code="request_queue_timeout") from None
    except EngineClosedError as exc:
        raise APIError(503, f"{exc}; retry on another server", code="server_shutting_down") from None
    except PromptTooLongError as exc:
        raise APIError(400, str(exc), code="context_length_exceeded", param="messages") from None
    except SamplingError as exc:
        raise APIError(400, str(exc), code="invalid_value") from None
    except NinferError as exc:  # its message is meant for users
        logger.warning("engine refused request %s: %s", request.request_id, exc)
        raise APIError(500, str(exc), code="engine_error") from None


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports that the client went away (the body must have been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: HTTPRequest, work: Awaitable[Any]) -> Any:
    """Await `work` in its own task, cancelling it if the client disconnects first (ClientDisconnected is raised
    then). For non-streaming answers, whose client may hang up during a long generation."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected("the client disconnected")
    return task.result()


async def generate(state: ServerState, http_request: HTTPRequest, request: Request,
                   on_event: Callable[[Any], object] | None = None) -> Result:
    """Run `request` to completion and return its Result (also written to the request's log record); every event
    before Finished is passed to `on_event` first, if given (to build the answer from the same events as a stream).
    Raises the APIErrors of `engine_events`, or ClientDisconnected (the request is cancelled then)."""

    async def collect() -> Result:
        async for event in engine_events(state, request):
            if isinstance(event, Finished):
                return event.completion
            if on_event is not None:
                on_event(event)
        raise RuntimeError("the engine's event stream ended without Finished")

    result = await run_until_disconnect(http_request, collect())
    record_result(http_request, result)
    return result


def disconnected_response(http_request: HTTPRequest) -> Response:
    """What a route returns after ClientDisconnected: nothing reaches the client; the log says 499."""
    record_of(http_request)["finish_reason"] = "cancelled"
    return Response(status_code=499)


def stream_error(http_request: HTTPRequest, exc: Exception, what: str) -> APIError:
    """The error a stream reports in-band for `exc`, raised after its first event: an APIError as it is; anything
    else is logged with its traceback ("<what> failed while streaming") and becomes `internal_error()`. The error's
    code and type go into the request's log record."""
    if isinstance(exc, APIError):
        error = exc
    else:
        logger.exception("%s failed while streaming", what)
        error = internal_error()
    record_error(http_request.scope, error)
    return error
