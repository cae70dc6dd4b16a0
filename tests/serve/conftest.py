"""Fixtures of the server tests: the tiny model and a started engine over it, once per test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ninfer.engine import LLM, Engine

REASONING_MODEL = Path(__file__).resolve().parents[2] / "data" / "models" / "small-moe-q8.ninfer"


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    """The tiny default LLM with torch on one thread (the tiny model is fastest on one thread; more only contend on
    a busy machine); the thread count is restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine(llm: LLM) -> Iterator[Engine]:
    """A started Engine over the `llm` fixture (8 concurrent sequences, 64 waiting), closed afterwards."""
    engine = llm.engine_with(max_concurrency=8, max_pending=64).start()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reasoning_llm() -> Iterator[LLM]:
    """The small MoE model: it never saw the chat format, so with thinking on it reasons until its budget ends (the
    embedded model, taught chats, closes an empty reasoning block at once): for the tests of the reasoning path."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(REASONING_MODEL)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reasoning_engine(reasoning_llm: LLM) -> Iterator[Engine]:
    engine = reasoning_llm.engine_with(max_concurrency=8, max_pending=64).start()
    yield engine
    engine.close()
