"""y = x · Wᵀ with W stored packed in a groupwise format (q4/q5/q6 g64, q8 g32, `row_split_k128_v1`).

Contract: x `[T, K]` (fp32 / bf16 / fp16), `data` the object's bytes (1-D uint8, on x's device), `shape` = (N, K)
of W, `fmt` its format. Returns y `[T, N]` in fp32: y[t, n] = Σ_k x[t, k] · scale[n, k // G] · code[n, k].

Two paths with that contract:
  * `quant_linear_reference`: decode W exactly (ninfer.quant) and multiply in fp32 — the oracle, any device;
  * `quant_linear_gemv`: a Triton kernel for few tokens (decode, speculative verify: T ≤ 16) that reads the
    packed planes once — each program owns BLOCK_N output rows and walks their groups: the base nibbles (even
    lanes low, odd lanes high), the high-bit plane (q5: 1 bit, q6: 2 bits per lane), the fp16 scale; codes
    become exact small integers in x's dtype and meet x through `tl.dot` (fp32 accumulation).
Not yet called by the model (which decodes weights at load); the GPU fast path will choose the kernel on CUDA
for T ≤ 16. Runs under TRITON_INTERPRET=1 (fp32 inputs there: the interpreter miscomputes bf16 `tl.dot`).
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
    def _groupwise_gemv_kernel(x_ptr, base_ptr, high_ptr, scale_ptr, out_ptr, T, N, gpr, groups_per_split,
                               stride_x, stride_out, stride_split,
                               BITS: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_T: tl.constexpr, IEEE: tl.constexpr):
        pid = tl.program_id(0)
        split = tl.program_id(1)  # split-K: this program sums groups [split * groups_per_split, ...) of its rows
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        tokens = tl.arange(0, BLOCK_T)
        token_ok = tokens < T
        acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        lanes = tl.arange(0, HALF)
        first_group = split * groups_per_split
        last_group = tl.minimum(first_group + groups_per_split, gpr)
        for g in tl.range(first_group, last_group):
            scale = tl.load(scale_ptr + rows * gpr + g, mask=row_ok, other=0.0).to(tl.float32)
            if BITS == 8:
                # one int8 per lane: treat the group as two halves of consecutive lanes
                offs = rows[:, None] * (gpr * GROUP) + g * GROUP + lanes[None, :]
                first = tl.load(base_ptr + offs, mask=row_ok[:, None], other=0).to(tl.int8).to(tl.int32)
                second = tl.load(base_ptr + offs + HALF, mask=row_ok[:, None], other=0).to(tl.int8).to(tl.int32)
                x_first = tl.load(x_ptr + tokens[None, :] * stride_x + g * GROUP + lanes[:, None],
                                  mask=token_ok[None, :], other=0.0)
                x_second = tl.load(x_ptr + tokens[None, :] * stride_x + g * GROUP + HALF + lanes[:, None],
                                   mask=token_ok[None, :], other=0.0)
            else:
                # base plane: byte j holds lane 2j (low nibble) and lane 2j+1 (high nibble)
                offs = rows[:, None] * (gpr * HALF) + g * HALF + lanes[None, :]
                packed = tl.load(base_ptr + offs, mask=row_ok[:, None], other=0).to(tl.int32)
                first = packed & 0xF
                second = (packed >> 4) & 0xF
                if BITS == 5:  # bit 4 of lane i at bit i % 8 of byte i // 8: lanes 2j, 2j+1 share byte j // 4
                    hoffs = rows[:, None] * (gpr * (GROUP // 8)) + g * (GROUP // 8) + (lanes // 4)[None, :]
                    high = tl.load(high_ptr + hoffs, mask=row_ok[:, None], other=0).to(tl.int32)
                    shift = 2 * (lanes % 4)[None, :]
                    first = first | (((high >> shift) & 1) << 4)
                    second = second | (((high >> (shift + 1)) & 1) << 4)
                if BITS == 6:  # bits 4-5 of lane i at bits 2i, 2i+1 of the stream: byte i // 4, shift 2 (i % 4)
                    hoffs = rows[:, None] * (gpr * (GROUP // 4)) + g * (GROUP // 4) + (lanes // 2)[None, :]
                    high = tl.load(high_ptr + hoffs, mask=row_ok[:, None], other=0).to(tl.int32)
                    shift = 4 * (lanes % 2)[None, :]
                    first = first | (((high >> shift) & 3) << 4)
                    second = second | (((high >> (shift + 2)) & 3) << 4)
                sign = 1 << (BITS - 1)
                first = first - ((first & sign) << 1)
                second = second - ((second & sign) << 1)
                x_first = tl.load(x_ptr + tokens[None, :] * stride_x + g * GROUP + 2 * lanes[:, None],
                                  mask=token_ok[None, :], other=0.0)
                x_second = tl.load(x_ptr + tokens[None, :] * stride_x + g * GROUP + 2 * lanes[:, None] + 1,
                                   mask=token_ok[None, :], other=0.0)
            codes_first = first.to(x_first.dtype)
            codes_second = second.to(x_first.dtype)
            if IEEE:
                part = tl.dot(codes_first, x_first, input_precision="ieee")
                part += tl.dot(codes_second, x_second, input_precision="ieee")
            else:
                part = tl.dot(codes_first, x_first) + tl.dot(codes_second, x_second)
            acc += part * scale[:, None]
        out = out_ptr + split * stride_split + tokens[None, :] * stride_out + rows[:, None]
        tl.store(out, acc, mask=row_ok[:, None] & token_ok[None, :])


def quant_linear_gemv(x: torch.Tensor, data: torch.Tensor, shape: tuple[int, int], fmt: str,
                      block_n: int = 64, split_k: int = 1) -> torch.Tensor:
    """The Triton path (see the module docstring); x has at most MAX_GEMV_TOKENS rows. With `split_k` > 1 the
    groups of each row block are shared among that many programs, whose fp32 partial sums are then added in a
    fixed order (deterministic, unlike atomics) — more programs for long-K, few-row matrices."""
    if triton is None:
        raise RuntimeError("the Triton GEMV needs the triton package")
    codec = codec_for(fmt)
    if not isinstance(codec, GroupwiseCodec):
        raise ValueError(f"{fmt} is not a groupwise format")
    tokens = x.shape[0]
    if not 1 <= tokens <= MAX_GEMV_TOKENS:
        raise ValueError(f"the GEMV takes 1..{MAX_GEMV_TOKENS} tokens, not {tokens}")
    n, k = shape
    gpr = codec.groups_per_row(k)
    planes = codec.planes(shape)
    k_pad = gpr * codec.group
    xp = torch.nn.functional.pad(x, (0, k_pad - k)).contiguous() if k_pad != k else x.contiguous()
    base = data[: n * planes[0].row_bytes]
    high = data[planes[1].offset :] if len(planes) == 3 else data
    scales = data[planes[-1].offset : planes[-1].offset + n * planes[-1].row_bytes].view(torch.float16)
    split_k = max(1, min(split_k, gpr))
    groups_per_split = triton.cdiv(gpr, split_k)
    split_k = triton.cdiv(gpr, groups_per_split)
    out = torch.empty((split_k, tokens, n), dtype=torch.float32, device=x.device)
    block_t = 16  # tl.dot needs at least 16 columns
    _groupwise_gemv_kernel[(triton.cdiv(n, block_n), split_k)](
        xp, base, high, scales, out, tokens, n, gpr, groups_per_split, xp.stride(0), out.stride(1), out.stride(0),
        BITS=codec.bits, GROUP=codec.group, HALF=codec.group // 2, BLOCK_N=block_n, BLOCK_T=block_t,
        IEEE=x.dtype == torch.float32)
    return out[0] if split_k == 1 else out.sum(dim=0)
