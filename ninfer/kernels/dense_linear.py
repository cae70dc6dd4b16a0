"""y = x · Wᵀ for a dense weight matrix (bf16 / fp16 / fp32) and few tokens, with a result per token that does not
depend on how many tokens share the call.

Contract: x `[T, K]` (fp32 / bf16 / fp16, stride 1 on K), W `[N, K]` (stride 1 on K), T ≤ 64. y[t, n] =
Σ_k x[t, k] · W[n, k] accumulated in fp32, `[T, N]` in `out_dtype` (default fp32).

`dense_linear_gemv`: each program owns BLOCK_N rows of one token (grid: row tiles × tokens) and walks K in
BLOCK_K tiles, multiplying in fp32 into a `[BLOCK_N, BLOCK_K]` accumulator summed at the end. The decode steps'
small bf16 matrices (GDN a/b projection, MoE router) take it instead of cuBLAS, whose kernel choice changes with
T: with it every matrix of a decode step gives a token the same bits at any batch (a verify step's rows equal the
decode steps'). These matrices are short (96 rows for the 27B's a/b, 257 for a router), so the tile plan
(`tuning.DenseTuning`) spreads them wide: one row per program and K in one tile up to MAX_BLOCK_K lanes — one load
wave per program, not a loop of dependent ones. Runs under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from ninfer.kernels import tuning
from ninfer.kernels.dependent_launch import launch_options, wait_for_inputs
from ninfer.kernels.quant_linear import MAX_GEMV_TOKENS

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None


MAX_BLOCK_K = 8192  # lanes of K per step: 32 fp32 accumulators per thread at 8 warps

if triton is not None:
    from ninfer.kernels.fixed_order import pairwise_row_sum
    from ninfer.kernels.row_tiles import row_tile

    @triton.jit
    def _dense_gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_x, stride_w, stride_out, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, PAIRWISE: tl.constexpr, PDL: tl.constexpr):
        wait_for_inputs(PDL)
        rows, row_ok, safe_rows = row_tile(tl.program_id(0), N, BLOCK_N)
        token = tl.program_id(1).to(tl.int64)
        lanes = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            k_ok = (k0 + lanes) < K
            w = tl.load(w_ptr + safe_rows[:, None] * stride_w + (k0 + lanes)[None, :], mask=k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + token * stride_x + k0 + lanes, mask=k_ok, other=0.0)
            acc = tl.fma(w.to(tl.float32), x.to(tl.float32)[None, :], acc)  # what `acc += w · x` compiles to
        total = pairwise_row_sum(acc, BLOCK_K) if PAIRWISE else tl.sum(acc, axis=1)
        tl.store(out_ptr + token * stride_out + rows, total, mask=row_ok)


def dense_linear_gemv(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
                      pairwise: bool = False) -> torch.Tensor:
    """`[T, N]` (see the module docstring). With `pairwise` (K ≤ MAX_BLOCK_K) the row sums take the fixed tree of
    `pairwise_row_sum` over one K tile: the bits of `gated_delta_decode`'s in-kernel a/b product."""
    if triton is None:
        raise RuntimeError("the dense GEMV needs the triton package")
    tokens, k = x.shape
    n = weight.shape[0]
    if not 1 <= tokens <= MAX_GEMV_TOKENS or weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"dense_linear_gemv: x {list(x.shape)} and W {list(weight.shape)} (1..{MAX_GEMV_TOKENS} "
                         f"tokens, the same K, stride 1 on K)")
    out = torch.empty((tokens, n), dtype=out_dtype or torch.float32, device=x.device)
    # the plan depends on the matrix only (a token's bits at any T)
    choice = tuning.for_device(x.device).dense
    block_n, block_k = choice.block_n, choice.block_k or min(triton.next_power_of_2(k), MAX_BLOCK_K)
    if pairwise:  # one tile of the padded K, whatever the platform
        if k > MAX_BLOCK_K:
            raise ValueError(f"dense_linear_gemv: the pairwise sum takes K ≤ {MAX_BLOCK_K}, not {k}")
        block_k = triton.next_power_of_2(k)
    _dense_gemv_kernel[(triton.cdiv(n, block_n), tokens)](x, weight, out, n, k, x.stride(0), weight.stride(0),
                                                         out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                                                         PAIRWISE=pairwise,
                                                         num_warps=max(1, min(8, block_k // 512)),
                                                         **launch_options(x.device))
    return out
