"""The stripe GEMV (`ninfer.kernels.stripe_linear`) against the batch route of `quant_linear` on the 27B's q5
matrices, each call on a rotating copy (L2 never holds the matrix), as CUDA graphs: first a check at T = 1..16 that
every result matches the float64 oracle and that each token's row has the bits of that token alone, then the
timings, as a fraction of the read bandwidth measured in the same run, and the prefill's decoding of each matrix
(the chunks against the natural layout's `dequantize`, bf16 into one scratch buffer).

Usage (GPU): python3 scripts/device/stripe_timing.py [--tokens 1,8] [--warps 8,16] [--depth 1,2,3,4] [--only NAME-PART]
       [--dequantize] (the decoding only)
(`--warps` other than the product's WARPS changes a result's bits: timed, not the product.)"""

import itertools
import sys

import torch
import triton
from device_timing import read_bandwidth, rotating_copies

from ninfer.kernels.activation_quant import quantize_activations
from ninfer.kernels.quant_linear import dequantize, quant_linear_gemv
from ninfer.kernels.stripe_linear import (
    FORMAT,
    WARPS,
    dequantize_stripes,
    quantize_tiles,
    repack,
    stripe_gemv,
    stripe_gemv_reference,
)
from ninfer.quant import codec_for

MATRICES = (("27b mlp/down", 5120, 17408), ("27b gdn/value_z", 12288, 5120), ("27b gdn/output", 5120, 6144),
            ("27b attention/gate_value", 7168, 5120))


def _ints(flag: str, default: list[int]) -> list[int]:
    return [int(v) for v in sys.argv[sys.argv.index(flag) + 1].split(",")] if flag in sys.argv else default


def check() -> None:
    """T = 1..16 on the down projection's shape: against the oracle, and row t equal to token t alone."""
    torch.manual_seed(0)
    shape = (5120, 17408)
    data = codec_for(FORMAT).encode(torch.randn(shape, device="cuda") * 0.02)
    chunks = repack(data, shape)
    x = torch.randn(16, shape[1], device="cuda", dtype=torch.bfloat16)
    alone = torch.cat([stripe_gemv(quantize_tiles(x[t : t + 1]), chunks, shape) for t in range(16)])
    worst = 0.0
    for tokens in range(1, 17):
        tiles = quantize_tiles(x[:tokens])
        got = stripe_gemv(tiles, chunks, shape)
        expected = stripe_gemv_reference(tiles, chunks, shape)
        worst = max(worst, float((got.double() - expected).norm() / expected.norm()))
        assert torch.equal(got, alone[:tokens]), f"T={tokens}: a token's bits depend on T"
    print(f"check T=1..16: worst relative error {worst:.1e} (bf16 out); every row the bits of its token alone")
    assert worst < 4e-3


def dequantize_timing(bandwidth: float) -> None:
    """Each matrix decoded to bf16 (read its bytes, write 2 bytes an element) from either layout."""
    codec = codec_for(FORMAT)
    for name, n, k in _matrices():
        shape = (n, k)
        data = codec.encode(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        chunks = repack(data, shape)
        scratch = torch.empty(n * k, dtype=torch.bfloat16, device="cuda")
        moved = codec.encoded_bytes(shape) + 2 * n * k
        calls = (("natural dequantize", lambda d=data, sh=shape, o=scratch: dequantize(d, sh, FORMAT, out=o)),
                 ("stripe chunks", lambda c=chunks, sh=shape, o=scratch: dequantize_stripes(c, sh, out=o)))
        for label, call in calls:
            us = triton.testing.do_bench_cudagraph(call, return_mode="median") * 1e3
            print(f"{name:26s} decode to bf16, {label}: {us:7.1f} us ({moved / (us / 1e6) / bandwidth:4.0%} of the "
                  f"read bandwidth, bytes read and written)", flush=True)


def _matrices():
    return [m for m in MATRICES if "--only" not in sys.argv or sys.argv[sys.argv.index("--only") + 1] in m[0]]


def main() -> None:
    if "--dequantize" in sys.argv:
        dequantize_timing(read_bandwidth())
        return
    check()
    bandwidth = read_bandwidth()
    dequantize_timing(bandwidth)
    codec = codec_for(FORMAT)
    for name, n, k in _matrices():
        shape = (n, k)
        read = codec.encoded_bytes(shape)
        copies = rotating_copies(codec.encode(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02), 31)
        chunks = [repack(c, shape) for c in copies]
        for tokens in _ints("--tokens", [1, 8]):
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            acts, tiles = quantize_activations(x), quantize_tiles(x)
            out = torch.empty((tokens, n), dtype=torch.bfloat16, device="cuda")
            rotation = itertools.cycle(copies)
            us = triton.testing.do_bench_cudagraph(lambda acts=acts, rotation=rotation, shape=shape: quant_linear_gemv(
                acts, next(rotation), shape, FORMAT, out_dtype=torch.bfloat16), return_mode="median") * 1e3
            print(f"{name:26s} T={tokens:2d}: batch route {us:6.1f} us ({read / (us / 1e6) / bandwidth:4.0%})",
                  flush=True)
            for warps, depth in itertools.product(_ints("--warps", [WARPS]), _ints("--depth", [1, 2])):
                rotation = itertools.cycle(chunks)
                us = triton.testing.do_bench_cudagraph(
                    lambda tiles=tiles, rotation=rotation, shape=shape, out=out, warps=warps, depth=depth: stripe_gemv(
                        tiles, next(rotation), shape, out=out, warps=warps, depth=depth), return_mode="median") * 1e3
                print(f"{name:26s} T={tokens:2d}: stripes, warps {warps:2d} depth {depth}: {us:6.1f} us "
                      f"({read / (us / 1e6) / bandwidth:4.0%})", flush=True)
        del copies, chunks


if __name__ == "__main__":
    main()
