"""A groupwise matrix (`quant_linear`'s formats) decoded into a dense `[N, K]` matrix on the device: the prefill
route of packed matrices (dequantize into a scratch buffer, then cuBLAS), embedding lookups and one expert's block.
"""

from __future__ import annotations

import torch

from ninfer.kernels import tuning
from ninfer.kernels.dependent_launch import launch_options, wait_for_inputs
from ninfer.kernels.groupwise_planes import high_row_units, packed_planes

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

if triton is not None:
    from ninfer.kernels.groupwise_planes import lane_values, load_tile

    @triton.jit
    def _dequantize_kernel(base_ptr, high_ptr, scale_ptr, out_ptr, index_ptr, N, K, row_words, high_row_units, gpr,
                           BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GATHER: tl.constexpr, PDL: tl.constexpr):
        wait_for_inputs(PDL)
        LPW: tl.constexpr = 4 if BITS == 8 else 8
        NG: tl.constexpr = BLOCK_K // GROUP
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output rows
        k0 = tl.program_id(1) * BLOCK_K
        safe_rows = tl.minimum(rows, N - 1).to(tl.int64)
        if GATHER:  # output row r is stored row index[r]
            safe_rows = tl.load(index_ptr + safe_rows).to(tl.int64)
        words, high, scale = load_tile(base_ptr, high_ptr, scale_ptr, safe_rows, k0, row_words, high_row_units, gpr,
                                       BITS, LPW, GROUP, BLOCK_K)
        # codes of lanes LPW·w + p for every p, interleaved back into lane order with joins
        c01 = tl.join(lane_values(words, high, 0, BITS), lane_values(words, high, 1, BITS))
        c23 = tl.join(lane_values(words, high, 2, BITS), lane_values(words, high, 3, BITS))
        if LPW == 8:
            c45 = tl.join(lane_values(words, high, 4, BITS), lane_values(words, high, 5, BITS))
            c67 = tl.join(lane_values(words, high, 6, BITS), lane_values(words, high, 7, BITS))
            codes = tl.permute(tl.join(tl.join(c01, c23), tl.join(c45, c67)), (0, 1, 4, 3, 2))
        else:
            codes = tl.permute(tl.join(c01, c23), (0, 1, 3, 2))
        codes = tl.reshape(codes, [BLOCK_N, NG, GROUP])
        w = tl.reshape(codes * scale[:, :, None], [BLOCK_N, BLOCK_K])
        lanes = k0 + tl.arange(0, BLOCK_K)
        out = out_ptr + rows[:, None].to(tl.int64) * K + lanes[None, :]
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=(rows < N)[:, None] & (lanes < K)[None, :])


def dequantize(data: torch.Tensor, shape: tuple[int, int], fmt: str, dtype: torch.dtype = torch.bfloat16,
               out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """W `[N, K]` in `dtype` (rounded once from fp32 scale × code), into `out` when given (a scratch buffer of at
    least N·K elements, reused across matrices by the prefill route). With `rows` (a device int tensor `[R]`),
    only those rows, in that order: `[R, K]` (embedding lookups, one expert's block)."""
    if triton is None:
        raise RuntimeError("the Triton dequantizer needs the triton package")
    codec, base, high, scales, planes = packed_planes(data, shape, fmt)
    n, k = shape if rows is None else (rows.numel(), shape[1])
    gpr = codec.groups_per_row(k)
    result = torch.empty((n, k), dtype=dtype, device=data.device) if out is None else out[: n * k].view(n, k)
    block_n, block_k = tuning.for_device(data.device).quant_linear.dequantize_block
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        base, high, scales, result, rows if rows is not None else base, n, k, planes[0].row_bytes // 4,
        high_row_units(codec, planes), gpr, BITS=codec.bits, GROUP=codec.group, BLOCK_N=block_n, BLOCK_K=block_k,
        GATHER=rows is not None, **launch_options(data.device))
    return result
