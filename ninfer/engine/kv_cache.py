"""Per-sequence state of the packed GPU model: a paged KV pool for the attention layers and a slot pool for the
Gated DeltaNet conv windows and recurrent states, with explicit allocation and freeing.

Layout (see ninfer/kernels/paged_attention.py for the page format):
  * KV: per attention layer `key_pages`, `value_pages` `[P, PAGE, kvh, hd]` in the KV dtype (bf16 / int8 / fp8)
    and, for int8/fp8, fp16 scales `[P, PAGE, kvh, hd / 64]`. Page 0 is scratch (padding rows of a batch write
    there); a sequence owns the pages of its block-table row, allocated for its whole capacity at admission.
  * GDN: `conv` `[L, S + 1 + S·V, C, K-1]` bf16 and `recurrent` `[L, S + 1 + S·V, Hv, Dk, Dv]` in the state
    dtype (fp32, as the models' `mamba_ssm_dtype`, or bf16: half the memory and traffic) over the L GDN layers;
    slot S is scratch; with V = `max_verify_tokens` > 0, slots S + 1 + s·V + t hold sequence slot s's state after
    draft token t of a verify step (the recurrent state cannot be cut back to an accepted prefix).
A `SlotState` is one sequence's handle: `allocate` gives it, `free` returns its slot and pages.

Pages are reference-counted so that prefix snapshots share them by content instead of copying them: a snapshot
holds a `PageLease` on the full pages of its prefix (`release` gives it back), and a sequence restored from it points
its block table at those pages (it only ever writes past its restored length, so a shared page is never written). A
page returns to the free list when no sequence and no lease holds it; when an allocation finds too few free pages
it asks `reclaim` (the engine's prefix cache) to drop snapshots first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ninfer.engine.memory import KV_DTYPES, PAGE, SCALE_GROUP, STATE_DTYPES
from ninfer.errors import NinferError
from ninfer.model.config import FULL_ATTENTION, TextConfig


class CacheFullError(NinferError):
    """No free sequence slot or not enough free KV pages for a new sequence."""


@dataclass(eq=False)
class SlotState:
    """One sequence in the pools: its state slot, its KV pages and how many positions it holds."""

    slot: int
    capacity: int
    pages: list[int]
    length: int = 0
    pending: int = 0  # draft tokens of a verify step not yet accepted or rejected
    freed: bool = False


@dataclass(eq=False)
class PageLease:
    """A hold on KV pages (a prefix snapshot's full pages); the pages stay allocated until it is released."""

    pages: list[int]
    released: bool = False


POOL_KINDS = ("key_pages", "value_pages", "key_scales", "value_scales")


class KVCache:
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

    # -- sequences -------------------------------------------------------------------------------------------

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
        return SlotState(slot, capacity, pages)

    def free(self, state: SlotState) -> None:
        """Return a sequence's slot and its pages (those no lease holds) to the free lists."""
        if state.freed:
            raise ValueError(f"sequence slot {state.slot} is already free")
        state.freed = True
        self.free_slots.append(state.slot)
        self._unref(state.pages)

    def _unref(self, pages: list[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free_pages.append(page)

    def lease(self, pages: list[int]) -> PageLease:
        """A hold on pages that a live sequence holds (they stay allocated after it is freed, until `release`)."""
        if any(self.refs[page] == 0 for page in pages):
            raise ValueError("a lease must be taken on pages a live sequence holds, not on a free page")
        for page in pages:
            self.refs[page] += 1
        return PageLease(list(pages))

    def release(self, lease: PageLease) -> None:
        if lease.released:
            raise ValueError("the lease is already released")
        lease.released = True
        self._unref(lease.pages)

    def share(self, state: SlotState, index: int, page: int) -> None:
        """Make position block `index` of a sequence the (leased) page `page`, giving up its own page there."""
        own = state.pages[index]
        if own == page:
            return
        self.refs[page] += 1
        state.pages[index] = page
        self.block_tables[state.slot, index] = page
        self._unref([own])

    # -- prefix snapshots and speculative steps ---------------------------------------------------------------

    def snapshot(self, state: SlotState) -> dict[tuple[str, int], object]:
        """A sequence's state for prefix reuse: a lease on its full KV pages (shared, not copied), copies of its
        partial last page and of its GDN slot."""
        full = state.length // self.page
        snapshot: dict[tuple[str, int], object] = {("pages", 0): self.lease(state.pages[:full])}
        if state.length % self.page:
            index = torch.tensor(state.pages[full : full + 1], device=self.device)
            for kind in POOL_KINDS:
                for layer, pool in getattr(self, kind).items():
                    snapshot[(kind, layer)] = pool[index].clone()
        snapshot[("conv", 0)] = self.conv[:, state.slot].clone()
        snapshot[("recurrent", 0)] = self.recurrent[:, state.slot].clone()
        return snapshot

    def restore(self, state: SlotState, length: int, snapshot: dict[tuple[str, int], object]) -> None:
        """Put a `snapshot` of a `length`-token prefix into a fresh state: its block table points at the leased
        full pages, the partial page and the GDN state are copied."""
        full = length // self.page
        for index, page in enumerate(snapshot[("pages", 0)].pages):
            self.share(state, index, page)
        for (kind, layer), tensor in snapshot.items():
            if kind == "conv":
                self.conv[:, state.slot] = tensor.to(self.device)
            elif kind == "recurrent":
                self.recurrent[:, state.slot] = tensor.to(self.device)
            elif kind != "pages":
                index = torch.tensor(state.pages[full : full + 1], device=self.device)
                getattr(self, kind)[layer][index] = tensor.to(self.device)
        state.length = length

    def release_snapshot(self, snapshot: dict[tuple[str, int], object]) -> None:
        """Give back the pages a snapshot holds."""
        self.release(snapshot[("pages", 0)])

    def accept(self, states: Sequence[SlotState], accepted: Sequence[int]) -> None:
        """Keep the first `accepted[b]` (≥ 1) draft tokens of each sequence's last verify step: its length drops to
        that prefix and its GDN state becomes the snapshot after the last kept token (KV rows past the length are
        simply overwritten later)."""
        for state, count in zip(states, accepted, strict=True):
            if not 1 <= count <= state.pending:
                raise ValueError(f"accept 1..{state.pending} tokens of the verify step, not {count}")
            if count < state.pending:
                snapshot = self.verify_slot(state.slot, count - 1)
                self.conv[:, state.slot] = self.conv[:, snapshot]
                self.recurrent[:, state.slot] = self.recurrent[:, snapshot]
            state.length -= state.pending - count
            state.pending = 0

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
