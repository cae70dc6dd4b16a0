"""q5 matrices as stripe chunks (`ninfer.kernels.stripe_linear`) on the CPU: the repacking is exact (unpacked, it is
the codec's decode), the tile layout holds the int8 codes of `activation_quant` (read back, the oracle equals the
integer GEMV's oracle on the original bytes), and the kernels that the Triton interpreter runs — the quantizer,
`silu_mul` writing tiles, the one-token GEMV, the dequantizer — against their torch oracles, there and on CUDA.

On CUDA only (`pytest -m gpu`), the `mma` kernel for several tokens: at the 27B's down projection (the matrix the q4
recipe keeps as stripe chunks) and at a shape whose groups do not fill the warps, for T = 1..16 and a 64-token
verify, against the float64 oracle, each token's row the bits of that token alone (verify = decode, batched =
alone), and through `PackedLinear` on every route it takes (tiles, records, and the prefill's dequantize + cuBLAS)."""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.activation_quant import quantize_activations, quantize_activations_reference
from ninfer.kernels.fused import silu_mul
from ninfer.kernels.l2_prefetch import L2Prefetch
from ninfer.kernels.quant_linear import quant_linear_reference
from ninfer.kernels.stripe_linear import (
    FORMAT,
    MIN_K,
    TILE_TOKENS,
    TileActivations,
    dequantize_stripes,
    quantize_tiles,
    repack,
    stripe_gemv,
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


@pytest.mark.gpu
def test_which_matrices_take_stripes_on_cuda():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the stripe kernels need compute capability 8.0")
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


triton = pytest.importorskip("triton")  # the kernels: under the interpreter on the CPU, and on CUDA


@pytest.mark.parametrize("tokens", [1, 5, 8, 11])
def test_quantized_tiles_equal_the_oracles_written_words(device, tokens):
    x = torch.randn(tokens, 1000, device=device)
    got = quantize_tiles(x).tiles
    expected = tile_activations_reference(x).tiles
    mask = _written(expected, tokens)
    assert torch.equal(got[mask], expected[mask])


def test_silu_mul_writes_the_tiles_of_its_result(device):
    gate_up = torch.randn(3, 2 * 1024, device=device)
    made = silu_mul(gate_up, quantize=True, tiles=True)
    assert isinstance(made, TileActivations)
    expected = quantize_tiles(made.source).tiles
    mask = _written(expected, 3)
    assert torch.equal(made.tiles[mask], expected[mask])


@pytest.mark.parametrize("shape", SHAPES)
def test_dequantized_stripes_are_the_codecs_decode(device, shape):
    data = _matrix(shape).to(device)
    assert torch.equal(dequantize_stripes(repack(data, shape), shape, torch.float32),
                       codec_for(FORMAT).decode(data, shape))
    scratch = torch.full((shape[0] * shape[1] + 7,), float("nan"), device=device)
    w = dequantize_stripes(repack(data, shape), shape, torch.float32, out=scratch)
    assert w.data_ptr() == scratch.data_ptr() and torch.equal(w, codec_for(FORMAT).decode(data, shape))


@pytest.mark.parametrize("warps,depth", [(2, 1), (4, 2), (8, 1)])  # 10 groups: warps past the last group
def test_one_token_gemv_matches_the_oracle(device, warps, depth):
    shape = (48, 640)
    chunks = repack(_matrix(shape).to(device), shape)
    tiles = quantize_tiles(torch.randn(1, shape[1], device=device))
    got = stripe_gemv(tiles, chunks, shape, out_dtype=torch.float32, warps=warps, depth=depth)
    expected = stripe_gemv_reference(tiles, chunks, shape)
    assert float((got.double() - expected).norm() / expected.norm()) < 1e-6


def test_the_groups_loaded_ahead_never_change_a_bit(device):
    # 10 groups over 4 warps: 3 steps, so depths 3 and 4 also load groups past a warp's last step
    shape = (32, 640)
    chunks = repack(_matrix(shape).to(device), shape)
    tiles = quantize_tiles(torch.randn(1, shape[1], device=device))
    results = [stripe_gemv(tiles, chunks, shape, out_dtype=torch.float32, warps=4, depth=d) for d in (1, 2, 3, 4)]
    assert all(torch.equal(results[0], r) for r in results[1:])
    expected = stripe_gemv_reference(tiles, chunks, shape)
    assert float((results[0].double() - expected).norm() / expected.norm()) < 1e-6


def test_stripe_gemv_refuses_what_does_not_match(device):
    shape = (48, 640)
    chunks = repack(_matrix(shape).to(device), shape)
    with pytest.raises(ValueError, match="features"):
        stripe_gemv(quantize_tiles(torch.randn(1, 512, device=device)), chunks, shape)
    with pytest.raises(ValueError, match="int32"):
        stripe_gemv(quantize_tiles(torch.randn(1, 640, device=device)), chunks[:2], shape)


# --- on CUDA only (`pytest -m gpu`): the mma kernel at real shapes ----------------------------------------------------

CUDA_SHAPES = {"27b mlp/down": (5120, 17408), "groups past the warps": (48, 8320)}  # 130 groups: 16 warps, 9 turns
BF16_REL = 4e-3  # a bf16 result against float64


def _cuda_matrix(shape):
    torch.manual_seed(0)
    return codec_for(FORMAT).encode(torch.randn(shape, device="cuda") * 0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CUDA_SHAPES))
def test_stripe_gemv_on_cuda_matches_the_oracle_and_a_token_alone(name):
    shape = CUDA_SHAPES[name]
    chunks = repack(_cuda_matrix(shape), shape)
    x = torch.randn(64, shape[1], device="cuda", dtype=torch.bfloat16)
    alone = torch.cat([stripe_gemv(quantize_tiles(x[t : t + 1]), chunks, shape) for t in range(64)])
    for tokens in [*range(1, 17), 64]:
        tiles = quantize_tiles(x[:tokens])
        got = stripe_gemv(tiles, chunks, shape)
        expected = stripe_gemv_reference(tiles, chunks, shape)
        assert float((got.double() - expected).norm() / expected.norm()) < BF16_REL, tokens
        assert torch.equal(got, alone[:tokens]), f"T = {tokens}: a token's bits depend on the others"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 13])
def test_the_groups_loaded_ahead_never_change_a_bit_on_cuda(tokens):
    shape = CUDA_SHAPES["groups past the warps"]
    chunks = repack(_cuda_matrix(shape), shape)
    tiles = quantize_tiles(torch.randn(tokens, shape[1], device="cuda", dtype=torch.bfloat16))
    results = [stripe_gemv(tiles, chunks, shape, depth=depth) for depth in (1, 2, 3, 4)]
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.gpu
def test_stripe_gemv_writes_into_columns_of_a_wider_buffer():
    shape = CUDA_SHAPES["groups past the warps"]
    chunks = repack(_cuda_matrix(shape), shape)
    tiles = quantize_tiles(torch.randn(5, shape[1], device="cuda"))
    wide = torch.zeros(5, shape[0] + 32, device="cuda")
    stripe_gemv(tiles, chunks, shape, out=wide[:, 16 : 16 + shape[0]])
    assert torch.equal(wide[:, 16 : 16 + shape[0]], stripe_gemv(tiles, chunks, shape, out_dtype=torch.float32))
    assert not wide[:, :16].any() and not wide[:, 16 + shape[0] :].any()


@pytest.mark.gpu
def test_dequantized_stripes_on_cuda_round_once():
    shape = CUDA_SHAPES["27b mlp/down"]
    data = _cuda_matrix(shape)
    chunks = repack(data, shape)
    assert torch.equal(unpack_reference(chunks, shape), codec_for(FORMAT).decode(data, shape))
    assert torch.equal(dequantize_stripes(chunks, shape), codec_for(FORMAT).decode(data, shape).bfloat16())


@pytest.mark.gpu
def test_silu_mul_tiles_on_cuda_are_the_quantizers():
    gate_up = torch.randn(11, 2 * 17408, device="cuda", dtype=torch.bfloat16)
    made = silu_mul(gate_up, quantize=True, tiles=True)
    shape = CUDA_SHAPES["27b mlp/down"]
    chunks = repack(_cuda_matrix(shape), shape)
    assert torch.equal(stripe_gemv(made, chunks, shape), stripe_gemv(quantize_tiles(made.source), chunks, shape))


@pytest.mark.gpu
def test_packed_linear_keeps_the_down_projection_as_stripes_on_every_route():
    from ninfer.model.packed_linear import PackedLinear, Scratch

    shape = CUDA_SHAPES["27b mlp/down"]
    data = _cuda_matrix(shape)
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
