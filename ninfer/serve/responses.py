"""OpenAI Responses (core): `POST /v1/responses` (JSON or semantic server-sent events), `POST
/v1/responses/input_tokens` (`{"object": "response.input_tokens", "input_tokens": N}`: the prompt a response request
would build, without the context-length check), and `GET` / `DELETE /v1/responses/{id}` over a bounded in-memory
store.

Request:

- input: a string (one user message) or items: messages (role user, system, developer or assistant; content a
  string or input_text / output_text / refusal parts; `type` may be left out), function_call {call_id, name,
  arguments}, function_call_output {call_id, output: a string or text parts} and reasoning (its reasoning_text
  content, else its summary, becomes the reasoning of the assistant turn that follows). An assistant message and
  the function calls after it are one assistant turn. System and developer messages are folded, in order, into
  the one leading system turn the Qwen template has, after `instructions`.
- previous_response_id: the conversation continues a stored response: its input and output items come before
  this request's input. Its instructions are not carried over (as OpenAI does). The store keeps the last
  `STORE_SIZE` responses created with `store` not false; an unknown id is a 404 (code previous_response_not_found).
- tools: function tools in the flat shape {type: "function", name, description, parameters, strict}; tool_choice
  none (no tools rendered) / auto / required (all rendered; required is not enforced: no constrained decoding) /
  {type: "function", name} (only that tool rendered); parallel_tool_calls=false keeps the first call.
- max_output_tokens (default: the server's), temperature, top_p; reasoning.effort none or minimal turns thinking
  off, any other level on (the template has no levels); absent: the server's default. `model` (required; optional
  for input_tokens) must be the served id or one of its aliases, else 404 model_not_found.
- accepted with no effect: include, metadata, prompt_cache_key, prompt_cache_retention, safety_identifier,
  service_tier, user, truncation (nothing is truncated: a prompt over the context is a 400), text.verbosity,
  stream_options, reasoning.summary, max_tool_calls. Refused with a 400 saying why: background, conversation,
  prompt, top_logprobs, text.format other than text, non-function tools, media parts, any unknown field.

Response: `{id: "resp_…", object: "response", created_at, status: completed | incomplete, model, output, usage,
incomplete_details, …}` with output items in the order the model wrote them: reasoning {id: "rs_…", summary: [],
content: [{type: "reasoning_text", text}]}, message {id: "msg_…", role: assistant, content: [{type:
"output_text", text, annotations: []}]}, function_call {id: "fc_…", call_id: "call_…", name, arguments (JSON)}.
status is incomplete (incomplete_details.reason max_output_tokens) when the budget or the context ran out. usage:
input_tokens (the whole prompt), input_tokens_details.cached_tokens (resumed from the prefix cache),
output_tokens, output_tokens_details.reasoning_tokens, total_tokens.

Streaming sends named events, each with a `sequence_number` counting from 0: response.created,
response.in_progress, then per item response.output_item.added, and for reasoning / message items
response.content_part.added, response.reasoning_text.delta / response.output_text.delta…, the matching .done,
response.content_part.done; for function calls response.function_call_arguments.delta (the whole arguments) and
.done; then response.output_item.done; finally response.completed (or response.incomplete). There is no [DONE].
A refusal before the engine's first event (queue full, queue timeout) is an HTTP error; a failure after it is an
`error` event followed by response.failed.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Literal

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import Response
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from ninfer.engine import Request, Result
from ninfer.frontend import ToolCall
from ninfer.serve.answer import Answer, OrderedParts, StreamEvents, new_id, reasoning_tokens, respond, speculative_usage
from ninfer.serve.conversation import (
    Conversation,
    Sampling,
    engine_request,
    prompt_ids,
    resolve_thinking,
    with_system,
)
from ninfer.serve.errors import APIError
from ninfer.serve.request_log import record_of
from ninfer.serve.schema import JSONObjectString, LenientModel, StrictModel, parse_body, parse_tagged
from ninfer.serve.sse import sse_event
from ninfer.serve.state import ServerState, check_model
from ninfer.serve.tools import FunctionTool, OpenAIFunction, arguments_json, template_call, tools_by_name

STORE_SIZE = 256  # responses kept for previous_response_id (least recently used dropped first)

# ---------------------------------------------------------------------------------------------------------------
# request schema
# ---------------------------------------------------------------------------------------------------------------


class TextPart(LenientModel):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(LenientModel):
    type: Literal["refusal"]
    refusal: str


class MediaPart(LenientModel):
    """input_image / input_file / input_audio: refused (this server takes text only)."""

    type: str


PARTS: dict[str, type[LenientModel]] = {"input_text": TextPart, "output_text": TextPart, "refusal": RefusalPart,
                                        "input_image": MediaPart, "input_file": MediaPart, "input_audio": MediaPart}


class MessageItem(LenientModel):
    type: Literal["message"]
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Any]  # parts, parsed by `_text`


class FunctionCallItem(LenientModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: JSONObjectString


class FunctionCallOutputItem(LenientModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Any]  # text parts, parsed by `_text`


class ReasoningItem(LenientModel):
    type: Literal["reasoning"]
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None


class ReasoningPart(LenientModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


ITEMS: dict[str, type[LenientModel]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                        "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


class FlatFunctionTool(OpenAIFunction):
    """A function tool in Responses' flat shape: OpenAI's function fields beside `type`."""

    model_config = LenientModel.model_config
    type: Literal["function"]


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    name: str


class ReasoningConfig(LenientModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None


class TextFormat(LenientModel):
    type: str


class TextConfig(LenientModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(StrictModel):
    model: str
    input: str | list[Any] | None = None  # items, parsed by `parse_items`
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None  # function tools, parsed by `template_tools`
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None
    store: bool | None = None
    text: TextConfig | None = None
    # accepted, no effect on the output
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    max_tool_calls: int | None = None
    # refused unless absent or trivially satisfied (checked in `check_supported`)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None


class InputTokensRequest(ResponsesRequest):
    """`POST /v1/responses/input_tokens`: the fields of a response request (those that do not shape the prompt are
    accepted and ignored); `model` may be left out, as OpenAI allows here."""

    model: str | None = None
    personality: str | None = None


def check_supported(body: ResponsesRequest) -> None:
    """400 for request features this server cannot honour (rather than ignoring them)."""
    if body.background:
        raise APIError(400, "background: background responses are not supported; stream instead",
                       code="unsupported_parameter", param="background")
    for name in ("conversation", "prompt"):
        if getattr(body, name) is not None:
            raise APIError(400, f"{name}: stored {name}s are not supported; send the input (or use "
                                "previous_response_id)", code="unsupported_parameter", param=name)
    if body.top_logprobs:
        raise APIError(400, "top_logprobs: log probabilities are not supported", code="unsupported_parameter",
                       param="top_logprobs")
    if body.text is not None and body.text.format is not None and body.text.format.type != "text":
        raise APIError(400, f"text.format.type: {body.text.format.type!r} is not supported (no constrained "
                            "decoding); only 'text'", code="response_format_not_supported", param="text.format.type")


# ---------------------------------------------------------------------------------------------------------------
# request -> prompt
# ---------------------------------------------------------------------------------------------------------------


def parse_items(raw: str | list[Any] | None) -> list[dict[str, Any]]:
    """The request's input as a list of validated item dicts (a string is one user message; `type` defaults to
    message). Raises 400 naming the field (input[i]…) on any violation."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    items = []
    for index, item in enumerate(raw):
        where = f"input[{index}]"
        parsed = parse_tagged(item, ITEMS, where, default_type="message")
        if isinstance(parsed, MessageItem):
            _text(parsed.content, f"{where}.content")
        elif isinstance(parsed, FunctionCallOutputItem):
            _text(parsed.output, f"{where}.output")
        elif isinstance(parsed, ReasoningItem):
            _reasoning_text(parsed, where)
        items.append({**item, "type": parsed.type})
    return items


def _text(content: str | list[Any], param: str) -> str:
    """A content string, or its text and refusal parts concatenated; 400 for media parts."""
    if isinstance(content, str):
        return content
    texts = []
    for index, raw in enumerate(content):
        where = f"{param}[{index}]"
        part = parse_tagged(raw, PARTS, where)
        if isinstance(part, MediaPart):
            raise APIError(400, f"{where}.type: {part.type!r} parts are not supported (this server takes text only)",
                           code="modality_not_supported", param=f"{where}.type")
        texts.append(part.text if isinstance(part, TextPart) else part.refusal)
    return "".join(texts)


def _reasoning_text(item: ReasoningItem, where: str) -> str:
    """A reasoning item's reasoning_text content, else its summary texts, joined by blank lines."""
    field = "content" if item.content else "summary"
    parts = [parse_tagged(raw, {"reasoning_text": ReasoningPart, "summary_text": ReasoningPart},
                          f"{where}.{field}[{index}]") for index, raw in enumerate(item.content or item.summary)]
    return "\n\n".join(part.text for part in parts)


def template_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Items (validated by `parse_items`) -> the conversation as the chat template takes it: one leading system
    turn (instructions, then system / developer messages), user, assistant (content, reasoning_content,
    tool_calls) and tool turns."""
    system = [instructions] if instructions else []
    rendered: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn that is still open

    def assistant() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            rendered.append(turn)
        return turn

    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item["type"]
        if kind == "message" and item["role"] == "assistant":
            if turn is not None and "tool_calls" in turn:  # text after tool calls starts a new turn
                turn = None
            current = assistant()
            current["content"] += _text(item["content"], f"{where}.content")
        elif kind == "function_call":
            assistant().setdefault("tool_calls", []).append(
                template_call(item["call_id"], item["name"], item["arguments"]))
        elif kind == "reasoning":
            if turn is not None and (turn["content"] or "tool_calls" in turn or "reasoning_content" in turn):
                turn = None
            assistant()["reasoning_content"] = _reasoning_text(ReasoningItem.model_validate(item), where)
        else:
            turn = None
            if kind == "function_call_output":
                rendered.append({"role": "tool", "tool_call_id": item["call_id"],
                                 "content": _text(item["output"], f"{where}.output")})
            elif item["role"] in ("system", "developer"):
                system.append(_text(item["content"], f"{where}.content"))
            else:
                rendered.append({"role": "user", "content": _text(item["content"], f"{where}.content")})
    return with_system(system, rendered)


def template_tools(body: ResponsesRequest) -> list[FunctionTool] | None:
    """The tools to render: none for tool_choice none, only the named one for a named choice, else all. 400 for
    non-function tools, duplicate names, a required or named choice without tools, or a named tool that is not
    among them."""
    wire = [parse_tagged(raw, {"function": FlatFunctionTool}, f"tools[{index}]")
            for index, raw in enumerate(body.tools or [])]
    by_name = tools_by_name((tool.tool() for tool in wire), "tools[{}].name")
    choice = body.tool_choice
    if choice not in (None, "none", "auto") and not by_name:
        raise APIError(400, "tool_choice: requires tools", code="invalid_value", param="tool_choice")
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        if choice.name not in by_name:
            raise APIError(400, f"tool_choice.name: {choice.name!r} is not among the tools", code="invalid_value",
                           param="tool_choice.name")
        return [by_name[choice.name]]
    return list(by_name.values()) or None


def read_request(body: ResponsesRequest, history: list[dict[str, Any]],
                 default_thinking: bool) -> tuple[list[dict[str, Any]], Conversation]:
    """The conversation's items (`history`, then this request's input) and the Conversation they make."""
    check_supported(body)
    items = history + parse_items(body.input)
    if not any(item["type"] != "reasoning" for item in items):
        raise APIError(400, "input: give at least one message (or a previous_response_id)",
                       code="missing_required_parameter", param="input")
    messages = template_messages(items, body.instructions)
    effort = body.reasoning.effort if body.reasoning else None
    thinking = resolve_thinking(default_thinking,
                                ("reasoning.effort", None if effort is None else effort not in ("none", "minimal")))
    return items, Conversation(messages, template_tools(body), thinking)


def build_request(state: ServerState, body: ResponsesRequest, history: list[dict[str, Any]],
                  request_id: str) -> tuple[Request, list[dict[str, Any]]]:
    """The engine request of a validated Responses request, and the conversation's items."""
    items, conversation = read_request(body, history, state.config.default_thinking)
    sampling = Sampling(max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p)
    return engine_request(state, conversation, sampling, request_id), items


# ---------------------------------------------------------------------------------------------------------------
# response
# ---------------------------------------------------------------------------------------------------------------


class OutputItems(OrderedParts):
    """Engine events -> Responses output items (reasoning, message, function_call) in the order the model wrote
    them. `feed` returns the stream events (name, payload without sequence_number) that an event decides; `items`
    accumulates the finished items for a JSON answer."""

    def __init__(self, single_tool_call: bool):
        super().__init__(single_tool_call)
        self.items: list[dict[str, Any]] = []

    def _open_part(self, kind: str) -> StreamEvents:
        if kind == "reasoning":
            item = {"id": new_id("rs_"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": new_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events = self._add(item)
        item["content"].append(part)
        return [*events, ("response.content_part.added", {**self._where(), "content_index": 0, "part": _copy(part)})]

    def _delta(self, kind: str, text: str) -> StreamEvents:
        self.items[-1]["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        delta = {**self._where(), "content_index": 0, "delta": text}
        return [(name, delta if kind == "reasoning" else {**delta, "logprobs": []})]

    def _close_part(self, kind: str) -> StreamEvents:
        item = self.items[-1]
        item["status"] = "completed"
        part = item["content"][0]
        where = {**self._where(), "content_index": 0}
        done = ({**where, "text": part["text"]} if kind == "reasoning"
                else {**where, "text": part["text"], "logprobs": []})
        name = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        return [(name, done), ("response.content_part.done", {**where, "part": _copy(part)}),
                ("response.output_item.done", {"output_index": where["output_index"], "item": _copy(item)})]

    def _tool_call(self, call: ToolCall) -> StreamEvents:
        arguments = arguments_json(call.arguments)
        item = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress", "call_id": new_id("call_"),
                "name": call.name, "arguments": ""}
        events = self._add(item)
        item.update(arguments=arguments, status="completed")
        where = self._where()
        return [*events, ("response.function_call_arguments.delta", {**where, "delta": arguments}),
                ("response.function_call_arguments.done", {**where, "name": call.name, "arguments": arguments}),
                ("response.output_item.done", {"output_index": where["output_index"], "item": _copy(item)})]

    def _add(self, item: dict[str, Any]) -> StreamEvents:
        self.items.append(item)
        return [("response.output_item.added", {"output_index": len(self.items) - 1, "item": _copy(item)})]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item or part as it is now (the builder keeps changing its own)."""
    return json.loads(json.dumps(value))


def output_as_input(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the input items that continue the conversation (what previous_response_id replays)."""
    replay = []
    for item in items:
        if item["type"] == "message":
            replay.append({"type": "message", "role": "assistant",
                           "content": [{"type": "output_text", "text": item["content"][0]["text"]}]})
        elif item["type"] == "reasoning":
            replay.append({"type": "reasoning", "summary": [], "content": item["content"]})
        else:
            replay.append({key: item[key] for key in ("type", "call_id", "name", "arguments")})
    return replay


class ResponseAnswer(Answer):
    """One response: a `response` object, or Responses' semantic events (each with its `sequence_number`). A
    finished response is stored for previous_response_id (a stream's once its last item is closed)."""

    def __init__(self, state: ServerState, body: ResponsesRequest, request: Request, items: list[dict[str, Any]],
                 store: ResponseStore):
        self.state = state
        self.body = body
        self.id = request.request_id
        self.what = f"response {self.id}"
        self.thinking = request.thinking
        self.items = items
        self.store = store
        self.created_at = int(time.time())
        self.output = OutputItems(single_tool_call=body.parallel_tool_calls is False)
        self.sequence = 0  # of the next stream event

    def response(self, result: Result | None, status: str = "in_progress",
                 error: APIError | None = None) -> dict[str, Any]:
        """The response object: in progress (no result yet), completed / incomplete (with `result`) or failed."""
        body = self.body
        if result is not None:
            status = "incomplete" if result.finish_reason == "length" else "completed"
        reasoning = body.reasoning.effort if body.reasoning else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if result is not None else None,
            "error": {"code": error.code or "server_error", "message": error.message} if error else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.state.model_id, "output": [_copy(item) for item in self.output.items],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": reasoning, "summary": None}, "store": body.store is not False,
            "temperature": body.temperature, "text": {"format": {"type": "text"}},
            "tool_choice": (body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice)
                            else body.tool_choice or "auto"),
            "tools": body.tools or [], "top_p": body.top_p, "truncation": body.truncation or "disabled",
            "usage": self.usage(result) if result is not None else None,
            "metadata": body.metadata or {}, "user": body.user}

    def usage(self, result: Result) -> dict[str, Any]:
        reasoning = reasoning_tokens(result, self.state.llm.tokenizer, self.thinking)
        return {"input_tokens": result.prompt_tokens,
                "input_tokens_details": {"cached_tokens": result.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": result.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": result.prompt_tokens + result.completion_tokens, **speculative_usage(result)}

    def save(self, response: dict[str, Any]) -> None:
        """Store the finished response, unless the request says `store: false`."""
        if self.body.store is not False:
            self.store.put(self.id, response, self.items + output_as_input(self.output.items))

    def send(self, name: str, payload: dict[str, Any]) -> bytes:
        self.sequence += 1
        return sse_event(name, {"type": name, "sequence_number": self.sequence - 1, **payload})

    def collect(self, event: Any) -> None:
        self.output.feed(event)

    def whole(self, result: Result) -> dict[str, Any]:
        self.output.close()
        response = self.response(result)
        self.save(response)
        return response

    def opening(self) -> list[bytes]:
        return [self.send("response.created", {"response": self.response(None)}),
                self.send("response.in_progress", {"response": self.response(None)})]

    def chunks(self, event: Any) -> list[bytes]:
        return [self.send(name, payload) for name, payload in self.output.feed(event)]

    def failure(self, error: APIError) -> list[bytes]:
        return [self.send("error", {"code": error.code, "message": error.message, "param": error.param}),
                self.send("response.failed", {"response": self.response(None, "failed", error)})]

    def closing(self, result: Result) -> Iterator[bytes]:
        for name, payload in self.output.close():
            yield self.send(name, payload)
        response = self.response(result)
        self.save(response)
        final = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield self.send(final, {"response": response})


class ResponseStore:
    """The last `size` stored responses by id (least recently used dropped first): each response object and the
    conversation items (input and output) that a follow-up with previous_response_id continues."""

    def __init__(self, size: int = STORE_SIZE):
        self.size = size
        self._records: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, response_id: str, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        self._records[response_id] = (response, items)
        self._records.move_to_end(response_id)
        while len(self._records) > self.size:
            self._records.popitem(last=False)

    def get(self, response_id: str, param: str = "previous_response_id") -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(response, conversation items) of a stored response; 404 previous_response_not_found if unknown."""
        if response_id not in self._records:
            code = "previous_response_not_found" if param == "previous_response_id" else "response_not_found"
            raise APIError(404, f"{param}: no stored response {response_id!r} (this server keeps the last "
                                f"{self.size} responses in memory, and none created with store=false)",
                           code=code, param=param)
        self._records.move_to_end(response_id)
        return self._records[response_id]

    def delete(self, response_id: str) -> None:
        self.get(response_id, param="response_id")
        del self._records[response_id]


# ---------------------------------------------------------------------------------------------------------------
# routes
# ---------------------------------------------------------------------------------------------------------------


def router(state: ServerState) -> APIRouter:
    """The Responses routes over `state`, with their own response store."""
    routes = APIRouter()
    store = ResponseStore()

    def history(body: ResponsesRequest) -> list[dict[str, Any]]:
        if body.model is not None:
            check_model(state, body.model)
        return store.get(body.previous_response_id)[1] if body.previous_response_id else []

    @routes.post("/v1/responses")
    async def create(http_request: HTTPRequest) -> Response:
        body = await parse_body(http_request, ResponsesRequest)
        request, items = await run_in_threadpool(build_request, state, body, history(body), new_id("resp_"))
        record_of(http_request).update(id=request.request_id, stream=bool(body.stream), thinking=request.thinking)
        answer = ResponseAnswer(state, body, request, items, store)
        return await respond(state, http_request, request, answer, stream=bool(body.stream))

    @routes.post("/v1/responses/input_tokens")
    async def input_tokens(http_request: HTTPRequest) -> dict[str, Any]:
        body = await parse_body(http_request, InputTokensRequest)
        _, conversation = read_request(body, history(body), state.config.default_thinking)
        return {"object": "response.input_tokens", "input_tokens": len(prompt_ids(state, conversation, limit=False))}

    @routes.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict[str, Any]:
        return store.get(response_id, param="response_id")[0]

    @routes.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return routes
