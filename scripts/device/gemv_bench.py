"""Time the Triton groupwise GEMV at 27B shapes: effective GB/s of packed weight bytes read, against the read
bandwidth measured in the same run (a reduction over 1 GiB). Usage: python3 scripts/device/gemv_bench.py"""

import torch
import triton

from ninfer.kernels.quant_linear import quant_linear_gemv
from ninfer.quant import codec_for

buffer = torch.ones(1 << 28, device="cuda")
bandwidth = buffer.numel() * 4 / (triton.testing.do_bench(buffer.sum, return_mode="median") / 1e3)
print(f"read bandwidth {bandwidth / 1e12:.2f} TB/s")
for n, k, fmt in ((34816, 5120, "q4_g64_fp16"), (5120, 17408, "q5_g64_fp16"), (7168, 5120, "q4_g64_fp16")):
    data = codec_for(fmt).encode(torch.randn(n, k, device="cuda") * 0.02)
    for tokens in (1, 16):
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        for block_n, split_k in ((16, 1), (64, 1), (16, 4), (32, 4), (64, 4), (16, 8), (32, 8), (64, 8), (32, 16)):
            def call(x=x, data=data, shape=(n, k), fmt=fmt, block_n=block_n, split_k=split_k):
                return quant_linear_gemv(x, data, shape, fmt, block_n=block_n, split_k=split_k)

            ms = triton.testing.do_bench(call, return_mode="median")
            rate = data.numel() / (ms / 1e3)
            print(f"[{n}, {k}] {fmt} T={tokens:2d} BLOCK_N={block_n:3d} SPLIT_K={split_k:2d}: {ms * 1e3:8.1f} us  "
                  f"{rate / 1e12:.2f} TB/s ({rate / bandwidth:.0%} of the limit)")
