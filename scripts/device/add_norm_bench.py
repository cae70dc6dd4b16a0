"""Time the residual add + next norm of a one-token decode step three ways, at the 27B shapes of the two GEMVs
before a norm (gdn/output and mlp/down, both 5,120 rows, q5): the GEMV then `add_rms_norm` (the default path), the
GEMV then `add_norm_records` (a deferred norm made by an elementwise launch), and `quant_linear_gemv_add_norm`
(the deferred norm in the GEMV's epilogue) with each (warps, depth, unroll, register cap) of its 32-row programs.
Each line is a CUDA graph of calls (as the runner replays a step, PDL included), each call on a different copy of
the matrix so the L2 never holds the weights; the fraction is of the read bandwidth measured in the same run over
the matrix's bytes alone.
Usage: python3 scripts/device/add_norm_bench.py   (NINFER_PDL=0 to time without programmatic dependent launch)"""

import itertools

import torch
import triton

from ninfer.kernels import quant_linear
from ninfer.kernels.activation_quant import quantize_activations
from ninfer.kernels.fused import add_norm_records, add_rms_norm
from ninfer.quant import codec_for

buffer = torch.ones(1 << 28, device="cuda")
bandwidth = buffer.numel() * 4 / (triton.testing.do_bench(buffer.sum, return_mode="median") / 1e3)
del buffer
print(f"read bandwidth {bandwidth / 1e12:.2f} TB/s")
SHAPES = [("27b gdn/output", 5120, 6144, "q5_g64_fp16"), ("27b mlp/down", 5120, 17408, "q5_g64_fp16")]
# (warps, (depth, unroll), register cap) of the epilogue kernel's 32-row programs; the first is what ships
EPILOGUES = [(16, (2, 1), 64), (16, (1, 1), 64), (16, (2, 2), 64), (16, (2, 2), 80), (8, (2, 1), 128)]


def time_shape(name: str, n: int, k: int, fmt: str) -> None:
    codec = codec_for(fmt)
    data = codec.encode(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    read = codec.encoded_bytes((n, k))
    rotation = itertools.cycle([data, *(data.clone() for _ in range(min(63, (256 << 20) // data.numel())))])
    acts = quantize_activations(torch.randn(1, k, device="cuda", dtype=torch.bfloat16))
    residual = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1

    def gemv():
        return quant_linear.quant_linear_gemv(acts, next(rotation), (n, k), fmt, out_dtype=torch.bfloat16)

    def epilogue(warps, pipeline, registers):
        quant_linear.ADD_NORM_WARPS, quant_linear.ADD_NORM_PIPELINE = warps, pipeline
        quant_linear.ADD_NORM_REGISTERS = registers
        return lambda: quant_linear.quant_linear_gemv_add_norm(acts, next(rotation), (n, k), fmt, residual, weight,
                                                               1e-6)

    cases = [("GEMV alone", lambda: gemv),
             ("GEMV + add_rms_norm", lambda: lambda: add_rms_norm(residual, gemv(), weight, 1e-6, quantize=True)),
             ("GEMV + add_norm_records", lambda: lambda: add_norm_records(residual, gemv(), weight, 1e-6))]
    cases += [(f"epilogue warps={w} depth/unroll={p} maxnreg={r}", lambda w=w, p=p, r=r: epilogue(w, p, r))
              for w, p, r in EPILOGUES]
    for label, make in cases:
        us = triton.testing.do_bench_cudagraph(make(), return_mode="median") * 1e3
        print(f"{name:16s} T=1 {label:52s} {us:7.1f} us {read / (us / 1e6) / bandwidth:5.0%} of the limit",
              flush=True)


for shape in SHAPES:
    time_shape(*shape)
