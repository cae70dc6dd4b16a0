"""The Triton groupwise GEMV on CUDA (`pytest -m gpu`): equal to the exact reference at the real shapes of the
qwen3.8-27b and qwen3.6-35b-a3b presets for T = 1..16 tokens, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.quant_linear import quant_linear_gemv, quant_linear_reference
from ninfer.quant import codec_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPES = {  # (N, K, format) as the q4 recipe stores them
    "27b attention/query_key": (7168, 5120, "q4_g64_fp16"),
    "27b mlp/down": (5120, 17408, "q5_g64_fp16"),
    "27b token head": (4096, 5120, "q6_g64_fp16"),  # a slice of the head's rows
    "35b moe/routed_down (one expert)": (2048, 512, "q5_g64_fp16"),
    "mtp q8": (5120, 10240, "q8_g32_fp16"),
}
FP32_REL, BF16_REL = 1e-5, 1e-2  # bf16: x rounded to bf16 for both, products accumulate in fp32


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 2, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_k", [1, 8])
def test_gemv_on_cuda_equals_the_reference(name, tokens, dtype, split_k):
    n, k, fmt = SHAPES[name]
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    data = codec_for(fmt).encode(torch.randn(n, k, device="cuda", generator=generator) * 0.02)
    x = torch.randn(tokens, k, device="cuda", generator=generator).to(dtype)
    expected = quant_linear_reference(x.float(), data, (n, k), fmt)
    got = quant_linear_gemv(x, data, (n, k), fmt, split_k=split_k)
    error = float((got - expected).norm() / expected.norm())
    assert error < (FP32_REL if dtype == torch.float32 else BF16_REL), f"{name} T={tokens} {dtype}: {error:.2e}"
