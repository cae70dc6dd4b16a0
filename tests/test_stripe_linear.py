"""q5 matrices as stripe chunks (`ninfer.kernels.stripe_linear`) on the CPU: the repacking is exact (unpacked, it is
the codec's decode), the tile layout holds the int8 codes of `activation_quant` (read back, the oracle equals the
integer GEMV's oracle on the original bytes), and the kernels that the Triton interpreter runs — the quantizer,
`silu_mul` writing tiles, the one-token GEMV, the dequantizer — against their torch oracles. The `mma` kernel for
several tokens needs a GPU (tests/test_stripe_linear_gpu.py)."""

from __future__ import annotations

import os

import pytest
import torch

from ninfer.kernels.l2_prefetch import L2Prefetch
from ninfer.kernels.quant_linear import quant_linear_reference
from ninfer.kernels.stripe_linear import (
    FORMAT,
    MIN_K,
    TILE_TOKENS,
    TileActivations,
    repack,
    stripe_gemv_reference,
    stripes_fit,
    tile_activations_reference,
    unpack_reference,
)
from ninfer.quant import codec_for

SHAPES = [(16, 128), (48, 640), (32, 1000)]  # one stripe; 10 groups; K padded to 1,024 lanes


def _matrix(shape, seed=0):
    torch.manual_seed(seed)
    return codec_for(FORMAT).encode(torch.randn(*shape) * 0.02)


@pytest.mark.parametrize("shape", SHAPES)
def test_repacked_chunks_unpack_to_the_codecs_decode_exactly(shape):
    data = _matrix(shape)
    for rows_at_once in (16, 1024):
        assert torch.equal(unpack_reference(repack(data, shape, rows_at_once), shape),
                           codec_for(FORMAT).decode(data, shape))


def test_repack_refuses_rows_that_are_not_whole_stripes():
    with pytest.raises(ValueError, match="multiple of 16"):
        repack(_matrix((24, 128)), (24, 128))


@pytest.mark.parametrize("tokens", [1, 8, 11])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_oracle_over_tiles_is_the_integer_gemvs_oracle(shape, tokens):
    data = _matrix(shape)
    x = torch.randn(tokens, shape[1])
    got = stripe_gemv_reference(tile_activations_reference(x), repack(data, shape), shape)
    expected = quant_linear_reference(x, data, shape, FORMAT, int8_activations=True).double()
    assert got.shape == (tokens, shape[0])
    assert float((got - expected).norm() / expected.norm()) < 1e-6


def test_the_oracle_reads_only_the_tokens_it_is_given():
    """Tokens past T in the last tile are never written by the kernels: garbage there changes no result."""
    shape = (32, 256)
    data = _matrix(shape)
    x = torch.randn(3, shape[1])
    tiles = tile_activations_reference(x)
    dirty = tiles.tiles.clone()
    quads = dirty[..., :128].view(-1, dirty.shape[1], 8, 16)
    quads[:, :, 3:] = 0x7F7F7F7F  # tokens 3..7: their quads and (below) their scales
    dirty[..., 128:].view(-1, dirty.shape[1], 4, 2, 2)[:, :, 1:] = 0x7F800000  # tokens 2t + k, t ≥ 1 (one +inf)
    dirty[..., 128:].view(-1, dirty.shape[1], 4, 2, 2)[:, :, 1, :, 0] = tiles.tiles[..., 128:].view(
        -1, dirty.shape[1], 4, 2, 2)[:, :, 1, :, 0]  # token 2 is live
    chunks = repack(data, shape)
    assert torch.equal(stripe_gemv_reference(TileActivations(x, dirty), chunks, shape),
                       stripe_gemv_reference(tiles, chunks, shape))


def _written(tiles: torch.Tensor, tokens: int) -> torch.Tensor:
    """A mask of the words of `tiles` that belong to tokens < `tokens`."""
    mask = torch.zeros_like(tiles, dtype=torch.bool)
    for token in range(tokens):
        tile, g = divmod(token, TILE_TOKENS)
        mask[tile, :, 16 * g : 16 * g + 16] = True
        for block in range(2):
            mask[tile, :, 128 + 4 * (g // 2) + 2 * block + g % 2] = True
    return mask


def test_tiles_hold_each_tokens_record_codes_and_scales():
    """Word by word against the records (`activation_quant`'s layout): the quads and scales move, unchanged."""
    from ninfer.kernels.activation_quant import quantize_activations_reference

    x = torch.randn(10, 256)
    records = quantize_activations_reference(x).blocks  # [T, 8, 12]
    tiles = tile_activations_reference(x).tiles  # [2, 4, 144]
    for token, j, block, t, parity in [(0, 0, 0, 0, 0), (9, 3, 1, 3, 1), (5, 2, 0, 1, 1), (8, 1, 1, 2, 0)]:
        tile, g = divmod(token, 8)
        assert tiles[tile, j, 4 * (4 * g + t) + 2 * block + parity] == records[token, 2 * j + block, 4 * parity + t]
        assert tiles[tile, j, 128 + 4 * (g // 2) + 2 * block + g % 2] == records[token, 2 * j + block, 8]


def test_which_matrices_take_stripes():
    cpu = torch.device("cpu")
    assert not stripes_fit((5120, 17408), FORMAT, cpu)  # the GPU kernels only
    assert not stripes_fit((5120, 17408), "q4_g64_fp16", cpu)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0):
        cuda = torch.device("cuda")
        assert stripes_fit((5120, 17408), FORMAT, cuda)
        assert not stripes_fit((5120, MIN_K - 128), FORMAT, cuda)
        assert not stripes_fit((5128, 17408), FORMAT, cuda)


def test_l2_prefetch_of_stripe_chunks_covers_the_first_rows_in_order():
    shape = (64, 1024)
    chunks = repack(_matrix(shape), shape)
    prefetch = L2Prefetch([(chunks, shape, FORMAT)], budget=chunks.numel() * 4 // 4)  # a quarter: 16 rows
    assert prefetch.ranges.tolist() == [[chunks.data_ptr() // 128 * 128,
                                         -(-(chunks.data_ptr() % 128 + 16 * 16 * 42) // 128) * 128]]


triton = pytest.importorskip("triton")
# the kernels: under the interpreter on the CPU (conftest), on CUDA where the GPU runs them
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


@pytest.mark.parametrize("tokens", [1, 5, 8, 11])
def test_quantized_tiles_equal_the_oracles_written_words(tokens):
    from ninfer.kernels.stripe_linear import quantize_tiles

    x = torch.randn(tokens, 1000, device=DEVICE)
    got = quantize_tiles(x).tiles
    expected = tile_activations_reference(x).tiles
    mask = _written(expected, tokens)
    assert torch.equal(got[mask], expected[mask])


def test_silu_mul_writes_the_tiles_of_its_result():
    from ninfer.kernels.fused import silu_mul
    from ninfer.kernels.stripe_linear import quantize_tiles

    gate_up = torch.randn(3, 2 * 1024, device=DEVICE)
    made = silu_mul(gate_up, quantize=True, tiles=True)
    assert isinstance(made, TileActivations)
    expected = quantize_tiles(made.source).tiles
    mask = _written(expected, 3)
    assert torch.equal(made.tiles[mask], expected[mask])


@pytest.mark.parametrize("shape", SHAPES)
def test_dequantized_stripes_are_the_codecs_decode(shape):
    from ninfer.kernels.stripe_linear import dequantize_stripes

    data = _matrix(shape).to(DEVICE)
    assert torch.equal(dequantize_stripes(repack(data, shape), shape, torch.float32),
                       codec_for(FORMAT).decode(data, shape))
    scratch = torch.full((shape[0] * shape[1] + 7,), float("nan"), device=DEVICE)
    w = dequantize_stripes(repack(data, shape), shape, torch.float32, out=scratch)
    assert w.data_ptr() == scratch.data_ptr() and torch.equal(w, codec_for(FORMAT).decode(data, shape))


@pytest.mark.parametrize("warps,depth", [(2, 1), (4, 2), (8, 1)])  # 10 groups: warps past the last group
def test_one_token_gemv_matches_the_oracle(warps, depth):
    from ninfer.kernels.stripe_linear import quantize_tiles, stripe_gemv

    shape = (48, 640)
    chunks = repack(_matrix(shape).to(DEVICE), shape)
    tiles = quantize_tiles(torch.randn(1, shape[1], device=DEVICE))
    got = stripe_gemv(tiles, chunks, shape, out_dtype=torch.float32, warps=warps, depth=depth)
    expected = stripe_gemv_reference(tiles, chunks, shape)
    assert float((got.double() - expected).norm() / expected.norm()) < 1e-6


def test_the_groups_loaded_ahead_never_change_a_bit():
    # 10 groups over 4 warps: 3 steps, so depths 3 and 4 also load groups past a warp's last step
    from ninfer.kernels.stripe_linear import quantize_tiles, stripe_gemv

    shape = (32, 640)
    chunks = repack(_matrix(shape).to(DEVICE), shape)
    tiles = quantize_tiles(torch.randn(1, shape[1], device=DEVICE))
    results = [stripe_gemv(tiles, chunks, shape, out_dtype=torch.float32, warps=4, depth=d) for d in (1, 2, 3, 4)]
    assert all(torch.equal(results[0], r) for r in results[1:])
    expected = stripe_gemv_reference(tiles, chunks, shape)
    assert float((results[0].double() - expected).norm() / expected.norm()) < 1e-6


def test_stripe_gemv_refuses_what_does_not_match():
    from ninfer.kernels.stripe_linear import quantize_tiles, stripe_gemv

    shape = (48, 640)
    chunks = repack(_matrix(shape).to(DEVICE), shape)
    with pytest.raises(ValueError, match="features"):
        stripe_gemv(quantize_tiles(torch.randn(1, 512, device=DEVICE)), chunks, shape)
    with pytest.raises(ValueError, match="int32"):
        stripe_gemv(quantize_tiles(torch.randn(1, 640, device=DEVICE)), chunks[:2], shape)
