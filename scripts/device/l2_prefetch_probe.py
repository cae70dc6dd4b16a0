"""Probe: does streaming a GEMV's weights into L2 while the GPU runs small kernels (DRAM idle) make the GEMV that
follows faster by about the prefetched bytes over the read bandwidth? A decode step spends about a fifth of each
27B GDN layer in small kernels (conv, delta rule, norms, SwiGLU) that read little.
Each timed call: one launch (one program spins W µs, the small kernels' stand-in; the others prefetch) ; the GEMV, on a
rotating copy of the matrix (copies over > 256 MiB, so L2 holds nothing from the call before). The prefetch is
`prefetch.global.L2::evict_last` of the first `f` of each row of every plane (columns first: every program of the
GEMV finds its first tiles in L2) or of the first `f` of the rows (rows first). Printed: the call's time, against
spin + GEMV without prefetch, and what the bytes predict.
Usage: python3 scripts/device/l2_prefetch_probe.py"""

import itertools

import torch
import triton
import triton.language as tl
from device_timing import read_bandwidth, rotating_copies

from ninfer.kernels.activation_quant import quantize_activations
from ninfer.kernels.quant_linear import quant_linear_gemv
from ninfer.quant import codec_for

LINE = tl.constexpr(128)


@triton.jit
def _now(zero):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [zero], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _spin_prefetch_kernel(ns, dummy_ptr, rows, ptr0, row_bytes0, prefix0, ptr1, row_bytes1, prefix1, ptr2,
                          row_bytes2, prefix2, PLANES: tl.constexpr, ROWS: tl.constexpr, LINES: tl.constexpr):
    """Program 0 returns after `ns` nanoseconds of the global timer (the small kernels' stand-in); programs 1.. take
    ROWS rows each and issue `prefetch.global.L2::evict_last` for the first `prefix` bytes of each row of each plane
    (PLANES of them: base words, high plane, scales)."""
    pid = tl.program_id(0)
    if pid == 0:
        zero = tl.zeros([1], dtype=tl.int32)
        start = _now(zero)
        now = start
        while tl.max(now - start, axis=0) < ns:
            now = _now(zero)
        tl.store(dummy_ptr + tl.arange(0, 1), (now - start).to(tl.int32))
    else:
        row = (pid - 1) * ROWS + tl.arange(0, ROWS)[:, None]
        total = 0
        for plane in tl.static_range(PLANES):
            ptr = ptr0 if plane == 0 else ptr1 if plane == 1 else ptr2
            row_bytes = row_bytes0 if plane == 0 else row_bytes1 if plane == 1 else row_bytes2
            prefix = prefix0 if plane == 0 else prefix1 if plane == 1 else prefix2
            for l0 in range(0, tl.cdiv(prefix, LINE * LINES)):
                byte = (l0 * LINES + tl.arange(0, LINES)[None, :]) * LINE
                ok = (row < rows) & (byte < prefix)
                ptrs = ptr + tl.where(ok, row.to(tl.int64) * row_bytes + byte, 0)
                done = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                                 [ptrs], dtype=tl.int32, is_pure=False, pack=1)
                total += tl.sum(tl.sum(done, axis=1), axis=0)
        if total != 0:  # never: keeps the asm
            tl.store(dummy_ptr + 1, total)


dummy = torch.zeros(4, dtype=torch.int32, device="cuda")


def spin_prefetch(spin_ns, data, shape, fmt, fraction, columns_first):
    """One launch: the spin, and (fraction > 0) the prefetch of the first fraction of each row (columns first) or of
    the first fraction of the rows."""
    planes = codec_for(fmt).planes(shape)
    n = shape[0]
    rows = n if columns_first else max(1, int(n * fraction))
    args = []
    for plane in planes:
        line = LINE.value
        prefix = max(line, int(plane.row_bytes * fraction) // line * line) if columns_first else plane.row_bytes
        args += [data[plane.offset:], plane.row_bytes, prefix]
    args += [data, 0, 0] * (3 - len(planes))
    programs = 1 + (triton.cdiv(rows, 16) if fraction else 0)
    _spin_prefetch_kernel[(programs,)](spin_ns, dummy, rows, *args, PLANES=len(planes), ROWS=16, LINES=8,
                                       num_warps=4)


bandwidth = read_bandwidth()


def timed(copies, acts, shape, fmt, spin_ns, fraction, columns_first):
    """CUDA-graph time of [spin + prefetch launch] ; GEMV, each call on the next copy of the matrix."""
    rotation = itertools.cycle(copies)

    def call():
        matrix = next(rotation)
        if spin_ns or fraction:
            spin_prefetch(spin_ns, matrix, shape, fmt, fraction, columns_first)
        return quant_linear_gemv(acts, matrix, shape, fmt)

    return triton.testing.do_bench_cudagraph(call, return_mode="median") * 1e3


for w in (2500, 5000, 10000):
    us = triton.testing.do_bench_cudagraph(
        lambda w=w: _spin_prefetch_kernel[(1,)](w, dummy, 0, *[dummy, 0, 0] * 3, PLANES=1, ROWS=16, LINES=8),
        return_mode="median") * 1e3
    print(f"spin {w / 1000:.1f} us alone: {us:.1f} us")
SHAPES = [("27b gdn/output", 5120, 6144, "q5_g64_fp16", (0.25, 0.5, 1.0)),
          ("27b mlp/gate_up", 34816, 5120, "q4_g64_fp16", (0.1, 0.2, 0.4)),
          ("27b mlp/down", 5120, 17408, "q5_g64_fp16", (0.2, 0.4))]
for name, n, k, fmt, fractions in SHAPES:
    codec = codec_for(fmt)
    data = codec.encode(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    read = codec.encoded_bytes((n, k))
    copies = rotating_copies(data)
    acts = quantize_activations(torch.randn(1, k, device="cuda", dtype=torch.bfloat16))
    expected = quant_linear_gemv(acts, data, (n, k), fmt)
    spin_prefetch(0, data, (n, k), fmt, 1.0, True)
    assert torch.equal(quant_linear_gemv(acts, data, (n, k), fmt), expected)
    gemv = timed(copies, acts, (n, k), fmt, 0, 0, True)
    print(f"{name}: {read / 1e6:.1f} MB, GEMV alone {gemv:.1f} us ({read / (gemv / 1e6) / bandwidth:.0%} of the limit)")
    for spin_ns in (2500, 5000, 10000):
        base = timed(copies, acts, (n, k), fmt, spin_ns, 0, True)
        line = f"  spin {spin_ns / 1000:4.1f} + GEMV {base:6.1f} us |"
        for fraction, columns_first in itertools.product(fractions, (True, False)):
            t = timed(copies, acts, (n, k), fmt, spin_ns, fraction, columns_first)
            predicted = min(fraction * read, spin_ns * 1e-9 * bandwidth) / bandwidth * 1e6
            line += f" f={fraction} {'cols' if columns_first else 'rows'}: {t - base:+5.1f} (pred -{predicted:.1f})"
        print(line, flush=True)
    for fraction in fractions:
        extra = timed(copies, acts, (n, k), fmt, 0, fraction, True) - gemv
        print(f"  no spin, prefetch f={fraction} cols + GEMV: {extra:+.1f} us")
    del copies, data
