"""Time the integer GEMV's tensor-core route (`quant_linear_gemv_mma`) against the batch route at the q4 shapes of
the 27B and 35B-A3B, with a bits check: µs a call and the fraction of the read bandwidth measured in the same run.
Timed as CUDA graphs of calls, each on a different copy of the matrix (copies rotate over > 256 MiB, so the 50 MiB
L2 never holds the weights); x is quantized once outside the timed calls.
With `ncu STRIPES X_AHEAD`, only calls the route 16 times at the 27B gate_up shape and 8 tokens, for `ncu -k
regex:_gemv_mma --launch-skip 10 --launch-count 1 …` to read one launch.
Usage: python3 scripts/device/mma_route_bench.py [TOKENS,…] (default 2,4,8,16) | ncu STRIPES X_AHEAD"""

import itertools
import sys

import torch
import triton
from device_timing import read_bandwidth, rotating_copies

from ninfer.kernels.activation_quant import quantize_activations
from ninfer.kernels.quant_linear import quant_linear_gemv
from ninfer.kernels.quant_linear_mma import quant_linear_gemv_mma
from ninfer.quant import codec_for

SHAPES = [("27b mlp/gate_up", 34816, 5120), ("27b gdn/query_key", 4096, 5120), ("35b gdn/query_key", 4096, 2048)]
FMT = "q4_g64_fp16"
if sys.argv[1:2] == ["ncu"]:
    n, k = SHAPES[0][1:]
    data = codec_for(FMT).encode(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    copies = itertools.cycle(rotating_copies(data, 15))
    acts = quantize_activations(torch.randn(8, k, device="cuda", dtype=torch.bfloat16))
    for _ in range(16):
        quant_linear_gemv_mma(acts, next(copies), (n, k), FMT, stripes=int(sys.argv[2]), x_ahead=sys.argv[3] == "1")
    torch.cuda.synchronize()
    raise SystemExit
bandwidth = read_bandwidth()
token_counts = [int(t) for t in sys.argv[1].split(",")] if len(sys.argv) > 1 else [2, 4, 8, 16]
codec = codec_for(FMT)
for name, n, k in SHAPES:
    data = codec.encode(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    read = codec.encoded_bytes((n, k))
    copies = rotating_copies(data)
    for tokens in token_counts:
        acts = quantize_activations(torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16))
        batch = quant_linear_gemv(acts, data, (n, k), FMT)
        variants = [("batch", lambda d, acts=acts, n=n, k=k: quant_linear_gemv(acts, d, (n, k), FMT))]
        variants += [(f"mma stripes={s} x_ahead={int(a)} persistent={p} depth={e}",
                      lambda d, s=s, a=a, p=p, e=e, acts=acts, n=n, k=k: quant_linear_gemv_mma(
                          acts, d, (n, k), FMT, stripes=s, x_ahead=a, persistent=p, depth=e))
                     for s, a, p, e in ((2, True, 0, 1), (2, False, 1, 1), (2, False, 1, 2))]
        for label, run in variants:
            same = torch.equal(run(data), batch)
            rotation = itertools.cycle(copies)
            us = triton.testing.do_bench_cudagraph(lambda run=run, rotation=rotation: run(next(rotation)),
                                                   return_mode="median") * 1e3
            print(f"{name:20s} T={tokens:2d} {label:44s} {us:8.1f} us {read / (us / 1e6) / bandwidth:5.0%} of the "
                  f"limit, {'same bits' if same else 'BITS DIFFER'}", flush=True)
    del copies, data
