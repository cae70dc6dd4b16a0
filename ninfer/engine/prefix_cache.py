"""Prefix reuse: snapshots of a sequence's whole state (KV rows, GDN conv and recurrent state) keyed by the exact
token prefix they follow. The recurrent state cannot be cut back, so a prefix can only be reused where a snapshot
was taken: the engine takes them at turn boundaries. LRU within two byte budgets: on the model's device, then (CUDA
only) in pinned host memory, then dropped; a dropped snapshot gives back what it holds in the model's pools."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

PREFIX_CACHE_CPU_BYTES = 256 << 20
# the device budget's ceiling (a 27B snapshot holds 151 MB of GDN state: a budget of 256 MB kept one, and every new
# one spilled the last to host memory)
PREFIX_CACHE_MAX_BYTES = 8 << 30


@dataclass
class Snapshot:
    """A sequence's whole state after `length` prompt tokens, as the model's `snapshot` gives it: tensors, and on the
    packed GPU model a lease on shared KV pages (not a tensor: it stays on the device, is not counted in the byte
    budgets and passes through moves unchanged)."""

    length: int
    tensors: dict[tuple[str, int], Any]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values() if isinstance(t, torch.Tensor))

    def to(self, device: torch.device | str, pin: bool = False) -> Snapshot:
        moved = {}
        for key, value in self.tensors.items():
            if isinstance(value, torch.Tensor):  # to pinned memory in one copy, not through a pageable one
                target = torch.empty(value.shape, dtype=value.dtype, device=device, pin_memory=pin)
                value = target.copy_(value)
            moved[key] = value
        return Snapshot(self.length, moved)


def default_prefix_cache_bytes(device: torch.device) -> int:
    """The device budget when none is given: on CUDA a quarter of the memory still free once the model and its pools
    are loaded, at most PREFIX_CACHE_MAX_BYTES; elsewhere PREFIX_CACHE_CPU_BYTES."""
    if device.type != "cuda":
        return PREFIX_CACHE_CPU_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return min(PREFIX_CACHE_MAX_BYTES, free // 4)


class PrefixCache:
    """See the module docstring. `release(snapshot)` is called for every snapshot the cache drops."""

    def __init__(self, device: torch.device, device_bytes: int, host_bytes: int,
                 release: Callable[[Snapshot], None] = lambda snapshot: None):
        self.device = device
        self.device_bytes = device_bytes
        self.host_bytes = host_bytes if device.type == "cuda" else 0
        self.release = release
        self._device: OrderedDict[bytes, Snapshot] = OrderedDict()
        self._host: OrderedDict[bytes, Snapshot] = OrderedDict()
        self.hits = 0

    @staticmethod
    def key(ids: list[int]) -> bytes:
        return hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).digest()

    def __contains__(self, key: bytes) -> bool:
        return key in self._device or key in self._host

    def __len__(self) -> int:
        return len(self._device) + len(self._host)

    def put(self, key: bytes, snapshot: Snapshot) -> None:
        """Keep `snapshot` (the cache owns it from here: one it cannot keep is released at once)."""
        if snapshot.nbytes > self.device_bytes:
            self.release(snapshot)
            return
        self._device[key] = snapshot
        self._device.move_to_end(key)
        while sum(s.nbytes for s in self._device.values()) > self.device_bytes:
            old_key, old = self._device.popitem(last=False)
            if self.host_bytes and old.nbytes <= self.host_bytes:
                self._host[old_key] = old.to("cpu", pin=True)
            else:
                self.release(old)
        while sum(s.nbytes for s in self._host.values()) > self.host_bytes:
            self.release(self._host.popitem(last=False)[1])

    def get(self, key: bytes) -> Snapshot | None:
        if key in self._device:
            self._device.move_to_end(key)
            return self._device[key]
        if key in self._host:
            snapshot = self._host.pop(key).to(self.device)
            self.put(key, snapshot)
            return snapshot
        return None

    def drop_oldest(self) -> bool:
        """Forget the least recently used snapshot (host first): the model needs what it holds."""
        for store in (self._host, self._device):
            if store:
                self.release(store.popitem(last=False)[1])
                return True
        return False
