"""FP8 rows: `fp8_e4m3fn_row_bf16` in layout `row_scale_v1`.

A [N, K] matrix is stored as N*K E4M3FN codes, row-major (NaN codes 0x7F / 0xFF are illegal), then, at
the next 256-byte boundary inside the object, N bf16 multipliers, one per row. Reconstruction:
w = fp32(code) * fp32(scale). A row whose scale is +0 holds only ±0 codes; scales are +0 or positive
finite.

Encoder (per row, same reciprocal-then-multiply order as the groupwise formats):
    amax = max|x| (fp32); scale = round_bf16(round_f32(amax / 448))
    if scale < 2^-126 and amax > 0: scale = 2^-126 (smallest normal, so 1/scale stays finite)
    inv = round_f32(1 / f32(scale)); code = e4m3fn_rne(clamp(round_f32(x * inv), -448, 448))
"""

from __future__ import annotations

import torch

from ninfer.errors import FormatError
from ninfer.quant.registry import Codec, Plane, Shape, align_up, check_finite, register

LAYOUT = "row_scale_v1"
FP8_MAX = 448.0
RESCUE_SCALE = 2.0**-126


class Fp8RowCodec(Codec):
    format = "fp8_e4m3fn_row_bf16"
    layout = LAYOUT

    def check_shape(self, shape: Shape) -> None:
        if len(shape) != 2 or shape[0] <= 0 or shape[1] <= 0:
            raise FormatError(f"{self.format}: layout {LAYOUT} stores [N, K] matrices, not {list(shape)}")

    def planes(self, shape: Shape) -> list[Plane]:
        n, k = shape
        return [Plane(0, k), Plane(align_up(n * k, 256), 2)]

    def encoded_bytes(self, shape: Shape) -> int:
        self.check_shape(shape)
        n, k = shape
        return align_up(n * k, 256) + 2 * n

    def _scales(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.abs().amax(dim=-1)
        # a tensor divisor keeps the division exact on CUDA (see groupwise._scales)
        scale = (amax / torch.full_like(amax, FP8_MAX)).to(torch.bfloat16)
        rescue = (scale < RESCUE_SCALE) & (amax > 0)  # zero or subnormal: 1 / scale could overflow
        return torch.where(rescue, torch.full_like(scale, RESCUE_SCALE), scale)

    def encode_rows(self, rows: torch.Tensor) -> list[torch.Tensor]:
        self.check_shape(tuple(rows.shape))
        if not rows.is_floating_point():
            raise FormatError(f"{self.format}: needs a float tensor, got {rows.dtype}")
        check_finite(rows, self.format)
        x = rows.to(torch.float32)
        check_finite(x, f"{self.format} (value overflows float32)")
        scale = self._scales(x)
        inv = 1.0 / scale.to(torch.float32)
        inv = torch.where(scale == 0, torch.zeros_like(inv), inv)
        codes = (x * inv.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return [codes.view(torch.uint8), scale.contiguous().view(torch.uint8).reshape(-1, 2)]

    def _split(self, data: torch.Tensor, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = shape
        if data.numel() != self.encoded_bytes(shape):
            raise FormatError(f"{self.format}: {data.numel()} bytes, expected {self.encoded_bytes(shape)}")
        codes = data[: n * k].view(torch.float8_e4m3fn).reshape(n, k)
        offset = self.planes(shape)[1].offset
        scales = data[offset : offset + 2 * n].view(torch.bfloat16)
        return codes, scales

    def decode(self, data: torch.Tensor, shape: Shape) -> torch.Tensor:
        codes, scales = self._split(data, shape)
        return codes.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)

    def validate(self, data: torch.Tensor, shape: Shape) -> None:
        codes, scales = self._split(data, shape)
        raw = codes.view(torch.uint8)
        if bool(((raw & 0x7F) == 0x7F).any()):
            raise FormatError(f"{self.format}: a NaN code is stored")
        s = scales.to(torch.float32)
        if not bool(torch.isfinite(s).all()) or bool(torch.signbit(s).any()):
            raise FormatError(f"{self.format}: a row scale is negative, -0, Inf or NaN")
        if bool(((s == 0).unsqueeze(-1) & ((raw & 0x7F) != 0)).any()):
            raise FormatError(f"{self.format}: a row with scale 0 has non-zero codes")

    def error_bound(self, source: torch.Tensor) -> torch.Tensor:
        x = source.to(torch.float32)
        scale = self._scales(x).to(torch.float32).unsqueeze(-1)
        # e4m3: 3 stored mantissa bits (half-ulp 2^-4 relative), subnormal step 2^-9 (in units of scale),
        # plus the clamp at 448 when the bf16 scale rounded down (< 2^-8 of the value)
        return (x.abs() * (2.0**-4 + 2.0**-8) + scale * 2.0**-10) * (1 + 2.0**-8)


FP8_ROW = register(Fp8RowCodec())
