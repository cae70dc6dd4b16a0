"""Which rows (and which token) a GEMV program owns, shared by the few-token GEMVs of every weight format
(`quant_linear`'s token route, `fp8_linear`, `dense_linear`): row tiles of BLOCK_N rows, the tile's rows clamped
into the matrix for unmasked loads, and with GATHER the expert block an output slot reads (MoE decode)."""

from __future__ import annotations

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None


if triton is not None:

    @triton.jit
    def row_tile(tile, N, BLOCK_N: tl.constexpr):
        """The rows of row tile `tile`, whether each is < N (the store masks), and the rows clamped into [0, N) as
        int64 (for unmasked, vectorisable loads)."""
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        return rows, rows < N, tl.minimum(rows, N - 1).to(tl.int64)

    @triton.jit
    def gemv_rows(x_ptr, out_ptr, expert_ptr, N, T, stride_x, stride_out, BLOCK_N: tl.constexpr,
                  GATHER: tl.constexpr, X_PER_SLOT: tl.constexpr):
        """The output rows of a GEMV program and where they live: (rows, row_ok, safe_rows clamped into [0, N) for
        unmasked, vectorisable loads — the store masks —, the weight rows, x's row and the output row). Without
        GATHER, program_id(0) = row tile · T + token: the T programs of a row tile run side by side, so the ones
        after the first read its weights from L2. With GATHER, program_id(0) is the row tile and program_id(1) an
        output slot, whose expert `expert_ptr[slot]` offsets the weight rows by expert · N."""
        rows, row_ok, safe_rows = row_tile(tl.program_id(0) if GATHER else tl.program_id(0) // T, N, BLOCK_N)
        if GATHER:
            slot = tl.program_id(1)
            wrows = tl.load(expert_ptr + slot).to(tl.int64) * N + safe_rows
            x_base = x_ptr + (slot // X_PER_SLOT) * stride_x
            out_base = out_ptr + slot * stride_out
        else:
            token = (tl.program_id(0) % T).to(tl.int64)
            wrows = safe_rows
            x_base = x_ptr + token * stride_x
            out_base = out_ptr + token * stride_out
        return rows, row_ok, safe_rows, wrows, x_base, out_base
