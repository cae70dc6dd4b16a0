"""The Triton groupwise GEMV against the exact reference (decode + fp32 matmul), under the Triton interpreter on
the CPU (tests/conftest.py switches it on); real shapes on CUDA are in tests/test_quant_linear_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from ninfer.kernels.quant_linear import quant_linear_gemv, quant_linear_reference
from ninfer.quant import codec_for

FORMATS = ["q4_g64_fp16", "q5_g64_fp16", "q6_g64_fp16", "q8_g32_fp16"]
RELATIVE_TOLERANCE = 1e-5  # fp32 on both sides; only the summation order differs


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("tokens", "n", "k", "split_k"), [(1, 40, 130, 1), (3, 64, 256, 1), (16, 70, 64, 1),
                                                          (2, 40, 640, 3), (5, 24, 384, 8)])
def test_gemv_equals_the_reference(fmt, tokens, n, k, split_k):
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # tests/conftest.py decides
    generator = torch.Generator().manual_seed(n * k + tokens)
    weight = torch.randn(n, k, generator=generator)
    data = codec_for(fmt).encode(weight).to(device)
    x = torch.randn(tokens, k, generator=generator).to(device)
    expected = quant_linear_reference(x, data, (n, k), fmt)
    got = quant_linear_gemv(x, data, (n, k), fmt, block_n=16, split_k=split_k)
    error = float((got - expected).abs().max() / expected.abs().max())
    assert error < RELATIVE_TOLERANCE, f"{fmt} T={tokens} [{n}, {k}]: relative error {error:.2e}"


def test_gemv_refuses_what_it_does_not_do():
    data = codec_for("q4_g64_fp16").encode(torch.randn(8, 64))  # refused before any kernel runs
    with pytest.raises(ValueError, match=r"1\.\.16 tokens"):
        quant_linear_gemv(torch.randn(17, 64), data, (8, 64), "q4_g64_fp16")
    with pytest.raises(ValueError, match="not a groupwise format"):
        quant_linear_gemv(torch.randn(1, 64), codec_for("bf16").encode(torch.randn(8, 64)), (8, 64), "bf16")
