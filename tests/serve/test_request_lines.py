"""The operator's log: one line per HTTP request on the `ninfer.serve` logger (method, path, status, error code,
token counts, milliseconds), with no request log file configured, and never a word of the prompt or the answer."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest

from ninfer.engine import Engine
from ninfer.serve.app import create_app
from ninfer.serve.state import ServeConfig
from tests.serve.support import Loopback, wait_until

MODEL = "test-model"
SECRET = "purple-elephant-secret"  # a prompt word that must never reach the log


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[Loopback]:
    loopback = Loopback(create_app(engine, ServeConfig(model_id=MODEL)))
    yield loopback
    loopback.stop()


def _request_lines(caplog: pytest.LogCaptureFixture, count: int) -> list[logging.LogRecord]:
    """The server's request lines, once `count` of them have been written (a line follows the response's end)."""

    def lines() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "ninfer.serve" and r.getMessage().endswith(" ms")]

    wait_until(lambda: len(lines()) >= count)
    return lines()


def test_a_4xx_leaves_one_line_without_the_prompt(server: Loopback, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ninfer.serve")
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": f"tell me about {SECRET}"}]}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).status_code == 404
    [line] = _request_lines(caplog, 1)
    assert line.levelno == logging.INFO
    assert line.getMessage().startswith("POST /v1/chat/completions 404 model_not_found ")
    assert SECRET not in caplog.text


def test_a_generation_line_has_its_token_counts_and_no_text(server: Loopback,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ninfer.serve")
    body = {"model": MODEL, "messages": [{"role": "user", "content": SECRET}], "max_tokens": 3,
            "temperature": 0, "ignore_eos": True, "enable_thinking": False}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200
    usage = response.json()["usage"]
    [line] = _request_lines(caplog, 1)
    assert line.getMessage().startswith(f"POST /v1/chat/completions 200 prompt_tokens={usage['prompt_tokens']} "
                                        "completion_tokens=3 ")
    answer = response.json()["choices"][0]["message"]["content"]
    assert SECRET not in caplog.text and (not answer.strip() or answer not in caplog.text)


def test_health_checks_log_only_at_debug(server: Loopback, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ninfer.serve")
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/v1/models/nope%0Aforged", timeout=10).status_code == 404
    [line] = _request_lines(caplog, 1)  # the health check wrote none
    assert line.getMessage().startswith("GET /v1/models/nope\\nforged 404 not_found ")  # a path stays one line
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="ninfer.serve")
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    [line] = _request_lines(caplog, 1)
    assert line.levelno == logging.DEBUG and line.getMessage().startswith("GET /health 200 ")
