"""y = x · Wᵀ with W stored packed in a groupwise format (q4/q5/q6 g64, q8 g32, `row_split_k128_v1`).

Contract: x `[T, K]` (fp32 / bf16 / fp16), `data` the object's bytes (1-D uint8, on x's device), `shape` = (N, K)
of W, `fmt` its format, W[n, k] = scale[n, k // G] · code[n, k].

Four paths:
  * `quant_linear_reference`: decode W exactly (ninfer.quant) and multiply in fp32 — the oracle, any device. With
    `int8_activations`, x is first replaced by its int8 image (`activation_quant`): the oracle of the GEMV;
  * `quant_linear_gemv`: the integer GEMV for few tokens (decode, speculative verify, batched decode: T ≤ 64),
    which reads the packed planes once. x is quantized to int8 per 32 lanes (`activation_quant`, Q8_1-style as
    llama.cpp's integer matrix-vector products do) and y[t, n] = Σ_b scale_w[n, b] · scale_x[t, b] · D[t, n, b]
    with D the exact integer dot product of block b. A program owns a few rows and walks K in tiles of BLOCK_K
    lanes: the base plane is loaded as 32-bit words (8 lanes of nibbles, or 4 int8 lanes for q8) with the high
    units of the same lanes (q5: a byte, q6: 16 bits per word) and the scales; a word's even and odd nibbles,
    masked in place (plus the high bits, moved by a multiply), are byte quads that meet the activation quads in
    one `dp4a` each — about 5 integer instructions per 8 weights for q4, against ~50 for a float conversion of
    every lane, which bound the earlier kernel (docs/performance.md). Unsigned codes carry an offset (8, 16, 32),
    removed per block with the activation sums. Two routes:
      - "batch" (whole matrices whose padded K is a multiple of BATCH_BLOCK_K): a program holds up to 8 tokens;
        each lane of its warp owns one 32-lane block of the 1,024-lane tile for all the program's rows and
        tokens, so a weight tile is loaded and unpacked once for all tokens and an x record once for all rows,
        with no data exchanged between lanes until the final sum (T tokens cost about 2× one token at T = 8,
        not T×);
      - "token" (gathered experts and other K): one token per program, the programs of a row tile side by side
        (the later ones read its weights from L2). With `experts` it gathers: output row s uses the
        `expert_rows`-row block of expert `experts[s]` and input row `s // x_per_slot` (the MoE decode GEMV).
    Both keep a sum per block position of the K tile, added in a fixed pairwise order at the end; the tile depends
    on the matrix only, so a token's result is the same bits at any T (verify = decode) and on either route;
  * `quant_linear_grouped`: tiles of (token, expert) pairs that share an expert (`group_pairs` plans the tiles on
    the device) through `tl.dot` with bf16 weights (the codes decoded exactly, scaled, rounded to x's dtype) and
    fp32 accumulation, for MoE prefill: one launch per matrix for all experts;
  * `dequantize`: the same unpacking into a bf16 `[N, K]` matrix, for the prefill route of dense matrices
    (dequantize to scratch, then cuBLAS; `ninfer.fast.linear` picks the route by T).
Runs under TRITON_INTERPRET=1 (fp32 inputs there: the interpreter miscomputes bf16 `tl.dot`).
"""

from __future__ import annotations

import torch

from ninfer import flags
from ninfer.kernels.activation_quant import (
    Int8Activations,
    dequantize_activations,
    quantize_activations,
    quantize_activations_reference,
)
from ninfer.kernels.dependent_launch import launch_options, wait_for_inputs
from ninfer.quant import codec_for
from ninfer.quant.groupwise import GroupwiseCodec

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

MAX_GEMV_TOKENS = 64  # decode and verify steps of up to this many rows take the per-token routes
# the batch route (`_gemv_batch_kernel`): a program holds up to BATCH_TOKENS tokens and a few rows (`batch_block_n`),
# each lane of its one warp a 32-lane block of a BATCH_BLOCK_K-lane tile, so that a weight tile is loaded and
# unpacked once for all its tokens and an x record once for all its rows (tuned on the H200: docs/performance.md)
BATCH_TOKENS = 8
BATCH_BLOCK_K = 1024
# the interpreter runs programs one after another and vectorises within one: few wide programs are far faster there
INTERPRETED = flags.triton_interpreted()
# dp4a / prmt as inline PTX on NVIDIA GPUs; integer-op emulation under the interpreter and on other backends
ASM = not INTERPRETED and torch.version.hip is None


def quant_linear_reference(x: torch.Tensor, data: torch.Tensor, shape: tuple[int, int], fmt: str,
                           int8_activations: bool = False) -> torch.Tensor:
    weight = codec_for(fmt).decode(data, shape)
    if not int8_activations:
        return x.to(torch.float32) @ weight.T
    lanes = dequantize_activations(quantize_activations_reference(x))[:, : shape[1]]
    return (lanes.double() @ weight.double().T).float()


if triton is not None:
    # The axis of the batch route's 4-D tensors that holds the 32-lane blocks (tokens and rows follow in that order,
    # the 4 words of a block's units last): it must come first among the dimensions that Triton's load coalescing
    # orders by contiguity, where every one but the words ties. Triton up to 3.6 breaks the tie first dimension
    # first, 3.7 and later last dimension first; with the blocks elsewhere the loads spread rows or tokens over the
    # lanes, and every loop turn pays shuffles to bring them back (sm_90 SASS of the q4 loop at one token: 102
    # instructions either way round, 138 with the other version's placement; `scripts/compile_kernels.py
    # --resources`, docs/performance.md). The placement never changes a bit.
    BLOCKS_FIRST = tl.constexpr(tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7))

    @triton.jit
    def _block_positions(BLOCKS: tl.constexpr):
        """0..BLOCKS-1 along the batch route's blocks axis: `[BLOCKS, 1, 1, 1]` with BLOCKS_FIRST (tensors
        `[BLOCKS, T, BN, ·]`), else `[1, 1, BLOCKS, 1]` (tensors `[T, BN, BLOCKS, ·]`)."""
        if BLOCKS_FIRST:
            positions = tl.arange(0, BLOCKS)[:, None, None, None]
        else:
            positions = tl.arange(0, BLOCKS)[None, None, :, None]
        return positions

    @triton.jit
    def _lane_values(words, high, p: tl.constexpr, BITS: tl.constexpr):
        """Codes of lanes k0 + LPW·w + p (w < WORDS, LPW = lanes per 32-bit base word: 8, or 4 for q8) of the
        tile, exactly, as fp32 `[BN, WORDS]`, from its base words and high units (`_load_tile`). The int → float step is
        the magic-number one (OR the offset-binary code into the mantissa of 2^23, subtract), not a conversion
        instruction: conversions run at a quarter of the FP32 rate and would bound the kernel."""
        if BITS == 8:
            u = ((words >> (8 * p)) & 0xFF) ^ (0x4B000000 | 0x80)
            return u.to(tl.float32, bitcast=True) - (8388608.0 + 128.0)
        nibble = (words >> (4 * p)) & 0xF
        if BITS == 4:
            return (nibble ^ (0x4B000000 | 0x8)).to(tl.float32, bitcast=True) - (8388608.0 + 8.0)
        if BITS == 5:  # bit 4 of lane i is bit i % 8 of high byte i // 8: byte w of the row for word w
            bits = ((high >> p) & 1) << 4
            return ((nibble | bits) ^ (0x4B000000 | 0x10)).to(tl.float32, bitcast=True) - (8388608.0 + 16.0)
        # q6: bits 4-5 of lane i are bits 2i, 2i+1 of the high stream: 16-bit unit w of the row for word w
        bits = ((high >> (2 * p)) & 3) << 4
        return ((nibble | bits) ^ (0x4B000000 | 0x20)).to(tl.float32, bitcast=True) - (8388608.0 + 32.0)

    @triton.jit
    def _load_tile(base_ptr, high_ptr, scale_ptr, wrows, k0, row_words, high_row_units, gpr, BITS: tl.constexpr,
                   LPW: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
        """The tile's base words `[BN, BLOCK_K / LPW]` int32, its high units (q5: a byte, q6: 16 bits per word;
        else the words again, unused) as int32, and its scales `[BN, BLOCK_K / GROUP]` fp32."""
        WORDS: tl.constexpr = BLOCK_K // LPW
        words = tl.load(base_ptr + wrows[:, None] * row_words + (k0 // LPW + tl.arange(0, WORDS))[None, :])
        if BITS == 5 or BITS == 6:
            high = tl.load(high_ptr + wrows[:, None] * high_row_units + (k0 // 8 + tl.arange(0, WORDS))[None, :])
            high = high.to(tl.int32) & (0xFF if BITS == 5 else 0xFFFF)
        else:
            high = words
        groups = tl.arange(0, BLOCK_K // GROUP)
        scale = tl.load(scale_ptr + wrows[:, None] * gpr + (k0 // GROUP + groups)[None, :]).to(tl.float32)
        return words, high, scale

    @triton.jit
    def row_tile(tile, N, BLOCK_N: tl.constexpr):
        """The rows of row tile `tile`, whether each is < N (the store masks), and the rows clamped into [0, N) as
        int64 (for unmasked, vectorisable loads)."""
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        return rows, rows < N, tl.minimum(rows, N - 1).to(tl.int64)

    @triton.jit
    def gemv_rows(x_ptr, out_ptr, expert_ptr, N, T, stride_x, stride_out, BLOCK_N: tl.constexpr,
                  GATHER: tl.constexpr, X_PER_SLOT: tl.constexpr):
        """The output rows of a GEMV program and where they live: (rows, row_ok, safe_rows clamped into [0, N) for
        unmasked, vectorisable loads — the store masks —, the weight rows, x's row and the output row). Without
        GATHER, program_id(0) = row tile · T + token: the T programs of a row tile run side by side, so the ones
        after the first read its weights from L2. With GATHER, program_id(0) is the row tile and program_id(1) an
        output slot, whose expert `expert_ptr[slot]` offsets the weight rows by expert · N."""
        rows, row_ok, safe_rows = row_tile(tl.program_id(0) if GATHER else tl.program_id(0) // T, N, BLOCK_N)
        if GATHER:
            slot = tl.program_id(1)
            wrows = tl.load(expert_ptr + slot).to(tl.int64) * N + safe_rows
            x_base = x_ptr + (slot // X_PER_SLOT) * stride_x
            out_base = out_ptr + slot * stride_out
        else:
            token = (tl.program_id(0) % T).to(tl.int64)
            wrows = safe_rows
            x_base = x_ptr + token * stride_x
            out_base = out_ptr + token * stride_out
        return rows, row_ok, safe_rows, wrows, x_base, out_base

    @triton.jit
    def _dp4a(a, b, c, SIGNED: tl.constexpr, ASM: tl.constexpr):
        """c + Σ_i byte_i(a) · byte_i(b) in int32 (4-D a, b), b's bytes signed, a's unsigned (signed with SIGNED):
        one `dp4a` instruction on NVIDIA GPUs (sm_61+), integer ops elsewhere (the interpreter, other backends)."""
        if ASM:
            if SIGNED:
                r = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                              is_pure=True, pack=1)
            else:
                r = tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                              is_pure=True, pack=1)
        else:  # the bytes along a new last axis (few wide ops: fast in the interpreter)
            shifts = 8 * tl.arange(0, 4)
            a_bytes = (tl.expand_dims(a, -1) >> shifts) & 0xFF
            if SIGNED:
                a_bytes = (a_bytes ^ 0x80) - 0x80
            b_bytes = (((tl.expand_dims(b, -1) >> shifts) & 0xFF) ^ 0x80) - 0x80
            r = c + tl.sum(a_bytes * b_bytes, axis=-1)
        return r

    @triton.jit
    def _pick_bytes(w0, w1, SELECTOR: tl.constexpr, ASM: tl.constexpr):
        """Bytes 0 and 2 (SELECTOR 0x6420) or 1 and 3 (0x7531) of w0 then w1 as one word: `prmt` on NVIDIA."""
        if ASM:
            r = tl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SELECTOR};", "=r,r,r", [w0, w1], dtype=tl.int32,
                                          is_pure=True, pack=1)
        else:
            first: tl.constexpr = 0 if SELECTOR == 0x6420 else 8
            r = ((w0 >> first) & 0xFF) | ((w0 >> (first + 8)) & 0xFF00) | (((w1 >> first) & 0xFF) << 16) \
                | (((w1 >> (first + 16)) & 0xFF) << 24)
        return r

    @triton.jit
    def _spread_q6_pairs(h):
        """Bits (4j, 4j + 1) of h to bits (8j + 4, 8j + 5), j < 4 (two multiplies whose stray products fall outside
        the masks; checked over every 16-bit h by tests/test_quant_linear.py)."""
        return (((h & 0x0303) * 0x1010) & 0x00300030) | (((h & 0x3030) * 0x10100) & 0x30003000)

    @triton.jit
    def _weight_quads(words, high, bias, BITS: tl.constexpr, ASM: tl.constexpr):
        """The tile's weight codes as byte quads matching the activation quads (`activation_quant`): (even, odd)
        `[BN, BLOCKS, 4]` int32 for the units (8 lanes) of each 32-lane block; even = lanes 8u + 0, 2, 4, 6 of unit
        u, odd = lanes 8u + 1, 3, 5, 7; unsigned code + offset (q4: 8, q5: 16, q6: 32) for the 4–6-bit formats,
        the signed code for q8. `words`, `high`: as `_load_weights` returns them; `bias` the q4 offset in every
        byte (0x08080808), a runtime value: in a register, the mask and the flip fuse into one LOP3 (two immediates
        cannot). For q5 / q6 the offset is the code's top bit, flipped in the high plane before it is spread."""
        if BITS == 8:
            w0, w1 = tl.split(words)
            even = _pick_bytes(w0, w1, 0x6420, ASM)
            odd = _pick_bytes(w0, w1, 0x7531, ASM)
        elif BITS == 4:
            even = (words & 0x0F0F0F0F) ^ bias
            odd = ((words >> 4) & 0x0F0F0F0F) ^ bias
        else:  # the offset is the top code bit, which comes from the high plane: flip it there, once per word
            even = words & 0x0F0F0F0F
            odd = (words >> 4) & 0x0F0F0F0F
            if BITS == 5:  # bit i of the high byte is bit 4 of lane i
                flipped = high ^ 0xFF
                even = even | (((flipped & 0x55) * 0x410410) & 0x10101010)
                odd = odd | (((flipped & 0xAA) * 0x208208) & 0x10101010)
            else:  # q6: bits 2i, 2i + 1 of the high unit are bits 4, 5 of lane i
                flipped = high ^ 0xAAAA
                even = even | _spread_q6_pairs(flipped)
                odd = odd | _spread_q6_pairs(flipped >> 2)
        return even, odd

    @triton.jit
    def _load_base_words(base_ptr, rows, unit, row_words, BITS: tl.constexpr):
        """The base words of weight rows `rows` at 8-lane units `unit` (index tensors that broadcast to the tile's
        shape; q8 adds a last axis for its two words per unit)."""
        if BITS == 8:
            words = tl.load(base_ptr + tl.expand_dims(rows * row_words + 2 * unit, -1) + tl.arange(0, 2))
        else:
            words = tl.load(base_ptr + rows * row_words + unit)
        return words

    @triton.jit
    def _load_units(base_ptr, high_ptr, rows, unit, row_words, high_row_units, BITS: tl.constexpr):
        """`_load_base_words` and the high units as int32 (q5: a byte, q6: 16 bits; the words again without a high
        plane, unused)."""
        words = _load_base_words(base_ptr, rows, unit, row_words, BITS)
        if BITS == 5 or BITS == 6:
            high = tl.load(high_ptr + rows * high_row_units + unit).to(tl.int32) & (0xFF if BITS == 5 else 0xFFFF)
        else:
            high = words
        return words, high

    @triton.jit
    def _load_weights(base_ptr, high_ptr, scale_ptr, wrows, k0, row_words, high_row_units, gpr, BITS: tl.constexpr,
                      GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
        """The tile's packed weights as loaded, per row, 32-lane block and unit (8 lanes): base words (q8:
        `[BN, BLOCKS, 4, 2]`, two per unit, else `[BN, BLOCKS, 4]`), the high units as int32 (the words again
        without a high plane, unused) and the weight scale of each block `[BN, BLOCKS]` fp32. A block's units
        are contiguous: 16- or 32-byte vector loads."""
        BLOCKS: tl.constexpr = BLOCK_K // 32
        unit = k0 // 8 + 4 * tl.arange(0, BLOCKS)[None, :, None] + tl.arange(0, 4)[None, None, :]
        words, high = _load_units(base_ptr, high_ptr, wrows[:, None, None], unit, row_words, high_row_units, BITS)
        groups = (k0 + 32 * tl.arange(0, BLOCKS)[None, :]) // GROUP
        scale = tl.load(scale_ptr + wrows[:, None] * gpr + groups).to(tl.float32)
        return words, high, scale

    @triton.jit
    def _pairwise_sum(values, WIDTH: tl.constexpr):
        """Σ over the last axis (WIDTH, a power of 2) of a 3-D tensor by halving: lane b + WIDTH / 2 onto lane b,
        then again — a fixed order whatever the layout, so a row's sum does not depend on the tensor's other
        dimensions (the token count)."""
        if WIDTH == 1:
            r = tl.sum(values, axis=2)
        else:
            pairs = tl.reshape(values, [values.shape[0], values.shape[1], 2, WIDTH // 2])
            r = _pairwise_sum(tl.sum(pairs, axis=2), WIDTH // 2)
        return r

    @triton.jit
    def _shuffle_xor(values, MASK: tl.constexpr, ASM: tl.constexpr):
        """values `[LANES, M]` fp32 with row p taken from row p ^ MASK: on NVIDIA GPUs one `shfl.sync.bfly` per
        element, which is that exchange only where row p lives in lane p of one warp (the caller's layout: the
        batch route's blocks axis at 1,024-lane tiles on one warp); elsewhere the rows swapped with a flip, for
        any layout (the interpreter)."""
        if ASM:
            bits = tl.inline_asm_elementwise(f"shfl.sync.bfly.b32 $0, $1, {MASK}, 0x1f, 0xffffffff;", "=r,r",
                                              [values.to(tl.int32, bitcast=True)], dtype=tl.int32, is_pure=False,
                                              pack=1)
            r = bits.to(tl.float32, bitcast=True)
        else:
            LANES: tl.constexpr = values.shape[0]
            M: tl.constexpr = values.shape[1]
            pairs = tl.reshape(values, [LANES // (2 * MASK), 2, MASK, M])
            r = tl.reshape(tl.flip(pairs, 1), [LANES, M])
        return r

    @triton.jit
    def _lane_tree_sum(values, lane, MASK: tl.constexpr, M: tl.constexpr, ASM: tl.constexpr):
        """`_pairwise_sum` over the 32 positions of `values` `[32, M]` (position p in lane p, `lane` = p `[32, 1]`;
        M ≤ 32 sums per lane, a power of 2), the same bits, in 31 shuffles where the reduction across lanes takes
        5 · M: each level pairs the lanes p and p ^ MASK (MASK = 16, 8, …, 1; callers start at 16), which are the
        halving tree's pairs, and each lane of a pair keeps half of its sums, lane p the half that bit MASK of p picks
        (an exchange sends the other half), so a level costs M / 2 shuffles and halves M; once one sum is left, the
        rest are plain butterflies. Returns `[32, 1]`: lane p holds the sum of value p >> (5 − log2 M), in every lane
        of its run of 32 / M (an IEEE addition is commutative, so both lanes of a pair get the same bits). The H200
        profile of the 8-token gate_up put 11.6 % of its samples after the K loop in the reduction across lanes
        (docs/performance.md)."""
        if M == 1:
            r = values + _shuffle_xor(values, MASK, ASM)
        else:
            first, second = tl.split(tl.permute(tl.reshape(values, [values.shape[0], 2, M // 2]), (0, 2, 1)))
            upper = (lane & MASK) != 0
            r = tl.where(upper, second, first) + _shuffle_xor(tl.where(upper, first, second), MASK, ASM)
        if MASK > 1:  # M halves down to 1
            r = _lane_tree_sum(r, lane, MASK // 2, (M + 1) // 2, ASM)
        return r

    @triton.jit
    def _quads(t):
        """The 4 words along the last axis of a 4-D t (one thread's, in every layout of the GEMVs) as 4 tensors of
        t's other axes."""
        a, b = tl.split(tl.reshape(t, [t.shape[0], t.shape[1], t.shape[2], 2, 2]))
        q0, q2 = tl.split(a)
        q1, q3 = tl.split(b)
        return q0, q1, q2, q3

    @triton.jit
    def _block_dots(even, odd, record, word, OFFSET: tl.constexpr, CHAIN: tl.constexpr, SIGNED: tl.constexpr,
                    ASM: tl.constexpr):
        """The block dot products D = Σ code · x − OFFSET · x_sum (exact int32, |D| < 2^22) as exact fp32, and the x
        scales, from the weight quads (even, odd) and the activation records at `record` (even quads, odd quads,
        then scale bits, sum, 0, 0: word offsets 0, 4, 8 along the last axis, `word` = 0..3 there), 4-D tensors that
        broadcast to one shape with the 4 units last. The int → float step is the magic number 1.5 · 2^23: the
        bits 0x4B400000 + D are the float 1.5 · 2^23 + D, from which one FADD takes 1.5 · 2^23, in place of the
        conversion instruction (1/8 of the FMA rate; docs/performance.md); the offset and the magic bits fold into
        one term per token, `start`, shared by a program's rows. CHAIN is the `dp4a` a dependent chain holds: 2
        (even and odd of each unit, then a sum over the units plus `start`), 4 (units 0-1 from `start`, units 2-3,
        one add) or 8 (one chain from `start`: no adds, a longer dependence). int32 sums are exact in any order, so
        CHAIN never changes a bit; which one schedules best depends on the format and the tile (`batch_chain`)."""
        if CHAIN == 2:
            dots = _dp4a(even, tl.load(record), 0, SIGNED, ASM)
            dots = _dp4a(odd, tl.load(record + 4), dots, SIGNED, ASM)
        meta = tl.load(record + 8)
        x_scale = tl.sum(tl.where(word == 0, meta, 0), axis=3).to(tl.float32, bitcast=True)
        start = 0x4B400000 - OFFSET * tl.sum(tl.where(word == 1, meta, 0), axis=3)
        if CHAIN == 2:
            c = tl.sum(dots, axis=3) + start
        else:
            e0, e1, e2, e3 = _quads(even)
            o0, o1, o2, o3 = _quads(odd)
            x0, x1, x2, x3 = _quads(tl.load(record))
            y0, y1, y2, y3 = _quads(tl.load(record + 4))
            c = _dp4a(e0, x0, start, SIGNED, ASM)
            c = _dp4a(o0, y0, c, SIGNED, ASM)
            c = _dp4a(e1, x1, c, SIGNED, ASM)
            c = _dp4a(o1, y1, c, SIGNED, ASM)
            half = _dp4a(e2, x2, 0 if CHAIN == 4 else c, SIGNED, ASM)
            half = _dp4a(o2, y2, half, SIGNED, ASM)
            half = _dp4a(e3, x3, half, SIGNED, ASM)
            half = _dp4a(o3, y3, half, SIGNED, ASM)
            c = c + half if CHAIN == 4 else half
        return c.to(tl.float32, bitcast=True) - 12582912.0, x_scale

    @triton.jit
    def _tile_indices(program, T, BLOCK_T: tl.constexpr):
        """A batch-route program's (row tile, token tile): program = row tile · token tiles + token tile, so the
        token tiles of one row tile run side by side and the ones after the first read its weights from L2."""
        token_tiles = tl.cdiv(T, BLOCK_T)
        return program // token_tiles, program % token_tiles

    @triton.jit
    def _row_and_token_tiles(program, N, T, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
        """A batch-route program's rows and tokens (`_tile_indices`). Returns (rows, row_ok, safe_rows clamped into
        [0, N) for unmasked, vectorisable loads, tokens)."""
        row_index, token_index = _tile_indices(program, T, BLOCK_T)
        rows, row_ok, safe_rows = row_tile(row_index, N, BLOCK_N)
        return rows, row_ok, safe_rows, token_index * BLOCK_T + tl.arange(0, BLOCK_T)

    @triton.jit
    def _gemv_kernel(x_blocks_ptr, base_ptr, high_ptr, scale_ptr, out_ptr, expert_ptr,
                     T, N, k_pad, row_words, high_row_units, gpr, x_block_count, stride_out, bias,
                     BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GATHER: tl.constexpr, X_PER_SLOT: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
        BLOCKS: tl.constexpr = BLOCK_K // 32
        OFFSET: tl.constexpr = 0 if BITS == 8 else 1 << (BITS - 1)
        if GATHER:  # the experts come from the routing kernel
            wait_for_inputs(PDL)
        rows, row_ok, _, wrows, x_base, out_base = gemv_rows(x_blocks_ptr, out_ptr, expert_ptr, N, T,
                                                             x_block_count * 12, stride_out, BLOCK_N, GATHER,
                                                             X_PER_SLOT)
        # x's block records are addressed at the full [1, BN, BLOCKS, 4] shape of the products (rows broadcast):
        # their loads then take the products' layout (no shuffles between layouts in the loop; repeats hit L1)
        word = tl.arange(0, 4)[None, None, None, :]
        x_record = x_base + (tl.arange(0, BLOCKS)[None, None, :, None] + 0 * rows[None, :, None, None]) * 12 + word
        acc = tl.zeros((1, BLOCK_N, BLOCKS), dtype=tl.float32)
        k_last = tl.multiple_of(k_pad - BLOCK_K, BLOCK_K)  # k_pad is a multiple of BLOCK_K: aligned vector loads
        words, high, w_scale = _load_weights(base_ptr, high_ptr, scale_ptr, wrows, 0, row_words, high_row_units, gpr,
                                             BITS, GROUP, BLOCK_K)
        if not GATHER:  # the first weight tile streams while the kernel before this one finishes
            wait_for_inputs(PDL)
        for k0 in tl.range(0, k_pad, BLOCK_K):
            # the next tile's loads are out before this tile's arithmetic (past the end, the last tile reloads
            # itself): bytes in flight per warp, which bound the kernel at one program per warp
            next_tile = _load_weights(base_ptr, high_ptr, scale_ptr, wrows, tl.minimum(k0 + BLOCK_K, k_last),
                                      row_words, high_row_units, gpr, BITS, GROUP, BLOCK_K)
            even, odd = _weight_quads(words, high, bias, BITS, ASM)
            block_dots, x_scale = _block_dots(even[None], odd[None], x_record + (k0 // 32) * 12, word, OFFSET, 2,
                                              BITS == 8, ASM)
            acc += block_dots * (w_scale[None, :, :] * x_scale)
            words, high, w_scale = next_tile
        tl.store(out_base + rows[None, :], _pairwise_sum(acc, BLOCKS), mask=row_ok[None, :])

    @triton.jit
    def _gemv_batch_kernel(x_blocks_ptr, T, x_block_count, base_ptr, high_ptr, scale_ptr, out_ptr, N, k_pad,
                           row_words, high_row_words, gpr, stride_out, bias, BITS: tl.constexpr, GROUP: tl.constexpr,
                           BLOCK_N: tl.constexpr, DEPTH: tl.constexpr, UNROLL: tl.constexpr, CHAIN: tl.constexpr,
                           LANE_TREE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, ASM: tl.constexpr,
                           PDL: tl.constexpr):
        """The batch route for one matrix (`_batch_program`)."""
        _batch_program(tl.program_id(0), x_blocks_ptr, base_ptr, high_ptr, scale_ptr, out_ptr, T, N, k_pad,
                       row_words, high_row_words, gpr, x_block_count, stride_out, bias, BITS, GROUP, BLOCK_N, BLOCK_K,
                       BLOCK_T, DEPTH, UNROLL, CHAIN, LANE_TREE, ASM, PDL)

    @triton.jit
    def _gemv_batch_pair_kernel(x_blocks_ptr, T, x_block_count, programs,
                                base_ptr, high_ptr, scale_ptr, out_ptr, N, k_pad, row_words, high_row_words, gpr,
                                stride_out, bias,
                                base2_ptr, high2_ptr, scale2_ptr, out2_ptr, N2, k_pad2, row_words2, high_row_words2,
                                gpr2, stride_out2, bias2,
                                BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, DEPTH: tl.constexpr,
                                UNROLL: tl.constexpr, CHAIN: tl.constexpr, BITS2: tl.constexpr, GROUP2: tl.constexpr,
                                BLOCK_N2: tl.constexpr, DEPTH2: tl.constexpr, UNROLL2: tl.constexpr,
                                CHAIN2: tl.constexpr, LANE_TREE: tl.constexpr, LANE_TREE2: tl.constexpr,
                                BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
        """The batch route for two matrices that read the same x, in one launch: the first `programs` programs are
        the first matrix's, the rest the second's, each exactly a program of `_gemv_batch_kernel` (the same bits).
        Neither product waits for the other: as two launches, the second could start only after the first had
        finished (PDL orders every kernel after all earlier ones), and the smaller one's last wave ran alone."""
        program = tl.program_id(0)
        if program < programs:
            _batch_program(program, x_blocks_ptr, base_ptr, high_ptr, scale_ptr, out_ptr, T, N, k_pad, row_words,
                           high_row_words, gpr, x_block_count, stride_out, bias, BITS, GROUP, BLOCK_N, BLOCK_K,
                           BLOCK_T, DEPTH, UNROLL, CHAIN, LANE_TREE, ASM, PDL)
        else:
            _batch_program(program - programs, x_blocks_ptr, base2_ptr, high2_ptr, scale2_ptr, out2_ptr, T, N2,
                           k_pad2, row_words2, high_row_words2, gpr2, x_block_count, stride_out2, bias2, BITS2,
                           GROUP2, BLOCK_N2, BLOCK_K, BLOCK_T, DEPTH2, UNROLL2, CHAIN2, LANE_TREE2, ASM, PDL)

    @triton.jit
    def _batch_program(program, x_blocks_ptr, base_ptr, high_ptr, scale_ptr, out_ptr, T, N, k_pad, row_words,
                       high_row_words, gpr, x_block_count, stride_out, bias, BITS: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, DEPTH: tl.constexpr,
                       UNROLL: tl.constexpr, CHAIN: tl.constexpr, LANE_TREE: tl.constexpr, ASM: tl.constexpr,
                       PDL: tl.constexpr):
        """Program `program` of the batch route: BLOCK_T tokens × BLOCK_N rows. Every tensor is block-major
        ([BLOCKS, …, 4] with the 4 words of a block's units last; the shapes here are those of BLOCKS_FIRST, from
        Triton 3.7 the blocks are the third axis: [T, BN, BLOCKS, 4]), and Triton's layout then puts the blocks across
        the warp's lanes and tokens and rows in each lane's registers: the records `[BLOCKS, T, 1, 4]` and the weights
        `[BLOCKS, 1, BN, 4]` broadcast in place (checked with `scripts/compile_kernels.py --resources`: no shared
        memory or shuffles in the loop at BLOCK_K = 1,024, one block per lane of one warp). DEPTH (1 or 2) weight
        tiles are loaded ahead, kept as loaded until used; the K loop is unrolled UNROLL times (2: the tile loaded
        ahead lands in the registers it is used from, where a loop-carried copy would wait for the load). CHAIN: the
        `dp4a` per dependent chain (`_block_dots`). LANE_TREE: the positions' sums meet in `_lane_tree_sum` where
        the tile is 1,024 lanes and the program holds at most 32 (token, row) sums, else in `_pairwise_sum`; the
        same bits either way."""
        BLOCKS: tl.constexpr = BLOCK_K // 32
        OFFSET: tl.constexpr = 0 if BITS == 8 else 1 << (BITS - 1)
        rows, row_ok, safe_rows, tokens = _row_and_token_tiles(program, N, T, BLOCK_N, BLOCK_T)
        x_rows = tl.minimum(tokens, T - 1).to(tl.int64)
        if BLOCKS_FIRST:  # the records' tokens and the weights' rows on their axes (`_block_positions`)
            x_rows = x_rows[None, :, None, None]
            w_rows = safe_rows[None, None, :, None]
            acc = tl.zeros((BLOCKS, BLOCK_T, BLOCK_N), dtype=tl.float32)
        else:
            x_rows = x_rows[:, None, None, None]
            w_rows = safe_rows[None, :, None, None]
            acc = tl.zeros((BLOCK_T, BLOCK_N, BLOCKS), dtype=tl.float32)
        word = tl.arange(0, 4)[None, None, None, :]
        x_record = x_blocks_ptr + (x_rows * x_block_count + _block_positions(BLOCKS)) * 12 + word
        k_last = tl.multiple_of(k_pad - BLOCK_K, BLOCK_K)
        words, high, w_scale = _load_blocks(base_ptr, high_ptr, scale_ptr, w_rows, 0, row_words, high_row_words, gpr,
                                            BITS, GROUP, BLOCK_K, ASM)
        if DEPTH == 2:  # a second tile in flight (the last tile again when there is one tile)
            words2, high2, w_scale2 = _load_blocks(base_ptr, high_ptr, scale_ptr, w_rows, tl.minimum(BLOCK_K, k_last),
                                                   row_words, high_row_words, gpr, BITS, GROUP, BLOCK_K, ASM)
        wait_for_inputs(PDL)  # the first weight tiles stream while the kernel before this one finishes
        for k0 in tl.range(0, k_pad, BLOCK_K, loop_unroll_factor=UNROLL):
            # the tile DEPTH tiles ahead is loaded before this tile's arithmetic (past the end, the last tile again):
            # weight bytes in flight per warp, which bound the few-row, long-K matrices at one token
            next_tile = _load_blocks(base_ptr, high_ptr, scale_ptr, w_rows, tl.minimum(k0 + DEPTH * BLOCK_K, k_last),
                                     row_words, high_row_words, gpr, BITS, GROUP, BLOCK_K, ASM)
            units, scale = _block_units(high, w_scale, BITS)
            even, odd = _weight_quads(words, units, bias, BITS, ASM)
            block_dots, x_scale = _block_dots(even, odd, x_record + (k0 // 32) * 12, word, OFFSET, CHAIN, BITS == 8,
                                              ASM)
            acc += block_dots * (tl.reshape(scale, [scale.shape[0], scale.shape[1], scale.shape[2]]) * x_scale)
            if DEPTH == 2:
                words, high, w_scale = words2, high2, w_scale2
                words2, high2, w_scale2 = next_tile
            else:
                words, high, w_scale = next_tile
        SUMS: tl.constexpr = BLOCK_T * BLOCK_N
        if LANE_TREE and BLOCKS == 32 and SUMS <= 32:  # lane p sums value p // COPIES, j = token · BLOCK_N + row
            if not BLOCKS_FIRST:
                acc = tl.permute(acc, (2, 0, 1))
            lane = tl.arange(0, 32)[:, None]
            sums = _lane_tree_sum(tl.reshape(acc, [BLOCKS, SUMS]), lane, 16, SUMS, ASM)
            COPIES: tl.constexpr = 32 // SUMS
            row_index, token_index = _tile_indices(program, T, BLOCK_T)
            token = token_index * BLOCK_T + lane // COPIES // BLOCK_N
            row = row_index * BLOCK_N + lane // COPIES % BLOCK_N
            tl.store(out_ptr + token.to(tl.int64) * stride_out + row, sums,
                     mask=(lane % COPIES == 0) & (token < T) & (row < N))
        else:
            out = out_ptr + tokens[:, None].to(tl.int64) * stride_out + rows[None, :]
            if BLOCKS_FIRST:
                acc = tl.permute(acc, (1, 2, 0))
            tl.store(out, _pairwise_sum(acc, BLOCKS), mask=(tokens < T)[:, None] & row_ok[None, :])

    @triton.jit
    def _load_blocks(base_ptr, high_ptr, scale_ptr, w_rows, k0, row_words, high_row_words, gpr, BITS: tl.constexpr,
                     GROUP: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
        """A tile of the batch route as loaded, nothing converted (a tile loaded ahead then stays in its load
        registers until it is used; `_block_units` converts it; shapes with BLOCKS_FIRST, else the blocks third and
        the rows second), for the rows `w_rows` `[1, 1, BN, 1]`: base words `[BLOCKS, 1, BN, 4]` (q8: `[…, 4, 2]`);
        the high plane (`high_ptr` as int32 words) `[BLOCKS, 1, BN, 4]`, for unit u the word that holds its high bits
        (q5: the block's one word of 4 high bytes, q6: word u // 2 of the block's two), the words again without a
        high plane; the scales' fp16 bits `[BLOCKS, 1, BN, 1]` (`scale_ptr` as int16)."""
        BLOCKS: tl.constexpr = BLOCK_K // 32
        blocks = _block_positions(BLOCKS)
        unit = k0 // 8 + 4 * blocks + tl.arange(0, 4)[None, None, None, :]
        if BITS == 8 and not BLOCKS_FIRST:  # loaded with the units ahead of the blocks: the blocks then come first
            # among the tied dimensions (a unit's two words last), as in the other formats' loads
            words = tl.permute(_load_base_words(base_ptr, w_rows, tl.permute(unit, (0, 1, 3, 2)), row_words, BITS),
                               (0, 1, 3, 2, 4))
        else:
            words = _load_base_words(base_ptr, w_rows, unit, row_words, BITS)
        if BITS == 5 or BITS == 6:  # q5: a block's one high word for each unit; q6: word u // 2 for unit u
            u = tl.arange(0, 4)[None, None, None, :]
            word = blocks + 0 * u if BITS == 5 else 2 * blocks + u // 2
            high = _load_bits(high_ptr + w_rows * high_row_words + k0 // (32 if BITS == 5 else 16) + word, 32, ASM)
        else:
            high = words
        scale = _load_bits(scale_ptr + w_rows * gpr + (k0 + 32 * blocks) // GROUP, 16, ASM)
        return words, high, scale

    @triton.jit
    def _load_bits(ptrs, BITS: tl.constexpr, ASM: tl.constexpr):
        """The BITS-bit (16 or 32) integers at `ptrs` (read-only data), zero-extended to int32 on NVIDIA GPUs,
        through an inline `ld.global.nc`, which the compiler neither vectorizes nor unpacks: a vector load of a
        tensor contiguous along the blocks would take another layout (and shuffles), and unpacking a loaded
        vector into its elements would wait for the load where it is issued, not where it is used. Repeated
        addresses merge into one load. Elsewhere `tl.load` (the pointer's type)."""
        if ASM:
            words = tl.inline_asm_elementwise(f"ld.global.nc.u{BITS} $0, [$1];", "=r,l", [ptrs], dtype=tl.int32,
                                              is_pure=True, pack=1)
        else:
            words = tl.load(ptrs)
        return words

    @triton.jit
    def _block_units(high, scale, BITS: tl.constexpr):
        """A tile from `_load_blocks`: its high units `[BLOCKS, 1, BN, 4]` int32 (q5: a byte, q6: 16 bits per 8-lane
        unit; `high` itself without a high plane) and its scales as fp32."""
        unit = tl.arange(0, 4)[None, None, None, :]
        if BITS == 5:
            high = (high >> (8 * unit)) & 0xFF
        elif BITS == 6:
            high = (high >> (16 * (unit % 2))) & 0xFFFF
        return high, scale.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _grouped_kernel(x_ptr, base_ptr, high_ptr, scale_ptr, out_ptr, expert_ptr, pairs_ptr, N, k_pad, row_words,
                        high_row_units, gpr, stride_x, stride_out, num_experts, BITS: tl.constexpr,
                        GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                        X_PER_SLOT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        wait_for_inputs(PDL)
        LPW: tl.constexpr = 4 if BITS == 8 else 8  # lanes per 32-bit base word
        WORDS: tl.constexpr = BLOCK_K // LPW
        WPG: tl.constexpr = GROUP // LPW  # words per group (8 in every format)
        NG: tl.constexpr = BLOCK_K // GROUP
        rows, row_ok, safe_rows = row_tile(tl.program_id(0), N, BLOCK_N)
        w_idx = tl.arange(0, WORDS)
        tokens = tl.arange(0, BLOCK_T)
        tile = tl.program_id(1)  # a tile of BLOCK_T (token, expert) pairs that share one expert
        expert = tl.load(expert_ptr + tile)
        live = expert < num_experts  # tiles past the plan's last one hold no pairs
        wrows = tl.minimum(expert, num_experts - 1).to(tl.int64) * N + safe_rows
        pairs = tl.load(pairs_ptr + tile * BLOCK_T + tokens)
        token_ok = (pairs >= 0) & (tokens < tl.where(live, BLOCK_T, 0))  # tensor-only mask terms
        x_rows = tl.where(token_ok, pairs // X_PER_SLOT, 0).to(tl.int64)
        out_rows = tl.where(token_ok, pairs, 0).to(tl.int64)
        acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        for k0 in tl.range(0, tl.where(live, k_pad, 0), BLOCK_K):
            words, high, scale = _load_tile(base_ptr, high_ptr, scale_ptr, wrows, k0, row_words,
                                            high_row_units, gpr, BITS, LPW, GROUP, BLOCK_K)
            for p in tl.static_range(LPW):
                x_p = tl.load(x_ptr + x_rows[None, :] * stride_x + (k0 + LPW * w_idx + p)[:, None],
                              mask=token_ok[None, :], other=0.0)
                codes = _lane_values(words, high, p, BITS)
                w_p = tl.reshape(tl.reshape(codes, [BLOCK_N, NG, WPG]) * scale[:, :, None], [BLOCK_N, WORDS])
                if IEEE:
                    acc += tl.dot(w_p.to(x_p.dtype), x_p, input_precision="ieee")
                else:
                    acc += tl.dot(w_p.to(x_p.dtype), x_p)
        out = out_ptr + out_rows[None, :] * stride_out + rows[:, None]
        tl.store(out, acc, mask=row_ok[:, None] & token_ok[None, :])

    @triton.jit
    def _dequantize_kernel(base_ptr, high_ptr, scale_ptr, out_ptr, index_ptr, N, K, row_words, high_row_units, gpr,
                           BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GATHER: tl.constexpr, PDL: tl.constexpr):
        wait_for_inputs(PDL)
        LPW: tl.constexpr = 4 if BITS == 8 else 8
        NG: tl.constexpr = BLOCK_K // GROUP
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output rows
        k0 = tl.program_id(1) * BLOCK_K
        safe_rows = tl.minimum(rows, N - 1).to(tl.int64)
        if GATHER:  # output row r is stored row index[r]
            safe_rows = tl.load(index_ptr + safe_rows).to(tl.int64)
        words, high, scale = _load_tile(base_ptr, high_ptr, scale_ptr, safe_rows, k0, row_words, high_row_units, gpr,
                                        BITS, LPW, GROUP, BLOCK_K)
        # codes of lanes LPW·w + p for every p, interleaved back into lane order with joins
        c01 = tl.join(_lane_values(words, high, 0, BITS), _lane_values(words, high, 1, BITS))
        c23 = tl.join(_lane_values(words, high, 2, BITS), _lane_values(words, high, 3, BITS))
        if LPW == 8:
            c45 = tl.join(_lane_values(words, high, 4, BITS), _lane_values(words, high, 5, BITS))
            c67 = tl.join(_lane_values(words, high, 6, BITS), _lane_values(words, high, 7, BITS))
            codes = tl.permute(tl.join(tl.join(c01, c23), tl.join(c45, c67)), (0, 1, 4, 3, 2))
        else:
            codes = tl.permute(tl.join(c01, c23), (0, 1, 3, 2))
        codes = tl.reshape(codes, [BLOCK_N, NG, GROUP])
        w = tl.reshape(codes * scale[:, :, None], [BLOCK_N, BLOCK_K])
        lanes = k0 + tl.arange(0, BLOCK_K)
        out = out_ptr + rows[:, None].to(tl.int64) * K + lanes[None, :]
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=(rows < N)[:, None] & (lanes < K)[None, :])


def _groupwise_codec(fmt: str) -> GroupwiseCodec:
    codec = codec_for(fmt)
    if not isinstance(codec, GroupwiseCodec):
        raise ValueError(f"{fmt} is not a groupwise format")
    return codec


def _check_features(features: int, k: int) -> None:
    if features != k:
        raise ValueError(f"x has {features} features, the matrix {k}")


def _planes(data: torch.Tensor, shape: tuple[int, int], fmt: str) -> tuple:
    codec = _groupwise_codec(fmt)
    planes = codec.planes(shape)
    n = shape[0]
    base = data[: n * planes[0].row_bytes].view(torch.int32)
    if len(planes) == 3:  # q5: one high byte per 8 lanes; q6: one 16-bit unit per 8 lanes
        high = data[planes[1].offset : planes[1].offset + n * planes[1].row_bytes]
        high = high.view(torch.int16) if codec.bits == 6 else high
    else:
        high = data
    scales = data[planes[-1].offset : planes[-1].offset + n * planes[-1].row_bytes].view(torch.float16)
    return codec, base, high, scales, planes


def _high_row_units(codec: GroupwiseCodec, planes: list) -> int:
    """Row stride of the high plane in its load unit (q5: bytes, q6: 16-bit units); 0 without a high plane."""
    return planes[1].row_bytes // (2 if codec.bits == 6 else 1) if len(planes) == 3 else 0


def _block_k(k_pad: int) -> int:
    """The widest tile (lanes) up to 256 that divides the padded K (`tl.dot` meets x in the grouped product)."""
    return next(b for b in (256, 128) if k_pad % b == 0)


def gemv_block_k(k_pad: int, route: str = "token") -> int:
    """The integer GEMV's K tile: BATCH_BLOCK_K lanes on the batch route where it divides the padded K (one 32-lane
    block per lane of a warp), else the widest of 512, 256, 128, 64 lanes dividing it (512 measured best for the
    token route on the H200, docs/performance.md). It depends on the matrix and route only, never on the token
    count, so that every token's result is the same bits at any T."""
    if route == "batch" and k_pad % BATCH_BLOCK_K == 0:
        return BATCH_BLOCK_K
    return next(b for b in (512, 256, 128, 64) if k_pad % b == 0)


def gemv_route(k_pad: int, gathered: bool = False) -> str:
    """The GEMV route a product takes by default: "token" for gathered experts and for K not a multiple of
    BATCH_BLOCK_K, else "batch". It depends on the matrix only (a token's bits do not depend on T)."""
    return "token" if gathered or k_pad % BATCH_BLOCK_K else "batch"


def quant_linear_gemv(x: torch.Tensor | Int8Activations, data: torch.Tensor, shape: tuple[int, int], fmt: str,
                      block_n: int | None = None, block_k: int | None = None, out_dtype: torch.dtype | None = None,
                      experts: torch.Tensor | None = None, expert_rows: int = 0, x_per_slot: int = 1,
                      num_warps: int | None = None, out: torch.Tensor | None = None,
                      route: str | None = None, block_t: int | None = None,
                      depth: int | None = None, unroll: int | None = None, chain: int | None = None,
                      lane_tree: bool | None = None) -> torch.Tensor:
    """The integer GEMV (see the module docstring) of x, a tensor or its `Int8Activations` (quantized once for
    several matrices that read the same input). x has at most MAX_GEMV_TOKENS rows; the result is `[T, N]` in
    `out_dtype` (default fp32), written into `out` when given (a view with unit column stride, such as columns of
    a wider buffer). With `experts` `[S]` (int), W stacks experts of `expert_rows` rows each and the result is
    `[S, expert_rows]`: row s = x[s // x_per_slot] · W_{experts[s]}ᵀ. `route` ("token" or "batch"; default
    `gemv_route`) picks the kernel; both give the same bits at the same K tile. `block_t`: tokens per
    program of the batch route (default BATCH_TOKENS); `depth`, `unroll`: its weight tiles loaded ahead and K tiles
    per turn of its loop, 1 or 2 each (default `batch_pipeline`); `chain`: its `dp4a` per dependent chain, 2, 4 or 8
    (default `batch_chain`); `lane_tree`: whether its block positions' sums meet by exchanging halves between lanes
    (`_lane_tree_sum`; default `batch_lane_tree`; on one warp only). None of them changes a result's bits."""
    if triton is None:
        raise RuntimeError("the Triton GEMV needs the triton package")
    if not isinstance(x, Int8Activations):  # refused before the quantization's launch: no kernel sees bad input
        _groupwise_codec(fmt)
        _check_features(_checked_tokens(x, experts is None).shape[1], shape[1])
    acts = x if isinstance(x, Int8Activations) else quantize_activations(x)
    product = _Product(acts, data, shape, fmt, out, out_dtype, experts, expert_rows)
    route = route or gemv_route(product.k_pad, experts is not None)
    if route not in ("token", "batch"):
        raise ValueError(f"unknown GEMV route {route!r}")
    if route != "token" and experts is not None:
        raise ValueError(f"the {route} route takes whole matrices, not gathered experts")
    block_k = block_k or gemv_block_k(product.k_pad, route)
    if product.k_pad % block_k:
        raise ValueError(f"block_k {block_k} does not divide the padded K of {product.k_pad}")
    if chain not in (None, 2, 4, 8):
        raise ValueError(f"a dp4a chain holds 2, 4 or 8 products, not {chain}")
    if route == "batch":
        programs, args, constants = product.batch(block_n, block_t, depth, unroll, chain,
                                                  lane_tree if (num_warps or 1) == 1 else False)
        _gemv_batch_kernel[(programs,)](acts.blocks, product.tokens, acts.blocks.shape[1], *args, **constants,
                                        BLOCK_K=block_k, BLOCK_T=block_t or product.block_t, ASM=ASM,
                                        num_warps=num_warps or 1, **launch_options(data.device))
        return product.out
    # the H200 sweep's best (docs/performance.md): 2 rows on 1 warp for whole matrices, 4 on 2 for gathered experts
    codec, planes, n, out = product.codec, product.planes, product.n, product.out
    default_n, default_warps = (256, 2) if INTERPRETED else (4, 2) if experts is not None else (2, 1)
    block_n = block_n or default_n
    slots = out.shape[0]
    grid = (triton.cdiv(n, block_n) * (1 if experts is not None else product.tokens),
            slots if experts is not None else 1)
    _gemv_kernel[grid](acts.blocks, product.base, product.high, product.scales, out,
                       experts if experts is not None else product.base, product.tokens if experts is None else 1, n,
                       product.k_pad, planes[0].row_bytes // 4, _high_row_units(codec, planes), product.gpr,
                       acts.blocks.shape[1], out.stride(0), product.bias, BITS=codec.bits, GROUP=codec.group,
                       BLOCK_N=block_n, BLOCK_K=block_k, GATHER=experts is not None, X_PER_SLOT=x_per_slot, ASM=ASM,
                       num_warps=num_warps or default_warps, **launch_options(data.device))
    return out


def quant_linear_gemv_pair(x: Int8Activations, first: tuple, second: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Two integer GEMVs of the same input in one launch (`_gemv_batch_pair_kernel`): `first` and `second` are
    (data, shape, fmt, out) with `out` a `[T, N]` view with unit column stride (or None: fp32 results). Both
    matrices must take the batch route (`gemv_route`); each result has the bits `quant_linear_gemv` gives it
    alone. Returns both results."""
    if triton is None:
        raise RuntimeError("the Triton GEMV needs the triton package")
    products = [_Product(x, data, shape, fmt, out, None, None, 0) for data, shape, fmt, out in (first, second)]
    if any(gemv_route(p.k_pad) != "batch" for p in products):
        raise ValueError("a GEMV pair takes two matrices of the batch route (padded K a multiple of "
                         f"{BATCH_BLOCK_K}), not K = {[p.k_pad for p in products]}")
    block_t = min(p.block_t for p in products)  # one token tile for the launch (it never changes a bit)
    (programs, args, constants), (programs2, args2, constants2) = (p.batch(block_t=block_t) for p in products)
    _gemv_batch_pair_kernel[(programs + programs2,)](
        x.blocks, products[0].tokens, x.blocks.shape[1], programs, *args, *args2, **constants,
        **{name + "2": value for name, value in constants2.items()}, BLOCK_K=BATCH_BLOCK_K,
        BLOCK_T=block_t, ASM=ASM, num_warps=1, **launch_options(x.blocks.device))
    return products[0].out, products[1].out


def _lane_tree_sums() -> bool:
    """Whether the batch route can sum its positions in `_lane_tree_sum` (on one warp): with its shuffles emulated
    under the interpreter, or as `shfl` where Triton puts position p in lane p (checked on the H200 up to Triton
    3.6, `BLOCKS_FIRST`; later versions keep the reduction across lanes)."""
    return INTERPRETED or (ASM and bool(BLOCKS_FIRST))


def _checked_tokens(x: torch.Tensor, whole: bool) -> torch.Tensor:
    if whole and not 1 <= x.shape[0] <= MAX_GEMV_TOKENS:
        raise ValueError(f"the GEMV takes 1..{MAX_GEMV_TOKENS} tokens, not {x.shape[0]}")
    return x


class _Product:
    """One integer GEMV's operands, checked: the matrix's planes, the input records and the output (allocated
    when not given)."""

    def __init__(self, acts: Int8Activations, data: torch.Tensor, shape: tuple[int, int], fmt: str,
                 out: torch.Tensor | None, out_dtype: torch.dtype | None, experts: torch.Tensor | None,
                 expert_rows: int):
        self.codec, self.base, self.high, self.scales, self.planes = _planes(data, shape, fmt)
        self.tokens = _checked_tokens(acts.source, experts is None).shape[0]
        self.n, k = shape if experts is None else (expert_rows, shape[1])
        _check_features(acts.shape[1], k)
        self.gpr = self.codec.groups_per_row(k)
        self.k_pad = self.gpr * self.codec.group
        if acts.blocks.shape[1] * 32 < self.k_pad:
            raise ValueError(f"the activation records cover {acts.blocks.shape[1] * 32} lanes, the matrix "
                             f"{self.k_pad}")
        slots = self.tokens if experts is None else experts.numel()
        if out is None:
            out = torch.empty((slots, self.n), dtype=out_dtype or torch.float32, device=data.device)
        elif out.shape != (slots, self.n) or out.stride(1) != 1 or out.device != data.device:
            raise ValueError(f"out must be a [{slots}, {self.n}] view with unit column stride on {data.device}, got "
                             f"{list(out.shape)} strides {out.stride()} on {out.device}")
        self.out = out
        self.bias = 0 if self.codec.bits == 8 else 0x01010101 << (self.codec.bits - 1)  # the code offset per byte
        # the batch route's tile choices go by the token tile a program fills, the next power of two: 5-7 tokens
        # run the 8-token tile the H200 sweeps tuned at 8 (masked rows cost what live ones do), 3 the 4-token one
        self.tile_tokens = 1 << (self.tokens - 1).bit_length()
        self.block_t = batch_block_t(self.tile_tokens, self.codec.bits, self.k_pad)

    def batch(self, block_n: int | None = None, block_t: int | None = None, depth: int | None = None,
              unroll: int | None = None, chain: int | None = None,
              lane_tree: bool | None = None) -> tuple[int, tuple, dict]:
        """The batch route's launch for this product: (programs, the kernel's per-matrix arguments, its per-matrix
        constants)."""
        bits = self.codec.bits
        tiles = self.tile_tokens
        block_n = block_n or (256 if INTERPRETED else batch_block_n(tiles, bits))
        default_depth, default_unroll = batch_pipeline(tiles, self.n, self.k_pad, bits)
        # `_load_blocks` reads the high plane as int32 words and the scales as their fp16 bits
        high_words, high_row_words = (self.high.view(torch.int32), self.planes[1].row_bytes // 4) \
            if len(self.planes) == 3 else (self.high, 0)
        programs = triton.cdiv(self.n, block_n) * triton.cdiv(self.tokens, block_t or self.block_t)
        args = (self.base, high_words, self.scales.view(torch.int16), self.out, self.n, self.k_pad,
                self.planes[0].row_bytes // 4, high_row_words, self.gpr, self.out.stride(0), self.bias)
        if lane_tree is None:
            lane_tree = batch_lane_tree(tiles, bits, block_n, block_t or self.block_t)
        constants = {"BITS": bits, "GROUP": self.codec.group, "BLOCK_N": block_n, "DEPTH": depth or default_depth,
                     "UNROLL": unroll or default_unroll, "CHAIN": chain or batch_chain(tiles, bits, self.k_pad),
                     "LANE_TREE": lane_tree and _lane_tree_sums()}
        return programs, args, constants


def batch_pipeline(tokens: int, rows: int, k_pad: int, bits: int) -> tuple[int, int]:
    """(depth, unroll) of the batch route: the weight tiles it loads ahead (1 or 2) and the K tiles per turn of its
    loop (1 or 2). Few programs (up to 8,192 rows at one token and from 8 tokens on, 12,288 at 4-7 tokens) keep
    too few weight bytes in flight per SM; a second tile ahead helps them, and at one token only when the loop is
    unrolled, so that the tile lands in the registers it is used from (the long-K ones: K ≥ 6,144). From 8 tokens
    on, q5 programs that hold all 8 tokens (K < 8,192: `batch_block_t`) gain more from the registers a tile fewer
    frees (27B GDN v|z, GDN output and attention gate/value). Elsewhere (gate/up, the head, 2-3 tokens, q8 at 4
    tokens or more) one tile ahead measured best; unrolling costs more tokens their registers. From the H200 sweeps
    (`scripts/device/gemv_bench.py --depth 1,2 --unroll 1,2`, docs/performance.md). Neither changes the bits."""
    if tokens == 1:
        return (2, 2) if rows <= 8192 and k_pad >= 6144 else (1, 1)
    if tokens >= 8:
        return (2, 1) if rows <= 8192 and bits != 8 and (bits != 5 or k_pad >= 8192) else (1, 1)
    return (2, 1) if tokens >= 4 and rows <= 12288 and bits != 8 else (1, 1)


def batch_lane_tree(tokens: int, bits: int, block_n: int, block_t: int) -> bool:
    """Whether the batch route's positions meet by exchanging halves between lanes (`_lane_tree_sum`) rather than
    in a reduction across lanes per sum: from 8 tokens on, in the 4- and 5-bit programs of 32 sums (4 rows × 8
    tokens). Elsewhere the loop that ptxas schedules around the other epilogue measured faster (or the epilogue is
    a small share of the program). From the H200 sweep at 8 tokens (`scripts/device/gemv_bench.py --lane-tree 0,1`,
    docs/performance.md). It never changes a bit."""
    return tokens >= 8 and bits in (4, 5) and block_n * block_t == 32


def batch_chain(tokens: int, bits: int, k_pad: int) -> int:
    """The batch route's `dp4a` per dependent chain (`_block_dots`) from 8 tokens on: 8 for q6 (the head), whose
    unpacking gives the scheduler other work beside the long chains, and for q5 programs of all 8 tokens with
    K ≥ 6,144 (the 27B GDN output: 12.6 against 15.5 µs with the lane tree), 4 for the other q5; else, and below 8
    tokens, 2. From the H200 sweeps at 8 tokens (`scripts/device/gemv_bench.py --tokens 8 --chain 2,4,8`,
    docs/performance.md). It never changes a bit."""
    if tokens < 8:
        return 2
    if bits == 5:
        return 8 if k_pad >= 6144 and batch_block_t(tokens, bits, k_pad) == 8 else 4
    return 8 if bits == 6 else 2


def batch_block_n(tokens: int, bits: int) -> int:
    """Rows per program of the batch route: 2 for one token and for q5 matrices below 8 tokens, else 4 (the H200
    sweeps' best at T = 1, 2, 4, 8, 16, the q5 one at 8 tokens with `batch_chain`'s chains; docs/performance.md).
    Rows never change a result's bits."""
    return 2 if tokens == 1 or (bits == 5 and tokens < 8) else 4


def batch_block_t(tokens: int, bits: int, k_pad: int) -> int:
    """Tokens per program of the batch route: up to BATCH_TOKENS, except 4 for q5 matrices with K ≥ 8,192 from 8
    tokens on (27B down: two programs per row tile, the second reading the weights from L2, beat one holding all
    8 tokens' records; the H200 sweep at 8 tokens, docs/performance.md; the GDN output, K = 6,144, holds all 8
    since its lane-tree epilogue with chains of 8: 12.6 against 14.4 µs). Tokens per program never change a
    result's bits."""
    if bits == 5 and tokens >= 8 and k_pad >= 8192:
        return 4
    return min(BATCH_TOKENS, triton.next_power_of_2(tokens))


def group_pairs(expert_ids: torch.Tensor, experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile plan of `quant_linear_grouped` for the (token, expert) pairs `expert_ids` `[P]` (pair p = token
    p // top_k's choice p % top_k): pairs sorted by expert, each expert's run padded to whole tiles of `block`.
    Returns (tile_experts `[tiles]` int64: the expert of each tile, `experts` past the last used tile;
    tile_pairs `[tiles · block]` int64: pair ids, -1 for padding). `tiles` = ⌈P / block⌉ + experts, an upper
    bound from host ints: the plan is built on the device with no host synchronisation."""
    flat = expert_ids.reshape(-1).long()
    pairs = flat.numel()
    tiles = -(-pairs // block) + experts
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    tiles_per_expert = (counts + block - 1) // block
    tile_end = torch.cumsum(tiles_per_expert, 0)
    first_pair = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=flat.device) - first_pair[sorted_experts]
    tile_pairs = torch.full((tiles * block,), -1, dtype=torch.long, device=flat.device)
    tile_pairs[(tile_end - tiles_per_expert)[sorted_experts] * block + rank] = order
    tile_experts = torch.searchsorted(tile_end, torch.arange(tiles, device=flat.device), right=True)
    return tile_experts, tile_pairs


def quant_linear_grouped(x: torch.Tensor, data: torch.Tensor, shape: tuple[int, int], fmt: str,
                         plan: tuple[torch.Tensor, torch.Tensor], pairs: int, expert_rows: int, x_per_pair: int,
                         block: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Many tokens through their experts in one launch (MoE prefill): W stacks experts of `expert_rows` rows
    (`shape` is the whole stack); with the tile plan of `group_pairs(ids, experts, block)`, row p of the result
    `[pairs, expert_rows]` is x[p // x_per_pair] · W_{ids[p]}ᵀ. Each program dequantizes one BLOCK_N × BLOCK_K
    weight tile of its tile's expert per step and meets the tile's `block` gathered x rows through `tl.dot`
    (weights rounded to x's dtype, fp32 accumulation) — an expert's weights are read once per tile of its pairs,
    not once per pair."""
    if triton is None:
        raise RuntimeError("the Triton grouped product needs the triton package")
    codec, base, high, scales, planes = _planes(data, shape, fmt)
    tile_experts, tile_pairs = plan
    k = shape[1]
    gpr = codec.groups_per_row(k)
    k_pad = gpr * codec.group
    if x.shape[1] != k_pad or x.stride(1) != 1:
        x = torch.nn.functional.pad(x, (0, k_pad - x.shape[1])).contiguous()
    out = torch.empty((pairs, expert_rows), dtype=out_dtype or x.dtype, device=x.device)
    block_n = 256 if INTERPRETED else 64
    block_k = _block_k(k_pad)
    experts = shape[0] // expert_rows
    _grouped_kernel[(triton.cdiv(expert_rows, block_n), tile_experts.numel())](
        x, base, high, scales, out, tile_experts, tile_pairs, expert_rows, k_pad, planes[0].row_bytes // 4,
        _high_row_units(codec, planes), gpr, x.stride(0), out.stride(0), experts,
        BITS=codec.bits, GROUP=codec.group, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_T=block,
        X_PER_SLOT=x_per_pair, IEEE=x.dtype == torch.float32,
        num_warps=8,  # 4 warps spill registers at 64 × 64 tiles (scripts/compile_kernels.py --resources)
        **launch_options(x.device))
    return out


def dequantize(data: torch.Tensor, shape: tuple[int, int], fmt: str, dtype: torch.dtype = torch.bfloat16,
               out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """W `[N, K]` in `dtype` (rounded once from fp32 scale × code), into `out` when given (a scratch buffer of at
    least N·K elements, reused across matrices by the prefill route). With `rows` (a device int tensor `[R]`),
    only those rows, in that order: `[R, K]` (embedding lookups, one expert's block)."""
    if triton is None:
        raise RuntimeError("the Triton dequantizer needs the triton package")
    codec, base, high, scales, planes = _planes(data, shape, fmt)
    n, k = shape if rows is None else (rows.numel(), shape[1])
    gpr = codec.groups_per_row(k)
    result = torch.empty((n, k), dtype=dtype, device=data.device) if out is None else out[: n * k].view(n, k)
    block_n, block_k = (256, 128) if INTERPRETED else (16, 128)
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        base, high, scales, result, rows if rows is not None else base, n, k, planes[0].row_bytes // 4,
        _high_row_units(codec, planes), gpr, BITS=codec.bits, GROUP=codec.group, BLOCK_N=block_n, BLOCK_K=block_k,
        GATHER=rows is not None, **launch_options(data.device))
    return result
