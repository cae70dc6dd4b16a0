"""The OpenAI Chat Completions server over loopback, driven by the official `openai` SDK and httpx: answers equal the
single-sequence LLM's (greedy), streaming equals non-streaming, reasoning, tools, stops, usage, the plain routes,
and every error status in OpenAI's shape."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from ninfer.engine import LLM, Engine
from ninfer.errors import NinferError
from ninfer.frontend import ContentDelta, ReasoningDelta, ToolCall
from ninfer.serve import openai_chat
from ninfer.serve.app import create_app
from ninfer.serve.main import bind
from ninfer.serve.state import ServeConfig
from tests.serve.support import Loopback, ScriptedEngine, greedy, wait_until

MODEL = "test-model"
KEY = "sk-test-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time of a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
]


@pytest.fixture(scope="module")
def server(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loopback]:
    log = tmp_path_factory.mktemp("serve") / "requests.jsonl"
    loopback = Loopback(create_app(engine, ServeConfig(model_id=MODEL, request_log=log)))
    loopback.log_path = log  # type: ignore[attr-defined]
    yield loopback
    loopback.stop()


@pytest.fixture(scope="module")
def client(server: Loopback) -> openai.OpenAI:
    return server.openai_client("unused")


def stream_text(client: openai.OpenAI, **request: Any) -> tuple[str, str, list[Any]]:
    """(reasoning, content, chunks) of a streamed chat completion."""
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **request))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return reasoning, content, chunks


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI-shape error of a response (asserting the shape)."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


# ---------------------------------------------------------------------------------------------------------------
# answers
# ---------------------------------------------------------------------------------------------------------------


def test_chat_equals_single_sequence_llm(client: openai.OpenAI, server: Loopback, llm: LLM) -> None:
    expected = greedy(llm, QUESTION, 12)
    prompt = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION}).json()
    assert prompt["tokens"] == llm.prompt_ids(QUESTION)

    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12)
    message = answer.choices[0].message
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-") and answer.model == MODEL
    assert message.role == "assistant"
    assert (message.reasoning_content or "", message.content) == (expected.reasoning, expected.text)
    assert answer.choices[0].finish_reason == expected.finish_reason == "length"
    assert answer.usage.prompt_tokens == prompt["count"]
    assert answer.usage.completion_tokens == len(expected.token_ids) == 12
    assert answer.usage.total_tokens == prompt["count"] + 12
    assert answer.usage.prompt_tokens_details.cached_tokens >= 0

    reasoning, content, chunks = stream_text(client, messages=QUESTION, temperature=0, max_completion_tokens=12,
                                             stream_options={"include_usage": True})
    assert (reasoning, content) == (expected.reasoning, expected.text)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt["count"], 12)
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: its prefix is reused


def test_stream_wire_format(server: Loopback) -> None:
    request = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=request, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert all("usage" not in c for c in chunks)  # only with stream_options.include_usage
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"][0]["delta"] == {}


def test_thinking_on_and_off(reasoning_engine: Engine, reasoning_llm: LLM) -> None:
    """On the model that reasons (conftest's `reasoning_llm`): thinking on, its budget ends inside the reasoning."""
    server, llm = Loopback(create_app(reasoning_engine, ServeConfig(model_id=MODEL))), reasoning_llm
    client = server.openai_client("unused")
    on = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=6)
    assert on.choices[0].message.reasoning_content == greedy(llm, QUESTION, 6).reasoning != ""
    assert on.usage.completion_tokens_details.reasoning_tokens == 6  # still thinking when the budget ran out

    expected = greedy(llm, QUESTION, 6, thinking=False)
    off_prompt = llm.prompt_ids(QUESTION, thinking=False)
    assert llm.tokenizer.decode(off_prompt).endswith("<think>\n\n</think>\n\n")
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False},
                  {"reasoning_effort": "none"}):
        off = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=6,
                                             extra_body=extra)
        assert off.choices[0].message.reasoning_content is None
        assert off.choices[0].message.content == expected.text
        assert off.usage.prompt_tokens == len(off_prompt)
        assert off.usage.completion_tokens_details.reasoning_tokens == 0
    reasoning, content, _ = stream_text(client, messages=QUESTION, temperature=0, max_tokens=6,
                                        extra_body={"enable_thinking": False})
    assert (reasoning, content) == ("", expected.text)
    contradiction = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": QUESTION, "enable_thinking": True,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert contradiction.status_code == 400
    assert error_of(contradiction)["param"] == "chat_template_kwargs.enable_thinking"
    server.stop()


def test_the_embedded_model_closes_an_empty_reasoning_block(client: openai.OpenAI, llm: LLM) -> None:
    """The embedded model, taught chats, answers with thinking on: no reasoning text, the content after it."""
    on = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12)
    expected = greedy(llm, QUESTION, 12)
    assert on.choices[0].message.reasoning_content is None and expected.reasoning == ""
    assert on.choices[0].message.content == expected.text != ""
    closed = expected.token_ids.index(llm.tokenizer.think_end_id) + 1  # up to and including </think>
    assert on.usage.completion_tokens_details.reasoning_tokens == closed


def test_tools_round_trip(client: openai.OpenAI, server: Loopback, llm: LLM) -> None:
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION, "tools": TOOLS}).json()["tokens"]
    prompt = llm.tokenizer.decode(tokens)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and '"name": "get_time"' in prompt

    def prompt_tokens(**request: Any) -> int:
        answer = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=1, **request)
        return answer.usage.prompt_tokens

    assert prompt_tokens(messages=QUESTION, tools=TOOLS) == len(tokens) == len(llm.prompt_ids(QUESTION, tools=TOOLS))
    named = {"type": "function", "function": {"name": "get_time"}}
    assert prompt_tokens(messages=QUESTION, tools=TOOLS, tool_choice=named) == len(
        llm.prompt_ids(QUESTION, tools=TOOLS[1:]))
    assert prompt_tokens(messages=QUESTION, tools=TOOLS, tool_choice="none") == len(llm.prompt_ids(QUESTION))

    history = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=3)
    rendered = llm.prompt_ids(history, tools=TOOLS)
    assert answer.usage.prompt_tokens == len(rendered)
    text = llm.tokenizer.decode(rendered)
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text

    bad = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "tools": TOOLS,
                                                                 "tool_choice": {"type": "function",
                                                                                 "function": {"name": "nope"}}})
    assert bad.status_code == 400 and error_of(bad)["param"] == "tool_choice.function.name"
    arguments = json.loads(json.dumps(history))
    arguments[2]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"
    bad = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": arguments})
    assert bad.status_code == 400
    assert error_of(bad)["param"] == "messages[2].tool_calls[0].function.arguments"


def test_stop_strings(client: openai.OpenAI, llm: LLM) -> None:
    options: dict[str, Any] = {"messages": QUESTION, "temperature": 0, "max_tokens": 24,
                               "extra_body": {"enable_thinking": False}}
    full = client.chat.completions.create(model=MODEL, **options).choices[0].message.content
    assert full == greedy(llm, QUESTION, 24, thinking=False).text and len(full) > 12
    stop = full[8:11]
    cut = full[: full.index(stop)]
    answer = client.chat.completions.create(model=MODEL, stop=stop, **options)
    assert answer.choices[0].message.content == cut and answer.choices[0].finish_reason == "stop"
    answer = client.chat.completions.create(model=MODEL, stop=["\x00never", stop], **options)
    assert answer.choices[0].message.content == cut
    assert stream_text(client, stop=[stop], **options)[1] == cut


def test_sampling_fields_are_honoured(client: openai.OpenAI, llm: LLM) -> None:
    first = greedy(llm, QUESTION, 4, thinking=False).token_ids[0]
    options: dict[str, Any] = {"messages": QUESTION, "temperature": 0, "max_tokens": 4,
                               "extra_body": {"enable_thinking": False}}
    plain = client.chat.completions.create(model=MODEL, **options).choices[0].message.content
    banned = client.chat.completions.create(model=MODEL, logit_bias={str(first): -100}, **options)
    assert banned.choices[0].message.content != plain
    assert not banned.choices[0].message.content.startswith(llm.tokenizer.decode([first]))
    forced = llm.tokenizer.encode("Paris")[0]
    boosted = client.chat.completions.create(model=MODEL, logit_bias={str(forced): 100}, **options)
    assert boosted.choices[0].message.content == llm.tokenizer.decode([forced] * 4)
    # the same seed gives the same sample; top_k / min_p / penalties are accepted
    sampled = {"messages": QUESTION, "max_tokens": 8, "temperature": 1.0, "seed": 7, "top_p": 0.9,
               "presence_penalty": 0.5, "frequency_penalty": 0.5, "extra_body": {"top_k": 20, "min_p": 0.05,
                                                                                "repetition_penalty": 1.1}}
    a = client.chat.completions.create(model=MODEL, **sampled).choices[0].message
    b = client.chat.completions.create(model=MODEL, **sampled).choices[0].message
    assert (a.reasoning_content, a.content) == (b.reasoning_content, b.content)


# ---------------------------------------------------------------------------------------------------------------
# plain routes and the request log
# ---------------------------------------------------------------------------------------------------------------


def test_models_health_tokenize_detokenize(client: openai.OpenAI, server: Loopback, llm: LLM) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "ninfer")
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("other-model")
    assert missing.value.code == "model_not_found"

    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL

    text = "Hello <|im_end|> world"
    tokens = httpx.post(f"{server.url}/tokenize", json={"text": text}).json()
    assert tokens["tokens"] == llm.tokenizer.encode(text) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == llm.max_context
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"text": text}
    off = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION, "enable_thinking": False}).json()
    assert off["tokens"] == llm.prompt_ids(QUESTION, thinking=False)
    for body, param in (({"tokens": [0, 10**9]}, "tokens[1]"), ({"tokens": "abc"}, "tokens")):
        response = httpx.post(f"{server.url}/detokenize", json=body)
        assert response.status_code == 400 and error_of(response)["param"] == param
    both = httpx.post(f"{server.url}/tokenize", json={"text": "a", "messages": QUESTION})
    assert both.status_code == 400


def test_request_log_has_numbers_not_text(client: openai.OpenAI, server: Loopback) -> None:
    marker = "zebra-umbrella-marker"
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": marker}], temperature=0,
                                   max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": marker}])
    text = server.log_path.read_text()  # type: ignore[attr-defined]
    assert marker not in text
    lines = [json.loads(line) for line in text.splitlines()]
    chat = [r for r in lines if r["endpoint"] == "/v1/chat/completions"]
    done = [r for r in chat if r["status"] == 200 and r["completion_tokens"] == 2][-1]
    assert done["id"].startswith("chatcmpl-") and done["prompt_tokens"] > 0 and done["finish_reason"] == "length"
    assert all(done[key] >= 0 for key in ("queue_seconds", "prefill_seconds", "decode_seconds", "cached_tokens"))
    assert chat[-1]["status"] == 404 and chat[-1]["error_code"] == "model_not_found"
    assert len({tuple(r) for r in lines}) == 1  # every line has the same keys


# ---------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"model": MODEL, "messages": QUESTION, "temperature": "hot"}, "temperature", "invalid_type"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"model": MODEL, "messages": "hello"}, "messages", "invalid_type"),
    ({"model": MODEL}, "messages", "missing_required_parameter"),
    ({"messages": QUESTION}, "model", "missing_required_parameter"),
    ({"model": MODEL, "messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "unsupported_role"),
    ({"model": MODEL, "messages": [{"content": "x"}]}, "messages[0].role", "missing_required_parameter"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ({"model": MODEL, "messages": QUESTION, "n": 2}, "n", "n_not_supported"),
    ({"model": MODEL, "messages": QUESTION, "best_of": 2}, "best_of", "unknown_parameter"),
    ({"model": MODEL, "messages": QUESTION, "logit_bias": {"x": 1}}, "logit_bias", "invalid_value"),
    ({"model": MODEL, "messages": QUESTION, "logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
    ({"model": MODEL, "messages": QUESTION, "response_format": {"type": "json_object"}}, "response_format",
     "response_format_not_supported"),
    ({"model": MODEL, "messages": QUESTION, "logprobs": True}, "logprobs", "logprobs_not_supported"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]", "modality_not_supported"),
    ({"model": MODEL, "messages": [*QUESTION, {"role": "system", "content": "late"}]}, "messages[1].role",
     "invalid_value"),
    ({"model": MODEL, "messages": QUESTION, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name", "invalid_value"),
    ({"model": MODEL, "messages": QUESTION, "stop": [1]}, "stop", "invalid_type"),
    ({"model": MODEL, "messages": QUESTION, "stream_options": {"include_usage": True}}, "stream_options",
     "invalid_value"),
])
def test_schema_errors_name_the_field(server: Loopback, body: dict, param: str, code: str) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert param in error["message"]


def test_sdk_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as n:
        client.chat.completions.create(model=MODEL, messages=QUESTION, n=2)
    assert n.value.code == "n_not_supported" and n.value.param == "n"
    with pytest.raises(openai.NotFoundError) as model:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert model.value.code == "model_not_found" and model.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as long:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 6000}])
    assert long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as long_stream:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 6000}],
                                       stream=True)
    assert long_stream.value.code == "context_length_exceeded"


def test_body_too_large(server: Loopback) -> None:
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (8 << 20)}]}).encode()
    response = httpx.post(f"{server.url}/v1/chat/completions", content=big,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit counts the bytes received
        for start in range(0, len(big), 1 << 20):
            yield big[start : start + (1 << 20)]

    response = httpx.post(f"{server.url}/v1/chat/completions", content=chunked())
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"


def test_api_key(engine: Engine) -> None:
    loopback = Loopback(create_app(engine, ServeConfig(model_id=MODEL, api_key=KEY)))
    try:
        with pytest.raises(openai.AuthenticationError) as denied:
            loopback.openai_client("wrong").models.list()
        assert denied.value.status_code == 401 and denied.value.code == "invalid_api_key"
        assert [m.id for m in loopback.openai_client(KEY).models.list().data] == [MODEL]
        assert httpx.get(f"{loopback.url}/v1/models", headers={"x-api-key": KEY}).status_code == 200
        missing = httpx.get(f"{loopback.url}/v1/models")
        assert missing.status_code == 401 and error_of(missing)["code"] == "invalid_api_key"
        anthropic = httpx.post(f"{loopback.url}/v1/messages", json={})
        assert anthropic.status_code == 401 and anthropic.json()["type"] == "error"
        assert anthropic.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{loopback.url}/health").status_code == 200  # exempt
    finally:
        loopback.stop()


def test_cors(engine: Engine) -> None:
    loopback = Loopback(create_app(engine, ServeConfig(model_id=MODEL, api_key=KEY, cors=True)))
    try:
        preflight = httpx.options(f"{loopback.url}/v1/chat/completions", headers={
            "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "*"
        denied = httpx.get(f"{loopback.url}/v1/models", headers={"Origin": "http://example.com"})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"
    finally:
        loopback.stop()


def test_queue_full_and_queue_timeout(llm: LLM) -> None:
    """One running slot, one waiting place: a third request is refused at once (429); the waiting one gives up
    after queue_timeout (503); both say Retry-After; closing the running stream frees its sequence."""
    engine = llm.engine_with(max_concurrency=1, max_pending=1, queue_timeout=1.0).start()
    loopback = Loopback(create_app(engine, ServeConfig(model_id=MODEL)))
    url = f"{loopback.url}/v1/chat/completions"
    long = {"model": MODEL, "messages": QUESTION, "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
    client = loopback.openai_client("unused")
    try:
        with httpx.stream("POST", url, json={**long, "stream": True}, timeout=60) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # keep it: a discarded iterator closes the connection
            next(lines)
            wait_until(lambda: engine.stats()["running"] == 1)
            waiting: dict[str, httpx.Response] = {}
            waiter = threading.Thread(target=lambda: waiting.update(r=httpx.post(url, json=long, timeout=60)))
            waiter.start()
            wait_until(lambda: engine.stats()["waiting"] == 1)
            with pytest.raises(openai.RateLimitError) as full:
                client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4000,
                                               extra_body={"ignore_eos": True})
            assert full.value.status_code == 429 and full.value.code == "server_overloaded"
            assert full.value.response.headers["retry-after"] == "1"
            refused = httpx.post(url, json={**long, "stream": True})  # a stream is refused with a status, too
            assert refused.status_code == 429 and error_of(refused)["code"] == "server_overloaded"
            assert refused.headers["retry-after"] == "1"
            waiter.join(timeout=30)
            assert waiting["r"].status_code == 503 and error_of(waiting["r"])["code"] == "request_queue_timeout"
            assert waiting["r"].headers["retry-after"] == "1"
            assert engine.stats()["running"] == 1
        wait_until(lambda: engine.stats()["running"] == 0)  # the closed stream freed its sequence
    finally:
        loopback.stop()
        engine.close()


def test_internal_error_is_500_and_server_survives(client: openai.OpenAI, server: Loopback,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    with monkeypatch.context() as patch:
        patch.setattr(openai_chat, "build_request", broken)
        for stream in (False, True):
            response = httpx.post(f"{server.url}/v1/chat/completions",
                                  json={"model": MODEL, "messages": QUESTION, "stream": stream})
            assert response.status_code == 500
            error = error_of(response)
            assert error["code"] == "internal_error" and "boom" not in error["message"]
    assert client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2).usage.completion_tokens == 2


# ---------------------------------------------------------------------------------------------------------------
# the wire format of tool calls and of late errors, with a scripted engine
# ---------------------------------------------------------------------------------------------------------------


def test_tool_call_wire_format(llm: LLM) -> None:
    calls = [ToolCall("get_weather", {"city": "Paris"}, "<tool_call>…</tool_call>"),
             ToolCall("get_time", {"city": "Oslo", "utc": True}, "<tool_call>…</tool_call>")]
    loopback = Loopback(create_app(ScriptedEngine(llm, [ReasoningDelta("Let me look."), *calls]),  # type: ignore
                                   ServeConfig(model_id=MODEL)))
    client = loopback.openai_client("unused")
    try:
        answer = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS)
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "tool_calls"
        assert message.content is None and message.reasoning_content == "Let me look."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("get_weather", {"city": "Paris"}), ("get_time", {"city": "Oslo", "utc": True})]
        assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
        assert len({c.id for c in message.tool_calls}) == 2

        chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, stream=True))
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
            (0, "get_weather", {"city": "Paris"}), (1, "get_time", {"city": "Oslo", "utc": True})]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        single = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                                parallel_tool_calls=False)
        assert [c.function.name for c in single.choices[0].message.tool_calls] == ["get_weather"]
    finally:
        loopback.stop()


def test_error_after_stream_started_is_an_sse_event(llm: LLM) -> None:
    engine = ScriptedEngine(llm, [ContentDelta("Hello"), RuntimeError("engine fell over")])
    loopback = Loopback(create_app(engine, ServeConfig(model_id=MODEL)))  # type: ignore[arg-type]
    try:
        request = {"model": MODEL, "messages": QUESTION, "stream": True}
        with httpx.stream("POST", f"{loopback.url}/v1/chat/completions", json=request) as response:
            assert response.status_code == 200
            events = [json.loads(line[6:]) for line in response.iter_lines() if line]  # no "[DONE]" to skip
        assert events[1]["choices"][0]["delta"] == {"content": "Hello"}
        assert events[-1]["error"]["code"] == "internal_error" and "fell over" not in events[-1]["error"]["message"]
    finally:
        loopback.stop()


# ---------------------------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------------------------


def test_serve_command(tmp_path: Any) -> None:
    """`ninfer serve` answers under the artifact's own name, logs requests, and stops cleanly on Ctrl-C."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path / "requests.jsonl"
    process = subprocess.Popen([sys.executable, "-m", "ninfer", "serve", "--port", str(port), "--max-concurrency",
                                "2", "--request-log-jsonl", str(log)], stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            assert process.poll() is None and time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["ninfer-small-dense"]
        answer = httpx.post(f"{url}/v1/chat/completions", json={"model": "ninfer-small-dense", "messages": QUESTION,
                                                                 "max_tokens": 2}, timeout=60)
        assert answer.status_code == 200
        with pytest.raises(NinferError, match="cannot listen"):
            bind("127.0.0.1", port)  # taken
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
    assert json.loads(log.read_text().splitlines()[-1])["completion_tokens"] == 2
