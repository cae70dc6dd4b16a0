"""Sweep the integer groupwise GEMV's tiles at the 27B / 35B-A3B shapes: effective TB/s of packed weight bytes
read, against the read bandwidth measured in the same run (a reduction over 1 GiB). Timed as CUDA graphs of
calls (as the runner replays decode steps: no host launch cost inside), each call on a different copy of the
matrix (copies rotate over > 256 MiB), so the 50 MiB L2 never holds the weights; x is quantized once outside the
timed calls, as the runner shares it between matrices.
For whole matrices it then times the tensor-core route (`mma=True`, a few tiles) against the dp4a route at
T = 4, 6, 8, 16, 32.
Usage: python3 scripts/device/gemv_bench.py [--quick]"""

import itertools
import sys

import torch
import triton

from ninfer.kernels.activation_quant import quantize_activations
from ninfer.kernels.quant_linear import dequantize, gemv_block_k, quant_linear_gemv
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
# (BLOCK_N, warps, tiles prefetched); BLOCK_K is the matrix's
configs = [(2, 1, 1), (2, 1, 2), (4, 2, 1), (4, 2, 2), (4, 4, 1), (8, 2, 1), (8, 4, 1), (16, 4, 1), (16, 8, 1)]
best = {}
for name, n, k, fmt, gathered in SHAPES:
    codec = codec_for(fmt)
    total_rows = n * 256 if gathered else n
    data = codec.encode(torch.randn(total_rows, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    read = codec.encoded_bytes((n, k)) * max(1, gathered)
    copies = [data, *(data.clone() for _ in range(min(63, (256 << 20) // data.numel())))]
    experts = torch.randperm(256, device="cuda")[:gathered].to(torch.int32) if gathered else None
    block_k = gemv_block_k(codec.groups_per_row(k) * codec.group)
    for tokens in ((1,) if gathered else (1, 8)):
        acts = quantize_activations(torch.randn(1 if gathered else tokens, k, device="cuda", dtype=torch.bfloat16))
        for block_n, warps, prefetch in configs[:4] if quick else configs:
            rotation = itertools.cycle(copies)
            kwargs = dict(block_n=block_n, out_dtype=torch.bfloat16, experts=experts, expert_rows=n,
                          x_per_slot=gathered or 1, num_warps=warps, prefetch=prefetch, mma=False)

            def call(acts=acts, rotation=rotation, shape=(total_rows, k), fmt=fmt, kwargs=kwargs):
                return quant_linear_gemv(acts, next(rotation), shape, fmt, **kwargs)

            us = triton.testing.do_bench_cudagraph(call, return_mode="median") * 1e3
            fraction = read / (us / 1e6) / bandwidth
            key = (name, tokens)
            if key not in best or fraction > best[key][0]:
                best[key] = (fraction, us, block_n, block_k, warps, prefetch)
            print(f"{name:28s} T={tokens:2d} BN={block_n:3d} BK={block_k:4d} warps={warps} prefetch={prefetch}: "
                  f"{us:8.1f} us {fraction:5.0%} of the limit", flush=True)
    if not gathered:  # the tensor-core route against the best dp4a tile: where MMA_MIN_TOKENS should sit
        for tokens in (4, 6, 8, 16, 32):
            acts = quantize_activations(torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16))
            # the dp4a route's default tile, then tensor-core tiles (rows, warps); None = the defaults
            for mma, block_n, warps in ((False, None, None), (True, None, None), (True, 16, 4), (True, 32, 8),
                                        (True, 64, 8)):
                rotation = itertools.cycle(copies)

                def call(acts=acts, rotation=rotation, shape=(total_rows, k), fmt=fmt, mma=mma, block_n=block_n,
                         warps=warps):
                    return quant_linear_gemv(acts, next(rotation), shape, fmt, out_dtype=torch.bfloat16, mma=mma,
                                             block_n=block_n, num_warps=warps)

                us = triton.testing.do_bench_cudagraph(call, return_mode="median") * 1e3
                route = f"tensor-core route BN={block_n or 'default'} warps={warps or 'default'}" if mma \
                    else "dp4a route, default tile"
                print(f"{name:28s} T={tokens:2d} {route}: {us:8.1f} us {read / (us / 1e6) / bandwidth:5.0%} of the "
                      "limit", flush=True)
        ms = triton.testing.do_bench(lambda data=data, n=n, k=k, fmt=fmt: dequantize(data, (n, k), fmt))
        print(f"{name:28s} dequantize: {ms * 1e3:8.1f} us ({(read + n * k * 2) / (ms / 1e3) / bandwidth:.0%} of "
              f"the limit, reading packed + writing bf16)")
    del copies, data
x = torch.randn(16, 17408, device="cuda", dtype=torch.bfloat16)
for tokens in (1, 16):
    us = triton.testing.do_bench_cudagraph(lambda tokens=tokens: quantize_activations(x[:tokens]),
                                           return_mode="median") * 1e3
    print(f"quantize_activations T={tokens} K=17408: {us:.1f} us")
print("best per shape:")
for (name, tokens), (fraction, us, block_n, block_k, warps, prefetch) in best.items():
    print(f"  {name:28s} T={tokens:2d}: {us:8.1f} us {fraction:5.0%}  BN={block_n} BK={block_k} warps={warps} "
          f"prefetch={prefetch}")
