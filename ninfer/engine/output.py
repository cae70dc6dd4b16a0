"""What happens to each generated token of a sequence: sampling with the padding rows masked, stop ids, the
incremental detokenizer, stop strings and the reasoning / tool-call parser, accumulated into a Completion.
Shared by `LLM.stream` (one sequence) and the serving scheduler (many)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ninfer.engine.speculative import SpeculationStats
from ninfer.frontend import (
    ContentDelta,
    IncrementalDetokenizer,
    OutputParser,
    ReasoningDelta,
    StopMatcher,
    Tokenizer,
    ToolCall,
)
from ninfer.kernels.sampling import make_generator, sample_batch
from ninfer.sampling import SamplingError, SamplingParams


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens resumed from a cached prefix instead of prefilled
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    speculation: SpeculationStats | None = None  # rounds, drafts and acceptance, when the engine speculates

    @property
    def prefill_tokens_per_second(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # the first token comes from the prefill's logits; each later one costs a decode step
        steps = max(0, self.generated_tokens - 1)
        return steps / self.decode_seconds if self.decode_seconds else 0.0


@dataclass
class Completion:
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "stop" (eos, stop id or stop string) or "length"
    stop_string: str | None = None  # the stop string that ended generation, if one did
    stats: GenerationStats = field(default_factory=GenerationStats)

    @property
    def prompt_tokens(self) -> int:
        return self.stats.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def cached_tokens(self) -> int:
        return self.stats.cached_tokens


def sample_rows(pipelines: list[OutputPipeline], logits: torch.Tensor) -> list[int | SamplingError]:
    """The next token of each pipeline's sequence from its row of `logits` `[B, V]` (rows past the tokenizer's
    vocabulary, the embedding's padding, masked first, in place): `sample_batch`, one device round trip for
    the whole batch."""
    logits[:, pipelines[0].tokenizer.vocab_size :] = float("-inf")  # padding rows of the embedding: no text
    params, generators, prompts, generated = zip(*(p.sampling_inputs() for p in pipelines), strict=True)
    return sample_batch(logits, params, generators, prompts, generated)


class OutputPipeline:
    """One sequence's sampler and text pipeline. `step(logits)` samples the next token and returns the events it
    decided (`sample_rows` + `advance` do the same for many sequences at once); once `done`, `completion` holds
    the whole answer."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_ids: torch.Tensor, *, thinking: bool,
                 tools_enabled: bool, device: torch.device):
        self.tokenizer = tokenizer
        self.params = params
        self.prompt_ids = prompt_ids
        self.device = device
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eos_ids))
        self.parser = OutputParser(thinking=thinking, tools_enabled=tools_enabled)
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stops = StopMatcher(list(params.stop))
        self.generator = make_generator(params.seed, device)
        self.completion = Completion()
        self.done = False

    def step(self, logits: torch.Tensor, free: int) -> list[Any]:
        """Sample from `logits` (the last position's, fp32 [V]) and `advance` with the token."""
        return self.advance(sample_rows([self], logits[None])[0], free)

    def sampling_inputs(self) -> tuple[SamplingParams, torch.Generator | None, torch.Tensor | None,
                                       torch.Tensor | None]:
        """What `sample_batch` needs for this sequence's next token: params, generator, and the prompt / generated
        ids only when a penalty reads them (no host-to-device copy of the generated ids otherwise)."""
        p = self.params
        repetition = p.repetition_penalty != 1.0
        generated = None
        if repetition or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            generated = torch.tensor(self.completion.token_ids, dtype=torch.long, device=self.device)
        return p, self.generator, self.prompt_ids if repetition else None, generated

    def advance(self, token: int | SamplingError, free: int) -> list[Any]:
        """Take the sampled `token` (a SamplingError is raised); `free` = context positions still free before it
        takes one. Returns the decided events; sets `done` when the sequence ends."""
        if isinstance(token, SamplingError):
            raise token
        if token in self.stop_ids:
            return self.finish("stop")
        self.completion.token_ids.append(token)
        text, stopped = self.stops.feed(self.detokenizer.push(token))
        events = self._emit(self.parser.feed(text))
        if stopped:
            self.completion.stop_string = self.stops.matched
            return events + self.finish("stop", flush=False)
        if len(self.completion.token_ids) >= self.params.max_tokens or free <= 1:
            return events + self.finish("length")
        return events

    def finish(self, reason: str, flush: bool = True) -> list[Any]:
        """End the sequence: release held-back text (unless a stop string cut it) and close the parser."""
        events = []
        if flush:
            tail, stopped = self.stops.feed(self.detokenizer.flush())
            if stopped:
                self.completion.stop_string = self.stops.matched
            events += self._emit(self.parser.feed(tail if stopped else tail + self.stops.flush()))
        events += self._emit(self.parser.finish())
        self.completion.finish_reason = reason
        self.done = True
        return events

    def _emit(self, events: list[Any]) -> list[Any]:
        for event in events:
            if isinstance(event, ReasoningDelta):
                self.completion.reasoning += event.text
            elif isinstance(event, ContentDelta):
                self.completion.text += event.text
            elif isinstance(event, ToolCall):
                self.completion.tool_calls.append(event)
        return events
