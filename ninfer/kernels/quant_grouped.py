"""Many tokens through their experts in one launch (MoE prefill): `quant_linear_grouped` over the tile plan of
`group_pairs`, for a stack of experts in a groupwise format (`quant_linear`'s formats)."""

from __future__ import annotations

import torch

from ninfer.kernels import tuning
from ninfer.kernels.dependent_launch import launch_options, wait_for_inputs
from ninfer.kernels.groupwise_planes import high_row_units, packed_planes

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

if triton is not None:
    from ninfer.kernels.groupwise_planes import lane_values, load_tile
    from ninfer.kernels.row_tiles import row_tile

    @triton.jit
    def _grouped_kernel(x_ptr, base_ptr, high_ptr, scale_ptr, out_ptr, expert_ptr, pairs_ptr, N, k_pad, row_words,
                        high_row_units, gpr, stride_x, stride_out, num_experts, BITS: tl.constexpr,
                        GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                        X_PER_SLOT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        wait_for_inputs(PDL)
        LPW: tl.constexpr = 4 if BITS == 8 else 8  # lanes per 32-bit base word
        WORDS: tl.constexpr = BLOCK_K // LPW
        WPG: tl.constexpr = GROUP // LPW  # words per group (8 in every format)
        NG: tl.constexpr = BLOCK_K // GROUP
        rows, row_ok, safe_rows = row_tile(tl.program_id(0), N, BLOCK_N)
        w_idx = tl.arange(0, WORDS)
        tokens = tl.arange(0, BLOCK_T)
        tile = tl.program_id(1)  # a tile of BLOCK_T (token, expert) pairs that share one expert
        expert = tl.load(expert_ptr + tile)
        live = expert < num_experts  # tiles past the plan's last one hold no pairs
        wrows = tl.minimum(expert, num_experts - 1).to(tl.int64) * N + safe_rows
        pairs = tl.load(pairs_ptr + tile * BLOCK_T + tokens)
        token_ok = (pairs >= 0) & (tokens < tl.where(live, BLOCK_T, 0))  # tensor-only mask terms
        x_rows = tl.where(token_ok, pairs // X_PER_SLOT, 0).to(tl.int64)
        out_rows = tl.where(token_ok, pairs, 0).to(tl.int64)
        acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        for k0 in tl.range(0, tl.where(live, k_pad, 0), BLOCK_K):
            words, high, scale = load_tile(base_ptr, high_ptr, scale_ptr, wrows, k0, row_words,
                                           high_row_units, gpr, BITS, LPW, GROUP, BLOCK_K)
            for p in tl.static_range(LPW):
                x_p = tl.load(x_ptr + x_rows[None, :] * stride_x + (k0 + LPW * w_idx + p)[:, None],
                              mask=token_ok[None, :], other=0.0)
                codes = lane_values(words, high, p, BITS)
                w_p = tl.reshape(tl.reshape(codes, [BLOCK_N, NG, WPG]) * scale[:, :, None], [BLOCK_N, WORDS])
                if IEEE:
                    acc += tl.dot(w_p.to(x_p.dtype), x_p, input_precision="ieee")
                else:
                    acc += tl.dot(w_p.to(x_p.dtype), x_p)
        out = out_ptr + out_rows[None, :] * stride_out + rows[:, None]
        tl.store(out, acc, mask=row_ok[:, None] & token_ok[None, :])


def _block_k(k_pad: int) -> int:
    """The widest tile (lanes) up to 256 that divides the padded K (`tl.dot` meets x in the grouped product)."""
    return next(b for b in (256, 128) if k_pad % b == 0)


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
    counts = torch.zeros(experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
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
    codec, base, high, scales, planes = packed_planes(data, shape, fmt)
    tile_experts, tile_pairs = plan
    k = shape[1]
    gpr = codec.groups_per_row(k)
    k_pad = gpr * codec.group
    if x.shape[1] != k_pad or x.stride(1) != 1:
        x = torch.nn.functional.pad(x, (0, k_pad - x.shape[1])).contiguous()
    out = torch.empty((pairs, expert_rows), dtype=out_dtype or x.dtype, device=x.device)
    choice = tuning.for_device(x.device).quant_linear
    block_n = choice.grouped_block_n
    block_k = _block_k(k_pad)
    experts = shape[0] // expert_rows
    _grouped_kernel[(triton.cdiv(expert_rows, block_n), tile_experts.numel())](
        x, base, high, scales, out, tile_experts, tile_pairs, expert_rows, k_pad, planes[0].row_bytes // 4,
        high_row_units(codec, planes), gpr, x.stride(0), out.stride(0), experts,
        BITS=codec.bits, GROUP=codec.group, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_T=block,
        X_PER_SLOT=x_per_pair, IEEE=x.dtype == torch.float32,
        num_warps=choice.grouped_warps, **launch_options(x.device))
    return out

