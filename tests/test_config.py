"""The configuration: one object from keywords or flags, validated when built."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from ninfer.config import ConfigError, EngineConfig, RuntimeConfig, from_args


def test_keywords_land_in_their_part_and_slots_follow_the_concurrency():
    config = EngineConfig.create(device="cpu", kv_dtype="int8", max_concurrency=3, interleaved_prefill_chunk=64)
    assert config.cache.kv_dtype == "int8" and config.runtime.device == "cpu"
    assert config.scheduler.max_concurrency == 3 and config.cache.sequences == 3
    assert config.scheduler.interleaved_prefill_chunk == 64 and config.cache.prefill_chunk == 4096
    assert EngineConfig.create(sequences=2).scheduler.max_concurrency == 2  # no more than the slots
    assert EngineConfig.create(sequences=16).scheduler.max_concurrency == 8  # the default concurrency


@pytest.mark.parametrize(("values", "message"), [
    ({"turbo": True}, "unknown option 'turbo'"),
    ({"dtype": "fp16"}, "dtype must be one of auto, fp32, bf16"),
    ({"runner": "turbo"}, "runner must be one of auto, fast, reference"),
    ({"kv_dtype": "fp4"}, "kv_dtype must be one of"),
    ({"max_context": 1}, "too small"),
    ({"kv_capacity": 0}, "kv_capacity must be a positive integer"),
    ({"max_pending": -1}, "max_pending must be a non-negative integer"),
    ({"queue_timeout": math.nan}, "queue_timeout must be a positive number"),
    ({"sequences": 2, "max_concurrency": 4}, "exceeds the 2 sequence slots"),
])
def test_values_out_of_range_are_refused_by_name(values, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.create(**values)


def test_torch_dtypes_are_taken_as_their_names():
    assert RuntimeConfig(dtype=torch.bfloat16).dtype == "bf16"
    assert RuntimeConfig(dtype="auto").torch_dtype(torch.device("cpu")) == torch.float32
    with pytest.raises(ConfigError):
        RuntimeConfig(dtype=torch.float16)


def test_flags_build_the_same_configuration():
    args = argparse.Namespace(device="cpu", dtype="auto", runner="reference", kv_dtype="bf16", state_dtype="fp32",
                              max_context=None, prefill_chunk=None, max_concurrency=4, max_pending=2,
                              queue_timeout=5.0, interleaved_prefill_chunk=32, kv_capacity="auto")
    config = from_args(args)
    assert config == EngineConfig.create(runner="reference", max_concurrency=4, max_pending=2, queue_timeout=5.0,
                                         interleaved_prefill_chunk=32)
    assert config.cache.kv_capacity is None  # "auto": planned from the free memory
    assert from_args(argparse.Namespace(kv_capacity=1000)).cache.kv_capacity == 1000
