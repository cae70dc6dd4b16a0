"""`ninfer.LLM`: load an artifact and generate, whole or streamed, from text, chat messages or token ids.

    llm = ninfer.LLM()                                   # the embedded demo model, on the CPU
    llm = ninfer.LLM("model.ninfer", device="cuda")
    print(llm.generate("Hello", SamplingParams(temperature=0)).text)
    for event in llm.stream([{"role": "user", "content": "Hi"}]):
        ...                                              # ReasoningDelta / ContentDelta / ToolCall, then Finished

The model is the GPU fast path (ninfer.fast: packed weights, paged KV, CUDA-graph decode) on CUDA when the
model's shapes suit its kernels, else the torch reference model (`runner="reference"` forces it). One sequence at a
time here (the serving Engine batches): prefill the prompt, then sample token by token; the text
goes through the incremental detokenizer, the stop-string matcher and the reasoning / tool-call parser.
Ids beyond the tokenizer's vocabulary (the embedding's padding rows, e.g. 248,077..248,319 for Qwen3.5) are
never sampled: they have no text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ninfer.artifact.reader import Artifact
from ninfer.devices import parse_device, synchronize
from ninfer.engine.output import Completion, OutputPipeline
from ninfer.errors import NinferError
from ninfer.frontend import ChatTemplate, Tokenizer
from ninfer.model.config import TextConfig
from ninfer.model.qwen3_5 import Qwen35Model
from ninfer.sampling import SamplingParams

DEFAULT_ARTIFACT = Path(__file__).resolve().parent.parent / "assets" / "demo.ninfer"

FAST_DEFAULT_CONTEXT = 32768

Messages = list[dict[str, Any]]
Prompt = str | Messages | Sequence[int]


def fast_path_unsupported(config: TextConfig, device: torch.device) -> str | None:
    """Why the fast path cannot run this model here, or None when it can."""
    if device.type != "cuda":
        return "it runs on CUDA only"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed"
    if config.head_dim < 64 or config.head_dim & (config.head_dim - 1):
        return f"the attention head_dim {config.head_dim} is not a power of two of at least 64"
    return None


class PromptTooLongError(NinferError):
    """The prompt (plus one generated token) does not fit in the context."""


PREFILL_CHUNK = 4096  # prompt tokens per prefill chunk of the model (fast path: fewer cost more per token)


@dataclass
class Finished:
    """The last event of a stream."""

    completion: Completion


class LLM:
    """A loaded model with its tokenizer and chat template."""

    def __init__(self, model: str | Path | None = None, *, device: str = "cpu", dtype: torch.dtype | None = None,
                 max_context: int | None = None, runner: str = "auto", kv_dtype: str = "bf16",
                 state_dtype: str = "fp32", kv_capacity: int | None = None, max_sequences: int = 8,
                 prefill_chunk: int = PREFILL_CHUNK, progress: bool = False):
        """`runner`: "auto" (the fast path on CUDA when the model suits it), "fast" or "reference". The fast path's
        options: `kv_dtype` (bf16 / int8 / fp8), `state_dtype` (the GDN recurrent state as stored: fp32 / bf16),
        `kv_capacity` (KV tokens over all sequences; default: what the free memory holds, up to `max_sequences`
        full contexts), `max_sequences` (state slots = the largest decode batch), `prefill_chunk`; its context
        defaults to min(the model's, FAST_DEFAULT_CONTEXT)."""
        started = time.perf_counter()
        self.path = Path(model) if model is not None else DEFAULT_ARTIFACT
        self.device = parse_device(device)
        self.dtype = dtype or (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        if runner not in ("auto", "fast", "reference"):
            raise NinferError(f"unknown runner {runner!r}; use auto, fast or reference")
        with Artifact.open(self.path) as artifact:
            config = TextConfig.from_dict(artifact.components["text"]["config"])
            reason = fast_path_unsupported(config, self.device)
            if runner == "fast" and reason:
                raise NinferError(f"the fast path cannot run this model: {reason}")
            self.fast = runner != "reference" and reason is None
            if self.fast:
                from ninfer.fast.runner import FastQwen35

                context = min(max_context or FAST_DEFAULT_CONTEXT, config.max_positions)
                self.model = FastQwen35.from_artifact(
                    artifact, self.device, max_sequences=max_sequences, max_context=context,
                    kv_capacity=kv_capacity, kv_dtype=kv_dtype, state_dtype=state_dtype, prefill_chunk=prefill_chunk,
                    dtype=self.dtype, progress=progress)
                max_context = context
            else:
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
        self.check_prompt(ids)
        prompt_tensor = torch.tensor(ids, device=self.device)
        output = OutputPipeline(self.tokenizer, params, prompt_tensor, thinking=templated and thinking,
                                tools_enabled=bool(tools) or templated, device=self.device)
        stats = output.completion.stats
        stats.prompt_tokens = len(ids)
        with torch.inference_mode():
            state = self.model.new_state(min(self.max_context, len(ids) + params.max_tokens))
            started = time.perf_counter()
            logits = self.model.forward(prompt_tensor, state)
            synchronize(self.device)
            stats.prefill_seconds = time.perf_counter() - started
            started = time.perf_counter()
            while True:
                yield from output.step(logits, state.capacity - len(ids) - len(output.completion.token_ids))
                if output.done:
                    break
                logits = self.model.forward(torch.tensor(output.completion.token_ids[-1:], device=self.device), state)
            synchronize(self.device)
            stats.decode_seconds = time.perf_counter() - started
        stats.generated_tokens = len(output.completion.token_ids)
        yield Finished(output.completion)

    def check_prompt(self, ids: list[int]) -> None:
        """Refuse an empty prompt or one that leaves no room for a generated token."""
        if not ids:
            raise NinferError("the prompt is empty")
        if len(ids) + 1 > self.max_context:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens; the context holds {self.max_context} "
                                     "(the prompt plus at least one generated token)")

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, **options: Any) -> Completion:
        """The whole completion of one prompt (see `stream` for the options)."""
        for event in self.stream(prompt, params, **options):
            if isinstance(event, Finished):
                return event.completion
        raise AssertionError("a stream always ends with Finished")
