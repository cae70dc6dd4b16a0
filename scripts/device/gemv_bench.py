"""Sweep the Triton groupwise GEMV's tile shapes at the 27B / 35B-A3B shapes: effective TB/s of packed weight bytes
read, against the read bandwidth measured in the same run (a reduction over 1 GiB). Each timed call reads a
different copy of the matrix (copies rotate over > 256 MiB), so the 50 MiB L2 never holds the weights.
Usage: python3 scripts/device/gemv_bench.py [--quick]"""

import itertools
import sys

import torch
import triton

from ninfer.kernels.quant_linear import dequantize, quant_linear_gemv
from ninfer.quant import codec_for

buffer = torch.ones(1 << 28, device="cuda")
bandwidth = buffer.numel() * 4 / (triton.testing.do_bench(buffer.sum, return_mode="median") / 1e3)
del buffer
print(f"read bandwidth {bandwidth / 1e12:.2f} TB/s")
SHAPES = [  # (name, N, K, fmt, experts gathered)
    ("27b mlp/gate_up", 34816, 5120, "q4_g64_fp16", 0),
    ("27b mlp/down", 5120, 17408, "q5_g64_fp16", 0),
    ("27b gdn/value_z", 12288, 5120, "q5_g64_fp16", 0),
    ("27b head", 248320, 5120, "q6_g64_fp16", 0),
    ("35b gdn/query_key", 4096, 2048, "q4_g64_fp16", 0),
    ("35b moe/routed_gate_up x8", 1024, 2048, "q4_g64_fp16", 8),
    ("35b moe/routed_down x8", 2048, 512, "q5_g64_fp16", 8),
    ("mtp q8", 5120, 10240, "q8_g32_fp16", 0),
]
quick = "--quick" in sys.argv
decode_configs = list(itertools.product((4, 8, 16), (256, 512, 1024), (2, 4, 8)))
verify_configs = list(itertools.product((16, 32, 64), (128, 256), (4, 8)))
best = {}
for name, n, k, fmt, gathered in SHAPES:
    codec = codec_for(fmt)
    total_rows = n * 256 if gathered else n
    data = codec.encode(torch.randn(total_rows, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    read = codec.encoded_bytes((n, k)) * max(1, gathered)
    copies = [data, *(data.clone() for _ in range(min(63, (256 << 20) // data.numel())))]
    experts = torch.randperm(256, device="cuda")[:gathered].to(torch.int32) if gathered else None
    for tokens in ((1,) if gathered else (1, 8)):
        x = torch.randn(1 if gathered else tokens, k, device="cuda", dtype=torch.bfloat16)
        configs = decode_configs if tokens == 1 else verify_configs
        for block_n, block_k, warps in configs[:3] if quick else configs:
            if block_k > 512 and k % block_k:
                continue
            rotation = itertools.cycle(copies)
            kwargs = dict(block_n=block_n, block_k=block_k, out_dtype=torch.bfloat16, experts=experts,
                          expert_rows=n, x_per_slot=gathered or 1, num_warps=warps)

            def call(x=x, rotation=rotation, shape=(total_rows, k), fmt=fmt, kwargs=kwargs):
                return quant_linear_gemv(x, next(rotation), shape, fmt, **kwargs)

            us = triton.testing.do_bench(call, return_mode="median") * 1e3
            fraction = read / (us / 1e6) / bandwidth
            key = (name, tokens)
            if key not in best or fraction > best[key][0]:
                best[key] = (fraction, us, block_n, block_k, warps)
            print(f"{name:28s} T={tokens} BN={block_n:3d} BK={block_k:4d} warps={warps}: {us:8.1f} us "
                  f"{fraction:5.0%} of the limit", flush=True)
    if not gathered:
        ms = triton.testing.do_bench(lambda data=data, n=n, k=k, fmt=fmt: dequantize(data, (n, k), fmt))
        print(f"{name:28s} dequantize: {ms * 1e3:8.1f} us ({(read + n * k * 2) / (ms / 1e3) / bandwidth:.0%} of "
              f"the limit, reading packed + writing bf16)")
    del copies, data
print("best per shape:")
for (name, tokens), (fraction, us, block_n, block_k, warps) in best.items():
    print(f"  {name:28s} T={tokens}: {us:8.1f} us {fraction:5.0%}  BN={block_n} BK={block_k} warps={warps}")
