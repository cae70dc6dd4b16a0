"""The engine's configuration, built once: from the command line (`from_args`) or from `LLM(...)` keywords
(`EngineConfig.create`), validated here, and passed down whole. A value is resolved in one place: the KV capacity
in the memory plan (`None`: what the free memory holds), the context in the loader (`None`: the model's, at most
FAST_DEFAULT_CONTEXT on the packed GPU model), a request's output budget at admission."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ninfer.errors import NinferError

DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}
RUNNERS = ("auto", "fast", "reference")
KV_DTYPE_NAMES = ("bf16", "int8", "fp8")
STATE_DTYPE_NAMES = ("fp32", "bf16")
SPEC_METHODS = ("none", "mtp")
MAX_DRAFT_TOKENS = 8
FAST_DEFAULT_CONTEXT = 32768  # the packed GPU model's context when none is given (its KV pool is planned for it)


class ConfigError(NinferError):
    """A configuration value out of its range."""


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, not {value!r}")


def _positive(name: str, value: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, not {value!r}")


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how the model runs: `device` (cpu, cuda, cuda:N), `dtype` (auto: fp32 on the CPU, bf16 on CUDA;
    torch.float32 / torch.bfloat16 are taken too),
    `runner` (auto: the packed GPU model on CUDA when the model suits it; fast; reference), `verify_weights` (hash
    every object at load against the SHA-256 the artifact records, before using it; the embedded demo model always
    is)."""

    device: str = "cpu"
    dtype: str = "auto"
    runner: str = "auto"
    verify_weights: bool = False

    def __post_init__(self) -> None:
        names = {torch_dtype: name for name, torch_dtype in DTYPES.items() if torch_dtype is not None}
        if isinstance(self.dtype, torch.dtype) and self.dtype in names:  # the Python API may pass torch's own
            object.__setattr__(self, "dtype", names[self.dtype])
        _choice("dtype", self.dtype, tuple(DTYPES))
        _choice("runner", self.runner, RUNNERS)
        if not isinstance(self.verify_weights, bool):
            raise ConfigError(f"verify_weights must be True or False, not {self.verify_weights!r}")

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        return DTYPES[self.dtype] or (torch.float32 if device.type == "cpu" else torch.bfloat16)


@dataclass(frozen=True)
class CacheConfig:
    """The sequences' memory: `kv_dtype` (KV pages: bf16 / int8 / fp8), `state_dtype` (the GDN recurrent state as
    stored: fp32 / bf16), `kv_capacity` (KV positions over all sequences; None: planned from the free memory),
    `sequences` (state slots: the largest decode batch), `max_context` (None: the model's), `prefill_chunk` (prompt
    tokens per prefill pass of the model; the memory plan reserves room for one)."""

    kv_dtype: str = "bf16"
    state_dtype: str = "fp32"
    kv_capacity: int | None = None
    sequences: int = 8
    max_context: int | None = None
    prefill_chunk: int = 4096

    def __post_init__(self) -> None:
        _choice("kv_dtype", self.kv_dtype, KV_DTYPE_NAMES)
        _choice("state_dtype", self.state_dtype, STATE_DTYPE_NAMES)
        _positive("kv_capacity", self.kv_capacity, optional=True)
        _positive("sequences", self.sequences)
        _positive("max_context", self.max_context, optional=True)
        if self.max_context is not None and self.max_context < 2:
            raise ConfigError(f"max_context {self.max_context} is too small (at least 2)")
        _positive("prefill_chunk", self.prefill_chunk)


@dataclass(frozen=True)
class SchedulerConfig:
    """Admission and batching: `max_concurrency` (sequences running together), `max_pending` (requests that may
    wait; more are refused), `queue_timeout` (seconds a request may wait), `interleaved_prefill_chunk` (prompt
    tokens a sequence prefills per engine step while other sequences decode, so that they go on between its
    pieces; a prompt alone goes to the model up to its next turn boundary at once)."""

    max_concurrency: int = 8
    max_pending: int = 64
    queue_timeout: float = 60.0
    interleaved_prefill_chunk: int = 512

    def __post_init__(self) -> None:
        _positive("max_concurrency", self.max_concurrency)
        if isinstance(self.max_pending, bool) or not isinstance(self.max_pending, int) or self.max_pending < 0:
            raise ConfigError(f"max_pending must be a non-negative integer, not {self.max_pending!r}")
        if not (isinstance(self.queue_timeout, int | float) and math.isfinite(self.queue_timeout)
                and self.queue_timeout > 0):
            raise ConfigError(f"queue_timeout must be a positive number of seconds, not {self.queue_timeout!r}")
        _positive("interleaved_prefill_chunk", self.interleaved_prefill_chunk)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: `spec` (none; mtp: the artifact's MTP head drafts, the model verifies), `draft_tokens`
    (drafts per round, 1..MAX_DRAFT_TOKENS; None: chosen per round from the sequence's acceptance and the measured
    round cost), `lm_head_draft` (drafts take the argmax over the artifact's restricted proposal head, the rows of
    the output head for its most frequent tokens; verification still uses the whole head)."""

    spec: str = "none"
    draft_tokens: int | None = None
    lm_head_draft: bool = False

    def __post_init__(self) -> None:
        _choice("spec", self.spec, SPEC_METHODS)
        _positive("draft_tokens", self.draft_tokens, optional=True)
        if self.draft_tokens is not None and self.draft_tokens > MAX_DRAFT_TOKENS:
            raise ConfigError(f"draft_tokens must be 1..{MAX_DRAFT_TOKENS}, not {self.draft_tokens}")
        if self.draft_tokens is not None and self.spec == "none":
            raise ConfigError("draft_tokens (--draft-tokens) needs spec='mtp' (--spec mtp)")
        if self.lm_head_draft and self.spec == "none":
            raise ConfigError("lm_head_draft (--lm-head-draft) needs spec='mtp' (--spec mtp)")


@dataclass(frozen=True)
class EngineConfig:
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.scheduler.max_concurrency > self.cache.sequences:
            raise ConfigError(f"max_concurrency {self.scheduler.max_concurrency} exceeds the {self.cache.sequences} "
                              "sequence slots of the cache (sequences >= max_concurrency)")

    @classmethod
    def create(cls, **values: Any) -> EngineConfig:
        """A configuration from flat keywords, each the name of a field of one part (`device=`, `kv_dtype=`,
        `max_concurrency=`, ...); unknown names are refused. `sequences` defaults to `max_concurrency`."""
        kinds = {"runtime": RuntimeConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                 "speculative": SpeculativeConfig}
        parts: dict[str, dict[str, Any]] = {part: {} for part in kinds}
        owners = {f.name: part for part, kind in kinds.items() for f in fields(kind)}
        for name, value in values.items():
            if name not in owners:
                raise ConfigError(f"unknown option {name!r}; known: {', '.join(sorted(owners))}")
            parts[owners[name]][name] = value
        if "max_concurrency" in parts["scheduler"]:
            parts["cache"].setdefault("sequences", parts["scheduler"]["max_concurrency"])
        elif "sequences" in parts["cache"]:
            parts["scheduler"]["max_concurrency"] = min(parts["cache"]["sequences"],
                                                        SchedulerConfig.max_concurrency)
        return cls(**{part: kind(**parts[part]) for part, kind in kinds.items()})


def from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The configuration of a `ninfer run | bench | serve` command line (the flags each command has), with
    `overrides` (e.g. the sequences a bench needs)."""
    names = ("device", "dtype", "runner", "verify_weights", "kv_dtype", "state_dtype", "max_context", "prefill_chunk",
             "max_concurrency", "max_pending", "queue_timeout", "interleaved_prefill_chunk", "spec", "draft_tokens",
             "lm_head_draft")
    values = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    capacity = getattr(args, "kv_capacity", None)
    if isinstance(capacity, int):  # "auto" and None: planned from the free memory
        values["kv_capacity"] = capacity
    values.update(overrides)
    return EngineConfig.create(**values)
