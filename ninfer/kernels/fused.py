"""Small fused kernels of the decode step, each replacing a chain of elementwise torch ops (one launch instead of
several: a decode step of a 64-layer model runs a few hundred of them, so launches cost as much as the matrices).

  * `add_rms_norm(x, h, weight, eps)`: s = x + h rounded to x's dtype (the residual add), then the zero-centred
    RMSNorm of s exactly as `ninfer.kernels.norm.rms_norm` (fp32 inside, `x̂ · (1 + w)`, one rounding);
    returns (s, norm(s)). With h None it is only the norm. With `quantize`, norm(s) also comes as the int8
    records of `ninfer.kernels.activation_quant` (for the decode step's integer GEMVs: no separate launch).
  * `silu_mul(gate_up)`: silu(gate) · up of a `[B, 2I]` gate/up projection (gate first), in its dtype — the SwiGLU
    activation as `swiglu_mlp` computes it (silu rounded to the dtype, then the product rounded). With `quantize`,
    also the int8 records of the result (as `add_rms_norm`'s), or with `tiles` the same codes in the tile layout of
    `ninfer.kernels.stripe_linear` (the input of a down projection kept as stripe chunks).
  * `sigmoid_mul(x, gate)`: x · sigmoid(gate) in x's dtype (the attention output gate); with `quantize`, also the
    int8 records of the result.
  * `route_top_k(logits, experts, top_k)`: the MoE routing of `ninfer.kernels.moe.route_top_k` in one launch —
    the top-k of the first `experts` logits (iterated argmax, ties to the lower id, sorted by descending logit)
    and their softmax (= softmax over all experts, top-k, renormalised); weights in the logits' dtype, ids int32.
  * `moe_combine(routed, weights, shared, shared_logit)`: Σ_j weights[b, j] · routed[b, j] + sigmoid(shared_logit[b])
    · shared[b], summed in fp32 and rounded once (the reference adds expert by expert in the activation dtype:
    equal within rounding).
Rows are independent; shapes `[B, D]` with stride 1 on D (row strides free). Under TRITON_INTERPRET=1 they run
on the CPU (tested there in fp32; bf16 conversions in the interpreter truncate).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ninfer.kernels import tuning
from ninfer.kernels.activation_quant import Int8Activations, empty_records, padded_lanes
from ninfer.kernels.dependent_launch import launch_options, wait_for_inputs
from ninfer.kernels.stripe_linear import TileActivations, empty_tiles

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

if triton is not None:
    from ninfer.kernels.activation_quant import store_tile_records
    from ninfer.kernels.stripe_linear import store_tile_x


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, h_ptr, w_ptr, sum_ptr, out_ptr, records_ptr, D, stride_x, stride_h, stride_out,
                             eps, record_count, HAS_H: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK: tl.constexpr,
                             SLICE: tl.constexpr, PDL: tl.constexpr):
        d_slice = tl.program_id(1) * SLICE + tl.arange(0, SLICE)  # the lanes this program writes (SLICE == BLOCK: all)
        ok_slice = d_slice < D
        w = tl.load(w_ptr + d_slice, mask=ok_slice, other=0.0)  # no kernel writes a norm weight: read before the wait
        # every program of a row reduces the whole row (the same bits in each), then writes its SLICE of lanes
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK)
        ok = d < D
        if HAS_H:  # x is the residual, which only earlier kernels write (`add_rms_norm`): read before the wait
            x = tl.load(x_ptr + row * stride_x + d, mask=ok, other=0.0)
            if SLICE != BLOCK:  # this program's lanes, loaded with the row (both loads in flight at once)
                x_slice = tl.load(x_ptr + row * stride_x + d_slice, mask=ok_slice, other=0.0)
        wait_for_inputs(PDL)
        if SLICE != BLOCK:
            if HAS_H:
                h_slice = tl.load(h_ptr + row * stride_h + d_slice, mask=ok_slice, other=0.0)
            else:
                x_slice = tl.load(x_ptr + row * stride_x + d_slice, mask=ok_slice, other=0.0)
        if HAS_H:
            x = (x + tl.load(h_ptr + row * stride_h + d, mask=ok, other=0.0)).to(x_ptr.dtype.element_ty)
        else:
            x = tl.load(x_ptr + row * stride_x + d, mask=ok, other=0.0)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
        if SLICE != BLOCK:  # the slice's sum again (the same bits as in the row)
            d, ok, x = d_slice, ok_slice, x_slice
            if HAS_H:
                x = (x + h_slice).to(x_ptr.dtype.element_ty)
            xf = x.to(tl.float32)
        if HAS_H:
            tl.store(sum_ptr + row * D + d, x, mask=ok)
        y = (xf * rstd * (1.0 + w.to(tl.float32))).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_out + d, y, mask=ok)
        if QUANTIZE:  # the rounded output's int8 records, as `quantize_activations` would make them
            store_tile_records(y, records_ptr, row, record_count, SLICE)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, records_ptr, width, stride_gu, record_count, QUANTIZE: tl.constexpr,
                         TILES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        gate = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0)
        up = tl.load(gu_ptr + row * stride_gu + width + cols, mask=ok, other=0.0)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        y = (silu * up).to(gate.dtype)
        tl.store(out_ptr + row * width + cols, y, mask=ok)
        if QUANTIZE:  # this tile's whole 32-lane blocks (BLOCK is a multiple of 128): their int8 records
            if TILES:  # in the stripe GEMV's tile layout
                store_tile_x(y, records_ptr, row, record_count, BLOCK)
            else:
                store_tile_records(y, records_ptr, row, record_count, BLOCK)

    @triton.jit
    def output_gate(x, g):
        """x · sigmoid(g) as the attention output gate rounds it: the sigmoid in fp32, rounded to x's dtype, then
        the product rounded to it. Shared with the paged-decode kernels that gate their own output (the same
        bits)."""
        sig = (1.0 / (1.0 + tl.exp(-g.to(tl.float32)))).to(x.dtype)
        return (x * sig).to(x.dtype)

    @triton.jit
    def _sigmoid_mul_kernel(x_ptr, gate_ptr, out_ptr, records_ptr, D, stride_x, stride_gate, record_count,
                            QUANTIZE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < D
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        y = output_gate(x, tl.load(gate_ptr + row * stride_gate + cols, mask=ok, other=0.0))
        tl.store(out_ptr + row * D + cols, y, mask=ok)
        if QUANTIZE:  # this tile's whole 32-lane blocks (BLOCK is a multiple of 128): their int8 records
            store_tile_records(y, records_ptr, row, record_count, BLOCK)


    @triton.jit
    def _moe_combine_kernel(routed_ptr, weight_ptr, shared_ptr, logit_ptr, out_ptr, D, stride_weight,
                            stride_shared, stride_logit, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < D
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            w = tl.load(weight_ptr + row * stride_weight + j).to(tl.float32)
            acc += w * tl.load(routed_ptr + (row * TOP_K + j) * D + cols, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(logit_ptr + row * stride_logit).to(tl.float32)
        shared = tl.load(shared_ptr + row * stride_shared + cols, mask=ok, other=0.0).to(tl.float32)
        acc += shared / (1.0 + tl.exp(-g))
        tl.store(out_ptr + row * D + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


    @triton.jit
    def _route_top_k_kernel(logit_ptr, weight_ptr, id_ptr, experts, stride_logit, TOP_K: tl.constexpr,
                            K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
        wait_for_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        values = tl.load(logit_ptr + row * stride_logit + e, mask=e < experts, other=float("-inf")).to(tl.float32)
        k = tl.arange(0, K_PAD)
        top = tl.full((K_PAD,), float("-inf"), dtype=tl.float32)  # padding entries weigh exp(-inf) = 0
        ids = tl.zeros((K_PAD,), dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(values, 0)
            chosen = tl.min(tl.where(values == best, e, BLOCK_E), 0)  # the lowest id among equal logits
            top = tl.where(k == j, best, top)
            ids = tl.where(k == j, chosen, ids)
            values = tl.where(e == chosen, float("-inf"), values)
        weights = tl.exp(top - tl.max(top, 0))
        weights = weights / tl.sum(weights, 0)
        tl.store(weight_ptr + row * TOP_K + k, weights.to(weight_ptr.dtype.element_ty), mask=k < TOP_K)
        tl.store(id_ptr + row * TOP_K + k, ids, mask=k < TOP_K)


# up to this many rows (every decode and verify step: MAX_GEMV_TOKENS) a norm spreads each row over several
# programs; one layout for all of them, so a row's bits do not depend on how many rows the step has
NORM_SPLIT_ROWS = 64


def _check(name: str, *tensors: Tensor) -> None:
    if triton is None:
        raise RuntimeError(f"{name} needs the triton package")
    for t in tensors:
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{name}: expected [B, D] tensors with stride 1 on D, got {list(t.shape)} "
                             f"strides {t.stride()}")


def add_rms_norm(x: Tensor, h: Tensor | None, weight: Tensor, eps: float,
                 quantize: bool = False) -> tuple[Tensor, Tensor | Int8Activations]:
    """(s, rms_norm(s)) with s = x + h (or s = x when h is None); see the module docstring. With `quantize`, the
    norm comes as `Int8Activations` (its int8 records made in the same pass, equal to `quantize_activations`'s).
    Under PDL, with h given, the kernel reads x (the residual) before it waits for the kernel launched before it
    (`kernels.dependent_launch`'s rule): callers must not write x with that kernel (in the runner that kernel
    writes h, the mixer's or the MLP's output, and x comes from the norm before)."""
    _check("add_rms_norm", x, *([h] if h is not None else []))
    rows, width = x.shape
    total = torch.empty((rows, width), dtype=x.dtype, device=x.device) if h is not None else x
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    records = empty_records(rows, width, x.device) if quantize else out
    block = max(triton.next_power_of_2(width), padded_lanes(width) if quantize else 1)
    # few rows (a decode step): each row over several programs of the elementwise block's lanes (`tuning`), each
    # reducing the whole row itself (one launch, no second pass); many rows (prefill): a program per row
    choice = tuning.for_device(x.device).elementwise
    split = rows <= NORM_SPLIT_ROWS and block > choice.block
    slice_ = choice.block if split else block
    _add_rms_norm_kernel[(rows, triton.cdiv(width, slice_))](  # slices are whole 128-lane units: padding covered
        x, h if h is not None else x, weight, total, out, records, width, x.stride(0),
        h.stride(0) if h is not None else 0, out.stride(0), eps, records.shape[1] if quantize else 0,
        HAS_H=h is not None, QUANTIZE=quantize, BLOCK=block, SLICE=slice_,
        num_warps=choice.norm_split_warps if split else max(1, min(16, block // 256)), **launch_options(x.device))
    return total, Int8Activations(out, records) if quantize else out


def silu_mul(gate_up: Tensor, quantize: bool = False,
             tiles: bool = False) -> Tensor | Int8Activations | TileActivations:
    """silu(gate_up[:, :I]) · gate_up[:, I:] → `[B, I]`; with `quantize`, as `Int8Activations` (its int8 records
    made in the same pass, equal to `quantize_activations`'s), or with `tiles` as `TileActivations` (the same codes
    in the stripe GEMV's layout, equal to `quantize_tiles`'s)."""
    _check("silu_mul", gate_up)
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if quantize and tiles:
        records = empty_tiles(rows, inter, out.device)
        count = 2 * records.shape[1]
    else:
        records = empty_records(rows, inter, out.device) if quantize else out
        count = records.shape[1] if quantize else 0
    choice = tuning.for_device(gate_up.device).elementwise
    _silu_mul_kernel[(rows, triton.cdiv(inter, choice.block))](
        gate_up, out, records, inter, gate_up.stride(0), count, QUANTIZE=quantize, TILES=tiles,
        BLOCK=choice.block, num_warps=choice.warps, **launch_options(gate_up.device))
    if not quantize:
        return out
    return TileActivations(out, records) if tiles else Int8Activations(out, records)


def sigmoid_mul(x: Tensor, gate: Tensor, quantize: bool = False) -> Tensor | Int8Activations:
    """x · sigmoid(gate) → `[B, D]` in x's dtype; with `quantize`, as `Int8Activations` (as `silu_mul`'s)."""
    _check("sigmoid_mul", x, gate)
    rows, width = x.shape
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    records = empty_records(rows, width, out.device) if quantize else out
    choice = tuning.for_device(x.device).elementwise
    _sigmoid_mul_kernel[(rows, triton.cdiv(width, choice.block))](
        x, gate, out, records, width, x.stride(0), gate.stride(0), records.shape[1] if quantize else 0,
        QUANTIZE=quantize, BLOCK=choice.block, num_warps=choice.warps, **launch_options(x.device))
    return Int8Activations(out, records) if quantize else out


def moe_combine(routed: Tensor, weights: Tensor, shared: Tensor, shared_logit: Tensor) -> Tensor:
    """routed `[B·k, D]` (pair b·k + j = token b's j-th expert, contiguous), weights `[B, k]`, shared `[B, D]`,
    shared_logit `[B, 1]` (a column view is fine) → `[B, D]` in shared's dtype; see the module docstring."""
    _check("moe_combine", routed, weights, shared)
    rows, width = shared.shape
    top_k = weights.shape[1]
    if routed.shape != (rows * top_k, width) or not routed.is_contiguous():
        raise ValueError(f"moe_combine: routed must be a contiguous [{rows * top_k}, {width}], got "
                         f"{list(routed.shape)}")
    out = torch.empty((rows, width), dtype=shared.dtype, device=shared.device)
    choice = tuning.for_device(shared.device).elementwise
    _moe_combine_kernel[(rows, triton.cdiv(width, choice.block))](
        routed, weights, shared, shared_logit, out, width, weights.stride(0), shared.stride(0), shared_logit.stride(0),
        TOP_K=top_k, BLOCK=choice.block, num_warps=choice.warps, **launch_options(routed.device))
    return out


def route_top_k(logits: Tensor, experts: int, top_k: int) -> tuple[Tensor, Tensor]:
    """logits `[B, ≥ experts]` (the router's output; columns past `experts` ignored) → (weights `[B, top_k]` in
    the logits' dtype, ids `[B, top_k]` int32); see the module docstring."""
    _check("route_top_k", logits)
    rows = logits.shape[0]
    if not 0 < top_k <= experts <= logits.shape[1]:
        raise ValueError(f"route_top_k: top_k {top_k} of {experts} experts does not fit logits {list(logits.shape)}")
    weights = torch.empty((rows, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((rows, top_k), dtype=torch.int32, device=logits.device)
    _route_top_k_kernel[(rows,)](logits, weights, ids, experts, logits.stride(0), TOP_K=top_k,
                                 K_PAD=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(experts),
                                 num_warps=4, **launch_options(logits.device))
    return weights, ids
