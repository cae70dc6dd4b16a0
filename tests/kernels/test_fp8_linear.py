"""The FP8-row GEMV against the exact reference (codec decode + fp32 matmul) under the Triton interpreter on the
CPU (fp32 x) and on CUDA (bf16 x, `pytest -m gpu`); the integer E4M3 decoding over every code."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ninfer.kernels.fp8_linear import FORMAT, fp8_block, fp8_linear_gemv, fp8_rows
from ninfer.quant import codec_for

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative, by x's dtype: summation order / x rounded to bf16


def _relative(got, expected):
    return float((got.float() - expected.float()).abs().max() / expected.float().abs().max())


def test_every_e4m3_code_decodes_exactly(device):
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # the two NaN codes are illegal in the format
    n = codes.numel()
    data = torch.zeros(codec_for(FORMAT).encoded_bytes((n, 1)), dtype=torch.uint8)
    data[:n] = codes
    data[codec_for(FORMAT).planes((n, 1))[1].offset :][: 2 * n].view(torch.bfloat16)[:] = 1.0
    x = torch.ones(1, 1)
    got = fp8_linear_gemv(x.to(device), data.to(device), (n, 1))[0].cpu()
    assert torch.equal(got, codes.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize(("tokens", "n", "k"), [(1, 40, 700), (1, 16, 1024), (5, 70, 300), (16, 33, 128)])
def test_fp8_gemv_equals_the_reference(device, activation_dtype, tokens, n, k):
    generator = torch.Generator().manual_seed(n + k + tokens)
    data = codec_for(FORMAT).encode(torch.randn(n, k, generator=generator)).to(device)
    x = torch.randn(tokens, k, generator=generator).to(device, activation_dtype)
    expected = x.float() @ codec_for(FORMAT).decode(data, (n, k)).T
    assert _relative(fp8_linear_gemv(x, data, (n, k)), expected) < TOLERANCE[activation_dtype]


def test_fp8_gemv_gives_a_token_the_same_bits_at_any_token_count(device, activation_dtype):
    generator = torch.Generator().manual_seed(9)
    data = codec_for(FORMAT).encode(torch.randn(50, 600, generator=generator)).to(device)
    x = torch.randn(7, 600, generator=generator).to(device, activation_dtype)
    single = torch.cat([fp8_linear_gemv(x[t : t + 1], data, (50, 600)) for t in range(7)])
    assert torch.equal(fp8_linear_gemv(x, data, (50, 600)), single)


def test_fp8_gather_and_rows(device, activation_dtype):
    experts, rows, k = 4, 24, 256
    generator = torch.Generator().manual_seed(5)
    data = codec_for(FORMAT).encode(torch.randn(experts * rows, k, generator=generator)).to(device)
    weight = codec_for(FORMAT).decode(data, (experts * rows, k))
    chosen = torch.tensor([2, 0, 3, 2], dtype=torch.int32, device=device)
    x = torch.randn(2, k, generator=generator).to(device, activation_dtype)
    got = fp8_linear_gemv(x, data, (experts * rows, k), experts=chosen, expert_rows=rows, x_per_slot=2)
    for slot, expert in enumerate(chosen.tolist()):
        expected = x[slot // 2].float() @ weight[expert * rows : (expert + 1) * rows].T
        assert _relative(got[slot], expected) < TOLERANCE[activation_dtype]
    index = torch.tensor([5, 0, 95], device=device)
    assert torch.equal(fp8_rows(data, (experts * rows, k), index, torch.float32), weight[index])
    scratch = torch.full((60 * k,), -1.0, device=device)
    assert torch.equal(fp8_block(data, (experts * rows, k), 30, 50, scratch), weight[30:80])
    assert scratch[50 * k :].eq(-1).all()
