"""Activations as int8 for the integer GEMV (`ninfer.kernels.quant_linear.quant_linear_gemv`).

Contract: x `[T, K]` (fp32 / bf16 / fp16) becomes `Int8Activations` over K padded with zeros to a multiple of
LANE_PAD (128, as the groupwise formats pad a row) lanes, one record of RECORD (12) int32 words per block of BLOCK
(32) lanes — `blocks` `[T, K_pad / 32, 12]`:
  * words 0–3: for the block's 8-lane units u = 0..3, the codes of lanes 8u + 0, 2, 4, 6 as the bytes of one
    word; words 4–7: the codes of lanes 8u + 1, 3, 5, 7. A packed 4-bit weight word's even / odd nibbles, masked
    in place, are the matching byte quads on the weight side;
  * word 8: the scale s = absmax / 127 (IEEE division) as fp32 bits; word 9: Σ q over the block (the GEMV removes
    the offset of unsigned weight codes with it); words 10, 11: zero.
The codes are q = round_half_even(x / s) in [-127, 127] (0 where the block is all zeros), so x ≈ q · s per lane
with |error| ≤ s / 2. A block's scale and sum travel in its record so that the GEMV loads them in the layout of
the codes (one 16-byte load each, no shuffles between thread layouts). This is the Q8_1-style activation
quantization of llama.cpp's integer matrix-vector products (blocks of 32, absmax scaling), which we follow; the
rounding is exact IEEE on both sides, so `quantize_activations` and `quantize_activations_reference` agree bit
for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ninfer.kernels.dependent_launch import launch_options, wait_for_inputs
from ninfer.quant.groupwise import K_ALIGN

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

BLOCK = 32  # lanes per activation scale
LANE_PAD = K_ALIGN  # K is padded as the groupwise formats pad a row (128 lanes): every weight lane meets a code
RECORD = 12  # int32 words per block: 4 even quads, 4 odd quads, scale, sum, 2 zero


class Int8Activations(NamedTuple):
    source: torch.Tensor  # x itself `[T, K]`, for the routes that do not take int8 activations
    blocks: torch.Tensor  # [T, K_pad / BLOCK, RECORD] int32

    @property
    def shape(self) -> torch.Size:
        return self.source.shape

    @property
    def scales(self) -> torch.Tensor:
        return self.blocks[..., 8].view(torch.float32)

    @property
    def sums(self) -> torch.Tensor:
        return self.blocks[..., 9]

    def rows(self, index: slice) -> Int8Activations:
        """The inputs of rows `index` (views: records of whole rows stay contiguous)."""
        return Int8Activations(self.source[index], self.blocks[index])


def padded_lanes(k: int) -> int:
    return -(-k // LANE_PAD) * LANE_PAD


def empty_records(rows: int, k: int, device: torch.device) -> torch.Tensor:
    """Uninitialised `blocks` for `rows` inputs of `k` lanes, for the kernels that write them."""
    return torch.empty((rows, padded_lanes(k) // BLOCK, RECORD), dtype=torch.int32, device=device)


def quantize_activations_reference(x: torch.Tensor) -> Int8Activations:
    """The contract in torch (any device): the oracle of `quantize_activations`."""
    tokens, k = x.shape
    k_pad = padded_lanes(k)
    lanes = torch.nn.functional.pad(x.float(), (0, k_pad - k)).view(tokens, k_pad // BLOCK, BLOCK)
    # IEEE fp32 divisions on every device (CUDA torch multiplies by a scalar divisor's reciprocal): exact in float64,
    # then one rounding to fp32, which is the correctly rounded fp32 quotient
    scales = (lanes.abs().amax(-1).double() / 127).float()
    divisors = torch.where(scales > 0, scales, 1).double()[..., None]
    codes = torch.round((lanes.double() / divisors).float()).to(torch.int32)
    units = (codes & 0xFF).view(tokens, k_pad // BLOCK, 4, 8)
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32, device=x.device)
    blocks = torch.zeros(tokens, k_pad // BLOCK, RECORD, dtype=torch.int32, device=x.device)
    blocks[..., 0:4] = (units[..., 0::2] << shifts).sum(-1)
    blocks[..., 4:8] = (units[..., 1::2] << shifts).sum(-1)
    blocks[..., 8] = scales.view(torch.int32)
    blocks[..., 9] = codes.sum(-1, dtype=torch.int32)
    return Int8Activations(x, blocks)


def dequantize_activations(acts: Int8Activations) -> torch.Tensor:
    """q · s `[T, K_pad]` fp32: the values the integer GEMV multiplies (its oracle's input)."""
    tokens, count, _ = acts.blocks.shape
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32, device=acts.blocks.device)
    quads = acts.blocks[..., :8].reshape(tokens, count, 2, 4)  # [T, blocks, parity, unit]
    codes = ((quads[..., None] >> shifts) & 0xFF).to(torch.uint8).view(torch.int8).to(torch.float32)
    lanes = codes.permute(0, 1, 3, 4, 2).reshape(tokens, count, BLOCK)  # lane 8u + 2i + parity
    return (lanes * acts.scales[..., None]).reshape(tokens, count * BLOCK)


if triton is not None:

    @triton.jit
    def block_quads(x):
        """x `[BLOCKS, 32]` fp32 (32-lane blocks) → the blocks' codes as the records hold them: even quads
        `[BLOCKS, 4]` (unit u: lanes 8u + 0, 2, 4, 6 as the bytes of one word), odd quads (lanes 8u + 1, 3, 5, 7),
        the scales `[BLOCKS]` fp32 and the code sums `[BLOCKS]` int32. Shared by every kernel that writes int8
        activations, in any layout (`store_records`, `stripe_linear.store_tiles`): the same codes everywhere."""
        BLOCKS: tl.constexpr = x.shape[0]
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0)
        y = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])
        # round half to even by the 1.5 · 2^23 magic number (|y| ≤ 127.5): the code sits in the low mantissa bits
        codes = (y + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
        units = tl.reshape(codes & 0xFF, [BLOCKS, 4, 8])
        column = tl.arange(0, 8)[None, None, :]
        placed = units << (8 * (column // 2))  # byte i of the even / odd quad: lane 2i / 2i + 1 of the unit
        even = tl.sum(tl.where(column % 2 == 0, placed, 0), axis=2)  # [BLOCKS, 4]
        odd = tl.sum(tl.where(column % 2 == 1, placed, 0), axis=2)
        return even, odd, scale, tl.sum(codes, axis=1)

    @triton.jit
    def store_records(x, record_ptr, blocks, block_count):
        """Quantize x `[BLOCKS, 32]` fp32 (the lanes of blocks `blocks` of one row) and store their records at
        `record_ptr` (the row's first record); blocks ≥ `block_count` are not stored. Shared by the quantizer and
        the kernels that quantize their own output (`fused.add_rms_norm`)."""
        even, odd, scale, sums = block_quads(x)
        word = tl.arange(0, 4)[None, :]
        meta = tl.where(word == 0, scale.to(tl.int32, bitcast=True)[:, None], tl.where(word == 1, sums[:, None], 0))
        record = record_ptr + blocks[:, None] * 12 + word
        ok = (blocks < block_count)[:, None]
        tl.store(record, even, mask=ok)
        tl.store(record + 4, odd, mask=ok)
        tl.store(record + 8, meta, mask=ok)

    @triton.jit
    def store_tile_records(y, records_ptr, row, record_count, LANES: tl.constexpr):
        """The records of y, lanes [program_id(1) · LANES, (program_id(1) + 1) · LANES) of row `row` (LANES a
        multiple of 32), at `records_ptr` `[rows, record_count, 12]`: for the kernels that quantize the output
        tile they have just made (`fused`, `gdn_decode`)."""
        blocks = tl.program_id(1) * (LANES // 32) + tl.arange(0, LANES // 32)
        store_records(tl.reshape(y.to(tl.float32), [LANES // 32, 32]), records_ptr + row * record_count * 12, blocks,
                      record_count)

    @triton.jit
    def _quantize_kernel(x_ptr, blocks_ptr, K, block_count, stride_x, BLOCKS: tl.constexpr, PDL: tl.constexpr):
        wait_for_inputs(PDL)
        t = tl.program_id(0).to(tl.int64)
        blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
        lane = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]  # [BLOCKS, 32]
        x = tl.load(x_ptr + t * stride_x + lane, mask=lane < K, other=0.0).to(tl.float32)
        store_records(x, blocks_ptr + t * block_count * 12, blocks, block_count)


def quantize_activations(x: torch.Tensor) -> Int8Activations:
    """x `[T, K]` → `Int8Activations` (see the module docstring), one Triton launch."""
    if triton is None:
        raise RuntimeError("the activation quantizer needs the triton package")
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, k = x.shape
    blocks = empty_records(tokens, k, x.device)
    count = blocks.shape[1]
    per_program = min(32, triton.next_power_of_2(count))
    _quantize_kernel[(tokens, triton.cdiv(count, per_program))](x, blocks, k, count, x.stride(0), BLOCKS=per_program,
                                                                **launch_options(x.device))
    return Int8Activations(x, blocks)
