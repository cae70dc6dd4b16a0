"""A request to the engine and the sequence that carries it through admission, prefill and decode."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ninfer.engine.output import Completion, OutputPipeline
from ninfer.sampling import SamplingParams


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    thinking: bool = True  # the prompt's generation prompt opened <think>: the output starts as reasoning
    tools_enabled: bool = False  # parse <tool_call> blocks
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])


# The result of a request is the Completion of its output pipeline; its `stats` carry the token counts and the
# queue / prefill / decode timings (cached_tokens: prompt tokens resumed from the prefix cache).
Result = Completion


@dataclass
class Finished:
    """The last event of a request's stream."""

    completion: Completion


class Sequence:
    """One request inside the engine. `deliver(item)` hands an event, `Finished` or an exception to the request's
    consumer (from the engine's thread)."""

    def __init__(self, request: Request, deliver: Callable[[Any], None]):
        self.request = request
        self.deliver = deliver
        self.enqueued = time.perf_counter()
        self.cancelled = False
        self.finished = False
        self.state: Any = None  # the model's state of this sequence
        self.output: OutputPipeline | None = None
        self.position = 0  # prompt tokens in the state
        self.boundaries: set[int] = set()  # prompt positions right after a turn (prefix snapshots are taken there)
        self.limit = 0  # context positions this sequence may fill: prompt + output budget (resolved at admission)
        self.logits: torch.Tensor | None = None
        self.reserved = 0  # KV positions reserved at admission (the limit in whole pages)
        self.prefill_started = 0.0
        self.decode_started = 0.0

    @property
    def prompt_done(self) -> bool:
        return self.position >= len(self.request.prompt_ids)

    def send(self, item: Any) -> None:
        try:
            self.deliver(item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is left to tell
            self.cancelled = True
