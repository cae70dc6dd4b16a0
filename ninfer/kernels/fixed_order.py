"""Sums in a fixed order, for kernels whose results must not depend on their layout, warps or tile of tokens.

`pairwise_row_sum(values, WIDTH)`: Σ over axis 1 of a 2-D tensor (WIDTH lanes, a power of 2) by a fixed tree —
lanes 2j and 2j + 1 added, then again — so the bits depend on neither the layout nor the warps, and a zero-padded
wider row gives the same bits as the narrower one (a zero adds exactly). Kernels that compute the same sum in other
tiles agree bit for bit, given the same summands: products from `tl.fma(w, x, 0)` (a product written into a sum
would be fused into an FMA there and rounded once less). Used by the dense GEMV and the GDN's in-kernel a/b
product (`dense_linear`, `gdn_decode`), which must agree bit for bit.
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
