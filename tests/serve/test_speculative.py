"""A server over a speculating engine: the same answers as plain decoding, and the rounds in every API's usage (an
extension field) and in the request log."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from ninfer.engine import LLM
from ninfer.serve.app import create_app
from ninfer.serve.state import ServeConfig
from tests.serve.support import Loopback, wait_until

MODEL = "test-model"
PROMPT = [{"role": "user", "content": "Write a function to add two numbers."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loopback]:
    log = tmp_path_factory.mktemp("serve") / "requests.jsonl"
    engine = LLM(runner="reference", spec="mtp", draft_tokens=2).engine.start()
    loopback = Loopback(create_app(engine, ServeConfig(model_id=MODEL, request_log=log)))
    loopback.log_path = log  # type: ignore[attr-defined]
    yield loopback
    loopback.stop()
    engine.close()


def test_usage_and_log_carry_the_rounds(server: Loopback, llm: LLM) -> None:
    expected = llm.generate(PROMPT, llm.default_params(temperature=0, max_tokens=12), thinking=False)
    requests = {
        "/v1/chat/completions": {"messages": PROMPT, "chat_template_kwargs": {"enable_thinking": False}},
        "/v1/messages": {"messages": PROMPT, "thinking": {"type": "disabled"}},
        "/v1/responses": {"input": PROMPT, "reasoning": {"effort": "none"}},
    }
    for route, body in requests.items():
        tokens = "max_output_tokens" if route == "/v1/responses" else "max_tokens"
        response = httpx.post(f"{server.url}{route}", timeout=120,
                              json={"model": MODEL, "temperature": 0, tokens: 12, **body})
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        spec = usage["speculative"]
        assert spec["method"] == "mtp" and spec["rounds"] >= 1
        # two drafts a round (fewer in a round the output budget cuts short)
        assert spec["rounds"] < spec["drafted_tokens"] <= 2 * spec["rounds"] and len(spec["accepted_per_position"]) == 2
        assert spec["accepted_tokens"] == sum(spec["accepted_per_position"]) <= spec["drafted_tokens"]
        if route == "/v1/chat/completions":
            assert response.json()["choices"][0]["message"]["content"] == expected.text
    def lines() -> list[dict]:  # a request's line is written after its response ends
        return [json.loads(line) for line in server.log_path.read_text().splitlines()]  # type: ignore[attr-defined]

    wait_until(lambda: len(lines()) >= 3)
    assert len(lines()) == 3 and all(line["speculative"]["rounds"] >= 1 for line in lines())
