"""The OpenAI Responses API over loopback, driven by the official `openai` SDK and httpx: answers equal the
single-sequence LLM's (greedy), streamed semantic events (with sequence numbers) rebuild the same response, thinking
on/off by reasoning effort, input items rendered as the hand-written chat conversation, function calls round trip
through previous_response_id, the response store, and every error status in OpenAI's shape."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from ninfer.engine import LLM, Engine
from ninfer.frontend import ContentDelta, ReasoningDelta, ToolCall
from ninfer.serve.app import create_app
from ninfer.serve.state import ServeConfig
from tests.serve.support import (
    Loopback,
    ScriptedEngine,
    greedy,
    one_slot_taken,
    wait_until,
)

MODEL = "test-model"
KEY = "sk-test-key"
BODY_LIMIT = 256 << 10
QUESTION = "What is the capital of France?"
HELLO = [{"role": "user", "content": QUESTION}]
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather of a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"type": "function", "name": "get_time", "description": "Local time of a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
]
CHAT_TOOLS = [{"type": "function", "function": {key: t[key] for key in ("name", "description", "parameters")}}
              for t in TOOLS]
OFF = {"effort": "none"}


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[Loopback]:
    loopback = Loopback(create_app(engine, ServeConfig(model_id=MODEL, api_key=KEY, max_body_bytes=BODY_LIMIT)))
    yield loopback
    loopback.stop()


@pytest.fixture(scope="module")
def client(server: Loopback) -> openai.OpenAI:
    return server.openai_client(KEY)


@pytest.fixture(scope="module")
def reasoning_server(reasoning_engine: Engine) -> Iterator[Loopback]:
    """As `server`, over the model that reasons (conftest's `reasoning_llm`)."""
    loopback = Loopback(create_app(reasoning_engine, ServeConfig(model_id=MODEL, api_key=KEY,
                                                                 max_body_bytes=BODY_LIMIT)))
    yield loopback
    loopback.stop()


def sse(url: str, body: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """(status, event payloads) of a streamed request read with httpx, asserting `event:` names match `type` and
    sequence numbers count from 0."""
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    if response.status_code != 200:
        return response.status_code, [json.loads(lines[0])]
    events = []
    for name, data in zip(lines[::2], lines[1::2], strict=True):
        assert name.startswith("event: ") and data.startswith("data: "), (name, data)
        payload = json.loads(data[6:])
        assert payload["type"] == name[7:] and payload["sequence_number"] == len(events)
        events.append(payload)
    return response.status_code, events


def without_ids(output: list[Any]) -> list[dict[str, Any]]:
    """Output items as dicts without their random ids (streamed and whole answers get their own)."""
    items = [item if isinstance(item, dict) else item.model_dump(exclude_none=True) for item in output]
    return [{key: value for key, value in item.items() if key not in ("id", "call_id")} for item in items]


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI-shape error of a response (asserting status and shape)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


# ---------------------------------------------------------------------------------------------------------------
# answers
# ---------------------------------------------------------------------------------------------------------------


def test_response_equals_single_sequence_llm_and_stream(reasoning_server: Loopback, reasoning_llm: LLM) -> None:
    server, llm = reasoning_server, reasoning_llm
    client = server.openai_client(KEY)
    expected = greedy(llm, HELLO, 12)
    assert expected.reasoning and expected.finish_reason == "length"
    answer = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0)
    assert answer.id.startswith("resp_") and answer.object == "response" and answer.model == MODEL
    assert (answer.status, answer.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    reasoning = answer.output[0]
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", expected.reasoning)]
    assert answer.output_text == expected.text
    assert [item.type for item in answer.output] == ["reasoning"] + (["message"] if expected.text else [])
    usage = answer.usage
    assert usage.input_tokens == len(llm.prompt_ids(HELLO)) and usage.output_tokens == 12
    assert usage.total_tokens == usage.input_tokens + 12 and usage.output_tokens_details.reasoning_tokens > 0
    assert usage.input_tokens_details.cached_tokens >= 0

    status, events = sse(server.url, {"model": MODEL, "input": QUESTION, "max_output_tokens": 12, "temperature": 0})
    assert status == 200
    names = [event["type"] for event in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:-1] == ["response.reasoning_text.done" if not expected.text else "response.output_text.done",
                            "response.content_part.done", "response.output_item.done"]
    assert names[-1] == "response.incomplete" and "[DONE]" not in json.dumps(events)
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert len({event["response"]["id"] for event in events if "response" in event}) == 1
    final = events[-1]["response"]
    assert without_ids(final["output"]) == without_ids(answer.output)
    assert final["usage"]["input_tokens"] == usage.input_tokens and final["usage"]["output_tokens"] == 12
    assert final["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the same prompt again: prefix reused
    reasoning_deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text_deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (reasoning_deltas, text_deltas) == (expected.reasoning, expected.text)

    # the SDK's stream helper follows the events (incomplete: there is no response.completed to finish on)
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0) as stream:
        sdk_events = list(stream)
    assert [e.sequence_number for e in sdk_events] == list(range(len(sdk_events)))
    assert sdk_events[-1].type == "response.incomplete"
    assert without_ids(sdk_events[-1].response.output) == without_ids(answer.output)


def test_reasoning_effort_turns_thinking_on_and_off(reasoning_server: Loopback, reasoning_llm: LLM) -> None:
    client, llm = reasoning_server.openai_client(KEY), reasoning_llm
    expected = greedy(llm, HELLO, 16, thinking=False)
    assert expected.text and not expected.reasoning
    for effort in ("none", "minimal"):
        answer = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0,
                                         reasoning={"effort": effort})
        assert [item.type for item in answer.output] == ["message"] and answer.output_text == expected.text
        assert answer.output[0].content[0].annotations == [] and answer.output[0].role == "assistant"
        assert answer.usage.input_tokens == len(llm.prompt_ids(HELLO, thinking=False))
        assert answer.usage.output_tokens_details.reasoning_tokens == 0 and answer.reasoning.effort == effort
    on = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0,
                                 reasoning={"effort": "high"})
    assert on.output[0].type == "reasoning" and on.output[0].content[0].text == greedy(llm, HELLO, 8).reasoning


def test_input_items_render_as_the_chat_conversation(client: openai.OpenAI, llm: LLM) -> None:
    """Each Responses input is counted (input_tokens) and prompted (usage) as its hand-written chat equivalent."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    cases = [
        ({"input": QUESTION}, HELLO, None, True),
        ({"input": QUESTION, "instructions": "Be terse.", "reasoning": OFF},
         [{"role": "system", "content": "Be terse."}, *HELLO], None, False),
        ({"instructions": "One.", "input": [
            {"role": "developer", "content": "Two."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi "},
                                                            {"type": "input_text", "text": "there"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
            {"role": "system", "content": "Three."},
            {"role": "user", "content": QUESTION}]},
         [{"role": "system", "content": "One.\n\nTwo.\n\nThree."}, {"role": "user", "content": "Hi there"},
          {"role": "assistant", "content": "Hello."}, *HELLO], None, True),
        ({"input": QUESTION, "tools": TOOLS}, HELLO, CHAT_TOOLS, True),
        ({"input": QUESTION, "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"}}, HELLO,
         CHAT_TOOLS[1:], True),
        ({"input": QUESTION, "tools": TOOLS, "tool_choice": "none"}, HELLO, None, True),
        ({"input": [*HELLO, {"type": "reasoning", "summary": [], "content": [
            {"type": "reasoning_text", "text": "Use the tool."}]},
                    {"role": "assistant", "content": "Checking."}, call,
                    {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}], "tools": TOOLS},
         [*HELLO, {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.",
                   "tool_calls": [{"id": "call_1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}], CHAT_TOOLS, True),
    ]
    for request, messages, tools, thinking in cases:
        expected = len(llm.prompt_ids(messages, tools=tools, thinking=thinking))
        assert client.responses.input_tokens.count(model=MODEL, **request).input_tokens == expected, request
        answer = client.responses.create(model=MODEL, max_output_tokens=1, temperature=0, **request)
        assert answer.usage.input_tokens == expected, request


# ---------------------------------------------------------------------------------------------------------------
# function calls and previous_response_id (a scripted engine plays the model: the tiny model does not call tools)
# ---------------------------------------------------------------------------------------------------------------


def test_function_call_round_trip(llm: LLM) -> None:
    calls = [ToolCall("get_weather", {"city": "Paris"}, "<tool_call>…</tool_call>"),
             ToolCall("get_time", {"city": "Oslo", "utc": True}, "<tool_call>…</tool_call>")]
    engine = ScriptedEngine(llm, [ReasoningDelta("Let me "), ReasoningDelta("look."), ContentDelta("Checking."),
                                  *calls])
    scripted = Loopback(create_app(engine, ServeConfig(model_id=MODEL)))  # type: ignore[arg-type]
    client = scripted.openai_client(KEY)
    try:
        question = "Weather in Paris, time in Oslo?"
        first = client.responses.create(model=MODEL, input=question, tools=TOOLS)
        assert first.status == "completed" and first.incomplete_details is None
        assert [item.type for item in first.output] == ["reasoning", "message", "function_call", "function_call"]
        assert (first.output[0].content[0].text, first.output_text) == ("Let me look.", "Checking.")
        functions = first.output[2:]
        assert [(f.name, json.loads(f.arguments)) for f in functions] == [
            ("get_weather", {"city": "Paris"}), ("get_time", {"city": "Oslo", "utc": True})]
        assert all(f.call_id.startswith("call_") and f.id.startswith("fc_") for f in functions)
        assert functions[0].call_id != functions[1].call_id

        with client.responses.stream(model=MODEL, input=question, tools=TOOLS) as stream:
            sdk_events = list(stream)
            streamed = stream.get_final_response()
        assert without_ids(streamed.output) == without_ids(first.output)
        kinds = [e.type for e in sdk_events]
        assert kinds.count("response.function_call_arguments.delta") == 2
        done = [e for e in sdk_events if e.type == "response.function_call_arguments.done"]
        assert [json.loads(e.arguments) for e in done] == [call.arguments for call in calls]
        assert kinds[-1] == "response.completed"
        single = client.responses.create(model=MODEL, input=question, tools=TOOLS, parallel_tool_calls=False)
        assert [item.name for item in single.output if item.type == "function_call"] == ["get_weather"]

        # the results go back by previous_response_id: the stored conversation continues
        outputs = [{"type": "function_call_output", "call_id": functions[0].call_id, "output": "18 C, sunny"},
                   {"type": "function_call_output", "call_id": functions[1].call_id,
                    "output": [{"type": "input_text", "text": "09:00"}]}]
        chat = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "Let me look.",
             "tool_calls": [{"id": f.call_id, "type": "function",
                             "function": {"name": f.name, "arguments": f.arguments}} for f in functions]},
            {"role": "tool", "tool_call_id": functions[0].call_id, "content": "18 C, sunny"},
            {"role": "tool", "tool_call_id": functions[1].call_id, "content": "09:00"},
        ]
        ids = llm.prompt_ids(chat, tools=CHAT_TOOLS)
        text = llm.tokenizer.decode(ids)
        assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text
        assert "<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n09:00\n</tool_response>" in text
        second = client.responses.create(model=MODEL, previous_response_id=first.id, input=outputs, tools=TOOLS)
        assert second.previous_response_id == first.id and second.usage.input_tokens == len(ids)
        assert client.responses.input_tokens.count(model=MODEL, previous_response_id=first.id, input=outputs,
                                                   tools=TOOLS).input_tokens == len(ids)
        streamed_second = sse(scripted.url, {"model": MODEL, "previous_response_id": first.id, "input": outputs,
                                             "tools": TOOLS})[1][-1]["response"]
        assert streamed_second["usage"]["input_tokens"] == len(ids)

        # the store: retrieve, a chain of follow-ups, delete, store=false
        assert client.responses.retrieve(first.id).output_text == "Checking."
        chained = client.responses.create(model=MODEL, previous_response_id=streamed_second["id"], input="And?",
                                          tools=TOOLS)
        calls_again = [item for item in streamed_second["output"] if item["type"] == "function_call"]
        chat += [{"role": "assistant", "content": "Checking.", "reasoning_content": "Let me look.",
                  "tool_calls": [{"id": f["call_id"], "type": "function",
                                  "function": {"name": f["name"], "arguments": f["arguments"]}} for f in calls_again]},
                 {"role": "user", "content": "And?"}]
        assert chained.usage.input_tokens == len(llm.prompt_ids(chat, tools=CHAT_TOOLS))
        client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError) as gone:
            client.responses.create(model=MODEL, previous_response_id=first.id, input="x")
        assert gone.value.code == "previous_response_not_found" and gone.value.param == "previous_response_id"
        unstored = client.responses.create(model=MODEL, input="x", store=False)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unstored.id)
    finally:
        scripted.stop()


# ---------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"model": MODEL, "input": QUESTION, "temperature": "hot"}, "temperature", "invalid_type"),
    ({"model": MODEL, "input": QUESTION, "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"model": MODEL, "input": QUESTION, "best_of": 2}, "best_of", "unknown_parameter"),
    ({"model": MODEL}, "input", "missing_required_parameter"),
    ({"model": MODEL, "input": [{"role": "tool", "content": "x"}]}, "input[0].role", "invalid_value"),
    ({"model": MODEL, "input": [{"type": "web_search_call"}]}, "input[0].type", "invalid_value"),
    ({"model": MODEL, "input": [5]}, "input[0]", "invalid_type"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "modality_not_supported"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0].text", "missing_required_parameter"),
    ({"model": MODEL, "input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments",
     "missing_required_parameter"),
    ({"model": MODEL, "input": [*HELLO, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input[1].arguments", "invalid_value"),
    ({"model": MODEL, "input": QUESTION, "tools": [{"type": "web_search"}]}, "tools[0].type", "invalid_value"),
    ({"model": MODEL, "input": QUESTION, "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name",
     "invalid_value"),
    ({"model": MODEL, "input": QUESTION, "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name", "invalid_value"),
    ({"model": MODEL, "input": QUESTION, "reasoning": {"effort": "extreme"}}, "reasoning.effort", "invalid_value"),
    ({"model": MODEL, "input": QUESTION, "text": {"format": {"type": "json_object"}}}, "text.format.type",
     "response_format_not_supported"),
    ({"model": MODEL, "input": QUESTION, "background": True}, "background", "unsupported_parameter"),
    ({"model": MODEL, "input": "word " * 6000}, "messages", "context_length_exceeded"),
])
def test_schema_errors_name_the_field(server: Loopback, body: dict, param: str, code: str) -> None:
    response = httpx.post(f"{server.url}/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"})
    error = openai_error(response, 400)
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert param in error["message"]


def test_sdk_errors(server: Loopback, client: openai.OpenAI) -> None:
    with pytest.raises(openai.AuthenticationError) as denied:
        server.openai_client("wrong").responses.create(model=MODEL, input=QUESTION)
    assert denied.value.status_code == 401 and denied.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as model:
        client.responses.create(model="gpt-5", input=QUESTION)
    assert model.value.code == "model_not_found" and model.value.param == "model"
    with pytest.raises(openai.NotFoundError) as previous:
        client.responses.create(model=MODEL, input=QUESTION, previous_response_id="resp_unknown")
    assert previous.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError) as stream_previous:
        client.responses.create(model=MODEL, input=QUESTION, previous_response_id="resp_unknown", stream=True)
    assert stream_previous.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as long:
        client.responses.create(model=MODEL, input="word " * 6000, stream=True)
    assert long.value.code == "context_length_exceeded"
    with pytest.raises(openai.APIStatusError) as large:
        client.responses.create(model=MODEL, input="x" * BODY_LIMIT)
    assert large.value.status_code == 413 and large.value.code == "request_too_large"
    assert client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=1).usage.output_tokens == 1


def test_queue_full_and_queue_timeout(llm: LLM) -> None:
    """One running slot, one waiting place: a third request is refused at once (429); the waiting one gives up after
    queue_timeout (503)."""
    with one_slot_taken(llm, MODEL) as (loopback, engine):
        client = loopback.openai_client(KEY)
        waiting: dict[str, Any] = {}

        def wait() -> None:
            try:
                client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=1)
            except openai.APIStatusError as exc:
                waiting["error"] = exc

        waiter = threading.Thread(target=wait)
        waiter.start()
        wait_until(lambda: engine.stats()["waiting"] == 1)
        with pytest.raises(openai.RateLimitError) as full:
            client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=1)
        assert full.value.status_code == 429 and full.value.code == "server_overloaded"
        assert full.value.response.headers["retry-after"] == "1"
        status, events = sse(loopback.url, {"model": MODEL, "input": QUESTION})  # a stream gets a status, too
        assert status == 429 and events[0]["error"]["code"] == "server_overloaded"
        waiter.join(timeout=30)
        assert isinstance(waiting["error"], openai.InternalServerError)
        assert waiting["error"].status_code == 503 and waiting["error"].code == "request_queue_timeout"
        assert waiting["error"].response.headers["retry-after"] == "1"


def test_internal_errors(llm: LLM) -> None:
    """An engine failure before any output is a 500 (JSON or stream); after the stream started it is an `error`
    event followed by response.failed."""
    broken = Loopback(create_app(ScriptedEngine(llm, [RuntimeError("boom")]),  # type: ignore[arg-type]
                                 ServeConfig(model_id=MODEL)))
    late = Loopback(create_app(ScriptedEngine(llm, [ContentDelta("Hello"), RuntimeError("late boom")]),  # type: ignore
                               ServeConfig(model_id=MODEL)))
    try:
        with pytest.raises(openai.InternalServerError) as failed:
            broken.openai_client(KEY).responses.create(model=MODEL, input=QUESTION)
        assert failed.value.status_code == 500 and failed.value.code == "internal_error"
        assert "boom" not in str(failed.value.message)
        response = httpx.post(f"{broken.url}/v1/responses", json={"model": MODEL, "input": QUESTION, "stream": True})
        assert openai_error(response, 500)["code"] == "internal_error"

        status, events = sse(late.url, {"model": MODEL, "input": QUESTION})
        assert status == 200
        assert [e["type"] for e in events] == [
            "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            "response.output_text.delta", "error", "response.failed"]
        assert events[-2]["code"] == "internal_error" and "boom" not in events[-2]["message"]
        failed_response = events[-1]["response"]
        assert failed_response["status"] == "failed" and failed_response["error"]["code"] == "internal_error"
    finally:
        broken.stop()
        late.stop()
