"""OpenAI Chat Completions: `POST /v1/chat/completions`, JSON or server-sent events.

Request (beyond OpenAI's own fields, the vLLM extensions top_k, min_p, repetition_penalty, ignore_eos,
stop_token_ids, enable_thinking and chat_template_kwargs):

- model: the served id or one of its aliases (`ninfer serve --model-alias`), else 404 model_not_found; the answer
  names the served id.
- messages: system / developer (as system; leading ones are joined), user, assistant (content, reasoning_content or
  reasoning, tool_calls with JSON-object-string arguments), tool (content, tool_call_id); content is a string or
  text parts. Another role, or a non-text part, is a 400 naming the field.
- tools (functions) and tool_choice: none renders no tools; auto and required render them all (required is not
  enforced: there is no constrained decoding); a named choice renders only that tool. parallel_tool_calls=false
  keeps the first tool call of the answer.
- sampling: temperature, top_p, top_k (-1 or 0: off), min_p, presence / frequency / repetition penalties, seed,
  logit_bias (honoured), stop (content and reasoning), max_completion_tokens or max_tokens (default: the
  server's). Omitted fields take the model's generation_config defaults.
- thinking: enable_thinking, chat_template_kwargs.enable_thinking, or reasoning_effort ("none" = off, any other
  level = on; the template has no levels); default: the server's.
- accepted with no effect on the output: user, metadata, store, service_tier, prompt_cache_key,
  prompt_cache_retention, safety_identifier, prediction, stream_options.include_obfuscation.
- refused with a 400 saying why: n > 1, logprobs, response_format other than text, audio / non-text modalities,
  functions / function_call, web_search_options, verbosity, any unknown field.

Response: `chat.completion` with message.content (null when there are tool calls and no text), reasoning_content,
tool_calls (`call_<hex>` ids, arguments as JSON strings), finish_reason stop | length | tool_calls, and usage with
prompt_tokens_details.cached_tokens and completion_tokens_details.reasoning_tokens. Streaming sends a role chunk,
then reasoning_content / content / tool_calls deltas as the engine decides them, a finish_reason chunk, a usage
chunk when stream_options.include_usage, and `data: [DONE]`; an error after the first chunk is a `data: {"error":…}`
event and the stream ends without [DONE].
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import Response
from pydantic import Discriminator, Field, Tag
from starlette.concurrency import run_in_threadpool

from ninfer.engine import Request, Result
from ninfer.frontend import ContentDelta, ReasoningDelta, ToolCall
from ninfer.serve.answer import Answer, new_id, reasoning_tokens, respond, speculative_usage
from ninfer.serve.conversation import Conversation, Sampling, engine_request, resolve_thinking, with_system
from ninfer.serve.errors import APIError, openai_error_body
from ninfer.serve.request_log import record_of
from ninfer.serve.schema import JSONObjectString, LenientModel, StrictModel, parse_body
from ninfer.serve.sse import SSE_DONE, sse_data
from ninfer.serve.state import ServerState, check_model
from ninfer.serve.tools import FunctionTool, OpenAIFunction, arguments_json, template_call, tools_by_name

# ---------------------------------------------------------------------------------------------------------------
# request schema
# ---------------------------------------------------------------------------------------------------------------


class ContentPart(LenientModel):
    """One part of a message's content; only "text" parts are supported (this server has no media input)."""

    type: str
    text: str | None = None


Content = str | list[ContentPart]


class SystemMessage(StrictModel):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(StrictModel):
    role: Literal["user"]
    content: Content
    name: str | None = None


class FunctionCall(StrictModel):
    name: str
    arguments: JSONObjectString


class AssistantToolCall(StrictModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(StrictModel):
    """An earlier answer. `refusal`, `annotations`, `audio` and `function_call` are accepted so that a client can send
    back the message object it received (they are null there); a refusal text stands in for absent content."""

    role: Literal["assistant"]
    content: Content | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    name: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None


class ToolMessage(StrictModel):
    role: Literal["tool"]
    content: Content
    tool_call_id: str
    name: str | None = None


_MESSAGE_KINDS = {"system": "system message", "developer": "system message", "user": "user message",
                  "assistant": "assistant message", "tool": "tool message"}


def role(message: Any) -> str | None:
    """The union tag of a message (the error location shows `role`, the tags read "user message" ...)."""
    value = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
    return None if value is None else _MESSAGE_KINDS.get(value, str(value)) if isinstance(value, str) else str(value)


ChatMessage = Annotated[
    Annotated[SystemMessage, Tag("system message")] | Annotated[UserMessage, Tag("user message")]
    | Annotated[AssistantMessage, Tag("assistant message")] | Annotated[ToolMessage, Tag("tool message")],
    Discriminator(role)]


class ToolDefinition(StrictModel):
    type: Literal["function"]
    function: OpenAIFunction


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(StrictModel):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # padding against side channels: nothing to pad here


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(StrictModel):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, lt=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    n: int | None = None
    enable_thinking: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # accepted, no effect on the output
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    prediction: dict[str, Any] | None = None
    # refused unless absent or trivially satisfied (checked in `check_supported`)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None


def check_supported(body: ChatCompletionRequest) -> None:
    """400 for request features this server cannot honour (rather than ignoring them)."""
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", code="invalid_value",
                       param="stream_options")
    if body.n not in (None, 1):
        raise APIError(400, f"n={body.n}: only one choice per request is supported (n=1)", code="n_not_supported",
                       param="n")
    if body.logprobs or body.top_logprobs:
        param = "logprobs" if body.logprobs else "top_logprobs"
        raise APIError(400, "log probabilities are not supported", code="logprobs_not_supported", param=param)
    if body.response_format is not None and body.response_format.type != "text":
        raise APIError(400, f"response_format {body.response_format.type!r} is not supported (no constrained "
                            "decoding); only {'type': 'text'}", code="response_format_not_supported",
                       param="response_format")
    if body.modalities is not None and set(body.modalities) - {"text"}:
        raise APIError(400, "only the text modality is supported", code="modality_not_supported", param="modalities")
    if body.audio is not None:
        raise APIError(400, "audio output is not supported", code="modality_not_supported", param="audio")
    if body.functions is not None or body.function_call is not None:
        param = "functions" if body.functions is not None else "function_call"
        raise APIError(400, "the legacy functions / function_call fields are not supported; use tools and "
                            "tool_choice", code="tools_not_supported", param=param)
    if body.web_search_options is not None:
        raise APIError(400, "web search is not supported", code="unsupported_parameter", param="web_search_options")
    if body.verbosity is not None:
        raise APIError(400, "verbosity is not supported (the model has no verbosity control)",
                       code="unsupported_parameter", param="verbosity")


# ---------------------------------------------------------------------------------------------------------------
# request -> prompt
# ---------------------------------------------------------------------------------------------------------------


def content_text(content: Content | None, param: str) -> str:
    """A message's content as one string: a string as is, text parts concatenated (as the chat template does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for index, part in enumerate(content):
        if part.type != "text":
            raise APIError(400, f"{param}[{index}]: content parts of type {part.type!r} are not supported (this "
                                "server takes text only)", code="modality_not_supported", param=f"{param}[{index}]")
        if part.text is None:
            raise APIError(400, f"{param}[{index}].text: field required", code="missing_required_parameter",
                           param=f"{param}[{index}].text")
        texts.append(part.text)
    return "".join(texts)


def template_messages(messages: list[SystemMessage | UserMessage | AssistantMessage | ToolMessage]
                      ) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them: developer becomes system, leading system messages
    are joined by a blank line (the template takes one), content becomes a string. A system message after the
    conversation started is a 400 (the Qwen template has no place for it)."""
    rendered: list[dict[str, Any]] = []
    system: list[str] = []
    for index, message in enumerate(messages):
        param = f"messages[{index}]"
        if isinstance(message, SystemMessage):
            if rendered:
                raise APIError(400, f"{param}: a {message.role} message must come before the conversation (the "
                                    "model's chat template takes one leading system turn)", code="invalid_value",
                               param=f"{param}.role")
            system.append(content_text(message.content, f"{param}.content"))
        elif isinstance(message, UserMessage):
            rendered.append({"role": "user", "content": content_text(message.content, f"{param}.content")})
        elif isinstance(message, ToolMessage):
            rendered.append({"role": "tool", "content": content_text(message.content, f"{param}.content"),
                             "tool_call_id": message.tool_call_id})
        else:
            text = content_text(message.content, f"{param}.content")
            if not text and message.refusal:
                text = message.refusal
            turn: dict[str, Any] = {"role": "assistant", "content": text}
            reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
            if reasoning is not None:
                turn["reasoning_content"] = reasoning
            if message.tool_calls:
                turn["tool_calls"] = [template_call(call.id, call.function.name, call.function.arguments)
                                      for call in message.tool_calls]
            rendered.append(turn)
    return with_system(system, rendered)


def template_tools(tools: list[ToolDefinition] | None, tool_choice: str | NamedToolChoice | None
                   ) -> list[FunctionTool] | None:
    """The tools to render: none for tool_choice "none", only the named one for a named choice, else all. 400 for
    duplicate names, a named or required choice without tools, or a named tool that is not among them."""
    by_name = tools_by_name((tool.function.tool() for tool in tools or []), "tools[{}].function.name")
    if tool_choice not in (None, "none", "auto") and not by_name:
        raise APIError(400, "tool_choice requires tools", code="invalid_value", param="tool_choice")
    if tool_choice == "none":
        return None
    if isinstance(tool_choice, NamedToolChoice):
        if tool_choice.function.name not in by_name:
            raise APIError(400, f"tool_choice names {tool_choice.function.name!r}, which is not among the tools",
                           code="invalid_value", param="tool_choice.function.name")
        return [by_name[tool_choice.function.name]]
    return list(by_name.values()) or None


def thinking_of(body: ChatCompletionRequest, default: bool) -> bool:
    kwargs = body.chat_template_kwargs or {}
    from_kwargs = kwargs.get("enable_thinking")
    if from_kwargs is not None and not isinstance(from_kwargs, bool):
        raise APIError(400, "chat_template_kwargs.enable_thinking must be a boolean", code="invalid_type",
                       param="chat_template_kwargs.enable_thinking")
    effort = None if body.reasoning_effort is None else body.reasoning_effort != "none"
    return resolve_thinking(default, ("enable_thinking", body.enable_thinking),
                            ("chat_template_kwargs.enable_thinking", from_kwargs), ("reasoning_effort", effort))


# ---------------------------------------------------------------------------------------------------------------
# response
# ---------------------------------------------------------------------------------------------------------------


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """A parsed tool call on the wire: a fresh `call_<hex>` id, arguments as a JSON string (index when streamed)."""
    wire: dict[str, Any] = {} if index is None else {"index": index}
    wire.update(id=new_id("call_"), type="function",
                function={"name": call.name, "arguments": arguments_json(call.arguments)})
    return wire


def usage_json(result: Result, reasoning: int) -> dict[str, Any]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": reasoning}, **speculative_usage(result)}


class ChatAnswer(Answer):
    """One chat completion: a `chat.completion` object, or `chat.completion.chunk` events ended by [DONE]."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, thinking: bool):
        self.state = state
        self.body = body
        self.thinking = thinking
        self.id = new_id("chatcmpl-")
        self.what = f"chat completion {self.id}"
        self.created = int(time.time())
        self.single_tool_call = body.parallel_tool_calls is False
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.tool_calls = 0  # streamed so far

    def finish_reason(self, result: Result, tool_calls: int) -> str:
        return "tool_calls" if tool_calls else result.finish_reason

    def usage(self, result: Result) -> dict[str, Any]:
        return usage_json(result, reasoning_tokens(result, self.state.llm.tokenizer, self.thinking))

    def whole(self, result: Result) -> dict[str, Any]:
        calls = result.tool_calls[:1] if self.single_tool_call else result.tool_calls
        message: dict[str, Any] = {"role": "assistant", "content": result.text if result.text or not calls else None,
                                   "reasoning_content": result.reasoning or None}
        if calls:
            message["tool_calls"] = [tool_call_json(call) for call in calls]
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.state.model_id,
                "system_fingerprint": None,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": self.finish_reason(result, len(calls))}],
                "usage": self.usage(result)}

    def chunk(self, delta: dict[str, Any] | None, finish_reason: str | None = None,
              usage: dict[str, Any] | None = None) -> bytes:
        """One `chat.completion.chunk`; delta None gives the usage chunk (no choices)."""
        payload: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                   "model": self.state.model_id, "system_fingerprint": None}
        payload["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                        "finish_reason": finish_reason}]
        if self.include_usage:
            payload["usage"] = usage
        return sse_data(payload)

    def opening(self) -> list[bytes]:
        return [self.chunk({"role": "assistant", "content": ""})]

    def chunks(self, event: Any) -> list[bytes]:
        if isinstance(event, ReasoningDelta):
            return [self.chunk({"reasoning_content": event.text})]
        if isinstance(event, ContentDelta):
            return [self.chunk({"content": event.text})]
        if isinstance(event, ToolCall) and not (self.single_tool_call and self.tool_calls):
            chunk = self.chunk({"tool_calls": [tool_call_json(event, self.tool_calls)]})
            self.tool_calls += 1
            return [chunk]
        return []

    def failure(self, error: APIError) -> list[bytes]:
        return [sse_data(openai_error_body(error))]

    def closing(self, result: Result) -> list[bytes]:
        chunks = [self.chunk({}, self.finish_reason(result, self.tool_calls))]
        if self.include_usage:
            chunks.append(self.chunk(None, usage=self.usage(result)))
        return [*chunks, SSE_DONE]


# ---------------------------------------------------------------------------------------------------------------
# route
# ---------------------------------------------------------------------------------------------------------------


def build_request(state: ServerState, body: ChatCompletionRequest, thinking: bool, request_id: str) -> Request:
    """The engine request of a validated chat request (prompt rendered and tokenized, sampling resolved)."""
    check_supported(body)
    messages = template_messages(body.messages)
    tools = template_tools(body.tools, body.tool_choice)
    kwargs = {key: value for key, value in (body.chat_template_kwargs or {}).items() if key != "enable_thinking"}
    sampling = Sampling(
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        stop=[body.stop] if isinstance(body.stop, str) else body.stop, logit_bias=body.logit_bias,
        stop_token_ids=body.stop_token_ids, temperature=body.temperature, top_p=body.top_p,
        top_k=0 if body.top_k == -1 else body.top_k, min_p=body.min_p, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty, seed=body.seed,
        ignore_eos=body.ignore_eos)
    return engine_request(state, Conversation(messages, tools, thinking, kwargs), sampling, request_id)


def router(state: ServerState) -> APIRouter:
    """The Chat Completions route over `state`."""
    routes = APIRouter()

    @routes.post("/v1/chat/completions")
    async def chat_completions(http_request: HTTPRequest) -> Response:
        body = await parse_body(http_request, ChatCompletionRequest)
        check_model(state, body.model)
        thinking = thinking_of(body, state.config.default_thinking)
        answer = ChatAnswer(state, body, thinking)
        record_of(http_request).update(id=answer.id, stream=bool(body.stream), thinking=thinking)
        request = await run_in_threadpool(build_request, state, body, thinking, answer.id)
        return await respond(state, http_request, request, answer, stream=bool(body.stream))

    return routes
