"""L2 prefetch in a captured step's second branch: the ranges name the first rows of every plane within the budget,
the kernel's programs together issue every line of every range (traced under the Triton interpreter: a wrong
program split would skip or repeat lines), and the runner names the matrices a step reads next."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ninfer.artifact.reader import Artifact
from ninfer.kernels.l2_prefetch import LINE_BYTES, LINES, PROGRAMS, L2Prefetch, prefetch_to_l2
from ninfer.quant import codec_for
from tests.model.support import packed_model


def _matrix(rows: int, columns: int, fmt: str, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rows)
    return codec_for(fmt).encode(torch.randn(rows, columns, generator=generator) * 0.02).to(device)


def _covered(ranges: torch.Tensor) -> set[int]:
    """Every byte address the ranges name."""
    return {b for start, length in ranges.tolist() for b in range(start, start + length)}


@pytest.mark.parametrize("fmt", ["q4_g64_fp16", "q5_g64_fp16", "q6_g64_fp16"])
def test_the_ranges_are_the_first_rows_of_every_plane_within_the_budget(fmt, device):
    shape = (40, 256)
    data = _matrix(*shape, fmt, device)
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
        assert set(range(base + plane.offset, base + plane.offset + rows * plane.row_bytes)) <= covered
        beyond = set(range(base + plane.offset + rows * plane.row_bytes + LINE_BYTES,
                           base + plane.offset + shape[0] * plane.row_bytes - LINE_BYTES))
        assert not beyond & covered
    assert prefetch.bytes <= total // 4 + len(planes) * 2 * LINE_BYTES + sum(p.row_bytes for p in planes)


def test_a_budget_past_the_matrices_takes_them_whole_and_splits_by_size(device):
    small, large = _matrix(8, 256, "q4_g64_fp16", device), _matrix(64, 256, "q4_g64_fp16", device)
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
        L2Prefetch([], budget=1)


def test_the_programs_together_issue_every_line_of_every_range_once(device):
    # ranges of 1, 300 and 70,000 lines: fewer lines than one program's turn, a few programs, several turns each
    matrices = [(_matrix(rows, 256, "q4_g64_fp16", device), (rows, 256), "q4_g64_fp16") for rows in (1, 200, 44_000)]
    prefetch = L2Prefetch(matrices, budget=1 << 40)
    lines = prefetch.ranges[:, 1] // LINE_BYTES
    turns = int(sum(-(-int(n) // (PROGRAMS * LINES)) for n in lines))
    trace = torch.full((PROGRAMS, turns * LINES), -1, dtype=torch.int64, device=device)
    prefetch_to_l2(prefetch, trace)
    issued = trace[trace >= 0].tolist()
    expected = [start // LINE_BYTES + i for start, length in prefetch.ranges.tolist()
                for i in range(length // LINE_BYTES)]
    assert sorted(issued) == sorted(expected)


def test_the_runner_prefetches_the_matrices_each_step_reads_next(device):
    with Artifact.open("ninfer/assets/demo.ninfer") as artifact:
        fast = packed_model(artifact, device, dtype=torch.float32, max_context=64)
    c = fast.config
    for i, kind in enumerate(c.layer_types):
        mixer = ["attention/query_key", "attention/gate_value"] if kind == "full_attention" else \
            ["gdn/query_key", "gdn/value_z"]
        assert fast.model._inputs_of(i) == [f"layers/{i}/{m}" for m in mixer]
        assert all(fast.model.linears[f"layers/{i}/{m}"].packed for m in (*mixer, "mlp/gate_up", "mlp/down")
                   if not (c.moe and m.startswith("mlp")))
    assert [fast.model.linears[n] for n in fast.model._inputs_of(c.layers)] == [fast.model.head]
