"""y = x · Wᵀ with W stored packed in a groupwise format (q4/q5/q6 g64, q8 g32, `row_split_k128_v1`).

Contract: x `[T, K]` (fp32 / bf16 / fp16), `data` the object's bytes (1-D uint8, on x's device), `shape` = (N, K)
of W, `fmt` its format. y[t, n] = Σ_k x[t, k] · scale[n, k // G] · code[n, k], accumulated in fp32.

Three paths with that contract:
  * `quant_linear_reference`: decode W exactly (ninfer.quant) and multiply in fp32 — the oracle, any device;
  * `quant_linear_gemv`: a Triton kernel for few tokens (decode, speculative verify: T ≤ 16) that reads the
    packed planes once. Each program owns BLOCK_N rows and walks K in tiles of BLOCK_K lanes: one wide load of
    the row's base bytes (q4/q5/q6: even lane in the low nibble, odd lane in the high one; q8: a byte a lane,
    split into even/odd lanes), the high-bit plane of the same lanes (q5: 1 bit, q6: 2 bits), and the tile's
    fp16 scales. T = 1 multiplies codes by x in fp32, sums each group and scales it (exact products);
    T > 1 rounds the scaled weights to x's dtype (as the reference model's decoded weights are) and meets x
    through `tl.dot` with fp32 accumulation. With `experts`, the kernel gathers: output row s uses the
    `rows`-row block of expert `experts[s]` and input row `s // x_per_slot` (the MoE decode GEMV);
  * `dequantize`: the same unpacking into a bf16 `[N, K]` matrix, for the prefill route (dequantize to scratch,
    then cuBLAS) — `quant_linear` picks the route by T.
Runs under TRITON_INTERPRET=1 (fp32 inputs there: the interpreter miscomputes bf16 `tl.dot`).
"""

from __future__ import annotations

import torch

from ninfer.quant import codec_for
from ninfer.quant.groupwise import GroupwiseCodec

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

MAX_GEMV_TOKENS = 16


def quant_linear_reference(x: torch.Tensor, data: torch.Tensor, shape: tuple[int, int], fmt: str) -> torch.Tensor:
    weight = codec_for(fmt).decode(data, shape)
    return x.to(torch.float32) @ weight.T


if triton is not None:

    @triton.jit
    def _unpack_tile(base_ptr, high_ptr, scale_ptr, wrows, k0, row_bytes, high_row_bytes, gpr,
                     BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Codes of lanes [k0, k0 + BLOCK_K) of rows `wrows` as fp32 (even lanes, odd lanes) `[BN, BLOCK_K/2]`
        and the tile's scales `[BN, BLOCK_K/GROUP]` fp32."""
        half = tl.arange(0, BLOCK_K // 2)
        if BITS == 8:
            lanes = tl.arange(0, BLOCK_K)
            codes = tl.load(base_ptr + wrows[:, None] * row_bytes + (k0 + lanes)[None, :]).to(tl.int8)
            even, odd = tl.split(tl.reshape(codes, [BLOCK_N, BLOCK_K // 2, 2]))
            even = even.to(tl.float32)
            odd = odd.to(tl.float32)
        else:
            packed = tl.load(base_ptr + wrows[:, None] * row_bytes + (k0 // 2 + half)[None, :]).to(tl.int32)
            even = packed & 0xF
            odd = (packed >> 4) & 0xF
            if BITS == 5:  # bit 4 of lane i at bit i % 8 of byte i // 8: bytes j of the base hold lanes 2j, 2j+1
                hbyte = (k0 // 2 + half) // 4
                high = tl.load(high_ptr + wrows[:, None] * high_row_bytes + hbyte[None, :]).to(tl.int32)
                shift = 2 * (half % 4)[None, :]
                even = even | (((high >> shift) & 1) << 4)
                odd = odd | (((high >> (shift + 1)) & 1) << 4)
            if BITS == 6:  # bits 4-5 of lane i at bits 2i, 2i+1 of the stream: byte i // 4, shift 2 (i % 4)
                hbyte = (k0 // 2 + half) // 2
                high = tl.load(high_ptr + wrows[:, None] * high_row_bytes + hbyte[None, :]).to(tl.int32)
                shift = 4 * (half % 2)[None, :]
                even = even | (((high >> shift) & 3) << 4)
                odd = odd | (((high >> (shift + 2)) & 3) << 4)
            sign = 1 << (BITS - 1)
            even = (even - ((even & sign) << 1)).to(tl.float32)
            odd = (odd - ((odd & sign) << 1)).to(tl.float32)
        groups = tl.arange(0, BLOCK_K // GROUP)
        scale = tl.load(scale_ptr + wrows[:, None] * gpr + (k0 // GROUP + groups)[None, :]).to(tl.float32)
        return even, odd, scale

    @triton.jit
    def _gemv_kernel(x_ptr, base_ptr, high_ptr, scale_ptr, out_ptr, expert_ptr,
                     T, N, k_pad, row_bytes, high_row_bytes, gpr, stride_x, stride_out,
                     BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_T: tl.constexpr, GATHER: tl.constexpr, X_PER_SLOT: tl.constexpr, IEEE: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        safe_rows = tl.minimum(rows, N - 1).to(tl.int64)  # unmasked (vectorisable) loads; the store masks
        half = tl.arange(0, BLOCK_K // 2)
        NG: tl.constexpr = BLOCK_K // GROUP
        if GATHER:
            slot = tl.program_id(1)
            wrows = tl.load(expert_ptr + slot).to(tl.int64) * N + safe_rows
            x_base = x_ptr + (slot // X_PER_SLOT) * stride_x
            out_base = out_ptr + slot * stride_out
        else:
            wrows = safe_rows
            x_base = x_ptr
            out_base = out_ptr
        if BLOCK_T == 1:
            acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
            for k0 in tl.range(0, k_pad, BLOCK_K):
                even, odd, scale = _unpack_tile(base_ptr, high_ptr, scale_ptr, wrows, k0, row_bytes,
                                                high_row_bytes, gpr, BITS, GROUP, BLOCK_N, BLOCK_K)
                x_even = tl.load(x_base + k0 + 2 * half).to(tl.float32)
                x_odd = tl.load(x_base + k0 + 2 * half + 1).to(tl.float32)
                prod = even * x_even[None, :] + odd * x_odd[None, :]
                acc += tl.sum(tl.reshape(prod, [BLOCK_N, NG, GROUP // 2]), axis=2) * scale
            tl.store(out_base + rows, tl.sum(acc, axis=1), mask=row_ok)
        else:
            tokens = tl.arange(0, BLOCK_T)
            token_ok = tokens < T
            acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            for k0 in tl.range(0, k_pad, BLOCK_K):
                even, odd, scale = _unpack_tile(base_ptr, high_ptr, scale_ptr, wrows, k0, row_bytes,
                                                high_row_bytes, gpr, BITS, GROUP, BLOCK_N, BLOCK_K)
                x_even = tl.load(x_base + tokens[None, :] * stride_x + (k0 + 2 * half)[:, None],
                                 mask=token_ok[None, :], other=0.0)
                x_odd = tl.load(x_base + tokens[None, :] * stride_x + (k0 + 2 * half + 1)[:, None],
                                mask=token_ok[None, :], other=0.0)
                w_even = tl.reshape(tl.reshape(even, [BLOCK_N, NG, GROUP // 2]) * scale[:, :, None],
                                    [BLOCK_N, BLOCK_K // 2]).to(x_even.dtype)
                w_odd = tl.reshape(tl.reshape(odd, [BLOCK_N, NG, GROUP // 2]) * scale[:, :, None],
                                   [BLOCK_N, BLOCK_K // 2]).to(x_even.dtype)
                if IEEE:
                    acc += tl.dot(w_even, x_even, input_precision="ieee")
                    acc += tl.dot(w_odd, x_odd, input_precision="ieee")
                else:
                    acc += tl.dot(w_even, x_even) + tl.dot(w_odd, x_odd)
            out = out_base + tokens[None, :] * stride_out + rows[:, None]
            tl.store(out, acc, mask=row_ok[:, None] & token_ok[None, :])

    @triton.jit
    def _dequantize_kernel(base_ptr, high_ptr, scale_ptr, out_ptr, N, K, row_bytes, high_row_bytes, gpr,
                           BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        safe_rows = tl.minimum(rows, N - 1).to(tl.int64)
        even, odd, scale = _unpack_tile(base_ptr, high_ptr, scale_ptr, safe_rows, k0, row_bytes, high_row_bytes,
                                        gpr, BITS, GROUP, BLOCK_N, BLOCK_K)
        NG: tl.constexpr = BLOCK_K // GROUP
        w_even = tl.reshape(tl.reshape(even, [BLOCK_N, NG, GROUP // 2]) * scale[:, :, None], [BLOCK_N, BLOCK_K // 2])
        w_odd = tl.reshape(tl.reshape(odd, [BLOCK_N, NG, GROUP // 2]) * scale[:, :, None], [BLOCK_N, BLOCK_K // 2])
        w = tl.reshape(tl.join(w_even, w_odd), [BLOCK_N, BLOCK_K])  # lanes back in order: 2j, 2j+1
        lanes = k0 + tl.arange(0, BLOCK_K)
        out = out_ptr + rows[:, None].to(tl.int64) * K + lanes[None, :]
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=(rows < N)[:, None] & (lanes < K)[None, :])


def _planes(data: torch.Tensor, shape: tuple[int, int], fmt: str) -> tuple:
    codec = codec_for(fmt)
    if not isinstance(codec, GroupwiseCodec):
        raise ValueError(f"{fmt} is not a groupwise format")
    planes = codec.planes(shape)
    high = data[planes[1].offset :] if len(planes) == 3 else data
    scales = data[planes[-1].offset :].view(torch.uint8)
    scales = scales[: scales.numel() // 2 * 2].view(torch.float16)
    return codec, data, high, scales, planes


def _block_k(k_pad: int, tokens: int) -> int:
    return 256 if tokens > 1 or k_pad % 512 else 512


def quant_linear_gemv(x: torch.Tensor, data: torch.Tensor, shape: tuple[int, int], fmt: str,
                      block_n: int | None = None, block_k: int | None = None, out_dtype: torch.dtype | None = None,
                      experts: torch.Tensor | None = None, expert_rows: int = 0, x_per_slot: int = 1,
                      num_warps: int | None = None) -> torch.Tensor:
    """The Triton GEMV (see the module docstring). x has at most MAX_GEMV_TOKENS rows; the result is
    `[T, N]` in `out_dtype` (default fp32). With `experts` `[S]` (int), W stacks experts of `expert_rows` rows
    each and the result is `[S, expert_rows]`: row s = x[s // x_per_slot] · W_{experts[s]}ᵀ."""
    if triton is None:
        raise RuntimeError("the Triton GEMV needs the triton package")
    codec, base, high, scales, planes = _planes(data, shape, fmt)
    tokens = x.shape[0]
    if experts is None and not 1 <= tokens <= MAX_GEMV_TOKENS:
        raise ValueError(f"the GEMV takes 1..{MAX_GEMV_TOKENS} tokens, not {tokens}")
    n, k = shape if experts is None else (expert_rows, shape[1])
    gpr = codec.groups_per_row(k)
    k_pad = gpr * codec.group
    if x.shape[1] != k_pad or x.stride(1) != 1:
        x = torch.nn.functional.pad(x, (0, k_pad - x.shape[1])).contiguous()
    slots = tokens if experts is None else experts.numel()
    out = torch.empty((slots, n), dtype=out_dtype or torch.float32, device=x.device)
    block_t = 1 if tokens == 1 or experts is not None else 16  # tl.dot needs at least 16 columns
    block_n = block_n or (16 if block_t > 1 else 8)
    block_k = block_k or _block_k(k_pad, block_t)
    if k_pad % block_k:
        raise ValueError(f"block_k {block_k} does not divide the padded K of {k_pad}")
    high_row_bytes = planes[1].row_bytes if len(planes) == 3 else 0
    grid = (triton.cdiv(n, block_n), slots if experts is not None else 1)
    _gemv_kernel[grid](
        x, base, high, scales, out, experts if experts is not None else base, tokens, n, k_pad,
        planes[0].row_bytes, high_row_bytes, gpr, x.stride(0), out.stride(0),
        BITS=codec.bits, GROUP=codec.group, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_T=block_t,
        GATHER=experts is not None, X_PER_SLOT=x_per_slot, IEEE=x.dtype == torch.float32,
        num_warps=num_warps or 4)
    return out


def dequantize(data: torch.Tensor, shape: tuple[int, int], fmt: str, dtype: torch.dtype = torch.bfloat16,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """W `[N, K]` in `dtype` (rounded once from fp32 scale × code), into `out` when given (a scratch buffer of at
    least N·K elements, reused across matrices by the prefill route)."""
    if triton is None:
        raise RuntimeError("the Triton dequantizer needs the triton package")
    codec, base, high, scales, planes = _planes(data, shape, fmt)
    n, k = shape
    gpr = codec.groups_per_row(k)
    result = torch.empty((n, k), dtype=dtype, device=data.device) if out is None else out[: n * k].view(n, k)
    block_n, block_k = 16, 128
    high_row_bytes = planes[1].row_bytes if len(planes) == 3 else 0
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        base, high, scales, result, n, k, planes[0].row_bytes, high_row_bytes, gpr,
        BITS=codec.bits, GROUP=codec.group, BLOCK_N=block_n, BLOCK_K=block_k)
    return result
