"""A matrix held as two (`PackedLinear.split`, the GDN value_z and attention gate_value on the fast path): each part
decodes to exactly its rows of the whole, in every format the fast path holds, and keeps what makes it take the
integer GEMV."""

from __future__ import annotations

import pytest
import torch

from ninfer.fast.linear import PackedLinear, Scratch, split_rows
from ninfer.quant import codec_for

FORMATS = ["q4_g64_fp16", "q5_g64_fp16", "q6_g64_fp16", "q8_g32_fp16", "fp8_e4m3fn_row_bf16", "bf16"]


def _decoded(linear: PackedLinear) -> torch.Tensor:
    if linear.packed:
        return codec_for(linear.format).decode(linear.data, linear.shape).float()
    return linear.weight.float()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 40, 95])
def test_each_part_decodes_to_its_rows_of_the_whole(fmt, rows):
    shape = (96, 320)  # five 64-lane groups a row: planes whose rows are not multiples of their alignment
    generator = torch.Generator().manual_seed(rows)
    data = codec_for(fmt).encode(torch.randn(shape, generator=generator))
    whole = PackedLinear(data, shape, fmt, Scratch(torch.device("cpu"), torch.float32))
    expected = _decoded(whole)
    first, second = whole.split(rows)
    assert (first.shape, second.shape) == ((rows, 320), (96 - rows, 320))
    assert torch.equal(_decoded(first), expected[:rows]) and torch.equal(_decoded(second), expected[rows:])
    assert first.format == second.format == fmt and first.batch_route == second.batch_route == whole.batch_route
    if whole.packed:
        assert first.data.numel() == codec_for(fmt).encoded_bytes(first.shape)


def test_a_split_must_leave_two_parts():
    data = codec_for("q4_g64_fp16").encode(torch.randn(8, 64))
    for rows in (0, 8):
        with pytest.raises(ValueError, match="empty part"):
            split_rows(data, (8, 64), "q4_g64_fp16", rows)
