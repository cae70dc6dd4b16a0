"""Weights streamed into L2 ahead of the GEMV that reads them, by a kernel in a second graph branch.

Between a decode step's GEMVs run small kernels (conv, delta rule, norms, SwiGLU) that read little, so DRAM idles
there and every GEMV starts cold. `L2Prefetch` names the first rows of the next GEMV's matrices (every plane:
codes, high bits, scales), `budget` bytes in all; `prefetch_to_l2` issues `prefetch.global.L2` for those lines
from `PROGRAMS` programs. The runner launches it in the step's second branch (`model.branches`) once the GEMV before
the small kernels has finished, so that it neither competes with that GEMV's stream nor lengthens the small
kernels: the next GEMV then finds its first rows in L2. A prefetch reads only weights and writes nothing, so no
result depends on it. (Issued from spare programs of the small kernels themselves, the same prefetches made those
kernels end only when their prefetch did: docs/optimizations.md.)

Ranges: an int64 tensor `[R, 2]` on the device of (address, bytes), each a whole number of 128-byte lines from an
address aligned to them; program p of P issues lines p·LINES … p·LINES + LINES − 1 of each range, then
(p + P)·LINES …; under the Triton interpreter and on other backends it issues nothing (with `trace`, it writes the
line numbers it would issue instead: tests).
"""

from __future__ import annotations

import torch

from ninfer import flags
from ninfer.quant import codec_for

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

LINE_BYTES = 128
PROGRAMS = 128  # programs of a prefetch launch, LINES lines a turn each
LINES = 256


class L2Prefetch:
    """The first rows of each plane (`_row_planes`) of `matrices` (packed `(data, shape, fmt)`), `budget` bytes in
    all, spread over them by size (the same fraction of each matrix's rows). `ranges` is the kernel's `[R, 2]`
    tensor; `bytes` what it covers."""

    def __init__(self, matrices: list[tuple[torch.Tensor, tuple[int, int], str]], budget: int):
        if not matrices or budget <= 0:
            raise ValueError("L2Prefetch needs at least one matrix and a positive budget")
        total = sum(data.numel() * data.element_size() for data, _, _ in matrices)
        fraction = min(1.0, budget / total)
        ranges = []
        for data, shape, fmt in matrices:
            rows = max(1, round(shape[0] * fraction))
            start = data.data_ptr()
            for offset, row_bytes in _row_planes(data, shape, fmt):
                first = (start + offset) // LINE_BYTES * LINE_BYTES
                end = start + offset + rows * row_bytes
                ranges.append((first, -(-(end - first) // LINE_BYTES) * LINE_BYTES))
        device = matrices[0][0].device
        self.ranges = torch.tensor(ranges, dtype=torch.int64, device=device)
        self.bytes = sum(length for _, length in ranges)
        self.asm = device.type == "cuda" and torch.version.hip is None and not flags.triton_interpreted()


def _row_planes(data: torch.Tensor, shape: tuple[int, int], fmt: str) -> list[tuple[int, int]]:
    """(offset, bytes per row) of each plane of a packed matrix; a matrix kept as stripe chunks (3-D `data`,
    `ninfer.kernels.stripe_linear`) is one plane, its rows in order 16 at a time."""
    if data.dim() == 3:
        return [(0, data.numel() * data.element_size() // shape[0])]
    return [(plane.offset, plane.row_bytes) for plane in codec_for(fmt).planes(shape)]


if triton is not None:

    @triton.jit
    def _prefetch_kernel(ranges_ptr, range_count, trace_ptr, trace_stride, LINES: tl.constexpr, ASM: tl.constexpr,
                         TRACE: tl.constexpr):
        program, programs = tl.program_id(0), tl.num_programs(0)
        lane = tl.arange(0, LINES)
        issued = tl.zeros((LINES,), dtype=tl.int32)
        traced = program * trace_stride
        for r in range(range_count):
            start = tl.load(ranges_ptr + 2 * r)
            lines = tl.load(ranges_ptr + 2 * r + 1) // 128  # LINE_BYTES
            for first in range(program * LINES, lines, programs * LINES):
                line = tl.minimum(first + lane, lines - 1).to(tl.int64)  # past the end: the last line again
                if ASM:
                    issued += tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                                        [start + line * 128], dtype=tl.int32, is_pure=False,
                                                        pack=1)
                if TRACE:  # the global line numbers this program issues, r-major: row (r, first + lane)
                    tl.store(trace_ptr + traced + lane, start // 128 + line, mask=first + lane < lines)
                    traced += LINES
        if tl.sum(issued, 0) != 0:  # never: keeps the prefetches (an unused asm result could be dropped)
            tl.store(ranges_ptr + lane, issued.to(tl.int64), mask=lane < 0)


def prefetch_to_l2(prefetch: L2Prefetch, trace: torch.Tensor | None = None) -> None:
    """Issue L2 prefetches for every line of `prefetch.ranges` (see the module docstring); a hint, no result.

    `trace` (tests): an int64 tensor `[PROGRAMS, capacity]` that each program fills with the line numbers
    (address // 128) it issues, in order, instead of issuing them; its unused tail is left as it was."""
    if triton is None:
        return
    _prefetch_kernel[(PROGRAMS,)](prefetch.ranges, prefetch.ranges.shape[0],
                                  trace if trace is not None else prefetch.ranges,
                                  trace.stride(0) if trace is not None else 0, LINES=LINES,
                                  ASM=prefetch.asm and trace is None, TRACE=trace is not None)
