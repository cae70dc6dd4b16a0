"""Sampling parameters of one request: what the sampler may do, checked once, immutable afterwards.

The sampler itself (penalties, temperature, top-k / top-p / min-p, the draw) is
`ninfer.kernels.sampling`; its module docstring states the semantics of every field below.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from ninfer.errors import NinferError

# torch.Generator.manual_seed accepts this inclusive range (negative seeds wrap around modulo 2^64)
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1

# keys of a Hugging Face generation_config.json that become sampling defaults
GENERATION_CONFIG_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")

LogitBias = tuple[tuple[int, float], ...]


class SamplingError(NinferError):
    """Sampling parameters (or the logits handed to the sampler) are outside their domain."""


@dataclass(frozen=True)
class SamplingParams:
    """How to choose each next token of one request, and when to stop.

    temperature: 0 means greedy (argmax, lowest id on ties); otherwise logits are divided by it.
    top_k: keep the k most probable tokens; 0 keeps all. There is no hidden cap.
    top_p: keep the smallest most-probable set whose probability reaches top_p; 1 keeps all.
    min_p: keep tokens whose probability is at least min_p times the largest one; 0 keeps all.
    presence_penalty / frequency_penalty: OpenAI semantics, on generated tokens only.
    repetition_penalty: HF semantics (divide positive, multiply negative logits), on prompt + generated.
    logit_bias: token id -> value added to its logit. Pass a dict (or pairs); it is stored as a tuple of
        (id, bias) pairs sorted by id so that the params stay hashable; `dict(params.logit_bias)` reads it.
    seed: seeds a per-request generator; None draws from torch's global generator.
    max_tokens: most tokens to generate; stop / stop_token_ids end generation early; ignore_eos keeps
        generating past the model's end-of-sequence token.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | LogitBias = ()
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # normalise containers so that equal params compare and hash equal
        object.__setattr__(self, "logit_bias", _normalise_logit_bias(self.logit_bias))
        if isinstance(self.stop, str):
            raise SamplingError(f"stop must be a sequence of strings, not the single string {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def greedy_params(cls, **overrides: Any) -> SamplingParams:
        """Greedy decoding (temperature 0); other fields from `overrides` (passing temperature is a TypeError)."""
        return cls(**overrides, temperature=0.0)

    @classmethod
    def from_generation_config(cls, config: Mapping[str, Any], **overrides: Any) -> SamplingParams:
        """Defaults from a Hugging Face generation_config dict, then `overrides` on top.

        As in transformers, `do_sample` absent or false means greedy (temperature 0). Keys that are
        absent or null keep this class's defaults (not transformers' top_k=50); other keys are ignored.
        """
        fields: dict[str, Any] = {key: config[key] for key in GENERATION_CONFIG_KEYS if config.get(key) is not None}
        if not config.get("do_sample", False):
            fields["temperature"] = 0.0
        return cls(**{**fields, **overrides})

    def validate(self) -> None:
        """Raise SamplingError naming the first field outside its domain; called on construction."""
        _check_real("temperature", self.temperature)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        _check_real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        _check_real("min_p", self.min_p)
        if not 0 <= self.min_p < 1:
            raise SamplingError(f"min_p must be in [0, 1) (0 = off), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_real(name, value)
            if not math.isfinite(value):
                raise SamplingError(f"{name} must be finite, got {value}")
        _check_real("repetition_penalty", self.repetition_penalty)
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise SamplingError(f"repetition_penalty must be finite and > 0 (1 = off), got {self.repetition_penalty}")
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise SamplingError(f"logit_bias token id must be >= 0, got {token_id}")
            if not math.isfinite(bias):
                raise SamplingError(f"logit_bias value for token {token_id} must be finite, got {bias}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not SEED_MIN <= self.seed <= SEED_MAX:
                raise SamplingError(f"seed must be in [-2^63, 2^64 - 1], got {self.seed}")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise SamplingError(f"stop entries must be non-empty strings, got {text!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids entry", token_id)
            if token_id < 0:
                raise SamplingError(f"stop_token_ids entries must be >= 0, got {token_id}")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise SamplingError(f"{name} must be an integer, got {value!r}")


def _check_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise SamplingError(f"{name} must be a number, got {value!r}")


def _normalise_logit_bias(bias: Mapping[int, float] | Iterable[tuple[int, float]]) -> LogitBias:
    pairs = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
    normalised: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise SamplingError(f"logit_bias must map token ids to numbers, got entry {pair!r}")
        token_id, value = pair
        if isinstance(token_id, bool) or not isinstance(token_id, Integral):
            raise SamplingError(
                f"logit_bias keys must be int token ids, got {token_id!r} (convert JSON string keys with int())"
            )
        _check_real(f"logit_bias value for token {token_id}", value)
        if token_id in normalised:
            raise SamplingError(f"logit_bias lists token {token_id} twice")
        normalised[int(token_id)] = float(value)
    return tuple(sorted(normalised.items()))
