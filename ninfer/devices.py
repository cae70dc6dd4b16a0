"""Device names from the command line, checked before any work starts."""

from __future__ import annotations

import os

import torch

from ninfer.errors import NinferError


def parse_device(name: str) -> torch.device:
    """`cpu`, `cuda` or `cuda:N`, refused with a clear message when it is not usable here."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise NinferError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise NinferError(f"device {name!r} requested but CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise NinferError(f"device {name!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
    elif device.type != "cpu":
        raise NinferError(f"unsupported device {name!r}; use cpu, cuda or cuda:N")
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), before reading a host clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> int:
    """Bytes free for new allocations: the CUDA allocator's view of the device, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
