"""Anthropic Messages: `POST /v1/messages` (JSON or server-sent events) and `POST /v1/messages/count_tokens`.

Request:

- system: a string or text blocks; system-role messages inside `messages` (as Claude Code sends) are folded into
  it, in order. Consecutive messages of one role are one turn (as Anthropic combines them); the text blocks of a
  turn are joined by a blank line.
- user blocks: text, tool_result (content a string or text blocks). Each tool_result becomes its own tool turn,
  placed before the message's text (the Qwen template's order: tool responses, then the user's words).
- assistant blocks: text, thinking (-> reasoning_content), redacted_thinking (dropped), tool_use (id, name, input).
  A last assistant message of text only is a prefill: the answer continues it (thinking must be off; a request
  that does not say gets it off) and the prefill is not repeated in the answer, as Anthropic does.
- tools: client tools {name, description, input_schema} only, rendered as OpenAI function JSON in the template's
  tools block. tool_choice: auto, any (all tools rendered; not enforced, there is no constrained decoding), none
  (no tools rendered), tool (only the named tool rendered); disable_parallel_tool_use keeps the first call.
- max_tokens (required, as Anthropic requires it: 400 "max_tokens: Field required"), stop_sequences, temperature,
  top_p, top_k, stream.
- thinking: {"type": "disabled"} turns thinking off, any other type (enabled, adaptive) on; budget_tokens is not
  enforced. Absent: the server's default.
- model: the served id or one of its aliases (`ninfer serve --model-alias`, e.g. the Claude model names a client
  such as Claude Code sends), else 404 not_found_error; the answer echoes it.
- accepted with no effect: metadata, service_tier, context_management, cache_control (top level, blocks, tools),
  container, diagnostics, inference_geo, speed, user_profile_id, workspace_id, output_config.effort. Refused with
  a 400 saying why: images, documents and other non-text blocks, server tools, mcp_servers, output formats, and
  any unknown field. Every 400 names the field (e.g. `messages[1].content[0].tool_use_id`).

Response: `{id: "msg_…", type: "message", role: "assistant", model, content, stop_reason, stop_sequence, usage}`.
content holds the blocks in the order the model wrote them: thinking{thinking, signature: ""}, text, tool_use{id:
"toolu_…", name, input}; an answer with none gets one empty text block. stop_reason: tool_use when there are tool
calls, max_tokens when the budget (or the context) ran out, stop_sequence (with `stop_sequence` set to it) when a
stop sequence ended the text, else end_turn. usage follows Anthropic's accounting: input_tokens are the prompt
tokens computed afresh, cache_read_input_tokens those resumed from the prefix cache (their sum is the prompt
length), cache_creation_input_tokens 0, output_tokens every generated token.

Streaming sends exactly: message_start (usage.input_tokens = the prompt length), ping, then per block
content_block_start, content_block_delta (thinking_delta / text_delta / one input_json_delta holding the whole
input), content_block_stop, then message_delta (stop_reason, stop_sequence, usage with the final counts) and
message_stop. A refusal before the first event (queue full, queue timeout) is an HTTP error; an error after it is
`event: error` with `{"type": "error", "error": {type, message}}`, and the stream ends.

count_tokens takes the same conversation fields and returns `{"input_tokens": N}`, the length of the prompt that
/v1/messages would build (template and tokenizer; no context-length check, no generation).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import Response
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from ninfer.engine import Request, Result
from ninfer.frontend import ToolCall
from ninfer.serve.answer import Answer, OrderedParts, StreamEvents, new_id, respond, speculative_usage
from ninfer.serve.conversation import Conversation, Sampling, engine_request, prompt_ids, with_system
from ninfer.serve.errors import APIError, anthropic_error_body
from ninfer.serve.request_log import record_of
from ninfer.serve.schema import LenientModel, StrictModel, parse_body, parse_tagged
from ninfer.serve.sse import sse_event
from ninfer.serve.state import ServerState, check_model
from ninfer.serve.tools import FunctionTool, arguments_json, template_call, tools_by_name

TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
BLOCK_SEPARATOR = "\n\n"  # between the text blocks of one turn

# ---------------------------------------------------------------------------------------------------------------
# request schema
# ---------------------------------------------------------------------------------------------------------------


class TextBlock(LenientModel):
    type: Literal["text"]
    text: str


class UnsupportedBlock(LenientModel):
    """A block kind this server cannot take (media, documents, server-tool results): refused with a 400."""

    type: str


class ToolUseBlock(LenientModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(LenientModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Any] | None = None  # text blocks (parsed by `_texts`)
    is_error: bool | None = None


class ThinkingBlock(LenientModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(LenientModel):
    type: Literal["redacted_thinking"]
    data: str | None = None


UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "server_tool_use", "web_search_tool_result",
                      "web_fetch_tool_result", "code_execution_tool_result", "container_upload")
BLOCKS: dict[str, type[LenientModel]] = {
    "text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock, "thinking": ThinkingBlock,
    "redacted_thinking": RedactedThinkingBlock, **dict.fromkeys(UNSUPPORTED_BLOCKS, UnsupportedBlock)}


class Message(StrictModel):
    """A turn; its content blocks are validated one by one (`_blocks`), so that an error names the block field."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Any]


class Tool(LenientModel):
    """A client tool. A server tool (a `type` such as "web_search_20250305") is refused in `template_tools`."""

    type: str | None = None
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "none", "tool"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(LenientModel):
    type: str
    budget_tokens: int | None = None


class ConversationRequest(StrictModel):
    """The fields that decide the prompt: everything count_tokens takes."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Any] | None = None  # text blocks
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    # accepted, no effect on the output
    context_management: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # refused unless empty (checked in `check_supported`)
    mcp_servers: list[Any] | None = None
    output_format: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


class MessagesRequest(ConversationRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    # accepted, no effect on the output
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None


def check_supported(body: ConversationRequest) -> None:
    """400 for request features this server cannot honour (rather than ignoring them)."""
    if body.mcp_servers:
        raise APIError(400, "mcp_servers: MCP connectors are not supported; call tools from the client",
                       param="mcp_servers")
    if body.output_format is not None:
        raise APIError(400, "output_format: structured outputs are not supported (no constrained decoding)",
                       param="output_format")
    refused = sorted(key for key, value in (body.output_config or {}).items() if key != "effort" and value is not None)
    if refused:
        extra = refused[0]
        raise APIError(400, f"output_config.{extra}: not supported (no constrained decoding)",
                       param=f"output_config.{extra}")


# ---------------------------------------------------------------------------------------------------------------
# request -> prompt
# ---------------------------------------------------------------------------------------------------------------


def _refuse_block(block: Any, param: str, role: str) -> APIError:
    if isinstance(block, UnsupportedBlock):
        return APIError(400, f"{param}.type: {block.type!r} blocks are not supported (this server takes text only)",
                        code="modality_not_supported", param=f"{param}.type")
    return APIError(400, f"{param}.type: a {block.type!r} block cannot appear in a {role} message",
                    code="invalid_value", param=f"{param}.type")


def _texts(content: str | list[Any] | None, param: str, role: str) -> str:
    """Content that may hold only text blocks, as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for index, raw in enumerate(content):
        block = parse_tagged(raw, BLOCKS, f"{param}[{index}]")
        if not isinstance(block, TextBlock):
            raise _refuse_block(block, f"{param}[{index}]", role)
        texts.append(block.text)
    return BLOCK_SEPARATOR.join(texts)


Located = list[tuple[str, Any]]  # (field path, block) pairs of one turn


def _blocks(message: Message, param: str) -> Located:
    if isinstance(message.content, str):
        return [(f"{param}.content", TextBlock(type="text", text=message.content))]
    located = [(f"{param}.content[{index}]", raw) for index, raw in enumerate(message.content)]
    return [(where, parse_tagged(raw, BLOCKS, where)) for where, raw in located]


def _user_turns(blocks: Located) -> list[dict[str, Any]]:
    """A user turn's tool results (one tool turn each, first) and its text (one user turn, if any)."""
    tool_turns, texts = [], []
    for where, block in blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            tool_turns.append({"role": "tool", "tool_call_id": block.tool_use_id,
                               "content": _texts(block.content, f"{where}.content", "tool_result")})
        else:
            raise _refuse_block(block, where, "user")
    if texts or not tool_turns:
        return [*tool_turns, {"role": "user", "content": BLOCK_SEPARATOR.join(texts)}]
    return tool_turns


def _assistant_turn(blocks: Located) -> dict[str, Any]:
    texts, reasoning, calls = [], [], []
    for where, block in blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append(template_call(block.id, block.name, arguments_json(block.input)))
        elif not isinstance(block, RedactedThinkingBlock):
            raise _refuse_block(block, where, "assistant")
    turn: dict[str, Any] = {"role": "assistant", "content": BLOCK_SEPARATOR.join(texts)}
    if reasoning:
        turn["reasoning_content"] = BLOCK_SEPARATOR.join(reasoning)
    if calls:
        turn["tool_calls"] = calls
    return turn


def template_messages(body: ConversationRequest) -> tuple[list[dict[str, Any]], str | None]:
    """The conversation as the chat template takes it (OpenAI-shape messages, one leading system turn), and the
    prefill: the text of a last assistant turn without tool calls (None when the conversation ends otherwise).
    Consecutive messages of one role are one turn, as Anthropic combines them."""
    system = [_texts(body.system, "system", "system")] if body.system else []
    turns: list[tuple[str, Located]] = []
    for index, message in enumerate(body.messages):
        param = f"messages[{index}]"
        if message.role == "system":
            system.append(_texts(message.content, f"{param}.content", "system"))
        elif turns and turns[-1][0] == message.role:
            turns[-1][1].extend(_blocks(message, param))
        else:
            turns.append((message.role, _blocks(message, param)))
    rendered: list[dict[str, Any]] = []
    for role, blocks in turns:
        rendered += _user_turns(blocks) if role == "user" else [_assistant_turn(blocks)]
    prefill = None
    if rendered and rendered[-1]["role"] == "assistant":
        last = rendered.pop()
        if "tool_calls" in last:
            param = f"messages[{len(body.messages) - 1}]"
            raise APIError(400, f"{param}: the conversation ends with a tool_use; send its tool_result in a "
                                "following user message", param=param)
        prefill = last["content"]
    return with_system(system, rendered), prefill


def template_tools(body: ConversationRequest) -> list[FunctionTool] | None:
    """The tools to render: none for tool_choice none, only the named one for tool, else all. 400 for server
    tools, a missing input_schema, duplicate names, or a choice that names no given tool."""

    def client_tools() -> Iterator[FunctionTool]:
        for index, tool in enumerate(body.tools or []):
            if tool.type not in (None, "custom"):
                raise APIError(400, f"tools[{index}].type: server tool {tool.type!r} is not supported; give client "
                                    "tools ({name, description, input_schema})", param=f"tools[{index}].type")
            if tool.input_schema is None:
                raise APIError(400, f"tools[{index}].input_schema: field required",
                               code="missing_required_parameter", param=f"tools[{index}].input_schema")
            yield FunctionTool(tool.name, tool.description, tool.input_schema)

    by_name = tools_by_name(client_tools(), "tools[{}].name", code=None)
    choice = body.tool_choice
    if choice is not None and choice.type in ("any", "tool") and not by_name:
        raise APIError(400, f"tool_choice.type: {choice.type!r} requires tools", param="tool_choice.type")
    if choice is not None and choice.type == "none":
        return None
    if choice is not None and choice.type == "tool":
        if choice.name not in by_name:
            raise APIError(400, f"tool_choice.name: {choice.name!r} is not among the tools",
                           param="tool_choice.name")
        return [by_name[choice.name]]
    return list(by_name.values()) or None


def thinking_of(body: ConversationRequest, default: bool, prefill: str | None) -> bool:
    """`thinking.type` "disabled" is off, any other type on; absent: off with a prefill, else `default`. A prefill
    with thinking on is a 400 (the answer would have to start inside the reasoning)."""
    if body.thinking is None:
        return default and prefill is None
    thinking = body.thinking.type != "disabled"
    if thinking and prefill is not None:
        raise APIError(400, "thinking: a conversation that ends with an assistant message (a prefill) needs "
                            "thinking disabled", param="thinking.type")
    return thinking


def read_request(body: ConversationRequest, default_thinking: bool) -> Conversation:
    """The Conversation of a validated request (its prefill included)."""
    check_supported(body)
    messages, prefill = template_messages(body)
    thinking = thinking_of(body, default_thinking, prefill)
    return Conversation(messages, template_tools(body), thinking, prefill=prefill)


# ---------------------------------------------------------------------------------------------------------------
# response
# ---------------------------------------------------------------------------------------------------------------


def stop_reason(result: Result, tool_calls: int) -> str:
    if tool_calls:
        return "tool_use"
    if result.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if result.stop_string is not None else "end_turn"


def usage_json(result: Result) -> dict[str, Any]:
    return {"input_tokens": result.prompt_tokens - result.cached_tokens, "output_tokens": result.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": result.cached_tokens,
            **speculative_usage(result)}


BLOCK_TEXT_FIELDS = {"reasoning": ("thinking", "thinking_delta"), "content": ("text", "text_delta")}


class ContentBlocks(OrderedParts):
    """Engine events -> Anthropic content blocks (thinking, text, tool_use) in the order the model wrote them.
    `feed` returns the SSE events (name, payload) that an event decides; `blocks` accumulates the finished blocks
    for a JSON answer."""

    def __init__(self, single_tool_call: bool):
        super().__init__(single_tool_call)
        self.blocks: list[dict[str, Any]] = []

    def _open_part(self, kind: str) -> StreamEvents:
        return self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "reasoning"
                           else {"type": "text", "text": ""})

    def _delta(self, kind: str, text: str) -> StreamEvents:
        field, delta = BLOCK_TEXT_FIELDS[kind]
        self.blocks[-1][field] += text
        return [("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                         "delta": {"type": delta, field: text}})]

    def _close_part(self, kind: str) -> StreamEvents:
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def _tool_call(self, call: ToolCall) -> StreamEvents:
        block = {"type": "tool_use", "id": new_id("toolu_"), "name": call.name, "input": {}}
        events = self._start(block)
        block["input"] = call.arguments
        index = len(self.blocks) - 1
        arguments = arguments_json(call.arguments)
        return [*events, ("content_block_delta", {"type": "content_block_delta", "index": index,
                                                  "delta": {"type": "input_json_delta", "partial_json": arguments}}),
                ("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _start(self, block: dict[str, Any]) -> StreamEvents:
        self.blocks.append(block)
        return [("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                         "content_block": dict(block)})]


class MessageAnswer(Answer):
    """One message: a `message` object, or Anthropic's stream events from message_start to message_stop."""

    def __init__(self, body: MessagesRequest, request: Request):
        self.body = body
        self.id = request.request_id
        self.what = f"message {self.id}"
        self.prompt_tokens = len(request.prompt_ids)
        self.blocks = ContentBlocks(bool(body.tool_choice and body.tool_choice.disable_parallel_tool_use))

    def message(self, content: list[dict[str, Any]], result: Result | None, tool_calls: int) -> dict[str, Any]:
        """The message object: whole (with `result`) or as message_start announces it (result None)."""
        done = result is not None
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.body.model, "content": content,
                "stop_reason": stop_reason(result, tool_calls) if done else None,
                "stop_sequence": result.stop_string if done and not tool_calls else None,
                "usage": usage_json(result) if done else {
                    "input_tokens": self.prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0}}

    def collect(self, event: Any) -> None:
        self.blocks.feed(event)

    def whole(self, result: Result) -> dict[str, Any]:
        return self.message(self.blocks.blocks or [{"type": "text", "text": ""}], result, self.blocks.tool_calls)

    def opening(self) -> list[bytes]:
        return [sse_event("message_start", {"type": "message_start", "message": self.message([], None, 0)}),
                sse_event("ping", {"type": "ping"})]

    def chunks(self, event: Any) -> list[bytes]:
        return [sse_event(name, payload) for name, payload in self.blocks.feed(event)]

    def failure(self, error: APIError) -> list[bytes]:
        return [sse_event("error", anthropic_error_body(error))]

    def closing(self, result: Result) -> list[bytes]:
        closing = [sse_event(name, payload) for name, payload in self.blocks.close()]
        final = self.message([], result, self.blocks.tool_calls)
        return [*closing, sse_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]},
            "usage": final["usage"]}), sse_event("message_stop", {"type": "message_stop"})]


# ---------------------------------------------------------------------------------------------------------------
# routes
# ---------------------------------------------------------------------------------------------------------------


def build_request(state: ServerState, body: MessagesRequest, request_id: str) -> Request:
    """The engine request of a validated Messages request (prompt rendered and tokenized, sampling resolved)."""
    conversation = read_request(body, state.config.default_thinking)
    sampling = Sampling(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                        top_p=body.top_p, top_k=body.top_k)
    return engine_request(state, conversation, sampling, request_id)


def router(state: ServerState) -> APIRouter:
    """The Anthropic Messages routes over `state`."""
    routes = APIRouter()

    @routes.post("/v1/messages")
    async def messages(http_request: HTTPRequest) -> Response:
        body = await parse_body(http_request, MessagesRequest)
        check_model(state, body.model)
        message_id = new_id("msg_")
        record = record_of(http_request)
        record.update(id=message_id, stream=bool(body.stream))
        request = await run_in_threadpool(build_request, state, body, message_id)
        record.update(thinking=request.thinking)
        return await respond(state, http_request, request, MessageAnswer(body, request), stream=bool(body.stream))

    @routes.post("/v1/messages/count_tokens")
    async def count_tokens(http_request: HTTPRequest) -> dict[str, int]:
        body = await parse_body(http_request, ConversationRequest)
        check_model(state, body.model)
        return {"input_tokens": len(prompt_ids(state, read_request(body, state.config.default_thinking),
                                               limit=False))}

    return routes
