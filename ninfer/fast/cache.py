"""Per-sequence state of the GPU fast path: a paged KV pool for the attention layers, a slot pool for the Gated
DeltaNet conv windows and recurrent states, and the memory plan that sizes both before anything is allocated.

Layout (see ninfer/kernels/paged_attention.py for the page format):
  * KV: per attention layer `key_pages`, `value_pages` `[P, PAGE, kvh, hd]` in the KV dtype (bf16 / int8 / fp8)
    and, for int8/fp8, fp16 scales `[P, PAGE, kvh, hd / 64]`. Page 0 is scratch (padding rows of a batch write
    there); a sequence owns the pages of its block-table row, allocated for its whole capacity at admission.
  * GDN: `conv` `[L, S + 1 + S·V, C, K-1]` bf16 and `recurrent` `[L, S + 1 + S·V, Hv, Dk, Dv]` in the state
    dtype (fp32, as the models' `mamba_ssm_dtype`, or bf16: half the memory and traffic) over the L GDN layers;
    slot S is scratch; with V = `max_verify_tokens` > 0, slots S + 1 + s·V + t hold sequence slot s's state after
    draft token t of a verify step (the recurrent state cannot be cut back to an accepted prefix).
A `SlotState` is one sequence's handle; dropping the last reference returns its slot and pages.

Pages are reference-counted so that prefix snapshots share them by content instead of copying them: a snapshot
holds a `PageLease` on the full pages of its prefix, and a sequence restored from it points its block table at
those pages (it only ever writes past its restored length, so a shared page is never written). A page returns
to the free list when no sequence and no lease holds it; when an allocation finds too few free pages it asks
`reclaim` (the engine's prefix cache) to drop snapshots first.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ninfer.errors import NinferError
from ninfer.model.config import FULL_ATTENTION, TextConfig

KV_DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the GDN recurrent state as pooled
SCALE_GROUP = 64
PAGE = 64  # positions per KV page
# the step graphs' buffers in their shared pool (27B on the H200: 14 MiB for the decode graphs of 8 slots, 36 MiB for
# 64; 50 MiB after `warm_up(8)`, the 15 short-prompt graphs included; `scripts/device/graph_memory.py`); their logits
# share one buffer, in the workspace
GRAPH_POOL_BYTES = 64 * 2**20


def logit_rows(slots: int, max_verify_tokens: int) -> int:
    """Rows of the runner's logits buffer, which every decode and verify step's head writes: one per sequence slot,
    or one per draft token of every slot when verify steps are enabled."""
    return slots * max(1, max_verify_tokens)


class MemoryPlanError(NinferError):
    """The model, its cache and workspace do not fit in the device memory."""


class CacheFullError(NinferError):
    """No free sequence slot or not enough free KV pages for a new sequence."""


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


@dataclass
class MemoryPlan:
    """Bytes of each part of the fast path on the device, decided at start-up."""

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
    if state_dtype not in STATE_DTYPES:
        raise NinferError(f"unknown recurrent-state dtype {state_dtype!r}; use {' or '.join(STATE_DTYPES)}")
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


@dataclass(eq=False)
class SlotState:
    """One sequence on the fast path: its state slot, its KV pages and how many positions it holds."""

    slot: int
    capacity: int
    pages: list[int]
    length: int = 0
    pending: int = 0  # draft tokens of a verify step not yet accepted or rejected


class PageLease:
    """A hold on KV pages (a prefix snapshot's full pages); the pages stay allocated while the lease lives."""

    def __init__(self, cache: SequenceCache, pages: list[int]):
        if any(cache.refs[page] == 0 for page in pages):
            raise ValueError("a lease must be taken on pages a live sequence holds, not on a free page")
        self.pages = pages
        for page in pages:
            cache.refs[page] += 1
        weakref.finalize(self, cache.unref, list(pages))


class SequenceCache:
    """The device pools, their free lists and page reference counts (host side; the device never reads them)."""

    def __init__(self, config: TextConfig, device: torch.device, *, slots: int, kv_tokens: int, max_context: int,
                 kv_dtype: str, float_dtype: torch.dtype = torch.bfloat16, page: int = PAGE,
                 max_verify_tokens: int = 0, state_dtype: str = "fp32"):
        self.config = config
        self.device = device
        self.page = page
        self.slots = slots
        self.max_verify_tokens = max_verify_tokens
        self.kv_dtype = kv_dtype
        self.state_dtype = state_dtype
        self.max_pages = math.ceil(max_context / page)
        pages = math.ceil(kv_tokens / page) + 1  # + the scratch page 0
        dtype = float_dtype if kv_dtype == "bf16" else KV_DTYPES[kv_dtype]  # "bf16": pages in the activation dtype
        shape = (pages, page, config.kv_heads, config.head_dim)
        self.attention_layers = [i for i, t in enumerate(config.layer_types) if t == FULL_ATTENTION]
        self.gdn_layers = [i for i, t in enumerate(config.layer_types) if t != FULL_ATTENTION]
        self.key_pages, self.value_pages, self.key_scales, self.value_scales = {}, {}, {}, {}
        for layer in self.attention_layers:
            self.key_pages[layer] = torch.zeros(shape, dtype=dtype, device=device)
            self.value_pages[layer] = torch.zeros(shape, dtype=dtype, device=device)
            if kv_dtype != "bf16":
                scale_shape = (*shape[:3], config.head_dim // SCALE_GROUP)
                self.key_scales[layer] = torch.zeros(scale_shape, dtype=torch.float16, device=device)
                self.value_scales[layer] = torch.zeros(scale_shape, dtype=torch.float16, device=device)
        gdn = len(self.gdn_layers)
        self.gdn_index = {layer: i for i, layer in enumerate(self.gdn_layers)}
        state_slots = slots * (1 + max_verify_tokens) + 1
        self.conv = torch.zeros((gdn, state_slots, config.conv_dim, config.conv_kernel - 1), dtype=float_dtype,
                                device=device)
        self.recurrent = torch.zeros((gdn, state_slots, config.v_heads, config.k_dim, config.v_dim),
                                     dtype=STATE_DTYPES[state_dtype], device=device)
        self.block_tables = torch.zeros((slots + 1, self.max_pages), dtype=torch.int32, device=device)
        self.free_slots = list(range(slots - 1, -1, -1))
        self.free_pages = list(range(pages - 1, 0, -1))
        self.refs = [0] * pages  # holders of each page: sequences and leases
        self.reclaim: Callable[[], bool] | None = None  # drops one snapshot (its lease); False when none is left

    @property
    def kv_element_bytes(self) -> float:
        """Bytes per cached K or V element, scales included."""
        pool = next(iter(self.key_pages.values()), None)
        if pool is None:
            return 0.0
        return pool.element_size() + (2 / SCALE_GROUP if self.kv_dtype != "bf16" else 0)

    @property
    def scratch_slot(self) -> int:
        return self.slots

    def verify_slot(self, slot: int, token: int) -> int:
        """The GDN pool slot that holds sequence slot `slot`'s state after draft token `token` of a verify step."""
        return self.slots + 1 + slot * self.max_verify_tokens + token

    def allocate(self, capacity: int) -> SlotState:
        """A fresh sequence of up to `capacity` positions (zeroed GDN state, its pages in its block-table row)."""
        needed = math.ceil(capacity / self.page)
        if needed > self.max_pages:
            raise CacheFullError(f"a sequence of {capacity} tokens exceeds the context of {self.max_pages * self.page}")
        while needed > len(self.free_pages) and self.reclaim is not None and self.reclaim():
            pass
        if not self.free_slots or needed > len(self.free_pages):
            raise CacheFullError(f"no room for a sequence of {capacity} tokens: {len(self.free_slots)} free slots, "
                                 f"{len(self.free_pages) * self.page} free KV positions")
        slot = self.free_slots.pop()
        pages = [self.free_pages.pop() for _ in range(needed)]
        for page in pages:
            self.refs[page] = 1
        row = torch.zeros(self.max_pages, dtype=torch.int32)
        row[:needed] = torch.tensor(pages, dtype=torch.int32)
        self.block_tables[slot].copy_(row)
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        state = SlotState(slot, capacity, pages)
        weakref.finalize(state, self._release, slot, pages)  # `pages` is the state's own (mutable) list
        return state

    def _release(self, slot: int, pages: list[int]) -> None:
        self.free_slots.append(slot)
        self.unref(pages)

    def unref(self, pages: list[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free_pages.append(page)

    def lease(self, pages: list[int]) -> PageLease:
        return PageLease(self, list(pages))

    def share(self, state: SlotState, index: int, page: int) -> None:
        """Make position block `index` of a sequence the (leased) page `page`, giving up its own page there."""
        own = state.pages[index]
        if own == page:
            return
        self.refs[page] += 1
        state.pages[index] = page
        self.block_tables[state.slot, index] = page
        self.unref([own])

    def dense_kv(self, layer: int, state: SlotState, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Keys and values of positions [0, length) of a sequence as dense `[length, kvh, hd]` in `dtype`."""
        pages = torch.tensor(state.pages[: math.ceil(length / self.page)], device=self.device)
        result = []
        for pool, scales in ((self.key_pages, self.key_scales), (self.value_pages, self.value_scales)):
            rows = pool[layer][pages].flatten(0, 1)[:length]
            if scales:
                scale = scales[layer][pages].flatten(0, 1)[:length].float()
                rows = (rows.float().unflatten(-1, (-1, SCALE_GROUP)) * scale[..., None]).flatten(-2)
            result.append(rows.to(dtype))
        return tuple(result)
