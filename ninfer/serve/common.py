"""What every HTTP API of the server shares: state, errors, request parsing, prompts, sampling, engine calls, SSE.

An API module (`openai_chat`, `responses`, `anthropic_messages`) exposes `router(state: ServerState) -> APIRouter`
and builds its routes from these pieces:

    body = await parse_body(http_request, MyRequest)     # 400 naming the field on any schema violation
    check_model(state, body.model)                         # 404 model_not_found (if the API checks it)
    thinking = resolve_thinking(state.config.default_thinking, ("thinking", ...))
    ids = prompt_ids(state, messages, tools=..., thinking=thinking)   # OpenAI-shape messages and tools
    params = sampling_params(state, prompt_tokens=len(ids), max_tokens=..., stop=..., temperature=...)
    tools_enabled = bool(tools) or history_uses_tools(messages)
    engine_request = Request(ids, params, thinking=thinking, tools_enabled=tools_enabled, request_id=new_id("x-"))
    try:                                                   # non-streaming
        result = await generate(state, http_request, engine_request)
    except ClientDisconnected:
        return disconnected_response(http_request)
    ... or streaming: an async generator that pulls the first event before yielding anything
    return EventStreamResponse(my_chunks(engine_events(state, engine_request)))
    ... where a chunk generator turns an exception after its first event into the API's in-band error with
    `stream_error`, and an API whose answer is a list of parts subclasses `OrderedParts` (`generate(...,
    on_event=parts.feed)` builds the whole answer from the same events as the stream).

(`prompt_ids` and `sampling_params` are plain functions; run them with starlette's `run_in_threadpool` when the
conversation may be long, so that tokenizing does not hold up the event loop.)

Errors are raised as `APIError`; the app renders them in the body shape of the API the path belongs to
(`error_body`): OpenAI `{"error": {message, type, param, code}}` everywhere except `/v1/messages*`, which gets
Anthropic's `{"type": "error", "error": {type, message}}`. Each request writes one line to the request log; a route
adds its token counts and timings with `record_result(request, result)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import anyio
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError
from starlette.types import Receive, Scope, Send

from ninfer.engine.llm import PromptTooLongError
from ninfer.engine.scheduler import (
    Engine,
    EngineClosedError,
    Finished,
    QueueFullError,
    QueueTimeoutError,
    Request,
    Result,
)
from ninfer.errors import NinferError
from ninfer.frontend import ChatTemplateError, ContentDelta, ReasoningDelta, ToolCall
from ninfer.sampling import SamplingError, SamplingParams

if TYPE_CHECKING:
    from ninfer.engine.llm import LLM
    from ninfer.serve.app import ServeConfig

logger = logging.getLogger("ninfer.serve")

ANTHROPIC_PATH_PREFIX = "/v1/messages"
RECORD_KEY = "ninfer_record"  # request.scope["state"][RECORD_KEY]: this request's log record
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"

# ---------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------

# OpenAI's `error.type` by status (OpenAI itself uses invalid_request_error for every 4xx but 429)
OPENAI_ERROR_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
                      429: "rate_limit_error"}
# Anthropic's `error.type` by status (docs.anthropic.com "Errors")
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


class APIError(Exception):
    """An error answered to the client: HTTP `status`, a `message` the user can act on, the OpenAI-style `type`
    (default by status: invalid_request_error for 4xx, rate_limit_error for 429, server_error for 5xx), a
    machine-readable `code` (e.g. "model_not_found", "context_length_exceeded") and the request field at fault
    (`param`, e.g. "messages[2].role"), or None. A message that does not name its param is prefixed with it."""

    def __init__(self, status: int, message: str, *, type: str | None = None, code: str | None = None,
                 param: str | None = None):
        if param and param not in message:
            message = f"{param}: {message}"
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or OPENAI_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.code = code
        self.param = param


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready; the engine request has been cancelled."""


def openai_error_body(error: APIError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    kind = ANTHROPIC_ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_body(path: str, error: APIError) -> dict[str, Any]:
    """The error in the body shape of the API that `path` belongs to (Anthropic for /v1/messages*, else OpenAI)."""
    return anthropic_error_body(error) if path.startswith(ANTHROPIC_PATH_PREFIX) else openai_error_body(error)


def error_response(path: str, error: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(path, error), status_code=error.status, headers=dict(headers or {}))


def internal_error() -> APIError:
    """The 500 answered for an unexpected exception (which is logged with its traceback, never sent)."""
    return APIError(500, "internal server error; the server logged the details and keeps running",
                    code="internal_error")


# ---------------------------------------------------------------------------------------------------------------
# state and the request log
# ---------------------------------------------------------------------------------------------------------------


class RequestLog:
    """An append-only JSONL file, one object per request, flushed on every line; safe across threads.
    It holds ids, statuses, token counts and timings, never prompt or answer text."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._lock = threading.Lock()

    def write(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=str)
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


@dataclass
class ServerState:
    """What the routes share: the engine (owned by the caller, who starts and closes it), the configuration and the
    request log (None when off). `created` is the server's start time (unix seconds), used as the model's."""

    engine: Engine
    config: ServeConfig
    log: RequestLog | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_id(self) -> str:
        return self.config.model_id

    @property
    def llm(self) -> LLM:
        return self.engine.llm


def record_of(request: HTTPRequest) -> dict[str, Any]:
    """This request's log record (a dict the app writes as one JSONL line when the request ends); routes add
    fields such as `id`, `stream`, `thinking` to it."""
    return request.scope.setdefault("state", {}).setdefault(RECORD_KEY, {})


def record_result(request: HTTPRequest, result: Result) -> None:
    """Add a finished generation's token counts, timings and finish reason to the request's log record."""
    stats = result.stats
    record_of(request).update(
        prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
        cached_tokens=result.cached_tokens, queue_seconds=stats.queue_seconds, prefill_seconds=stats.prefill_seconds,
        decode_seconds=stats.decode_seconds, finish_reason=result.finish_reason, tool_calls=len(result.tool_calls))


def new_id(prefix: str, nbytes: int = 12) -> str:
    """A random id such as `chatcmpl-<24 hex>` or `call_<24 hex>`."""
    return f"{prefix}{secrets.token_hex(nbytes)}"


# ---------------------------------------------------------------------------------------------------------------
# request bodies
# ---------------------------------------------------------------------------------------------------------------


class StrictModel(BaseModel):
    """Base of request schemas: unknown fields are errors (nothing is ignored silently), no type coercion (a string
    is not a number), NaN and infinities are refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class LenientModel(BaseModel):
    """Base of request sub-objects whose extra fields are harmless metadata (e.g. a message's `name`)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def check_json_object_string(value: str) -> str:
    """`value` unchanged if it is a JSON object written as a string (blank counts as `{}`), as function-call
    arguments are sent; else ValueError saying what it is instead (pydantic reports it as the field's 400)."""
    try:
        parsed = json.loads(value) if value.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"must be a JSON object string ({exc})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"must be a JSON object string, got a JSON {type(parsed).__name__}")
    return value


JSONObjectString = Annotated[str, AfterValidator(check_json_object_string)]

Model = TypeVar("Model", bound=BaseModel)


async def parse_body(request: HTTPRequest, schema: type[Model]) -> Model:
    """The request body validated against `schema` (JSON mode). Raises APIError 400 naming the first offending
    field: code invalid_json (not JSON / not UTF-8 / nested too deep), missing_required_parameter,
    unknown_parameter, invalid_type, unsupported_role or invalid_value."""
    body = await request.body()
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    """A pydantic ValidationError as a 400 APIError about its first error (the count of others is mentioned)."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    kind, loc = first["type"], list(first["loc"])
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                        code="invalid_json")
    tagged_object = kind in ("union_tag_invalid", "union_tag_not_found") and isinstance(first.get("input"), dict)
    if tagged_object:  # name the discriminator field: 'role' or role() (a callable)
        loc.append(str(first.get("ctx", {}).get("discriminator", "type")).strip("'").removesuffix("()"))
    param = format_loc(loc)
    message = first["msg"]
    if kind == "extra_forbidden":
        code, message = "unknown_parameter", "unknown parameter (not supported by this server)"
    elif kind == "missing":
        code = "missing_required_parameter"
    elif kind == "union_tag_not_found":
        code, message = (("missing_required_parameter", "field required (it selects the kind of object)")
                         if tagged_object else ("invalid_type", "must be an object"))
    elif kind.endswith("_type") or kind in ("model_attributes_type", "is_instance_of"):
        code = "invalid_type"
    elif kind == "union_tag_invalid" and loc[-1] == "role":
        ctx = first.get("ctx", {})
        roles = ", ".join(tag.strip("'").removesuffix(" message") for tag in ctx.get("expected_tags", "").split(", "))
        code, message = "unsupported_role", f"role {ctx.get('tag')!r} is not supported; use one of {roles}"
    else:
        code = "invalid_value"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    where = f"{param}: " if param else "body: "
    return APIError(400, f"{where}{message}{more}", code=code, param=param or None)


def format_loc(loc: list[Any] | tuple[Any, ...]) -> str:
    """A pydantic error location as a field path: ("messages", 2, "role") -> "messages[2].role". The union-member
    tags pydantic inserts ("literal['auto']", "NamedToolChoice", "str", "function-after[...]") are left out: field
    names are snake_case."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _FIELD_NAME.fullmatch(part) and part not in _TYPE_TAGS:
            text += f".{part}" if text else part
    return text


def parse_tagged(raw: Any, models: Mapping[str, type[Model]], where: str, default_type: str | None = None) -> Model:
    """One object of a list whose kind is its `type` field (`default_type` when absent), validated by the model that
    `models` gives for that kind. Errors are 400s whose param and message start at `where` (e.g. "input[2]"):
    not an object, a missing or unlisted `type`, or the first schema violation inside the object. (A pydantic
    union of str and such a list reports the str branch's error; parsing the list items here names the field.)"""
    if not isinstance(raw, dict):
        raise APIError(400, f"{where}: must be an object, got {type(raw).__name__}", code="invalid_type", param=where)
    kind = raw.get("type", default_type)
    if kind is None:
        raise APIError(400, f"{where}.type: field required", code="missing_required_parameter", param=f"{where}.type")
    model = models.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise APIError(400, f"{where}.type: {kind!r} is not supported here; use one of {sorted(models)}",
                       code="invalid_value", param=f"{where}.type")
    try:
        return model.model_validate(raw if "type" in raw else {**raw, "type": kind})
    except ValidationError as exc:
        error = validation_error(exc)
        inner = error.param or ""
        param = where + (inner if inner.startswith("[") or not inner else f".{inner}")
        message = error.message.split(": ", 1)[1] if ": " in error.message else error.message
        raise APIError(400, f"{param}: {message}", code=error.code, param=param) from None


_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "any", "literal", "bytes"})


def check_model(state: ServerState, model: str | None, param: str = "model") -> None:
    """404 model_not_found unless `model` is the served id."""
    if model != state.model_id:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_id!r}",
                       code="model_not_found", param=param)


def resolve_thinking(default: bool, *choices: tuple[str, bool | None]) -> bool:
    """Thinking on/off from the request's (param, value) choices (None = not given), else `default`.
    Two choices that disagree are a 400 naming the second."""
    chosen: tuple[str, bool] | None = None
    for param, value in choices:
        if value is None:
            continue
        if chosen is not None and chosen[1] != value:
            raise APIError(400, f"{param} ({value}) contradicts {chosen[0]} ({chosen[1]})", code="invalid_value",
                           param=param)
        chosen = (param, value)
    return default if chosen is None else chosen[1]


# ---------------------------------------------------------------------------------------------------------------
# prompts and sampling
# ---------------------------------------------------------------------------------------------------------------


def history_uses_tools(messages: list[Mapping[str, Any]]) -> bool:
    """Whether a conversation (OpenAI-shape messages) holds tool calls or tool results."""
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def function_tool_json(name: str, description: str | None, parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool as the chat template takes it, OpenAI's function shape: {"type": "function", "function": {name,
    description (left out when None), parameters}}."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters
    return {"type": "function", "function": function}


def prompt_ids(state: ServerState, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
               thinking: bool, template_kwargs: Mapping[str, Any] | None = None, limit: bool = True) -> list[int]:
    """The prompt's token ids: OpenAI-shape `messages` (system first, assistant `tool_calls` with JSON-string or
    object arguments, `reasoning_content`) and OpenAI function `tools` ({"type": "function", "function": {...}})
    rendered through the model's chat template with the generation prompt, then tokenized. Raises APIError 400
    (code invalid_prompt) when the template rejects the conversation or the model has none, and (with `limit`)
    400 context_length_exceeded when the prompt leaves no room for one generated token."""
    template = state.llm.template
    if template is None:
        raise APIError(400, f"the model {state.model_id!r} has no chat template, so it cannot take messages",
                       code="invalid_prompt", param="messages")
    try:
        text = template.render(messages, tools=tools or None, add_generation_prompt=True, enable_thinking=thinking,
                               **dict(template_kwargs or {}))
    except ChatTemplateError as exc:
        raise APIError(400, f"the conversation cannot be rendered: {exc}", code="invalid_prompt",
                       param="messages") from None
    ids = state.llm.tokenizer.encode(text)
    if limit:
        check_context(state, len(ids))
    return ids


def check_context(state: ServerState, prompt_tokens: int) -> None:
    """400 context_length_exceeded unless the prompt plus one generated token fits the context."""
    limit = state.llm.max_context
    if prompt_tokens + 1 > limit:
        raise APIError(400, f"the prompt has {prompt_tokens} tokens; this model's context holds {limit} "
                            "(the prompt plus at least one generated token); shorten the conversation",
                       code="context_length_exceeded", param="messages")


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "ignore_eos")


def sampling_params(state: ServerState, *, prompt_tokens: int, max_tokens: int | None,
                    stop: list[str] | None = None, logit_bias: Mapping[int, float] | None = None,
                    stop_token_ids: list[int] | None = None, **fields: Any) -> SamplingParams:
    """SamplingParams of a request: the artifact's generation_config defaults, overridden by every field the request
    sets (`fields`: any of SAMPLING_FIELDS; None = not set). `max_tokens` None takes the server default; the budget
    is then cut to what the context leaves after the prompt (finish reason "length" when that binds). Empty stop
    strings are dropped. Raises APIError 400 naming the field when a value is outside its domain."""
    unknown = set(fields) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling fields {sorted(unknown)}")
    overrides = {name: value for name, value in fields.items() if value is not None}
    budget = state.config.default_max_tokens if max_tokens is None else max_tokens
    overrides["max_tokens"] = max(1, min(budget, state.llm.max_context - prompt_tokens))
    overrides["stop"] = tuple(s for s in (stop or ()) if s)
    if logit_bias:
        overrides["logit_bias"] = dict(logit_bias)
    if stop_token_ids:
        overrides["stop_token_ids"] = tuple(stop_token_ids)
    try:
        return state.llm.default_params(**overrides)
    except SamplingError as exc:
        message = str(exc)
        param = next((name for name in (*SAMPLING_FIELDS, "logit_bias", "stop_token_ids", "stop", "max_tokens")
                      if message.startswith(name)), None)
        raise APIError(400, message, code="invalid_value", param=param) from None


def parse_logit_bias(bias: Mapping[str, float] | None, vocab_size: int, param: str = "logit_bias",
                     limit: float = 100.0) -> dict[int, float]:
    """OpenAI's logit_bias (JSON object: token id as a string -> bias in [-limit, limit]) as {id: bias}; 400 naming
    the entry when a key is not a token id of this vocabulary or a value is out of range."""
    parsed: dict[int, float] = {}
    for key, value in (bias or {}).items():
        where = f"{param}[{key!r}]"
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"{where}: keys must be token ids written as decimal strings", code="invalid_value",
                           param=param) from None
        if not 0 <= token < vocab_size:
            raise APIError(400, f"{where}: token id {token} is outside the vocabulary [0, {vocab_size})",
                           code="invalid_value", param=param)
        if not -limit <= value <= limit:
            raise APIError(400, f"{where}: bias {value} is outside [-{limit:g}, {limit:g}]", code="invalid_value",
                           param=param)
        parsed[token] = float(value)
    return parsed


def reasoning_tokens(result: Result, tokenizer: Any, thinking: bool) -> int:
    """Generated tokens spent on reasoning: up to and including `</think>` (all of them when it never came) with
    thinking on; 0 with thinking off."""
    if not thinking:
        return 0
    end = tokenizer.think_end_id
    if end is not None and end in result.token_ids:
        return result.token_ids.index(end) + 1
    return result.completion_tokens


# ---------------------------------------------------------------------------------------------------------------
# running requests on the engine
# ---------------------------------------------------------------------------------------------------------------


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
        raise APIError(429, f"the server is busy (its request queue is full): {exc}; retry later",
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


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports that the client went away (the body must have been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


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
    record_of(http_request).update(error_code=error.code, error_type=error.type)
    return error


# ---------------------------------------------------------------------------------------------------------------
# answers as ordered parts
# ---------------------------------------------------------------------------------------------------------------

StreamEvents = list[tuple[str, dict[str, Any]]]  # (SSE event name, payload) pairs


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


# ---------------------------------------------------------------------------------------------------------------
# server-sent events
# ---------------------------------------------------------------------------------------------------------------


def sse_data(payload: Any) -> bytes:
    """One unnamed SSE event: `data: <json>` and a blank line (OpenAI Chat Completions)."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_event(name: str, payload: Any) -> bytes:
    """One named SSE event: `event: NAME`, `data: <json>` and a blank line (Responses, Anthropic Messages)."""
    return f"event: {name}\n".encode() + sse_data(payload)


SSE_DONE = b"data: [DONE]\n\n"


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
            scope.setdefault("state", {}).setdefault(RECORD_KEY, {}).setdefault("finish_reason", "cancelled")
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
        scope.setdefault("state", {}).setdefault(RECORD_KEY, {}).update(error_code=error.code, error_type=error.type)
        response = error_response(scope.get("path", ""), error)
        await response(scope, _no_receive, send)


async def _no_receive() -> dict[str, Any]:
    raise RuntimeError("an error response does not read the request")

