"""Decode step of the full-attention layers over a paged KV cache: q/k norm + RoPE, the cache write, attention.

Cache layout (one pool per attention layer):
  * `key_pages`, `value_pages` `[P, PAGE, kvh, hd]`: P pages of PAGE positions (a power of two, e.g. 16 or 64);
    dtype bf16 (or any float dtype: stored as is), int8 (kv dtype "int8") or torch.float8_e4m3fn ("fp8").
  * int8/fp8: `key_scales`, `value_scales` `[P, PAGE, kvh, hd // 64]` fp16, one scale per 64 consecutive dims of
    one head at one position: x ≈ code · scale. int8: scale = fp16(amax / 127), code = round-half-even(x / scale)
    clamped to ±127; fp8: scale = fp16(amax / 448), code = e4m3(clamp(x / scale, ±448)), round-half-even. The
    code divides by the fp16-rounded scale (so |x − code · scale| ≤ scale / 2 for int8); an all-zero group has
    scale 0 and zero codes. None for float pages.
  * `block_table` `[B, max_pages]` int32: position p of sequence b lives at page block_table[b, p // PAGE], row
    p % PAGE. Slots past a sequence's length are never read.
  * head_dim: a power of two, at least 64 (Qwen3.5: 256).

Operations, each a Triton kernel with a pure-torch oracle:
  * `qk_norm_rope`: zero-centred RMSNorm of every q and k head, then partial NeoX RoPE (text positions).
  * `write_kv` (oracle `write_kv_reference`): store (quantising) one new k/v per sequence.
  * `paged_attention_decode` (oracle `paged_attention_reference`): one query per sequence over its cache,
    flash-decoding — programs over (sequence, kv head, split of the positions) with an online softmax, the query
    heads of one kv head (the GQA group) as one tile, int8/fp8 tiles dequantised in registers; a second kernel
    merges the splits by log-sum-exp. Nothing reads `lengths` on the host and every allocation is sized from host
    ints, so a decode step can be captured in a CUDA graph. With a `gate`, the kernel that writes the output (the
    merge, or the decode kernel when there is one split) also applies the attention output gate of
    `fused.sigmoid_mul`, and with `quantize` makes the int8 records of the gated output: no launch of its own.
Under TRITON_INTERPRET=1 the kernels run on the CPU (fp32 activations there: the interpreter miscomputes bf16
`tl.dot` and rounds fp32 → bf16 imprecisely).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ninfer.kernels import tuning
from ninfer.kernels.activation_quant import LANE_PAD, Int8Activations, empty_records
from ninfer.kernels.attention import causal_attention
from ninfer.kernels.dependent_launch import launch_options, wait_for_inputs
from ninfer.kernels.fp8_linear import e4m3_to_fp32
from ninfer.kernels.fused import sigmoid_mul

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

if triton is not None:
    from ninfer.kernels.activation_quant import store_records
    from ninfer.kernels.fused import output_gate

SCALE_GROUP = 64  # dims per int8/fp8 scale
CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
CPU_PROGRAMS = 8  # programs the split plan aims for without a GPU (the interpreter runs them one by one)
_QUANT_MODE = {torch.int8: 1, torch.float8_e4m3fn: 2}  # kernels' QUANT: 0 = float pages


def quantize_kv_reference(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Codes and scales of x `[..., hd]` (hd a multiple of 64) in `dtype` (torch.int8 or torch.float8_e4m3fn) as
    the module docstring defines them: codes `[..., hd]` of `dtype`, scales `[..., hd // 64]` fp16."""
    if dtype not in CODE_MAX:
        raise ValueError(f"quantize_kv_reference: kv dtype must be int8 or float8_e4m3fn, got {dtype}")
    code_max = CODE_MAX[dtype]
    groups = x.float().unflatten(-1, (-1, SCALE_GROUP))
    scales = (groups.abs().amax(-1) / code_max).to(torch.float16)
    scale = scales.float()[..., None]
    y = torch.where(scale > 0, groups / scale, 0.0).clamp(-code_max, code_max)
    codes = y.round().to(torch.int8) if dtype == torch.int8 else y.to(dtype)
    return codes.flatten(-2), scales


def dequantize_kv(codes: Tensor, scales: Tensor | None, dtype: torch.dtype) -> Tensor:
    """x̂ = code · scale (exact in fp32), cast to `dtype`; float codes without scales are just cast."""
    if scales is None:
        return codes.to(dtype)
    x = codes.float().unflatten(-1, (-1, SCALE_GROUP)) * scales.float()[..., None]
    return x.flatten(-2).to(dtype)


def _cache_mode(key_pages: Tensor, value_pages: Tensor, key_scales: Tensor | None, value_scales: Tensor | None) -> int:
    """Checks the pool against the layout of the module docstring; returns the kernels' QUANT mode."""
    if key_pages.dim() != 4 or key_pages.shape != value_pages.shape or key_pages.dtype != value_pages.dtype:
        raise ValueError(f"paged KV cache: key/value pages must be equal [P, PAGE, kvh, hd] tensors, got "
                         f"{list(key_pages.shape)} {key_pages.dtype} and {list(value_pages.shape)} {value_pages.dtype}")
    page, hd = key_pages.shape[1], key_pages.shape[3]
    if page & (page - 1) or hd < SCALE_GROUP or hd & (hd - 1):
        raise ValueError(f"paged KV cache: PAGE ({page}) must be a power of two and head_dim ({hd}) a power of two "
                         f"≥ {SCALE_GROUP}")
    if key_pages.stride() != value_pages.stride() or key_pages.stride(-1) != 1:
        raise ValueError("paged KV cache: key and value pages need the same strides, with stride 1 on head_dim")
    mode = _QUANT_MODE.get(key_pages.dtype, 0)
    if mode == 0 and not key_pages.dtype.is_floating_point:
        raise ValueError(f"paged KV cache: unsupported page dtype {key_pages.dtype} (float, int8 or float8_e4m3fn)")
    if mode == 0 and (key_scales is not None or value_scales is not None):
        raise ValueError(f"paged KV cache: {key_pages.dtype} pages take no scales")
    if mode:
        scale_shape = (*key_pages.shape[:3], hd // SCALE_GROUP)
        for name, scales in (("key_scales", key_scales), ("value_scales", value_scales)):
            if scales is None or scales.shape != scale_shape or scales.dtype != torch.float16:
                got = None if scales is None else f"{list(scales.shape)} {scales.dtype}"
                raise ValueError(f"paged KV cache: {key_pages.dtype} pages need {name} {list(scale_shape)} fp16, "
                                 f"got {got}")
        if key_scales.stride() != value_scales.stride() or key_scales.stride(-1) != 1:
            raise ValueError("paged KV cache: key and value scales need the same strides, with stride 1 last")
    return mode


def _slots(block_table: Tensor, positions: Tensor, page: int) -> tuple[Tensor, Tensor]:
    """(page id, row) of position positions[b] of each sequence b."""
    rows = torch.arange(block_table.shape[0], device=block_table.device)
    positions = positions.to(torch.long)
    return block_table[rows, positions // page].long(), positions % page


def write_kv_reference(k: Tensor, v: Tensor, key_pages: Tensor, value_pages: Tensor, key_scales: Tensor | None,
                       value_scales: Tensor | None, block_table: Tensor, positions: Tensor) -> None:
    """The torch oracle of `write_kv` (same contract)."""
    _cache_mode(key_pages, value_pages, key_scales, value_scales)
    pages, rows = _slots(block_table, positions, key_pages.shape[1])
    for x, pool, scales in ((k, key_pages, key_scales), (v, value_pages, value_scales)):
        if scales is None:
            pool[pages, rows] = x.to(pool.dtype)
        else:
            pool[pages, rows], scales[pages, rows] = quantize_kv_reference(x, pool.dtype)


def paged_attention_reference(q: Tensor, key_pages: Tensor, value_pages: Tensor, key_scales: Tensor | None,
                              value_scales: Tensor | None, block_table: Tensor, lengths: Tensor, scale: float,
                              max_length: int | None = None) -> Tensor:
    """The torch oracle of `paged_attention_decode` (same contract): gathers each sequence's pages into a dense
    cache, dequantised to q's dtype, and runs `causal_attention` with the query at the last position. Reads
    `lengths` on the host; `max_length` is accepted for the signature and ignored."""
    _cache_mode(key_pages, value_pages, key_scales, value_scales)
    page = key_pages.shape[1]
    out = torch.empty_like(q)
    for b, length in enumerate(lengths.tolist()):
        positions = torch.arange(length, device=q.device)
        pages, rows = block_table[b, positions // page].long(), positions % page
        k = dequantize_kv(key_pages[pages, rows], None if key_scales is None else key_scales[pages, rows], q.dtype)
        v = dequantize_kv(value_pages[pages, rows], None if value_scales is None else value_scales[pages, rows],
                          q.dtype)
        out[b] = causal_attention(q[b : b + 1], k, v, length - 1, scale)[0]
    return out


def decode_split_plan(kv_heads: int, max_length: int, device: torch.device) -> int:
    """Splits of `paged_attention_decode`, from host ints only: enough programs for `waves` waves over the GPU's
    SMs (CPU_PROGRAMS without one) for one sequence, at most `max_splits`, and no more than `max_length` has tiles
    of `block_positions` (`tuning.AttentionTuning`; each sequence then divides its own length among the splits on
    the device). Not a
    function of the batch: a query's result is the same bits whatever rows share the call (a verify step's rows
    equal the decode steps'; greedy output does not depend on what else is batched)."""
    device = torch.device(device)
    choice = tuning.for_device(device).attention
    blocks = max(1, -(-max_length // choice.block_positions))
    target = choice.waves * _sm_count(device.index or 0) if device.type == "cuda" else CPU_PROGRAMS
    return max(1, min(-(-target // kv_heads), choice.max_splits, blocks))


@functools.lru_cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


if triton is not None:

    @triton.jit
    def _reduce_angle(angle):
        """angle − 2π · round(angle / 2π), in [-π, π]: Cody-Waite with 2π split into 8-bit, 8-bit and fp32 parts,
        so the first two products are exact below 2^16 turns (~411k radians: position 411k at inv_freq 1); the
        result does not depend on how the backend's cos/sin reduce large arguments."""
        turns = tl.floor(angle * 0.15915494309189535 + 0.5)
        r = angle - turns * 6.28125
        r = r - turns * 0.00193023681640625
        return r - turns * 5.070363386039389e-06

    @triton.jit
    def _qk_norm_rope_kernel(qk_ptr, q_norm_ptr, k_norm_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_ptr, stride_row,
                             heads, kv_heads, eps, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, PDL: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, HEAD_DIM)
        half: tl.constexpr = ROTARY // 2
        rotated = d < ROTARY
        partner = tl.where(d < half, d + half, d - half)
        row = qk_ptr + b.to(tl.int64) * stride_row + h * HEAD_DIM
        if h < heads:
            weight_ptr = q_norm_ptr
            out = q_ptr + (b * heads + h) * HEAD_DIM
        else:
            weight_ptr = k_norm_ptr
            out = k_ptr + (b * kv_heads + h - heads) * HEAD_DIM
        # what the kernel before does not write, read before waiting for it (`qk_norm_rope`: why)
        scale = 1.0 + tl.load(weight_ptr + d).to(tl.float32)
        scale_partner = 1.0 + tl.load(weight_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
        angle = tl.load(pos_ptr + b).to(tl.float32) * tl.load(inv_freq_ptr + d % half, mask=rotated, other=0.0)
        angle = _reduce_angle(angle)
        wait_for_inputs(PDL)
        x = tl.load(row + d).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / HEAD_DIM + eps)
        y = x * rstd * scale
        x_partner = tl.load(row + partner, mask=rotated, other=0.0).to(tl.float32)
        y_partner = x_partner * rstd * scale_partner
        y_rot = y * tl.cos(angle) + tl.where(d < half, -y_partner, y_partner) * tl.sin(angle)
        tl.store(out + d, tl.where(rotated, y_rot, y).to(q_ptr.dtype.element_ty))


def qk_norm_rope(query_key: Tensor, q_norm: Tensor, k_norm: Tensor, positions: Tensor, heads: int, kv_heads: int,
                 head_dim: int, rotary_dim: int, inv_freq: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """q and k of one token per sequence: `apply_rope(rms_norm(x, w, eps), cos, sin)` per head.

    Math: per head, `x̂ = x · rsqrt(mean(x²) + eps) · (1 + w)` (w = q_norm for the q heads, k_norm for the k heads),
    then dims i < rotary_dim/2 and i + rotary_dim/2 rotate by `angle = float(position) · inv_freq[i]`
    (partial NeoX RoPE; dims ≥ rotary_dim pass through). All in fp32 with one final rounding — the reference
    (`rms_norm`, `rope_cos_sin(..., dtype=x.dtype)`, `apply_rope`) rounds the normed x and cos/sin to x's dtype
    first, so bf16 results may differ by an ulp or so.

    Shapes: query_key `[B, (heads + kv_heads) · head_dim]` (the query_key projection: q heads, then k heads; any
    row stride, stride 1 along a row); q_norm, k_norm `[head_dim]`; positions `[B]` integer (text positions: the
    three MRoPE rows equal); inv_freq `[rotary_dim / 2]` fp32 = 1 / theta^(2j / rotary_dim). head_dim a power of
    two, rotary_dim even and ≤ head_dim. Returns q `[B, heads, head_dim]`, k `[B, kv_heads, head_dim]` (contiguous,
    query_key's dtype).

    Under PDL the kernel reads the norm weights, `inv_freq` and `positions` before it waits for the kernel before it
    (`kernels.dependent_launch`'s rule): no kernel writes the first two, and a caller must not write `positions` with
    a PDL kernel launched right before this function (the runner's is a projection GEMV).
    """
    if triton is None:
        raise RuntimeError("qk_norm_rope needs the triton package")
    batch = query_key.shape[0]
    if query_key.dim() != 2 or query_key.shape[1] != (heads + kv_heads) * head_dim or query_key.stride(1) != 1:
        raise ValueError(f"qk_norm_rope: query_key {list(query_key.shape)} (strides {query_key.stride()}) is not "
                         f"[B, {(heads + kv_heads) * head_dim}] with stride 1 along rows")
    if head_dim & (head_dim - 1) or rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"qk_norm_rope: head_dim {head_dim} must be a power of two and rotary_dim {rotary_dim} "
                         f"even, in 2..head_dim")
    if q_norm.shape != (head_dim,) or k_norm.shape != (head_dim,) or q_norm.dtype != k_norm.dtype:
        raise ValueError(f"qk_norm_rope: q_norm {list(q_norm.shape)} {q_norm.dtype} and k_norm {list(k_norm.shape)} "
                         f"{k_norm.dtype} must both be [{head_dim}] of one dtype")
    if inv_freq.shape != (rotary_dim // 2,) or positions.shape != (batch,):
        raise ValueError(f"qk_norm_rope: inv_freq {list(inv_freq.shape)} or positions {list(positions.shape)} does "
                         f"not fit rotary_dim {rotary_dim}, B {batch}")
    q = torch.empty((batch, heads, head_dim), dtype=query_key.dtype, device=query_key.device)
    k = torch.empty((batch, kv_heads, head_dim), dtype=query_key.dtype, device=query_key.device)
    _qk_norm_rope_kernel[(batch, heads + kv_heads)](
        query_key, q_norm, k_norm, positions, inv_freq.float().contiguous(), q, k, query_key.stride(0), heads,
        kv_heads, eps, HEAD_DIM=head_dim, ROTARY=rotary_dim,
        num_warps=tuning.for_device(query_key.device).attention.rope_warps, **launch_options(query_key.device))
    return q, k


if triton is not None:

    @triton.jit
    def _shift_right_rtne(m, shift):
        """round-half-even(m / 2^shift) for int32 m ≥ 0 and shift ≥ 1 (shift ≥ 25 gives 0 for 24-bit m)."""
        shift = tl.minimum(shift, 31)
        q = m >> shift
        rest = m - (q << shift)
        half = 1 << (shift - 1)
        return q + ((rest > half) | ((rest == half) & ((q & 1) == 1))).to(tl.int32)

    @triton.jit
    def _significand_exponent(a):
        """(m, e) with a = m · 2^(e − 150) for fp32 a ≥ 0: m the 24-bit significand, e the biased exponent ≥ 1."""
        bits = a.to(tl.int32, bitcast=True)
        e = bits >> 23
        m = (bits & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
        return m, tl.maximum(e, 1)

    @triton.jit
    def _store_head(src, pages, scales, QUANT: tl.constexpr, CODE_MAX: tl.constexpr, GROUPS: tl.constexpr):
        """Store one head vector at `pages` (its row of the pool), quantised per 64 dims when QUANT; integer
        rounding so that the interpreter and the GPU give the bits of `quantize_kv_reference`."""
        g = tl.arange(0, GROUPS)
        lanes = tl.arange(0, 64)
        offs = g[:, None] * 64 + lanes[None, :]
        x = tl.load(src + offs)
        if QUANT == 0:
            tl.store(pages + offs, x.to(pages.dtype.element_ty))
        else:
            x = x.to(tl.float32)
            scale = tl.div_rn(tl.max(tl.abs(x), 1), CODE_MAX).to(tl.float16)
            scale32 = scale.to(tl.float32)
            safe = tl.where(scale32 > 0, scale32, 1.0)
            y = tl.where(scale32[:, None] > 0, tl.div_rn(x, safe[:, None]), 0.0)
            y = tl.minimum(tl.maximum(y, -CODE_MAX), CODE_MAX)
            negative = y.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 gives e4m3 -0, as torch does
            m, e = _significand_exponent(tl.abs(y))
            if QUANT == 1:
                magnitude = _shift_right_rtne(m, 150 - e)
                tl.store(pages + offs, tl.where(negative, -magnitude, magnitude).to(tl.int8))
            else:  # e4m3: 3 mantissa bits from 2^-6 up (code (e − 120) · 8 + mantissa), steps of 2^-9 below
                magnitude = _shift_right_rtne(m, tl.maximum(141 - e, 20)) + tl.maximum(e - 121, 0) * 8
                tl.store(pages + offs, (magnitude | tl.where(negative, 128, 0)).to(tl.uint8))
            tl.store(scales + g, scale)

    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, key_pages, value_pages, key_scales, value_scales, table_ptr, pos_ptr,
                         stride_kb, stride_kh, stride_vb, stride_vh, stride_table, stride_page, stride_row,
                         stride_head, scale_stride_page, scale_stride_row, scale_stride_head,
                         PAGE: tl.constexpr, GROUPS: tl.constexpr, QUANT: tl.constexpr, CODE_MAX: tl.constexpr,
                         PDL: tl.constexpr):
        wait_for_inputs(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        position = tl.load(pos_ptr + b)
        page = tl.load(table_ptr + b * stride_table + position // PAGE).to(tl.int64)
        row = position % PAGE
        slot = page * stride_page + row * stride_row + h * stride_head
        scale_slot = page * scale_stride_page + row * scale_stride_row + h * scale_stride_head
        _store_head(k_ptr + b * stride_kb + h * stride_kh, key_pages + slot, key_scales + scale_slot, QUANT,
                    CODE_MAX, GROUPS)
        _store_head(v_ptr + b * stride_vb + h * stride_vh, value_pages + slot, value_scales + scale_slot, QUANT,
                    CODE_MAX, GROUPS)


def write_kv(k: Tensor, v: Tensor, key_pages: Tensor, value_pages: Tensor, key_scales: Tensor | None,
             value_scales: Tensor | None, block_table: Tensor, positions: Tensor) -> None:
    """Store the new key and value of each sequence b at position positions[b] of its pages (see the module
    docstring), quantised for int8/fp8 pages (with their scales) and cast for float pages; nothing else changes.

    Shapes: k, v `[B, kvh, hd]` in a float dtype, any strides on B and the heads, stride 1 on hd (v may be a view
    into the gate_value projection); block_table `[B, max_pages]` int32; positions `[B]` integer, each
    < max_pages · PAGE with its page already in the block table. Sequences must write distinct slots.
    """
    if triton is None:
        raise RuntimeError("write_kv needs the triton package")
    mode = _cache_mode(key_pages, value_pages, key_scales, value_scales)
    batch, kv_heads, head_dim = k.shape
    if v.shape != k.shape or key_pages.shape[2:] != (kv_heads, head_dim) or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"write_kv: k {list(k.shape)} and v {list(v.shape)} (stride 1 last) must be [B, kvh, hd] "
                         f"of the pages {list(key_pages.shape)}")
    if block_table.shape[0] != batch or positions.shape != (batch,):
        raise ValueError(f"write_kv: block_table {list(block_table.shape)} and positions {list(positions.shape)} "
                         f"must have B = {batch} rows")
    pages = key_pages.view(torch.uint8) if mode == 2 else key_pages  # e4m3 bits are composed in the kernel
    value_pool = value_pages.view(torch.uint8) if mode == 2 else value_pages
    scales = (key_scales, value_scales) if mode else (key_pages, value_pages)  # unused pointers when float pages
    scale_strides = key_scales.stride()[:3] if mode else (0, 0, 0)
    _write_kv_kernel[(batch, kv_heads)](
        k, v, pages, value_pool, *scales, block_table, positions, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), block_table.stride(0), *key_pages.stride()[:3], *scale_strides, PAGE=key_pages.shape[1],
        GROUPS=head_dim // SCALE_GROUP, QUANT=mode, CODE_MAX=CODE_MAX.get(key_pages.dtype, 0.0),
        num_warps=tuning.for_device(k.device).attention.write_warps,
        **launch_options(k.device))


if triton is not None:

    @triton.jit
    def _load_kv_tile(pages, scales, slots, scale_slots, valid, dtype: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_S: tl.constexpr, QUANT: tl.constexpr):
        """`[BLOCK_S, HEAD_DIM]` keys or values of the positions whose rows start at `slots`, dequantised and cast
        to `dtype`; zero where not `valid`."""
        if QUANT == 0:
            d = tl.arange(0, HEAD_DIM)
            tile = tl.load(pages + slots[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        else:
            groups: tl.constexpr = HEAD_DIM // 64
            g = tl.arange(0, groups)
            lanes = tl.arange(0, 64)
            offs = slots[:, None, None] + g[None, :, None] * 64 + lanes[None, None, :]
            codes = tl.load(pages + offs, mask=valid[:, None, None], other=0)
            if QUANT == 2:  # noqa: SIM108 - fp8 pools arrive as uint8 bits, decoded by integer ops (no sm_89 cvt)
                codes = e4m3_to_fp32(codes.to(tl.int32))
            else:
                codes = codes.to(tl.float32)
            scale = tl.load(scales + scale_slots[:, None] + g[None, :], mask=valid[:, None], other=0.0)
            tile = tl.reshape(codes * scale.to(tl.float32)[:, :, None], (BLOCK_S, HEAD_DIM))
        return tile.to(dtype)

    @triton.jit
    def _store_output(o, b, head, row_ok, out_ptr, stride_ob, gate_ptr, stride_gate, records_ptr, record_count,
                      HEAD_DIM: tl.constexpr, GATE: tl.constexpr, QUANTIZE: tl.constexpr):
        """Store o `[R, HEAD_DIM]` fp32, the outputs of heads `head` `[R]` of sequence b (rows where `row_ok`), in
        out's dtype at out `[B, heads · HEAD_DIM]`. With GATE, y = o · sigmoid(gate) instead, o rounded to the dtype
        first and then gated by `fused.output_gate` (`sigmoid_mul`'s bits); with QUANTIZE also y's
        int8 records (a head is HEAD_DIM / 32 whole blocks of the row)."""
        lanes = head[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
        y = o.to(out_ptr.dtype.element_ty)
        if GATE:
            y = output_gate(y, tl.load(gate_ptr + b * stride_gate + lanes, mask=row_ok[:, None], other=0.0))
        tl.store(out_ptr + b * stride_ob + lanes, y, mask=row_ok[:, None])
        if QUANTIZE:
            per_head: tl.constexpr = HEAD_DIM // 32
            tile_blocks: tl.constexpr = o.shape[0] * per_head
            blocks = head[:, None] * per_head + tl.arange(0, per_head)[None, :]
            blocks = tl.where(row_ok[:, None], blocks, record_count)  # padding rows: past the records, not stored
            store_records(tl.reshape(y.to(tl.float32), [tile_blocks, 32]), records_ptr + b * record_count * 12,
                          tl.reshape(blocks, [tile_blocks]), record_count)

    @triton.jit
    def _paged_decode_kernel(q_ptr, key_pages, value_pages, key_scales, value_scales, table_ptr, lengths_ptr,
                             out_ptr, partial_out, partial_max, partial_sum, gate_ptr, records_ptr, stride_qb,
                             stride_qh, stride_ob, stride_gate, record_count, stride_table, stride_page, stride_row,
                             stride_head, scale_stride_page, scale_stride_row, scale_stride_head, qk_scale, splits,
                             heads, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                             PAGE: tl.constexpr, BLOCK_S: tl.constexpr, QUANT: tl.constexpr, SPLIT: tl.constexpr,
                             IEEE: tl.constexpr, GATE: tl.constexpr, QUANTIZE: tl.constexpr, PDL: tl.constexpr):
        wait_for_inputs(PDL)
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(lengths_ptr + b)
        chunk = tl.cdiv(tl.cdiv(length, splits), BLOCK_S) * BLOCK_S  # this sequence's positions per split
        first = split * chunk
        last = tl.minimum(first + chunk, length)
        rows = tl.arange(0, GROUP_PAD)
        row_ok = rows < GROUP
        head = kv_head * GROUP + rows
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
        running_max = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros((GROUP_PAD,), dtype=tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
        for start in range(first, last, BLOCK_S):
            position = start + tl.arange(0, BLOCK_S)
            valid = position < last
            page = tl.load(table_ptr + b * stride_table + position // PAGE, mask=valid, other=0).to(tl.int64)
            row = position % PAGE
            slots = page * stride_page + row * stride_row + kv_head * stride_head
            scale_slots = page * scale_stride_page + row * scale_stride_row + kv_head * scale_stride_head
            k = _load_kv_tile(key_pages, key_scales, slots, scale_slots, valid, q.dtype, HEAD_DIM, BLOCK_S, QUANT)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") if IEEE else tl.dot(q, tl.trans(k))
            scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))  # log2 domain
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            decay = tl.exp2(running_max - new_max)
            p = tl.exp2(scores - new_max[:, None])
            running_sum = running_sum * decay + tl.sum(p, 1)
            v = _load_kv_tile(value_pages, value_scales, slots, scale_slots, valid, q.dtype, HEAD_DIM, BLOCK_S,
                              QUANT)
            if IEEE:
                acc = acc * decay[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
            else:
                acc = acc * decay[:, None] + tl.dot(p.to(q.dtype), v)
            running_max = new_max
        if SPLIT:  # a split past the sequence's length (no positions) writes only its max (−inf) and sum
            part = (b * heads + head) * splits + split
            written = d < tl.where(first < last, HEAD_DIM, 0)  # every lane, or none
            tl.store(partial_out + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & written[None, :])
            tl.store(partial_max + part, running_max, mask=row_ok)
            tl.store(partial_sum + part, running_sum, mask=row_ok)
        else:
            o = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
            _store_output(o, b, head, row_ok, out_ptr, stride_ob, gate_ptr, stride_gate, records_ptr, record_count,
                          HEAD_DIM, GATE, QUANTIZE)

    @triton.jit
    def _merge_splits_kernel(partial_out, partial_max, partial_sum, out_ptr, gate_ptr, records_ptr, stride_ob,
                             stride_gate, record_count, splits, heads, HEAD_DIM: tl.constexpr,
                             SPLITS_PAD: tl.constexpr, GATE: tl.constexpr, QUANTIZE: tl.constexpr,
                             PDL: tl.constexpr):
        wait_for_inputs(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, SPLITS_PAD)
        part = (b * heads + h) * splits + s
        used = s < splits
        split_max = tl.load(partial_max + part, mask=used, other=float("-inf"))
        split_sum = tl.load(partial_sum + part, mask=used, other=0.0)
        top = tl.max(split_max, 0)
        had_positions = split_max > float("-inf")  # false for empty splits and past `splits`
        weight = tl.where(had_positions, tl.exp2(split_max - top), 0.0)  # empty splits weigh 0
        total = tl.sum(weight * split_sum, 0)
        d = tl.arange(0, HEAD_DIM)
        # only the splits that had positions wrote an output (an empty one's counts as 0)
        acc = tl.load(partial_out + part[:, None] * HEAD_DIM + d[None, :], mask=had_positions[:, None], other=0.0)
        o = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
        head = h + tl.arange(0, 1)
        _store_output(o[None, :], b, head, head < heads, out_ptr, stride_ob, gate_ptr, stride_gate, records_ptr,
                      record_count, HEAD_DIM, GATE, QUANTIZE)


def paged_attention_decode(q: Tensor, key_pages: Tensor, value_pages: Tensor, key_scales: Tensor | None,
                           value_scales: Tensor | None, block_table: Tensor, lengths: Tensor, scale: float,
                           max_length: int | None = None, *, gate: Tensor | None = None,
                           quantize: bool = False) -> Tensor | Int8Activations:
    """One query per sequence attending to its cached positions 0 … lengths[b] − 1 (its own already written),
    optionally followed by the attention output gate.

    Math: per query head h with kv head `h // (heads // kvh)`: `o = Σ_s p_s v_s`, `p = softmax_s(scale · q·k_s)`
    with k, v dequantised (x̂ = code · scale, rounded to q's dtype), the scores, softmax and sums in fp32, p
    rounded to q's dtype before meeting v (as flash attention does; `causal_attention` also rounds the scores).
    With `gate`: `y = o · sigmoid(gate)` over the heads' concatenation, the same bits as
    `fused.sigmoid_mul(o.view(B, -1), gate, quantize)` (o rounded to q's dtype, then the sigmoid, then the
    product); with `quantize` also y's int8 records, equal to `sigmoid_mul`'s.

    Shapes: q `[B, heads, hd]` (fp32/bf16/fp16, stride 1 on hd), heads a multiple of kvh; the cache as in the
    module docstring; block_table `[B, max_pages]` int32; lengths `[B]` int32 with 1 ≤ lengths[b] ≤ max_length
    (a host bound, default max_pages · PAGE, that fixes the number of splits — `decode_split_plan`; each sequence
    divides its own length among them on the device; a length of 0 gives zeros); gate `[B, heads · hd]` (any row
    stride, stride 1 along a row). Returns o `[B, heads, hd]` in q's dtype; with `gate`, y `[B, heads · hd]` in
    q's dtype, as `Int8Activations(y, records)` with `quantize` (made in the output's kernel when heads · hd is a
    multiple of LANE_PAD, else by `sigmoid_mul` after it). No host synchronisation; scratch sized from host ints
    only.
    """
    if triton is None:
        raise RuntimeError("paged_attention_decode needs the triton package")
    mode = _cache_mode(key_pages, value_pages, key_scales, value_scales)
    batch, heads, head_dim = q.shape
    kv_heads, page = key_pages.shape[2], key_pages.shape[1]
    if key_pages.shape[3] != head_dim or heads % kv_heads or q.stride(2) != 1:
        raise ValueError(f"paged_attention_decode: q {list(q.shape)} does not fit the pages {list(key_pages.shape)} "
                         f"(heads a multiple of kvh, stride 1 on hd)")
    if block_table.dim() != 2 or block_table.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"paged_attention_decode: block_table {list(block_table.shape)} and lengths "
                         f"{list(lengths.shape)} must have B = {batch} rows")
    width = heads * head_dim
    if gate is not None and (gate.shape != (batch, width) or gate.stride(1) != 1 or gate.device != q.device):
        raise ValueError(f"paged_attention_decode: gate {list(gate.shape)} (strides {gate.stride()}) on "
                         f"{gate.device} must be [{batch}, {width}] with stride 1 along rows, on {q.device}")
    if quantize and gate is None:
        raise ValueError("paged_attention_decode: quantize makes the records of the gated output; pass a gate")
    # the records of a row are whole heads only when no padding block follows them (hd is a multiple of 32)
    fuse_gate = gate is not None and (not quantize or width % LANE_PAD == 0)
    max_length = block_table.shape[1] * page if max_length is None else max_length
    splits = decode_split_plan(kv_heads, max_length, q.device)
    choice = tuning.for_device(q.device).attention
    group = heads // kv_heads
    records_here = fuse_gate and quantize
    out = torch.empty((batch, width), dtype=q.dtype, device=q.device)
    # out stands for the pointers a launch does not use: no gate, no records, no splits
    gate_in = gate if fuse_gate else out
    records = empty_records(batch, width, q.device) if records_here else out
    record_count = records.shape[1] if records_here else 0
    partial_out = partial_max = partial_sum = out
    if splits > 1:
        partial_out = torch.empty((batch, heads, splits, head_dim), dtype=torch.float32, device=q.device)
        partial_max = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
        partial_sum = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
    pools = (key_pages.view(torch.uint8), value_pages.view(torch.uint8)) if mode == 2 else (key_pages, value_pages)
    scales = (key_scales, value_scales) if mode else pools  # unused pointers for float pages
    scale_strides = key_scales.stride()[:3] if mode else (0, 0, 0)
    _paged_decode_kernel[(batch, kv_heads, splits)](
        q, *pools, *scales, block_table, lengths, out, partial_out, partial_max, partial_sum, gate_in, records,
        q.stride(0), q.stride(1), out.stride(0), gate_in.stride(0), record_count, block_table.stride(0),
        *key_pages.stride()[:3], *scale_strides, scale * math.log2(math.e), splits, heads, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE=page, BLOCK_S=choice.block_positions,
        QUANT=mode, SPLIT=splits > 1, IEEE=q.dtype == torch.float32, GATE=fuse_gate, QUANTIZE=records_here,
        num_warps=choice.decode_warps, **launch_options(q.device))
    if splits > 1:
        _merge_splits_kernel[(batch, heads)](
            partial_out, partial_max, partial_sum, out, gate_in, records, out.stride(0), gate_in.stride(0),
            record_count, splits, heads, HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(splits),
            GATE=fuse_gate, QUANTIZE=records_here, num_warps=choice.merge_warps, **launch_options(q.device))
    if gate is None:
        return out.view(batch, heads, head_dim)
    if not fuse_gate:  # records with a padding block: `sigmoid_mul` makes them
        return sigmoid_mul(out, gate, quantize=True)
    return Int8Activations(out, records) if quantize else out
