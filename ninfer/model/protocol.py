"""The one interface through which the engine runs a model: state allocation, prefill, decode steps, speculative
verify steps, and prefix snapshots. The reference model (`qwen3_5.Qwen35Model`) implements it directly; the packed
GPU model (`qwen3_5_packed.PackedQwen35`) implements it through the engine's graph runner (`engine.runner`), which
owns its static inputs and CUDA graphs.

A sequence's `State` is opaque to the engine except for `length` (positions it holds) and `capacity`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from ninfer.model.config import TextConfig


@runtime_checkable
class Model(Protocol):
    config: TextConfig
    device: torch.device
    dtype: torch.dtype
    max_batch: int | None  # the most sequences a decode step takes (None: no limit)
    page: int  # positions per unit of KV allocation (a sequence's capacity is rounded up to it)
    kv_capacity: int | None  # KV positions over all sequences (None: as many as memory allows)
    drafter: bool  # sequences carry the MTP head's state, and `draft` proposes tokens

    def new_state(self, capacity: int) -> Any:
        """A fresh sequence of up to `capacity` positions."""

    def free_state(self, state: Any) -> None:
        """Give a sequence's memory back (once; the state is unusable after)."""

    def prefill(self, ids: torch.Tensor, state: Any, all_logits: bool = False) -> torch.Tensor:
        """Append `ids` `[T]` to the sequence: logits (fp32) of the last position `[V]`, or of all `[T, V]`."""

    def decode(self, states: Sequence[Any], ids: torch.Tensor) -> torch.Tensor:
        """Append one token to each of B sequences: logits `[B, V]` fp32."""

    def verify(self, states: Sequence[Any], ids: torch.Tensor) -> torch.Tensor:
        """Append T draft tokens `ids` `[B, T]` to each of B sequences: logits `[B, T, V]` after each; `accept` then
        keeps a prefix of them."""

    def accept(self, states: Sequence[Any], accepted: Sequence[int]) -> None:
        """Keep the first `accepted[b]` (≥ 1) draft tokens of each sequence's last verify step."""

    def draft(self, states: Sequence[Any], ids: torch.Tensor, k: int) -> torch.Tensor:
        """K greedy draft tokens `[B, K]` after each sequence's next token `ids[b]` (sampled, not yet in its state),
        from the MTP head chained on its own output; the states are left as they were."""

    def snapshot(self, state: Any) -> dict[tuple[str, int], Any]:
        """The sequence's whole state at its length, for prefix reuse (tensors, and model-held handles)."""

    def restore(self, state: Any, length: int, snapshot: dict[tuple[str, int], Any]) -> None:
        """Put a snapshot of a `length`-token prefix into a fresh state."""

    def release_snapshot(self, snapshot: dict[tuple[str, int], Any]) -> None:
        """Give back what a snapshot holds in the model's pools (nothing for plain tensors)."""

    def set_reclaim(self, reclaim: Callable[[], bool] | None) -> None:
        """`reclaim()` drops one snapshot when the pools run short (False: none left to drop)."""

    def prepare(self, batch_sizes: Iterable[int]) -> None:
        """Get decode steps of these batch sizes ready (capture their graphs); a no-op where nothing is captured."""

    def warm_up(self, max_batch: int | None = None) -> float:
        """Compile and capture what serving meets before the first request; returns the seconds it took."""

    def describe_memory(self) -> str | None:
        """The memory plan in one line, where there is one."""

    @property
    def weight_bytes(self) -> int:
        """Device bytes of the weights as held."""

    def matrices(self) -> dict[str, tuple[int, int, int]]:
        """Name → (rows, columns, bytes as held) of every trunk weight matrix (speed accounting)."""


class PooledSequence(Protocol):
    """A sequence in the packed model's pools, as the engine's KV cache allocates it (`engine.kv_cache.SlotState`):
    its state slot, the KV pages of its block-table row, and the positions it holds."""

    slot: int
    pages: list[int]
    length: int
