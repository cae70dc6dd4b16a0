"""What every route shares: the server's configuration and `ServerState`, the one way to the engine and the model."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ninfer.engine import LLM, Engine
from ninfer.serve.errors import APIError
from ninfer.serve.request_log import RequestLog

MiB = 1 << 20


@dataclass
class ServeConfig:
    """model_id: the served id (`model` in requests, the id /v1/models lists); model_aliases: other names a request's
    `model` may give (e.g. the Claude or GPT names a client is set to send); api_key: required on every route but
    /health when set;
    max_body_bytes: largest request body; default_max_tokens: output budget when a request sets none;
    cors: allow browsers from any origin; request_log: JSONL file to append one line per request to;
    default_thinking: thinking on for requests that do not say."""

    model_id: str
    model_aliases: tuple[str, ...] = ()
    api_key: str | None = None
    max_body_bytes: int = 8 * MiB
    default_max_tokens: int = 1024
    cors: bool = False
    request_log: str | Path | None = None
    default_thinking: bool = True


@dataclass
class ServerState:
    """What the routes share: the engine (owned by the caller, who starts and closes it), the configuration and the
    request log (None when off). `created` is the server's start time (unix seconds), used as the model's."""

    engine: Engine
    config: ServeConfig
    log: RequestLog | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_id(self) -> str:
        return self.config.model_id

    @property
    def llm(self) -> LLM:
        """The loaded model (template, tokenizer, context length, sampling defaults): routes reach it only here."""
        return self.engine.llm


def check_model(state: ServerState, model: str | None, param: str = "model") -> None:
    """404 model_not_found (Anthropic: not_found_error) unless `model` is the served id or one of its aliases."""
    if model != state.model_id and model not in state.config.model_aliases:
        names = ", ".join(repr(name) for name in (state.model_id, *state.config.model_aliases))
        raise APIError(404, f"the model {model!r} does not exist; this server serves {names} (see GET /v1/models)",
                       code="model_not_found", param=param)
