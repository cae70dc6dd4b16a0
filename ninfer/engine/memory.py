"""The memory plan of the packed GPU model: bytes of weights, KV pool, recurrent-state slots, workspace and decode
graphs, decided at start-up before anything is allocated; a model that does not fit is refused with the numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ninfer.errors import NinferError
from ninfer.model.config import FULL_ATTENTION, TextConfig

KV_DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the GDN recurrent state as pooled
SCALE_GROUP = 64  # K/V elements per fp16 scale of int8 / fp8 pages
PAGE = 64  # positions per KV page
# the step graphs' buffers in their shared pool (27B on the H200: 14 MiB for the decode graphs of 8 slots, 36 MiB for
# 64, 50 MiB with the 15 short-prompt graphs); their logits share one buffer, in the workspace
GRAPH_POOL_BYTES = 64 * 2**20


class MemoryPlanError(NinferError):
    """The model, its cache and workspace do not fit in the device memory."""


def logit_rows(slots: int, max_verify_tokens: int) -> int:
    """Rows of the logits buffer that every decode and verify step's head writes: one per sequence slot, or one per
    draft token of every slot when verify steps are enabled."""
    return slots * max(1, max_verify_tokens)


def kv_bytes_per_token(config: TextConfig, kv_dtype: str) -> int:
    """Bytes of K and V (and their scales) that one position costs over all attention layers."""
    layers = sum(1 for t in config.layer_types if t == FULL_ATTENTION)
    element = torch.empty((), dtype=KV_DTYPES[kv_dtype]).element_size()
    per_head = config.head_dim * element + (config.head_dim // SCALE_GROUP * 2 if kv_dtype != "bf16" else 0)
    return layers * 2 * config.kv_heads * per_head


def state_bytes_per_slot(config: TextConfig, state_dtype: str = "fp32") -> int:
    """Bytes of one sequence's GDN conv window (bf16) and recurrent state (in `state_dtype`) over all GDN layers."""
    layers = sum(1 for t in config.layer_types if t != FULL_ATTENTION)
    conv = config.conv_dim * (config.conv_kernel - 1) * 2
    recurrent = config.v_heads * config.k_dim * config.v_dim * STATE_DTYPES[state_dtype].itemsize
    return layers * (conv + recurrent)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of each part of the packed model on the device."""

    weights: int
    kv: int
    state: int
    workspace: int
    graphs: int
    free: int
    kv_tokens: int
    slots: int
    margin: int
    state_dtype: str = "fp32"

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.state + self.workspace + self.graphs

    def describe(self) -> str:
        gib = 2**30
        return (f"weights {self.weights / gib:.2f} GiB + KV {self.kv / gib:.2f} GiB ({self.kv_tokens} tokens) + "
                f"recurrent state {self.state / gib:.2f} GiB ({self.slots} slots, {self.state_dtype}) + workspace "
                f"{self.workspace / gib:.2f} GiB + decode graphs {self.graphs / gib:.2f} GiB = "
                f"{self.total / gib:.2f} GiB of {self.free / gib:.2f} GiB free")


def plan_memory(config: TextConfig, weight_bytes: int, free: int, *, slots: int, max_context: int,
                kv_capacity: int | None, kv_dtype: str, prefill_chunk: int, margin: float = 0.05,
                page: int = PAGE, max_verify_tokens: int = 0, state_dtype: str = "fp32",
                decode_graphs: bool = True) -> MemoryPlan:
    """Size the KV pool: `kv_capacity` tokens when given, else (auto) what is left after the weights, the slots'
    recurrent state and the workspace, minus a `margin` fraction of the free memory — capped at what `slots`
    sequences of `max_context` (in whole pages) can use. Raises MemoryPlanError when even one full-context
    sequence does not fit. `decode_graphs`: whether decode steps are captured as CUDA graphs (their memory is
    planned only then)."""
    state = (slots * (1 + max_verify_tokens) + 1) * state_bytes_per_slot(config, state_dtype)
    per_token = kv_bytes_per_token(config, kv_dtype)
    # workspace: the largest dequantized prefill matrix, prefill activations (a few [chunk, width] tensors), the
    # steps' logits buffer and the copy a step returns
    widths = (config.hidden, config.intermediate or 2 * config.expert_width * max(config.top_k, 1), config.conv_dim,
              2 * config.heads * config.head_dim)
    largest_matrix = max(config.vocab * config.hidden, 2 * config.intermediate * config.hidden,
                         config.conv_dim * config.hidden)
    logits = 2 * logit_rows(slots, max_verify_tokens) * config.vocab * 4
    workspace = largest_matrix * 2 + 8 * prefill_chunk * max(widths) * 4 + logits
    graphs = GRAPH_POOL_BYTES if decode_graphs else 0
    keep = int(free * margin)
    room = free - keep - weight_bytes - state - workspace - graphs
    ceiling = slots * math.ceil(max_context / page) * page
    tokens = min(ceiling, room // per_token) if kv_capacity is None else kv_capacity
    plan = MemoryPlan(weight_bytes, tokens * per_token, state, workspace, graphs, free, tokens, slots, keep,
                      state_dtype)
    if tokens < max_context or plan.total > free - keep:
        gib = 2**30
        raise MemoryPlanError(
            f"the model does not fit: {plan.describe()} (keeping {keep / gib:.2f} GiB back), and one sequence of "
            f"{max_context} tokens needs {max_context * per_token / gib:.2f} GiB of KV; lower --max-context, "
            "--max-concurrency or --kv-capacity, or choose --kv-dtype int8/fp8 or --state-dtype bf16")
    return plan
