"""Probe for the next batch-8 step: how fast an int8 tensor-core GEMV can read q4 weights repacked so that each
lane's `mma.m16n8k32` fragments are one 16-byte vector (the Marlin idea: pack the weights in the order the MMA
consumes them), against the dp4a batch route on the same matrix. Not a product route: q4 only, the float steps in
block order (not the batch route's bits), split K written as partial sums (their sum is not timed). It answers
whether the fragment loads were what made the row-layout tensor-core route of 2026-11-30 2–4× slower
(docs/performance.md) before the weight layout of every route is changed for it.

Layout: for a stripe of 16 rows and a pair of 32-lane blocks, lane 4g + t holds 4 words: unit t (8 lanes) of rows
g and g + 8 in the first block, then in the second — so a warp's load of a block pair is 512 contiguous bytes. The
codes (two's-complement nibbles) become signed bytes times 16 (the nibble in the top half), so `mma` needs no
offset term; the weight scale takes the 1/16. The x records are the GEMV's (`activation_quant`): lane 4g + t
reads token g's even and odd quads of unit t, the same lanes on both sides, so the K order inside a block does not
matter.

Usage (GPU): python3 scripts/device/mma_layout_probe.py [--tokens 1,8] — checks the probe against the integer
oracle, then times both at the 27B q4 shapes (CUDA graphs, matrix copies rotating past L2)."""

import itertools
import sys

import torch
import triton
import triton.language as tl
from device_timing import read_bandwidth, rotating_copies

from ninfer.kernels.activation_quant import quantize_activations
from ninfer.kernels.quant_linear import _exact_float, _planes, quant_linear_gemv, quant_linear_reference
from ninfer.quant import codec_for


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1):
    """One int8 `mma.sync.m16n8k32` across the warp (one element a lane): A rows g, g + 8 from lane 4g + t (a0, a1:
    k 4t..4t + 3; a2, a3: k 16 + 4t..), B column g (b0, b1 the same k); c0 = (g, 2t), c1 = (g, 2t + 1),
    c2 = (g + 8, 2t), c3 = (g + 8, 2t + 1)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 z; mov.b32 z, 0; mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {$0, $1, $2, $3}, "
        "{$4, $5, $6, $7}, {$8, $9}, {z, z, z, z}; }",
        "=r,=r,=r,=r,r,r,r,r,r,r", [a0, a1, a2, a3, b0, b1],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _block(acc0, acc1, acc2, acc3, wg, wh, rec, xs0, xs1, ws_g, ws_h, t):
    """One block of the pair: its codes from the words of rows g (wg) and g + 8 (wh), x's quads from token g's record
    `rec`, the x scales of tokens 2t, 2t + 1 at xs0, xs1; acc += exact dot · (w scale · x scale)."""
    even_g = (wg << 4) & -0x0F0F0F10  # the two's-complement nibble in a byte's top half: code · 16 as int8
    even_h = (wh << 4) & -0x0F0F0F10
    odd_g = wg & -0x0F0F0F10
    odd_h = wh & -0x0F0F0F10
    c0, c1, c2, c3 = _mma(even_g, even_h, odd_g, odd_h, tl.load(rec + t), tl.load(rec + 4 + t))
    scale0 = tl.load(xs0).to(tl.float32, bitcast=True)
    scale1 = tl.load(xs1).to(tl.float32, bitcast=True)
    acc0 += _exact_float(c0, 0, 0) * (ws_g * scale0)
    acc1 += _exact_float(c1, 0, 0) * (ws_g * scale1)
    acc2 += _exact_float(c2, 0, 0) * (ws_h * scale0)
    acc3 += _exact_float(c3, 0, 0) * (ws_h * scale1)
    return acc0, acc1, acc2, acc3


@triton.jit
def _probe_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, T, N, pairs, gpr, x_block_count, SPLIT: tl.constexpr):
    """Program (stripe, split): 16 rows × 8 tokens over block pairs split, split + SPLIT, …; partial sums to
    out[split, token, row]."""
    lane = tl.arange(0, 32)
    g = lane // 4
    t = lane % 4
    stripe = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    row_g = stripe * 16 + g
    row_h = row_g + 8
    record_stride = x_block_count * 12
    x_b = x_ptr + tl.minimum(g, T - 1).to(tl.int64) * record_stride
    x_s0 = x_ptr + tl.minimum(2 * t, T - 1).to(tl.int64) * record_stride + 8
    x_s1 = x_ptr + tl.minimum(2 * t + 1, T - 1).to(tl.int64) * record_stride + 8
    w_lane = w_ptr + (stripe * pairs * 32 + lane[:, None]) * 4 + tl.arange(0, 4)[None, :]
    acc0 = tl.zeros([32], tl.float32)
    acc1 = tl.zeros([32], tl.float32)
    acc2 = tl.zeros([32], tl.float32)
    acc3 = tl.zeros([32], tl.float32)
    w = tl.load(w_lane + split * 128)
    for j in tl.range(split, pairs, SPLIT):
        ahead = tl.load(w_lane + tl.minimum(j + SPLIT, pairs - 1) * 128)
        first, second = tl.split(tl.reshape(w, [32, 2, 2]))  # words (0, 2) and (1, 3)
        wg0, wg1 = tl.split(first)  # row g: block 2j, 2j + 1
        wh0, wh1 = tl.split(second)  # row g + 8
        ws_g = tl.load(scale_ptr + row_g * gpr + j).to(tl.float32) * 0.0625
        ws_h = tl.load(scale_ptr + row_h * gpr + j).to(tl.float32) * 0.0625
        acc0, acc1, acc2, acc3 = _block(acc0, acc1, acc2, acc3, wg0, wh0, x_b + 2 * j * 12, x_s0 + 2 * j * 12,
                                        x_s1 + 2 * j * 12, ws_g, ws_h, t)
        acc0, acc1, acc2, acc3 = _block(acc0, acc1, acc2, acc3, wg1, wh1, x_b + (2 * j + 1) * 12,
                                        x_s0 + (2 * j + 1) * 12, x_s1 + (2 * j + 1) * 12, ws_g, ws_h, t)
        w = ahead
    out = out_ptr + (split * T + 2 * t) * N + row_g
    ok0 = 2 * t < T
    ok1 = 2 * t + 1 < T
    tl.store(out, acc0, mask=ok0)
    tl.store(out + N, acc1, mask=ok1)
    tl.store(out + 8, acc2, mask=ok0)
    tl.store(out + N + 8, acc3, mask=ok1)


def repack(data: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """q4 bytes → (fragment-ordered words [N/16 · pairs · 32 · 4] int32, scales [N, K/64] fp16)."""
    _, base, _, scales, _ = _planes(data, shape, "q4_g64_fp16")
    n, k = shape
    words = base.view(n // 16, 2, 8, k // 64, 2, 4)  # [stripe, row half, g, pair, block in pair, unit t]
    return words.permute(0, 3, 2, 5, 4, 1).contiguous().view(-1), scales.view(n, -1)


def probe(acts, packed, scales, shape, tokens, split):
    n, k = shape
    out = torch.empty((split, tokens, n), dtype=torch.float32, device="cuda")
    _probe_kernel[(n // 16, split)](acts.blocks, packed, scales, out, tokens, n, k // 64, scales.shape[1],
                                    acts.blocks.shape[1], SPLIT=split, num_warps=1)
    return out


def main() -> None:
    token_counts = [int(t) for t in sys.argv[sys.argv.index("--tokens") + 1].split(",")] if "--tokens" in sys.argv \
        else [1, 8]
    codec = codec_for("q4_g64_fp16")
    shape = (256, 2048)
    data = codec.encode(torch.randn(*shape, device="cuda") * 0.02)
    packed, scales = repack(data, shape)
    x = torch.randn(8, shape[1], device="cuda")
    acts = quantize_activations(x)
    expected = quant_linear_reference(x, data, shape, "q4_g64_fp16", int8_activations=True)
    for split in (1, 4):
        got = probe(acts, packed, scales, shape, 8, split).sum(0)
        error = float((got - expected).norm() / expected.norm())
        print(f"check split={split}: relative error {error:.1e}", flush=True)
        assert error < 1e-5
    bandwidth = read_bandwidth()
    for name, n, k in (("27b mlp/gate_up", 34816, 5120), ("q4 at the down shape", 5120, 17408),
                       ("27b gdn/query_key", 4096, 5120)):
        shape = (n, k)
        data = codec.encode(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        read = codec.encoded_bytes(shape)
        copies = rotating_copies(data, 31)
        repacked = [repack(c, shape) for c in copies]
        for tokens in token_counts:
            acts = quantize_activations(torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16))
            rotation = itertools.cycle(copies)
            us = triton.testing.do_bench_cudagraph(
                lambda acts=acts, rotation=rotation, shape=shape: quant_linear_gemv(acts, next(rotation), shape,
                                                                                   "q4_g64_fp16"),
                return_mode="median") * 1e3
            print(f"{name:22s} T={tokens}: batch route {us:7.1f} us ({read / (us / 1e6) / bandwidth:4.0%})", flush=True)
            for split in (1, 2, 4, 8):
                rotation = itertools.cycle(repacked)
                us = triton.testing.do_bench_cudagraph(
                    lambda acts=acts, rotation=rotation, shape=shape, tokens=tokens, split=split: probe(
                        acts, *next(rotation), shape, tokens, split), return_mode="median") * 1e3
                print(f"{name:22s} T={tokens}: mma probe split {split}: {us:7.1f} us "
                      f"({read / (us / 1e6) / bandwidth:4.0%})", flush=True)
        del copies, repacked, data


if __name__ == "__main__":
    main()
