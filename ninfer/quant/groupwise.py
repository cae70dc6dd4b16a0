"""Groupwise symmetric integers with fp16 scales in layout `row_split_k128_v1`.

Formats (codes are two's complement, one fp16 multiplier per group of G values along K):

    q4_g64_fp16  codes [-8, 7]      G = 64   4.25 bits per weight
    q5_g64_fp16  codes [-16, 15]    G = 64   5.25
    q6_g64_fp16  codes [-32, 31]    G = 64   6.25
    q8_g32_fp16  codes [-127, 127]  G = 32   8.50   (-128 is illegal)

Reconstruction: w = fp32(scale) * code. A scale is +0 or positive finite (subnormals allowed); a zero
scale implies all-zero codes.

Canonical encoder (MAXABS_F16_RECIP_RNE), per row and group, arithmetic order normative:
    amax = max|x| (fp32); raw = round_f32(amax / qmax); scale = round_f16(raw)
    if scale == +0 and amax > 0: scale = 2^-24 (the smallest fp16 subnormal: the "rescue")
    inv = round_f32(1 / f32(scale)); code = clamp(round_half_even(round_f32(x * inv)), qmin, qmax)
    an all-zero group has scale +0 and codes 0.

Layout of a [N, K] matrix: K is padded to K_pad = align_up(K, 128) with zeros (so the final partial group's
scale comes from its logical values; whole padding groups have scale 0). gpr = K_pad / G groups per row.
Three planes, each starting at a 256-byte boundary inside the object, each row-major then group-major:
    base  N*gpr*B bytes  q4/q5/q6: B = 32, byte j of a group = (u[2j] & 0xF) | (u[2j+1] & 0xF) << 4
                         (even lane in the low nibble); q8: B = 32, one int8 per lane
    high  N*gpr*H bytes  q5: H = 8, bit 4 of lane i at bit i % 8 of byte i // 8
                         q6: H = 16, bits 4, 5 of lane i at bits 2i, 2i+1 of an LSB-first stream
                         q4 / q8: absent (H = 0)
    scale N*gpr*2 bytes  fp16 little-endian, index row * gpr + group
The object ends at the end of the scale plane. Example: q5 [2, 130] -> K_pad 256, gpr 4, base 256 B at 0,
high 64 B at 256, scales 16 B at 512, 528 bytes in all.
"""

from __future__ import annotations

import torch

from ninfer.errors import FormatError
from ninfer.quant.registry import Codec, Plane, Shape, align_up, check_finite, register

LAYOUT = "row_split_k128_v1"
K_ALIGN = 128
PLANE_ALIGN = 256
RESCUE_SCALE = 2.0**-24


class GroupwiseCodec(Codec):
    layout = LAYOUT

    def __init__(self, fmt: str, bits: int, group: int, qmin: int, qmax: int):
        self.format = fmt
        self.bits = bits
        self.group = group
        self.qmin = qmin
        self.qmax = qmax
        # bytes per group in each plane
        self.base_bytes = group if bits == 8 else group // 2
        self.high_bytes = {4: 0, 5: group // 8, 6: group // 4, 8: 0}[bits]

    # -- geometry ---------------------------------------------------------------------------------------

    def check_shape(self, shape: Shape) -> None:
        if len(shape) != 2 or shape[0] <= 0 or shape[1] <= 0:
            raise FormatError(f"{self.format}: layout {LAYOUT} stores [N, K] matrices, not {list(shape)}")

    def groups_per_row(self, k: int) -> int:
        return align_up(k, K_ALIGN) // self.group

    def planes(self, shape: Shape) -> list[Plane]:
        n, k = shape
        gpr = self.groups_per_row(k)
        base = Plane(0, gpr * self.base_bytes)
        offset = align_up(n * base.row_bytes, PLANE_ALIGN)
        planes = [base]
        if self.high_bytes:
            planes.append(Plane(offset, gpr * self.high_bytes))
            offset = align_up(offset + n * gpr * self.high_bytes, PLANE_ALIGN)
        planes.append(Plane(offset, gpr * 2))
        return planes

    def encoded_bytes(self, shape: Shape) -> int:
        self.check_shape(shape)
        last = self.planes(shape)[-1]
        return last.offset + shape[0] * last.row_bytes

    # -- encoder -----------------------------------------------------------------------------------------

    def _padded_groups(self, rows: torch.Tensor) -> torch.Tensor:
        n, k = rows.shape
        x = rows.to(torch.float32)
        pad = align_up(k, K_ALIGN) - k
        if pad:
            x = torch.nn.functional.pad(x, (0, pad))
        return x.reshape(n, -1, self.group)

    def _scales(self, groups: torch.Tensor) -> torch.Tensor:
        """fp16 scales [n, gpr] of fp32 groups [n, gpr, G], by the canonical rule."""
        amax = groups.abs().amax(dim=-1)
        # a tensor divisor: CUDA turns division by a Python scalar into multiplication by its reciprocal,
        # which rounds differently from the canonical round_f32(amax / qmax)
        scale = (amax / torch.full_like(amax, self.qmax)).to(torch.float16)
        rescue = (scale == 0) & (amax > 0)
        scale = torch.where(rescue, torch.full_like(scale, RESCUE_SCALE), scale)
        if not bool(torch.isfinite(scale).all()):
            worst = float(amax.max())
            raise FormatError(
                f"{self.format}: |value| {worst:.6g} is too large for an fp16 group scale "
                f"(limit {65504.0 * self.qmax:.6g})"
            )
        return scale

    def _codes(self, groups: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        inv = 1.0 / scale.to(torch.float32)
        inv = torch.where(scale == 0, torch.zeros_like(inv), inv)
        codes = torch.round(groups * inv.unsqueeze(-1)).clamp_(self.qmin, self.qmax)
        return codes.to(torch.int16)

    def encode_rows(self, rows: torch.Tensor) -> list[torch.Tensor]:
        self.check_shape(tuple(rows.shape))
        if not rows.is_floating_point():
            raise FormatError(f"{self.format}: needs a float tensor, got {rows.dtype}")
        check_finite(rows, self.format)
        groups = self._padded_groups(rows)
        scale = self._scales(groups)
        codes = self._codes(groups, scale)
        n, gpr, g = codes.shape
        u = (codes & ((1 << self.bits) - 1)).to(torch.uint8)
        if self.bits == 8:
            base = u
        else:
            low = u & 0xF
            base = low[..., 0::2] | (low[..., 1::2] << 4)
        planes = [base.reshape(n, -1)]
        if self.bits == 5:
            high = ((u >> 4) & 1).reshape(n, gpr, g // 8, 8)
            shifts = torch.arange(8, device=u.device, dtype=torch.uint8)
            planes.append((high << shifts).sum(-1, dtype=torch.uint8).reshape(n, -1))
        elif self.bits == 6:
            high = ((u >> 4) & 3).reshape(n, gpr, g // 4, 4)
            shifts = torch.arange(0, 8, 2, device=u.device, dtype=torch.uint8)
            planes.append((high << shifts).sum(-1, dtype=torch.uint8).reshape(n, -1))
        planes.append(scale.contiguous().view(torch.uint8).reshape(n, -1))
        return planes

    # -- decoder -----------------------------------------------------------------------------------------

    def codes_and_scales(self, data: torch.Tensor, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes [N, gpr, G] (int16) and fp16 scales [N, gpr] from the object's bytes."""
        n, k = shape
        gpr = self.groups_per_row(k)
        planes = self.planes(shape)
        if data.numel() != self.encoded_bytes(shape):
            raise FormatError(f"{self.format}: {data.numel()} bytes, expected {self.encoded_bytes(shape)}")
        base = data[: n * planes[0].row_bytes].reshape(n, gpr, self.base_bytes)
        if self.bits == 8:
            codes = base.view(torch.int8).to(torch.int16)
        else:
            u = torch.stack((base & 0xF, base >> 4), dim=-1).reshape(n, gpr, self.group).to(torch.int16)
            if self.high_bytes:
                hp = planes[1]
                high = data[hp.offset : hp.offset + n * hp.row_bytes].reshape(n, gpr, self.high_bytes)
                per_byte = 8 if self.bits == 5 else 4
                width = 8 // per_byte
                shifts = torch.arange(0, 8, width, device=data.device, dtype=torch.uint8)
                hi = ((high.unsqueeze(-1) >> shifts) & ((1 << width) - 1)).reshape(n, gpr, self.group)
                u = u | (hi.to(torch.int16) << 4)
            sign = 1 << (self.bits - 1)
            codes = u - ((u & sign) << 1)
        sp = planes[-1]
        scales = data[sp.offset : sp.offset + n * sp.row_bytes].view(torch.float16).reshape(n, gpr)
        return codes, scales

    def decode(self, data: torch.Tensor, shape: Shape) -> torch.Tensor:
        n, k = shape
        codes, scales = self.codes_and_scales(data, shape)
        w = scales.to(torch.float32).unsqueeze(-1) * codes.to(torch.float32)
        return w.reshape(n, -1)[:, :k]

    def validate(self, data: torch.Tensor, shape: Shape) -> None:
        n, k = shape
        codes, scales = self.codes_and_scales(data, shape)
        s = scales.to(torch.float32)
        if not bool(torch.isfinite(s).all()) or bool(torch.signbit(s).any()):
            raise FormatError(f"{self.format}: a scale is negative, -0, Inf or NaN")
        if self.bits == 8 and bool((codes == -128).any()):
            raise FormatError(f"{self.format}: code -128 is illegal")
        if bool(((s == 0).unsqueeze(-1) & (codes != 0)).any()):
            raise FormatError(f"{self.format}: a group with scale 0 has non-zero codes")
        flat = codes.reshape(n, -1)
        if flat.shape[1] > k and bool((flat[:, k:] != 0).any()):
            raise FormatError(f"{self.format}: padding lanes beyond K = {k} are not zero")

    def error_bound(self, source: torch.Tensor) -> torch.Tensor:
        n, k = source.shape
        groups = self._padded_groups(source)
        scale = self._scales(groups).to(torch.float32)
        # |x * inv - x / scale| stays below 2^-8 of a step; a subnormal scale can round down by up to half its
        # spacing, and then values near amax clamp at qmax with an error up to amax - qmax * scale
        clamped = (groups.abs().amax(dim=-1) - self.qmax * scale) * (1 + 2.0**-8)
        bound = torch.maximum(scale * (0.5 + 2.0**-8), clamped).unsqueeze(-1).expand_as(groups)
        return bound.reshape(n, -1)[:, :k]


Q4 = register(GroupwiseCodec("q4_g64_fp16", bits=4, group=64, qmin=-8, qmax=7))
Q5 = register(GroupwiseCodec("q5_g64_fp16", bits=5, group=64, qmin=-16, qmax=15))
Q6 = register(GroupwiseCodec("q6_g64_fp16", bits=6, group=64, qmin=-32, qmax=31))
Q8 = register(GroupwiseCodec("q8_g32_fp16", bits=8, group=32, qmin=-127, qmax=127))
