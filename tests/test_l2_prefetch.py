"""L2 prefetch by the small kernels' spare programs: the ranges name the first rows of every plane, and a kernel given
a prefetch gives the bits it gives without one (under the Triton interpreter the spare programs issue nothing, but
they run: a wrong program split would write or skip rows). The runner's targets name the matrices a decode step
reads next."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from ninfer.artifact.reader import Artifact
from ninfer.fast.runner import FastQwen35
from ninfer.kernels.fused import add_rms_norm, sigmoid_mul, silu_mul
from ninfer.kernels.gdn_decode import conv1d_update
from ninfer.kernels.l2_prefetch import LINE_BYTES, L2Prefetch
from ninfer.quant import codec_for

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16


def _matrix(rows: int, columns: int, fmt: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rows)
    return codec_for(fmt).encode(torch.randn(rows, columns, generator=generator) * 0.02).to(DEVICE)


def _covered(ranges: torch.Tensor) -> set[int]:
    """Every byte address the ranges name."""
    return {b for start, length in ranges.tolist() for b in range(start, start + length)}


@pytest.mark.parametrize("fmt", ["q4_g64_fp16", "q5_g64_fp16", "q6_g64_fp16"])
def test_the_ranges_are_the_first_rows_of_every_plane_within_the_budget(fmt):
    shape = (40, 256)
    data = _matrix(*shape, fmt)
    planes = codec_for(fmt).planes(shape)
    total = data.numel()
    prefetch = L2Prefetch([(data, shape, fmt)], budget=total // 4)
    rows = round(shape[0] / 4)
    assert prefetch.ranges.shape == (len(planes), 2)
    starts, lengths = prefetch.ranges[:, 0].tolist(), prefetch.ranges[:, 1].tolist()
    assert all(s % LINE_BYTES == 0 and n % LINE_BYTES == 0 and n > 0 for s, n in zip(starts, lengths, strict=True))
    covered = _covered(prefetch.ranges)
    base = data.data_ptr()
    for plane in planes:  # the first `rows` rows of each plane, whole; beyond them a line's slack at either end
        first = set(range(base + plane.offset, base + plane.offset + rows * plane.row_bytes))
        assert first <= covered
        beyond = set(range(base + plane.offset + rows * plane.row_bytes + LINE_BYTES,
                           base + plane.offset + shape[0] * plane.row_bytes - LINE_BYTES))
        assert not beyond & covered
    assert prefetch.bytes <= total // 4 + len(planes) * 2 * LINE_BYTES + sum(p.row_bytes for p in planes)


def test_a_budget_past_the_matrices_takes_them_whole_and_splits_by_size():
    small, large = _matrix(8, 256, "q4_g64_fp16"), _matrix(64, 256, "q4_g64_fp16")
    whole = L2Prefetch([(small, (8, 256), "q4_g64_fp16")], budget=10 * small.numel())
    assert set(range(small.data_ptr(), small.data_ptr() + small.numel())) <= _covered(whole.ranges)
    both = L2Prefetch([(small, (8, 256), "q4_g64_fp16"), (large, (64, 256), "q4_g64_fp16")],
                      budget=(small.numel() + large.numel()) // 2)
    planes = codec_for("q4_g64_fp16").planes((8, 256))
    covered = _covered(both.ranges)
    for data, rows in ((small, 4), (large, 32)):  # half the rows of each
        assert set(range(data.data_ptr(), data.data_ptr() + rows * planes[0].row_bytes)) <= covered
        assert data.data_ptr() + (rows + 2) * planes[0].row_bytes not in covered
    with pytest.raises(ValueError, match="at least one matrix"):
        L2Prefetch([])


def test_kernels_with_spare_programs_give_the_bits_they_give_without():
    generator = torch.Generator().manual_seed(3)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(DEVICE, DTYPE)

    data = _matrix(64, 1024, "q5_g64_fp16")
    prefetch = L2Prefetch([(data, (64, 1024), "q5_g64_fp16")], budget=data.numel())
    x, h, weight = randn(2, 1280), randn(2, 1280), randn(1280)
    total, normed = add_rms_norm(x, h, weight, 1e-6, True, prefetch)
    total_alone, normed_alone = add_rms_norm(x, h, weight, 1e-6, True)
    assert torch.equal(total, total_alone) and torch.equal(normed.source, normed_alone.source)
    assert torch.equal(normed.blocks, normed_alone.blocks)
    gate_up = randn(2, 2 * 1280)
    got, expected = silu_mul(gate_up, True, prefetch), silu_mul(gate_up, True)
    assert torch.equal(got.source, expected.source) and torch.equal(got.blocks, expected.blocks)
    o, gate = randn(2, 1280), randn(2, 1280)
    got, expected = sigmoid_mul(o, gate, True, prefetch), sigmoid_mul(o, gate, True)
    assert torch.equal(got.source, expected.source) and torch.equal(got.blocks, expected.blocks)
    conv_weight, pool, slots = randn(640, 4), randn(3, 640, 3), torch.tensor([2, 0], device=DEVICE)
    inputs = randn(2, 640)
    pool_with = pool.clone()
    got = conv1d_update(inputs, conv_weight, pool_with, slots, prefetch=prefetch)
    assert torch.equal(got, conv1d_update(inputs, conv_weight, pool, slots)) and torch.equal(pool_with, pool)


def test_the_runners_targets_are_the_matrices_each_step_reads_next():
    with Artifact.open("ninfer/assets/demo.ninfer") as artifact:
        fast = FastQwen35.from_artifact(artifact, DEVICE, dtype=torch.float32, max_context=64, l2_prefetch=True)
        plain = FastQwen35.from_artifact(artifact, DEVICE, dtype=torch.float32, max_context=64, l2_prefetch=False)
    c = fast.config
    assert not plain.prefetch
    for i, kind in enumerate(c.layer_types):
        mixer = "attention" if kind == "full_attention" else "gdn"
        names = {"mixer": [f"{mixer}/query_key", f"{mixer}/gate_value" if mixer == "attention" else "gdn/value_z"],
                 "output": [f"{mixer}/output"], "gate_up": ["mlp/gate_up"], "down": ["mlp/down"]}
        for what, matrices in names.items():
            starts = {fast.linears[f"layers/{i}/{m}"].data.data_ptr() // LINE_BYTES * LINE_BYTES for m in matrices}
            assert starts <= set(fast.prefetch[i, what].ranges[:, 0].tolist()), (i, what)
    assert fast.head.data.data_ptr() // LINE_BYTES * LINE_BYTES in fast.prefetch[c.layers, "mixer"].ranges[:, 0]
    x = torch.zeros(1, c.hidden)
    assert fast._prefetch(0, "mixer", x, True) is fast.prefetch[0, "mixer"]
    assert fast._prefetch(0, "mixer", x, False) is None  # prefill steps take none
