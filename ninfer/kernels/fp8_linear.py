"""y = x · Wᵀ with W stored as FP8 rows (`fp8_e4m3fn_row_bf16`, layout `row_scale_v1`: N·K E4M3FN codes row-major,
then N bf16 row scales at the next 256-byte boundary; docs/artifact-format.md).

Contract: x `[T, K]` (fp32 / bf16 / fp16), `data` the object's bytes (1-D uint8 on x's device), `shape` = (N, K).
y[t, n] = scale[n] · Σ_k x[t, k] · e4m3(code[n, k]), accumulated in fp32.

`fp8_linear_gemv` (T ≤ 16: decode, verify; with `experts`, the MoE gather of `quant_linear_gemv`): each program
owns BLOCK_N rows of one token (the T programs of a row tile side by side, so that all but the first read its
weights from L2) and walks K in BLOCK_K-byte tiles, multiplying in fp32 and scaling the row sum — so a token's
result is the same bits at any T. The E4M3 → fp32
step is integer ops on the code's bits (sign, exponent rebiased from 7 to 127, mantissa moved up; subnormals as
m · 2⁻⁹), exact and the same on every GPU — no reliance on hardware FP8 conversion (sm_89+ only).
`fp8_rows` / `fp8_block`: rows of W decoded in torch (embedding lookups; the prefill route's scratch).
"""

from __future__ import annotations

import torch

from ninfer.kernels import tuning
from ninfer.kernels.dependent_launch import launch_options, wait_for_inputs
from ninfer.quant import codec_for

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

FORMAT = "fp8_e4m3fn_row_bf16"
MAX_TOKENS = 16


if triton is not None:
    from ninfer.kernels.row_tiles import gemv_rows

    @triton.jit
    def e4m3_to_fp32(bits):
        """E4M3FN bits (int32 in 0..255, never a NaN code) → the exact fp32 value."""
        sign = (bits & 0x80) << 24
        exponent = (bits >> 3) & 0xF
        mantissa = bits & 0x7
        normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        subnormal = mantissa.to(tl.float32) * 0.001953125  # m · 2^-9
        subnormal = tl.where(sign != 0, -subnormal, subnormal)
        return tl.where(exponent == 0, subnormal, normal)

    @triton.jit
    def _fp8_gemv_kernel(x_ptr, code_ptr, scale_ptr, out_ptr, expert_ptr, N, K, T, stride_x, stride_out,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATHER: tl.constexpr, X_PER_SLOT: tl.constexpr,
                         PDL: tl.constexpr):
        wait_for_inputs(PDL)
        rows, row_ok, _, wrows, x_base, out_base = gemv_rows(x_ptr, out_ptr, expert_ptr, N, T, stride_x, stride_out,
                                                             BLOCK_N, GATHER, X_PER_SLOT)
        lanes = tl.arange(0, BLOCK_K)
        scale = tl.load(scale_ptr + wrows).to(tl.float32)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            k_ok = (k0 + lanes) < K
            bits = tl.load(code_ptr + wrows[:, None] * K + (k0 + lanes)[None, :], mask=k_ok[None, :], other=0)
            x = tl.load(x_base + k0 + lanes, mask=k_ok, other=0.0).to(tl.float32)
            acc += e4m3_to_fp32(bits.to(tl.int32)) * x[None, :]
        tl.store(out_base + rows, tl.sum(acc, axis=1) * scale, mask=row_ok)


def _split(data: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = shape
    offset = codec_for(FORMAT).planes(shape)[1].offset
    return data[: n * k], data[offset : offset + 2 * n].view(torch.bfloat16)


def fp8_linear_gemv(x: torch.Tensor, data: torch.Tensor, shape: tuple[int, int], out_dtype: torch.dtype | None = None,
                    experts: torch.Tensor | None = None, expert_rows: int = 0, x_per_slot: int = 1) -> torch.Tensor:
    """`[T, N]` (or, with `experts`, `[S, expert_rows]` as in `quant_linear_gemv`) in `out_dtype` (default fp32)."""
    if triton is None:
        raise RuntimeError("the Triton FP8 GEMV needs the triton package")
    tokens = x.shape[0]
    if experts is None and not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"the FP8 GEMV takes 1..{MAX_TOKENS} tokens, not {tokens}")
    codes, scales = _split(data, shape)
    n, k = shape if experts is None else (expert_rows, shape[1])
    if x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"fp8_linear_gemv: x {list(x.shape)} (stride 1 last) does not fit W {list(shape)}")
    slots = tokens if experts is None else experts.numel()
    out = torch.empty((slots, n), dtype=out_dtype or torch.float32, device=x.device)
    choice = tuning.for_device(data.device).fp8
    block_n = choice.block_n
    grid = (triton.cdiv(n, block_n), slots) if experts is not None else (triton.cdiv(n, block_n) * tokens, 1)
    _fp8_gemv_kernel[grid](
        x, codes, scales, out, experts if experts is not None else codes, n, k, tokens, x.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=choice.block_k, GATHER=experts is not None, X_PER_SLOT=x_per_slot,
        num_warps=choice.warps, **launch_options(data.device))
    return out


def fp8_block(data: torch.Tensor, shape: tuple[int, int], first_row: int, rows: int, out: torch.Tensor) -> torch.Tensor:
    """W[first_row : first_row + rows] decoded into `out` (≥ rows · K elements of the activation dtype), code ×
    row scale in fp32 rounded once, a few million values at a time (the prefill route's scratch)."""
    codes, scales = _split(data, shape)
    k = shape[1]
    block = out[: rows * k].view(rows, k)
    step = max(1, (1 << 22) // k)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        picked = codes.view(shape)[first_row + start : first_row + stop].view(torch.float8_e4m3fn).float()
        block[start:stop] = picked * scales[first_row + start : first_row + stop].float()[:, None]
    return block


def fp8_rows(data: torch.Tensor, shape: tuple[int, int], rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `rows` of W decoded (code × row scale in fp32, rounded once to `dtype`) `[R, K]`."""
    codes, scales = _split(data, shape)
    picked = codes.view(shape)[rows].view(torch.float8_e4m3fn).float()
    return (picked * scales[rows].float()[:, None]).to(dtype)
