"""The Triton kernels of the integer GEMV (`quant_linear.quant_linear_gemv`, whose docstring states the math): the
token route (`_gemv_kernel`: one token a program, or gathered experts) and the batch route (`_gemv_batch_kernel`,
and `_gemv_batch_pair_kernel` for two matrices of one input in one launch), with the unpacking of the groupwise
planes into `dp4a` byte quads and the fixed-order sums they share. `ASM` (a constexpr argument) selects inline PTX
(`dp4a`, `prmt`, `shfl`, `ld.global.nc`) on NVIDIA GPUs, integer-op emulation under the interpreter and elsewhere.
"""

from __future__ import annotations

from ninfer.kernels.dependent_launch import wait_for_inputs

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

if triton is not None:
    from ninfer.kernels.row_tiles import gemv_rows, row_tile

    # The axis of the batch route's 4-D tensors that holds the 32-lane blocks (tokens and rows follow in that order,
    # the 4 words of a block's units last): it must come first among the dimensions that Triton's load coalescing
    # orders by contiguity, where every one but the words ties. Triton up to 3.6 breaks the tie first dimension
    # first, 3.7 and later last dimension first; with the blocks elsewhere the loads spread rows or tokens over the
    # lanes, and every loop turn pays shuffles to bring them back (sm_90 SASS of the q4 loop at one token: 102
    # instructions either way round, 138 with the other version's placement; `python -m
    # ninfer.kernels.compile_check --resources`). The placement never changes a bit.
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
        the masks; checked over every 16-bit h by tests/kernels/test_quant_linear.py)."""
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
        of its run of 32 / M (an IEEE addition is commutative, so both lanes of a pair get the same bits). On the
        H200 the reduction across lanes held about a tenth of the 8-token gate_up's profile samples."""
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
        conversion instruction (1/8 of the FMA rate); the offset and the magic bits fold into
        one term per token, `start`, shared by a program's rows. CHAIN is the `dp4a` a dependent chain holds: 2
        (even and odd of each unit, then a sum over the units plus `start`), 4 (units 0-1 from `start`, units 2-3,
        one add) or 8 (one chain from `start`: no adds, a longer dependence). int32 sums are exact in any order, so
        CHAIN never changes a bit; which one schedules best depends on the format and the tile (`tuning.BatchTile`)."""
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
        `[BLOCKS, 1, BN, 4]` broadcast in place (checked with `compile_check --resources`: no shared
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
