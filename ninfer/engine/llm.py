"""`ninfer.LLM`: load an artifact and generate, whole or streamed, from text, chat messages or token ids.

    llm = ninfer.LLM()                                   # the embedded demo model, on the CPU
    llm = ninfer.LLM("model.ninfer", device="cuda")
    print(llm.generate("Hello", SamplingParams(temperature=0)).text)
    for event in llm.stream([{"role": "user", "content": "Hi"}]):
        ...                                              # ReasoningDelta / ContentDelta / ToolCall, then Finished

One sequence at a time on the reference model: prefill the prompt, then sample token by token; the text
goes through the incremental detokenizer, the stop-string matcher and the reasoning / tool-call parser.
Ids beyond the tokenizer's vocabulary (the embedding's padding rows, e.g. 248,077..248,319 for Qwen3.5) are
never sampled: they have no text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ninfer.artifact.reader import Artifact
from ninfer.devices import parse_device
from ninfer.errors import NinferError
from ninfer.frontend import (
    ChatTemplate,
    ContentDelta,
    IncrementalDetokenizer,
    OutputParser,
    ReasoningDelta,
    StopMatcher,
    Tokenizer,
    ToolCall,
)
from ninfer.kernels.sampling import make_generator, sample_next
from ninfer.model.qwen3_5 import Qwen35Model
from ninfer.sampling import SamplingParams

DEFAULT_ARTIFACT = Path(__file__).resolve().parent.parent / "assets" / "demo.ninfer"

Messages = list[dict[str, Any]]
Prompt = str | Messages | Sequence[int]


class PromptTooLongError(NinferError):
    """The prompt (plus one generated token) does not fit in the context."""


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

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
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass
class Finished:
    """The last event of a stream."""

    completion: Completion


class LLM:
    """A loaded model with its tokenizer and chat template."""

    def __init__(self, model: str | Path | None = None, *, device: str = "cpu", dtype: torch.dtype | None = None,
                 max_context: int | None = None):
        started = time.perf_counter()
        self.path = Path(model) if model is not None else DEFAULT_ARTIFACT
        self.device = parse_device(device)
        self.dtype = dtype or (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        with Artifact.open(self.path) as artifact:
            self.model = Qwen35Model.from_artifact(artifact, self.device, self.dtype)
            self.tokenizer = Tokenizer.from_artifact(artifact)
            generation_config = artifact.component_resource("text", "generation_config.json")
            self.generation_config = json.loads(generation_config) if generation_config else {}
            has_template = any(artifact.component_resource("text", role) is not None
                               for role in ("chat_template.jinja", "tokenizer_config.json"))
            self.template = ChatTemplate.from_artifact(artifact) if has_template else None
        limit = self.model.config.max_positions
        if max_context is not None and max_context < 2:
            raise NinferError(f"max_context {max_context} is too small (at least 2)")
        self.max_context = min(max_context or limit, limit)
        self.load_seconds = time.perf_counter() - started

    # -- prompts ---------------------------------------------------------------------------------------------

    def prompt_ids(self, prompt: Prompt, *, raw: bool = False, thinking: bool = True,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a prompt: ids as given, text as is with `raw`, otherwise text or messages rendered
        through the chat template with the generation prompt."""
        if not isinstance(prompt, str) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            vocab = self.model.config.vocab
            if any(t < 0 or t >= vocab for t in ids):
                raise NinferError(f"prompt token ids must lie in [0, {vocab})")
            return ids
        if isinstance(prompt, str) and raw:
            return self.tokenizer.encode(prompt)
        if self.template is None:
            raise NinferError(f"{self.path} has no chat template; use a raw prompt")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        text = self.template.render(messages, tools=tools, add_generation_prompt=True, enable_thinking=thinking)
        return self.tokenizer.encode(text)

    def default_params(self, **overrides: Any) -> SamplingParams:
        """Sampling defaults of the artifact's generation_config (greedy unless it sets do_sample), then overrides."""
        return SamplingParams.from_generation_config(self.generation_config, **overrides)

    # -- generation ------------------------------------------------------------------------------------------

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, raw: bool = False,
               thinking: bool = True, tools: list[dict[str, Any]] | None = None) -> Iterator[Any]:
        """Yield ReasoningDelta / ContentDelta / ToolCall events as text is decided, then Finished."""
        params = params or self.default_params()
        ids = self.prompt_ids(prompt, raw=raw, thinking=thinking, tools=tools)
        templated = not (raw or (not isinstance(prompt, str) and all(isinstance(t, int) for t in prompt)))
        if not ids:
            raise NinferError("the prompt is empty")
        if len(ids) + 1 > self.max_context:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens; the context holds {self.max_context} "
                                     "(the prompt plus at least one generated token)")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.tokenizer.eos_ids))
        parser = OutputParser(thinking=templated and thinking, tools_enabled=bool(tools) or templated)
        detokenizer = IncrementalDetokenizer(self.tokenizer)
        stops = StopMatcher(list(params.stop))
        generator = make_generator(params.seed, self.device)
        completion = Completion()
        stats = completion.stats
        stats.prompt_tokens = len(ids)
        prompt_tensor = torch.tensor(ids, device=self.device)
        generated: list[int] = []

        def emit(events: list[Any]) -> Iterator[Any]:
            for event in events:
                if isinstance(event, ReasoningDelta):
                    completion.reasoning += event.text
                elif isinstance(event, ContentDelta):
                    completion.text += event.text
                elif isinstance(event, ToolCall):
                    completion.tool_calls.append(event)
                yield event

        with torch.inference_mode():
            state = self.model.new_state(min(self.max_context, len(ids) + params.max_tokens))
            started = time.perf_counter()
            logits = self.model.forward(prompt_tensor, state)
            _sync(self.device)
            stats.prefill_seconds = time.perf_counter() - started
            started = time.perf_counter()
            finish, stopped = "length", False
            while True:
                logits[self.tokenizer.vocab_size :] = float("-inf")  # padding rows of the embedding: no text
                token = sample_next(logits, params, generator, prompt_tensor,
                                    torch.tensor(generated, dtype=torch.long, device=self.device))
                if token in stop_ids:
                    finish = "stop"
                    break
                generated.append(token)
                text, stopped = stops.feed(detokenizer.push(token))
                yield from emit(parser.feed(text))
                if stopped:
                    finish = "stop"
                    break
                if len(generated) >= params.max_tokens or len(ids) + len(generated) >= state.capacity:
                    break
                logits = self.model.forward(torch.tensor([token], device=self.device), state)
            _sync(self.device)
            stats.decode_seconds = time.perf_counter() - started
        if not stopped:  # text held back for a possible stop string or an unfinished character is final now
            tail, stopped = stops.feed(detokenizer.flush())
            yield from emit(parser.feed(tail if stopped else tail + stops.flush()))
        yield from emit(parser.finish())
        completion.token_ids = generated
        completion.finish_reason = finish
        stats.generated_tokens = len(generated)
        yield Finished(completion)

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, **options: Any) -> Completion:
        """The whole completion of one prompt (see `stream` for the options)."""
        for event in self.stream(prompt, params, **options):
            if isinstance(event, Finished):
                return event.completion
        raise AssertionError("a stream always ends with Finished")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
