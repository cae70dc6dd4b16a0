"""Weights streamed into L2 ahead of the GEMV that reads them, by spare programs of the small kernel before it.

A decode step's GEMVs read their weights from DRAM, and between them run small kernels (conv, norms, SwiGLU) that
read little: DRAM idles there, and every GEMV starts cold. `L2Prefetch` names the first rows of the next GEMV's
matrices (every plane: codes, high bits, scales), `budget` bytes in all; a small kernel given one launches
`PREFETCH_PROGRAMS` more programs, which issue `prefetch.global.L2::evict_last` for those lines and exit
(`prefetch_ranges`). The GEMV then finds its first rows in L2. A prefetch is a hint: it reads only weights, which
no kernel writes, so it may run before the kernel's programmatic-dependent-launch wait (`dependent_launch`), and
no result depends on it. Off under the Triton interpreter and on other backends (the spare programs do nothing).

Ranges: an int64 tensor `[R, 2]` on the device of (address, bytes), each a whole number of 128-byte lines from an
address aligned to them; program p of P issues lines p·LINES … of each range, then (p + P)·LINES …
"""

from __future__ import annotations

import os

import torch

from ninfer.quant import codec_for

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

LINE_BYTES = 128
PREFETCH_PROGRAMS = 64  # spare programs a small kernel launches to issue a prefetch
PREFETCH_BYTES = 12 << 20  # per small kernel: about its window at the H200's read bandwidth (docs/performance.md)


def _asm_supported(device: torch.device) -> bool:
    return (torch.device(device).type == "cuda" and torch.version.hip is None
            and os.environ.get("TRITON_INTERPRET") != "1")


class L2Prefetch:
    """The first rows of each plane of `matrices` (packed groupwise `(data, shape, fmt)`), `budget` bytes in all
    spread over them by size: the same fraction of each matrix's rows. `ranges` is the kernels' `[R, 2]` tensor;
    `asm` whether the kernels issue real prefetches (CUDA, not interpreted)."""

    def __init__(self, matrices: list[tuple[torch.Tensor, tuple[int, int], str]], budget: int = PREFETCH_BYTES):
        if not matrices:
            raise ValueError("L2Prefetch needs at least one matrix")
        total = sum(data.numel() * data.element_size() for data, _, _ in matrices)
        fraction = min(1.0, budget / total)
        ranges = []
        for data, shape, fmt in matrices:
            rows = max(1, round(shape[0] * fraction))
            start = data.data_ptr()
            for plane in codec_for(fmt).planes(shape):
                first = (start + plane.offset) // LINE_BYTES * LINE_BYTES
                end = start + plane.offset + rows * plane.row_bytes
                ranges.append((first, -(-(end - first) // LINE_BYTES) * LINE_BYTES))
        self.device = matrices[0][0].device
        self.ranges = torch.tensor(ranges, dtype=torch.int64, device=self.device)
        self.bytes = sum(length for _, length in ranges)
        self.asm = _asm_supported(self.device)


def launch_args(prefetch: L2Prefetch | None, fallback: torch.Tensor, tiles: int) -> tuple[int, tuple, dict]:
    """For a small kernel launched over a grid `(rows, tiles)`: the spare rows to add to its grid, its
    (ranges, range count) arguments (`fallback` stands in for the ranges without a prefetch) and its PREFETCH,
    PREFETCH_ASM and PREFETCH_WAIT constexprs."""
    if prefetch is None:
        return 0, (fallback, 0), {"PREFETCH": False, "PREFETCH_ASM": False, "PREFETCH_WAIT": False}
    return (-(-PREFETCH_PROGRAMS // tiles), (prefetch.ranges, prefetch.ranges.shape[0]),
            {"PREFETCH": True, "PREFETCH_ASM": prefetch.asm,
             "PREFETCH_WAIT": os.environ.get("NINFER_L2_PREFETCH_WAIT") == "1"})


if triton is not None:
    from ninfer.kernels.dependent_launch import wait_for_inputs

    SPARE_LINES = tl.constexpr(256)  # lines a spare program issues a turn

    @triton.jit
    def prefetch_ranges(ranges_ptr, range_count, program, programs, LINES: tl.constexpr, ASM: tl.constexpr):
        """Program `program` of `programs`: its share of the lines of every range (see the module docstring)."""
        lane = tl.arange(0, LINES)
        issued = tl.zeros((LINES,), dtype=tl.int32)
        for r in range(range_count):
            start = tl.load(ranges_ptr + 2 * r)
            lines = tl.load(ranges_ptr + 2 * r + 1) // 128  # LINE_BYTES
            for first in range(program * LINES, lines, programs * LINES):
                line = tl.minimum(first + lane, lines - 1).to(tl.int64)  # past the end: the last line again
                if ASM:
                    issued += tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
                                                        "=r,l", [start + line * 128], dtype=tl.int32,
                                                        is_pure=False, pack=1)
                else:
                    issued += (line < 0).to(tl.int32)
        if tl.sum(issued, 0) != 0:  # never: keeps the prefetches (an unused asm result could be dropped)
            tl.store(ranges_ptr + lane, issued.to(tl.int64), mask=lane < 0)

    @triton.jit
    def spare_program(ranges_ptr, range_count, rows, ASM: tl.constexpr, WAIT: tl.constexpr, PDL: tl.constexpr):
        """A spare program of a small kernel whose grid is `(rows + spare rows, tiles)`: its share of the ranges."""
        if WAIT:
            wait_for_inputs(PDL)
        tiles = tl.num_programs(1)
        prefetch_ranges(ranges_ptr, range_count, (tl.program_id(0) - rows) * tiles + tl.program_id(1),
                        (tl.num_programs(0) - rows) * tiles, SPARE_LINES, ASM)
