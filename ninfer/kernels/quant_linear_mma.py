"""The integer GEMV's tensor-core route: y = x · Wᵀ for 2..8 tokens a program with int8 `mma` instead of `dp4a`.

Contract: the batch route's (`ninfer.kernels.quant_linear`): W a q4 g64 groupwise matrix whose padded K is a multiple
of BATCH_BLOCK_K (1,024 lanes), x its `Int8Activations` records; y[t, n] has the bits the batch route gives it at
any token count — the same exact integer block dots D, the same float steps acc_p += D · (w_scale · x_scale) per
32-lane block position p of the 1,024-lane tile, and the same halving tree over the 32 positions.

Why: at 8 tokens the batch route spends 32 `dp4a` a lane per 16 rows × 32 lanes × 8 tokens and is bound by its
instruction issue at about half the read bandwidth (docs/performance.md); one `mma.m16n8k32` does those 4,096
products. The eighth and nineteenth sessions' tensor-core routes lost on their loads (a warp load touched 8 rows
× 16 bytes for 4-byte words, and every `mma` reloaded its activations). Here a lane loads its row's whole 32-lane
block as one 16-byte vector, so the 4 lanes of a row read 64 contiguous bytes, and the activations are read once
per tile for all the program's rows. The price is that one `mma` no longer sums one block for 8 tokens:

  * warp w owns the block positions 4w .. 4w + 3 of every tile (8 warps); lane l = 4g + t holds rows g and g + 8
    of its 16-row stripe at position p = 4w + t, all 4 of the block's 8-lane units;
  * `mma` k-chunk t (8 of the 32 k) is then lane t's unit u of its own block, so the 4 chunks are 4 different
    blocks; the activations (B, 32 × 8) are block-diagonal: column n belongs to block slot n // 2 and token
    2j + n % 2 in the j-th of 4 passes, and is zero outside its slot's chunk. Four `mma` (units 0..3) accumulate
    each pass's D exactly in C, from the magic start 0x4B400000 − OFFSET · x_sum (the batch route's `_block_dots`);
    lane (g, t) ends a pass with D of its own block for rows g, g + 8 and tokens 2j, 2j + 1 (D's columns 2t, 2t + 1).

So 16 `mma` a stripe and tile (4× the tensor-core work of a dense product, which the tensor cores have to spare)
and no data exchanged between lanes inside the loop. B's non-zero quads are loaded only by the lanes whose slot
they are (g // 2 = t), predicated; the others' registers hold zeros.

Runs under TRITON_INTERPRET=1: the `mma` and the vector loads are emulated with tensor ops there (and on backends
without NVIDIA's PTX).
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

MMA_WARPS = 8  # a program's warps: 4 block positions each, the 32 of a 1,024-lane tile
MMA_TOKENS = 8  # tokens a program holds (the 4 passes of 2 tokens)
STRIPE = 16  # rows of one `mma` stripe
# inline PTX (the `mma`, vector loads) on NVIDIA GPUs; tensor-op emulation under the interpreter and elsewhere
MMA_ASM = os.environ.get("TRITON_INTERPRET") != "1" and torch.version.hip is None

if triton is not None:
    from ninfer.kernels.dependent_launch import wait_for_inputs

    @triton.jit
    def _opaque(values, ASM: tl.constexpr):
        """`values` unchanged, through an inline move on NVIDIA GPUs: the compiler no longer sees how they were
        made, so it keeps the tensors one element a thread (the lane roles above) rather than vectorizing them."""
        if ASM:
            values = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [values], dtype=tl.int32, is_pure=True,
                                               pack=1)
        return values

    @triton.jit
    def _load4(ptrs, ASM: tl.constexpr):
        """The 4 int32 words at `ptrs` (16-byte aligned, read-only data): one `ld.global.nc.v4` a lane."""
        if ASM:
            w0, w1, w2, w3 = tl.inline_asm_elementwise(
                "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptrs],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
        else:
            w0 = tl.load(ptrs)
            w1 = tl.load(ptrs + 1)
            w2 = tl.load(ptrs + 2)
            w3 = tl.load(ptrs + 3)
        return w0, w1, w2, w3

    @triton.jit
    def _load2(ptrs, ASM: tl.constexpr):
        """The 2 int32 words at `ptrs` (8-byte aligned, read-only data): one `ld.global.nc.v2` a lane."""
        if ASM:
            w0, w1 = tl.inline_asm_elementwise("ld.global.nc.v2.b32 {$0, $1}, [$2];", "=r,=r,l", [ptrs],
                                               dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        else:
            w0 = tl.load(ptrs)
            w1 = tl.load(ptrs + 1)
        return w0, w1

    @triton.jit
    def _load_u16(ptrs, ASM: tl.constexpr):
        """The 16-bit unit at `ptrs` (read-only data), zero-extended to int32."""
        if ASM:
            r = tl.inline_asm_elementwise("ld.global.nc.u16 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32,
                                          is_pure=True, pack=1)
        else:
            r = tl.load(ptrs).to(tl.int32) & 0xFFFF
        return r

    @triton.jit
    def _bytes(values, WARPS: tl.constexpr, SIGNED: tl.constexpr):
        """A warp-wide operand register `[WARPS · 32]` as `[WARPS, 8 (g), 4 (t), 4 bytes]` (emulation only)."""
        b = (tl.reshape(values, [WARPS, 8, 4])[:, :, :, None] >> (8 * tl.arange(0, 4))[None, None, None, :]) & 0xFF
        if SIGNED:
            b = (b ^ 0x80) - 0x80
        return b

    @triton.jit
    def _lane_columns(d, WARPS: tl.constexpr):
        """`[WARPS, 8 (row), 8 (column)]` → lane (g, t)'s columns 2t and 2t + 1 of row g, as two `[WARPS · 32]`."""
        even, odd = tl.split(tl.reshape(d, [WARPS, 8, 4, 2]))
        return tl.reshape(even, [WARPS * 32]), tl.reshape(odd, [WARPS * 32])

    @triton.jit
    def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, WARPS: tl.constexpr, ASM: tl.constexpr):
        """D = A · B + C of one `mma.sync.m16n8k32` (A unsigned bytes, B signed bytes, C and D int32, exact) per warp,
        its operands one element a lane (`[WARPS · 32]`, lane 4g + t of each warp), in PTX's fragment layout: A's
        row g from a0 (k = 4t..4t+3) and a2 (k = 16 + 4t..), row g + 8 from a1 and a3; B's column g from b0 and b1
        (the same k); C and D of lane (g, t): (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)."""
        if ASM:
            d0, d1, d2, d3 = tl.inline_asm_elementwise(
                "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
                "{$10, $11, $12, $13};", "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r",
                [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                is_pure=True, pack=1)
        else:  # [warp, row g, column n]: Σ over the lanes t and bytes of both k halves
            x0 = _bytes(b0, WARPS, True)[:, None, :, :, :]
            x1 = _bytes(b1, WARPS, True)[:, None, :, :, :]
            low = tl.sum(tl.sum(_bytes(a0, WARPS, False)[:, :, None, :, :] * x0
                                + _bytes(a2, WARPS, False)[:, :, None, :, :] * x1, axis=4), axis=3)
            high = tl.sum(tl.sum(_bytes(a1, WARPS, False)[:, :, None, :, :] * x0
                                 + _bytes(a3, WARPS, False)[:, :, None, :, :] * x1, axis=4), axis=3)
            low_even, low_odd = _lane_columns(low, WARPS)
            high_even, high_odd = _lane_columns(high, WARPS)
            d0 = low_even + c0
            d1 = low_odd + c1
            d2 = high_even + c2
            d3 = high_odd + c3
        return d0, d1, d2, d3

    @triton.jit
    def _stack4(a, b, c, d):
        """Four `[LANES, …]` tensors as `[LANES, 4, …]`, in order."""
        return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), [a.shape[0], 4])

    @triton.jit
    def _stripe_weights(base_ptr, scale_ptr, rows_lo, rows_hi, blk, row_words, gpr, ASM: tl.constexpr):
        """A lane's weights of one stripe and tile, as loaded: its block's 4 base words for rows g and g + 8 (one
        16-byte load each) and the fp16 bits of their scales (64-lane groups: two blocks)."""
        lo = _load4(base_ptr + rows_lo * row_words + blk * 4, ASM)
        hi = _load4(base_ptr + rows_hi * row_words + blk * 4, ASM)
        return lo, hi, _load_u16(scale_ptr + rows_lo * gpr + blk // 2, ASM), \
            _load_u16(scale_ptr + rows_hi * gpr + blk // 2, ASM)

    @triton.jit
    def _unpack(lo, hi, bias):
        """A stripe's A operands from its base words (`_stripe_weights`): per unit u, the offset-binary codes of the
        even lanes (8u + 0, 2, 4, 6) and odd lanes of rows g and g + 8 as byte quads (the batch route's
        `_weight_quads` for q4), the order of the activation records' quads."""
        e0 = ((lo[0] & 0x0F0F0F0F) ^ bias, (lo[1] & 0x0F0F0F0F) ^ bias, (lo[2] & 0x0F0F0F0F) ^ bias,
              (lo[3] & 0x0F0F0F0F) ^ bias)
        o0 = (((lo[0] >> 4) & 0x0F0F0F0F) ^ bias, ((lo[1] >> 4) & 0x0F0F0F0F) ^ bias,
              ((lo[2] >> 4) & 0x0F0F0F0F) ^ bias, ((lo[3] >> 4) & 0x0F0F0F0F) ^ bias)
        e1 = ((hi[0] & 0x0F0F0F0F) ^ bias, (hi[1] & 0x0F0F0F0F) ^ bias, (hi[2] & 0x0F0F0F0F) ^ bias,
              (hi[3] & 0x0F0F0F0F) ^ bias)
        o1 = (((hi[0] >> 4) & 0x0F0F0F0F) ^ bias, ((hi[1] >> 4) & 0x0F0F0F0F) ^ bias,
              ((hi[2] >> 4) & 0x0F0F0F0F) ^ bias, ((hi[3] >> 4) & 0x0F0F0F0F) ^ bias)
        return e0, o0, e1, o1

    @triton.jit
    def _pass(acc, quads, x, ws_lo, ws_hi, WARPS: tl.constexpr, ASM: tl.constexpr):
        """One pass (tokens 2j, 2j + 1; `x` from `_pass_activations`) over one stripe (`quads` from `_unpack`): 4
        `mma` (units 0..3) from the magic starts, then the batch route's float steps per row and token:
        acc += D · (w_scale · x_scale). acc: (row g / token 2j, g / 2j + 1, g + 8 / 2j, g + 8 / 2j + 1)."""
        e0, o0, e1, o1 = quads
        rec_even, rec_odd, start0, start1, xs0, xs1 = x
        # chunk t's two k halves: two units' even quads, then two units' odd quads (consecutive record words, so
        # that each `mma`'s B pair is two consecutive registers of one vector load)
        c0, c1, c2, c3 = _mma(e0[0], e1[0], e0[1], e1[1], rec_even[0], rec_even[1], start0, start1, start0, start1,
                              WARPS, ASM)
        c0, c1, c2, c3 = _mma(e0[2], e1[2], e0[3], e1[3], rec_even[2], rec_even[3], c0, c1, c2, c3, WARPS, ASM)
        c0, c1, c2, c3 = _mma(o0[0], o1[0], o0[1], o1[1], rec_odd[0], rec_odd[1], c0, c1, c2, c3, WARPS, ASM)
        c0, c1, c2, c3 = _mma(o0[2], o1[2], o0[3], o1[3], rec_odd[2], rec_odd[3], c0, c1, c2, c3, WARPS, ASM)
        d0 = c0.to(tl.float32, bitcast=True) - 12582912.0
        d1 = c1.to(tl.float32, bitcast=True) - 12582912.0
        d2 = c2.to(tl.float32, bitcast=True) - 12582912.0
        d3 = c3.to(tl.float32, bitcast=True) - 12582912.0
        return (acc[0] + d0 * (ws_lo * xs0), acc[1] + d1 * (ws_lo * xs1),
                acc[2] + d2 * (ws_hi * xs0), acc[3] + d3 * (ws_hi * xs1))

    @triton.jit
    def _pass_pointers(x_blocks_ptr, zeros_ptr, token0, T, g, slot, loads_b, x_block_count, j: tl.constexpr):
        """Pass j's record addresses at tile 0 for a lane: of its B quads (token 2j + g % 2 at its block where it
        loads B, else 8 zero words, which every tile reads again), and of tokens 2j, 2j + 1 (clamped into the T
        tokens) at its block."""
        tok_b = tl.minimum(token0 + 2 * j + g % 2, T - 1)
        tok0 = tl.minimum(token0 + 2 * j, T - 1)
        tok1 = tl.minimum(token0 + 2 * j + 1, T - 1)
        rec_b = tl.where(loads_b, x_blocks_ptr + (tok_b * x_block_count + slot) * 12, zeros_ptr + 0 * slot)
        return (rec_b, x_blocks_ptr + (tok0 * x_block_count + slot) * 12 + 8,
                x_blocks_ptr + (tok1 * x_block_count + slot) * 12 + 8)

    @triton.jit
    def _pass_activations(pointers, tile_b, tile_x, OFFSET: tl.constexpr, ASM: tl.constexpr):
        """A pass's activations for a lane at a tile (`pointers` from `_pass_pointers` moved by `tile_b` and
        `tile_x` words): its B quads (the even quads of units 0..3, then the odd; zeros where it does not load B),
        the magic starts and x scales of the pass's two tokens."""
        rec_b, meta0, meta1 = pointers
        rec_even = _load4(rec_b + tile_b, ASM)
        rec_odd = _load4(rec_b + tile_b + 4, ASM)
        scale0, sum0 = _load2(meta0 + tile_x, ASM)
        scale1, sum1 = _load2(meta1 + tile_x, ASM)
        return (rec_even, rec_odd, 0x4B400000 - OFFSET * sum0, 0x4B400000 - OFFSET * sum1,
                scale0.to(tl.float32, bitcast=True), scale1.to(tl.float32, bitcast=True))

    @triton.jit
    def _fp32(fp16_bits):
        return fp16_bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _stripe_sums(out_ptr, acc0, acc1, acc2, acc3, token0, row, T, N, stride_out, WARPS: tl.constexpr):
        """Store a stripe's 16 sums (pass j's accj = (g / 2j, g / 2j + 1, g + 8 / 2j, g + 8 / 2j + 1)), each the
        batch route's `_pairwise_sum` over the 32 positions p = 4w + t (lane 4g + t of warp w): position p + 16
        onto p, then + 8, … + 1, all 16 sums of a lane in one tensor, so that each level across the warps is one
        exchange through shared memory."""
        LANES: tl.constexpr = WARPS * 32
        s0 = _stack4(acc0[0], acc0[1], acc0[2], acc0[3])
        s1 = _stack4(acc1[0], acc1[1], acc1[2], acc1[3])
        s2 = _stack4(acc2[0], acc2[1], acc2[2], acc2[3])
        s3 = _stack4(acc3[0], acc3[1], acc3[2], acc3[3])
        sums = tl.join(tl.join(s0, s2), tl.join(s1, s3))
        # [LANES, 4 (value), 2 (pass bit 1), 2 (pass bit 0)] → [LANES, 16], index 4j + value
        sums = tl.reshape(tl.permute(sums, (0, 2, 3, 1)), [LANES, 16])
        r = tl.reshape(sums, [WARPS, 8, 4, 16])
        r = tl.sum(tl.reshape(r, [2, WARPS // 2, 8, 4, 16]), axis=0)  # p + 16: warp w + 4
        r = tl.sum(tl.reshape(r, [2, WARPS // 4, 8, 4, 16]), axis=0)  # p + 8: warp w + 2
        r = tl.sum(tl.reshape(r, [2, 8, 4, 16]), axis=0)  # p + 4: warp w + 1
        r = tl.sum(tl.reshape(r, [8, 2, 2, 16]), axis=1)  # p + 2: lane t + 2
        r = tl.sum(r, axis=1)  # p + 1: [8 (g), 16]
        index = tl.arange(0, 16)[None, :]
        rows = row + tl.arange(0, 8)[:, None] + 8 * ((index // 2) % 2)
        tokens = token0 + 2 * (index // 4) + index % 2
        tl.store(out_ptr + tokens.to(tl.int64) * stride_out + rows, r, mask=(rows < N) & (tokens < T))

    @triton.jit
    def _gemv_mma_kernel(x_blocks_ptr, zeros_ptr, T, x_block_count, base_ptr, scale_ptr, out_ptr, N, k_pad,
                         row_words, gpr, stride_out, bias, STRIPES: tl.constexpr, X_AHEAD: tl.constexpr,
                         WARPS: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
        """STRIPES (1 or 2) × 16 rows × 8 tokens a program (q4, 64-lane groups); see the module docstring."""
        OFFSET: tl.constexpr = 8
        LANES: tl.constexpr = WARPS * 32
        lane_id = _opaque(tl.arange(0, LANES), ASM)
        w = lane_id // 32
        g = (lane_id % 32) // 4
        t = lane_id % 4
        token_tiles = tl.cdiv(T, 8)
        row0 = (tl.program_id(0) // token_tiles) * (16 * STRIPES)
        token0 = (tl.program_id(0) % token_tiles) * 8
        slot = 4 * w + t  # the lane's block position in every tile
        loads_b = g // 2 == t  # B: the lanes whose column's slot is their chunk
        tiles = k_pad // 1024
        zero = tl.zeros([LANES], dtype=tl.float32)
        r0 = tl.minimum(row0 + g, N - 1).to(tl.int64)
        r1 = tl.minimum(row0 + 8 + g, N - 1).to(tl.int64)
        a0 = (zero, zero, zero, zero)
        a1 = (zero, zero, zero, zero)
        a2 = (zero, zero, zero, zero)
        a3 = (zero, zero, zero, zero)
        w0 = _stripe_weights(base_ptr, scale_ptr, r0, r1, slot, row_words, gpr, ASM)
        if STRIPES == 2:
            r2 = tl.minimum(row0 + 16 + g, N - 1).to(tl.int64)
            r3 = tl.minimum(row0 + 24 + g, N - 1).to(tl.int64)
            b0 = (zero, zero, zero, zero)
            b1 = (zero, zero, zero, zero)
            b2 = (zero, zero, zero, zero)
            b3 = (zero, zero, zero, zero)
            w1 = _stripe_weights(base_ptr, scale_ptr, r2, r3, slot, row_words, gpr, ASM)
        p0 = _pass_pointers(x_blocks_ptr, zeros_ptr, token0, T, g, slot, loads_b, x_block_count, 0)
        p1 = _pass_pointers(x_blocks_ptr, zeros_ptr, token0, T, g, slot, loads_b, x_block_count, 1)
        p2 = _pass_pointers(x_blocks_ptr, zeros_ptr, token0, T, g, slot, loads_b, x_block_count, 2)
        p3 = _pass_pointers(x_blocks_ptr, zeros_ptr, token0, T, g, slot, loads_b, x_block_count, 3)
        stride_b = tl.where(loads_b, 384, 0)  # the zero words stay put
        wait_for_inputs(PDL)  # the first weight tile streams while the kernel before this one finishes
        if X_AHEAD:  # the records of tile 0, then each turn those of the next tile
            x0 = _pass_activations(p0, 0, 0, OFFSET, ASM)
            x1 = _pass_activations(p1, 0, 0, OFFSET, ASM)
            x2 = _pass_activations(p2, 0, 0, OFFSET, ASM)
            x3 = _pass_activations(p3, 0, 0, OFFSET, ASM)
        for tile in tl.range(0, tiles):
            ahead = tl.minimum(tile + 1, tiles - 1)
            next0 = _stripe_weights(base_ptr, scale_ptr, r0, r1, ahead * 32 + slot, row_words, gpr, ASM)
            if STRIPES == 2:
                next1 = _stripe_weights(base_ptr, scale_ptr, r2, r3, ahead * 32 + slot, row_words, gpr, ASM)
            x_tile = ahead if X_AHEAD else tile
            tile_x = x_tile * 384  # 32 records of 12 words a tile
            tile_b = x_tile * stride_b
            n0 = _pass_activations(p0, tile_b, tile_x, OFFSET, ASM)
            n1 = _pass_activations(p1, tile_b, tile_x, OFFSET, ASM)
            n2 = _pass_activations(p2, tile_b, tile_x, OFFSET, ASM)
            n3 = _pass_activations(p3, tile_b, tile_x, OFFSET, ASM)
            if not X_AHEAD:
                x0, x1, x2, x3 = n0, n1, n2, n3
            lo0, hi0, s0, s1 = w0
            ws0 = _fp32(s0)
            ws1 = _fp32(s1)
            quads = _unpack(lo0, hi0, bias)
            a0 = _pass(a0, quads, x0, ws0, ws1, WARPS, ASM)
            a1 = _pass(a1, quads, x1, ws0, ws1, WARPS, ASM)
            a2 = _pass(a2, quads, x2, ws0, ws1, WARPS, ASM)
            a3 = _pass(a3, quads, x3, ws0, ws1, WARPS, ASM)
            w0 = next0
            if STRIPES == 2:
                lo1, hi1, s2, s3 = w1
                ws2 = _fp32(s2)
                ws3 = _fp32(s3)
                quads1 = _unpack(lo1, hi1, bias)
                b0 = _pass(b0, quads1, x0, ws2, ws3, WARPS, ASM)
                b1 = _pass(b1, quads1, x1, ws2, ws3, WARPS, ASM)
                b2 = _pass(b2, quads1, x2, ws2, ws3, WARPS, ASM)
                b3 = _pass(b3, quads1, x3, ws2, ws3, WARPS, ASM)
                w1 = next1
            if X_AHEAD:
                x0, x1, x2, x3 = n0, n1, n2, n3
        _stripe_sums(out_ptr, a0, a1, a2, a3, token0, row0, T, N, stride_out, WARPS)
        if STRIPES == 2:
            _stripe_sums(out_ptr, b0, b1, b2, b3, token0, row0 + 16, T, N, stride_out, WARPS)

    @triton.jit
    def _rows(group, g, N):
        """The 4 row sets (g, g + 8, g + 16, g + 24) of 32-row group `group`, clamped into [0, N)."""
        row0 = group * 32
        return (tl.minimum(row0 + g, N - 1).to(tl.int64), tl.minimum(row0 + 8 + g, N - 1).to(tl.int64),
                tl.minimum(row0 + 16 + g, N - 1).to(tl.int64), tl.minimum(row0 + 24 + g, N - 1).to(tl.int64))

    @triton.jit
    def _item_weights(base_ptr, scale_ptr, item, tiles, first, step, last_item, g, slot, N, row_words, gpr,
                      ASM: tl.constexpr):
        """The weights of work item `item` (clamped to the program's last): group first + (item // tiles) · step,
        tile item % tiles, both stripes."""
        item = tl.minimum(item, last_item)
        r = _rows(first + (item // tiles) * step, g, N)
        blk = (item % tiles) * 32 + slot
        return (_stripe_weights(base_ptr, scale_ptr, r[0], r[1], blk, row_words, gpr, ASM),
                _stripe_weights(base_ptr, scale_ptr, r[2], r[3], blk, row_words, gpr, ASM))

    @triton.jit
    def _kept(acc, keep):
        return (tl.where(keep, acc[0], 0.0), tl.where(keep, acc[1], 0.0), tl.where(keep, acc[2], 0.0),
                tl.where(keep, acc[3], 0.0))

    @triton.jit
    def _gemv_mma_persistent_kernel(x_blocks_ptr, zeros_ptr, T, x_block_count, base_ptr, scale_ptr, out_ptr, N,
                                    k_pad, row_words, gpr, stride_out, bias, groups, DEPTH: tl.constexpr,
                                    WARPS: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
        """The 2-stripe program made persistent: program p walks the 32-row groups p, p + grid, … (T ≤ 8), their
        K tiles as one sequence of work items, the weights DEPTH items ahead, so that the next group's first
        tiles stream while this one's sums cross the warps."""
        OFFSET: tl.constexpr = 8
        LANES: tl.constexpr = WARPS * 32
        lane_id = _opaque(tl.arange(0, LANES), ASM)
        w = lane_id // 32
        g = (lane_id % 32) // 4
        t = lane_id % 4
        first = tl.program_id(0)
        step = tl.num_programs(0)
        tiles = k_pad // 1024
        items = tl.cdiv(groups - first, step) * tiles
        last_item = items - 1
        slot = 4 * w + t
        loads_b = g // 2 == t
        zero = tl.zeros([LANES], dtype=tl.float32)
        a0 = (zero, zero, zero, zero)
        a1 = (zero, zero, zero, zero)
        a2 = (zero, zero, zero, zero)
        a3 = (zero, zero, zero, zero)
        b0 = (zero, zero, zero, zero)
        b1 = (zero, zero, zero, zero)
        b2 = (zero, zero, zero, zero)
        b3 = (zero, zero, zero, zero)
        w0 = _item_weights(base_ptr, scale_ptr, 0, tiles, first, step, last_item, g, slot, N, row_words, gpr, ASM)
        if DEPTH == 2:
            w1 = _item_weights(base_ptr, scale_ptr, 1, tiles, first, step, last_item, g, slot, N, row_words, gpr,
                               ASM)
        p0 = _pass_pointers(x_blocks_ptr, zeros_ptr, 0, T, g, slot, loads_b, x_block_count, 0)
        p1 = _pass_pointers(x_blocks_ptr, zeros_ptr, 0, T, g, slot, loads_b, x_block_count, 1)
        p2 = _pass_pointers(x_blocks_ptr, zeros_ptr, 0, T, g, slot, loads_b, x_block_count, 2)
        p3 = _pass_pointers(x_blocks_ptr, zeros_ptr, 0, T, g, slot, loads_b, x_block_count, 3)
        stride_b = tl.where(loads_b, 384, 0)
        wait_for_inputs(PDL)
        for item in tl.range(0, items):
            ahead = _item_weights(base_ptr, scale_ptr, item + DEPTH, tiles, first, step, last_item, g, slot, N,
                                  row_words, gpr, ASM)
            tile = item % tiles
            x0 = _pass_activations(p0, tile * stride_b, tile * 384, OFFSET, ASM)
            x1 = _pass_activations(p1, tile * stride_b, tile * 384, OFFSET, ASM)
            x2 = _pass_activations(p2, tile * stride_b, tile * 384, OFFSET, ASM)
            x3 = _pass_activations(p3, tile * stride_b, tile * 384, OFFSET, ASM)
            lo0, hi0, s0, s1 = w0[0]
            lo1, hi1, s2, s3 = w0[1]
            ws0 = _fp32(s0)
            ws1 = _fp32(s1)
            quads = _unpack(lo0, hi0, bias)
            a0 = _pass(a0, quads, x0, ws0, ws1, WARPS, ASM)
            a1 = _pass(a1, quads, x1, ws0, ws1, WARPS, ASM)
            a2 = _pass(a2, quads, x2, ws0, ws1, WARPS, ASM)
            a3 = _pass(a3, quads, x3, ws0, ws1, WARPS, ASM)
            ws2 = _fp32(s2)
            ws3 = _fp32(s3)
            quads1 = _unpack(lo1, hi1, bias)
            b0 = _pass(b0, quads1, x0, ws2, ws3, WARPS, ASM)
            b1 = _pass(b1, quads1, x1, ws2, ws3, WARPS, ASM)
            b2 = _pass(b2, quads1, x2, ws2, ws3, WARPS, ASM)
            b3 = _pass(b3, quads1, x3, ws2, ws3, WARPS, ASM)
            if DEPTH == 2:
                w0 = w1
                w1 = ahead
            else:
                w0 = ahead
            done = tile == tiles - 1
            if done:  # the group's last tile: its sums across the warps, stored
                row0 = (first + (item // tiles) * step) * 32
                _stripe_sums(out_ptr, a0, a1, a2, a3, 0, row0, T, N, stride_out, WARPS)
                _stripe_sums(out_ptr, b0, b1, b2, b3, 0, row0 + 16, T, N, stride_out, WARPS)
            keep = (zero == 0.0) & (tile != tiles - 1)
            a0 = _kept(a0, keep)
            a1 = _kept(a1, keep)
            a2 = _kept(a2, keep)
            a3 = _kept(a3, keep)
            b0 = _kept(b0, keep)
            b1 = _kept(b1, keep)
            b2 = _kept(b2, keep)
            b3 = _kept(b3, keep)


_ZEROS: dict[torch.device, torch.Tensor] = {}


def _zero_words(device: torch.device) -> torch.Tensor:
    """8 zero int32 words on `device` (16-byte aligned), which the lanes that hold no B quads load."""
    if device not in _ZEROS:
        _ZEROS[device] = torch.zeros(8, dtype=torch.int32, device=device)
    return _ZEROS[device]


def quant_linear_gemv_mma(acts, data: torch.Tensor, shape: tuple[int, int], fmt: str, out: torch.Tensor | None = None,
                          stripes: int = 1, x_ahead: bool = False, max_registers: int | None = None,
                          persistent: int = 0, depth: int = 1) -> torch.Tensor:
    """The tensor-core route of the integer GEMV for `acts` (`Int8Activations`, 1..64 tokens in tiles of 8) and a
    q4 g64 matrix whose padded K is a multiple of 1,024: `[T, N]` fp32 (or written into `out`), the bits of
    `quant_linear_gemv`'s batch route. `stripes`: 16-row stripes a program (1 or 2); `x_ahead`: whether each turn
    loads the next tile's activation records; `max_registers`: ptxas's register cap a thread (none of them changes a
    bit)."""
    from ninfer.kernels.dependent_launch import launch_options
    from ninfer.kernels.quant_linear import _Product

    product = _Product(acts, data, shape, fmt, out, None, None, 0)
    if product.codec.bits != 4 or product.codec.group != 64 or product.k_pad % 1024:
        raise ValueError(f"the tensor-core route takes q4 g64 matrices with K padded to a multiple of 1,024, not "
                         f"{fmt} with K = {product.k_pad}")
    if stripes not in (1, 2):
        raise ValueError(f"a program holds 1 or 2 stripes, not {stripes}")
    programs = triton.cdiv(product.n, STRIPE * stripes) * triton.cdiv(product.tokens, MMA_TOKENS)
    registers = {"maxnreg": max_registers} if max_registers else {}
    if persistent:  # `persistent` programs an SM walking the 32-row groups (T ≤ 8)
        groups = triton.cdiv(product.n, 32)
        grid = min(groups, persistent * torch.cuda.get_device_properties(data.device).multi_processor_count
                   if data.is_cuda else 4)
        _gemv_mma_persistent_kernel[(grid,)](acts.blocks, _zero_words(acts.blocks.device), product.tokens,
                                             acts.blocks.shape[1], product.base, product.scales.view(torch.int16),
                                             product.out, product.n, product.k_pad, product.planes[0].row_bytes // 4,
                                             product.gpr, product.out.stride(0), product.bias, groups, DEPTH=depth,
                                             WARPS=MMA_WARPS, ASM=MMA_ASM, num_warps=MMA_WARPS,
                                             **launch_options(data.device), **registers)
        return product.out
    _gemv_mma_kernel[(programs,)](acts.blocks, _zero_words(acts.blocks.device), product.tokens, acts.blocks.shape[1],
                                  product.base, product.scales.view(torch.int16), product.out, product.n, product.k_pad,
                                  product.planes[0].row_bytes // 4, product.gpr, product.out.stride(0), product.bias,
                                  STRIPES=stripes, X_AHEAD=x_ahead, WARPS=MMA_WARPS, ASM=MMA_ASM, num_warps=MMA_WARPS,
                                  **launch_options(data.device), **registers)
    return product.out
