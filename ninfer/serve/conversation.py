"""A request in the engine's terms, whichever API it came through: the `Conversation` the chat template renders,
the `Sampling` the request asks for, and `engine_request`, the engine Request they make.

    conversation = Conversation(messages, tools, thinking)   # OpenAI-shape messages, FunctionTools
    request = engine_request(state, conversation, Sampling(max_tokens=..., temperature=...), request_id)

`engine_request` is a plain function that tokenizes; run it with starlette's `run_in_threadpool`, so that a long
conversation does not hold up the event loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ninfer.engine import Request
from ninfer.frontend import ChatTemplateError
from ninfer.sampling import SamplingError, SamplingParams
from ninfer.serve.errors import APIError
from ninfer.serve.state import ServerState
from ninfer.serve.tools import FunctionTool

SYSTEM_SEPARATOR = "\n\n"  # between the system texts folded into the template's one leading system turn


@dataclass
class Conversation:
    """What the chat template renders: OpenAI-shape `messages` (one leading system turn, assistant `tool_calls` with
    JSON-string arguments, `reasoning_content`, tool turns), the `tools` offered (None: none), thinking on or off,
    extra template arguments, and a `prefill`: text the answer continues, appended after the generation prompt."""

    messages: list[dict[str, Any]]
    tools: list[FunctionTool] | None
    thinking: bool
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    prefill: str | None = None

    @property
    def tools_enabled(self) -> bool:
        """Whether the engine parses tool calls in the answer: tools are offered, or the history holds calls or
        results."""
        return bool(self.tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in self.messages)


def with_system(system: list[str], turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`turns` after one leading system turn that joins the `system` texts (none when there are no texts)."""
    return [{"role": "system", "content": SYSTEM_SEPARATOR.join(system)}, *turns] if system else turns


def resolve_thinking(default: bool, *choices: tuple[str, bool | None]) -> bool:
    """Thinking on/off from the request's (param, value) choices (None = not given), else `default`.
    Two choices that disagree are a 400 naming the second."""
    chosen: tuple[str, bool] | None = None
    for param, value in choices:
        if value is None:
            continue
        if chosen is not None and chosen[1] != value:
            raise APIError(400, f"{param} ({value}) contradicts {chosen[0]} ({chosen[1]})", code="invalid_value",
                           param=param)
        chosen = (param, value)
    return default if chosen is None else chosen[1]


def prompt_ids(state: ServerState, conversation: Conversation, *, limit: bool = True) -> list[int]:
    """The prompt's token ids: the conversation rendered through the model's chat template with the generation
    prompt and tokenized, then the prefill's tokens. Raises APIError 400 (code invalid_prompt) when the template
    rejects the conversation or the model has none, and (with `limit`) 400 context_length_exceeded when the prompt
    leaves no room for one generated token."""
    template = state.llm.template
    if template is None:
        raise APIError(400, f"the model {state.model_id!r} has no chat template, so it cannot take messages",
                       code="invalid_prompt", param="messages")
    tools = [tool.template_json() for tool in conversation.tools or []]
    try:
        text = template.render(conversation.messages, tools=tools or None, add_generation_prompt=True,
                               enable_thinking=conversation.thinking, **dict(conversation.template_kwargs))
    except ChatTemplateError as exc:
        raise APIError(400, f"the conversation cannot be rendered: {exc}", code="invalid_prompt",
                       param="messages") from None
    ids = state.llm.tokenizer.encode(text)
    if conversation.prefill:
        ids += state.llm.tokenizer.encode(conversation.prefill)
    if limit:
        check_context(state, len(ids))
    return ids


def check_context(state: ServerState, prompt_tokens: int) -> None:
    """400 context_length_exceeded unless the prompt plus one generated token fits the context."""
    limit = state.llm.max_context
    if prompt_tokens + 1 > limit:
        raise APIError(400, f"the prompt has {prompt_tokens} tokens; this model's context holds {limit} "
                            "(the prompt plus at least one generated token); shorten the conversation",
                       code="context_length_exceeded", param="messages")


@dataclass
class Sampling:
    """What a request asks of sampling; None = not set: the artifact's generation_config default applies (for
    `max_tokens`, the server's default). `logit_bias` is OpenAI's: token ids written as strings -> bias."""

    max_tokens: int | None = None
    stop: list[str] | None = None
    logit_bias: Mapping[str, float] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None


# the Sampling fields that override SamplingParams' fields of the same name as they are
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "ignore_eos")


def sampling_params(state: ServerState, sampling: Sampling) -> SamplingParams:
    """SamplingParams of a request: the artifact's generation_config defaults, overridden by every field the request
    sets. The output budget is resolved against the context at admission (finish reason "length" when the context
    binds); empty stop strings are dropped. Raises APIError 400 naming the field when a value is outside its domain."""
    overrides = {name: getattr(sampling, name) for name in SAMPLING_FIELDS if getattr(sampling, name) is not None}
    budget = state.config.default_max_tokens if sampling.max_tokens is None else sampling.max_tokens
    overrides["max_tokens"] = budget
    overrides["stop"] = tuple(s for s in (sampling.stop or ()) if s)
    logit_bias = parse_logit_bias(sampling.logit_bias, state.llm.tokenizer.vocab_size)
    if logit_bias:
        overrides["logit_bias"] = logit_bias
    if sampling.stop_token_ids:
        overrides["stop_token_ids"] = tuple(sampling.stop_token_ids)
    try:
        return state.llm.default_params(**overrides)
    except SamplingError as exc:
        message = str(exc)
        param = next((name for name in (*SAMPLING_FIELDS, "logit_bias", "stop_token_ids", "stop", "max_tokens")
                      if message.startswith(name)), None)
        raise APIError(400, message, code="invalid_value", param=param) from None


def parse_logit_bias(bias: Mapping[str, float] | None, vocab_size: int, param: str = "logit_bias",
                     limit: float = 100.0) -> dict[int, float]:
    """OpenAI's logit_bias (JSON object: token id as a string -> bias in [-limit, limit]) as {id: bias}; 400 naming
    the entry when a key is not a token id of this vocabulary or a value is out of range."""
    parsed: dict[int, float] = {}
    for key, value in (bias or {}).items():
        where = f"{param}[{key!r}]"
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"{where}: keys must be token ids written as decimal strings", code="invalid_value",
                           param=param) from None
        if not 0 <= token < vocab_size:
            raise APIError(400, f"{where}: token id {token} is outside the vocabulary [0, {vocab_size})",
                           code="invalid_value", param=param)
        if not -limit <= value <= limit:
            raise APIError(400, f"{where}: bias {value} is outside [-{limit:g}, {limit:g}]", code="invalid_value",
                           param=param)
        parsed[token] = float(value)
    return parsed


def engine_request(state: ServerState, conversation: Conversation, sampling: Sampling, request_id: str) -> Request:
    """The engine request: the conversation rendered and tokenized (400 when it leaves no room to generate), then
    the sampling resolved against what the context leaves."""
    ids = prompt_ids(state, conversation)
    return Request(ids, sampling_params(state, sampling), thinking=conversation.thinking,
                   tools_enabled=conversation.tools_enabled, request_id=request_id)
