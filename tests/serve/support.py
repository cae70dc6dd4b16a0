"""What the server tests share besides their fixtures (conftest.py): a loopback uvicorn server with its SDK clients,
a scripted stand-in for the engine, a server whose one slot is taken, and small waiting and greedy helpers."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import uvicorn

from ninfer.engine import LLM, Engine, Finished, Result
from ninfer.frontend import ContentDelta, ReasoningDelta, ToolCall
from ninfer.sampling import SamplingParams
from ninfer.serve.app import create_app
from ninfer.serve.state import ServeConfig

STARTUP_SECONDS = 10.0  # how long the loopback server may take to start, and to stop


class Loopback:
    """A uvicorn server for `app` on a free 127.0.0.1 port, in a background thread."""

    def __init__(self, app: Any):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + STARTUP_SECONDS
        while not self.server.started:
            assert time.monotonic() < deadline, "the loopback server did not start"
            time.sleep(0.01)

    def openai_client(self, key: str, timeout: float = 60) -> openai.OpenAI:
        """An OpenAI SDK client of this server that never retries."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=timeout)

    def anthropic_client(self, key: str) -> anthropic.Anthropic:
        """An Anthropic SDK client of this server that never retries."""
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0, timeout=60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=STARTUP_SECONDS)


class ScriptedEngine:
    """Stands in for Engine: answers every request with the same events (an exception in the script is raised),
    then Finished with a completion that holds the scripted text, reasoning and tool calls and 3 generated tokens."""

    def __init__(self, llm: LLM, script: list[Any]):
        self.llm = llm
        self.script = script

    def stats(self) -> dict[str, int]:
        return {"running": 0, "waiting": 0}

    async def generate(self, request: Any) -> AsyncIterator[Any]:
        completion = Result(finish_reason="stop", token_ids=[1, 2, 3])
        completion.stats.prompt_tokens = len(request.prompt_ids)
        completion.stats.generated_tokens = len(completion.token_ids)
        for event in self.script:
            if isinstance(event, Exception):
                raise event
            if isinstance(event, ToolCall):
                completion.tool_calls.append(event)
            elif isinstance(event, ContentDelta):
                completion.text += event.text
            elif isinstance(event, ReasoningDelta):
                completion.reasoning += event.text
            yield event
        yield Finished(completion)


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll `condition` until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the engine"
        time.sleep(0.01)


def greedy(llm: LLM, messages: list[dict], max_tokens: int, **options: Any) -> Result:
    """The single-sequence LLM's greedy answer: what the server must reproduce at temperature 0."""
    return llm.generate(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens), **options)


@contextlib.contextmanager
def one_slot_taken(llm: LLM, model_id: str) -> Iterator[tuple[Loopback, Engine]]:
    """A loopback server whose engine has one running slot and one waiting place (queue timeout 2 s), the slot held
    by a long chat stream during the `with` body; the server and the engine are stopped afterwards."""
    engine = llm.engine_with(max_concurrency=1, max_pending=1, queue_timeout=2.0).start()
    loopback = Loopback(create_app(engine, ServeConfig(model_id=model_id)))
    blocker = {"model": model_id, "messages": [{"role": "user", "content": "What is the capital of France?"}],
               "max_tokens": 4000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{loopback.url}/v1/chat/completions", json=blocker, timeout=60) as running:
            lines = running.iter_lines()  # kept: a dropped line iterator closes the response, cancelling the stream
            next(lines)
            yield loopback, engine
    finally:
        loopback.stop()
        engine.close()
