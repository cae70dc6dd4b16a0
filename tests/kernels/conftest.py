"""Fixtures of the kernel tests; `device` (interpreter or CUDA) is tests/conftest.py's."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def activation_dtype(device: torch.device) -> torch.dtype:
    """The activations' dtype of a kernel test: fp32 under the interpreter, whose bf16 rounding is not the GPU's
    (it truncates), bf16 on CUDA as the model runs."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16
