"""`ninfer.LLM`: load an artifact and generate, whole or streamed, from text, chat messages or token ids.

    llm = ninfer.LLM()                                   # the embedded demo model, on the CPU
    llm = ninfer.LLM("model.ninfer", device="cuda")
    print(llm.generate("Hello", SamplingParams(temperature=0)).text)
    for event in llm.stream([{"role": "user", "content": "Hi"}]):
        ...                                              # ReasoningDelta / ContentDelta / ToolCall, then Finished

A synchronous facade over the engine (`llm.engine`, the one generation loop): `stream` submits one request and runs
the engine's steps in the calling thread. The model is the packed GPU model on CUDA when the model's shapes suit its
kernels, else the torch reference model (`runner="reference"` forces it); the text goes through the incremental
detokenizer, the stop-string matcher and the reasoning / tool-call parser. Ids beyond the tokenizer's vocabulary
(the embedding's padding rows, e.g. 248,077..248,319 for Qwen3.5) are never sampled: they have no text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ninfer.artifact.reader import Artifact
from ninfer.config import EngineConfig, SchedulerConfig
from ninfer.devices import parse_device
from ninfer.engine.engine import Engine, PromptTooLongError
from ninfer.engine.load import load_model
from ninfer.engine.output import Completion
from ninfer.engine.sequence import Finished, Request
from ninfer.errors import NinferError
from ninfer.frontend import ChatTemplate, Tokenizer, check_text_only
from ninfer.model.qwen3_5 import Qwen35Model
from ninfer.sampling import SamplingParams

DEFAULT_ARTIFACT = Path(__file__).resolve().parent.parent / "assets" / "demo.ninfer"

Messages = list[dict[str, Any]]
Prompt = str | Messages | Sequence[int]


class LLM:
    """A loaded model with its tokenizer, chat template and engine."""

    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None, *,
                 progress: bool = False, **options: Any):
        """`config`, or its fields as keywords (`EngineConfig.create`): `device` (cpu, cuda), `dtype` (auto, fp32,
        bf16), `runner` ("auto": the packed GPU model on CUDA when the model suits it, "fast", "reference"),
        `verify_weights` (hash every object against the SHA-256 the artifact records before using it; DigestError
        names the damaged ones; the embedded demo model is always checked),
        `kv_dtype` (bf16 / int8 / fp8), `state_dtype` (the GDN recurrent state as stored: fp32 / bf16),
        `kv_capacity` (KV positions over all sequences; default: what the free memory holds, up to `sequences` full
        contexts), `sequences` (state slots = the largest decode batch), `max_context` (default: the model's, at
        most 32,768 on the packed GPU model), `prefill_chunk`, and the scheduler's `max_concurrency`,
        `max_pending`, `queue_timeout`, `interleaved_prefill_chunk`."""
        if config is not None and options:
            raise NinferError("give a config or its options as keywords, not both")
        started = time.perf_counter()
        self.config = config = config or EngineConfig.create(**options)
        self.path = Path(model) if model is not None else DEFAULT_ARTIFACT
        self.device = parse_device(config.runtime.device)
        self.dtype = config.runtime.torch_dtype(self.device)
        with Artifact.open(self.path) as artifact:
            self._verify_weights(artifact, config.runtime.verify_weights, progress)
            self.model, self.max_context = load_model(artifact, config, self.device, self.dtype, progress=progress)
            self.tokenizer = Tokenizer.from_artifact(artifact)
            generation_config = artifact.component_resource("text", "generation_config.json")
            self.generation_config = json.loads(generation_config) if generation_config else {}
            has_template = any(artifact.component_resource("text", role) is not None
                               for role in ("chat_template.jinja", "tokenizer_config.json"))
            self.template = ChatTemplate.from_artifact(artifact) if has_template else None
        self.fast = not isinstance(self.model, Qwen35Model)  # the packed GPU model behind its graph runner
        self.engine = Engine(self, config.scheduler, speculative=config.speculative)
        self.load_seconds = time.perf_counter() - started

    def _verify_weights(self, artifact: Artifact, requested: bool, progress: bool) -> None:
        """Hash the weights against their recorded SHA-256 before any is used (DigestError names the damaged
        objects): when `requested`, and always for the embedded demo model (10 MB: cheap)."""
        if not (requested or self.path.resolve() == DEFAULT_ARTIFACT):
            return
        if artifact.verify_digests(progress=progress) == 0 and requested:
            raise NinferError(f"{self.path}: records no object digests (another writer's artifact), so its weights "
                              "cannot be verified at load; check it with `ninfer verify` and its SHA256SUMS instead")

    def engine_with(self, **scheduler: Any) -> Engine:
        """Another engine over this loaded model, with other scheduler settings (`SchedulerConfig` fields)."""
        return Engine(self, SchedulerConfig(**scheduler), speculative=self.config.speculative)

    # -- prompts ---------------------------------------------------------------------------------------------

    def prompt_ids(self, prompt: Prompt, *, raw: bool = False, thinking: bool = True,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a prompt: ids as given, text as is with `raw`, otherwise text or messages rendered
        through the chat template with the generation prompt. Messages with an image (or other media) part raise
        UnsupportedContentError (a ValueError): the model would never see it."""
        if _is_ids(prompt):
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
        check_text_only(messages)
        text = self.template.render(messages, tools=tools, add_generation_prompt=True, enable_thinking=thinking)
        return self.tokenizer.encode(text)

    def default_params(self, **overrides: Any) -> SamplingParams:
        """Sampling defaults of the artifact's generation_config (greedy unless it sets do_sample), then overrides."""
        return SamplingParams.from_generation_config(self.generation_config, **overrides)

    def check_prompt(self, ids: list[int]) -> None:
        """Refuse an empty prompt or one that leaves no room for a generated token."""
        if not ids:
            raise NinferError("the prompt is empty")
        if len(ids) + 1 > self.max_context:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens; the context holds {self.max_context} "
                                     "(the prompt plus at least one generated token)")

    # -- generation ------------------------------------------------------------------------------------------

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, raw: bool = False,
               thinking: bool = True, tools: list[dict[str, Any]] | None = None) -> Iterator[Any]:
        """Yield ReasoningDelta / ContentDelta / ToolCall events as text is decided, then Finished."""
        params = params or self.default_params()
        ids = self.prompt_ids(prompt, raw=raw, thinking=thinking, tools=tools)
        templated = not (raw or _is_ids(prompt))
        request = Request(ids, params, thinking=templated and thinking, tools_enabled=bool(tools) or templated)
        yield from self.engine.stream(request)

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, **options: Any) -> Completion:
        """The whole completion of one prompt (see `stream` for the options)."""
        for event in self.stream(prompt, params, **options):
            if isinstance(event, Finished):
                return event.completion
        raise AssertionError("a stream always ends with Finished")


def _is_ids(prompt: Prompt) -> bool:
    return not isinstance(prompt, str) and all(isinstance(t, int) for t in prompt)
