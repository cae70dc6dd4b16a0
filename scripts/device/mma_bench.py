"""The tensor-core GEMV route (`quant_linear_gemv(route="mma")`) against the dp4a batch route at the 27B shapes:
bits compared first (every variant must equal the batch route's result exactly), then CUDA-graph times with the
matrix copies rotating past L2, as a fraction of the bytes limit at the read bandwidth measured in the same run.
Variants: warps per program (`num_warps`: 8 or 16), tiles loaded ahead (`depth`), K tiles per turn (`unroll`).
Usage: python3 scripts/device/mma_bench.py [--only NAME-PART] [--tokens 2,4,8] [--variants W:D:U,…]"""

import itertools
import sys

import torch
import triton
from device_timing import read_bandwidth, rotating_copies

from ninfer.kernels.activation_quant import quantize_activations
from ninfer.kernels.quant_linear import quant_linear_gemv
from ninfer.quant import codec_for

SHAPES = [
    ("27b mlp/gate_up", 34816, 5120, "q4_g64_fp16"),
    ("27b mlp/down", 5120, 17408, "q5_g64_fp16"),
    ("27b gdn/value_z", 12288, 5120, "q5_g64_fp16"),
    ("27b gdn/query_key", 4096, 5120, "q4_g64_fp16"),
    ("27b gdn/output", 5120, 6144, "q5_g64_fp16"),
    ("27b attention/gate_value", 7168, 5120, "q5_g64_fp16"),
    ("27b head", 248320, 5120, "q6_g64_fp16"),
]
only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
tokens_list = [int(t) for t in sys.argv[sys.argv.index("--tokens") + 1].split(",")] if "--tokens" in sys.argv \
    else [8]
variants = [tuple(int(v) for v in spec.split(":")) for spec in
            (sys.argv[sys.argv.index("--variants") + 1].split(",") if "--variants" in sys.argv
             else ["8:1:1", "8:2:1", "8:1:2", "8:2:2", "16:1:1", "16:1:2"])]
bandwidth = read_bandwidth()
for name, n, k, fmt in SHAPES:
    if only not in name:
        continue
    codec = codec_for(fmt)
    data = codec.encode(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    read = codec.encoded_bytes((n, k))
    copies = rotating_copies(data)
    for tokens in tokens_list:
        acts = quantize_activations(torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16))
        expected = quant_linear_gemv(acts, data, (n, k), fmt)
        runs = [("batch", {})] + [(f"mma warps={w} depth={d} unroll={u}",
                                   dict(route="mma", num_warps=w, depth=d, unroll=u)) for w, d, u in variants]
        for label, kwargs in runs:
            try:
                got = quant_linear_gemv(acts, data, (n, k), fmt, **kwargs)
            except Exception as exc:  # a variant the compiler refuses: report it, time the others
                print(f"{name:26s} T={tokens} {label}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            same = torch.equal(got, expected)
            rotation = itertools.cycle(copies)
            us = triton.testing.do_bench_cudagraph(
                lambda acts=acts, rotation=rotation, kwargs=kwargs, shape=(n, k), fmt=fmt: quant_linear_gemv(
                    acts, next(rotation), shape, fmt, **kwargs),
                return_mode="median") * 1e3
            print(f"{name:26s} T={tokens} {label:34s} {us:8.1f} us {read / (us / 1e6) / bandwidth:5.0%}"
                  f" {'same bits' if same else 'DIFFERENT BITS, max ' + str(float((got - expected).abs().max()))}",
                  flush=True)
    del copies, data
