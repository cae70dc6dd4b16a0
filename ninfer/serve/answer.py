"""Answers: each API writes the engine's events for one request in its own wire format, and `respond` sends them,
streamed as server-sent events or whole as JSON. An API's answer subclasses `Answer`; one whose answer is a list of
parts (Anthropic content blocks, Responses output items) builds them with an `OrderedParts`, so that a streamed and
a whole answer have the same content."""

from __future__ import annotations

import contextlib
import secrets
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from ninfer.engine import Finished, Request, Result
from ninfer.frontend import ContentDelta, ReasoningDelta, ToolCall
from ninfer.serve.errors import APIError
from ninfer.serve.generation import ClientDisconnected, disconnected_response, engine_events, generate, stream_error
from ninfer.serve.request_log import record_result
from ninfer.serve.sse import EventStreamResponse
from ninfer.serve.state import ServerState

StreamEvents = list[tuple[str, dict[str, Any]]]  # (SSE event name, payload) pairs


def new_id(prefix: str, nbytes: int = 12) -> str:
    """A random id such as `chatcmpl-<24 hex>` or `call_<24 hex>`."""
    return f"{prefix}{secrets.token_hex(nbytes)}"


def reasoning_tokens(result: Result, tokenizer: Any, thinking: bool) -> int:
    """Generated tokens spent on reasoning: up to and including `</think>` (all of them when it never came) with
    thinking on; 0 with thinking off."""
    if not thinking:
        return 0
    end = tokenizer.think_end_id
    if end is not None and end in result.token_ids:
        return result.token_ids.index(end) + 1
    return result.completion_tokens


def speculative_usage(result: Result) -> dict[str, Any]:
    """The usage extension of a speculating engine, `{"speculative": {rounds, drafted_tokens, accepted_tokens,
    accepted_per_position, fallback_steps}}`; nothing without speculation."""
    spec = result.stats.speculation
    return {} if spec is None else {"speculative": {"method": "mtp", **spec.as_dict()}}


class Answer(ABC):
    """One answer in an API's wire format, written from the engine's events of one request (see `respond`).
    `what` names it in the server's log, e.g. "chat completion chatcmpl-…"."""

    what: str

    def collect(self, event: Any) -> None:
        """Take an event before Finished into the whole answer (by default nothing: `whole` reads the Result)."""

    @abstractmethod
    def whole(self, result: Result) -> dict[str, Any]:
        """The whole answer, once the generation has finished."""

    @abstractmethod
    def opening(self) -> Iterable[bytes]:
        """The stream's first chunks, sent once the engine has produced its first event."""

    @abstractmethod
    def chunks(self, event: Any) -> Iterable[bytes]:
        """The stream's chunks for an event before Finished."""

    @abstractmethod
    def failure(self, error: APIError) -> Iterable[bytes]:
        """The in-band report of an error after the opening; the stream ends after it."""

    @abstractmethod
    def closing(self, result: Result) -> Iterable[bytes]:
        """The stream's last chunks, once the generation has finished."""


async def respond(state: ServerState, http_request: HTTPRequest, request: Request, answer: Answer,
                  stream: bool) -> Response:
    """Run `request` on the engine and send its answer: a server-sent-event stream, or JSON once the generation
    has finished (nothing, with status 499 in the log, when the client hung up before). Refusals before the
    engine's first event are APIErrors, answered with their status."""
    if stream:
        return EventStreamResponse(stream_chunks(state, http_request, request, answer))
    try:
        result = await generate(state, http_request, request, answer.collect)
    except ClientDisconnected:
        return disconnected_response(http_request)
    return JSONResponse(answer.whole(result))


async def stream_chunks(state: ServerState, http_request: HTTPRequest, request: Request,
                        answer: Answer) -> AsyncIterator[bytes]:
    """The answer's SSE chunks. A refusal before the engine's first event propagates (EventStreamResponse answers
    it with its status); a later error is reported in-band (`answer.failure`) and ends the stream."""
    async with contextlib.aclosing(engine_events(state, request)) as events:
        event = await anext(events)
        for chunk in answer.opening():
            yield chunk
        try:
            while not isinstance(event, Finished):
                for chunk in answer.chunks(event):
                    yield chunk
                event = await anext(events)
        except Exception as exc:
            for chunk in answer.failure(stream_error(http_request, exc, answer.what)):
                yield chunk
            return
    result = event.completion
    record_result(http_request, result)
    for chunk in answer.closing(result):
        yield chunk


class OrderedParts:
    """Engine events -> an answer's parts (Anthropic content blocks, Responses output items) in the order the model
    wrote them, as the stream events each event decides; a subclass keeps the parts, so that a streamed and a whole
    answer have the same content.

    Reasoning and content deltas go to the open part of their kind ("reasoning" or "content"): a delta of the other
    kind, or a tool call, first closes the open part; empty deltas are dropped. Each tool call is a part of its own;
    with `single_tool_call` only the first is kept (`tool_calls` counts those kept). A subclass gives the API's
    shapes: `_open_part(kind)`, `_delta(kind, text)` (the part is open), `_close_part(kind)` and `_tool_call(call)`.
    """

    def __init__(self, single_tool_call: bool):
        self.single_tool_call = single_tool_call
        self.open: str | None = None  # the kind of the part now receiving deltas
        self.tool_calls = 0

    def feed(self, event: Any) -> StreamEvents:
        if isinstance(event, ReasoningDelta | ContentDelta):
            if not event.text:
                return []
            kind = "reasoning" if isinstance(event, ReasoningDelta) else "content"
            events = [] if self.open == kind else [*self.close(), *self._open_part(kind)]
            self.open = kind
            return [*events, *self._delta(kind, event.text)]
        if isinstance(event, ToolCall):
            if self.single_tool_call and self.tool_calls:
                return []
            self.tool_calls += 1
            return [*self.close(), *self._tool_call(event)]
        return []

    def close(self) -> StreamEvents:
        """End the open reasoning or content part, if any."""
        if self.open is None:
            return []
        kind, self.open = self.open, None
        return self._close_part(kind)

    def _open_part(self, kind: str) -> StreamEvents:
        raise NotImplementedError

    def _delta(self, kind: str, text: str) -> StreamEvents:
        raise NotImplementedError

    def _close_part(self, kind: str) -> StreamEvents:
        raise NotImplementedError

    def _tool_call(self, call: ToolCall) -> StreamEvents:
        raise NotImplementedError
