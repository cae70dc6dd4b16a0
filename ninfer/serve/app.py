"""The FastAPI application: configuration, the plain routes, and the middleware every API shares.

    app = create_app(engine, ServeConfig(model_id="qwen3.6-27b", api_key="secret"))

Routes: `GET /health`, `GET /v1/models`, `GET /v1/models/{id}`, `POST /tokenize`, `POST /detokenize`, and the
routers of the OpenAI Chat Completions, Responses and Anthropic Messages modules (each exposes
`router(state) -> APIRouter`). From the outside in, every request passes:

1. CORS (with `cors`): `Access-Control-Allow-Origin: *`, any method and header; preflight answered here.
2. The guard: once a request has ended, one line on the `ninfer.serve` logger (method, path, status, error code,
   token counts, milliseconds; never text; /health at debug level, 5xx as warnings) and, with `request_log`, one
   request-log line (except /health); any unexpected exception turned into a logged 500 in the API's error shape;
   the server keeps serving.
3. The API key (with `api_key`): `Authorization: Bearer KEY` or `x-api-key: KEY`, else 401 invalid_api_key.
   /health and OPTIONS are exempt.
4. The body limit: 413 request_too_large when Content-Length or the bytes actually received exceed
   `max_body_bytes`, before any JSON parsing.

Errors are answered in the shape of the API the path belongs to (see `ninfer.serve.errors.error_body`). The engine
belongs to the caller, who starts it before serving and closes it afterwards. `ServeConfig` is defined in
`ninfer.serve.state`, beside the state the routes share.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from pydantic import Field
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import ninfer
from ninfer.engine import Engine
from ninfer.serve import anthropic_messages, openai_chat, responses
from ninfer.serve.conversation import Conversation, prompt_ids, resolve_thinking
from ninfer.serve.errors import APIError, error_response, internal_error
from ninfer.serve.request_log import RequestLog, record_error, scope_record
from ninfer.serve.schema import StrictModel, parse_body
from ninfer.serve.state import MiB, ServeConfig, ServerState, check_model

UNLOGGED_PATHS = ("/health",)
LOGGED_PATH_CHARS = 200  # a longer path is cut in the log line

log = logging.getLogger("ninfer.serve")


def create_app(engine: Engine, config: ServeConfig) -> FastAPI:
    """The server's ASGI application over a started `engine` (see the module docstring)."""
    state = ServerState(engine, config, RequestLog(config.request_log) if config.request_log else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if state.log is not None:
            state.log.close()

    app = FastAPI(title="ninfer", version=ninfer.__version__, docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.ninfer = state

    async def api_error(request: HTTPRequest, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        record_error(request.scope, exc)
        return error_response(request.url.path, exc)

    async def http_error(request: HTTPRequest, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on "
                                                             f"{request.url.path}"}.get(exc.status_code, exc.detail)
        return await api_error(request, APIError(exc.status_code, message, code=code))

    async def request_validation_error(request: HTTPRequest, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return await api_error(request, APIError(400, f"{param}: {first.get('msg', 'invalid request')}",
                                                 code="invalid_value", param=param))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, request_validation_error)

    app.include_router(_plain_routes(state))
    for api in (openai_chat, responses, anthropic_messages):
        app.include_router(api.router(state))

    # added innermost first
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(APIKeyCheck, key=config.api_key)
    app.add_middleware(Guard, log=state.log)
    if config.cors:
        app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["*"])
    return app


# ---------------------------------------------------------------------------------------------------------------
# plain routes
# ---------------------------------------------------------------------------------------------------------------


class TokenizeRequest(StrictModel):
    """Either `text` (tokenized as is, special-token text included) or `messages` (+ `tools`, `enable_thinking`)
    rendered through the chat template with the generation prompt, exactly as a chat completion would be."""

    model: str | None = None
    text: str | None = None
    messages: list[openai_chat.ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[openai_chat.ToolDefinition] | None = None
    enable_thinking: bool | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


def _plain_routes(state: ServerState) -> APIRouter:
    routes = APIRouter()

    def model_card() -> dict[str, Any]:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "ninfer",
                "max_model_len": state.llm.max_context}

    @routes.get("/health")
    async def health() -> dict[str, Any]:
        stats = state.engine.stats()
        return {"status": "ok", "model": state.model_id, "running": stats["running"], "waiting": stats["waiting"]}

    @routes.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @routes.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(state, model_id, param="model_id")
        return model_card()

    @routes.post("/tokenize")
    async def tokenize(request: HTTPRequest) -> dict[str, Any]:
        body = await parse_body(request, TokenizeRequest)
        if body.model is not None:
            check_model(state, body.model)
        if (body.text is None) == (body.messages is None):
            raise APIError(400, "give exactly one of text and messages", code="invalid_value",
                           param="text" if body.text is not None else "messages")
        if body.text is not None:
            if body.tools is not None or body.enable_thinking is not None:
                param = "tools" if body.tools is not None else "enable_thinking"
                raise APIError(400, f"{param} applies to messages, not to text", code="invalid_value", param=param)
            tokens = await run_in_threadpool(state.llm.tokenizer.encode, body.text)
        else:
            thinking = resolve_thinking(state.config.default_thinking, ("enable_thinking", body.enable_thinking))
            tools = openai_chat.template_tools(body.tools, None)
            conversation = Conversation(openai_chat.template_messages(body.messages or []), tools, thinking)
            tokens = await run_in_threadpool(prompt_ids, state, conversation, limit=False)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.llm.max_context}

    @routes.post("/detokenize")
    async def detokenize(request: HTTPRequest) -> dict[str, Any]:
        body = await parse_body(request, DetokenizeRequest)
        if body.model is not None:
            check_model(state, body.model)
        vocab = state.llm.tokenizer.vocab_size
        for index, token in enumerate(body.tokens):
            if not 0 <= token < vocab:
                raise APIError(400, f"tokens[{index}]: {token} is not a token id (the vocabulary is [0, {vocab}))",
                               code="invalid_value", param=f"tokens[{index}]")
        return {"text": state.llm.tokenizer.decode(body.tokens)}

    return routes


# ---------------------------------------------------------------------------------------------------------------
# middleware (pure ASGI, so that streams pass through untouched)
# ---------------------------------------------------------------------------------------------------------------


class Guard:
    """Writes one log line per request once it has ended, and answers any exception that escaped the app with a
    logged 500 in the API's shape (or, if the response had started, ends it)."""

    def __init__(self, app: ASGIApp, log: RequestLog | None):
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = scope_record(scope)
        started = time.time()
        status: int | None = None

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception:
            log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            error = internal_error()
            record_error(scope, error)
            if status is None:
                status = error.status
                await error_response(scope.get("path", ""), error)(scope, receive, send)
        finally:
            seconds = time.time() - started
            log_request(scope.get("method", ""), scope.get("path", ""), status, record, seconds)
            if self.log is not None and scope.get("path") not in UNLOGGED_PATHS:
                record.update(time=round(started, 3), method=scope.get("method"), endpoint=scope.get("path"),
                              status=status, total_seconds=seconds)
                self.log.write(record)


def log_request(method: str, path: str, status: int | None, record: dict[str, Any], seconds: float) -> None:
    """The request's line on the `ninfer.serve` logger, e.g. `POST /v1/chat/completions 200 prompt_tokens=21
    completion_tokens=8 134 ms` or `POST /v1/messages 404 model_not_found 2 ms` (status `-`: the client left before
    an answer). Only numbers and codes from the request's log record, never text."""
    level = logging.DEBUG if path in UNLOGGED_PATHS else logging.WARNING if (status or 0) >= 500 else logging.INFO
    if not log.isEnabledFor(level):
        return
    shown = path[:LOGGED_PATH_CHARS].encode("unicode_escape").decode("ascii")  # one line, whatever the path holds
    parts = [method, shown, "-" if status is None else str(status)]
    if record.get("error_code"):
        parts.append(str(record["error_code"]))
    parts += [f"{key}={record[key]}" for key in ("prompt_tokens", "completion_tokens") if record.get(key) is not None]
    log.log(level, "%s %.0f ms", " ".join(parts), seconds * 1000)


class APIKeyCheck:
    """401 invalid_api_key unless `Authorization: Bearer KEY` or `x-api-key: KEY` carries the key (compared in
    constant time); /health and OPTIONS requests are exempt."""

    def __init__(self, app: ASGIApp, key: str):
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and scope.get("path") != "/health":
            headers = Headers(scope=scope)
            bearer = headers.get("authorization", "")
            offered = [bearer[7:].strip()] if bearer[:7].lower() == "bearer " else []
            offered += [headers["x-api-key"]] if "x-api-key" in headers else []
            if not any(hmac.compare_digest(key.encode(), self.key) for key in offered):
                error = APIError(401, "missing or invalid API key; send 'Authorization: Bearer KEY' or "
                                      "'x-api-key: KEY'", code="invalid_api_key")
                record_error(scope, error)
                response = error_response(scope.get("path", ""), error, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Reads the whole body first (at most `limit` bytes), answering 413 request_too_large when the declared
    Content-Length or the bytes received exceed it; the app then gets the body in one message. A malformed
    Content-Length is a 400.

    Before a 413 the rest of the body is read and dropped, up to DRAIN_BYTES: a server that answers and closes
    while the client is still uploading resets the connection, and the client may never see the answer. Bodies
    larger still get the 413 at once and the connection is closed."""

    DRAIN_BYTES = 64 * MiB

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and not declared.strip().isdigit():
            error = APIError(400, f"Content-Length {declared!r} is not a number", code="invalid_request")
            await self._refuse(scope, receive, send, error, close=True)
            return
        if declared is not None and int(declared) > self.limit:
            drained = int(declared) <= self.DRAIN_BYTES and await self._drain(receive, 0)
            await self._refuse(scope, receive, send, self._too_large(int(declared)), close=not drained)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            body = message.get("body", b"")
            size += len(body)
            more = message.get("more_body", False)
            if size > self.limit:
                drained = not more or await self._drain(receive, size)
                await self._refuse(scope, receive, send, self._too_large(size), close=not drained)
                return
            chunks.append(body)
        whole = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": whole, "more_body": False}

        await self.app(scope, replay, send)

    async def _drain(self, receive: Receive, size: int) -> bool:
        """Read and drop the rest of the body; False when it exceeds DRAIN_BYTES or the client left."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            size += len(message.get("body", b""))
            if size > self.DRAIN_BYTES:
                return False
            if not message.get("more_body", False):
                return True

    def _too_large(self, size: int) -> APIError:
        return APIError(413, f"the request body ({size:,d} bytes or more) exceeds this server's limit of "
                             f"{self.limit:,d} bytes", code="request_too_large")

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, error: APIError, close: bool) -> None:
        record_error(scope, error)
        headers = {"Connection": "close"} if close else {}
        await error_response(scope.get("path", ""), error, headers=headers)(scope, receive, send)
