"""q5 matrices repacked at load into stripe chunks, and the integer GEMV over them for decode and verify steps.

Why: the batch route of `quant_linear` unpacks a weight tile once for up to 8 tokens, but each lane gathers the
tokens' int8 records from 8 places, and at 8 tokens the 27B's down projection took twice its one-token time.
Here both sides are stored in the order the int8 tensor cores consume them (Marlin's method: repack the weights at
load so that a warp's `mma` operands are one contiguous load), and the activations are written by the kernel that
makes them (`fused.silu_mul`) in the matching tile layout. At 8 tokens a matrix then costs about what one token
costs.

Chunk (stripe s = rows 16s..16s + 15, group j = lanes 64j..64j + 63 of the padded K): CHUNK_WORDS (168) int32,
with g = 0..7 a row of the stripe's halves and t = 0..3 a unit (8 lanes) of a 32-lane block:
  * words 4 · (4g + t) + 2 · block + half: the nibbles (the low 4 bits of the two's complement 5-bit codes) of lanes
    32 · block + 8t + 0..7 of row 16s + 8 · half + g, lane 8t + i in bits 4i..4i + 3;
  * word 128 + 4g + t: the fifth bits of those four words' 32 lanes: lane i of word w (w = 2 · block + half) in
    bit 8 · (i // 2) + 7 − (2w + i % 2), so that `(word << q) & 0x80808080` puts the fifth bits of quad
    q = 2w + parity (parity = i % 2: the even or odd lanes of the unit) in its bytes' sign bits;
  * word 160 + g: the fp16 scales of rows 16s + g (low half) and 16s + 8 + g of group j.
A quad (4 lanes as int8) is then the code times 8: nibble in bits 3..6, fifth bit as the sign.

x tiles (`TileActivations`, tokens 8τ..8τ + 7): the codes and scales of `activation_quant` (the same codes, bit
for bit, from `block_quads`) as TILE_WORDS (144) int32 per group j:
  * words 4 · (4g + t) + 2 · block + parity: token 8τ + g's even (parity 0) or odd (1) quad of unit t of block
    2j + block (its record's word 4 · parity + t);
  * word 128 + 4t + 2 · block + k: the scale of token 8τ + 2t + k in block 2j + block.
Tokens past T in the last tile are not written (their products are computed and never stored).

Kernels (CUDA, sm_80 and newer: `mma.sync.m16n8k32` int8 and `dp4a` as inline PTX):
  * `_stripe_kernel`, for T ≥ 2: program (stripe, tile of 8 tokens); warp w of WARPS takes groups w, w + WARPS, …
    (its turns loaded DEPTH groups ahead into registers; both from `tuning.StripeTuning`); per 32-lane block one
    `mma` gives the exact integer dots D of 16 rows × 8 tokens, and acc += D · (weight scale · x scale) in fp32,
    block 0 then block 1 of each group; the warps' sums meet in one reduction across warps; out in x's dtype;
  * `_stripe_kernel` with ONE_TOKEN (T = 1): the same loads and the same float steps with `dp4a` — a lane's dots
    over its unit, reduce-scattered across the row's four lanes (exact integers, 4 shuffles a group) so that a lane
    holds both blocks' D of one row — so that a token's result has the same bits at any T (verify = decode,
    batched = alone, as on every route of the fast path);
  * `_dequantize_stripes_kernel`: the chunks back into W `[N, K]` in the activation dtype (prefill: then cuBLAS),
    rounded once from code · scale in fp32 as `GroupwiseCodec.decode`;
  * `_quantize_tiles_kernel` / `store_tiles`: x → its tiles (inside `silu_mul` for the MLP's down projection).
`repack`, `unpack_reference`, `tile_activations_reference` and `stripe_gemv_reference` are the torch side (any
device); the one-token kernel, the dequantizer and the quantizer also run under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ninfer import flags
from ninfer.kernels import tuning
from ninfer.kernels.activation_quant import padded_lanes, quantize_activations_reference
from ninfer.kernels.dependent_launch import launch_options, wait_for_inputs
from ninfer.quant import codec_for

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl

    from ninfer.kernels.activation_quant import block_quads
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

FORMAT = "q5_g64_fp16"
GROUP = 64  # lanes of a chunk (the format's scale group)
STRIPE_ROWS = 16  # rows of a chunk (an `mma`'s A rows)
TILE_TOKENS = 8  # tokens of an x tile (an `mma`'s B columns)
CHUNK_WORDS = 168
TILE_WORDS = 144
# rows at least this long take the layout: at K = 17,408 (the 27B's down projection) the one-token kernel keeps up
# with the batch route and 8 tokens cost about one token's time; at K = 5,120 one token falls behind the batch route
MIN_K = 8192


def stripes_fit(shape: tuple[int, int], fmt: str, device: torch.device) -> bool:
    """Whether a matrix of `shape` in `fmt` on `device` is kept as stripe chunks: q5, rows a multiple of 16, K ≥
    MIN_K, on a CUDA GPU of compute capability 8.0 or newer (int8 `mma`) with Triton, and not switched off with
    NINFER_STRIPES=0."""
    device = torch.device(device)
    if fmt != FORMAT or shape[0] % STRIPE_ROWS or shape[1] < MIN_K or not flags.STRIPES.get():
        return False
    if triton is None or device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _groups(k: int) -> int:
    return padded_lanes(k) // GROUP


def repack(data: torch.Tensor, shape: tuple[int, int], rows_at_once: int = 1024) -> torch.Tensor:
    """q5 bytes of W `[N, K]` (N a multiple of 16) → its chunks `[N / 16, groups, 168]` int32 on data's device (the
    module docstring), the same size as the bytes. Temporaries: the matrix's int16 codes (2 bytes a weight: 178 MB
    for the 27B's down projection) and about 150 MB for each `rows_at_once` rows of them at that width."""
    n = shape[0]
    if n % STRIPE_ROWS:
        raise ValueError(f"stripe chunks need a multiple of {STRIPE_ROWS} rows, got {n}")
    codes, scales = codec_for(FORMAT).codes_and_scales(data, shape)  # [N, groups, 64] int16, [N, groups] fp16
    groups = codes.shape[1]
    chunks = torch.empty((n // STRIPE_ROWS, groups, CHUNK_WORDS), dtype=torch.int32, device=data.device)
    lane = torch.arange(8, device=data.device)
    nibble_shift = 4 * lane  # lane i of a unit in bits 4i..4i + 3 of its word
    word = torch.arange(4, device=data.device)[:, None]  # w = 2 · block + half
    high_shift = 8 * (lane // 2) + 7 - (2 * word + lane % 2)  # [w, i]
    for first in range(0, n, rows_at_once):
        stripes = slice(first // STRIPE_ROWS, (first + rows_at_once) // STRIPE_ROWS)
        u = codes[first : first + rows_at_once].to(torch.int32) & 31
        s = u.shape[0] // STRIPE_ROWS
        # [stripe, half, g, group, block, t, i] → [stripe, group, g, t, block, half, i]
        u = u.view(s, 2, 8, groups, 2, 4, 8).permute(0, 3, 2, 5, 4, 1, 6)
        nibbles = ((u & 15) << nibble_shift).sum(-1, dtype=torch.int64)  # [s, j, g, t, block, half]
        chunks[stripes, :, :128] = _as_int32(nibbles.reshape(s, groups, 128))
        fifth = (u >> 4).reshape(s, groups, 8, 4, 4, 8)  # [s, j, g, t, w, i]
        chunks[stripes, :, 128:160] = _as_int32((fifth << high_shift).sum((-2, -1), dtype=torch.int64)
                                                .reshape(s, groups, 32))
        sc = scales[first : first + rows_at_once].view(torch.int16).to(torch.int32) & 0xFFFF
        sc = sc.view(s, 2, 8, groups).permute(0, 3, 2, 1)  # [s, j, g, half]
        chunks[stripes, :, 160:] = _as_int32(sc[..., 0].to(torch.int64) | (sc[..., 1].to(torch.int64) << 16))
    return chunks


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 → the int32 with those bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_reference(chunks: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The chunks back into W `[N, K]` fp32 (code · scale), in torch: the oracle of `_dequantize_stripes_kernel` and
    of the repacking (equal to `codec_for(FORMAT).decode` of the bytes)."""
    n, k = shape
    stripes, groups, _ = chunks.shape
    lane = torch.arange(8, device=chunks.device)
    words = chunks[..., :128].view(stripes, groups, 8, 4, 4).to(torch.int64) & 0xFFFFFFFF  # [s, j, g, t, w]
    nibbles = (words[..., None] >> (4 * lane)) & 15  # [s, j, g, t, w, i]
    w = torch.arange(4, device=chunks.device)[:, None]
    high = chunks[..., 128:160].view(stripes, groups, 8, 4).to(torch.int64) & 0xFFFFFFFF
    fifth = (high[..., None, None] >> (8 * (lane // 2) + 7 - (2 * w + lane % 2))) & 1  # [s, j, g, t, w, i]
    codes = (nibbles - 16 * fifth).view(stripes, groups, 8, 4, 2, 2, 8)  # [s, j, g, t, block, half, i]
    codes = codes.permute(0, 5, 2, 1, 4, 3, 6).reshape(n, groups * GROUP)  # rows 16s + 8 · half + g
    scales = chunks[..., 160:].contiguous().view(torch.float16).view(stripes, groups, 8, 2).float()
    scales = scales.permute(0, 3, 2, 1).reshape(n, groups)  # [s, half, g, j]
    return (codes.float().view(n, groups, GROUP) * scales[..., None]).view(n, -1)[:, :k]


class TileActivations(NamedTuple):
    """x's int8 image in the tile layout (module docstring): what the stripe GEMV reads."""

    source: torch.Tensor  # x itself `[T, K]`, for the routes that do not take int8 activations
    tiles: torch.Tensor  # [ceil(T / 8), groups, 144] int32

    @property
    def shape(self) -> torch.Size:
        return self.source.shape


def empty_tiles(tokens: int, k: int, device: torch.device) -> torch.Tensor:
    """Uninitialised tiles for `tokens` inputs of `k` lanes, for the kernels that write them."""
    return torch.empty((-(-tokens // TILE_TOKENS), _groups(k), TILE_WORDS), dtype=torch.int32, device=device)


def tile_activations_reference(x: torch.Tensor) -> TileActivations:
    """x `[T, K]` → its tiles in torch (any device; tokens past T zero): the oracle of `quantize_tiles`."""
    tokens = x.shape[0]
    blocks = quantize_activations_reference(x).blocks  # [T, 2 · groups, 12]
    groups = blocks.shape[1] // 2
    padded = -(-tokens // TILE_TOKENS) * TILE_TOKENS
    rec = torch.zeros((padded, 2 * groups, 12), dtype=torch.int32, device=x.device)
    rec[:tokens] = blocks
    rec = rec.view(-1, 8, groups, 2, 12)  # [tile, g, j, block, word]
    quads = rec[..., :8].reshape(-1, 8, groups, 2, 2, 4)  # [tile, g, j, block, parity, t]
    quads = quads.permute(0, 2, 1, 5, 3, 4).reshape(-1, groups, 128)  # [tile, j, (g, t, block, parity)]
    scales = rec[..., 8].view(-1, 4, 2, groups, 2)  # [tile, t, k, j, block]: token 2t + k
    scales = scales.permute(0, 3, 1, 4, 2).reshape(-1, groups, 16)  # [tile, j, (t, block, k)]
    return TileActivations(x, torch.cat((quads, scales), -1).contiguous())


def stripe_gemv_reference(x: TileActivations, chunks: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The products the stripe GEMV computes, in float64 `[T, N]`: x's int8 image read back from its tiles (codes
    times scales) times the unpacked W — the oracle of `stripe_gemv`."""
    tokens, k = x.shape
    count, groups, _ = x.tiles.shape
    quads = x.tiles[..., :128].reshape(count, groups, 8, 4, 2, 2).to(torch.int64)  # [τ, j, g, t, block, parity]
    shifts = 8 * torch.arange(4, device=x.tiles.device)
    codes = ((quads[..., None] >> shifts) & 0xFF).to(torch.uint8).view(torch.int8)  # [..., byte k]: lane 2k + parity
    codes = codes.permute(0, 2, 1, 4, 3, 6, 5).reshape(count * 8, 2 * groups, 32)  # [token, block, 8t + 2k + parity]
    scales = x.tiles[..., 128:].contiguous().view(torch.float32).view(count, groups, 4, 2, 2)  # [τ, j, t, block, kk]
    scales = scales.permute(0, 2, 4, 1, 3).reshape(count * 8, 2 * groups)  # token 2t + kk, block 2j + block
    lanes = (codes.double() * scales.double()[..., None]).view(count * 8, -1)[:tokens, :k]
    return lanes @ unpack_reference(chunks, shape).double().T


if triton is not None:
    ASM = tl.constexpr(not flags.triton_interpreted())

    @triton.jit
    def store_tiles(x, tiles_ptr, row, blocks, block_count):
        """Quantize x `[BLOCKS, 32]` fp32 (the lanes of 32-lane blocks `blocks` of input row `row`) and store them
        in the tile layout at `tiles_ptr` (`[tiles, block_count / 2, 144]`); blocks ≥ `block_count` are not
        stored. The codes of `block_quads`, as every int8 activation layout."""
        even, odd, scale, _ = block_quads(x)
        g = row % 8
        group = tiles_ptr + ((row // 8) * (block_count // 2) + blocks // 2) * 144  # [BLOCKS]
        in_group = 2 * (blocks % 2)  # the block's words among its group's
        quad = group[:, None] + (4 * g + tl.arange(0, 4)[None, :]) * 4 + in_group[:, None]
        ok = blocks < block_count
        tl.store(quad, even, mask=ok[:, None])
        tl.store(quad + 1, odd, mask=ok[:, None])
        tl.store(group + 128 + 4 * (g // 2) + in_group + g % 2, scale.to(tl.int32, bitcast=True), mask=ok)

    @triton.jit
    def store_tile_x(y, tiles_ptr, row, block_count, LANES: tl.constexpr):
        """The tiles of y, lanes [program_id(1) · LANES, (program_id(1) + 1) · LANES) of row `row` (LANES a
        multiple of 32): for the kernels that quantize the output tile they have just made (`fused.silu_mul`)."""
        blocks = tl.program_id(1) * (LANES // 32) + tl.arange(0, LANES // 32)
        store_tiles(tl.reshape(y.to(tl.float32), [LANES // 32, 32]), tiles_ptr, row, blocks, block_count)

    @triton.jit
    def _quantize_tiles_kernel(x_ptr, tiles_ptr, K, block_count, stride_x, BLOCKS: tl.constexpr, PDL: tl.constexpr):
        wait_for_inputs(PDL)
        row = tl.program_id(0)
        blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
        lane = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + lane, mask=lane < K, other=0.0).to(tl.float32)
        store_tiles(x, tiles_ptr, row, blocks, block_count)

    @triton.jit
    def _mma(a0, a1, a2, a3, b0, b1):
        """One int8 `mma.sync.m16n8k32` (one element a lane), C started at 0x4B400000 (the bits of 1.5 · 2^23): lane
        4g + t gives A rows g, g + 8 (a0, a1: k 4t..4t + 3; a2, a3: k 16 + 4t..) and B column g (b0, b1 the same
        k); the results are the float bits of 1.5 · 2^23 + D at (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)
        (|D| < 2^22: 32 · 127 · 128)."""
        return tl.inline_asm_elementwise(
            "{ .reg .b32 m; mov.b32 m, 0x4B400000; mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {$0, $1, $2, $3}, "
            "{$4, $5, $6, $7}, {$8, $9}, {m, m, m, m}; }",
            "=r,=r,=r,=r,r,r,r,r,r,r", [a0, a1, a2, a3, b0, b1],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)

    @triton.jit
    def _dp4a(a, b, c):
        """c + Σ_i int8 byte_i(a) · int8 byte_i(b): one `dp4a` a lane on the GPU, integer ops under the
        interpreter."""
        if ASM:
            r = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                          is_pure=True, pack=1)
        else:
            r = (c + ((a << 24) >> 24) * ((b << 24) >> 24) + ((a << 16) >> 24) * ((b << 16) >> 24)
                 + ((a << 8) >> 24) * ((b << 8) >> 24) + (a >> 24) * (b >> 24))
        return r

    @triton.jit
    def _lane_xor(v, MASK: tl.constexpr, WARPS: tl.constexpr):
        """v `[WARPS, 32]` int32 with lane l given lane l ^ MASK's value (MASK 1 or 2): one `shfl.sync.bfly` on the
        GPU (the tensor's element (w, l) lives in lane l of warp w), a flip of pairs under the interpreter."""
        if ASM:
            r = tl.inline_asm_elementwise(f"shfl.sync.bfly.b32 $0, $1, {MASK}, 0x1f, 0xffffffff;", "=r,r", [v],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            r = tl.reshape(tl.flip(tl.reshape(v, [WARPS, 32 // (2 * MASK), 2, MASK]), 2), [WARPS, 32])
        return r

    @triton.jit
    def _scatter_sum(v0, v1, v2, v3, t, WARPS: tl.constexpr):
        """Four int32 values a lane `[WARPS, 32]` → in lane 4g + t, the sum of value t over lanes 4g..4g + 3
        (exact): a reduce-scatter in two exchanges, 3 shuffles where summing each value in every lane takes 8. With
        xor 2 a lane keeps the pair of values that bit 1 of t picks and sends the other pair; with xor 1 it keeps
        the value bit 0 picks."""
        high = (t & 2) != 0
        kept_a = tl.where(high, v2, v0) + _lane_xor(tl.where(high, v0, v2), 2, WARPS)
        kept_b = tl.where(high, v3, v1) + _lane_xor(tl.where(high, v1, v3), 2, WARPS)
        odd = (t & 1) != 0
        return tl.where(odd, kept_b, kept_a) + _lane_xor(tl.where(odd, kept_a, kept_b), 1, WARPS)

    @triton.jit
    def _vector(at, COHERENT: tl.constexpr = False):
        """Four 32-bit words a lane from one 16-byte load at `at` (read-only data; inline PTX: `tl.load` of
        contiguous lanes is vectorized in a layout that costs shared-memory conversions in the loop). COHERENT
        drops `.nc`: ptxas then keeps the load ahead of a PDL wait that follows it in the source."""
        if ASM:
            r = tl.inline_asm_elementwise(("ld.global" if COHERENT else "ld.global.nc")
                                          + ".v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [at],
                                          dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1)
        else:
            r = tl.load(at), tl.load(at + 1), tl.load(at + 2), tl.load(at + 3)
        return r

    @triton.jit
    def _word(at, COHERENT: tl.constexpr = False):
        """One 32-bit word a lane, read-only, in place (COHERENT as `_vector`'s)."""
        if ASM:
            r = tl.inline_asm_elementwise(("ld.global" if COHERENT else "ld.global.nc") + ".b32 $0, [$1];", "=r,l",
                                          [at], dtype=tl.int32, is_pure=False, pack=1)
        else:
            r = tl.load(at)
        return r

    @triton.jit
    def _group_at(step, warp, steps, groups, WARPS: tl.constexpr):
        """Warp `warp`'s group at `step` (past its last step or the last group: a group it has, read again and not
        counted) and whether it counts."""
        j = tl.minimum(tl.minimum(step, steps - 1) * WARPS + warp, groups - 1)
        return j, step * WARPS + warp < groups

    @triton.jit
    def _load_weights(chunk, lane, g, j, COHERENT: tl.constexpr = False):
        """Group j's weight operands for lane 4g + t: its four base words (one 16-byte load), fifth bits, scales."""
        at = chunk + j * 168
        w0, w1, w2, w3 = _vector(at + lane * 4, COHERENT)
        return w0, w1, w2, w3, _word(at + 128 + lane, COHERENT), _word(at + 160 + g, COHERENT)

    @triton.jit
    def _quads(w, high, Q: tl.constexpr):
        """Even (Q even) or odd lanes of a base word as code · 8 int8 quads, their fifth bits from `high`."""
        nibbles = ((w << 3) if Q % 2 == 0 else (w >> 1)) & 0x78787878
        return nibbles | ((high << Q) & -0x7F7F7F80)  # 0x80808080

    @triton.jit
    def _weight_scales(scale, counts):
        """The fp16 scales of rows g (low half) and g + 8 of a chunk's scale word times the quads' 1/8 (exact);
        0 where the group does not count."""
        ws_g = (scale & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 0.125
        ws_h = (scale >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 0.125
        return tl.where(counts, ws_g, 0.0), tl.where(counts, ws_h, 0.0)

    @triton.jit
    def _dot(d):
        """An `mma` result's float bits of 1.5 · 2^23 + D → D (exact)."""
        return d.to(tl.float32, bitcast=True) - 12582912.0

    @triton.jit
    def _tile_block(acc, w_g, w_h, high, x_even, x_odd, x_scales, ws_g, ws_h, B: tl.constexpr):
        """acc (rows g, g + 8 × tokens 2t, 2t + 1) += block B of a group: one `mma` on the block's quads (w_g, w_h:
        the base words of rows g, g + 8), then D · (w scale · x scale) (x_scales: tokens 2t, 2t + 1)."""
        acc0, acc1, acc2, acc3 = acc
        d0, d1, d2, d3 = _mma(_quads(w_g, high, 4 * B), _quads(w_h, high, 4 * B + 2), _quads(w_g, high, 4 * B + 1),
                              _quads(w_h, high, 4 * B + 3), x_even, x_odd)
        s0 = x_scales[0].to(tl.float32, bitcast=True)
        s1 = x_scales[1].to(tl.float32, bitcast=True)
        acc0 += _dot(d0) * (ws_g * s0)
        acc1 += _dot(d1) * (ws_g * s1)
        acc2 += _dot(d2) * (ws_h * s0)
        acc3 += _dot(d3) * (ws_h * s1)
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _tile_group(acc, weights, x, counts):
        """acc (rows g, g + 8 × tokens 2t, 2t + 1) += one group, block 0 then block 1."""
        w0, w1, w2, w3, high, scale = weights
        b0, b1, c0, c1, s0, s1, r0, r1 = x
        ws_g, ws_h = _weight_scales(scale, counts)
        acc = _tile_block(acc, w0, w1, high, b0, b1, (s0, s1), ws_g, ws_h, 0)
        return _tile_block(acc, w2, w3, high, c0, c1, (r0, r1), ws_g, ws_h, 1)

    @triton.jit
    def _unit_dot(w, high, Q: tl.constexpr, x_even, x_odd):
        """A lane's dot of one base word's 8 lanes (quads Q, Q + 1) with its unit's x quads: two `dp4a`."""
        return _dp4a(_quads(w, high, Q + 1), x_odd, _dp4a(_quads(w, high, Q), x_even, 0))

    @triton.jit
    def _one_token_group(acc, weights, x, counts, t, WARPS: tl.constexpr):
        """acc += one group for one token, the float steps of `_tile_group`'s token column 0: a lane's dots over its
        unit (rows g, g + 8 × blocks 0, 1) reduce-scattered so that lane 4g + t holds the whole block's D of (row
        g + 8 · (t % 2), block t // 2) (`_scatter_sum`), and the other block's D of that row from lane t ^ 2; then
        D₀ · (w scale · x scale₀), then D₁ · (w scale · x scale₁)."""
        w0, w1, w2, w3, high, scale = weights
        b0, b1, c0, c1, s0, r0 = x
        d = _scatter_sum(_unit_dot(w0, high, 0, b0, b1), _unit_dot(w1, high, 2, b0, b1),
                         _unit_dot(w2, high, 4, c0, c1), _unit_dot(w3, high, 6, c0, c1), t, WARPS)
        other = _lane_xor(d, 2, WARPS)
        second = (t & 2) != 0
        d0 = tl.where(second, other, d).to(tl.float32)
        d1 = tl.where(second, d, other).to(tl.float32)
        ws = ((scale >> (16 * (t % 2))) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 0.125
        ws = tl.where(counts, ws, 0.0)
        acc += d0 * (ws * s0.to(tl.float32, bitcast=True))
        return acc + d1 * (ws * r0.to(tl.float32, bitcast=True))

    @triton.jit
    def _x_operands(x, lane, t, j, ONE_TOKEN: tl.constexpr):
        """Group j's x operands for lane 4g + t. Tiles of 8: token g's quads (one 16-byte load) and the scales of
        tokens 2t, 2t + 1 in blocks 0 and 1 (another). One token: token 0's quads of unit t (the same load for the
        8 rows), and its scales in blocks 0 and 1 (words 128 and 130)."""
        if ONE_TOKEN:
            b0, b1, c0, c1 = _vector(x + j * 144 + t * 4)
            s0, _, r0, _ = _vector(x + j * 144 + 128 + 0 * t)
            operands = (b0, b1, c0, c1, s0, r0)
        else:
            b0, b1, c0, c1 = _vector(x + j * 144 + lane * 4)
            s0, s1, r0, r1 = _vector(x + j * 144 + 128 + t * 4)
            operands = (b0, b1, c0, c1, s0, s1, r0, r1)
        return operands

    @triton.jit
    def _group(acc, weights, x, counts, t, WARPS: tl.constexpr, ONE_TOKEN: tl.constexpr):
        """acc += one group: `_one_token_group` into acc's first sum, or `_tile_group`."""
        if ONE_TOKEN:
            acc0, acc1, acc2, acc3 = acc
            acc = (_one_token_group(acc0, weights, x, counts, t, WARPS), acc1, acc2, acc3)
        else:
            acc = _tile_group(acc, weights, x, counts)
        return acc

    @triton.jit
    def _step(acc, weights, x_ops, s, chunk, x, lane, g, t, warp, steps, groups, WARPS: tl.constexpr,
              DEPTH: tl.constexpr, ONE_TOKEN: tl.constexpr):
        """acc += the group of step s (its operands loaded DEPTH steps ago); then the operands of step s + DEPTH."""
        _, counts = _group_at(s, warp, steps, groups, WARPS)
        acc = _group(acc, weights, x_ops, counts, t, WARPS, ONE_TOKEN)
        j, _ = _group_at(s + DEPTH, warp, steps, groups, WARPS)
        return acc, _load_weights(chunk, lane, g, j), _x_operands(x, lane, t, j, ONE_TOKEN)

    @triton.jit
    def _stripe_kernel(tiles_ptr, chunk_ptr, out_ptr, T, groups, stride_out, WARPS: tl.constexpr,
                       DEPTH: tl.constexpr, ONE_TOKEN: tl.constexpr, PDL: tl.constexpr):
        """Program (stripe, tile of 8 tokens), or with ONE_TOKEN (stripe) for T = 1: see the module docstring. Tiles:
        the first DEPTH (1-4) groups' loads stand before the PDL wait here, but ptxas (Triton 3.6 and 3.9, sm_90)
        schedules the wait ahead of these non-coherent loads, so the kernel in fact waits first (`python -m
        ninfer.kernels.compile_check --resources`: 0 loads before the PDL wait). One token: only the first group is
        loaded before the wait, as coherent loads, which ptxas keeps there (3 loads before the wait). In the 27B's
        decode step all DEPTH groups ahead of the wait measured slower at batch 1 and 8, the first group alone
        faster at batch 1. With ONE_TOKEN, lanes 4g + t and 4g + (t ^ 2) both sum row g + 8 · (t % 2)."""
        lane = tl.arange(0, 32)[None, :]
        warp = tl.arange(0, WARPS)[:, None]
        g = lane // 4
        t = lane % 4
        stripe = tl.program_id(0).to(tl.int64)
        chunk = chunk_ptr + stripe * groups * 168
        x = tiles_ptr + tl.program_id(1).to(tl.int64) * groups * 144
        steps = tl.cdiv(groups, WARPS)
        j0, _ = _group_at(0, warp, steps, groups, WARPS)
        if ONE_TOKEN:  # the first group only, coherent, so that it stays ahead of the wait
            weights0 = _load_weights(chunk, lane, g, j0, True)
            wait_for_inputs(PDL)
        else:
            weights0 = _load_weights(chunk, lane, g, j0)
        if DEPTH >= 2:
            j1, _ = _group_at(1, warp, steps, groups, WARPS)
            weights1 = _load_weights(chunk, lane, g, j1)
        if DEPTH >= 3:
            j2, _ = _group_at(2, warp, steps, groups, WARPS)
            weights2 = _load_weights(chunk, lane, g, j2)
        if DEPTH >= 4:
            j3, _ = _group_at(3, warp, steps, groups, WARPS)
            weights3 = _load_weights(chunk, lane, g, j3)
        if not ONE_TOKEN:
            wait_for_inputs(PDL)
        x0 = _x_operands(x, lane, t, j0, ONE_TOKEN)
        if DEPTH >= 2:
            x1 = _x_operands(x, lane, t, j1, ONE_TOKEN)
        if DEPTH >= 3:
            x2 = _x_operands(x, lane, t, j2, ONE_TOKEN)
        if DEPTH >= 4:
            x3 = _x_operands(x, lane, t, j3, ONE_TOKEN)
        zero = tl.zeros([WARPS, 32], tl.float32)
        acc = (zero, zero, zero, zero)
        for turn in range(tl.cdiv(steps, DEPTH)):
            s = turn * DEPTH
            acc, weights0, x0 = _step(acc, weights0, x0, s, chunk, x, lane, g, t, warp, steps, groups, WARPS, DEPTH,
                                      ONE_TOKEN)
            if DEPTH >= 2:
                acc, weights1, x1 = _step(acc, weights1, x1, s + 1, chunk, x, lane, g, t, warp, steps, groups, WARPS,
                                          DEPTH, ONE_TOKEN)
            if DEPTH >= 3:
                acc, weights2, x2 = _step(acc, weights2, x2, s + 2, chunk, x, lane, g, t, warp, steps, groups, WARPS,
                                          DEPTH, ONE_TOKEN)
            if DEPTH >= 4:
                acc, weights3, x3 = _step(acc, weights3, x3, s + 3, chunk, x, lane, g, t, warp, steps, groups, WARPS,
                                          DEPTH, ONE_TOKEN)
        acc0, acc1, acc2, acc3 = acc
        dtype = out_ptr.dtype.element_ty
        if ONE_TOKEN:
            row = stripe * 16 + tl.arange(0, 32) // 4 + 8 * (tl.arange(0, 32) % 2)  # lanes t, t ^ 2: the same row
            tl.store(out_ptr + row, tl.sum(acc0, axis=0).to(dtype), mask=tl.arange(0, 32) % 4 < 2)
        else:
            row = stripe * 16 + tl.arange(0, 32) // 4
            token = tl.program_id(1) * 8 + 2 * (tl.arange(0, 32) % 4)
            out = out_ptr + token.to(tl.int64) * stride_out + row
            tl.store(out, tl.sum(acc0, axis=0).to(dtype), mask=token < T)
            tl.store(out + stride_out, tl.sum(acc1, axis=0).to(dtype), mask=token + 1 < T)
            tl.store(out + 8, tl.sum(acc2, axis=0).to(dtype), mask=token < T)
            tl.store(out + stride_out + 8, tl.sum(acc3, axis=0).to(dtype), mask=token + 1 < T)

    @triton.jit
    def _dequantize_stripes_kernel(chunk_ptr, out_ptr, K, groups, stride_out, GROUPS: tl.constexpr,
                                   PDL: tl.constexpr):
        """Program (stripe, GROUPS groups): each base word of a chunk gives its unit's 8 lanes of one row (its fifth
        bits and scale loaded beside it), code · scale rounded once, stored as 8 contiguous elements."""
        wait_for_inputs(PDL)
        j = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)[:, None, None]
        word = tl.arange(0, 128)[None, :, None]  # 4 · (4g + t) + w, w = 2 · block + half
        i = tl.arange(0, 8)[None, None, :]  # lane of the unit
        unit = word // 4  # 4g + t
        w = word % 4
        half = w % 2
        chunk = chunk_ptr + (tl.program_id(0).to(tl.int64) * groups + tl.minimum(j, groups - 1)) * 168
        nibble = (tl.load(chunk + word) >> (4 * i)) & 15
        fifth = (tl.load(chunk + 128 + unit) >> (8 * (i // 2) + 7 - (2 * w + i % 2))) & 1
        scale = (tl.load(chunk + 160 + unit // 4) >> (16 * half)) & 0xFFFF
        scale = scale.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        row = tl.program_id(0) * 16 + 8 * half + unit // 4
        column = j * 64 + 32 * (w // 2) + 8 * (unit % 4) + i
        out = out_ptr + row.to(tl.int64) * stride_out + column
        tl.store(out, ((nibble - 16 * fifth).to(tl.float32) * scale).to(out_ptr.dtype.element_ty),
                 mask=(column < K) & (j < groups))

def _check(chunks: torch.Tensor, shape: tuple[int, int]) -> None:
    if triton is None:
        raise RuntimeError("the stripe kernels need the triton package")
    expected = (shape[0] // STRIPE_ROWS, _groups(shape[1]), CHUNK_WORDS)
    if tuple(chunks.shape) != expected or chunks.dtype != torch.int32:
        raise ValueError(f"stripe chunks of a {list(shape)} matrix are int32 {list(expected)}, got "
                         f"{chunks.dtype} {list(chunks.shape)}")


def quantize_tiles(x: torch.Tensor) -> TileActivations:
    """x `[T, K]` → `TileActivations` (the module docstring), one Triton launch."""
    if triton is None:
        raise RuntimeError("the stripe kernels need the triton package")
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, k = x.shape
    tiles = empty_tiles(tokens, k, x.device)
    count = 2 * tiles.shape[1]
    per_program = min(32, triton.next_power_of_2(count))
    _quantize_tiles_kernel[(tokens, triton.cdiv(count, per_program))](x, tiles, k, count, x.stride(0),
                                                                      BLOCKS=per_program, **launch_options(x.device))
    return TileActivations(x, tiles)


def stripe_gemv(x: TileActivations, chunks: torch.Tensor, shape: tuple[int, int], out_dtype: torch.dtype | None = None,
                out: torch.Tensor | None = None, warps: int | None = None, depth: int | None = None) -> torch.Tensor:
    """y = x · Wᵀ `[T, N]` for W's stripe chunks (`repack`) and x's tiles, in `out_dtype` (default x's dtype), into
    `out` when given (a `[T, N]` view with unit column stride). One token takes `_stripe_kernel`'s `dp4a` variant,
    more its `mma` tiles: the same bits for a token either way. `warps` (part of the bits) and `depth` (groups loaded
    ahead; not part of the bits), by default the GPU's `tuning.StripeTuning`, are for measurements."""
    _check(chunks, shape)
    tokens, k = x.shape
    if k != shape[1]:
        raise ValueError(f"x has {k} features, the matrix {shape[1]}")
    if out is None:
        out = torch.empty((tokens, shape[0]), dtype=out_dtype or x.source.dtype, device=chunks.device)
    elif out.shape != (tokens, shape[0]) or out.stride(-1) != 1:
        raise ValueError(f"out must be a [{tokens}, {shape[0]}] view with unit column stride")
    if tokens == 0:
        return out
    stripes, groups = chunks.shape[0], chunks.shape[1]
    one_token = tokens == 1
    choice = tuning.for_device(chunks.device).stripes
    warps = warps or choice.warps
    _stripe_kernel[(stripes, x.tiles.shape[0])](x.tiles, chunks, out, tokens, groups, out.stride(0), WARPS=warps,
                                                DEPTH=depth or (choice.one_token_depth if one_token else
                                                                choice.tile_depth),
                                                ONE_TOKEN=one_token, num_warps=warps, **launch_options(chunks.device))
    return out


def dequantize_stripes(chunks: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype = torch.bfloat16,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """W `[N, K]` in `dtype` from its stripe chunks (into `out`'s first N · K elements when given: the shared
    scratch buffer), each element code · scale rounded once."""
    _check(chunks, shape)
    n, k = shape
    w = torch.empty((n, k), dtype=dtype, device=chunks.device) if out is None else out[: n * k].view(n, k)
    choice = tuning.for_device(chunks.device).stripes
    _dequantize_stripes_kernel[(chunks.shape[0], triton.cdiv(chunks.shape[1], choice.dequantize_groups))](
        chunks, w, k, chunks.shape[1], w.stride(0), GROUPS=choice.dequantize_groups, num_warps=choice.dequantize_warps,
        **launch_options(chunks.device))
    return w
