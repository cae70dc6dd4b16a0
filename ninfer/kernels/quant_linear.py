"""y = x · Wᵀ with W stored packed in a groupwise format (q4/q5/q6 g64, q8 g32, `row_split_k128_v1`).

Contract: x `[T, K]` (fp32 / bf16 / fp16), `data` the object's bytes (1-D uint8, on x's device), `shape` = (N, K)
of W, `fmt` its format. y[t, n] = Σ_k x[t, k] · scale[n, k // G] · code[n, k], accumulated in fp32.

Four paths with that contract:
  * `quant_linear_reference`: decode W exactly (ninfer.quant) and multiply in fp32 — the oracle, any device;
  * `quant_linear_gemv`: a Triton kernel for few tokens (decode, speculative verify: T ≤ 16) that reads the
    packed planes once. Each program owns BLOCK_N rows and walks K in tiles of BLOCK_K lanes, loading the base
    plane as 32-bit words (8 lanes of nibbles, or 4 int8 lanes for q8), the high units of the same lanes (q5:
    a byte, q6: 16 bits per word) and the tile's fp16 scales; lane p of every word is turned into an exact fp32
    code with integer ops and one subtraction (magic-number conversion), so the lanes of a word meet x[LPW·w + p].
    T = 1 multiplies codes by x in fp32, sums each group and scales it (exact products); T > 1 rounds the scaled
    weights to x's dtype (as the reference model's decoded weights are) and meets x through `tl.dot` with fp32
    accumulation. With `experts`, the kernel gathers: output row s uses the `expert_rows`-row block of expert
    `experts[s]` and input row `s // x_per_slot` (the MoE decode GEMV);
  * `quant_linear_grouped`: the same kernel's `tl.dot` form over tiles of (token, expert) pairs that share an
    expert (`group_pairs` plans the tiles on the device), for MoE prefill: one launch per matrix for all experts;
  * `dequantize`: the same unpacking into a bf16 `[N, K]` matrix, for the prefill route of dense matrices
    (dequantize to scratch, then cuBLAS; `ninfer.fast.linear` picks the route by T).
Runs under TRITON_INTERPRET=1 (fp32 inputs there: the interpreter miscomputes bf16 `tl.dot`).
"""

from __future__ import annotations

import os

import torch

from ninfer.quant import codec_for
from ninfer.quant.groupwise import GroupwiseCodec

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

MAX_GEMV_TOKENS = 16
# the interpreter runs programs one after another and vectorises within one: few wide programs are far faster there
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def quant_linear_reference(x: torch.Tensor, data: torch.Tensor, shape: tuple[int, int], fmt: str) -> torch.Tensor:
    weight = codec_for(fmt).decode(data, shape)
    return x.to(torch.float32) @ weight.T


if triton is not None:

    @triton.jit
    def _lane_values(words, high, p: tl.constexpr, BITS: tl.constexpr):
        """Codes of lanes k0 + LPW·w + p (w < WORDS, LPW = lanes per 32-bit base word: 8, or 4 for q8) of the
        tile, exactly, as fp32 `[BN, WORDS]`, from its base words and high units (`_load_tile`). The int → float step is
        the magic-number one (OR the offset-binary code into the mantissa of 2^23, subtract), not a conversion
        instruction: conversions run at a quarter of the FP32 rate and would bound the kernel."""
        if BITS == 8:
            u = ((words >> (8 * p)) & 0xFF) ^ (0x4B000000 | 0x80)
            return u.to(tl.float32, bitcast=True) - (8388608.0 + 128.0)
        nibble = (words >> (4 * p)) & 0xF
        if BITS == 4:
            return (nibble ^ (0x4B000000 | 0x8)).to(tl.float32, bitcast=True) - (8388608.0 + 8.0)
        if BITS == 5:  # bit 4 of lane i is bit i % 8 of high byte i // 8: byte w of the row for word w
            bits = ((high >> p) & 1) << 4
            return ((nibble | bits) ^ (0x4B000000 | 0x10)).to(tl.float32, bitcast=True) - (8388608.0 + 16.0)
        # q6: bits 4-5 of lane i are bits 2i, 2i+1 of the high stream: 16-bit unit w of the row for word w
        bits = ((high >> (2 * p)) & 3) << 4
        return ((nibble | bits) ^ (0x4B000000 | 0x20)).to(tl.float32, bitcast=True) - (8388608.0 + 32.0)

    @triton.jit
    def _load_tile(base_ptr, high_ptr, scale_ptr, wrows, k0, row_words, high_row_units, gpr, BITS: tl.constexpr,
                   LPW: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
        """The tile's base words `[BN, BLOCK_K / LPW]` int32, its high units (q5: a byte, q6: 16 bits per word;
        else the words again, unused) as int32, and its scales `[BN, BLOCK_K / GROUP]` fp32."""
        WORDS: tl.constexpr = BLOCK_K // LPW
        words = tl.load(base_ptr + wrows[:, None] * row_words + (k0 // LPW + tl.arange(0, WORDS))[None, :])
        if BITS == 5 or BITS == 6:
            high = tl.load(high_ptr + wrows[:, None] * high_row_units + (k0 // 8 + tl.arange(0, WORDS))[None, :])
            high = high.to(tl.int32) & (0xFF if BITS == 5 else 0xFFFF)
        else:
            high = words
        groups = tl.arange(0, BLOCK_K // GROUP)
        scale = tl.load(scale_ptr + wrows[:, None] * gpr + (k0 // GROUP + groups)[None, :]).to(tl.float32)
        return words, high, scale

    @triton.jit
    def gemv_rows(x_ptr, out_ptr, expert_ptr, N, stride_x, stride_out, BLOCK_N: tl.constexpr, GATHER: tl.constexpr,
                  X_PER_SLOT: tl.constexpr):
        """The output rows of a GEMV program and where they live: (rows, row_ok, safe_rows clamped into [0, N) for
        unmasked, vectorisable loads — the store masks —, the weight rows (with GATHER, program_id(1) is an
        output slot whose expert `expert_ptr[slot]` offsets them by expert · N), x's row and the output row)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        safe_rows = tl.minimum(rows, N - 1).to(tl.int64)
        if GATHER:
            slot = tl.program_id(1)
            wrows = tl.load(expert_ptr + slot).to(tl.int64) * N + safe_rows
            x_base = x_ptr + (slot // X_PER_SLOT) * stride_x
            out_base = out_ptr + slot * stride_out
        else:
            wrows = safe_rows
            x_base = x_ptr
            out_base = out_ptr
        return rows, row_ok, safe_rows, wrows, x_base, out_base

    @triton.jit
    def _gemv_kernel(x_ptr, base_ptr, high_ptr, scale_ptr, out_ptr, expert_ptr, pairs_ptr,
                     T, N, k_pad, row_words, high_row_units, gpr, stride_x, stride_out, num_experts,
                     BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_T: tl.constexpr, GATHER: tl.constexpr, GROUPED: tl.constexpr, X_PER_SLOT: tl.constexpr,
                     IEEE: tl.constexpr):
        LPW: tl.constexpr = 4 if BITS == 8 else 8  # lanes per 32-bit base word
        WORDS: tl.constexpr = BLOCK_K // LPW
        WPG: tl.constexpr = GROUP // LPW  # words per group (8 in every format)
        NG: tl.constexpr = BLOCK_K // GROUP
        rows, row_ok, safe_rows, wrows, x_base, out_base = gemv_rows(x_ptr, out_ptr, expert_ptr, N, stride_x,
                                                                     stride_out, BLOCK_N, GATHER, X_PER_SLOT)
        w_idx = tl.arange(0, WORDS)
        if BLOCK_T == 1:
            acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
            for k0 in tl.range(0, k_pad, BLOCK_K):
                words, high, scale = _load_tile(base_ptr, high_ptr, scale_ptr, wrows, k0, row_words,
                                                high_row_units, gpr, BITS, LPW, GROUP, BLOCK_K)
                part = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
                for p in tl.static_range(LPW):
                    x_p = tl.load(x_base + k0 + LPW * w_idx + p).to(tl.float32)
                    codes = _lane_values(words, high, p, BITS)
                    part += codes * x_p[None, :]
                acc += tl.sum(tl.reshape(part, [BLOCK_N, NG, WPG]), axis=2) * scale
            tl.store(out_base + rows, tl.sum(acc, axis=1), mask=row_ok)
        else:
            tokens = tl.arange(0, BLOCK_T)
            if GROUPED:  # program_id(1): a tile of BLOCK_T (token, expert) pairs that share one expert
                tile = tl.program_id(1)
                expert = tl.load(expert_ptr + tile)
                live = expert < num_experts  # tiles past the plan's last one hold no pairs
                wrows = tl.minimum(expert, num_experts - 1).to(tl.int64) * N + safe_rows
                pairs = tl.load(pairs_ptr + tile * BLOCK_T + tokens)
                token_ok = (pairs >= 0) & (tokens < tl.where(live, BLOCK_T, 0))  # tensor-only mask terms
                x_rows = tl.where(token_ok, pairs // X_PER_SLOT, 0).to(tl.int64)
                out_rows = tl.where(token_ok, pairs, 0).to(tl.int64)
                k_end = tl.where(live, k_pad, 0)
            else:
                token_ok = tokens < T
                x_rows = tokens
                out_rows = tokens
                k_end = k_pad
            acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            for k0 in tl.range(0, k_end, BLOCK_K):
                words, high, scale = _load_tile(base_ptr, high_ptr, scale_ptr, wrows, k0, row_words,
                                                high_row_units, gpr, BITS, LPW, GROUP, BLOCK_K)
                for p in tl.static_range(LPW):
                    x_p = tl.load(x_base + x_rows[None, :] * stride_x + (k0 + LPW * w_idx + p)[:, None],
                                  mask=token_ok[None, :], other=0.0)
                    codes = _lane_values(words, high, p, BITS)
                    w_p = tl.reshape(tl.reshape(codes, [BLOCK_N, NG, WPG]) * scale[:, :, None], [BLOCK_N, WORDS])
                    if IEEE:
                        acc += tl.dot(w_p.to(x_p.dtype), x_p, input_precision="ieee")
                    else:
                        acc += tl.dot(w_p.to(x_p.dtype), x_p)
            out = out_base + out_rows[None, :] * stride_out + rows[:, None]
            tl.store(out, acc, mask=row_ok[:, None] & token_ok[None, :])

    @triton.jit
    def _dequantize_kernel(base_ptr, high_ptr, scale_ptr, out_ptr, index_ptr, N, K, row_words, high_row_units, gpr,
                           BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GATHER: tl.constexpr):
        LPW: tl.constexpr = 4 if BITS == 8 else 8
        NG: tl.constexpr = BLOCK_K // GROUP
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output rows
        k0 = tl.program_id(1) * BLOCK_K
        safe_rows = tl.minimum(rows, N - 1).to(tl.int64)
        if GATHER:  # output row r is stored row index[r]
            safe_rows = tl.load(index_ptr + safe_rows).to(tl.int64)
        words, high, scale = _load_tile(base_ptr, high_ptr, scale_ptr, safe_rows, k0, row_words, high_row_units, gpr,
                                        BITS, LPW, GROUP, BLOCK_K)
        # codes of lanes LPW·w + p for every p, interleaved back into lane order with joins
        c01 = tl.join(_lane_values(words, high, 0, BITS), _lane_values(words, high, 1, BITS))
        c23 = tl.join(_lane_values(words, high, 2, BITS), _lane_values(words, high, 3, BITS))
        if LPW == 8:
            c45 = tl.join(_lane_values(words, high, 4, BITS), _lane_values(words, high, 5, BITS))
            c67 = tl.join(_lane_values(words, high, 6, BITS), _lane_values(words, high, 7, BITS))
            codes = tl.permute(tl.join(tl.join(c01, c23), tl.join(c45, c67)), (0, 1, 4, 3, 2))
        else:
            codes = tl.permute(tl.join(c01, c23), (0, 1, 3, 2))
        codes = tl.reshape(codes, [BLOCK_N, NG, GROUP])
        w = tl.reshape(codes * scale[:, :, None], [BLOCK_N, BLOCK_K])
        lanes = k0 + tl.arange(0, BLOCK_K)
        out = out_ptr + rows[:, None].to(tl.int64) * K + lanes[None, :]
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=(rows < N)[:, None] & (lanes < K)[None, :])


def _planes(data: torch.Tensor, shape: tuple[int, int], fmt: str) -> tuple:
    codec = codec_for(fmt)
    if not isinstance(codec, GroupwiseCodec):
        raise ValueError(f"{fmt} is not a groupwise format")
    planes = codec.planes(shape)
    n = shape[0]
    base = data[: n * planes[0].row_bytes].view(torch.int32)
    if len(planes) == 3:  # q5: one high byte per 8 lanes; q6: one 16-bit unit per 8 lanes
        high = data[planes[1].offset : planes[1].offset + n * planes[1].row_bytes]
        high = high.view(torch.int16) if codec.bits == 6 else high
    else:
        high = data
    scales = data[planes[-1].offset : planes[-1].offset + n * planes[-1].row_bytes].view(torch.float16)
    return codec, base, high, scales, planes


def _high_row_units(codec: GroupwiseCodec, planes: list) -> int:
    """Row stride of the high plane in its load unit (q5: bytes, q6: 16-bit units); 0 without a high plane."""
    return planes[1].row_bytes // (2 if codec.bits == 6 else 1) if len(planes) == 3 else 0


def _block_k(k_pad: int, tokens: int) -> int:
    """The widest K tile (lanes) that divides the padded K: up to 1024 for one token (the H200 sweep's best at
    every 27B / 35B shape, docs/performance.md), 256 when tl.dot meets x."""
    return next(b for b in ((1024, 512, 256, 128) if tokens == 1 else (256, 128)) if k_pad % b == 0)


def quant_linear_gemv(x: torch.Tensor, data: torch.Tensor, shape: tuple[int, int], fmt: str,
                      block_n: int | None = None, block_k: int | None = None, out_dtype: torch.dtype | None = None,
                      experts: torch.Tensor | None = None, expert_rows: int = 0, x_per_slot: int = 1,
                      num_warps: int | None = None) -> torch.Tensor:
    """The Triton GEMV (see the module docstring). x has at most MAX_GEMV_TOKENS rows; the result is
    `[T, N]` in `out_dtype` (default fp32). With `experts` `[S]` (int), W stacks experts of `expert_rows` rows
    each and the result is `[S, expert_rows]`: row s = x[s // x_per_slot] · W_{experts[s]}ᵀ."""
    if triton is None:
        raise RuntimeError("the Triton GEMV needs the triton package")
    codec, base, high, scales, planes = _planes(data, shape, fmt)
    tokens = x.shape[0]
    if experts is None and not 1 <= tokens <= MAX_GEMV_TOKENS:
        raise ValueError(f"the GEMV takes 1..{MAX_GEMV_TOKENS} tokens, not {tokens}")
    n, k = shape if experts is None else (expert_rows, shape[1])
    gpr = codec.groups_per_row(k)
    k_pad = gpr * codec.group
    if x.shape[1] != k_pad or x.stride(1) != 1:
        x = torch.nn.functional.pad(x, (0, k_pad - x.shape[1])).contiguous()
    slots = tokens if experts is None else experts.numel()
    out = torch.empty((slots, n), dtype=out_dtype or torch.float32, device=x.device)
    block_t = 1 if tokens == 1 or experts is not None else 16  # tl.dot needs at least 16 columns
    block_n = block_n or (256 if INTERPRETED else 64 if block_t > 1 else 16 if n >= 16384 else 8)
    block_k = block_k or _block_k(k_pad, block_t)
    if k_pad % block_k:
        raise ValueError(f"block_k {block_k} does not divide the padded K of {k_pad}")
    grid = (triton.cdiv(n, block_n), slots if experts is not None else 1)
    _gemv_kernel[grid](
        x, base, high, scales, out, experts if experts is not None else base, base, tokens, n, k_pad,
        planes[0].row_bytes // 4, _high_row_units(codec, planes), gpr, x.stride(0), out.stride(0), 0,
        BITS=codec.bits, GROUP=codec.group, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_T=block_t,
        GATHER=experts is not None, GROUPED=False, X_PER_SLOT=x_per_slot, IEEE=x.dtype == torch.float32,
        num_warps=num_warps or 4)
    return out


def group_pairs(expert_ids: torch.Tensor, experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile plan of `quant_linear_grouped` for the (token, expert) pairs `expert_ids` `[P]` (pair p = token
    p // top_k's choice p % top_k): pairs sorted by expert, each expert's run padded to whole tiles of `block`.
    Returns (tile_experts `[tiles]` int64: the expert of each tile, `experts` past the last used tile;
    tile_pairs `[tiles · block]` int64: pair ids, -1 for padding). `tiles` = ⌈P / block⌉ + experts, an upper
    bound from host ints: the plan is built on the device with no host synchronisation."""
    flat = expert_ids.reshape(-1).long()
    pairs = flat.numel()
    tiles = -(-pairs // block) + experts
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    tiles_per_expert = (counts + block - 1) // block
    tile_end = torch.cumsum(tiles_per_expert, 0)
    first_pair = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=flat.device) - first_pair[sorted_experts]
    tile_pairs = torch.full((tiles * block,), -1, dtype=torch.long, device=flat.device)
    tile_pairs[(tile_end - tiles_per_expert)[sorted_experts] * block + rank] = order
    tile_experts = torch.searchsorted(tile_end, torch.arange(tiles, device=flat.device), right=True)
    return tile_experts, tile_pairs


def quant_linear_grouped(x: torch.Tensor, data: torch.Tensor, shape: tuple[int, int], fmt: str,
                         plan: tuple[torch.Tensor, torch.Tensor], pairs: int, expert_rows: int, x_per_pair: int,
                         block: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Many tokens through their experts in one launch (MoE prefill): W stacks experts of `expert_rows` rows
    (`shape` is the whole stack); with the tile plan of `group_pairs(ids, experts, block)`, row p of the result
    `[pairs, expert_rows]` is x[p // x_per_pair] · W_{ids[p]}ᵀ. Each program dequantizes one BLOCK_N × BLOCK_K
    weight tile of its tile's expert per step and meets the tile's `block` gathered x rows through `tl.dot`
    (weights rounded to x's dtype, fp32 accumulation) — an expert's weights are read once per tile of its pairs,
    not once per pair."""
    if triton is None:
        raise RuntimeError("the Triton grouped product needs the triton package")
    codec, base, high, scales, planes = _planes(data, shape, fmt)
    tile_experts, tile_pairs = plan
    k = shape[1]
    gpr = codec.groups_per_row(k)
    k_pad = gpr * codec.group
    if x.shape[1] != k_pad or x.stride(1) != 1:
        x = torch.nn.functional.pad(x, (0, k_pad - x.shape[1])).contiguous()
    out = torch.empty((pairs, expert_rows), dtype=out_dtype or x.dtype, device=x.device)
    block_n = 256 if INTERPRETED else 64
    block_k = _block_k(k_pad, block)
    experts = shape[0] // expert_rows
    _gemv_kernel[(triton.cdiv(expert_rows, block_n), tile_experts.numel())](
        x, base, high, scales, out, tile_experts, tile_pairs, 0, expert_rows, k_pad, planes[0].row_bytes // 4,
        _high_row_units(codec, planes), gpr, x.stride(0), out.stride(0), experts,
        BITS=codec.bits, GROUP=codec.group, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_T=block, GATHER=False,
        GROUPED=True, X_PER_SLOT=x_per_pair, IEEE=x.dtype == torch.float32,
        num_warps=8)  # 4 warps spill registers at 64 × 64 tiles (scripts/compile_kernels.py --resources)
    return out


def dequantize(data: torch.Tensor, shape: tuple[int, int], fmt: str, dtype: torch.dtype = torch.bfloat16,
               out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """W `[N, K]` in `dtype` (rounded once from fp32 scale × code), into `out` when given (a scratch buffer of at
    least N·K elements, reused across matrices by the prefill route). With `rows` (a device int tensor `[R]`),
    only those rows, in that order: `[R, K]` (embedding lookups, one expert's block)."""
    if triton is None:
        raise RuntimeError("the Triton dequantizer needs the triton package")
    codec, base, high, scales, planes = _planes(data, shape, fmt)
    n, k = shape if rows is None else (rows.numel(), shape[1])
    gpr = codec.groups_per_row(k)
    result = torch.empty((n, k), dtype=dtype, device=data.device) if out is None else out[: n * k].view(n, k)
    block_n, block_k = (256, 128) if INTERPRETED else (16, 128)
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        base, high, scales, result, rows if rows is not None else base, n, k, planes[0].row_bytes // 4,
        _high_row_units(codec, planes), gpr, BITS=codec.bits, GROUP=codec.group, BLOCK_N=block_n, BLOCK_K=block_k,
        GATHER=rows is not None)
    return result
