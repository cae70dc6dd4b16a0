"""The dense GEMV (decode steps' bf16 matrices) against torch's product, and a token's result the same bits at any
token count — under the Triton interpreter on the CPU (fp32), in bf16 on CUDA (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ninfer.kernels.dense_linear import dense_linear_gemv


@pytest.mark.parametrize(("tokens", "n", "k"), [(1, 8, 256), (3, 70, 300), (16, 257, 1000)])
@pytest.mark.parametrize("pairwise", [False, True])  # tl.sum, or the fixed tree of `pairwise_row_sum`
def test_dense_gemv_equals_the_float64_product(device, activation_dtype, tokens, n, k, pairwise):
    generator = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=generator).to(device, activation_dtype)
    x = torch.randn(tokens, k, generator=generator).to(device, activation_dtype)
    expected = x.double() @ weight.double().T
    got = dense_linear_gemv(x, weight, pairwise=pairwise)
    assert got.shape == (tokens, n) and got.dtype == torch.float32
    assert float((got.double() - expected).abs().max() / expected.abs().max()) < 1e-5
    assert dense_linear_gemv(x, weight, out_dtype=torch.bfloat16).dtype == torch.bfloat16


def test_dense_gemv_gives_a_token_the_same_bits_at_any_token_count(device, activation_dtype):
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(20, 520, generator=generator).to(device, activation_dtype)
    x = torch.randn(9, 520, generator=generator).to(device, activation_dtype)
    single = torch.cat([dense_linear_gemv(x[t : t + 1], weight) for t in range(9)])
    assert torch.equal(dense_linear_gemv(x, weight), single)
    assert torch.equal(dense_linear_gemv(x[2:5], weight), single[2:5])


def test_dense_gemv_refuses_what_it_does_not_do():
    with pytest.raises(ValueError, match=r"1\.\.64 tokens"):
        dense_linear_gemv(torch.randn(65, 64), torch.randn(8, 64))
    with pytest.raises(ValueError, match="the same K"):
        dense_linear_gemv(torch.randn(2, 64), torch.randn(8, 32))
    with pytest.raises(ValueError, match="pairwise sum takes K"):
        dense_linear_gemv(torch.randn(2, 8193), torch.randn(8, 8193), pairwise=True)
