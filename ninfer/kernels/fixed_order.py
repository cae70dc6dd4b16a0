"""Sums in a fixed order, for kernels whose results must not depend on their layout, warps or tile of tokens.

`pairwise_row_sum(values, WIDTH)`: Σ over axis 1 of a 2-D tensor (WIDTH lanes, a power of 2) by a fixed tree —
lanes 2j and 2j + 1 added, then again — so the bits depend on neither the layout nor the warps, and a zero-padded
wider row gives the same bits as the narrower one (a zero adds exactly). Kernels that compute the same sum in other
tiles agree bit for bit, given the same summands: products from `tl.fma(w, x, 0)` (a product written into a sum
would be fused into an FMA there and rounded once less).

`pairwise_dot(w_rows, x, K, WIDTH, CHUNK)`: rows of W times x over K ≤ WIDTH lanes, the products summed in that
same tree, loaded CHUNK lanes at a time. The tree's root adds the sums of the two halves, each the tree of its half,
so a chunk is a subtree and its sum the same bits as in one wide tile: kernels with few registers to spare (one
warp) compute the dot of a wide row in the bits of the kernels that hold it at once. Used by the dense GEMV, the
GEMV pair's dense product and the GDN's in-kernel a/b product (`dense_linear`, `quant_linear`, `gdn_decode`), which
must agree bit for bit.
"""

from __future__ import annotations

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

if triton is not None:

    @triton.jit
    def pairwise_row_sum(values, WIDTH: tl.constexpr):
        """Σ over axis 1 of `values` `[R, WIDTH]` in the module's fixed tree."""
        if WIDTH == 1:
            r = tl.sum(values, axis=1)
        else:
            r = pairwise_row_sum(tl.sum(tl.reshape(values, [values.shape[0], WIDTH // 2, 2]), axis=2), WIDTH // 2)
        return r

    @triton.jit
    def pairwise_dot(w_rows, x_ptr, K, WIDTH: tl.constexpr, CHUNK: tl.constexpr, OFFSET: tl.constexpr):
        """Σ_{k < K} w_rows[r][k] · x[k] `[R]` fp32 over lanes OFFSET … OFFSET + WIDTH (WIDTH, CHUNK powers of 2,
        CHUNK ≤ WIDTH; lanes past K are zeros) in the module's fixed tree: `w_rows` `[R]` pointers to the rows'
        lane 0, `x_ptr` x's. Chunks wholly past K are not loaded; their sum, +0, is added all the same."""
        if WIDTH == CHUNK:
            lanes = OFFSET + tl.arange(0, CHUNK)
            ok = lanes < K
            r = tl.zeros([w_rows.shape[0]], tl.float32)
            if OFFSET < K:
                w = tl.load(w_rows[:, None] + lanes[None, :], mask=ok[None, :], other=0.0)
                x = tl.load(x_ptr + lanes, mask=ok, other=0.0)
                zero = tl.zeros([w_rows.shape[0], CHUNK], tl.float32)
                r = pairwise_row_sum(tl.fma(w.to(tl.float32), x.to(tl.float32)[None, :], zero), CHUNK)
        else:
            r = pairwise_dot(w_rows, x_ptr, K, WIDTH // 2, CHUNK, OFFSET) + \
                pairwise_dot(w_rows, x_ptr, K, WIDTH // 2, CHUNK, OFFSET + WIDTH // 2)
        return r
