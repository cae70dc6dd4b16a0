"""The stripe GEMV on CUDA (`pytest -m gpu`): at the 27B's down projection (the matrix the q4 recipe keeps as stripe
chunks) and at a shape whose groups do not fill the warps, for T = 1..16 and a 64-token verify, against the float64
oracle, each token's row the bits of that token alone (verify = decode, batched = alone), and through
`PackedLinear` on every route it takes (tiles, records, and the prefill's dequantize + cuBLAS)."""

from __future__ import annotations

import pytest
import torch

from ninfer.fast.linear import PackedLinear, Scratch
from ninfer.kernels.activation_quant import quantize_activations
from ninfer.kernels.fused import silu_mul
from ninfer.kernels.quant_linear import quant_linear_reference
from ninfer.kernels.stripe_linear import (
    FORMAT,
    dequantize_stripes,
    quantize_tiles,
    repack,
    stripe_gemv,
    stripe_gemv_reference,
    unpack_reference,
)
from ninfer.quant import codec_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPES = {"27b mlp/down": (5120, 17408), "groups past the warps": (48, 8320)}  # 130 groups: 16 warps, 9 turns
BF16_REL = 4e-3  # a bf16 result against float64


def _matrix(shape):
    torch.manual_seed(0)
    return codec_for(FORMAT).encode(torch.randn(shape, device="cuda") * 0.02)


@pytest.mark.parametrize("name", list(SHAPES))
def test_stripe_gemv_on_cuda_matches_the_oracle_and_a_token_alone(name):
    shape = SHAPES[name]
    chunks = repack(_matrix(shape), shape)
    x = torch.randn(64, shape[1], device="cuda", dtype=torch.bfloat16)
    alone = torch.cat([stripe_gemv(quantize_tiles(x[t : t + 1]), chunks, shape) for t in range(64)])
    for tokens in [*range(1, 17), 64]:
        tiles = quantize_tiles(x[:tokens])
        got = stripe_gemv(tiles, chunks, shape)
        expected = stripe_gemv_reference(tiles, chunks, shape)
        assert float((got.double() - expected).norm() / expected.norm()) < BF16_REL, tokens
        assert torch.equal(got, alone[:tokens]), f"T = {tokens}: a token's bits depend on the others"


@pytest.mark.parametrize("tokens", [1, 8, 13])
def test_the_groups_loaded_ahead_never_change_a_bit_on_cuda(tokens):
    shape = SHAPES["groups past the warps"]
    chunks = repack(_matrix(shape), shape)
    tiles = quantize_tiles(torch.randn(tokens, shape[1], device="cuda", dtype=torch.bfloat16))
    results = [stripe_gemv(tiles, chunks, shape, depth=depth) for depth in (1, 2, 3, 4)]
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_stripe_gemv_writes_into_columns_of_a_wider_buffer():
    shape = SHAPES["groups past the warps"]
    chunks = repack(_matrix(shape), shape)
    tiles = quantize_tiles(torch.randn(5, shape[1], device="cuda"))
    wide = torch.zeros(5, shape[0] + 32, device="cuda")
    stripe_gemv(tiles, chunks, shape, out=wide[:, 16 : 16 + shape[0]])
    assert torch.equal(wide[:, 16 : 16 + shape[0]], stripe_gemv(tiles, chunks, shape, out_dtype=torch.float32))
    assert not wide[:, :16].any() and not wide[:, 16 + shape[0] :].any()


def test_dequantized_stripes_on_cuda_round_once():
    shape = SHAPES["27b mlp/down"]
    data = _matrix(shape)
    chunks = repack(data, shape)
    assert torch.equal(unpack_reference(chunks, shape), codec_for(FORMAT).decode(data, shape))
    assert torch.equal(dequantize_stripes(chunks, shape), codec_for(FORMAT).decode(data, shape).bfloat16())


def test_silu_mul_tiles_on_cuda_are_the_quantizers():
    gate_up = torch.randn(11, 2 * 17408, device="cuda", dtype=torch.bfloat16)
    made = silu_mul(gate_up, quantize=True, tiles=True)
    shape = SHAPES["27b mlp/down"]
    chunks = repack(_matrix(shape), shape)
    assert torch.equal(stripe_gemv(made, chunks, shape), stripe_gemv(quantize_tiles(made.source), chunks, shape))


def test_packed_linear_keeps_the_down_projection_as_stripes_on_every_route():
    shape = SHAPES["27b mlp/down"]
    data = _matrix(shape)
    scratch = Scratch(torch.device("cuda"), torch.bfloat16)
    assert not PackedLinear(data, shape, FORMAT, scratch, whole=False).stripes  # stacked experts, tables
    linear = PackedLinear(data, shape, FORMAT, scratch)
    assert linear.stripes and not linear.batch_route and linear.nbytes == data.numel()
    x = torch.randn(8, shape[1], device="cuda", dtype=torch.bfloat16)
    from_tiles = linear(quantize_tiles(x))
    assert torch.equal(linear(quantize_activations(x)), from_tiles)  # records: tiles made from x
    oracle = quant_linear_reference(x, data, shape, FORMAT, int8_activations=True).double()
    assert float((from_tiles.double() - oracle).norm() / oracle.norm()) < BF16_REL
    exact = quant_linear_reference(x.float(), data, shape, FORMAT).double()
    prefill = linear(x)  # the scratch route: W dequantized from the chunks, then cuBLAS
    assert float((prefill.double() - exact).norm() / exact.norm()) < BF16_REL
    with pytest.raises(ValueError, match="stripe chunks"):
        linear.rows(torch.arange(3, device="cuda"))
