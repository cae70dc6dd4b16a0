"""What splitting K across programs would buy the few-row 27B matrices, before building it: a [S·N, K/S] GEMV has
the programs and per-program work of [N, K] with K split S ways (the partial sums' reduction not included). Times
the batch route at T = 1 and 8 with its default tile and 2 or 4 rows a program, the default or a second tile
ahead, as CUDA graphs over copies that rotate past L2; percent = packed bytes / time / the read bandwidth measured
in the same run.
Usage: python3 scripts/device/split_k_proxy.py"""

import itertools

import torch
import triton
from device_timing import read_bandwidth, rotating_copies

from ninfer.kernels.activation_quant import quantize_activations
from ninfer.kernels.quant_linear import quant_linear_gemv
from ninfer.quant import codec_for

bandwidth = read_bandwidth()
Q4, Q5 = "q4_g64_fp16", "q5_g64_fp16"
SHAPES = [  # (name, N, K, fmt): the 27B matrix, then [S·N, K/S] stand-ins for S-way splits
    ("down", 5120, 17408, Q5), ("down/2", 10240, 8192, Q5), ("down/2b", 10240, 9216, Q5), ("down/4", 20480, 4096, Q5),
    ("output", 5120, 6144, Q5), ("output/2", 10240, 3072, Q5), ("output/3", 15360, 2048, Q5),
    ("qk", 4096, 5120, Q4), ("qk/2", 8192, 3072, Q4),
    ("vz", 12288, 5120, Q5), ("gate_up", 34816, 5120, Q4), ("attn_out", 5120, 6144, Q5),
]
for name, n, k, fmt in SHAPES:
    codec = codec_for(fmt)
    data = codec.encode(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    read = codec.encoded_bytes((n, k))
    copies = rotating_copies(data)
    for tokens in (1, 8):
        acts = quantize_activations(torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16))
        for block_n, depth in itertools.product((None, 2, 4), (None, 2)):
            rotation = itertools.cycle(copies)

            def call(acts=acts, rotation=rotation, shape=(n, k), fmt=fmt, block_n=block_n, depth=depth):
                return quant_linear_gemv(acts, next(rotation), shape, fmt, block_n=block_n, depth=depth,
                                         out_dtype=torch.float32)
            us = triton.testing.do_bench_cudagraph(call, return_mode="median") * 1e3
            print(f"{name:9s} [{n},{k}] T={tokens} BN={block_n} depth={depth}: {us:7.1f} us "
                  f"({read / (us / 1e6) / bandwidth:5.0%} of bytes)", flush=True)
    del copies, data
