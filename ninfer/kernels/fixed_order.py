"""Sums in a fixed order, for kernels whose results must not depend on their layout, warps or tile of tokens.

`pairwise_row_sum(values, WIDTH)`: Σ over axis 1 of a 2-D tensor (WIDTH lanes, a power of 2) by a fixed tree —
lanes 2j and 2j + 1 added, then again — so the bits depend on neither the layout nor the warps, and a zero-padded
wider row gives the same bits as the narrower one (a zero adds exactly). Kernels that compute the same sum in other
tiles agree bit for bit, given the same summands: products from `tl.fma(w, x, 0)` (a product written into a sum
would be fused into an FMA there and rounded once less). Used by the dense GEMV, the GDN's in-kernel a/b product
and the dense product beside a GEMV pair (`dense_linear`, `gdn_decode`, `quant_linear`), which must agree bit for
bit; `pairwise_dot` is one row's product by that tree, a chunk of lanes at a time.
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
    def pairwise_dot(w_row, x_row, K, WIDTH: tl.constexpr, CHUNK: tl.constexpr):
        """Σ_{k<K} w_row[k] · x_row[k] in fp32 (pointers to a row each, unit stride), the products `fma(w, x, 0)`
        summed by the tree of `pairwise_row_sum` over WIDTH lanes (K ≤ WIDTH, the lanes past K zero), taken
        CHUNK lanes at a time (both powers of 2): each chunk's subtree, then the tree over the chunk sums. The same
        tree, so the bits of `pairwise_row_sum(fma(w, x, 0), WIDTH)` over the row in one tile, with CHUNK lanes in
        registers (a one-warp program)."""
        COUNT: tl.constexpr = WIDTH // CHUNK
        lanes = tl.arange(0, CHUNK)
        chunks = tl.arange(0, COUNT)
        sums = tl.zeros((COUNT,), dtype=tl.float32)
        for c in tl.static_range(COUNT):
            k = c * CHUNK + lanes
            w = tl.load(w_row + k, mask=k < K, other=0.0).to(tl.float32)
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            chunk = pairwise_row_sum(tl.fma(w, x, tl.zeros_like(w))[None, :], CHUNK)
            sums = tl.where(chunks == c, tl.sum(chunk, 0), sums)
        return tl.sum(pairwise_row_sum(sums[None, :], COUNT), 0)
