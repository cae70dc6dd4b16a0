"""The tensor-core experiment ("dot" route, `quant_linear._gemv_dot_kernel`) against the batch route at the 27B
shapes: µs a call (CUDA graphs over rotating copies of the matrix, as `gemv_bench.py` times) of the batch route's
default tile and of the dot route at 16 rows on 4 warps (its default) and 32 rows on 8, and whether the bits are
equal. Usage: python3 scripts/device/dot_route_bench.py [TOKENS] [NAME-PART]"""

import itertools
import sys

import torch
import triton
from device_timing import read_bandwidth, rotating_copies

from ninfer.kernels.activation_quant import quantize_activations
from ninfer.kernels.quant_linear import quant_linear_gemv
from ninfer.quant import codec_for

SHAPES = [("27b mlp/gate_up", 34816, 5120, "q4_g64_fp16"), ("27b mlp/down", 5120, 17408, "q5_g64_fp16"),
          ("27b gdn/value_z", 12288, 5120, "q5_g64_fp16"), ("27b gdn/output", 5120, 6144, "q5_g64_fp16"),
          ("27b head", 248320, 5120, "q6_g64_fp16")]
tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 8
only = sys.argv[2] if len(sys.argv) > 2 else ""
bandwidth = read_bandwidth()
for name, n, k, fmt in SHAPES:
    if only not in name:
        continue
    codec = codec_for(fmt)
    data = codec.encode(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    copies = rotating_copies(data)
    acts = quantize_activations(torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16))
    same = torch.equal(quant_linear_gemv(acts, data, (n, k), fmt, route="dot"),
                       quant_linear_gemv(acts, data, (n, k), fmt, route="batch"))
    cells = []
    for route, block_n, warps in (("batch", None, None), ("dot", 16, 4), ("dot", 32, 8)):
        rotation = itertools.cycle(copies)

        def call(rotation=rotation, route=route, block_n=block_n, warps=warps, acts=acts, shape=(n, k), fmt=fmt):
            return quant_linear_gemv(acts, next(rotation), shape, fmt, route=route, block_n=block_n, num_warps=warps,
                                     out_dtype=torch.bfloat16)

        us = triton.testing.do_bench_cudagraph(call, return_mode="median") * 1e3
        tile = "" if block_n is None else f" {block_n} rows on {warps} warps"
        cells.append(f"{route}{tile} {us:.1f} us ({codec.encoded_bytes((n, k)) / (us / 1e6) / bandwidth:.0%})")
    print(f"{name} T={tokens}: " + ", ".join(cells) + f", same bits: {same}", flush=True)
    del copies, data
