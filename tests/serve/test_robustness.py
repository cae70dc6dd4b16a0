"""The server under abuse: malformed and oversize bodies, thousands of garbage requests (each answered with a 4xx in
OpenAI's shape, the server still serving afterwards), parallel streams that each get exactly their single-request
text, and clients that hang up (their sequences are freed)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from ninfer.engine import LLM, Engine
from ninfer.serve.app import create_app
from ninfer.serve.openai_chat import ChatCompletionRequest
from ninfer.serve.state import ServeConfig
from tests.serve.support import Loopback, wait_until

MODEL = "test-model"
QUESTION = [{"role": "user", "content": "Tell me about the sea."}]
VALID = {"model": MODEL, "messages": QUESTION, "max_completion_tokens": 1, "enable_thinking": False,
         "temperature": 0}
LONG = {"model": MODEL, "messages": QUESTION, "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
GARBAGE_REQUESTS = 2000


def assert_openai_error(status: int, body: bytes, allowed: tuple[int, ...]) -> dict[str, Any]:
    assert status in allowed, (status, body[:300])
    error = json.loads(body)
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}, body[:300]
    assert isinstance(error["error"]["message"], str) and error["error"]["message"]
    assert isinstance(error["error"]["type"], str)
    return error["error"]


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[Loopback]:
    loopback = Loopback(create_app(engine, ServeConfig(model_id=MODEL)))
    yield loopback
    loopback.stop()


def chat(server: Loopback, body: bytes | str, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", content=body,
                      headers={"content-type": "application/json", **headers}, timeout=60)


# ---------------------------------------------------------------------------------------------------------------
# malformed bodies
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    b"", b"   ", b"{", b'{"model": ', b"[1, 2", b"null", b"42", b'"text"', b"[]", b"\xff\xfe\x00garbage",
    b'{"model": "test-model", "messages": [}', b"{'model': 'single quotes'}", b'{"a": NaN}',
    b"[" * 5000 + b"]" * 5000,  # nested past the parser's limit
    json.dumps({"model": MODEL, "messages": QUESTION, "temperature": float("inf")}).encode(),
])
def test_malformed_json_is_400(server: Loopback, body: bytes) -> None:
    response = chat(server, body)
    error = assert_openai_error(response.status_code, response.content, (400,))
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("field", "value"), [
    ("model", 5), ("messages", {"role": "user"}), ("messages", [5]), ("messages", [[]]), ("stream", "yes"),
    ("max_tokens", 1.5), ("max_tokens", "10"), ("temperature", [0]), ("top_p", 0), ("top_k", True), ("seed", 1.0),
    ("stop", {"a": 1}), ("logit_bias", [1, 2]), ("tools", {}), ("tool_choice", "sometimes"),
    ("stream_options", "usage"), ("n", "1"), ("min_p", 1.0), ("presence_penalty", 3), ("chat_template_kwargs", []),
])
def test_wrong_types_name_the_field(server: Loopback, field: str, value: Any) -> None:
    response = chat(server, json.dumps({**VALID, field: value}))
    error = assert_openai_error(response.status_code, response.content, (400,))
    assert error["param"] is not None and error["param"].split("[")[0].split(".")[0] == field, error


def test_oversize_bodies_are_413(engine: Engine) -> None:
    limit = 4096
    loopback = Loopback(create_app(engine, ServeConfig(model_id=MODEL, max_body_bytes=limit)))
    try:
        padding = "x" * limit
        response = chat(loopback, json.dumps({**VALID, "user": padding}))
        assert assert_openai_error(response.status_code, response.content, (413,))["code"] == "request_too_large"
        at_limit = json.dumps({**VALID, "user": ""})
        at_limit = at_limit.replace('"user": ""', '"user": "' + "x" * (limit - len(at_limit)) + '"')
        assert len(at_limit) == limit and chat(loopback, at_limit).status_code == 200
        chunks = (b"x" * 1024 for _ in range(64))  # streamed without a Content-Length
        response = httpx.post(f"{loopback.url}/v1/chat/completions", content=chunks)
        assert assert_openai_error(response.status_code, response.content, (413,))["code"] == "request_too_large"

        async def bad_length() -> httpx.Response:  # HTTP clients refuse to send this: talk ASGI directly
            transport = httpx.ASGITransport(app=loopback.server.config.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://ninfer") as client:
                return await client.post("/tokenize", content=b"{}", headers={"content-length": "abc"})

        liar = asyncio.run(bad_length())
        assert assert_openai_error(liar.status_code, liar.content, (400,))["code"] == "invalid_request"
        assert chat(loopback, json.dumps(VALID)).status_code == 200  # still serving
    finally:
        loopback.stop()


# ---------------------------------------------------------------------------------------------------------------
# garbage in bulk
# ---------------------------------------------------------------------------------------------------------------

FIELDS = sorted(ChatCompletionRequest.model_fields)
MESSAGE_KEYS = ["role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "refusal", "audio"]
STRINGS = ["", "user", "assistant", "tool", "system", "function", "<|im_start|>", "</think>", "<tool_call>", "\x00",
           "é" * 3, "🙂", "a" * 300, "null", "{}", "test-model", "auto", "none", "required", "text", "function"]


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, 1, -1, 2, 7, 2**31, -(2**63), 10**30, 4095, 4096])
    if kind == 3:
        return rng.choice([0.0, 0.5, -0.5, 1.0, 2.5, 1e308, -1e-300, 100.0])
    if kind in (4, 5):
        return rng.choice(STRINGS)
    if kind == 6:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = FIELDS + MESSAGE_KEYS + ["type", "function", "arguments", "text", "include_usage", "enable_thinking"]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def garbage(rng: random.Random, index: int) -> tuple[str, str, bytes, tuple[int, ...]]:
    """(method, path, body, allowed statuses) of the index-th garbage request."""
    kind = index % 5
    if kind == 0:  # random bytes
        return "POST", "/v1/chat/completions", rng.randbytes(rng.randrange(1, 200)), (400,)
    if kind == 1:  # random JSON value
        return "POST", "/v1/chat/completions", json.dumps(random_json(rng)).encode(), (400,)
    body: dict[str, Any] = json.loads(json.dumps(VALID))
    if kind == 2:  # a random field on a request for a model that is not served
        body["model"] = "not-served"
        body[rng.choice(FIELDS)] = random_json(rng)
        return "POST", "/v1/chat/completions", json.dumps(body).encode(), (400, 404)
    if kind == 3:  # a random change to a valid request: fine (200, one token) or refused (400)
        if rng.random() < 0.5:
            body["messages"] = [{rng.choice(MESSAGE_KEYS): random_json(rng) for _ in range(rng.randrange(1, 4))}]
        else:
            body[rng.choice([f for f in FIELDS if f not in ("max_completion_tokens", "model")])] = random_json(rng)
        return "POST", "/v1/chat/completions", json.dumps(body).encode(), (200, 400)
    method, path = rng.choice([("GET", "/v1/chat/completions"), ("POST", "/v1/models"), ("POST", "/nope"),
                               ("POST", "/tokenize"), ("POST", "/detokenize"), ("DELETE", "/health"),
                               ("GET", "/v1/models/" + rng.choice(["x", "gpt-4o", "a/b", "%00", "..", "test-model"]))])
    return method, path, json.dumps(random_json(rng)).encode(), (400, 404, 405, 200)


def test_thousands_of_garbage_requests(engine: Engine, server: Loopback) -> None:
    app = create_app(engine, ServeConfig(model_id=MODEL))
    rng = random.Random(20260731)
    statuses: Counter[int] = Counter()

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ninfer") as client:
            for index in range(GARBAGE_REQUESTS):
                method, path, body, allowed = garbage(rng, index)
                response = await client.request(method, path, content=body,
                                                headers={"content-type": "application/json"})
                statuses[response.status_code] += 1
                if response.status_code != 200:
                    assert_openai_error(response.status_code, response.content, allowed)
                else:
                    assert 200 in allowed, (method, path, body[:300])

    started = time.perf_counter()
    asyncio.run(run())
    assert sum(statuses.values()) == GARBAGE_REQUESTS
    assert statuses[400] > GARBAGE_REQUESTS // 2 and statuses[404] > 0 and statuses[405] > 0
    assert not any(status >= 500 for status in statuses), statuses
    assert time.perf_counter() - started < 60
    wait_until(lambda: engine.stats()["running"] == 0)  # a finished sequence is released at the next step
    # the real server, sharing the engine, still answers
    answer = httpx.post(f"{server.url}/v1/chat/completions", json={**VALID, "max_completion_tokens": 3}, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3


# ---------------------------------------------------------------------------------------------------------------
# concurrency and cancellation
# ---------------------------------------------------------------------------------------------------------------


def test_parallel_streams_get_their_single_request_text(engine: Engine, server: Loopback) -> None:
    client = server.openai_client("unused", timeout=120)
    topics = ["the sea", "a cat", "Python lists", "the moon", "bread", "trains", "winter", "chess"]
    requests = [{"messages": [{"role": "user", "content": f"Tell me about {topic}."}], "temperature": 0,
                 "max_tokens": 40, "extra_body": {"enable_thinking": index % 2 == 0}}
                for index, topic in enumerate(topics)]

    def single(request: dict[str, Any]) -> tuple[str, str]:
        message = client.chat.completions.create(model=MODEL, **request).choices[0].message
        return message.reasoning_content or "", message.content or ""

    def streamed(request: dict[str, Any]) -> tuple[str, str]:
        barrier.wait()
        chunks = list(client.chat.completions.create(model=MODEL, stream=True, **request))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        return ("".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
                "".join(d.content or "" for d in deltas))

    expected = [single(request) for request in requests]
    assert len(set(expected)) == len(expected)  # distinct answers: a mix-up would show
    barrier = threading.Barrier(len(requests))
    most_running = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal most_running
        while not done.is_set():
            most_running = max(most_running, engine.stats()["running"])
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            results = list(pool.map(streamed, requests))
    finally:
        done.set()
        watcher.join()
    assert results == expected
    assert most_running >= 2  # they really ran together


def test_cancelled_requests_free_their_sequences(llm: LLM) -> None:
    """A stream closed mid-way, a non-streaming request whose client gives up, and a request still waiting in
    the queue are all cancelled: the engine has nothing running or waiting soon after, far sooner than the
    generations (4000 tokens each) or the queue timeout would take."""
    engine = llm.engine_with(max_concurrency=1, max_pending=4, queue_timeout=30).start()
    loopback = Loopback(create_app(engine, ServeConfig(model_id=MODEL)))
    url = f"{loopback.url}/v1/chat/completions"
    idle = lambda: engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0  # noqa: E731
    try:
        with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as response:
            lines = response.iter_lines()
            for _ in range(3):
                next(lines)
            assert engine.stats()["running"] == 1
        wait_until(idle, timeout=5)

        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=LONG, timeout=httpx.Timeout(60, read=0.5))
        wait_until(idle, timeout=5)

        with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as running:
            lines = running.iter_lines()
            next(lines)
            with pytest.raises(httpx.ReadTimeout):  # waits in the queue, then its client gives up
                httpx.post(url, json={**LONG, "stream": True}, timeout=httpx.Timeout(60, read=0.5))
            wait_until(lambda: engine.stats()["waiting"] == 0, timeout=5)
            assert engine.stats()["running"] == 1
        wait_until(idle, timeout=5)

        answer = httpx.post(url, json={**VALID, "max_completion_tokens": 2}, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
    finally:
        loopback.stop()
        engine.close()
