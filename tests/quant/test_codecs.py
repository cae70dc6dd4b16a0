"""The numeric format codecs against their specifications (the module docstrings of ninfer/quant/*.py):
hand-computed bytes, the canonical encoder's rules, round trips within independently derived bounds,
rejections, validate(), plane-wise (chunked) encoding and decoding from views of a larger buffer; on CUDA
(`pytest -m gpu`) the encoder gives the CPU's bytes and the decoder the CPU's values.

Every expected value here comes from the format text: the layout arithmetic, the bit packing and the
reference encoders below are written from the specification with numpy and struct, never by calling the
code under test.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.errors import FormatError
from ninfer.quant import codec_for, registered_formats

# format -> (code bits, group size G, qmin, qmax), from the groupwise format table
GROUPWISE = {
    "q4_g64_fp16": (4, 64, -8, 7),
    "q5_g64_fp16": (5, 64, -16, 15),
    "q6_g64_fp16": (6, 64, -32, 31),
    "q8_g32_fp16": (8, 32, -127, 127),
}
BITS_PER_WEIGHT = {"q4_g64_fp16": 4.25, "q5_g64_fp16": 5.25, "q6_g64_fp16": 6.25, "q8_g32_fp16": 8.5}
FP8 = "fp8_e4m3fn_row_bf16"
# contiguous format -> (storage dtype, struct code of one little-endian word)
CONTIGUOUS = {"bf16": (torch.bfloat16, None), "fp16": (torch.float16, "<e"), "fp32": (torch.float32, "<f"),
              "i32": (torch.int32, "<i")}
FLOAT_FORMATS = [*GROUPWISE, FP8, "bf16", "fp16", "fp32"]
LOSSY = [*GROUPWISE, FP8, "bf16", "fp16"]
ALL_FORMATS = [*GROUPWISE, FP8, *CONTIGUOUS]

K_ALIGN = 128
PLANE_ALIGN = 256
FP16_MIN_SUBNORMAL = 2.0**-24  # the groupwise "rescue" scale, fp16 bits 0x0001
FP16_MAX = 65504.0
FP8_MAX = 448.0
FP8_RESCUE = 2.0**-126  # smallest normal bf16/fp32
ROUNDING_SLACK = 2.0**-9  # relative slack for fp16/fp32 rounding of the scale and of x * inv
AWKWARD_K = [1, 63, 64, 65, 127, 128, 129, 300]


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def f16le(value: float) -> bytes:
    return struct.pack("<e", value)


def bf16le(value: float) -> bytes:
    word = struct.pack("<f", value)
    assert word[:2] == b"\0\0", f"{value} is not exactly representable in bf16"
    return word[2:]


def as_bytes(t: torch.Tensor) -> bytes:
    assert t.dtype == torch.uint8 and t.dim() == 1
    return bytes(t.tolist())


def u8(data: bytes | bytearray) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


# -- the specification, independently ---------------------------------------------------------------------


def spec_planes(fmt: str, n: int, k: int) -> list[tuple[int, int]]:
    """(offset, byte size) of each plane of a row_split_k128_v1 object, from the layout text."""
    bits, group, _, _ = GROUPWISE[fmt]
    k_pad = align_up(k, K_ALIGN)
    sizes = [n * k_pad * (8 if bits == 8 else 4) // 8]
    if bits in (5, 6):
        sizes.append(n * k_pad * (bits - 4) // 8)
    sizes.append(n * (k_pad // group) * 2)
    planes, at = [], 0
    for size in sizes:
        planes.append((at, size))
        at = align_up(at + size, PLANE_ALIGN)
    return planes


def spec_bytes(fmt: str, shape: tuple[int, ...]) -> int:
    if fmt in GROUPWISE:
        offset, size = spec_planes(fmt, *shape)[-1]
        return offset + size
    if fmt == FP8:
        n, k = shape
        return align_up(n * k, PLANE_ALIGN) + 2 * n
    word = 2 if fmt in ("bf16", "fp16") else 4
    return math.prod(shape) * word


def pack_groupwise(fmt: str, codes: np.ndarray, scales: np.ndarray) -> bytes:
    """Object bytes of codes [N, K_pad] (ints) and fp16 scales [N, gpr], by the layout text."""
    bits, _, _, _ = GROUPWISE[fmt]
    n, k_pad = codes.shape
    u = (codes.astype(np.int64) & ((1 << bits) - 1)).astype(np.uint8).reshape(-1)  # lanes, row-major
    base = u if bits == 8 else (u[0::2] & 0xF) | ((u[1::2] & 0xF) << 4)  # even lane in the low nibble
    payloads = [base.tobytes()]
    if bits == 5:
        payloads.append(np.packbits((u >> 4) & 1, bitorder="little").tobytes())
    elif bits == 6:
        stream = np.stack([(u >> 4) & 1, (u >> 5) & 1], axis=-1).reshape(-1)  # bits 4, 5 of lane i at 2i, 2i+1
        payloads.append(np.packbits(stream, bitorder="little").tobytes())
    payloads.append(scales.astype("<f2").tobytes())
    out = bytearray(spec_bytes(fmt, (n, k_pad)))
    for (offset, size), payload in zip(spec_planes(fmt, n, k_pad), payloads, strict=True):
        assert len(payload) == size
        out[offset : offset + size] = payload
    return bytes(out)


def unpack_groupwise(fmt: str, data: bytes, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes [N, K_pad] (int64) and scales [N, gpr] (float32) read from object bytes by the layout text."""
    bits = GROUPWISE[fmt][0]
    buf = np.frombuffer(data, dtype=np.uint8)
    planes = spec_planes(fmt, n, k)
    offset, size = planes[0]
    base = buf[offset : offset + size]
    u = base.astype(np.int64) if bits == 8 else np.stack([base & 0xF, base >> 4], -1).reshape(-1).astype(np.int64)
    if bits in (5, 6):
        offset, size = planes[1]
        high = np.unpackbits(buf[offset : offset + size], bitorder="little").astype(np.int64)
        u |= (high << 4) if bits == 5 else ((high[0::2] << 4) | (high[1::2] << 5))
    codes = np.where(u >= 1 << (bits - 1), u - (1 << bits), u).reshape(n, -1)
    offset, size = planes[-1]
    scales = np.frombuffer(buf[offset : offset + size].tobytes(), dtype="<f2").astype(np.float32)
    return codes, scales.reshape(n, -1)


def reference_groupwise(fmt: str, x: np.ndarray) -> bytes:
    """MAXABS_F16_RECIP_RNE step by step in numpy float32 / float16, then packed by the layout text."""
    _, group, qmin, qmax = GROUPWISE[fmt]
    n, k = x.shape
    padded = np.zeros((n, align_up(k, K_ALIGN)), dtype=np.float32)
    padded[:, :k] = x
    groups = padded.reshape(n, -1, group)
    amax = np.abs(groups).max(axis=-1)
    scale = (amax / np.float32(qmax)).astype(np.float32).astype(np.float16)
    scale[(scale == 0) & (amax > 0)] = np.float16(FP16_MIN_SUBNORMAL)
    with np.errstate(divide="ignore"):
        inv = np.where(scale > 0, np.float32(1) / scale.astype(np.float32), np.float32(0)).astype(np.float32)
    product = (groups * inv[..., None]).astype(np.float32)
    codes = np.clip(np.rint(product), qmin, qmax).astype(np.int64)
    return pack_groupwise(fmt, codes.reshape(n, -1), scale)


def e4m3_value(code: int) -> float:
    """Value of an E4M3FN code (bias 7, no infinities; 0x7F / 0xFF are NaN)."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 7
    if exponent == 0:
        return sign * mantissa * 2.0**-9
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


E4M3_POSITIVE = np.array([e4m3_value(c) for c in range(0x7F)])  # codes 0 .. 0x7E, increasing


def e4m3_rne(values: np.ndarray) -> np.ndarray:
    """E4M3FN codes of finite values with |v| <= 448, rounded to nearest, ties to the even code."""
    mag = np.abs(values.astype(np.float64))
    hi = np.clip(np.searchsorted(E4M3_POSITIVE, mag), 1, 0x7E)
    lo = hi - 1
    d_lo, d_hi = mag - E4M3_POSITIVE[lo], E4M3_POSITIVE[hi] - mag
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return (code | np.where(np.signbit(values), 0x80, 0)).astype(np.uint8)


def bf16_rne_bits(values: np.ndarray) -> np.ndarray:
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def reference_fp8(x: np.ndarray) -> bytes:
    n, k = x.shape
    amax = np.abs(x).max(axis=-1)
    scale_bits = bf16_rne_bits((amax / np.float32(FP8_MAX)).astype(np.float32))
    scale = (scale_bits.astype(np.uint32) << 16).view(np.float32)
    scale = np.where((amax > 0) & (scale < FP8_RESCUE), np.float32(FP8_RESCUE), scale).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(scale > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
    product = np.clip((x * inv[:, None]).astype(np.float32), -FP8_MAX, FP8_MAX)
    out = bytearray(spec_bytes(FP8, (n, k)))
    out[: n * k] = e4m3_rne(product).tobytes()
    offset = align_up(n * k, PLANE_ALIGN)
    out[offset : offset + 2 * n] = bf16_rne_bits(scale).astype("<u2").tobytes()
    return bytes(out)


def independent_bound(fmt: str, source: torch.Tensor) -> torch.Tensor:
    """An element-wise error bound derived from the format text (float64, source's shape)."""
    x = source.to(torch.float64)
    if fmt in ("bf16", "fp16", "fp32"):
        significand, min_subnormal = {"bf16": (8, 2.0**-133), "fp16": (11, 2.0**-24), "fp32": (24, 2.0**-149)}[fmt]
        return x.abs() * 2.0**-significand + min_subnormal / 2
    if fmt == FP8:
        amax = x.abs().amax(dim=-1, keepdim=True)
        step = torch.clamp(amax / FP8_MAX, min=FP8_RESCUE)
        # e4m3 half-ulp (2^-4 relative, 2^-10 absolute in code units) + the clamp when the bf16 scale rounded down
        return (x.abs() * 2.0**-4 + amax * 2.0**-8 + step * 2.0**-10) * (1 + 2.0**-6)
    _, group, _, qmax = GROUPWISE[fmt]
    n, k = x.shape
    padded = torch.nn.functional.pad(x, (0, align_up(k, K_ALIGN) - k)).reshape(n, -1, group)
    amax = padded.abs().amax(dim=-1, keepdim=True)
    # half a step of the exact amax / qmax, plus qmax times half the fp16 subnormal spacing: a subnormal scale
    # can round down by up to 2^-25, and then the values near amax clamp at qmax
    bound = 0.5 * amax / qmax * (1 + ROUNDING_SLACK) + qmax * 2.0**-25
    return bound.expand_as(padded).reshape(n, -1)[:, :k]


def awkward_source(shape: tuple[int, ...], seed: int, fmt: str = "fp32") -> torch.Tensor:
    """Random values whose magnitude varies by orders from row to row and group to group, with exact zeros."""
    generator = torch.Generator().manual_seed(seed)
    if fmt == "i32":
        return torch.randint(-(2**31), 2**31 - 1, shape, generator=generator, dtype=torch.int32)
    values = torch.randn(shape, generator=generator)
    magnitude = 10.0 ** (torch.rand(shape, generator=generator) * 6 - 3)
    values = values * magnitude
    values[torch.rand(shape, generator=generator) < 0.05] = 0.0
    return values


# -- registry and sizes -------------------------------------------------------------------------------------


def test_every_registered_format_is_covered_here():
    assert set(registered_formats()) == set(ALL_FORMATS)


@pytest.mark.parametrize(("fmt", "layout"), [*((f, "row_split_k128_v1") for f in GROUPWISE),
                                             (FP8, "row_scale_v1"), *((f, "contiguous_le_v1") for f in CONTIGUOUS)])
def test_codec_for_names_format_and_layout(fmt, layout):
    codec = codec_for(fmt, layout)
    assert (codec.format, codec.layout) == (fmt, layout)
    with pytest.raises(FormatError, match="layout"):
        codec_for(fmt, "some_other_layout_v1")


def test_unknown_format_is_a_format_error():
    with pytest.raises(FormatError, match="q3_g64_fp16"):
        codec_for("q3_g64_fp16")


@pytest.mark.parametrize("fmt", [*GROUPWISE, FP8])
@pytest.mark.parametrize("shape", [(1, 1), (2, 130), (3, 64), (5, 300), (7, 128), (64, 256)])
def test_matrix_sizes_and_planes_follow_the_layout(fmt, shape):
    codec = codec_for(fmt)
    assert codec.encoded_bytes(shape) == spec_bytes(fmt, shape)
    planes = [(p.offset, p.row_bytes * shape[0]) for p in codec.planes(shape)]
    if fmt == FP8:
        n, k = shape
        assert planes == [(0, n * k), (align_up(n * k, PLANE_ALIGN), 2 * n)]
    else:
        assert planes == spec_planes(fmt, *shape)


@pytest.mark.parametrize("fmt", list(CONTIGUOUS))
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 4)])
def test_contiguous_sizes(fmt, shape):
    codec = codec_for(fmt)
    assert codec.encoded_bytes(shape) == spec_bytes(fmt, shape)
    rows = shape[0] if len(shape) >= 2 else 1
    assert [(p.offset, p.row_bytes * rows) for p in codec.planes(shape)] == [(0, spec_bytes(fmt, shape))]


def test_q5_example_from_the_layout_text():
    codec = codec_for("q5_g64_fp16")
    assert codec.encoded_bytes((2, 130)) == 528
    assert [(p.offset, p.row_bytes) for p in codec.planes((2, 130))] == [(0, 128), (256, 32), (512, 8)]


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_bits_per_weight(fmt):
    shape = (256, 4096)  # every plane a multiple of 256 bytes: no alignment overhead in the groupwise formats
    expected = {**BITS_PER_WEIGHT, FP8: 8 + 16 * 256 / (256 * 4096), "bf16": 16, "fp16": 16, "fp32": 32, "i32": 32}
    assert codec_for(fmt).bits_per_weight(shape) == expected[fmt]


# -- hand-computed bytes -----------------------------------------------------------------------------------


def test_q4_hand_bytes():
    # lanes repeat codes (1, -2, 7, -7); amax = 3.5 -> raw = 3.5 / 7 = 0.5 exactly -> scale 0.5, codes x / 0.5
    codes = [1, -2, 7, -7] * 16
    x = torch.tensor([[0.5 * c for c in codes]])
    expected = bytearray(260)  # base: 1 row x 2 groups x 32 B at 0; scales at 256 (2 x 2 B)
    expected[0:32] = bytes([0xE1, 0x97] * 16)  # (1 | 0xE << 4), (7 | 0x9 << 4); bytes 32..63: padding group = 0
    expected[256:258] = f16le(0.5)  # 00 38
    expected[258:260] = f16le(0.0)  # the padding group's scale
    codec = codec_for("q4_g64_fp16")
    data = codec.encode(x)
    assert as_bytes(data) == bytes(expected)
    codec.validate(data, (1, 64))
    torch.testing.assert_close(codec.decode(data, (1, 64)), x, rtol=0, atol=0)


def test_q4_decodes_every_nibble_including_minus_8():
    # one group holding the 16 nibbles 0..15 twice: two's complement codes 0..7, -8..-1, scale 0.25
    data = bytearray(260)
    data[0:32] = bytes(((2 * j) % 16) | (((2 * j + 1) % 16) << 4) for j in range(32))
    data[256:258] = f16le(0.25)
    codec = codec_for("q4_g64_fp16")
    codec.validate(u8(data), (1, 64))
    expected = torch.tensor([[0.25 * (v if v < 8 else v - 16) for v in list(range(16)) * 4]])
    torch.testing.assert_close(codec.decode(u8(data), (1, 64)), expected, rtol=0, atol=0)


def test_q5_hand_bytes_2x130():
    x = torch.zeros(2, 130)
    # row 0, group 0: amax 15 -> scale 1.0; codes 15, -1, 0, 5, ..., -6 at lane 9, ..., -15 at lane 63
    x[0, [0, 1, 3, 9, 63]] = torch.tensor([15.0, -1.0, 5.0, -6.0, -15.0])
    # row 1, group 2 (the partial one: lanes 128, 129): amax 7.5 -> scale 0.5; codes 15, -3
    x[1, [128, 129]] = torch.tensor([7.5, -1.5])
    expected = bytearray(528)
    # base plane (0..255): row r, group g at r * 128 + g * 32; u = code & 31, low nibble there
    expected[0] = 0xFF  # lanes 0, 1: 15 -> 0b01111, -1 -> 0b11111
    expected[1] = 0x50  # lanes 2, 3: 0, 5
    expected[4] = 0xA0  # lanes 8, 9: 0, -6 -> 0b11010
    expected[31] = 0x10  # lanes 62, 63: 0, -15 -> 0b10001
    expected[128 + 2 * 32] = 0xDF  # row 1 group 2, lanes 0, 1: 15 -> 0b01111, -3 -> 0b11101
    # high plane (256..319): row r, group g at 256 + r * 32 + g * 8; bit 4 of lane i at bit i % 8 of byte i // 8
    expected[256 + 0] = 0x02  # lane 1
    expected[256 + 1] = 0x02  # lane 9
    expected[256 + 7] = 0x80  # lane 63
    expected[256 + 32 + 16] = 0x02  # row 1 group 2, lane 1
    # scale plane (512..527): index row * 4 + group
    expected[512:514] = f16le(1.0)
    expected[512 + 2 * 6 : 512 + 2 * 7] = f16le(0.5)
    codec = codec_for("q5_g64_fp16")
    data = codec.encode(x)
    assert as_bytes(data) == bytes(expected)
    torch.testing.assert_close(codec.decode(data, (2, 130)), x, rtol=0, atol=0)


def test_q6_hand_bytes():
    x = torch.zeros(1, 64)
    # amax 31 -> scale 1.0; lanes 0..5: 31, -1, 16, -31, 0, -17
    x[0, :6] = torch.tensor([31.0, -1.0, 16.0, -31.0, 0.0, -17.0])
    expected = bytearray(516)  # base 64 B at 0, high 32 B at 256, scales 4 B at 512
    # u: 31 = 0b011111, -1 = 0b111111, 16 = 0b010000, -31 = 0b100001, -17 = 0b101111
    expected[0:3] = bytes([0xFF, 0x10, 0xF0])
    # high bits (bit 4, bit 5) per lane, 2 bits a lane LSB-first: lanes 0..3 -> 01, 11, 01, 10 -> 0b10_01_11_01
    expected[256] = 0b10011101
    expected[257] = 0b00001000  # lane 5: bits 4, 5 = 0, 1 at stream bits 10, 11
    expected[512:514] = f16le(1.0)
    codec = codec_for("q6_g64_fp16")
    data = codec.encode(x)
    assert as_bytes(data) == bytes(expected)
    torch.testing.assert_close(codec.decode(data, (1, 64)), x, rtol=0, atol=0)


def test_q8_hand_bytes_with_ties():
    x = torch.zeros(1, 40)
    x[0, :4] = torch.tensor([127.0, -127.0, -1.0, 2.0])  # group 0: amax 127 -> scale 1.0
    # group 1 (partial, lanes 32..39): amax 63.5 -> scale 0.5; 0.25 / 0.5 = 0.5 and 0.75 / 0.5 = 1.5 are ties
    x[0, 32:36] = torch.tensor([63.5, -0.5, 0.25, 0.75])
    expected = bytearray(264)  # base 1 x 4 groups x 32 B at 0, scales 8 B at 256
    expected[0:4] = bytes([0x7F, 0x81, 0xFF, 0x02])
    expected[32:36] = bytes([0x7F, 0xFF, 0x00, 0x02])  # 127, -1, 0 (tie to even), 2 (tie to even)
    expected[256:260] = f16le(1.0) + f16le(0.5)
    codec = codec_for("q8_g32_fp16")
    data = codec.encode(x)
    assert as_bytes(data) == bytes(expected)


def test_fp8_hand_bytes():
    x = torch.tensor([[448.0, -1.0, 0.5], [896.0, 2.0**-8, -3.25], [0.0, 0.0, 0.0]])
    expected = bytearray(262)  # 9 codes, scales at align_up(9, 256) = 256
    # row 0: scale 1; 448 = 0 1111 110, -1 = 1 0111 000, 0.5 = 0 0110 000
    # row 1: scale 2; 896 / 2 = 448, 2^-9 = smallest subnormal 0 0000 001, -1.625 = 1 0111 101; row 2: scale 0
    expected[0:9] = bytes([0x7E, 0xB8, 0x30, 0x7E, 0x01, 0xBD, 0, 0, 0])
    expected[256:262] = bf16le(1.0) + bf16le(2.0) + bf16le(0.0)
    codec = codec_for(FP8)
    data = codec.encode(x)
    assert as_bytes(data) == bytes(expected)
    torch.testing.assert_close(codec.decode(data, (3, 3)), x, rtol=0, atol=0)


def test_fp8_rounds_codes_to_nearest_even():
    # scale 1 (amax 448): 1.0625 is halfway between 1 (0x38) and 1.125 (0x39); 1.1875 between 0x39 and 1.25 (0x3A);
    # 1.5 * 2^-9 halfway between the subnormals 0x01 and 0x02; 2.5 * 2^-9 between 0x02 and 0x03
    x = torch.tensor([[448.0, 1.0625, 1.1875, 1.5 * 2.0**-9, -2.5 * 2.0**-9]])
    data = codec_for(FP8).encode(x)
    assert as_bytes(data[:5]) == bytes([0x7E, 0x38, 0x3A, 0x02, 0x82])


@pytest.mark.parametrize(
    ("fmt", "values", "expected"),
    [
        ("bf16", [1.0, -2.0, 1 + 2.0**-8, 1 + 3 * 2.0**-8], bytes.fromhex("803f 00c0 803f 823f")),  # ties to even
        ("fp16", [1.0, -2.0, 65504.0, 2.0**-24], bytes.fromhex("003c 00c0 ff7b 0100")),
        ("fp32", [1.0, -2.0, 2.0**-149], bytes.fromhex("0000803f 000000c0 01000000")),
        ("i32", [1, -2, 0x12345678], bytes.fromhex("01000000 feffffff 78563412")),
    ],
)
def test_contiguous_hand_bytes(fmt, values, expected):
    dtype = torch.int32 if fmt == "i32" else torch.float32
    source = torch.tensor(values, dtype=torch.float64 if fmt == "fp32" else dtype)
    codec = codec_for(fmt)
    data = codec.encode(source)
    assert as_bytes(data) == expected
    decoded = codec.decode(data, (len(values),))
    assert decoded.dtype == CONTIGUOUS[fmt][0]
    word = CONTIGUOUS[fmt][1]
    if word is not None:
        assert decoded.tolist() == [v for (v,) in struct.iter_unpack(word, expected)]


def test_contiguous_decode_keeps_nan_payloads():
    words = bytes.fromhex("0100c07f ffffffff 0000807f 00000080")  # quiet NaN with payload, negative NaN, +Inf, -0
    decoded = codec_for("fp32").decode(u8(words), (4,))
    codec_for("fp32").validate(u8(words), (4,))
    assert as_bytes(decoded.view(torch.uint8)) == words


# -- canonical encoder rules -------------------------------------------------------------------------------


def find_reciprocal_case(qmax: int) -> tuple[float, float, int, int]:
    """(fp16 scale, x, code by x * round_f32(1 / scale), code by x / scale) where the two rules disagree."""
    f32 = np.float32
    for scale_bits in range(0x2C00, 0x3C00):
        scale = f32(np.array([scale_bits], dtype=np.uint16).view(np.float16)[0])
        inv = f32(1) / scale
        for k in range(qmax):
            x = f32((k + 0.5) * scale)
            for _ in range(3):
                by_reciprocal, by_division = int(np.rint(f32(x * inv))), int(np.rint(f32(x / scale)))
                if by_reciprocal != by_division:
                    return float(scale), float(x), by_reciprocal, by_division
                x = np.nextafter(x, f32(np.inf))
    raise AssertionError("no disagreeing case in the search grid")


@pytest.mark.parametrize("fmt", list(GROUPWISE))
def test_codes_multiply_by_the_rounded_reciprocal(fmt):
    _, _, _, qmax = GROUPWISE[fmt]
    scale, x, by_reciprocal, by_division = find_reciprocal_case(qmax)
    source = torch.zeros(1, 64)
    source[0, 0] = qmax * scale  # exact in fp32, so raw = amax / qmax = scale exactly
    source[0, 1] = x
    codes, scales = unpack_groupwise(fmt, as_bytes(codec_for(fmt).encode(source)), 1, 64)
    assert scales[0, 0] == np.float32(scale)
    assert codes[0, :2].tolist() == [qmax, by_reciprocal], f"x / scale would give {by_division}"


@pytest.mark.parametrize("fmt", list(GROUPWISE))
def test_ties_round_half_to_even(fmt):
    _, _, _, qmax = GROUPWISE[fmt]
    source = torch.zeros(1, 64)
    ties = [0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5, 4.5, -6.5]
    source[0, 0] = float(qmax)  # scale 1.0, inv 1.0: x * inv == x
    source[0, 1 : 1 + len(ties)] = torch.tensor(ties)
    codes, scales = unpack_groupwise(fmt, as_bytes(codec_for(fmt).encode(source)), 1, 64)
    assert scales[0, 0] == 1.0
    expected = [0, 2, 2, 4, 0, -2, -2, -4, 4, -6]
    assert codes[0, 1 : 1 + len(ties)].tolist() == [max(min(c, qmax), -qmax - 1) for c in expected]


@pytest.mark.parametrize("fmt", list(GROUPWISE))
def test_rescue_scale_when_the_scale_rounds_to_zero(fmt):
    _, _, _, qmax = GROUPWISE[fmt]
    source = torch.zeros(1, 128)
    source[0, 0] = qmax * 2.0**-25  # raw = 2^-25 exactly: fp16 ties to even -> +0 -> rescued to 2^-24
    source[0, 1] = -(2.0**-26)  # x * 2^24 = -0.25 -> 0
    source[0, 64] = 1e-30  # second group: raw far below fp16 -> rescued, code 0
    data = as_bytes(codec_for(fmt).encode(source))
    scale_offset = spec_planes(fmt, 1, 128)[-1][0]
    groups = 128 // GROUPWISE[fmt][1]
    group_of_64 = 64 // GROUPWISE[fmt][1]
    assert data[scale_offset : scale_offset + 2] == bytes([0x01, 0x00])  # fp16 0x0001
    at = scale_offset + 2 * group_of_64
    assert data[at : at + 2] == bytes([0x01, 0x00])
    codes, scales = unpack_groupwise(fmt, data, 1, 128)
    assert scales[0, group_of_64] == FP16_MIN_SUBNORMAL
    assert codes[0, 0] == round(qmax / 2 / 2) * 2  # qmax / 2 = k + 0.5 -> the even neighbour
    assert codes[0, 1] == 0 and codes[0, 64] == 0
    assert (scales[0, group_of_64 + 1 : groups] == 0).all()


@pytest.mark.parametrize("fmt", list(GROUPWISE))
def test_subnormal_scales(fmt):
    _, group, _, qmax = GROUPWISE[fmt]
    source = torch.zeros(1, 128)
    source[0, 0] = qmax * 3 * 2.0**-24  # raw = 3 * 2^-24: a subnormal fp16 scale, bits 0x0003
    source[0, group] = qmax * 1000 * 2.0**-24  # 1000 * 2^-24, bits 0x03E8
    data = as_bytes(codec_for(fmt).encode(source))
    scale_offset = spec_planes(fmt, 1, 128)[-1][0]
    assert data[scale_offset : scale_offset + 4] == bytes([0x03, 0x00, 0xE8, 0x03])
    codes, _ = unpack_groupwise(fmt, data, 1, 128)
    assert codes[0, 0] == qmax and codes[0, group] == qmax


@pytest.mark.parametrize("fmt", list(GROUPWISE))
def test_zero_groups_have_positive_zero_scale_and_zero_codes(fmt):
    _, group, _, _ = GROUPWISE[fmt]
    source = torch.zeros(2, 128)
    source[0, :group] = -0.0  # amax = +0 even for negative zeros
    source[1, group:] = 1.0
    data = as_bytes(codec_for(fmt).encode(source))
    codes, scales = unpack_groupwise(fmt, data, 2, 128)
    scale_offset = spec_planes(fmt, 2, 128)[-1][0]
    gpr = 128 // group
    assert data[scale_offset : scale_offset + 2 * gpr] == bytes(2 * gpr)  # row 0: every scale +0 (no sign bit)
    assert (codes[0] == 0).all() and (codes[1, :group] == 0).all()
    assert scales[1, 0] == 0 and (scales[1, 1:] > 0).all()


@pytest.mark.parametrize("fmt", list(GROUPWISE))
@pytest.mark.parametrize("k", [66, 100, 200])
def test_partial_last_group_scale_and_zero_padding(fmt, k):
    _, group, _, qmax = GROUPWISE[fmt]
    source = torch.full((1, k), 1000.0)  # full groups get a large scale
    last = (k - 1) // group
    source[0, last * group :] = 0.5 * qmax  # the partial group: amax 0.5 * qmax -> scale 0.5 from its own values
    source[0, k - 1] = -0.5 * qmax
    data = as_bytes(codec_for(fmt).encode(source))
    codes, scales = unpack_groupwise(fmt, data, 1, k)
    assert scales[0, last] == 0.5
    assert (scales[0, last + 1 :] == 0).all()  # whole padding groups
    assert (codes[0, k:] == 0).all()  # padding lanes
    assert codes[0, k - 1] == -qmax and codes[0, last * group] == qmax


@pytest.mark.parametrize("fmt", list(GROUPWISE))
def test_codes_clamp_to_the_code_range(fmt):
    # A subnormal scale can round down by a large fraction: raw = 1.4 * 2^-24 -> scale 2^-24, so x * inv
    # reaches 1.4 * qmax and the codes clamp, at qmax and at qmin (which is -127 for q8, never -128).
    _, _, qmin, qmax = GROUPWISE[fmt]
    amax = np.float32(qmax * 1.4 * 2.0**-24)
    source = torch.zeros(1, 64)
    source[0, :2] = torch.tensor([amax, -amax])
    codes, scales = unpack_groupwise(fmt, as_bytes(codec_for(fmt).encode(source)), 1, 64)
    assert scales[0, 0] == FP16_MIN_SUBNORMAL
    assert codes[0, :2].tolist() == [qmax, qmin]


def test_q8_never_stores_minus_128():
    source = awkward_source((8, 300), seed=8)
    source[0, :32] = -torch.arange(1, 33, dtype=torch.float32)  # groups led by their most negative value
    source[1, :32] = -(2.0**-20)
    source[2, 32:64] = torch.tensor([-(127 * 1.4 * 2.0**-24)] * 32)  # clamped at qmin
    codes, _ = unpack_groupwise("q8_g32_fp16", as_bytes(codec_for("q8_g32_fp16").encode(source)), 8, 300)
    assert codes.min() == -127


@pytest.mark.parametrize("fmt", list(GROUPWISE))
def test_encoder_equals_the_reference_encoder(fmt):
    qmax = GROUPWISE[fmt][3]
    for seed, (n, k) in enumerate([(3, 300), (1, 65), (4, 129)]):
        source = awkward_source((n, k), seed)
        # a row of tiny groups: subnormal, rescued and clamped scales
        source[0] = torch.randn(k, generator=torch.Generator().manual_seed(seed)) * qmax * 2.0**-24 * 2
        codec = codec_for(fmt)
        assert as_bytes(codec.encode(source)) == reference_groupwise(fmt, source.numpy())


def test_fp8_encoder_equals_the_reference_encoder():
    for seed, (n, k) in enumerate([(3, 300), (1, 1), (5, 17)]):
        source = awkward_source((n, k), seed)
        assert as_bytes(codec_for(FP8).encode(source)) == reference_fp8(source.numpy())


def test_fp8_codes_multiply_by_the_rounded_reciprocal():
    f32 = np.float32
    midpoints = (E4M3_POSITIVE[1:] + E4M3_POSITIVE[:-1]) / 2
    for scale_bits in range(0x3F81, 0x4000):  # bf16 scales in (1, 2), most with an inexact reciprocal
        scale = (np.array([scale_bits], dtype=np.uint32) << 16).view(np.float32)[0]
        inv = f32(1) / scale
        for midpoint in midpoints:
            x = f32(midpoint * scale)
            by_reciprocal, by_division = e4m3_rne(np.array([f32(x * inv), f32(x / scale)]))
            if by_reciprocal != by_division:
                break
        else:
            continue
        break
    else:
        raise AssertionError("no disagreeing case in the search grid")
    source = torch.tensor([[FP8_MAX * float(scale), float(x)]])  # amax / 448 == scale exactly
    data = as_bytes(codec_for(FP8).encode(source))
    assert data[256:258] == bf16le(float(scale))
    assert data[1] == by_reciprocal, f"x / scale would give {by_division:#04x}"


@pytest.mark.parametrize("amax", [2.0**-149, 1e-40, 1e-38, 1e-37, 448 * 2.0**-130, 448 * 2.0**-127, 448 * 2.0**-126])
def test_fp8_tiny_rows_use_a_normal_scale(amax):
    # amax / 448 below the normal bf16 range: the scale is raised to 2^-126 so 1 / scale stays finite
    source = torch.tensor([[amax, 0.0, -amax / 2]], dtype=torch.float32)
    codec = codec_for(FP8)
    data = codec.encode(source)
    codec.validate(data, (1, 3))
    assert as_bytes(data[256:258]) == bf16le(FP8_RESCUE)
    assert as_bytes(data) == reference_fp8(source.numpy())


# -- round trips -------------------------------------------------------------------------------------------


def check_round_trip(fmt: str, source: torch.Tensor) -> torch.Tensor:
    codec = codec_for(fmt)
    shape = tuple(source.shape)
    data = codec.encode(source)
    assert data.dtype == torch.uint8 and data.shape == (codec.encoded_bytes(shape),)
    codec.validate(data, shape)
    decoded = codec.decode(data, shape)
    assert decoded.shape == source.shape
    if fmt == "i32":
        assert torch.equal(decoded, source)
        return data
    error = (decoded.to(torch.float64) - source.to(torch.float64)).abs()
    bound = codec.error_bound(source)
    assert bound.dtype == torch.float32 and bound.shape == source.shape
    assert bool((error <= bound.to(torch.float64)).all()), f"{fmt}: worst excess {(error - bound).max():.3g}"
    assert bool((error <= independent_bound(fmt, source)).all())
    return data


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("k", AWKWARD_K)
def test_round_trip_within_bounds(fmt, n, k):
    source = awkward_source((n, k), seed=1000 * n + k, fmt=fmt)
    data = check_round_trip(fmt, source)
    if fmt in LOSSY:
        decoded = codec_for(fmt).decode(data, (n, k))
        assert torch.equal(codec_for(fmt).encode(decoded), data), f"{fmt}: re-encoding the decoded values differs"


@pytest.mark.parametrize("fmt", [*GROUPWISE, FP8])
def test_error_bound_holds_for_tiny_values(fmt):
    # groupwise: subnormal fp16 scales (rounded up and down, clamping) and rescued groups;
    # fp8: rows whose amax / 448 is below the normal range
    generator = torch.Generator().manual_seed(7)
    unit = GROUPWISE[fmt][3] * 2.0**-24 if fmt in GROUPWISE else FP8_MAX * 2.0**-126
    levels = 2.0 ** torch.arange(-12, 6, dtype=torch.float32)
    source = torch.randn(len(levels), 256, generator=generator) * (unit * levels).unsqueeze(-1)
    check_round_trip(fmt, source)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32"])
def test_float_formats_are_exact_for_their_own_dtype(fmt):
    dtype = CONTIGUOUS[fmt][0]
    source = awkward_source((3, 65), seed=3).to(dtype)
    codec = codec_for(fmt)
    assert torch.equal(codec.error_bound(source), torch.zeros(3, 65))
    assert torch.equal(codec.decode(codec.encode(source), (3, 65)), source)


def test_i32_is_exact_for_any_integer_dtype():
    source = torch.tensor([[-(2**31), 2**31 - 1, 0], [5, -7, 1]], dtype=torch.int64)
    codec = codec_for("i32")
    assert torch.equal(codec.decode(codec.encode(source), (2, 3)), source.to(torch.int32))


def _magnitudes():
    # values in the normal scale range (or exact zeros): re-encoding a subnormal-scale group need not return
    # the same scale, so idempotence is a property of normal groups only
    magnitude = st.one_of(st.just(0.0), st.floats(2.0**-6, 2.0**12, width=32))
    return st.tuples(st.booleans(), magnitude).map(lambda p: -p[1] if p[0] else p[1])


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_round_trip_and_idempotence_property(fmt, data):
    n = data.draw(st.integers(1, 3), label="n")
    k = data.draw(st.integers(1, 200), label="k")
    if fmt == "i32":
        values = data.draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n * k, max_size=n * k))
        source = torch.tensor(values, dtype=torch.int64).reshape(n, k)
    else:
        values = data.draw(st.lists(_magnitudes(), min_size=n * k, max_size=n * k))
        source = torch.tensor(values, dtype=torch.float32).reshape(n, k)
    encoded = check_round_trip(fmt, source)
    codec = codec_for(fmt)
    assert torch.equal(codec.encode(codec.decode(encoded, (n, k))), encoded)


# -- rejections --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FLOAT_FORMATS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_is_rejected(fmt, bad):
    source = torch.ones(2, 70)
    source[1, 66] = bad
    with pytest.raises(FormatError, match="non-finite"):
        codec_for(fmt).encode(source)


@pytest.mark.parametrize("fmt", [*GROUPWISE, FP8, "bf16", "fp32"])
def test_values_beyond_float32_are_rejected(fmt):
    source = torch.ones(1, 64, dtype=torch.float64)
    source[0, 3] = 1e300
    with pytest.raises(FormatError):
        codec_for(fmt).encode(source)


@pytest.mark.parametrize("fmt", list(GROUPWISE))
def test_scale_beyond_fp16_is_rejected(fmt):
    _, _, _, qmax = GROUPWISE[fmt]
    codec = codec_for(fmt)
    largest = torch.zeros(1, 128)
    largest[0, 0] = qmax * 65519.0  # raw 65519 rounds down to the largest fp16, 65504
    data = as_bytes(codec.encode(largest))
    scale_offset = spec_planes(fmt, 1, 128)[-1][0]
    assert data[scale_offset : scale_offset + 2] == f16le(FP16_MAX)
    too_large = largest.clone()
    too_large[0, 0] = qmax * 65520.0  # raw 65520 is the midpoint to 2^16: ties to even -> Inf
    with pytest.raises(FormatError, match="too large"):
        codec.encode(too_large)
    with pytest.raises(FormatError):
        codec.encode(torch.full((2, 10), 1e6 * qmax / 7))


def test_q4_rejects_one_million():
    with pytest.raises(FormatError, match="too large"):
        codec_for("q4_g64_fp16").encode(torch.tensor([[1e6, 1.0]]))


@pytest.mark.parametrize(("value", "ok"), [(65504.0, True), (65519.0, True), (65520.0, False), (70000.0, False)])
def test_fp16_overflow_is_rejected(value, ok):
    source = torch.tensor([value, -1.0])
    codec = codec_for("fp16")
    if ok:
        assert as_bytes(codec.encode(source))[:2] == f16le(FP16_MAX)
    else:
        with pytest.raises(FormatError, match="overflow"):
            codec.encode(source)


@pytest.mark.parametrize("fmt", FLOAT_FORMATS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
def test_integers_into_float_formats_are_rejected(fmt, dtype):
    with pytest.raises(FormatError, match="float"):
        codec_for(fmt).encode(torch.ones(2, 64, dtype=dtype))


@pytest.mark.parametrize(
    "source",
    [torch.ones(2, 3), torch.ones(3, dtype=torch.float16), torch.ones(2, dtype=torch.bool),
     torch.tensor([2**31]), torch.tensor([-(2**31) - 1])],
)
def test_i32_rejects_floats_bools_and_out_of_range(source):
    with pytest.raises(FormatError):
        codec_for("i32").encode(source)


@pytest.mark.parametrize("fmt", [*GROUPWISE, FP8])
@pytest.mark.parametrize("shape", [(64,), (2, 3, 64), (), (0, 64), (2, 0)])
def test_matrix_layouts_reject_other_shapes(fmt, shape):
    codec = codec_for(fmt)
    with pytest.raises(FormatError, match=r"\[N, K\]"):
        codec.check_shape(shape)
    with pytest.raises(FormatError):
        codec.encode(torch.ones(shape))


@pytest.mark.parametrize("fmt", list(CONTIGUOUS))
@pytest.mark.parametrize("shape", [(0,), (3, 0), (1,) * 17])
def test_contiguous_rejects_empty_dims_and_rank_above_16(fmt, shape):
    with pytest.raises(FormatError):
        codec_for(fmt).check_shape(shape)


@pytest.mark.parametrize("fmt", [*GROUPWISE, FP8])
def test_decode_rejects_a_wrong_byte_count(fmt):
    codec = codec_for(fmt)
    data = codec.encode(torch.ones(2, 130))
    with pytest.raises(FormatError, match="bytes"):
        codec.decode(data[:-1], (2, 130))
    with pytest.raises(FormatError, match="bytes"):
        codec.decode(data, (3, 130))


# -- validate() --------------------------------------------------------------------------------------------


def corrupted(data: torch.Tensor, at: int, values: bytes) -> torch.Tensor:
    out = data.clone()
    out[at : at + len(values)] = u8(values)
    return out


@pytest.mark.parametrize("fmt", list(GROUPWISE))
@pytest.mark.parametrize(
    ("scale", "what"),
    [(-1.0, "negative"), (-0.0, "negative"), (math.nan, "NaN"), (math.inf, "Inf"), (-math.inf, "Inf")],
)
def test_validate_rejects_illegal_scales(fmt, scale, what):
    codec = codec_for(fmt)
    data = codec.encode(awkward_source((3, 130), seed=5))
    codec.validate(data, (3, 130))
    n, gpr = 3, 256 // GROUPWISE[fmt][1]
    scale_offset = spec_planes(fmt, 3, 130)[-1][0]
    at = scale_offset + 2 * (2 * gpr + 1)  # row 2, group 1
    with pytest.raises(FormatError, match=what):
        codec.validate(corrupted(data, at, f16le(scale)), (n, 130))


def test_validate_rejects_q8_code_minus_128():
    codec = codec_for("q8_g32_fp16")
    data = codec.encode(torch.ones(2, 64))
    codec.validate(data, (2, 64))
    at = 1 * 128 + 33  # row 1 (gpr 4, 32 B a group), lane 33
    with pytest.raises(FormatError, match="-128"):
        codec.validate(corrupted(data, at, bytes([0x80])), (2, 64))


@pytest.mark.parametrize("fmt", list(GROUPWISE))
def test_validate_rejects_codes_under_a_zero_scale(fmt):
    bits, group, _, _ = GROUPWISE[fmt]
    codec = codec_for(fmt)
    source = torch.ones(2, 128)
    source[1, group : 2 * group] = 0.0  # row 1, group 1 has scale 0
    data = codec.encode(source)
    codec.validate(data, (2, 128))
    base_row = 128 * (8 if bits == 8 else 4) // 8
    base_group = group * (8 if bits == 8 else 4) // 8
    with pytest.raises(FormatError, match="scale 0"):
        codec.validate(corrupted(data, base_row + base_group + 3, bytes([0x10])), (2, 128))
    if bits in (5, 6):  # a code that is non-zero through its high bits only
        high_offset = spec_planes(fmt, 2, 128)[1][0]
        high_group = group * (bits - 4) // 8
        at = high_offset + 2 * high_group + high_group  # row 1 (2 groups a row), group 1
        with pytest.raises(FormatError, match="scale 0"):
            codec.validate(corrupted(data, at, bytes([0x01])), (2, 128))


@pytest.mark.parametrize("fmt", list(GROUPWISE))
def test_validate_rejects_non_zero_padding_lanes(fmt):
    bits = GROUPWISE[fmt][0]
    codec = codec_for(fmt)
    k = 65  # the group holding lane 64 has a non-zero scale; lanes 65..127 are padding
    data = codec.encode(torch.ones(1, k))
    codec.validate(data, (1, k))
    lane = 90  # in the group of lane 64 for G = 64 and G = 32
    at = lane if bits == 8 else lane // 2  # an even lane sits in the low nibble
    with pytest.raises(FormatError, match="padding"):
        codec.validate(corrupted(data, at, bytes([0x01])), (1, k))
    if bits in (5, 6):
        high_offset = spec_planes(fmt, 1, k)[1][0]
        bit = lane * (bits - 4)  # bit 4 of the lane in the LSB-first high stream
        with pytest.raises(FormatError, match="padding"):
            codec.validate(corrupted(data, high_offset + bit // 8, bytes([1 << (bit % 8)])), (1, k))


@pytest.mark.parametrize("nan_code", [0x7F, 0xFF])
def test_validate_rejects_fp8_nan_codes(nan_code):
    codec = codec_for(FP8)
    data = codec.encode(awkward_source((3, 5), seed=9))
    codec.validate(data, (3, 5))
    with pytest.raises(FormatError, match="NaN code"):
        codec.validate(corrupted(data, 1 * 5 + 2, bytes([nan_code])), (3, 5))


@pytest.mark.parametrize(("scale", "what"), [(-1.0, "negative"), (-0.0, "negative"), (math.nan, "NaN"),
                                             (math.inf, "Inf")])
def test_validate_rejects_illegal_fp8_scales(scale, what):
    codec = codec_for(FP8)
    data = codec.encode(awkward_source((3, 5), seed=9))
    at = 256 + 2 * 1  # row 1's scale
    with pytest.raises(FormatError, match=what):
        codec.validate(corrupted(data, at, struct.pack("<f", scale)[2:]), (3, 5))


def test_validate_rejects_fp8_codes_under_a_zero_scale():
    codec = codec_for(FP8)
    source = torch.ones(3, 5)
    source[2] = 0.0
    data = codec.encode(source)
    codec.validate(corrupted(data, 2 * 5, bytes([0x80])), (3, 5))  # -0 is a zero code
    with pytest.raises(FormatError, match="scale 0"):
        codec.validate(corrupted(data, 2 * 5 + 4, bytes([0x01])), (3, 5))


@pytest.mark.parametrize("fmt", list(GROUPWISE))
def test_decoder_equals_the_layout_text_on_arbitrary_legal_bytes(fmt):
    bits, group, _, _ = GROUPWISE[fmt]
    n, k = 3, 200
    rng = np.random.default_rng(11)
    codes = rng.integers(-(1 << (bits - 1)) + (bits == 8), 1 << (bits - 1), size=(n, align_up(k, K_ALIGN)))
    codes[:, k:] = 0
    scale_bits = rng.integers(0, 0x7C00, size=(n, codes.shape[1] // group), dtype=np.uint16)  # +0 .. max finite
    scales = scale_bits.view(np.float16)
    codes[np.repeat(scales == 0, group, axis=1)] = 0
    data = pack_groupwise(fmt, codes, scales)
    codec = codec_for(fmt)
    codec.validate(u8(data), (n, k))
    expected = (np.repeat(scales.astype(np.float32), group, axis=1) * codes.astype(np.float32))[:, :k]
    assert np.array_equal(codec.decode(u8(data), (n, k)).numpy(), expected)


def test_fp8_decoder_equals_the_format_text_on_every_code():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8).reshape(2, 127)
    data = bytearray(spec_bytes(FP8, (2, 127)))
    data[:254] = codes.tobytes()
    data[256:260] = bf16le(0.75) + bf16le(2.0**-100)
    decoded = codec_for(FP8).decode(u8(data), (2, 127)).numpy()
    expected = np.array([[e4m3_value(int(c)) for c in row] for row in codes]) * np.array([[0.75], [2.0**-100]])
    assert np.array_equal(decoded, expected.astype(np.float32))


# -- chunked (plane-wise) encoding and decoding from views --------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "shape"),
    [(fmt, shape) for fmt in ALL_FORMATS for shape in [(5, 130), (2, 1), (4, 3, 7)]
     if fmt in CONTIGUOUS or len(shape) == 2],  # matrix layouts store [N, K] only
)
def test_chunked_encoding_equals_whole_encoding(fmt, shape):
    codec = codec_for(fmt)
    source = awkward_source(shape, seed=sum(shape), fmt=fmt)
    planes = codec.planes(shape)
    out = torch.full((codec.encoded_bytes(shape),), 0, dtype=torch.uint8)
    first = 0
    for rows in (source[:1], source[1:]):
        buffers = codec.encode_rows(rows)
        assert len(buffers) == len(planes)
        for plane, buf in zip(planes, buffers, strict=True):
            assert buf.dtype == torch.uint8 and buf.numel() == rows.shape[0] * plane.row_bytes
            start = plane.offset + first * plane.row_bytes
            out[start : start + buf.numel()] = buf.reshape(-1)
        first += rows.shape[0]
    assert torch.equal(out, codec.encode(source))


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_decode_from_a_view_into_a_larger_buffer(fmt):
    codec = codec_for(fmt)
    shape = (3, 129)
    source = awkward_source(shape, seed=21, fmt=fmt)
    data = codec.encode(source)
    payload = torch.randint(0, 256, (2 * PLANE_ALIGN + data.numel() + 100,), dtype=torch.uint8)
    offset = 2 * PLANE_ALIGN  # objects sit at 256-byte boundaries of a payload
    payload[offset : offset + data.numel()] = data
    view = payload[offset : offset + data.numel()]
    assert view.storage_offset() == offset
    decoded = codec.decode(view, shape)
    expected_dtype = CONTIGUOUS[fmt][0] if fmt in CONTIGUOUS else torch.float32
    assert decoded.dtype == expected_dtype and decoded.shape == shape
    assert torch.equal(decoded, codec.decode(data.clone(), shape))
    small = codec.encode(source[:1, :5])
    rows = torch.zeros(4, small.numel(), dtype=torch.uint8)  # a row of a 2-D byte buffer is a view too
    rows[3, : small.numel()] = small
    assert torch.equal(codec.decode(rows[3, : small.numel()], (1, 5)), codec.decode(small, (1, 5)))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_cuda_decode_equals_cpu(fmt):
    codec = codec_for(fmt)
    shape = (3, 300)
    data = codec.encode(awkward_source(shape, seed=31, fmt=fmt))
    payload = torch.zeros(PLANE_ALIGN + data.numel(), dtype=torch.uint8, device="cuda")
    payload[PLANE_ALIGN:] = data.cuda()
    decoded = codec.decode(payload[PLANE_ALIGN:], shape)
    assert decoded.device.type == "cuda"
    assert torch.equal(decoded.cpu(), codec.decode(data, shape))


CUDA_SHAPES = [(1, 1), (3, 63), (17, 129), (256, 5120), (1024, 2048), (2048, 512)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", registered_formats())
@pytest.mark.parametrize("shape", CUDA_SHAPES)
def test_cuda_encode_and_decode_equal_cpu(fmt, shape):
    """An artifact quantized on a GPU is the artifact quantized on a CPU: the same bytes, and the same values back."""
    codec = codec_for(fmt)
    generator = torch.Generator().manual_seed(hash((fmt, shape)) & 0xFFFF)
    if fmt == "i32":
        source = torch.randint(-(2**31), 2**31 - 1, shape, generator=generator, dtype=torch.int32)
    else:
        source = torch.randn(shape, generator=generator) * torch.logspace(-6, 2, shape[-1])  # wide dynamic range
    cpu = codec.encode(source)
    gpu = codec.encode(source.cuda())
    assert torch.equal(cpu, gpu.cpu()), f"{fmt} {shape}: the CUDA encoder differs from the CPU encoder"
    decoded_cpu = codec.decode(cpu, shape)
    decoded_gpu = codec.decode(cpu.cuda(), shape)
    assert decoded_gpu.device.type == "cuda"
    assert torch.equal(decoded_cpu, decoded_gpu.cpu())
