"""Sweep the integer groupwise GEMV's routes and tiles at the 27B / 35B-A3B shapes: effective TB/s of packed weight
bytes read, against the read bandwidth measured in the same run (a reduction over 1 GiB). Timed as CUDA graphs of
calls (as the runner replays decode steps: no host launch cost inside), each call on a different copy of the
matrix (copies rotate over > 256 MiB), so the 50 MiB L2 never holds the weights; x is quantized once outside the
timed calls, as the runner shares it between matrices.
Routes (`quant_linear_gemv(route=…)`): "token" (one token per program, the gathered MoE experts' route) and "batch"
(a tile of tokens per program, weights unpacked once for all of them).
With `--depth 1,2` and / or `--unroll 1,2` the batch route runs its default tile (at 8 tokens: 4 rows with 4 and
with 8 tokens a program) with each count of weight tiles loaded ahead (`depth`) and of K tiles per turn of its loop
(`unroll`) instead of the tile sweep; `--chain 2,4,8` runs every batch tile with each count of `dp4a` per dependent
chain, and `--lane-tree 0,1` with its positions' sums met in a reduction across lanes (0) or by exchanging halves
between lanes (1).
Usage: python3 scripts/device/gemv_bench.py [--quick] [--only NAME-PART] [--tokens 1,8] [--depth 1,2] [--unroll 1,2]
       [--chain 2,4,8] [--lane-tree 0,1]"""

import itertools
import sys

import torch
import triton
from device_timing import read_bandwidth, rotating_copies

from ninfer.kernels.activation_quant import quantize_activations
from ninfer.kernels.quant_linear import gemv_route, quant_linear_gemv
from ninfer.quant import codec_for

bandwidth = read_bandwidth()
SHAPES = [  # (name, N, K, fmt, experts gathered)
    ("27b mlp/gate_up", 34816, 5120, "q4_g64_fp16", 0),
    ("27b mlp/down", 5120, 17408, "q5_g64_fp16", 0),
    ("27b gdn/value_z", 12288, 5120, "q5_g64_fp16", 0),
    ("27b gdn/query_key", 4096, 5120, "q4_g64_fp16", 0),
    ("27b gdn/output", 5120, 6144, "q5_g64_fp16", 0),
    ("27b attention/gate_value", 7168, 5120, "q5_g64_fp16", 0),
    ("27b head", 248320, 5120, "q6_g64_fp16", 0),
    ("35b gdn/query_key", 4096, 2048, "q4_g64_fp16", 0),
    ("35b moe/routed_gate_up x8", 1024, 2048, "q4_g64_fp16", 8),
    ("35b moe/routed_down x8", 2048, 512, "q5_g64_fp16", 8),
    ("mtp q8", 5120, 10240, "q8_g32_fp16", 0),
]
quick = "--quick" in sys.argv
only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
token_counts = {int(t) for t in sys.argv[sys.argv.index("--tokens") + 1].split(",")} if "--tokens" in sys.argv else None


def _ints(flag: str) -> list[int | None]:
    return [int(v) for v in sys.argv[sys.argv.index(flag) + 1].split(",")] if flag in sys.argv else [None]


# (depth, unroll, chain, lane tree); None = the default
variants = list(itertools.product(_ints("--depth"), _ints("--unroll"), _ints("--chain"), _ints("--lane-tree")))
pipeline_sweep = "--depth" in sys.argv or "--unroll" in sys.argv  # then the batch route's default tile only
# (route, BLOCK_N, warps, tokens per program); None = the route's default
TOKEN_TILES = [("token", 2, 1, None), ("token", 4, 2, None)]
BATCH_TILES = [("batch", n, w, None) for n, w in ((1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 2), (16, 4))]
best = {}
for name, n, k, fmt, gathered in SHAPES:
    if only not in name:
        continue
    codec = codec_for(fmt)
    total_rows = n * 256 if gathered else n
    data = codec.encode(torch.randn(total_rows, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    read = codec.encoded_bytes((n, k)) * max(1, gathered)
    copies = rotating_copies(data)
    experts = torch.randperm(256, device="cuda")[:gathered].to(torch.int32) if gathered else None
    default_route = gemv_route(codec.groups_per_row(k) * codec.group, bool(gathered))
    if gathered:
        plan = [(1, TOKEN_TILES)]
    elif pipeline_sweep:
        # at 8 tokens 4 rows with both token tilings (the default depends on the format and K: `batch_block_t`)
        plan = [(t, [("batch", 4, 1, 4), ("batch", 4, 1, 8)] if t == 8 else [("batch", None, None, None)])
                for t in (1, 8, 2, 4, 16, 32)]
    else:
        batch = BATCH_TILES[1:4] if quick else BATCH_TILES
        # at 8 tokens 2 and 4 rows on one warp with both token tilings explicitly, in place of the default tiling
        # (`batch_block_t`: it depends on the format and K)
        eight = [tile for tile in batch if tile[1:3] not in ((2, 1), (4, 1))]
        eight += [("batch", n, 1, t) for t in (4, 8) for n in (2, 4)]
        plan = [(1, TOKEN_TILES[:1] + batch), (8, TOKEN_TILES[:1] + eight),
                *((t, [("token", None, None, None), ("batch", None, None, None), ("batch", 4, 1, None),
                       ("batch", 2, 1, 16)]) for t in (2, 4, 16, 32))]
    for tokens, tiles in plan:
        if token_counts and tokens not in token_counts:
            continue
        acts = quantize_activations(torch.randn(1 if gathered else tokens, k, device="cuda", dtype=torch.bfloat16))
        for (route, block_n, warps, block_t), (depth, unroll, chain, lane) in itertools.product(tiles, variants):
            if (route == "batch" and default_route != "batch") or \
                    (route == "token" and (pipeline_sweep or chain or lane is not None)):
                continue
            rotation = itertools.cycle(copies)
            kwargs = dict(block_n=block_n, out_dtype=torch.bfloat16, experts=experts, expert_rows=n,
                          x_per_slot=gathered or 1, num_warps=warps, route=route, block_t=block_t)
            if route == "batch":
                kwargs.update(depth=depth, unroll=unroll, chain=chain, lane_tree=None if lane is None else bool(lane))

            def call(acts=acts, rotation=rotation, shape=(total_rows, k), fmt=fmt, kwargs=kwargs):
                return quant_linear_gemv(acts, next(rotation), shape, fmt, **kwargs)

            us = triton.testing.do_bench_cudagraph(call, return_mode="median") * 1e3
            fraction = read / (us / 1e6) / bandwidth
            key = (name, tokens)
            tile = f"{route} BN={block_n or 'default'} warps={warps or 'default'} tokens/program={block_t or 'default'}"
            tile += "" if route == "token" else (f" depth={depth or 'default'} unroll={unroll or 'default'}"
                                                 f" chain={chain or 'default'}"
                                                 f" lane tree={'default' if lane is None else lane}")
            if key not in best or fraction > best[key][0]:
                best[key] = (fraction, us, tile)
            print(f"{name:28s} T={tokens:2d} {tile}: {us:8.1f} us {fraction:5.0%} of the limit", flush=True)
    del copies, data
x = torch.randn(16, 17408, device="cuda", dtype=torch.bfloat16)
for tokens in (1, 16):
    us = triton.testing.do_bench_cudagraph(lambda tokens=tokens: quantize_activations(x[:tokens]),
                                           return_mode="median") * 1e3
    print(f"quantize_activations T={tokens} K=17408: {us:.1f} us")
print("best per shape:")
for (name, tokens), (fraction, us, tile) in best.items():
    print(f"  {name:28s} T={tokens:2d}: {us:8.1f} us {fraction:5.0%}  {tile}")
