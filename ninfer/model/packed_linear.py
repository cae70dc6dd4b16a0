"""A weight matrix of the GPU fast path, kept in its stored format on the device, and y = x · Wᵀ over it.

Routes (chosen by the format, the number of tokens T and what x is):
  * groupwise (q4/q5/q6/q8), x given as `Int8Activations` (`shared_input`: decode and verify steps, T ≤ 64): the
    integer Triton GEMV, which reads the packed planes once (the batch route: each weight tile unpacked once
    for up to 8 tokens; a token's bits do not depend on T);
    an input read by several matrices is quantized once, and two of them on the batch route share one launch
    (`project`);
  * q5 matrices with long rows (`stripes_fit`: the dense MLP's down projection) are repacked at load into stripe
    chunks (`ninfer.kernels.stripe_linear`): their decode and verify steps take the stripe GEMV over x's tiles
    (`TileActivations`, which `silu_mul` writes), where 8 tokens cost about what one token costs;
  * groupwise, x a tensor (prefill, any T): dequantize into a shared scratch buffer, then cuBLAS (the matmul
    dominates); stacked MoE experts go through the grouped kernel in one launch;
  * fp8 rows: the FP8 GEMV for T ≤ 16 (its cost grows with T: one token per program), rows decoded into the
    scratch buffer then cuBLAS beyond;
  * bf16: the dense GEMV for T ≤ 64 and small matrices (a token's result independent of T), cuBLAS for the rest
    (fp32 artifacts are converted to the activation dtype at load).
The output has x's dtype unless asked otherwise; MoE experts go through `gather`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.kernels.activation_quant import Int8Activations, quantize_activations
from ninfer.kernels.dense_linear import dense_linear_gemv
from ninfer.kernels.fp8_linear import FORMAT as FP8_FORMAT
from ninfer.kernels.fp8_linear import MAX_TOKENS as FP8_GEMV_TOKENS
from ninfer.kernels.fp8_linear import fp8_block, fp8_linear_gemv, fp8_rows
from ninfer.kernels.quant_linear import (
    MAX_GEMV_TOKENS,
    dequantize,
    gemv_route,
    quant_linear_gemv,
    quant_linear_gemv_pair,
    quant_linear_grouped,
)
from ninfer.kernels.stripe_linear import (
    TileActivations,
    dequantize_stripes,
    quantize_tiles,
    repack,
    stripe_gemv,
    stripes_fit,
)
from ninfer.quant import codec_for
from ninfer.quant.groupwise import GroupwiseCodec


def is_groupwise(fmt: str) -> bool:
    return isinstance(codec_for(fmt), GroupwiseCodec)


def is_packed(fmt: str) -> bool:
    """Whether matrices of `fmt` stay in their stored bytes on this path (groupwise and FP8 rows)."""
    return is_groupwise(fmt) or fmt == FP8_FORMAT


Activations = torch.Tensor | Int8Activations | TileActivations


def shared_input(x: Activations, readers: list[PackedLinear]) -> Activations:
    """x prepared once for the matrices `readers` that all multiply it: its int8 image when some of them will take
    the integer GEMV (T ≤ MAX_GEMV_TOKENS and groupwise), else x. An input that comes quantized
    (`add_rms_norm(quantize=True)`, `silu_mul(tiles=True)`) is passed on."""
    if isinstance(x, Int8Activations | TileActivations):
        return x
    if x.shape[0] <= MAX_GEMV_TOKENS and any(reader.groupwise for reader in readers):
        return quantize_activations(x)
    return x


# steps of up to this many tokens run two GEMVs of one input in one launch (`project`); measured on the H200 at 1
# and 8 tokens (docs/optimizations.md)
PAIRED_GEMV_TOKENS = 8


def shares_launch(x: torch.Tensor | Int8Activations, first: PackedLinear, second: PackedLinear) -> bool:
    """Whether `project` runs x through `first` and `second` in one launch (`quant_linear_gemv_pair`)."""
    return isinstance(x, Int8Activations) and x.shape[0] <= PAIRED_GEMV_TOKENS and first.batch_route \
        and second.batch_route


def project(x: torch.Tensor | Int8Activations, readers: list[PackedLinear],
            outs: list[torch.Tensor | None] | None = None, out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """x through each of `readers` (into `outs[i]` where given, as `PackedLinear.__call__`). In a step of up to
    PAIRED_GEMV_TOKENS tokens, consecutive readers that both take the integer GEMV's batch route share one launch
    (`quant_linear_gemv_pair`): neither waits for the other to finish, and the results have the bits of separate
    calls. As two launches in two graph branches, the smaller product (q|k) queued behind the larger one's programs
    and ended after it (27B, 8 tokens); the pair's kernel holds the registers of the larger of its two (v|z at 8
    tokens: 242 alone, 244 paired), which costs q|k less than that wait (docs/optimizations.md)."""
    outs = outs or [None] * len(readers)
    results: list[torch.Tensor] = []
    i = 0
    while i < len(readers):
        pair = readers[i : i + 2]
        if len(pair) == 2 and shares_launch(x, *pair):
            targets = [out if out is not None else
                       torch.empty((x.shape[0], r.shape[0]), dtype=out_dtype or x.source.dtype, device=x.blocks.device)
                       for r, out in zip(pair, outs[i : i + 2], strict=True)]
            results += quant_linear_gemv_pair(x, *((r.data, r.shape, r.format, t)
                                                   for r, t in zip(pair, targets, strict=True)))
            i += 2
        else:
            results.append(readers[i](x, out_dtype=out_dtype, out=outs[i]))
            i += 1
    return results


def _source(x: Activations) -> torch.Tensor:
    """The activations themselves (for the routes that do not take int8 records)."""
    return x.source if isinstance(x, Int8Activations | TileActivations) else x


class Scratch:
    """One growable buffer in the activation dtype shared by every prefill dequantization (one matrix is live at a
    time); the activation dtype is also what non-packed weights are kept in."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device = device
        self.dtype = dtype
        self.buffer = torch.empty(0, dtype=dtype, device=device)

    def get(self, elements: int) -> torch.Tensor:
        if self.buffer.numel() < elements:
            self.buffer = torch.empty(elements, dtype=self.dtype, device=self.device)
        return self.buffer


# bf16 matrices up to this size take the per-token dense GEMV in decode steps: the small ones of a packed artifact
# (the 27B's a/b projection has 0.5 M elements); a bf16 artifact's projections would be read once per token
DENSE_GEMV_MAX_ELEMENTS = 1 << 22


class PackedLinear:
    """W `[N, K]` (`shape`) stored as `data` in `fmt` on the device. `whole`: W is only ever multiplied or decoded
    whole (not stacked experts nor a table of rows), so it may be kept as stripe chunks."""

    def __init__(self, data: torch.Tensor, shape: tuple[int, int], fmt: str, scratch: Scratch, whole: bool = True):
        self.shape = (int(shape[0]), int(shape[1]))
        self.format = fmt
        self.scratch = scratch
        self.groupwise = is_groupwise(fmt)
        self.packed = is_packed(fmt)
        # kept as stripe chunks (`data` then holds the chunks: the stripe GEMV and its dequantizer read it)
        self.stripes = whole and stripes_fit(self.shape, fmt, data.device)
        # whether the integer GEMV takes this matrix on its batch route (any number of tokens)
        self.batch_route = self.groupwise and not self.stripes and gemv_route(
            codec_for(fmt).groups_per_row(self.shape[1]) * codec_for(fmt).group) == "batch"
        if self.stripes:
            self.data = repack(data, self.shape)
            self.weight = None
        elif self.packed:
            self.data = data
            self.weight = None
        else:
            self.data = None
            self.weight = codec_for(fmt).decode(data, self.shape).to(scratch.dtype)

    @property
    def nbytes(self) -> int:
        tensor = self.data if self.packed else self.weight
        return tensor.numel() * tensor.element_size()

    def __call__(self, x: Activations, out_dtype: torch.dtype | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """x `[T, K]` (or its `shared_input`) → `[T, N]` in `out_dtype` (default x's dtype). With `out` (a `[T, N]`
        view with unit column stride: columns of a buffer that several products fill) the result goes there —
        written by the integer GEMV itself, copied from the other routes."""
        source = _source(x)
        out_dtype = out.dtype if out is not None else out_dtype or source.dtype
        route = self.route(x)
        if route == "stripes":
            tiles = x if isinstance(x, TileActivations) else quantize_tiles(source)
            return stripe_gemv(tiles, self.data, self.shape, out_dtype=out_dtype, out=out)
        if route == "integer":
            return quant_linear_gemv(x, self.data, self.shape, self.format, out_dtype=out_dtype, out=out)
        if route == "dense":
            result = dense_linear_gemv(source.to(self.weight.dtype), self.weight, out_dtype=out_dtype)
        elif route == "cublas":
            result = F.linear(source.to(self.weight.dtype), self.weight).to(out_dtype)
        elif route == "fp8":
            result = fp8_linear_gemv(source, self.data, self.shape, out_dtype=out_dtype)
        else:
            weight = self._decoded(0, self.shape[0])
            result = F.linear(source.to(weight.dtype), weight).to(out_dtype)
        return result if out is None else out.copy_(result)

    def route(self, x: Activations) -> str:
        """The kernel that takes x's product: "stripes" (W kept as stripe chunks, x's int8 image: the stripe GEMV,
        from x's tiles, made here from x if x came as records), "integer" (groupwise W, int8 records: the integer
        GEMV), "dense" (a small plain W: a result per token whatever T, where cuBLAS picks its kernel by T — GDN a/b,
        routers), "cublas" (a large plain W, a bf16 artifact's projections, read once for all tokens), "fp8" (the
        FP8 GEMV, up to FP8_GEMV_TOKENS rows) or "scratch" (W decoded into the shared scratch buffer, then cuBLAS: no
        other product that does so may run beside it, `Branches`)."""
        if isinstance(x, TileActivations):
            if not self.stripes:
                raise ValueError("x's tiles are for a matrix kept as stripe chunks")
            return "stripes"
        if isinstance(x, Int8Activations) and self.groupwise:
            return "stripes" if self.stripes else "integer"
        rows = _source(x).shape[0]
        if not self.packed:
            return "dense" if rows <= MAX_GEMV_TOKENS and self.weight.numel() <= DENSE_GEMV_MAX_ELEMENTS else "cublas"
        return "fp8" if rows <= FP8_GEMV_TOKENS and not self.groupwise else "scratch"

    def _decoded(self, first_row: int, rows: int) -> torch.Tensor:
        """W[first_row : first_row + rows] in the activation dtype, in the scratch buffer."""
        k = self.shape[1]
        scratch = self.scratch.get(rows * k)
        if not self.groupwise:
            return fp8_block(self.data, self.shape, first_row, rows, scratch)
        index = None
        if (first_row, rows) != (0, self.shape[0]):
            self._whole_only("a block of rows")
            index = torch.arange(first_row, first_row + rows, device=self.data.device, dtype=torch.int32)
        if self.stripes:
            return dequantize_stripes(self.data, self.shape, self.scratch.dtype, out=scratch)
        return dequantize(self.data, self.shape, self.format, self.scratch.dtype, out=scratch, rows=index)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of W in the activation dtype `[R, K]` (an embedding lookup)."""
        if not self.packed:
            return self.weight[index]
        if not self.groupwise:
            return fp8_rows(self.data, self.shape, index, self.scratch.dtype)
        self._whole_only("rows by index")
        return dequantize(self.data, self.shape, self.format, self.scratch.dtype, rows=index)

    def gather(self, x: torch.Tensor | Int8Activations, experts: torch.Tensor, expert_rows: int,
               x_per_slot: int) -> torch.Tensor:
        """W stacks experts of `expert_rows` rows: row s of the result is x[s // x_per_slot] · W_{experts[s]}ᵀ."""
        self._whole_only("gathered experts")
        if self.groupwise:
            return quant_linear_gemv(x, self.data, self.shape, self.format, out_dtype=_source(x).dtype,
                                     experts=experts, expert_rows=expert_rows, x_per_slot=x_per_slot)
        x = _source(x)
        if not self.packed:
            stacked = self.weight.view(-1, expert_rows, self.shape[1])[experts]  # [S, rows, K]
            inputs = x.repeat_interleave(x_per_slot, dim=0) if x_per_slot > 1 else x
            return torch.bmm(stacked, inputs.to(stacked.dtype)[:, :, None])[:, :, 0].to(x.dtype)
        return fp8_linear_gemv(x, self.data, self.shape, out_dtype=x.dtype, experts=experts, expert_rows=expert_rows,
                               x_per_slot=x_per_slot)

    def grouped(self, x: torch.Tensor, plan: tuple[torch.Tensor, torch.Tensor], pairs: int, expert_rows: int,
                x_per_pair: int) -> torch.Tensor:
        """Packed stacked experts: row p of the result is x[p // x_per_pair] · W_{expert of pair p}ᵀ, the pairs
        tiled by `group_pairs` (MoE prefill, one launch)."""
        self._whole_only("grouped experts")
        return quant_linear_grouped(x, self.data, self.shape, self.format, plan, pairs, expert_rows, x_per_pair,
                                    block=plan[1].numel() // plan[0].numel())

    def block(self, x: torch.Tensor, first_row: int, rows: int) -> torch.Tensor:
        """x · W[first_row : first_row + rows]ᵀ for many tokens (one expert's block in a prefill)."""
        if not self.packed:
            return F.linear(x, self.weight[first_row : first_row + rows])
        weight = self._decoded(first_row, rows)
        return F.linear(x.to(weight.dtype), weight).to(x.dtype)

    def _whole_only(self, what: str) -> None:
        """Stripe chunks serve whole-matrix products and their decoding only."""
        if self.stripes:
            raise ValueError(f"a matrix kept as stripe chunks ({list(self.shape)}) has no route for {what}")
