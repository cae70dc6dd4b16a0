"""The Anthropic Messages API over loopback, driven by the official `anthropic` SDK and httpx: answers equal the
single-sequence LLM's (greedy), streaming equals non-streaming with the exact event sequence, thinking on/off,
prompts (count_tokens) equal to the hand-written OpenAI-shape conversation rendered by the template, tool use
round trips, stop sequences, prefill, and every error status in Anthropic's shape."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from ninfer.engine import LLM, Engine
from ninfer.frontend import ContentDelta, ReasoningDelta, ToolCall
from ninfer.sampling import SamplingParams
from ninfer.serve.app import create_app
from ninfer.serve.state import ServeConfig
from tests.serve.support import (
    Loopback,
    ScriptedEngine,
    greedy,
    one_slot_taken,
    wait_until,
)

MODEL = "claude-test"  # served under an alias (echoed in answers), as Claude Code asks for a Claude model
KEY = "sk-ant-test"
BODY_LIMIT = 256 << 10
HELLO = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # this SDK version has no temperature argument
OFF = {"type": "disabled"}
TOOLS = [
    {"name": "get_weather", "description": "Weather of a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"name": "get_time", "description": "Local time of a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
]
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                  "parameters": t["input_schema"]}} for t in TOOLS]


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[Loopback]:
    loopback = Loopback(create_app(engine, ServeConfig(model_id="served-id", model_aliases=(MODEL,), api_key=KEY,
                                                       max_body_bytes=BODY_LIMIT)))
    yield loopback
    loopback.stop()


@pytest.fixture(scope="module")
def client(server: Loopback) -> anthropic.Anthropic:
    return server.anthropic_client(KEY)


@pytest.fixture(scope="module")
def reasoning_server(reasoning_engine: Engine) -> Iterator[Loopback]:
    """As `server`, over the model that reasons (conftest's `reasoning_llm`)."""
    loopback = Loopback(create_app(reasoning_engine, ServeConfig(model_id="served-id", model_aliases=(MODEL,),
                                                                 api_key=KEY, max_body_bytes=BODY_LIMIT)))
    yield loopback
    loopback.stop()


def prompt_length(usage: Any) -> int:
    """Anthropic's accounting: fresh input tokens plus those read from the cache make the whole prompt."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def sse(server: Loopback, body: dict[str, Any]) -> tuple[int, list[tuple[str, dict[str, Any]]]]:
    """(status, [(event name, data)]) of a streamed request, read with httpx."""
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", f"{server.url}/v1/messages", json={**body, "stream": True}, headers=headers,
                      timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    events = []
    for name, data in zip(lines[::2], lines[1::2], strict=True):
        assert name.startswith("event: ") and data.startswith("data: "), (name, data)
        payload = json.loads(data[6:])
        assert payload["type"] == name[7:]
        events.append((name[7:], payload))
    return response.status_code, events


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    """The message of an Anthropic-shape error (asserting status, shape and type)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]["message"]


# ---------------------------------------------------------------------------------------------------------------
# answers
# ---------------------------------------------------------------------------------------------------------------


def test_message_equals_single_sequence_llm_and_stream(reasoning_server: Loopback, reasoning_llm: LLM) -> None:
    server, llm = reasoning_server, reasoning_llm
    client = server.anthropic_client(KEY)
    expected = greedy(llm, HELLO, 12)
    assert expected.reasoning and expected.finish_reason == "length"
    answer = client.messages.create(model=MODEL, max_tokens=12, messages=HELLO, **GREEDY)
    assert answer.id.startswith("msg_") and answer.type == "message" and answer.role == "assistant"
    assert answer.model == MODEL
    assert [block.type for block in answer.content] == ["thinking"] + (["text"] if expected.text else [])
    assert answer.content[0].thinking == expected.reasoning and answer.content[0].signature == ""
    assert "".join(b.text for b in answer.content if b.type == "text") == expected.text
    assert (answer.stop_reason, answer.stop_sequence) == ("max_tokens", None)
    assert prompt_length(answer.usage) == len(llm.prompt_ids(HELLO)) and answer.usage.output_tokens == 12

    with client.messages.stream(model=MODEL, max_tokens=12, messages=HELLO, **GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in answer.content]
    assert streamed.stop_reason == "max_tokens" and streamed.usage.output_tokens == 12
    assert prompt_length(streamed.usage) == prompt_length(answer.usage)
    assert streamed.usage.cache_read_input_tokens > 0  # the same prompt again: its prefix is reused

    status, events = sse(server, {"model": MODEL, "max_tokens": 12, "messages": HELLO, "temperature": 0})
    assert status == 200
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["usage"]["input_tokens"] == len(llm.prompt_ids(HELLO)) and start["usage"]["output_tokens"] == 0
    index, open_block = -1, False  # per block exactly: start, deltas, stop, with the block's index
    for name, payload in events[2:-2]:
        if name == "content_block_start":
            assert not open_block and payload["index"] == index + 1
            index, open_block = index + 1, True
        else:
            assert name in ("content_block_delta", "content_block_stop") and open_block and payload["index"] == index
            open_block = name == "content_block_delta"
    assert not open_block and index + 1 == len(answer.content)
    deltas = [p["delta"] for n, p in events if n == "content_block_delta"]
    assert "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta") == expected.reasoning
    assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == expected.text
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == 12


def test_thinking_on_and_off(reasoning_server: Loopback, reasoning_llm: LLM) -> None:
    client, llm = reasoning_server.anthropic_client(KEY), reasoning_llm
    expected = greedy(llm, HELLO, 16, thinking=False)
    assert expected.text and not expected.reasoning
    for options in ({"thinking": OFF, **GREEDY}, {"extra_body": {"thinking": OFF, "temperature": 0}}):
        answer = client.messages.create(model=MODEL, max_tokens=16, messages=HELLO, **options)
        assert [(b.type, b.text) for b in answer.content] == [("text", expected.text)]
        assert prompt_length(answer.usage) == len(llm.prompt_ids(HELLO, thinking=False))
    with client.messages.stream(model=MODEL, max_tokens=16, messages=HELLO, thinking=OFF, **GREEDY) as stream:
        assert [(b.type, b.text) for b in stream.get_final_message().content] == [("text", expected.text)]

    enabled = client.messages.create(model=MODEL, max_tokens=8, messages=HELLO, **GREEDY,
                                     thinking={"type": "enabled", "budget_tokens": 1024})
    assert enabled.content[0].type == "thinking" and enabled.content[0].thinking == greedy(llm, HELLO, 8).reasoning
    adaptive = client.messages.create(model=MODEL, max_tokens=8, messages=HELLO, thinking={"type": "adaptive"},
                                      **GREEDY)
    assert adaptive.content[0].type == "thinking"


def test_count_tokens_is_the_rendered_conversation(client: anthropic.Anthropic, llm: LLM) -> None:
    """Each Anthropic conversation is counted as its hand-written OpenAI-shape equivalent renders, and a real request
    uses exactly that prompt."""
    cases = [
        ({"messages": HELLO}, HELLO, None, True),
        ({"system": "Be terse.", "messages": HELLO, "thinking": OFF},
         [{"role": "system", "content": "Be terse."}, *HELLO], None, False),
        ({"system": [{"type": "text", "text": "One."}, {"type": "text", "text": "Two.", "cache_control":
                                                           {"type": "ephemeral"}}],
          "messages": [{"role": "system", "content": "Three."}, *HELLO]},
         [{"role": "system", "content": "One.\n\nTwo.\n\nThree."}, *HELLO], None, True),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                       {"role": "user", "content": "c"}]},
         [{"role": "user", "content": "a\n\nb\n\nc"}], None, True),  # consecutive turns of one role are one turn
        ({"messages": HELLO, "tools": TOOLS}, HELLO, OPENAI_TOOLS, True),
        ({"messages": HELLO, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_time"}}, HELLO,
         OPENAI_TOOLS[1:], True),
        ({"messages": HELLO, "tools": TOOLS, "tool_choice": {"type": "none"}}, HELLO, None, True),
        ({"messages": HELLO, "tools": TOOLS, "tool_choice": {"type": "any"}}, HELLO, OPENAI_TOOLS, True),
    ]
    for request, messages, tools, thinking in cases:
        expected = len(llm.prompt_ids(messages, tools=tools, thinking=thinking))
        assert client.messages.count_tokens(model=MODEL, **request).input_tokens == expected, request
        answer = client.messages.create(model=MODEL, max_tokens=1, **request, **GREEDY)
        assert prompt_length(answer.usage) == expected, request


def test_stop_sequences(client: anthropic.Anthropic, server: Loopback, llm: LLM) -> None:
    full = greedy(llm, HELLO, 24, thinking=False).text
    assert len(full) > 12
    stop = full[8:11]
    cut = full[: full.index(stop)]
    options: dict[str, Any] = {"model": MODEL, "max_tokens": 24, "messages": HELLO, "thinking": OFF, **GREEDY}
    answer = client.messages.create(stop_sequences=["\x00never", stop], **options)
    assert [b.text for b in answer.content] == [cut]
    assert (answer.stop_reason, answer.stop_sequence) == ("stop_sequence", stop)
    with client.messages.stream(stop_sequences=[stop], **options) as stream:
        streamed = stream.get_final_message()
    assert ([b.text for b in streamed.content], streamed.stop_reason, streamed.stop_sequence) == (
        [cut], "stop_sequence", stop)
    for script, content in (([ContentDelta("Hi.")], [("text", "Hi.")]), ([], [("text", "")])):
        ends = Loopback(create_app(ScriptedEngine(llm, script), ServeConfig(model_id=MODEL)))  # type: ignore
        try:  # the model ends its turn itself (an empty answer still has one text block)
            ended = ends.anthropic_client(KEY).messages.create(model=MODEL, max_tokens=8, messages=HELLO,
                                                               stop_sequences=[stop])
        finally:
            ends.stop()
        assert [(b.type, b.text) for b in ended.content] == content
        assert (ended.stop_reason, ended.stop_sequence) == ("end_turn", None)


def test_prefill_continues_the_last_assistant_message(client: anthropic.Anthropic, llm: LLM) -> None:
    prefill = "The capital"
    messages = [*HELLO, {"role": "assistant", "content": prefill}]
    ids = llm.prompt_ids(HELLO, thinking=False) + llm.tokenizer.encode(prefill)
    assert client.messages.count_tokens(model=MODEL, messages=messages).input_tokens == len(ids)
    answer = client.messages.create(model=MODEL, max_tokens=8, messages=messages, **GREEDY)
    expected = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=8))
    assert [(b.type, b.text) for b in answer.content] == [("text", expected.text)]
    with pytest.raises(anthropic.BadRequestError) as thinking:
        client.messages.create(model=MODEL, max_tokens=8, messages=messages, thinking={"type": "enabled",
                                                                                     "budget_tokens": 1024})
    assert "thinking" in thinking.value.api_message


# ---------------------------------------------------------------------------------------------------------------
# tool use, with a scripted engine for the model's side (the tiny model does not call tools)
# ---------------------------------------------------------------------------------------------------------------


def test_tool_use_round_trip(client: anthropic.Anthropic, llm: LLM) -> None:
    calls = [ToolCall("get_weather", {"city": "Paris"}, "<tool_call>…</tool_call>"),
             ToolCall("get_time", {"city": "Oslo", "utc": True}, "<tool_call>…</tool_call>")]
    script = [ReasoningDelta("Let me "), ReasoningDelta("look."), ContentDelta("Checking."), *calls]
    scripted = Loopback(create_app(ScriptedEngine(llm, script), ServeConfig(model_id=MODEL)))  # type: ignore
    scripted_client = scripted.anthropic_client(KEY)
    try:
        question = [{"role": "user", "content": "Weather in Paris, time in Oslo?"}]
        answer = scripted_client.messages.create(model=MODEL, max_tokens=64, messages=question, tools=TOOLS)
        assert [b.type for b in answer.content] == ["thinking", "text", "tool_use", "tool_use"]
        assert (answer.content[0].thinking, answer.content[1].text) == ("Let me look.", "Checking.")
        uses = answer.content[2:]
        assert [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Paris"}),
                                                     ("get_time", {"city": "Oslo", "utc": True})]
        assert all(u.id.startswith("toolu_") for u in uses) and uses[0].id != uses[1].id
        assert (answer.stop_reason, answer.stop_sequence) == ("tool_use", None)

        with scripted_client.messages.stream(model=MODEL, max_tokens=64, messages=question, tools=TOOLS) as stream:
            streamed = stream.get_final_message()
        assert [b.type for b in streamed.content] == ["thinking", "text", "tool_use", "tool_use"]
        assert [(b.name, b.input) for b in streamed.content[2:]] == [(u.name, u.input) for u in uses]
        assert streamed.stop_reason == "tool_use"
        _, events = sse(scripted, {"model": MODEL, "max_tokens": 64, "messages": question, "tools": TOOLS})
        starts = [p["content_block"] for n, p in events if n == "content_block_start"]
        assert starts[2] == {"type": "tool_use", "id": starts[2]["id"], "name": "get_weather", "input": {}}
        json_deltas = [p["delta"] for n, p in events if n == "content_block_delta" and p["index"] == 2]
        assert json_deltas == [{"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}]

        single = scripted_client.messages.create(model=MODEL, max_tokens=64, messages=question, tools=TOOLS,
                                                 tool_choice={"type": "auto", "disable_parallel_tool_use": True})
        assert [b.name for b in single.content if b.type == "tool_use"] == ["get_weather"]
    finally:
        scripted.stop()

    # the client answers with tool results; the real server renders them as the Qwen template expects
    history = [*question, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in answer.content]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 C, sunny"},
                   {"type": "tool_result", "tool_use_id": uses[1].id,
                    "content": [{"type": "text", "text": "09:00"}]},
                   {"type": "text", "text": "Thanks!"}]}]
    openai_history = [
        *question,
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Let me look.",
         "tool_calls": [{"id": u.id, "type": "function", "function": {"name": u.name, "arguments": u.input}}
                        for u in uses]},
        {"role": "tool", "tool_call_id": uses[0].id, "content": "18 C, sunny"},
        {"role": "tool", "tool_call_id": uses[1].id, "content": "09:00"},
        {"role": "user", "content": "Thanks!"},
    ]
    ids = llm.prompt_ids(openai_history, tools=OPENAI_TOOLS)
    text = llm.tokenizer.decode(ids)
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n09:00\n</tool_response>" in text
    assert text.index("</tool_response><|im_end|>") < text.index("Thanks!")
    assert client.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS).input_tokens == len(ids)
    follow_up = client.messages.create(model=MODEL, max_tokens=2, messages=history, tools=TOOLS, **GREEDY)
    assert prompt_length(follow_up.usage) == len(ids) and follow_up.usage.output_tokens == 2


# ---------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "field"), [
    ({"max_tokens": 4, "messages": HELLO}, "model"),
    ({"model": MODEL, "max_tokens": 4}, "messages"),
    ({"model": MODEL, "max_tokens": 0, "messages": HELLO}, "max_tokens"),
    ({"model": MODEL, "messages": HELLO}, "max_tokens"),
    ({"model": MODEL, "messages": HELLO, "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "messages": HELLO, "best_of": 2}, "best_of"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0].type"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]},
     "messages[0].content[0].type"),
    ({"model": MODEL, "messages": [*HELLO, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "messages[1]"),
    ({"model": MODEL, "messages": HELLO, "system": [{"type": "text"}]}, "system[0].text"),
    ({"model": MODEL, "messages": HELLO, "tools": [{"name": "bad name!", "input_schema": {}}]}, "tools[0].name"),
    ({"model": MODEL, "messages": HELLO, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0].type"),
    ({"model": MODEL, "messages": HELLO, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name"),
    ({"model": MODEL, "messages": HELLO, "stop_sequences": "x"}, "stop_sequences"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 6000}]}, "messages"),
])
def test_schema_errors_name_the_field(server: Loopback, body: dict, field: str) -> None:
    headers = {"x-api-key": KEY}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        if path.endswith("count_tokens") and field in ("max_tokens", "temperature", "stop_sequences", "messages"):
            continue  # not count_tokens fields, or not an error there (counting has no context limit)
        if path.endswith("count_tokens"):
            sent = {k: v for k, v in body.items() if k != "max_tokens"}
        else:  # max_tokens is required: given unless it is the field at fault
            sent = body if field == "max_tokens" else {"max_tokens": 4, **body}
        response = httpx.post(f"{server.url}{path}", json=sent, headers=headers)
        assert field in anthropic_error(response, 400, "invalid_request_error"), (path, response.text)


def test_sdk_errors(server: Loopback, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.AuthenticationError) as denied:
        server.anthropic_client("wrong").messages.create(model=MODEL, max_tokens=1, messages=HELLO)
    assert denied.value.status_code == 401 and denied.value.type == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        server.anthropic_client("wrong").messages.count_tokens(model=MODEL, messages=HELLO)
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.batches.retrieve("msgbatch_nope")
    assert missing.value.status_code == 404 and missing.value.type == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "word " * 6000}])
    assert bad.value.type == "invalid_request_error" and "context" in bad.value.api_message
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=1, stream=True,
                               messages=[{"role": "user", "content": "word " * 6000}])
    with pytest.raises(anthropic.ContentTooLargeError) as large:
        client.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x" * BODY_LIMIT}])
    assert large.value.status_code == 413 and large.value.type == "request_too_large"
    assert client.messages.create(model=MODEL, max_tokens=1, messages=HELLO).usage.output_tokens == 1


def test_queue_full_and_queue_timeout(llm: LLM) -> None:
    """One running slot, one waiting place: a third request is refused at once (429 rate_limit_error); the waiting
    one gives up after queue_timeout (503 overloaded_error)."""
    with one_slot_taken(llm, MODEL) as (loopback, engine):
        client = loopback.anthropic_client(KEY)
        waiting: dict[str, Any] = {}

        def wait() -> None:
            try:
                client.messages.create(model=MODEL, max_tokens=1, messages=HELLO)
            except anthropic.APIStatusError as exc:
                waiting["error"] = exc

        waiter = threading.Thread(target=wait)
        waiter.start()
        wait_until(lambda: engine.stats()["waiting"] == 1)
        with pytest.raises(anthropic.RateLimitError) as full:
            client.messages.create(model=MODEL, max_tokens=1, messages=HELLO)
        assert full.value.status_code == 429 and full.value.type == "rate_limit_error"
        assert full.value.response.headers["retry-after"] == "1"
        refused = httpx.post(f"{loopback.url}/v1/messages", json={"model": MODEL, "max_tokens": 1,
                                                                  "messages": HELLO, "stream": True})
        anthropic_error(refused, 429, "rate_limit_error")  # a stream is refused with a status, too
        assert refused.headers["retry-after"] == "1"
        waiter.join(timeout=30)
        assert isinstance(waiting["error"], anthropic.ServiceUnavailableError)
        assert waiting["error"].status_code == 503 and waiting["error"].type == "overloaded_error"
        assert waiting["error"].response.headers["retry-after"] == "1"


def test_internal_errors(llm: LLM) -> None:
    """An engine failure before any output is a 500 api_error (JSON or stream); after the stream started it is an
    `error` event that ends the stream."""
    broken = Loopback(create_app(ScriptedEngine(llm, [RuntimeError("boom")]),  # type: ignore[arg-type]
                                 ServeConfig(model_id=MODEL)))
    late = Loopback(create_app(ScriptedEngine(llm, [ContentDelta("Hello"), RuntimeError("late boom")]),  # type: ignore
                               ServeConfig(model_id=MODEL)))
    try:
        with pytest.raises(anthropic.InternalServerError) as failed:
            broken.anthropic_client(KEY).messages.create(model=MODEL, max_tokens=1, messages=HELLO)
        assert failed.value.status_code == 500 and failed.value.type == "api_error"
        assert "boom" not in failed.value.api_message
        streamed = {"model": MODEL, "max_tokens": 1, "messages": HELLO, "stream": True}
        response = httpx.post(f"{broken.url}/v1/messages", json=streamed)
        anthropic_error(response, 500, "api_error")

        status, events = sse(late, {"model": MODEL, "max_tokens": 8, "messages": HELLO})
        assert status == 200
        assert [name for name, _ in events] == ["message_start", "ping", "content_block_start",
                                                "content_block_delta", "error"]
        assert events[-1][1]["error"]["type"] == "api_error" and "boom" not in events[-1][1]["error"]["message"]
        with pytest.raises(anthropic.APIStatusError), late.anthropic_client(KEY).messages.stream(
                model=MODEL, max_tokens=1, messages=HELLO) as stream:
            stream.get_final_message()
    finally:
        broken.stop()
        late.stop()
