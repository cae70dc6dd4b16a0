"""Plain formats in layout `contiguous_le_v1`: C-order little-endian words, `bytes = numel * word`.

`bf16`, `fp16` and `fp32` round a float source to nearest-even (exact when the source already has the
format's precision); `i32` stores integers verbatim. Decoding is a zero-copy view of the bytes.
"""

from __future__ import annotations

import math

import torch

from ninfer.errors import FormatError
from ninfer.quant.registry import Codec, Plane, Shape, check_finite, register, row_count

LAYOUT = "contiguous_le_v1"
MAX_RANK = 16


class ContiguousCodec(Codec):
    layout = LAYOUT

    def __init__(self, fmt: str, dtype: torch.dtype, significand_bits: int, min_subnormal: float):
        self.format = fmt
        self.dtype = dtype
        self.word = torch.empty((), dtype=dtype).element_size()
        self.source_kind = "float" if dtype.is_floating_point else "int"
        self._half_ulp = 2.0 ** -significand_bits  # relative rounding bound of a normal value
        self._half_subnormal = min_subnormal / 2

    def check_shape(self, shape: Shape) -> None:
        if len(shape) > MAX_RANK or any(d <= 0 for d in shape):
            raise FormatError(f"{self.format}: shape {list(shape)} needs rank <= {MAX_RANK} and positive dims")

    def planes(self, shape: Shape) -> list[Plane]:
        return [Plane(0, self.encoded_bytes(shape) // row_count(shape))]

    def encoded_bytes(self, shape: Shape) -> int:
        return math.prod(shape) * self.word

    def encode_rows(self, rows: torch.Tensor) -> list[torch.Tensor]:
        if self.source_kind == "int":
            if rows.is_floating_point() or rows.dtype == torch.bool:
                raise FormatError(f"{self.format}: needs an integer tensor, got {rows.dtype}")
            info = torch.iinfo(self.dtype)
            if rows.numel() and (int(rows.min()) < info.min or int(rows.max()) > info.max):
                raise FormatError(f"{self.format}: value out of the int32 range")
        else:
            if not rows.is_floating_point():
                raise FormatError(f"{self.format}: needs a float tensor, got {rows.dtype}")
            check_finite(rows, self.format)
        stored = rows.to(self.dtype)
        if self.source_kind == "float":
            check_finite(stored, f"{self.format} (value overflows the format's range)")
        return [stored.contiguous().reshape(-1).view(torch.uint8)]

    def decode(self, data: torch.Tensor, shape: Shape) -> torch.Tensor:
        return data.view(self.dtype).reshape(shape)

    def error_bound(self, source: torch.Tensor) -> torch.Tensor:
        if self.source_kind == "int" or source.dtype == self.dtype:
            return torch.zeros(source.shape, dtype=torch.float32, device=source.device)
        magnitude = source.abs().to(torch.float32)
        return magnitude * self._half_ulp + self._half_subnormal


BF16 = register(ContiguousCodec("bf16", torch.bfloat16, 8, 2.0**-133))
FP16 = register(ContiguousCodec("fp16", torch.float16, 11, 2.0**-24))
FP32 = register(ContiguousCodec("fp32", torch.float32, 24, 2.0**-149))
I32 = register(ContiguousCodec("i32", torch.int32, 0, 0.0))
