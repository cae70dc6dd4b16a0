"""y = x · Wᵀ with W stored packed in a groupwise format (q4/q5/q6 g64, q8 g32, `row_split_k128_v1`).

Contract: x `[T, K]` (fp32 / bf16 / fp16), `data` the object's bytes (1-D uint8, on x's device), `shape` = (N, K)
of W, `fmt` its format, W[n, k] = scale[n, k // G] · code[n, k].

Four paths:
  * `quant_linear_reference`: decode W exactly (ninfer.quant) and multiply in fp32 — the oracle, any device. With
    `int8_activations`, x is first replaced by its int8 image (`activation_quant`): the oracle of the GEMV;
  * `quant_linear_gemv`: the integer GEMV for few tokens (decode, speculative verify, batched decode: T ≤ 64),
    which reads the packed planes once. x is quantized to int8 per 32 lanes (`activation_quant`, Q8_1-style as
    llama.cpp's integer matrix-vector products do) and y[t, n] = Σ_b scale_w[n, b] · scale_x[t, b] · D[t, n, b]
    with D the exact integer dot product of block b. A program owns a few rows and walks K in tiles of BLOCK_K
    lanes: the base plane is loaded as 32-bit words (8 lanes of nibbles, or 4 int8 lanes for q8) with the high
    units of the same lanes (q5: a byte, q6: 16 bits per word) and the scales; a word's even and odd nibbles,
    masked in place (plus the high bits, moved by a multiply), are byte quads that meet the activation quads in
    one `dp4a` each — about 5 integer instructions per 8 weights for q4, against ~50 for a float conversion of
    every lane. Unsigned codes carry an offset (8, 16, 32), removed per block with the activation sums. Two
    routes (their kernels in `quant_gemv_kernels`, their tiles in `tuning`):
      - "batch" (whole matrices whose padded K is a multiple of BATCH_BLOCK_K): a program holds up to 8 tokens;
        each lane of its warp owns one 32-lane block of the 1,024-lane tile for all the program's rows and
        tokens, so a weight tile is loaded and unpacked once for all tokens and an x record once for all rows,
        with no data exchanged between lanes until the final sum (T tokens cost about 2× one token at T = 8,
        not T×);
      - "token" (gathered experts and other K): one token per program, the programs of a row tile side by side
        (the later ones read its weights from L2). With `experts` it gathers: output row s uses the
        `expert_rows`-row block of expert `experts[s]` and input row `s // x_per_slot` (the MoE decode GEMV).
    Both keep a sum per block position of the K tile, added in a fixed pairwise order at the end; the tile depends
    on the matrix only, so a token's result is the same bits at any T (verify = decode) and on either route;
  * `quant_linear_grouped` (in `quant_grouped`): tiles of (token, expert) pairs that share an expert (`group_pairs`
    plans the tiles on the device) through `tl.dot` with bf16 weights (the codes decoded exactly, scaled, rounded to
    x's dtype) and fp32 accumulation, for MoE prefill: one launch per matrix for all experts;
  * `dequantize` (in `quant_dequantize`): the same unpacking into a bf16 `[N, K]` matrix, for the prefill route of
    dense matrices (dequantize to scratch, then cuBLAS; `ninfer.model.packed_linear` picks the route by T).
Runs under TRITON_INTERPRET=1 (fp32 inputs there: the interpreter miscomputes bf16 `tl.dot`).
"""

from __future__ import annotations

import functools

import torch

from ninfer import flags
from ninfer.kernels import tuning
from ninfer.kernels.activation_quant import (
    Int8Activations,
    dequantize_activations,
    quantize_activations,
    quantize_activations_reference,
)
from ninfer.kernels.dependent_launch import launch_options
from ninfer.kernels.groupwise_planes import groupwise_codec, high_row_units, packed_planes
from ninfer.kernels.quant_dequantize import dequantize
from ninfer.kernels.quant_grouped import group_pairs, quant_linear_grouped
from ninfer.quant import codec_for

try:  # Triton is optional: the CPU path never needs it
    import triton
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

if triton is not None:
    from ninfer.kernels.quant_gemv_kernels import (
        BLOCKS_FIRST,
        _gemv_batch_kernel,
        _gemv_batch_pair_kernel,
        _gemv_kernel,
    )

__all__ = ["BATCH_BLOCK_K", "BATCH_TOKENS", "MAX_GEMV_TOKENS", "dequantize", "gemv_block_k", "gemv_route",
           "group_pairs", "quant_linear_gemv", "quant_linear_gemv_pair", "quant_linear_grouped",
           "quant_linear_reference"]

MAX_GEMV_TOKENS = 64  # decode and verify steps of up to this many rows take the per-token routes
# the batch route: a program holds up to BATCH_TOKENS tokens and a few rows, each lane of its one warp a 32-lane
# block of a BATCH_BLOCK_K-lane tile, so that a weight tile is loaded and unpacked once for all its tokens and an x
# record once for all its rows
BATCH_TOKENS = 8
BATCH_BLOCK_K = 1024
INTERPRETED = flags.triton_interpreted()
# dp4a / prmt as inline PTX on NVIDIA GPUs; integer-op emulation under the interpreter and on other backends
ASM = not INTERPRETED and torch.version.hip is None


def quant_linear_reference(x: torch.Tensor, data: torch.Tensor, shape: tuple[int, int], fmt: str,
                           int8_activations: bool = False) -> torch.Tensor:
    weight = codec_for(fmt).decode(data, shape)
    if not int8_activations:
        return x.to(torch.float32) @ weight.T
    lanes = dequantize_activations(quantize_activations_reference(x))[:, : shape[1]]
    return (lanes.double() @ weight.double().T).float()


def _check_features(features: int, k: int) -> None:
    if features != k:
        raise ValueError(f"x has {features} features, the matrix {k}")


def gemv_block_k(k_pad: int, route: str = "token", device: torch.device | str = "cpu") -> int:
    """The integer GEMV's K tile: BATCH_BLOCK_K lanes on the batch route where it divides the padded K (one 32-lane
    block per lane of a warp), else the widest power of two up to the token route's `token_max_block_k` lanes on
    `device` (`tuning`) dividing it. It depends on the matrix, route and GPU only, never on the token count, so that
    every token's result is the same bits at any T."""
    if route == "batch" and k_pad % BATCH_BLOCK_K == 0:
        return BATCH_BLOCK_K
    block_k = tuning.for_device(device).quant_linear.token_max_block_k
    while k_pad % block_k:  # K is padded to 128 lanes: 64 always divides it
        block_k //= 2
    return block_k


def gemv_route(k_pad: int, gathered: bool = False) -> str:
    """The GEMV route a product takes by default: "token" for gathered experts and for K not a multiple of
    BATCH_BLOCK_K, else "batch". It depends on the matrix only (a token's bits do not depend on T)."""
    return "token" if gathered or k_pad % BATCH_BLOCK_K else "batch"


def quant_linear_gemv(x: torch.Tensor | Int8Activations, data: torch.Tensor, shape: tuple[int, int], fmt: str,
                      block_n: int | None = None, block_k: int | None = None, out_dtype: torch.dtype | None = None,
                      experts: torch.Tensor | None = None, expert_rows: int = 0, x_per_slot: int = 1,
                      num_warps: int | None = None, out: torch.Tensor | None = None,
                      route: str | None = None, block_t: int | None = None,
                      depth: int | None = None, unroll: int | None = None, chain: int | None = None,
                      lane_tree: bool | None = None) -> torch.Tensor:
    """The integer GEMV (see the module docstring) of x, a tensor or its `Int8Activations` (quantized once for
    several matrices that read the same input). x has at most MAX_GEMV_TOKENS rows; the result is `[T, N]` in
    `out_dtype` (default fp32), written into `out` when given (a view with unit column stride, such as columns of
    a wider buffer). With `experts` `[S]` (int), W stacks experts of `expert_rows` rows each and the result is
    `[S, expert_rows]`: row s = x[s // x_per_slot] · W_{experts[s]}ᵀ. `route` ("token" or "batch"; default
    `gemv_route`) picks the kernel; both give the same bits at the same K tile. `block_t`: tokens per
    program of the batch route; `depth`, `unroll`: its weight tiles loaded ahead and K tiles per turn of its loop, 1
    or 2 each; `chain`: its `dp4a` per dependent chain, 2, 4 or 8; `lane_tree`: whether its block positions' sums
    meet by exchanging halves between lanes (`_lane_tree_sum`; on one warp only). Each defaults to the row of
    `tuning`'s batch table for the product on this GPU. None of them changes a result's bits."""
    if triton is None:
        raise RuntimeError("the Triton GEMV needs the triton package")
    if not isinstance(x, Int8Activations):  # refused before the quantization's launch: no kernel sees bad input
        groupwise_codec(fmt)
        _check_features(_checked_tokens(x, experts is None).shape[1], shape[1])
    acts = x if isinstance(x, Int8Activations) else quantize_activations(x)
    product = _Product(acts, data, shape, fmt, out, out_dtype, experts, expert_rows)
    route = route or gemv_route(product.k_pad, experts is not None)
    if route not in ("token", "batch"):
        raise ValueError(f"unknown GEMV route {route!r}")
    if route != "token" and experts is not None:
        raise ValueError(f"the {route} route takes whole matrices, not gathered experts")
    block_k = block_k or gemv_block_k(product.k_pad, route, data.device)
    if product.k_pad % block_k:
        raise ValueError(f"block_k {block_k} does not divide the padded K of {product.k_pad}")
    if chain not in (None, 2, 4, 8):
        raise ValueError(f"a dp4a chain holds 2, 4 or 8 products, not {chain}")
    if route == "batch":
        programs, args, constants = product.batch(block_n, block_t, depth, unroll, chain,
                                                  lane_tree if (num_warps or 1) == 1 else False)
        _gemv_batch_kernel[(programs,)](acts.blocks, product.tokens, acts.blocks.shape[1], *args, **constants,
                                        BLOCK_K=block_k, BLOCK_T=block_t or product.tile.block_t, ASM=ASM,
                                        num_warps=num_warps or 1, **launch_options(data.device))
        return product.out
    codec, planes, n, out = product.codec, product.planes, product.n, product.out
    choice = tuning.for_device(data.device).quant_linear
    default_n, default_warps = ((choice.gather_block_n, choice.gather_warps) if experts is not None
                                else (choice.token_block_n, choice.token_warps))
    block_n = block_n or default_n
    slots = out.shape[0]
    grid = (triton.cdiv(n, block_n) * (1 if experts is not None else product.tokens),
            slots if experts is not None else 1)
    _gemv_kernel[grid](acts.blocks, product.base, product.high, product.scales, out,
                       experts if experts is not None else product.base, product.tokens if experts is None else 1, n,
                       product.k_pad, planes[0].row_bytes // 4, high_row_units(codec, planes), product.gpr,
                       acts.blocks.shape[1], out.stride(0), product.bias, BITS=codec.bits, GROUP=codec.group,
                       BLOCK_N=block_n, BLOCK_K=block_k, GATHER=experts is not None, X_PER_SLOT=x_per_slot, ASM=ASM,
                       num_warps=num_warps or default_warps, **launch_options(data.device))
    return out


def quant_linear_gemv_pair(x: Int8Activations, first: tuple, second: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Two integer GEMVs of the same input in one launch (`_gemv_batch_pair_kernel`): `first` and `second` are
    (data, shape, fmt, out) with `out` a `[T, N]` view with unit column stride (or None: fp32 results). Both
    matrices must take the batch route (`gemv_route`); each result has the bits `quant_linear_gemv` gives it
    alone. Returns both results."""
    if triton is None:
        raise RuntimeError("the Triton GEMV needs the triton package")
    products = [_Product(x, data, shape, fmt, out, None, None, 0) for data, shape, fmt, out in (first, second)]
    if any(gemv_route(p.k_pad) != "batch" for p in products):
        raise ValueError("a GEMV pair takes two matrices of the batch route (padded K a multiple of "
                         f"{BATCH_BLOCK_K}), not K = {[p.k_pad for p in products]}")
    block_t = min(p.tile.block_t for p in products)  # one token tile for the launch (it never changes a bit)
    (programs, args, constants), (programs2, args2, constants2) = (p.batch(block_t=block_t) for p in products)
    _gemv_batch_pair_kernel[(programs + programs2,)](
        x.blocks, products[0].tokens, x.blocks.shape[1], programs, *args, *args2, **constants,
        **{name + "2": value for name, value in constants2.items()}, BLOCK_K=BATCH_BLOCK_K,
        BLOCK_T=block_t, ASM=ASM, num_warps=1, **launch_options(x.blocks.device))
    return products[0].out, products[1].out


def _lane_tree_sums() -> bool:
    """Whether the batch route can sum its positions in `_lane_tree_sum` (on one warp): with its shuffles emulated
    under the interpreter, or as `shfl` where Triton puts position p in lane p (checked on the H200 up to Triton
    3.6, `BLOCKS_FIRST`; later versions keep the reduction across lanes)."""
    return INTERPRETED or (ASM and bool(BLOCKS_FIRST))


def _checked_tokens(x: torch.Tensor, whole: bool) -> torch.Tensor:
    if whole and not 1 <= x.shape[0] <= MAX_GEMV_TOKENS:
        raise ValueError(f"the GEMV takes 1..{MAX_GEMV_TOKENS} tokens, not {x.shape[0]}")
    return x


class _Product:
    """One integer GEMV's operands, checked: the matrix's planes, the input records and the output (allocated
    when not given)."""

    def __init__(self, acts: Int8Activations, data: torch.Tensor, shape: tuple[int, int], fmt: str,
                 out: torch.Tensor | None, out_dtype: torch.dtype | None, experts: torch.Tensor | None,
                 expert_rows: int):
        self.codec, self.base, self.high, self.scales, self.planes = packed_planes(data, shape, fmt)
        self.tokens = _checked_tokens(acts.source, experts is None).shape[0]
        self.n, k = shape if experts is None else (expert_rows, shape[1])
        _check_features(acts.shape[1], k)
        self.gpr = self.codec.groups_per_row(k)
        self.k_pad = self.gpr * self.codec.group
        if acts.blocks.shape[1] * 32 < self.k_pad:
            raise ValueError(f"the activation records cover {acts.blocks.shape[1] * 32} lanes, the matrix "
                             f"{self.k_pad}")
        slots = self.tokens if experts is None else experts.numel()
        if out is None:
            out = torch.empty((slots, self.n), dtype=out_dtype or torch.float32, device=data.device)
        elif out.shape != (slots, self.n) or out.stride(1) != 1 or out.device != data.device:
            raise ValueError(f"out must be a [{slots}, {self.n}] view with unit column stride on {data.device}, got "
                             f"{list(out.shape)} strides {out.stride()} on {out.device}")
        self.out = out
        self.bias = 0 if self.codec.bits == 8 else 0x01010101 << (self.codec.bits - 1)  # the code offset per byte
        # the batch route's tile choices go by the token tile a program fills, the next power of two: 5-7 tokens
        # run the 8-token tile (masked rows cost what live ones do), 3 the 4-token one
        self.tile_tokens = 1 << (self.tokens - 1).bit_length()
        self.device = data.device

    @functools.cached_property
    def tile(self) -> tuning.BatchTile:
        """The product's row of the batch route's table on its GPU."""
        return tuning.for_device(self.device).quant_linear.batch_tile(self.tile_tokens, self.codec.bits, self.n,
                                                                      self.k_pad)

    def batch(self, block_n: int | None = None, block_t: int | None = None, depth: int | None = None,
              unroll: int | None = None, chain: int | None = None,
              lane_tree: bool | None = None) -> tuple[int, tuple, dict]:
        """The batch route's launch for this product: (programs, the kernel's per-matrix arguments, its per-matrix
        constants). What is not given comes from the product's row of the batch table; the lane tree only where
        the program holds 32 (token, row) sums."""
        tile = self.tile
        block_n = block_n or tile.block_n
        block_t = block_t or tile.block_t
        # `_load_blocks` reads the high plane as int32 words and the scales as their fp16 bits
        high_words, high_row_words = (self.high.view(torch.int32), self.planes[1].row_bytes // 4) \
            if len(self.planes) == 3 else (self.high, 0)
        programs = triton.cdiv(self.n, block_n) * triton.cdiv(self.tokens, block_t)
        args = (self.base, high_words, self.scales.view(torch.int16), self.out, self.n, self.k_pad,
                self.planes[0].row_bytes // 4, high_row_words, self.gpr, self.out.stride(0), self.bias)
        if lane_tree is None:
            lane_tree = tile.lane_tree and block_n * block_t == 32
        constants = {"BITS": self.codec.bits, "GROUP": self.codec.group, "BLOCK_N": block_n,
                     "DEPTH": depth or tile.depth, "UNROLL": unroll or tile.unroll, "CHAIN": chain or tile.chain,
                     "LANE_TREE": lane_tree and _lane_tree_sums()}
        return programs, args, constants
