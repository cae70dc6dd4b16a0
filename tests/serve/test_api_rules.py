"""Rules the three APIs share: a request's `model` is the served id or one of its aliases (else each API's own
404), fields each API requires are required here too, and a burst beyond running + waiting places gets 429 with
Retry-After at once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from ninfer.cli import build_parser
from ninfer.engine import LLM, Engine
from ninfer.serve.app import create_app
from ninfer.serve.state import ServeConfig
from tests.serve.support import Loopback

SERVED = "served-id"
ALIASES = ("claude-test", "gpt-test")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# (path, a valid body without `model`) of every route that takes a model
ROUTES = [
    ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 1}),
    ("/v1/responses/input_tokens", {"input": "Hi"}),
    ("/v1/messages", {"messages": QUESTION, "max_tokens": 1}),
    ("/v1/messages/count_tokens", {"messages": QUESTION}),
]
BURST_SECONDS = 10.0  # the refused part of a burst is answered well within this (the queue timeout is 60 s)


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[Loopback]:
    loopback = Loopback(create_app(engine, ServeConfig(model_id=SERVED, model_aliases=ALIASES)))
    yield loopback
    loopback.stop()


def error_of(response: httpx.Response, path: str) -> dict[str, Any]:
    """The error object of an error response in its API's shape: (type, code) for OpenAI, (type) for Anthropic."""
    body = response.json()
    if path.startswith("/v1/messages"):
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_the_served_id_and_its_aliases_are_answered(server: Loopback, path: str, body: dict) -> None:
    for model in (SERVED, *ALIASES):
        response = httpx.post(f"{server.url}{path}", json={"model": model, **body}, timeout=60)
        assert response.status_code == 200, (model, response.text)


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_an_unknown_model_is_each_apis_not_found(server: Loopback, path: str, body: dict) -> None:
    response = httpx.post(f"{server.url}{path}", json={"model": "claude-3", **body}, timeout=60)
    assert response.status_code == 404, response.text
    error = error_of(response, path)
    if path.startswith("/v1/messages"):
        assert error["type"] == "not_found_error"
    else:
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "model_not_found", "model")
    assert "'claude-3'" in error["message"] and repr(SERVED) in error["message"]


@pytest.mark.parametrize(("path", "body"), [route for route in ROUTES if route[0] != "/v1/responses/input_tokens"])
def test_a_missing_model_is_a_400(server: Loopback, path: str, body: dict) -> None:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = error_of(response, path)
    assert error["type"] == "invalid_request_error" and error["message"] == "model: Field required"
    if not path.startswith("/v1/messages"):
        assert (error["code"], error["param"]) == ("missing_required_parameter", "model")


def test_input_tokens_may_leave_the_model_out(server: Loopback) -> None:
    """As OpenAI's /v1/responses/input_tokens, whose every field is optional."""
    response = httpx.post(f"{server.url}/v1/responses/input_tokens", json={"input": "Hi"})
    assert response.status_code == 200 and response.json()["input_tokens"] > 0


def test_anthropic_requires_max_tokens(server: Loopback) -> None:
    response = httpx.post(f"{server.url}/v1/messages", json={"model": ALIASES[0], "messages": QUESTION})
    assert response.status_code == 400
    assert error_of(response, "/v1/messages") == {"type": "invalid_request_error",
                                                  "message": "max_tokens: Field required"}


def test_models_lists_the_served_id_and_finds_aliases(server: Loopback) -> None:
    listed = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [card["id"] for card in listed] == [SERVED]
    for name in (SERVED, *ALIASES):
        card = httpx.get(f"{server.url}/v1/models/{name}")
        assert card.status_code == 200 and card.json()["id"] == SERVED
    assert httpx.get(f"{server.url}/v1/models/gpt-4o").status_code == 404


def test_model_alias_flag_repeats() -> None:
    args = build_parser().parse_args(["serve", "--model-id", "qwen", "--model-alias", "a", "--model-alias", "b"])
    assert (args.model_id, args.model_alias) == ("qwen", ["a", "b"])
    assert build_parser().parse_args(["serve"]).model_alias == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_a_burst_beyond_running_plus_waiting_gets_429_at_once(llm: LLM, path: str) -> None:
    """max_concurrency 1 + max_pending 1, and 4 requests at once: 2 are refused at once with 429 and Retry-After, 2
    are answered. The engine starts only after the refusals, so the burst surely arrives before it admits any."""
    engine = llm.engine_with(max_concurrency=1, max_pending=1, queue_timeout=60)
    loopback = Loopback(create_app(engine, ServeConfig(model_id=SERVED)))
    body = dict(next(b for p, b in ROUTES if p == path), model=SERVED)
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(httpx.post, f"{loopback.url}{path}", json=body, timeout=90) for _ in range(4)]
            while sum(f.done() for f in futures) < 2 and time.monotonic() - started < BURST_SECONDS:
                time.sleep(0.01)
            refused_seconds = time.monotonic() - started
            first = [f for f in futures if f.done()]
            engine.start()
            refused = [f.result() for f in first]
            answered = [f.result() for f in futures if f not in first]
        assert len(refused) == 2 and refused_seconds < BURST_SECONDS, refused_seconds
        for response in refused:
            assert response.status_code == 429, response.text
            assert response.headers["retry-after"] == "1"
            assert error_of(response, path)["type"] == "rate_limit_error"
        assert [response.status_code for response in answered] == [200, 200]
    finally:
        engine.start()
        loopback.stop()
        engine.close()
