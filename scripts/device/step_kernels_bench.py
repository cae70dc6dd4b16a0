"""The small kernels of a decode step at the 27B / 35B-A3B shapes, timed as CUDA graphs (as the runner replays
them: no host launch cost inside), with the variants a change replaced beside the current ones. Each line: µs per
call, and for the kernels that stream a state, the fraction of the read bandwidth measured in the same run.
Usage: python3 scripts/device/step_kernels_bench.py"""

import functools

import torch
import triton
from device_timing import read_bandwidth

from ninfer.kernels import dense_linear, fused
from ninfer.kernels.activation_quant import quantize_activations
from ninfer.kernels.gdn_decode import gated_delta_decode

bandwidth = read_bandwidth()
bf16 = dict(device="cuda", dtype=torch.bfloat16)


def timed(label: str, moved: int, function, *args, **kwargs) -> None:
    us = triton.testing.do_bench_cudagraph(functools.partial(function, *args, **kwargs), return_mode="median") * 1e3
    extra = f"  {moved / (us / 1e6) / bandwidth:5.0%} of the limit" if moved else ""
    print(f"{label:56s} {us:7.2f} us{extra}", flush=True)


def old_dense(x, weight):  # the plan before: 8 rows per program, K in 256-lane steps, 4 warps
    out = torch.empty((x.shape[0], weight.shape[0]), device="cuda")
    dense_linear._dense_gemv_kernel[(triton.cdiv(weight.shape[0], 8), x.shape[0])](
        x, weight, out, weight.shape[0], x.shape[1], x.stride(0), weight.stride(0), out.stride(0), BLOCK_N=8,
        BLOCK_K=256, num_warps=4)
    return out


for name, hidden, v_heads, dense_rows in (("27b", 5120, 48, 96), ("35b", 2048, 32, 257)):
    weight = torch.randn(dense_rows, hidden, **bf16)
    norm_weight = torch.randn(hidden, **bf16) * 0.1
    for tokens in (1, 8):
        x = torch.randn(tokens, hidden, **bf16)
        h = torch.randn(tokens, hidden, **bf16)
        timed(f"{name} dense GEMV [{dense_rows}, {hidden}] T={tokens} old plan", 0, old_dense, x, weight)
        timed(f"{name} dense GEMV [{dense_rows}, {hidden}] T={tokens}", 0, dense_linear.dense_linear_gemv, x, weight)
        for split_rows in (0, fused.NORM_SPLIT_ROWS):
            fused.NORM_SPLIT_ROWS = split_rows
            label = "row split" if split_rows else "a program per row"
            timed(f"{name} add_rms_norm+records T={tokens} {label}", 0, fused.add_rms_norm, x, h, norm_weight, 1e-6,
                  quantize=True)
        timed(f"{name} quantize_activations T={tokens}", 0, quantize_activations, x)
    # GDN decode at batch 1 and 8: the conv and the delta-rule step on pooled windows and states, the gated norm
    k_heads, k_dim, v_dim = 16, 128, 128
    channels = 2 * k_heads * k_dim + v_heads * v_dim
    for batch in (1, 8):
        state = torch.randn(16, v_heads, k_dim, v_dim, device="cuda") * 0.1
        conv_state = torch.randn(16, channels, 3, **bf16)
        slots = torch.arange(batch, device="cuda", dtype=torch.int32)
        mixed = torch.randn(batch, channels, **bf16)
        z = torch.randn(batch, v_heads * v_dim, **bf16)
        a_b = torch.randn(batch, 2 * v_heads, **bf16)
        a_log, dt_bias = torch.randn(v_heads, device="cuda"), torch.randn(v_heads, device="cuda")
        conv_weight = torch.randn(channels, 4, **bf16)
        gdn_norm = torch.randn(v_dim, **bf16)
        timed(f"{name} gated_delta_decode B={batch}", 2 * batch * v_heads * k_dim * v_dim * 4, gated_delta_decode,
              mixed, z, a_b, conv_weight, conv_state, a_log, dt_bias, gdn_norm, state, slots, k_heads, k_dim, v_heads,
              v_dim, 1e-6)
