"""The planes of a groupwise matrix (q4/q5/q6 g64, q8 g32, `row_split_k128_v1`: docs/artifact-format.md) as the
kernels read them: on the host, the object's bytes split into its base words, high bits and scales; in a kernel, a
tile of rows × lanes loaded from them and its codes decoded exactly (`quant_linear`'s grouped product and
dequantizer)."""

from __future__ import annotations

import torch

from ninfer.quant import codec_for
from ninfer.quant.groupwise import GroupwiseCodec

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None


def groupwise_codec(fmt: str) -> GroupwiseCodec:
    """The codec of `fmt`, which must be a groupwise format."""
    codec = codec_for(fmt)
    if not isinstance(codec, GroupwiseCodec):
        raise ValueError(f"{fmt} is not a groupwise format")
    return codec


def packed_planes(data: torch.Tensor, shape: tuple[int, int], fmt: str) -> tuple:
    """(codec, base words int32, high plane (q5: bytes, q6: int16; else `data`, unused), scales fp16, the codec's
    planes) of the bytes `data` of a matrix of `shape` in `fmt`, as views."""
    codec = groupwise_codec(fmt)
    planes = codec.planes(shape)
    n = shape[0]
    base = data[: n * planes[0].row_bytes].view(torch.int32)
    if len(planes) == 3:  # q5: one high byte per 8 lanes; q6: one 16-bit unit per 8 lanes
        high = data[planes[1].offset : planes[1].offset + n * planes[1].row_bytes]
        high = high.view(torch.int16) if codec.bits == 6 else high
    else:
        high = data
    scales = data[planes[-1].offset : planes[-1].offset + n * planes[-1].row_bytes].view(torch.float16)
    return codec, base, high, scales, planes


def high_row_units(codec: GroupwiseCodec, planes: list) -> int:
    """Row stride of the high plane in its load unit (q5: bytes, q6: 16-bit units); 0 without a high plane."""
    return planes[1].row_bytes // (2 if codec.bits == 6 else 1) if len(planes) == 3 else 0


if triton is not None:

    @triton.jit
    def lane_values(words, high, p: tl.constexpr, BITS: tl.constexpr):
        """Codes of lanes k0 + LPW·w + p (w < WORDS, LPW = lanes per 32-bit base word: 8, or 4 for q8) of the
        tile, exactly, as fp32 `[BN, WORDS]`, from its base words and high units (`load_tile`). The int → float step is
        the magic-number one (OR the offset-binary code into the mantissa of 2^23, subtract), not a conversion
        instruction: conversions run at a quarter of the FP32 rate and would bound the kernel."""
        if BITS == 8:
            u = ((words >> (8 * p)) & 0xFF) ^ (0x4B000000 | 0x80)
            return u.to(tl.float32, bitcast=True) - (8388608.0 + 128.0)
        nibble = (words >> (4 * p)) & 0xF
        if BITS == 4:
            return (nibble ^ (0x4B000000 | 0x8)).to(tl.float32, bitcast=True) - (8388608.0 + 8.0)
        if BITS == 5:  # bit 4 of lane i is bit i % 8 of high byte i // 8: byte w of the row for word w
            bits = ((high >> p) & 1) << 4
            return ((nibble | bits) ^ (0x4B000000 | 0x10)).to(tl.float32, bitcast=True) - (8388608.0 + 16.0)
        # q6: bits 4-5 of lane i are bits 2i, 2i+1 of the high stream: 16-bit unit w of the row for word w
        bits = ((high >> (2 * p)) & 3) << 4
        return ((nibble | bits) ^ (0x4B000000 | 0x20)).to(tl.float32, bitcast=True) - (8388608.0 + 32.0)

    @triton.jit
    def load_tile(base_ptr, high_ptr, scale_ptr, wrows, k0, row_words, high_row_units, gpr, BITS: tl.constexpr,
                   LPW: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
        """The tile's base words `[BN, BLOCK_K / LPW]` int32, its high units (q5: a byte, q6: 16 bits per word;
        else the words again, unused) as int32, and its scales `[BN, BLOCK_K / GROUP]` fp32."""
        WORDS: tl.constexpr = BLOCK_K // LPW
        words = tl.load(base_ptr + wrows[:, None] * row_words + (k0 // LPW + tl.arange(0, WORDS))[None, :])
        if BITS == 5 or BITS == 6:
            high = tl.load(high_ptr + wrows[:, None] * high_row_units + (k0 // 8 + tl.arange(0, WORDS))[None, :])
            high = high.to(tl.int32) & (0xFF if BITS == 5 else 0xFFFF)
        else:
            high = words
        groups = tl.arange(0, BLOCK_K // GROUP)
        scale = tl.load(scale_ptr + wrows[:, None] * gpr + (k0 // GROUP + groups)[None, :]).to(tl.float32)
        return words, high, scale

