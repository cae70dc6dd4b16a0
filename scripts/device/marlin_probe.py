"""Probe for the batch-8 bar: an int8 tensor-core GEMV over q5 weights repacked at load so that a warp's `mma`
operands for one 64-lane group of a 16-row stripe are one contiguous 672-byte chunk (Marlin's method: store the
weights in the order the tensor cores consume them), against the dp4a batch route on the same matrices. The
product's route built from it is `ninfer.kernels.stripe_linear` (its own layout of x, timed by `stripe_timing.py`);
this probe keeps the variants that were not taken. Not a product route: q5 only, T ≤ 8 a launch (16 tokens as two
launches), float steps in block order (not the batch route's bits). It answers whether a program of several warps,
each walking its own groups of K with chunks loaded several groups ahead and the warps' sums met once in shared
memory, runs the 27B down projection at 8 tokens in about twice its one-token time, where the ninth session's
one-warp probe (split K into untimed partial sums) did not.

Chunk (stripe s of rows 16s..16s + 15, group j of lanes 64j..64j + 63), 168 int32 words:
  - words 0..127, lane 4g + t's 16-byte vector: the base-plane words (8 lanes of nibbles) of unit t (lanes 8t..8t + 7
    of a 32-lane block) for (block 0, row g), (block 0, row g + 8), (block 1, row g), (block 1, row g + 8);
  - word 128 + lane: the fifth bits of those 32 lanes. The 4 bits that complete int8 quad q (q = 2 · word + parity,
    parity 0 for the even lanes of the unit, 1 for the odd ones) sit at bits 7 − q, 15 − q, 23 − q, 31 − q, so
    `(high << q) & 0x80808080` puts them in the quad's sign bits;
  - word 160 + g: the fp16 scales of rows g (low half) and g + 8 of group j (16 rows × 64 lanes × 5.25 bits).
A quad is the code times 8 as int8 (nibble in bits 3..6, the fifth bit as the sign); the float step takes the 1/8.
The x records are the GEMV's (`activation_quant`): in block b the `mma`'s k-chunk t is the even lanes of unit t
(record word t) and k-chunk 4 + t its odd lanes (word 4 + t), the same lanes on both sides.

Usage (GPU): python3 scripts/device/marlin_probe.py [--tokens 1,8] [--warps 4,8,16] [--depth 1,2] [--only NAME-PART]
       [--kernel asm,xsame,xpacked,xpacked-split,dp4a,dp4a-split,xpacked-l2,loads,pipe] [--prefetch 1,2] [--split 2]
       [--stages 2,3,4] [--maxnreg R]
`--ncu N K TOKENS WARPS DEPTH` only runs one probe for `ncu` (`profile_target`). Without a GPU,
`python3 scripts/device/marlin_probe.py --emulate` checks the repacking and the quad unpacking
in torch against the integer oracle (the `mma` fragment mapping is the ninth session's, checked on the H200), and
`TRITON_INTERPRET=1 python3 scripts/device/marlin_probe.py --interpret` runs the one-token `dp4a` kernel;
`--static [--maxnreg R]` compiles the kernels for sm_90 and prints their loops (`static_report`)."""

import itertools
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

from ninfer.kernels.activation_quant import dequantize_activations, quantize_activations_reference
from ninfer.kernels.quant_linear import _planes, quant_linear_reference
from ninfer.quant import codec_for

FORMAT = "q5_g64_fp16"
CHUNK_WORDS = 168


def repack(data: torch.Tensor, shape: tuple[int, int], planar: bool = False) -> torch.Tensor:
    """q5 bytes of an [N, K] matrix (N a multiple of 16) → chunks [N/16, groups, 168] int32 (module docstring);
    `planar`: the base words as four planes of 32 lanes (word 32 · w + lane), for the pipelined kernel's loads."""
    _, base, high, scales, planes = _planes(data, shape, FORMAT)
    n = shape[0]
    groups = planes[-1].row_bytes // 2
    base = base.view(n // 16, 2, 8, groups, 2, 4)  # [stripe, row half, g, group, block, unit t]
    nibbles = base.permute(0, 3, 2, 5, 4, 1)  # [stripe, group, g, t, block, half]: lane 4g + t, word 2 · block + half
    # fifth bits: byte (row, group, block, unit) bit i = lane 8 · unit + i
    bits = high.view(n // 16, 2, 8, groups, 2, 4).to(torch.int32)  # [stripe, half, g, group, block, t]
    lane_bits = torch.stack([(bits >> i) & 1 for i in range(8)], -1)  # [..., lane i of the unit]
    lane_bits = lane_bits.permute(0, 3, 2, 5, 4, 1, 6)  # [stripe, group, g, t, block, half, i]
    word = lane_bits.reshape(n // 16, groups, 32, 4, 4, 2)  # [.., lane, word = 2 · block + half, i // 2, parity]
    quad = torch.arange(4, device=data.device)[:, None] * 2 + torch.arange(2, device=data.device)  # [word, parity]
    byte = torch.arange(4, device=data.device)[None, :, None]  # i // 2: the byte of the quad
    position = byte * 8 + 7 - quad[:, None, :]  # [word, byte, parity]
    high_words = (word << position).sum((-3, -2, -1), dtype=torch.int64)
    high_words = torch.where(high_words >= 2**31, high_words - 2**32, high_words).to(torch.int32)
    s = scales.view(n // 16, 2, 8, groups).permute(0, 3, 2, 1).contiguous().view(torch.int32)[..., 0]  # [s, j, g]
    nibbles = nibbles.reshape(n // 16, groups, 32, 4)
    nibbles = nibbles.transpose(-1, -2) if planar else nibbles
    chunks = torch.cat((nibbles.reshape(n // 16, groups, 128), high_words, s), -1).contiguous()
    assert chunks.shape[-1] == CHUNK_WORDS
    return chunks


def emulate(chunks: torch.Tensor, blocks: torch.Tensor, tokens: int, planar: bool = False) -> torch.Tensor:
    """What the kernel computes, in torch (int64 products, fp64 sums): y [tokens, N] from the chunks and x's records."""
    stripes, groups, _ = chunks.shape
    nib = chunks[..., :128].view(stripes, groups, 4, 32).transpose(-1, -2) if planar else chunks[..., :128]
    nib = nib.reshape(stripes, groups, 8, 4, 4).long()  # [s, j, g, t, word]
    high = chunks[..., 128:160].view(stripes, groups, 8, 4).long()
    scales = chunks[..., 160:].contiguous().view(torch.float16).view(stripes, groups, 8, 2).double()
    y = torch.zeros(tokens, stripes * 16, dtype=torch.float64)
    shifts = torch.tensor([0, 8, 16, 24])
    for word, parity in itertools.product(range(4), range(2)):
        q = 2 * word + parity
        w = nib[..., word]
        quads = (((w << 3) if parity == 0 else (w >> 1)) & 0x78787878) | ((high << q) & 0x80808080)
        codes = ((quads[..., None] >> shifts) & 0xFF).to(torch.uint8).view(torch.int8).long()  # [s, j, g, t, 4]
        block, half = divmod(word, 2)
        rec = blocks[:tokens, block::2, :][:, :groups]  # [T, j, 12]
        xq = rec[..., 4 * parity:4 * parity + 4].long()  # [T, j, unit t]
        xcodes = ((xq[..., None] >> shifts) & 0xFF).to(torch.uint8).view(torch.int8).long()  # [T, j, t, 4]
        dots = torch.einsum("sjgtb,kjtb->ksjg", codes, xcodes)  # [T, s, j, g]: one parity of one block
        xs = rec[..., 8].view(torch.float32).double()  # [T, j]
        contrib = (dots.double() * xs[:, None, :, None] * scales[None, ..., half] / 8).sum(2)  # [T, s, g]
        y.view(tokens, stripes, 2, 8)[:, :, half] += contrib
    return y


def _check_emulation() -> None:
    torch.manual_seed(0)
    codec = codec_for(FORMAT)
    shape = (48, 512)
    data = codec.encode(torch.randn(*shape) * 0.02)
    x = torch.randn(5, shape[1])
    acts = quantize_activations_reference(x)
    expected = quant_linear_reference(x, data, shape, FORMAT, int8_activations=True).double()
    for planar in (False, True):
        got = emulate(repack(data, shape, planar), acts.blocks, 5, planar)
        error = float((got - expected).norm() / expected.norm())
        print(f"emulated chunks (planar {planar}) against the integer oracle: relative error {error:.1e}")
        assert error < 1e-6, error
    assert torch.allclose(dequantize_activations(acts).double() @ codec.decode(data, shape).double().T, expected,
                          rtol=1e-5, atol=1e-6)


if "--emulate" in sys.argv:
    _check_emulation()
    sys.exit(0)

import triton  # noqa: E402  (the GPU part)
import triton.language as tl  # noqa: E402
from device_timing import read_bandwidth, rotating_copies  # noqa: E402

from ninfer.kernels.activation_quant import quantize_activations  # noqa: E402
from ninfer.kernels.quant_linear import quant_linear_gemv  # noqa: E402
from ninfer.kernels.stripe_linear import _dp4a, _mma, _quads, _weight_scales, _word  # noqa: E402  (the product's)

# inline PTX on the GPU; plain loads and integer ops under the interpreter (`--interpret`: the one-token kernel only,
# since an `mma` fragment spans lanes)
ASM = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _block(acc0, acc1, acc2, acc3, wg, wh, high, b0, b1, s0, s1, ws_g, ws_h, B: tl.constexpr):
    """Block B of a group: acc (rows g, g + 8 × tokens 2t, 2t + 1) += dot · w scale · x scale."""
    d0, d1, d2, d3 = _mma(_quads(wg, high, 4 * B), _quads(wh, high, 4 * B + 2), _quads(wg, high, 4 * B + 1),
                          _quads(wh, high, 4 * B + 3), b0, b1)
    s0 = s0.to(tl.float32, bitcast=True)
    s1 = s1.to(tl.float32, bitcast=True)
    acc0 += (d0.to(tl.float32, bitcast=True) - 12582912.0) * (ws_g * s0)
    acc1 += (d1.to(tl.float32, bitcast=True) - 12582912.0) * (ws_g * s1)
    acc2 += (d2.to(tl.float32, bitcast=True) - 12582912.0) * (ws_h * s0)
    acc3 += (d3.to(tl.float32, bitcast=True) - 12582912.0) * (ws_h * s1)
    return acc0, acc1, acc2, acc3


@triton.jit
def _vector(at, CACHE: tl.constexpr):
    """Four 32-bit words a lane from one 16-byte load at `at` (CACHE: the PTX load qualifiers)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "ld.global" + CACHE + ".v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [at],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1)
    return tl.load(at), tl.load(at + 1), tl.load(at + 2), tl.load(at + 3)


@triton.jit
def _load(chunk, x_b, x_s0, x_s1, g, lane, j, X_MODE: tl.constexpr):
    """Group j's operands for lane 4g + t: the four base words (one 16-byte load, not kept in L1), the fifth bits,
    the scales, then x's quads (token g) and scales (tokens 2t, 2t + 1) for its two blocks: from the records
    (X_MODE 0); from group 0's records whatever j (1: a timing split, wrong results); or from `pack_x`'s layout
    at x_b, one 16-byte load each (2)."""
    at = chunk + j * 168
    w0, w1, w2, w3 = _vector(at + lane * 4, ".nc.L1::no_allocate")
    t = lane % 4
    if X_MODE == 2:
        b0, b1, c0, c1 = _vector(x_b + j * 144 + lane * 4, ".nc")
        s0, s1, r0, r1 = _vector(x_b + j * 144 + 128 + t * 4, ".nc")
        return w0, w1, w2, w3, _word(at + 128 + lane), _word(at + 160 + g), b0, b1, s0, s1, c0, c1, r0, r1
    rec = 0 if X_MODE == 1 else 24 * j
    return (w0, w1, w2, w3, _word(at + 128 + lane), _word(at + 160 + g),
            _word(x_b + rec + t), _word(x_b + rec + 4 + t), _word(x_s0 + rec), _word(x_s1 + rec),
            _word(x_b + rec + 12 + t), _word(x_b + rec + 16 + t), _word(x_s0 + rec + 12), _word(x_s1 + rec + 12))


@triton.jit
def _group(acc, ops, valid, COMPUTE: tl.constexpr):
    """One 64-lane group from its loaded operands; nothing where not `valid` (a turn past the last group). Without
    COMPUTE only a word-wise xor of the operands (the loads' streaming rate alone; wrong results)."""
    acc0, acc1, acc2, acc3 = acc
    wg0, wh0, wg1, wh1, high, scale, b0, b1, s0, s1, c0, c1, r0, r1 = ops
    if not COMPUTE:
        mixed = wg0 ^ wh0 ^ wg1 ^ wh1 ^ high ^ scale ^ b0 ^ b1 ^ s0 ^ s1 ^ c0 ^ c1 ^ r0 ^ r1
        return acc0 + mixed.to(tl.float32), acc1, acc2, acc3
    ws_g, ws_h = _weight_scales(scale, valid)
    acc0, acc1, acc2, acc3 = _block(acc0, acc1, acc2, acc3, wg0, wh0, high, b0, b1, s0, s1, ws_g, ws_h, 0)
    acc0, acc1, acc2, acc3 = _block(acc0, acc1, acc2, acc3, wg1, wh1, high, c0, c1, r0, r1, ws_g, ws_h, 1)
    return acc0, acc1, acc2, acc3


@triton.jit
def _prefetch(at):
    """`prefetch.global.L2` of the line holding each lane's address (no register written: ptxas issues it where
    it stands)."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.b32 $0, 0;", "=r,l", [at], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _probe_kernel(x_ptr, chunk_ptr, out_ptr, T, N, groups, x_block_count, WARPS: tl.constexpr, DEPTH: tl.constexpr,
                  X_MODE: tl.constexpr, PREFETCH: tl.constexpr = 0, COMPUTE: tl.constexpr = True,
                  SPLIT: tl.constexpr = 1):
    """Program (stripe, token tile of 8, part of K): 16 rows; warp w walks groups w, w + WARPS, … of its part in
    turns of DEPTH groups, each group's operands loaded DEPTH groups ahead into its own registers (unrolled: no
    register copies, which would wait for the loads); the warps' sums meet in one reduction; out [T, N] bf16, or
    with SPLIT parts of K (more warps for matrices of few rows) fp32 that the parts add to (zeroed by the caller;
    two parts' sums are the same bits in either order)."""
    lane = tl.arange(0, 32)[None, :]
    warp = tl.arange(0, WARPS)[:, None]
    g = lane // 4
    t = lane % 4
    stripe = tl.program_id(0).to(tl.int64)
    t0 = tl.program_id(1) * 8
    record_stride = x_block_count * 12
    if X_MODE == 2:
        x_b = x_ptr + tl.program_id(1).to(tl.int64) * groups * 144 + 0 * g
    else:
        x_b = x_ptr + tl.minimum(t0 + g, T - 1).to(tl.int64) * record_stride
    x_s0 = x_ptr + tl.minimum(t0 + 2 * t, T - 1).to(tl.int64) * record_stride + 8
    x_s1 = x_ptr + tl.minimum(t0 + 2 * t + 1, T - 1).to(tl.int64) * record_stride + 8
    chunk = chunk_ptr + stripe * groups * 168
    zero = tl.zeros([WARPS, 32], tl.float32)
    acc = (zero, zero, zero, zero)
    steps = groups // (WARPS * SPLIT)  # groups of a warp
    turns = tl.cdiv(steps, DEPTH)
    # step s of warp w is group (part · steps + s) · WARPS + w; loads past the last step read the last one again
    warp = warp + tl.program_id(2) * steps * WARPS
    ops0 = _load(chunk, x_b, x_s0, x_s1, g, lane, warp, X_MODE)
    if DEPTH >= 2:
        ops1 = _load(chunk, x_b, x_s0, x_s1, g, lane, tl.minimum(1, steps - 1) * WARPS + warp, X_MODE)
    if DEPTH >= 3:
        ops2 = _load(chunk, x_b, x_s0, x_s1, g, lane, tl.minimum(2, steps - 1) * WARPS + warp, X_MODE)
    for turn in range(turns):
        s = turn * DEPTH
        if PREFETCH:  # the chunks PREFETCH turns past the ones loaded ahead, into L2
            for d in tl.static_range(DEPTH):
                ahead = chunk + (tl.minimum(s + (PREFETCH + 1) * DEPTH + d, steps - 1) * WARPS + warp) * 168
                _prefetch(ahead + lane * 4)
                _prefetch(ahead + 128 + lane)
        acc = _group(acc, ops0, s < steps, COMPUTE)
        j = tl.minimum(s + DEPTH, steps - 1) * WARPS + warp
        ops0 = _load(chunk, x_b, x_s0, x_s1, g, lane, j, X_MODE)
        if DEPTH >= 2:
            acc = _group(acc, ops1, s + 1 < steps, COMPUTE)
            j = tl.minimum(s + DEPTH + 1, steps - 1) * WARPS + warp
            ops1 = _load(chunk, x_b, x_s0, x_s1, g, lane, j, X_MODE)
        if DEPTH >= 3:
            acc = _group(acc, ops2, s + 2 < steps, COMPUTE)
            j = tl.minimum(s + DEPTH + 2, steps - 1) * WARPS + warp
            ops2 = _load(chunk, x_b, x_s0, x_s1, g, lane, j, X_MODE)
    acc0, acc1, acc2, acc3 = acc
    row_g = stripe * 16 + tl.arange(0, 32) // 4
    tok = t0 + 2 * (tl.arange(0, 32) % 4)
    out = out_ptr + tok.to(tl.int64) * N + row_g
    ok0 = tok < T
    ok1 = tok + 1 < T
    if SPLIT == 1:
        tl.store(out, tl.sum(acc0, axis=0).to(tl.bfloat16), mask=ok0)
        tl.store(out + N, tl.sum(acc1, axis=0).to(tl.bfloat16), mask=ok1)
        tl.store(out + 8, tl.sum(acc2, axis=0).to(tl.bfloat16), mask=ok0)
        tl.store(out + N + 8, tl.sum(acc3, axis=0).to(tl.bfloat16), mask=ok1)
    else:
        tl.atomic_add(out, tl.sum(acc0, axis=0), mask=ok0, sem="relaxed")
        tl.atomic_add(out + N, tl.sum(acc1, axis=0), mask=ok1, sem="relaxed")
        tl.atomic_add(out + 8, tl.sum(acc2, axis=0), mask=ok0, sem="relaxed")
        tl.atomic_add(out + N + 8, tl.sum(acc3, axis=0), mask=ok1, sem="relaxed")


@triton.jit
def _pipelined_kernel(x_ptr, chunk_ptr, out_ptr, T, N, groups, x_block_count, WARPS: tl.constexpr,
                      STAGES: tl.constexpr):
    """The probe with Triton's own software pipeline (planar chunks): each turn's operands are plain `tl.load`s that
    `tl.range(num_stages=STAGES)` issues as asynchronous copies into shared memory STAGES − 1 turns ahead; the
    tensors are one-dimensional (warp w = elements 32w..32w + 31) so that one layout serves every operation."""
    idx = tl.arange(0, 32 * WARPS)
    lane = idx % 32
    warp = idx // 32
    g = lane // 4
    t = lane % 4
    stripe = tl.program_id(0).to(tl.int64)
    t0 = tl.program_id(1) * 8
    record_stride = x_block_count * 12
    x_b = x_ptr + tl.minimum(t0 + g, T - 1).to(tl.int64) * record_stride + t
    x_s0 = x_ptr + tl.minimum(t0 + 2 * t, T - 1).to(tl.int64) * record_stride + 8
    x_s1 = x_ptr + tl.minimum(t0 + 2 * t + 1, T - 1).to(tl.int64) * record_stride + 8
    chunk = chunk_ptr + stripe * groups * 168
    acc0 = tl.zeros([32 * WARPS], tl.float32)
    acc1 = tl.zeros([32 * WARPS], tl.float32)
    acc2 = tl.zeros([32 * WARPS], tl.float32)
    acc3 = tl.zeros([32 * WARPS], tl.float32)
    for step in tl.range(groups // WARPS, num_stages=STAGES):
        j = step * WARPS + warp
        at = chunk + j * 168 + lane
        rec = 24 * j
        wg0 = tl.load(at)
        wh0 = tl.load(at + 32)
        wg1 = tl.load(at + 64)
        wh1 = tl.load(at + 96)
        high = tl.load(at + 128)
        scale = tl.load(chunk + j * 168 + 160 + g)
        ws_g, ws_h = _weight_scales(scale, True)
        acc0, acc1, acc2, acc3 = _block(acc0, acc1, acc2, acc3, wg0, wh0, high, tl.load(x_b + rec),
                                        tl.load(x_b + rec + 4), tl.load(x_s0 + rec), tl.load(x_s1 + rec), ws_g, ws_h,
                                        0)
        acc0, acc1, acc2, acc3 = _block(acc0, acc1, acc2, acc3, wg1, wh1, high, tl.load(x_b + rec + 12),
                                        tl.load(x_b + rec + 16), tl.load(x_s0 + rec + 12), tl.load(x_s1 + rec + 12),
                                        ws_g, ws_h, 1)
    row_g = stripe * 16 + tl.arange(0, 32) // 4
    tok = t0 + 2 * (tl.arange(0, 32) % 4)
    out = out_ptr + tok.to(tl.int64) * N + row_g
    ok0 = tok < T
    ok1 = tok + 1 < T
    tl.store(out, tl.sum(tl.reshape(acc0, [WARPS, 32]), axis=0).to(tl.bfloat16), mask=ok0)
    tl.store(out + N, tl.sum(tl.reshape(acc1, [WARPS, 32]), axis=0).to(tl.bfloat16), mask=ok1)
    tl.store(out + 8, tl.sum(tl.reshape(acc2, [WARPS, 32]), axis=0).to(tl.bfloat16), mask=ok0)
    tl.store(out + N + 8, tl.sum(tl.reshape(acc3, [WARPS, 32]), axis=0).to(tl.bfloat16), mask=ok1)


def pipelined(acts, chunks, shape, warps, stages, out=None):
    n, _ = shape
    tokens = acts.blocks.shape[0]
    out = torch.empty((tokens, n), dtype=torch.bfloat16, device="cuda") if out is None else out
    _pipelined_kernel[(n // 16, triton.cdiv(tokens, 8))](acts.blocks, chunks, out, tokens, n, chunks.shape[1],
                                                         acts.blocks.shape[1], WARPS=warps, STAGES=stages,
                                                         num_warps=warps)
    return out


def pack_x(blocks: torch.Tensor, groups: int) -> torch.Tensor:
    """x's records [T, blocks, 12] → [token tiles of 8, groups, 144] int32: per group, lane 4g + t's quads of token g
    (block 0 words t, 4 + t, block 1 words t, 4 + t) as one 16-byte vector, then at word 128 + 4t the scales of
    tokens 2t, 2t + 1 in block 0, then in block 1 (tokens past T repeat the last)."""
    tokens = blocks.shape[0]
    tiles = []
    for t0 in range(0, tokens, 8):
        rec = blocks[torch.clamp(torch.arange(t0, t0 + 8, device=blocks.device), max=tokens - 1)]
        rec = rec[:, :2 * groups].view(8, groups, 2, 12)  # [token g, group, block, word]
        quads = rec[..., :8].view(8, groups, 2, 2, 4)  # [g, j, block, parity, t]
        quads = quads.permute(1, 0, 4, 2, 3).reshape(groups, 128)  # [j, lane 4g + t, (block, parity)]
        scales = rec[..., 8].view(4, 2, groups, 2)  # [t, k, j, block]: token 2t + k
        scales = scales.permute(2, 0, 3, 1).reshape(groups, 16)  # [j, t, (block, k)]
        tiles.append(torch.cat((quads, scales), -1))
    return torch.stack(tiles).contiguous()


_PACKED = {}  # id(acts) → (acts, its pack_x), so that the timed calls do not pack
MAXNREG = {"maxnreg": int(sys.argv[sys.argv.index("--maxnreg") + 1])} if "--maxnreg" in sys.argv else {}


def _packed(acts, groups: int) -> torch.Tensor:
    if id(acts) not in _PACKED:
        _PACKED[id(acts)] = (acts, pack_x(acts.blocks, groups))
    return _PACKED[id(acts)][1]


def probe(acts, chunks, shape, warps, depth, out=None, x_mode=0, packed=None, prefetch=0, compute=True, split=1):
    """One launch of `_probe_kernel` (`--maxnreg R` on the command line: ptxas's register ceiling, which decides
    how far ahead of the loop's end it issues the next turn's loads). With `split` > 1 the result is fp32, and the
    zeroing of it is part of the call."""
    n, _ = shape
    tokens = acts.blocks.shape[0]
    if split > 1:
        out = torch.zeros((tokens, n), dtype=torch.float32, device="cuda")
    elif out is None:
        out = torch.empty((tokens, n), dtype=torch.bfloat16, device="cuda")
    _probe_kernel[(n // 16, triton.cdiv(tokens, 8), split)](
        acts.blocks if packed is None else packed, chunks, out, tokens, n, chunks.shape[1], acts.blocks.shape[1],
        WARPS=warps, DEPTH=depth, X_MODE=x_mode, PREFETCH=prefetch, COMPUTE=compute, SPLIT=split, num_warps=warps,
        **MAXNREG)
    return out


def _ints(flag, default):
    return [int(v) for v in sys.argv[sys.argv.index(flag) + 1].split(",")] if flag in sys.argv else default


@triton.jit
def _one_token_kernel(x_ptr, chunk_ptr, out_ptr, N, groups, WARPS: tl.constexpr, DEPTH: tl.constexpr,
                      SPLIT: tl.constexpr = 1):
    """The same chunks and packed x (`pack_x` of one token) for T = 1 with `dp4a` instead of `mma`: lane 4g + t
    multiplies its own 32 codes (rows g, g + 8 × blocks 0, 1 × unit t) by the token's quads, 8 `dp4a` a group
    (about half the mma route's instructions), and the 4 lanes of a row meet once at the end. Loads as in
    `_probe_kernel` (DEPTH groups ahead, unrolled), and so is SPLIT (parts of K added into an fp32 output)."""
    lane = tl.arange(0, 32)[None, :]
    warp = tl.arange(0, WARPS)[:, None]
    g = lane // 4
    stripe = tl.program_id(0).to(tl.int64)
    chunk = chunk_ptr + stripe * groups * 168
    x_b = x_ptr + 0 * g
    zero = tl.zeros([WARPS, 32], tl.float32)
    acc_g = zero
    acc_h = zero
    steps = groups // (WARPS * SPLIT)
    turns = tl.cdiv(steps, DEPTH)
    warp = warp + tl.program_id(1) * steps * WARPS
    ops0 = _load(chunk, x_b, x_b, x_b, g, lane, warp, 2)
    if DEPTH >= 2:
        ops1 = _load(chunk, x_b, x_b, x_b, g, lane, tl.minimum(1, steps - 1) * WARPS + warp, 2)
    for turn in range(turns):
        s = turn * DEPTH
        acc_g, acc_h = _one_token_group(acc_g, acc_h, ops0, s < steps)
        ops0 = _load(chunk, x_b, x_b, x_b, g, lane, tl.minimum(s + DEPTH, steps - 1) * WARPS + warp, 2)
        if DEPTH >= 2:
            acc_g, acc_h = _one_token_group(acc_g, acc_h, ops1, s + 1 < steps)
            ops1 = _load(chunk, x_b, x_b, x_b, g, lane, tl.minimum(s + DEPTH + 1, steps - 1) * WARPS + warp, 2)
    rows = stripe * 16 + tl.arange(0, 8)
    y_g = tl.sum(tl.reshape(tl.sum(acc_g, axis=0), [8, 4]), axis=1)
    y_h = tl.sum(tl.reshape(tl.sum(acc_h, axis=0), [8, 4]), axis=1)
    if SPLIT == 1:
        tl.store(out_ptr + rows, y_g.to(tl.bfloat16))
        tl.store(out_ptr + rows + 8, y_h.to(tl.bfloat16))
    else:
        tl.atomic_add(out_ptr + rows, y_g, sem="relaxed")
        tl.atomic_add(out_ptr + rows + 8, y_h, sem="relaxed")


@triton.jit
def _one_token_group(acc_g, acc_h, ops, valid):
    """One group for one token: the block dots of unit t from 8 `dp4a` (C started at 0x4B400000), then the
    scales."""
    wg0, wh0, wg1, wh1, high, scale, b0, b1, s0, _s1, c0, c1, r0, _r1 = ops  # tokens 2t + 1: the same token
    ws_g, ws_h = _weight_scales(scale, valid)
    magic = wg0 * 0 + 0x4B400000
    g0 = _dp4a(_quads(wg0, high, 1), b1, _dp4a(_quads(wg0, high, 0), b0, magic))
    h0 = _dp4a(_quads(wh0, high, 3), b1, _dp4a(_quads(wh0, high, 2), b0, magic))
    g1 = _dp4a(_quads(wg1, high, 5), c1, _dp4a(_quads(wg1, high, 4), c0, magic))
    h1 = _dp4a(_quads(wh1, high, 7), c1, _dp4a(_quads(wh1, high, 6), c0, magic))
    x0 = s0.to(tl.float32, bitcast=True)
    x1 = r0.to(tl.float32, bitcast=True)
    dots_g = (g0.to(tl.float32, bitcast=True) - 12582912.0) * x0 + (g1.to(tl.float32, bitcast=True) - 12582912.0) * x1
    dots_h = (h0.to(tl.float32, bitcast=True) - 12582912.0) * x0 + (h1.to(tl.float32, bitcast=True) - 12582912.0) * x1
    return acc_g + dots_g * ws_g, acc_h + dots_h * ws_h


def one_token(acts, chunks, shape, warps, depth, out=None, split=1):
    """`_one_token_kernel` on x packed once outside the timed calls (T = 1 only); with `split` > 1 the result is
    fp32 and its zeroing part of the call."""
    n, _ = shape
    assert acts.blocks.shape[0] == 1
    if split > 1:
        out = torch.zeros((1, n), dtype=torch.float32, device=chunks.device)
    elif out is None:
        out = torch.empty((1, n), dtype=torch.bfloat16, device=chunks.device)
    _one_token_kernel[(n // 16, split)](_packed(acts, chunks.shape[1]), chunks, out, n, chunks.shape[1],
                                        WARPS=warps, DEPTH=depth, SPLIT=split, num_warps=warps, **MAXNREG)
    return out


class Variant(NamedTuple):
    """One timed kernel setting: `call(acts, chunks, shape, out)`; the group count of a matrix must be a multiple of
    `stride` (warps × parts of K); `planar` chunks; `checked` against the oracle first (False: wrong results by
    design, timed only); `one_token`: T = 1 only."""

    label: str
    call: Callable
    stride: int
    planar: bool = False
    checked: bool = True
    one_token: bool = False


def _variants() -> list[Variant]:
    """The kernels and settings on the command line. "xsame" is the register-ahead probe with every group reading
    the first group's x records (`X_MODE` 1), to tell the x records' share of the time from the weights'; "xpacked"
    reads x from `pack_x`'s layout (`X_MODE` 2), packed once outside the timed calls."""
    warp_counts = _ints("--warps", [4, 8, 16])
    kernels = sys.argv[sys.argv.index("--kernel") + 1].split(",") if "--kernel" in sys.argv else ["asm", "pipe"]
    depths = list(itertools.product(warp_counts, _ints("--depth", [1, 2])))
    splits = _ints("--split", [2])
    variants = []
    if "asm" in kernels:
        variants += [Variant(f"registers ahead, warps {w:2d} depth {d}", lambda a, c, sh, o, w=w, d=d: probe(
            a, c, sh, w, d, o), w) for w, d in depths]
    if "xsame" in kernels:
        variants += [Variant(f"x of group 0 only (timing), warps {w:2d} depth {d}", lambda a, c, sh, o, w=w, d=d: probe(
            a, c, sh, w, d, o, 1), w, checked=False) for w, d in depths]
    if "xpacked" in kernels:
        variants += [Variant(f"x packed, warps {w:2d} depth {d}", lambda a, c, sh, o, w=w, d=d: probe(
            a, c, sh, w, d, o, 2, _packed(a, c.shape[1])), w) for w, d in depths]
    if "loads" in kernels:  # the x-packed probe's loads alone, no arithmetic
        variants += [Variant(f"loads only (timing), warps {w:2d} depth {d}", lambda a, c, sh, o, w=w, d=d: probe(
            a, c, sh, w, d, o, 2, _packed(a, c.shape[1]), compute=False), w, checked=False) for w, d in depths]
    if "xpacked-split" in kernels:  # K in `--split` parts a stripe, added in fp32 (the zeroing timed)
        variants += [Variant(f"x packed, K in {sp} parts, warps {w:2d} depth {d}",
                             lambda a, c, sh, o, w=w, d=d, sp=sp: probe(a, c, sh, w, d, o, 2, _packed(a, c.shape[1]),
                                                                        split=sp), w * sp)
                     for sp in splits for w, d in depths]
    if "dp4a" in kernels:
        variants += [Variant(f"one token, dp4a, warps {w:2d} depth {d}", lambda a, c, sh, o, w=w, d=d: one_token(
            a, c, sh, w, d, o), w, one_token=True) for w, d in depths]
    if "dp4a-split" in kernels:
        variants += [Variant(f"one token, dp4a, K in {sp} parts, warps {w:2d} depth {d}",
                             lambda a, c, sh, o, w=w, d=d, sp=sp: one_token(a, c, sh, w, d, o, sp), w * sp,
                             one_token=True) for sp in splits for w, d in depths]
    if "xpacked-l2" in kernels:  # and the chunks `--prefetch` turns further ahead prefetched into L2
        variants += [Variant(f"x packed, L2 prefetch {pf}, warps {w:2d} depth {d}",
                             lambda a, c, sh, o, w=w, d=d, pf=pf: probe(a, c, sh, w, d, o, 2, _packed(a, c.shape[1]),
                                                                        pf), w)
                     for pf in _ints("--prefetch", [1, 2]) for w, d in depths]
    if "pipe" in kernels:
        variants += [Variant(f"async copies, warps {w:2d} stages {st}", lambda a, c, sh, o, w=w, st=st: pipelined(
            a, c, sh, w, st, o), w, planar=True)
                     for w, st in itertools.product(warp_counts, _ints("--stages", [2, 3, 4]))]
    return variants


def main() -> None:
    token_counts = _ints("--tokens", [1, 8])
    variants = _variants()
    codec = codec_for(FORMAT)
    torch.manual_seed(0)
    shape = (256, 4096)
    data = codec.encode(torch.randn(*shape, device="cuda") * 0.02)
    chunks = {planar: repack(data, shape, planar) for planar in (False, True)}
    for tokens in (1, 5, 8, 11):
        x = torch.randn(tokens, shape[1], device="cuda")
        acts = quantize_activations(x)
        expected = quant_linear_reference(x, data, shape, FORMAT, int8_activations=True)
        errors = []
        for variant in variants:
            if not variant.checked or (variant.one_token and tokens > 1):
                continue
            got = variant.call(acts, chunks[variant.planar], shape, None).float()
            errors.append(float((got - expected).norm() / expected.norm()))
            if not errors[-1] < 4e-3:  # bf16 output
                print(f"check T={tokens} {variant.label} FAILS: error {errors[-1]:.1e}, nan {int(got.isnan().sum())}")
        print(f"check T={tokens}: worst relative error {max(errors):.1e} (bf16 out)", flush=True)
        assert max(errors) < 4e-3
    bandwidth = read_bandwidth()
    for name, n, k in (("27b mlp/down", 5120, 17408), ("27b gdn/value_z", 12288, 5120),
                       ("27b gdn/output", 5120, 6144), ("27b attention/gate_value", 7168, 5120)):
        if "--only" in sys.argv and sys.argv[sys.argv.index("--only") + 1] not in name:
            continue
        shape = (n, k)
        data = codec.encode(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        read = codec.encoded_bytes(shape)
        copies = rotating_copies(data, 31)
        repacked = {planar: [repack(c, shape, planar) for c in copies] for planar in {v.planar for v in variants}}
        for tokens in token_counts:
            acts = quantize_activations(torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16))
            rotation = itertools.cycle(copies)
            us = triton.testing.do_bench_cudagraph(
                lambda acts=acts, rotation=rotation, shape=shape: quant_linear_gemv(
                    acts, next(rotation), shape, FORMAT, out_dtype=torch.bfloat16), return_mode="median") * 1e3
            print(f"{name:26s} T={tokens:2d}: batch route {us:6.1f} us ({read / (us / 1e6) / bandwidth:4.0%})",
                  flush=True)
            out = torch.empty((tokens, n), dtype=torch.bfloat16, device="cuda")
            for variant in variants:
                if (variant.one_token and tokens > 1) or (k // 64) % variant.stride:
                    continue
                rotation = itertools.cycle(repacked[variant.planar])
                us = triton.testing.do_bench_cudagraph(
                    lambda acts=acts, rotation=rotation, shape=shape, out=out, call=variant.call: call(
                        acts, next(rotation), shape, out), return_mode="median") * 1e3
                print(f"{name:26s} T={tokens:2d}: {variant.label}: {us:6.1f} us "
                      f"({read / (us / 1e6) / bandwidth:4.0%})", flush=True)
        del copies, repacked, data


def profile_target() -> None:
    """`--ncu N K TOKENS WARPS DEPTH`: 16 calls of the register-ahead probe on rotating copies, for `ncu` to read
    (as `gemv_ncu.py` does for the batch route): `ncu --clock-control none -k regex:_probe_kernel --launch-skip 10
    --launch-count 1 --metrics … python3 scripts/device/marlin_probe.py --ncu 5120 17408 8 8 2`."""
    n, k, tokens, warps, depth = (int(v) for v in sys.argv[sys.argv.index("--ncu") + 1:][:5])
    data = codec_for(FORMAT).encode(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    copies = itertools.cycle([repack(c, (n, k)) for c in rotating_copies(data, 15)])
    acts = quantize_activations(torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16))
    for _ in range(16):
        probe(acts, next(copies), (n, k), warps, depth)
    torch.cuda.synchronize()


def interpret_check() -> None:
    """`TRITON_INTERPRET=1 python3 scripts/device/marlin_probe.py --interpret` (CPU): the one-token kernel, whole
    and with K in two parts, against the integer oracle."""
    assert not ASM, "--interpret needs TRITON_INTERPRET=1"
    torch.manual_seed(0)
    codec = codec_for(FORMAT)
    shape = (32, 1024)
    data = codec.encode(torch.randn(*shape) * 0.02)
    chunks = repack(data, shape)
    x = torch.randn(1, shape[1])
    acts = quantize_activations_reference(x)
    expected = quant_linear_reference(x, data, shape, FORMAT, int8_activations=True)
    for warps, depth, split in itertools.product((1, 2), (1, 2), (1, 2)):
        got = one_token(acts, chunks, shape, warps, depth, split=split).float()
        error = float((got - expected).norm() / expected.norm())
        print(f"one token, warps {warps} depth {depth} K in {split} parts: relative error {error:.1e}", flush=True)
        # fp32 with K in parts; bf16 whole (the interpreter truncates to bf16 where the GPU rounds to nearest)
        assert error < (1e-6 if split > 1 else 8e-3), error


def static_report() -> None:
    """`python3 scripts/device/marlin_probe.py --static [--maxnreg R]` (no GPU needed; put the GPU machine's Triton
    first on PYTHONPATH to read what it runs): each kernel compiled for sm_90 through `scripts/compile_kernels.py`'s
    readers, with its registers, its longest loop per opcode and that loop's waits on loads (how many instructions
    after its issue each load is first waited for)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import compile_kernels

    pointers = {"x_ptr": "*i32", "chunk_ptr": "*i32", "out_ptr": "*bf16"}
    sizes = {"T": "i32", "N": "i32", "groups": "i32", "x_block_count": "i32"}
    builds = [(_probe_kernel, {**pointers, **sizes},
               {"WARPS": w, "DEPTH": d, "X_MODE": x, "PREFETCH": 0, "COMPUTE": True, "SPLIT": 1})
              for x, (w, d) in itertools.product((0, 2), ((8, 2), (16, 1)))]
    builds += [(_one_token_kernel, {**pointers, "N": "i32", "groups": "i32"}, {"WARPS": w, "DEPTH": d, "SPLIT": 1})
               for w, d in ((8, 1), (8, 2))]
    builds.append((_pipelined_kernel, {**pointers, **sizes}, {"WARPS": 8, "STAGES": 2}))
    for kernel, signature, constants in builds:
        options = {"num_warps": constants["WARPS"], **MAXNREG}
        compiled = triton.compile(ASTSource(kernel, {**signature, **dict.fromkeys(constants, "constexpr")},
                                            constants, {}), target=GPUTarget("cuda", 90, 32), options=options)
        lines = compile_kernels._disassemble(compiled.asm["cubin"])
        print(f"{kernel.fn.__name__} {constants}{compile_kernels._resources(compiled.asm['cubin'])}"
              f"{compile_kernels._longest_loop(lines, True)}")
        for line in compile_kernels.scoreboard_waits(lines):
            print("   ", line)


if __name__ == "__main__":
    if "--static" in sys.argv:
        static_report()
    elif "--interpret" in sys.argv:
        interpret_check()
    elif "--ncu" in sys.argv:
        profile_target()
    else:
        main()
