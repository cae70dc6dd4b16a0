"""Fixtures of the server tests: the tiny model and a started engine over it, once per test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ninfer.engine import LLM, Engine

REASONING_MODEL = Path(__file__).resolve().parents[2] / "data" / "models" / "small-moe-q8.ninfer"


def _one_thread(path: Path | None) -> Iterator[LLM]:
    """An LLM with torch on one thread (the small models are fastest on one thread; more only contend on a busy
    machine); the thread count is restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(path)
    torch.set_num_threads(threads)


def _started(llm: LLM) -> Iterator[Engine]:
    """A started Engine over `llm` (8 concurrent sequences, 64 waiting), closed afterwards."""
    engine = llm.engine_with(max_concurrency=8, max_pending=64).start()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    """The embedded demo model (`_one_thread`)."""
    yield from _one_thread(None)


@pytest.fixture(scope="module")
def engine(llm: LLM) -> Iterator[Engine]:
    yield from _started(llm)


@pytest.fixture(scope="module")
def reasoning_llm() -> Iterator[LLM]:
    """The small MoE model: it never saw the chat format, so with thinking on it reasons until its budget ends (the
    embedded model, taught chats, closes an empty reasoning block at once): for the tests of the reasoning path."""
    yield from _one_thread(REASONING_MODEL)


@pytest.fixture(scope="module")
def reasoning_engine(reasoning_llm: LLM) -> Iterator[Engine]:
    yield from _started(reasoning_llm)
