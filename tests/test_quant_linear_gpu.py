"""The Triton groupwise GEMV and dequantizer on CUDA (`pytest -m gpu`): the integer GEMV equal to its oracle (x's int8
image times the exact matrix) at the real shapes of the qwen3.8-27b and qwen3.6-35b-a3b presets for T = 1..16
tokens, from fp32 and bf16 inputs, with every row tile the runner may choose, and each token's result the same bits
at any T; the MoE gather at the 35B expert shapes."""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.activation_quant import dequantize_activations, quantize_activations_reference
from ninfer.kernels.quant_linear import (
    dequantize,
    group_pairs,
    quant_linear_gemv,
    quant_linear_grouped,
    quant_linear_reference,
)
from ninfer.quant import codec_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPES = {  # (N, K, format) as the q4 recipe stores them
    "27b attention/query_key": (7168, 5120, "q4_g64_fp16"),
    "27b mlp/down": (5120, 17408, "q5_g64_fp16"),
    "27b token head": (4096, 5120, "q6_g64_fp16"),  # a slice of the head's rows
    "35b moe/routed_down (one expert)": (2048, 512, "q5_g64_fp16"),
    "mtp q8": (5120, 10240, "q8_g32_fp16"),
}
FP32_REL = 1e-5  # fp32 scaling of exact integer dot products against float64
INT8_ACTIVATION_REL = 0.015  # the int8 image of x against x itself (about 0.5 % on Gaussian inputs)
BF16_REL = 1e-2  # the grouped product: weights rounded to bf16, products accumulated in fp32


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 2, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_n", [None, 4, 32])
def test_gemv_on_cuda_equals_the_reference(name, tokens, dtype, block_n):
    n, k, fmt = SHAPES[name]
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    data = codec_for(fmt).encode(torch.randn(n, k, device="cuda", generator=generator) * 0.02)
    x = torch.randn(tokens, k, device="cuda", generator=generator).to(dtype)
    expected = quant_linear_reference(x.float(), data, (n, k), fmt, int8_activations=True)
    got = quant_linear_gemv(x, data, (n, k), fmt, block_n=block_n)
    error = float((got - expected).norm() / expected.norm())
    assert error < FP32_REL, f"{name} T={tokens} {dtype}: {error:.2e}"
    single = torch.cat([quant_linear_gemv(x[t : t + 1], data, (n, k), fmt) for t in range(tokens)])
    assert torch.equal(got, single), f"{name}: a token's result changed with T = {tokens}"
    exact = quant_linear_reference(x.float(), data, (n, k), fmt)
    assert float((got - exact).norm() / exact.norm()) < INT8_ACTIVATION_REL


@pytest.mark.parametrize("name", ["27b mlp/down", "mtp q8", "27b token head"])
@pytest.mark.parametrize("tokens", [1, 8])
def test_batch_pipeline_on_cuda_changes_no_bit(name, tokens):
    """Every (tiles loaded ahead, K tiles per loop turn, `dp4a` per chain) of the batch route gives the same bits on
    the GPU, where the loads are inline `ld.global.nc`, the loop is really unrolled and `dp4a` is the instruction."""
    n, k, fmt = SHAPES[name]
    generator = torch.Generator(device="cuda").manual_seed(tokens + 3)
    data = codec_for(fmt).encode(torch.randn(n, k, device="cuda", generator=generator) * 0.02)
    x = torch.randn(tokens, k, device="cuda", generator=generator)
    expected = quant_linear_gemv(x, data, (n, k), fmt, depth=1, unroll=1, chain=2)
    for depth, unroll, chain in ((2, 1, 2), (1, 2, 2), (2, 2, 2), (1, 1, 4), (1, 1, 8), (2, 1, 8)):
        got = quant_linear_gemv(x, data, (n, k), fmt, depth=depth, unroll=unroll, chain=chain)
        assert torch.equal(got, expected), f"{name} T={tokens}: depth {depth}, unroll {unroll}, chain {chain}"


@pytest.mark.parametrize("name", ["27b attention/query_key", "27b mlp/down", "27b token head", "mtp q8"])
@pytest.mark.parametrize("tokens", [1, 3, 8, 16])
def test_lane_tree_on_cuda_gives_the_bits_of_the_pairwise_sum(name, tokens):
    """On the GPU the batch route's positions meet through `shfl` exchanges between lanes (`_lane_tree_sum`, which
    takes position p to be in lane p of Triton's layout); the token route at the same 1,024-lane tile uses the
    plain halving tree: the same bits, every sum on its own token and row."""
    n, k, fmt = SHAPES[name]
    generator = torch.Generator(device="cuda").manual_seed(tokens + 7)
    data = codec_for(fmt).encode(torch.randn(n, k, device="cuda", generator=generator) * 0.02)
    x = torch.randn(tokens, k, device="cuda", generator=generator)
    expected = quant_linear_gemv(x, data, (n, k), fmt, route="token", block_k=1024)
    for block_n in (None, 1, 2, 4):
        got = quant_linear_gemv(x, data, (n, k), fmt, route="batch", block_n=block_n, lane_tree=True)
        assert torch.equal(got, expected), f"{name} T={tokens} BN={block_n}"


@pytest.mark.parametrize("fmt", ["q4_g64_fp16", "q5_g64_fp16", "q8_g32_fp16"])
def test_expert_gather_on_cuda(fmt):
    experts, rows, k, top_k = 256, 1024, 2048, 8  # 35B-A3B routed gate_up
    generator = torch.Generator(device="cuda").manual_seed(1)
    data = codec_for(fmt).encode(torch.randn(experts * rows, k, device="cuda", generator=generator) * 0.02)
    chosen = torch.randint(0, experts, (2 * top_k,), device="cuda", generator=generator, dtype=torch.int32)
    x = torch.randn(2, k, device="cuda", generator=generator).to(torch.bfloat16)
    got = quant_linear_gemv(x, data, (experts * rows, k), fmt, experts=chosen, expert_rows=rows, x_per_slot=top_k)
    weight = codec_for(fmt).decode(data, (experts * rows, k)).view(experts, rows, k).double()
    lanes = dequantize_activations(quantize_activations_reference(x))[:, :k].double()
    expected = torch.stack([lanes[s // top_k] @ weight[e].T for s, e in enumerate(chosen.tolist())]).float()
    assert float((got - expected).norm() / expected.norm()) < FP32_REL


@pytest.mark.parametrize("name", list(SHAPES))
def test_dequantize_on_cuda_rounds_once(name):
    n, k, fmt = SHAPES[name]
    data = codec_for(fmt).encode(torch.randn(n, k, device="cuda") * 0.02)
    assert torch.equal(dequantize(data, (n, k), fmt), codec_for(fmt).decode(data, (n, k)).to(torch.bfloat16))


@pytest.mark.parametrize(("fmt", "rows", "k", "x_per_pair"),
                         [("q4_g64_fp16", 1024, 2048, 8), ("q5_g64_fp16", 2048, 512, 1)])
def test_grouped_expert_product_on_cuda(fmt, rows, k, x_per_pair):
    experts, tokens, top_k = 256, 300, 8  # 35B-A3B routed gate_up (x per token) and down (x per pair)
    generator = torch.Generator(device="cuda").manual_seed(2)
    data = codec_for(fmt).encode(torch.randn(experts * rows, k, device="cuda", generator=generator) * 0.02)
    ids = torch.randint(0, experts, (tokens * top_k,), device="cuda", generator=generator)
    x = torch.randn(tokens * top_k // x_per_pair, k, device="cuda", generator=generator).to(torch.bfloat16)
    got = quant_linear_grouped(x, data, (experts * rows, k), fmt, group_pairs(ids, experts, 64), ids.numel(), rows,
                               x_per_pair, 64)
    weight = codec_for(fmt).decode(data, (experts * rows, k)).view(experts, rows, k)
    inputs = x[torch.arange(ids.numel(), device="cuda") // x_per_pair].float()
    expected = torch.empty_like(got, dtype=torch.float32)
    for expert in ids.unique().tolist():
        chosen = ids == expert
        expected[chosen] = inputs[chosen] @ weight[expert].T
    assert float((got.float() - expected).norm() / expected.norm()) < BF16_REL
