"""The Triton groupwise GEMV (integer products over int8 activations), the activation quantizer and the dequantizer
against their torch references, under the Triton interpreter on the CPU and on CUDA. The GEMV's oracle is the exact
decoded matrix times x's int8 image in float64 (the integer dot products are exact, only the fp32 scaling differs); a
second test bounds what the int8 activations cost against the exact product.

On CUDA only (`pytest -m gpu`), the real shapes: the integer GEMV equal to its oracle at the shapes of the
qwen3.8-27b and qwen3.6-35b-a3b presets for T = 1..16 tokens, from fp32 and bf16 inputs, with every row tile the
runner may choose, and each token's result the same bits at any T; the MoE gather at the 35B expert shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ninfer.kernels.activation_quant import (
    Int8Activations,
    dequantize_activations,
    quantize_activations,
    quantize_activations_reference,
)
from ninfer.kernels.quant_linear import (
    dequantize,
    group_pairs,
    quant_linear_gemv,
    quant_linear_gemv_pair,
    quant_linear_grouped,
    quant_linear_reference,
)
from ninfer.quant import codec_for

FORMATS = ["q4_g64_fp16", "q5_g64_fp16", "q6_g64_fp16", "q8_g32_fp16"]
RELATIVE_TOLERANCE = 1e-5  # fp32 against float64 over the same values; only rounding and order differ
BF16_ULP = 2.0**-7


def _matrix(fmt, n, k, seed, device):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator)
    return codec_for(fmt).encode(weight).to(device), generator


def _relative(got, expected):
    return float((got - expected).abs().max() / expected.abs().max())


def test_activation_quantizer_equals_its_reference_bit_for_bit(device):
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3, 200, generator=generator) * torch.logspace(-3, 3, 200)  # blocks of very different scales
    x[1, 64:96] = 0  # an all-zero block: scale 0, codes 0
    x[2, 5] = 1e4  # one outlier dominates its block
    x = x.to(device)
    got, expected = quantize_activations(x), quantize_activations_reference(x)
    assert got.blocks.shape == (3, 256 // 32, 12)  # K padded to 256 lanes, as the groupwise formats pad a row
    assert torch.equal(got.blocks, expected.blocks)
    lanes = dequantize_activations(got)
    assert torch.equal(lanes[:, 200:], torch.zeros_like(lanes[:, 200:]))
    error = (lanes[:, :200] - x).abs().view(3, -1)  # at most half a step of each lane's block
    steps = got.scales.repeat_interleave(32, dim=1)[:, :200]
    assert bool((error <= steps / 2 * (1 + 1e-6)).all())
    assert float(got.scales[1, 2]) == 0 and int(got.sums[1, 2]) == 0


def test_high_bit_spreads_place_every_pattern():
    """The q5 / q6 high-bit multiplies of `_weight_quads` (constants below as written there): every high unit's
    bits land on bit 4 (q5) or bits 4-5 (q6) of their lane's byte in the even / odd quad, and nowhere else."""
    for h in range(256):  # q5: bit i of the byte is bit 4 of lane i
        even = ((h & 0x55) * 0x410410) & 0x10101010
        odd = ((h & 0xAA) * 0x208208) & 0x10101010
        assert even == sum(((h >> (2 * j)) & 1) << (8 * j + 4) for j in range(4))
        assert odd == sum(((h >> (2 * j + 1)) & 1) << (8 * j + 4) for j in range(4))

    def spread(h):  # q6: bits (4j, 4j + 1) to bits (8j + 4, 8j + 5)
        return (((h & 0x0303) * 0x1010) & 0x00300030) | (((h & 0x3030) * 0x10100) & 0x30003000)

    for h in range(1 << 16):
        assert spread(h) == sum(((h >> (4 * j)) & 3) << (8 * j + 4) for j in range(4))
        assert spread(h >> 2) == sum(((h >> (4 * j + 2)) & 3) << (8 * j + 4) for j in range(4))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("tokens", "n", "k", "block_k"), [(1, 40, 130, None), (1, 24, 1024, 512), (3, 64, 256, 256),
                                                          (16, 70, 64, None), (2, 40, 640, 128)])
def test_gemv_equals_the_reference(device, fmt, tokens, n, k, block_k):
    data, generator = _matrix(fmt, n, k, n * k + tokens, device)
    x = torch.randn(tokens, k, generator=generator).to(device)
    expected = quant_linear_reference(x, data, (n, k), fmt, int8_activations=True)
    got = quant_linear_gemv(x, data, (n, k), fmt, block_n=16, block_k=block_k)
    assert _relative(got, expected) < RELATIVE_TOLERANCE, f"{fmt} T={tokens} [{n}, {k}]"
    exact = quant_linear_reference(x, data, (n, k), fmt)  # what int8 activations cost: about 0.5 % here
    assert float((got - exact).norm() / exact.norm()) < 0.015


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_holds_the_largest_block_dot_products_exactly(device, fmt):
    """Every weight code at its largest magnitude (both signs, the most negative one included) against activations
    of code ±127 whose signs match or oppose the row's: the block dots reach their extremes (q8: 32 · 127 · 128),
    which the GEMV turns into floats by the magic number 1.5 · 2^23 (exact below 2^22 in magnitude)."""
    k, generator = 2048, torch.Generator().manual_seed(7)
    signs = torch.where(torch.rand(4, k, generator=generator) < 0.5, -1.0, 1.0)
    weight = torch.cat([signs, -signs, signs.abs(), -signs.abs()])  # ±max codes; all-negative rows hit -2^(b-1)
    data = codec_for(fmt).encode(weight).to(device)
    x = torch.cat([signs[:2], -signs[2:]]).to(device) * 3.0  # every block's absmax: codes ±127
    expected = quant_linear_reference(x, data, weight.shape, fmt, int8_activations=True)
    for route in ("token", "batch"):
        got = quant_linear_gemv(x, data, weight.shape, fmt, route=route, block_k=1024)
        assert _relative(got, expected) < RELATIVE_TOLERANCE, f"{fmt} {route}"


def _fenced(tensor: torch.Tensor, fence: int) -> torch.Tensor:
    """`tensor` copied into the middle of a buffer whose other bytes are all `fence` (NaN bit patterns): a kernel
    that reads past either end picks them up."""
    flat = tensor.reshape(-1).view(torch.uint8)
    buffer = torch.full((flat.numel() + 2 * 4096,), fence, dtype=torch.uint8, device=tensor.device)
    buffer[4096 : 4096 + flat.numel()] = flat
    return buffer[4096 : 4096 + flat.numel()].view(tensor.dtype).view(tensor.shape)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k"), [(40, 130), (33, 320)])
def test_gemv_reads_nothing_outside_its_inputs(device, fmt, n, k):
    """K of 130 pads to 256 lanes in the weights: the activation records must cover them (once they did not)."""
    data, generator = _matrix(fmt, 3 * n, k, n + k, device)
    x = torch.randn(2, k, generator=generator).to(device)
    acts = quantize_activations(x)
    fenced = Int8Activations(acts.source, _fenced(acts.blocks, 0xFF))
    experts = torch.tensor([2, 0, 1, 2], dtype=torch.int32, device=device)
    for kwargs in ({}, dict(route="batch"), dict(experts=experts, expert_rows=n, x_per_slot=2)):
        shape = (3 * n, k)
        expected = quant_linear_gemv(acts, data, shape, fmt, **kwargs)
        got = quant_linear_gemv(fenced, _fenced(data, 0xFF), shape, fmt, **kwargs)
        assert torch.equal(got, expected), kwargs


@pytest.mark.parametrize("fmt", ["q4_g64_fp16", "q6_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize("k", [1024, 2048, 640])
def test_gemv_gives_a_token_the_same_bits_at_any_token_count(device, fmt, k):
    """Speculative verify (T tokens) must not change greedy decoding (T = 1): every row of a T-token product is
    the single-token product's bits, whatever the row tile or the batch route's tokens per program (K = 640 takes
    the token route)."""
    n = 50
    data, generator = _matrix(fmt, n, k, 5, device)
    x = torch.randn(11, k, generator=generator).to(device)
    single = torch.cat([quant_linear_gemv(x[t : t + 1], data, (n, k), fmt) for t in range(11)])
    for tokens, block_n, block_t in ((11, None, None), (4, 16, 2), (2, 32, None), (11, 64, 4)):
        got = quant_linear_gemv(x[:tokens], data, (n, k), fmt, block_n=block_n, block_t=block_t)
        assert torch.equal(got, single[:tokens]), f"T={tokens}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [1, 5])
def test_batch_pipeline_changes_no_bit(device, fmt, tokens):
    """The batch route's tiles loaded ahead and K tiles per loop turn (`depth`, `unroll`) move loads, and its `dp4a`
    chains (`chain`) regroup exact integer sums: every choice gives the same bits, equal to the oracle within
    rounding. Three K tiles: the unrolled loop has a tile over, and the tile two ahead runs past the end."""
    n, k = 9, 3072
    data, generator = _matrix(fmt, n, k, tokens + 11, device)
    x = torch.randn(tokens, k, generator=generator).to(device)
    expected = quant_linear_gemv(x, data, (n, k), fmt, route="batch", depth=1, unroll=1, chain=2)
    assert _relative(expected, quant_linear_reference(x, data, (n, k), fmt, int8_activations=True)) < RELATIVE_TOLERANCE
    for depth, unroll, chain in ((2, 1, 2), (1, 2, 2), (2, 2, 2), (1, 1, 4), (2, 1, 8)):
        got = quant_linear_gemv(x, data, (n, k), fmt, route="batch", depth=depth, unroll=unroll, chain=chain)
        assert torch.equal(got, expected), f"depth {depth}, unroll {unroll}, chain {chain}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("tokens", "n", "k"), [(2, 40, 130), (7, 33, 1024), (16, 70, 640), (37, 20, 256)])
def test_both_routes_give_the_same_bits_at_the_same_k_tile(device, fmt, tokens, n, k):
    """The token route (one token per program) and the batch route (weights unpacked once for a tile of tokens)
    compute the same exact integer block sums and then the same float steps: at the same K tile their bits are
    equal."""
    data, generator = _matrix(fmt, n, k, tokens * k, device)
    acts = quantize_activations(torch.randn(tokens, k, generator=generator).to(device))
    block_k = 128 if k == 640 else 256
    expected = quant_linear_gemv(acts, data, (n, k), fmt, route="token", block_k=block_k)
    assert torch.equal(quant_linear_gemv(acts, data, (n, k), fmt, route="batch", block_k=block_k), expected)


@pytest.mark.parametrize(("tokens", "block_n"), [(1, 2), (8, 4), (5, 2), (3, 1), (8, 1), (2, 8)])
def test_the_lane_tree_gives_the_bits_of_the_pairwise_sum(device, tokens, block_n):
    """At 1,024-lane tiles the batch route sums its 32 positions by exchanging halves between lanes
    (`_lane_tree_sum`: 1 to 32 sums a program, each lane keeping some); the token route at the same tile uses the
    plain halving tree. Every sum must land on its own token and row with the same bits."""
    n, k = 13, 3072
    data, generator = _matrix("q4_g64_fp16", n, k, tokens * block_n, device)
    acts = quantize_activations(torch.randn(tokens, k, generator=generator).to(device))
    expected = quant_linear_gemv(acts, data, (n, k), "q4_g64_fp16", route="token", block_k=1024)
    for lane_tree in (True, False):
        got = quant_linear_gemv(acts, data, (n, k), "q4_g64_fp16", route="batch", block_n=block_n, lane_tree=lane_tree)
        assert torch.equal(got, expected), f"lane tree {lane_tree}"


@pytest.mark.parametrize(("formats", "tokens", "k"), [(("q4_g64_fp16", "q5_g64_fp16"), 1, 2048),
                                                      (("q6_g64_fp16", "q8_g32_fp16"), 3, 2048),
                                                      (("q5_g64_fp16", "q4_g64_fp16"), 11, 2048),
                                                      (("q4_g64_fp16", "q5_g64_fp16"), 8, 5120),
                                                      (("q5_g64_fp16", "q4_g64_fp16"), 9, 6144)])
def test_a_gemv_pair_gives_each_product_the_bits_of_its_own_launch(device, formats, tokens, k):
    """Two matrices of one input in one launch (the GDN's q|k and v|z, attention's q|k and gate|v, in decode steps
    of up to 8 rows): each result equals its separate GEMV bit for bit, whatever the formats (their tiles,
    pipelines and tokens per program differ: q5 at K = 6,144 from 8 tokens takes 4 a program alone), and lands in
    the given columns of a shared buffer without touching the others."""
    shapes = [(40, k), (72, k)]
    matrices = [_matrix(fmt, n, k, 17 + i, device)[0]
                for i, (fmt, (n, _)) in enumerate(zip(formats, shapes, strict=True))]
    generator = torch.Generator().manual_seed(tokens)
    acts = quantize_activations(torch.randn(tokens, k, generator=generator).to(device))
    expected = [quant_linear_gemv(acts, data, shape, fmt, out_dtype=torch.float32)
                for data, shape, fmt in zip(matrices, shapes, formats, strict=True)]
    buffer = torch.full((tokens, 40 + 72 + 5), -7.0, device=device)
    first, second = quant_linear_gemv_pair(acts, (matrices[0], shapes[0], formats[0], buffer[:, :40]),
                                           (matrices[1], shapes[1], formats[1], buffer[:, 40:112]))
    assert torch.equal(first, expected[0]) and torch.equal(second, expected[1])
    assert torch.equal(buffer[:, :112], torch.cat(expected, dim=1)) and buffer[:, 112:].eq(-7).all()
    fresh = quant_linear_gemv_pair(acts, *((data, shape, fmt, None)
                                           for data, shape, fmt in zip(matrices, shapes, formats, strict=True)))
    assert all(torch.equal(got, want) for got, want in zip(fresh, expected, strict=True))
    with pytest.raises(ValueError, match="batch route"):
        short = _matrix("q4_g64_fp16", 8, 640, 3, device)[0]
        acts_640 = quantize_activations(torch.randn(1, 640, generator=generator).to(device))
        quant_linear_gemv_pair(acts_640, (short, (8, 640), "q4_g64_fp16", None), (short, (8, 640), "q4_g64_fp16", None))


@pytest.mark.parametrize("fmt", ["q4_g64_fp16", "q5_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize("x_per_slot", [1, 2])
def test_gathered_gemv_uses_each_slots_expert_and_input_row(device, fmt, x_per_slot):
    experts, rows, k = 5, 24, 256
    data, generator = _matrix(fmt, experts * rows, k, 7 + x_per_slot, device)
    chosen = torch.tensor([3, 0, 3, 4], dtype=torch.int32)
    x = torch.randn(chosen.numel() // x_per_slot, k, generator=generator).to(device)
    acts = quantize_activations(x)  # as the runner passes it: quantized once for several matrices
    got = quant_linear_gemv(acts, data, (experts * rows, k), fmt, block_n=16, experts=chosen.to(device),
                            expert_rows=rows, x_per_slot=x_per_slot)
    weight = codec_for(fmt).decode(data, (experts * rows, k)).view(experts, rows, k)
    lanes = dequantize_activations(acts)[:, :k].double()
    for slot, expert in enumerate(chosen.tolist()):
        expected = (lanes[slot // x_per_slot] @ weight[expert].double().T).float()
        assert _relative(got[slot], expected) < RELATIVE_TOLERANCE, f"slot {slot} (expert {expert})"


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_equals_the_codec(device, fmt):
    n, k = 20, 200  # partial last group and a padded tile
    data, _ = _matrix(fmt, n, k, 3, device)
    expected = codec_for(fmt).decode(data, (n, k))
    assert torch.equal(dequantize(data, (n, k), fmt, dtype=torch.float32), expected)
    scratch = torch.zeros(n * k + 50, dtype=torch.bfloat16, device=device)
    got = dequantize(data, (n, k), fmt, out=scratch).float()
    if device.type == "cuda":  # one round-to-nearest-even from the exact fp32 value
        assert torch.equal(got, expected.to(torch.bfloat16).float())
    else:  # the interpreter truncates fp32 -> bf16: within one bf16 ulp of the exact value
        assert float(((got - expected).abs() / expected.abs().clamp_min(1e-30)).max()) < BF16_ULP
    assert scratch[n * k :].eq(0).all(), "wrote past the matrix"
    rows = torch.tensor([7, 0, 19, 7], dtype=torch.int32, device=device)
    assert torch.equal(dequantize(data, (n, k), fmt, dtype=torch.float32, rows=rows), expected[rows.long()])


def test_gemv_refuses_what_it_does_not_do(device):
    data = codec_for("q4_g64_fp16").encode(torch.randn(8, 64))  # refused before any kernel runs
    with pytest.raises(ValueError, match=r"1\.\.64 tokens"):
        quant_linear_gemv(torch.randn(65, 64), data, (8, 64), "q4_g64_fp16")
    with pytest.raises(ValueError, match="not a groupwise format"):
        quant_linear_gemv(torch.randn(1, 64), codec_for("bf16").encode(torch.randn(8, 64)), (8, 64), "bf16")
    with pytest.raises(ValueError, match="the batch route takes whole matrices, not gathered experts"):
        quant_linear_gemv(torch.randn(1, 64, device=device), codec_for("q4_g64_fp16").encode(torch.randn(16, 64)).to(
            device), (16, 64), "q4_g64_fp16", experts=torch.tensor([1], device=device), expert_rows=8, route="batch")
    with pytest.raises(ValueError, match="unknown GEMV route 'fast'"):
        quant_linear_gemv(torch.randn(1, 64, device=device), data.to(device), (8, 64), "q4_g64_fp16", route="fast")
    with pytest.raises(ValueError, match="x has 32 features, the matrix 64"):
        quant_linear_gemv(torch.randn(1, 32), data, (8, 64), "q4_g64_fp16")


def test_group_pairs_tiles_every_pair_once_with_its_expert(device):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [3, 0]]).to(device)  # 5 tokens, top-2, 4 experts
    tile_experts, tile_pairs = group_pairs(ids, experts=4, block=2)
    flat = ids.reshape(-1).tolist()
    tiles = tile_pairs.view(-1, 2).tolist()
    assert len(tiles) == tile_experts.numel() == 5 + 4  # ⌈10 / 2⌉ + 4 experts
    seen = []
    for expert, tile in zip(tile_experts.tolist(), tiles, strict=True):
        pairs = [p for p in tile if p >= 0]
        if expert == 4:  # past the last used tile: empty
            assert not pairs
        assert all(flat[p] == expert for p in pairs)
        seen += pairs
    assert sorted(seen) == list(range(10))
    assert tile_experts.tolist()[:5] == [0, 0, 1, 2, 3] and tile_experts.tolist()[5:] == [3, 3, 4, 4]


@pytest.mark.parametrize("fmt", ["q4_g64_fp16", "q5_g64_fp16", "q6_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize("x_per_pair", [1, 3])
def test_grouped_product_equals_each_pairs_expert(device, fmt, x_per_pair):
    experts, rows, k, block = 6, 40, 256, 4
    data, generator = _matrix(fmt, experts * rows, k, 11 + x_per_pair, device)
    ids = torch.randint(0, experts, (7 * 3,), generator=generator)  # 21 pairs, uneven per expert
    x = torch.randn(21 // x_per_pair, k, generator=generator).to(device)
    plan = group_pairs(ids.to(device), experts, block)
    got = quant_linear_grouped(x, data, (experts * rows, k), fmt, plan, ids.numel(), rows, x_per_pair, block)
    weight = codec_for(fmt).decode(data, (experts * rows, k)).view(experts, rows, k)
    expected = torch.stack([x[p // x_per_pair].float() @ weight[e].T for p, e in enumerate(ids.tolist())])
    assert _relative(got, expected) < RELATIVE_TOLERANCE


# --- on CUDA only (`pytest -m gpu`): the presets' shapes --------------------------------------------------------------

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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_dequantize_on_cuda_rounds_once(name):
    n, k, fmt = SHAPES[name]
    data = codec_for(fmt).encode(torch.randn(n, k, device="cuda") * 0.02)
    assert torch.equal(dequantize(data, (n, k), fmt), codec_for(fmt).decode(data, (n, k)).to(torch.bfloat16))


@pytest.mark.gpu
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
