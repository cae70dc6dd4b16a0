"""Rotary position embedding of the full-attention layers: partial NeoX RoPE with interleaved MRoPE."""

from __future__ import annotations

import torch
from torch import Tensor


def _mrope_axis(num_freqs: int, mrope_section: list[int]) -> Tensor:
    """Position axis (0 = temporal, 1 = height, 2 = width) that each frequency index j reads.

    Interleaved MRoPE as hard-coded in transformers' qwen3_5: j%3 == 1 and j < 3*section[1] → H,
    j%3 == 2 and j < 3*section[2] → W, everything else → T.
    """
    j = torch.arange(num_freqs)
    axis = torch.zeros(num_freqs, dtype=torch.long)
    axis[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
    return axis


def rope_inv_freq(rotary_dim: int, theta: float) -> Tensor:
    """`1 / theta^(2j / rotary_dim)` for j < rotary_dim / 2, fp32, computed on the CPU as transformers does."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def rope_cos_sin(
    positions: Tensor,
    rotary_dim: int,
    theta: float,
    mrope_section: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """cos and sin tables of (M)RoPE for T tokens, in the NeoX layout.

    Math: `inv_freq[j] = 1 / theta^(2j / rotary_dim)` for j < rotary_dim/2 (computed in fp32 on the CPU, as
    transformers does); `angle[t, j] = float(pos[axis(j), t]) * inv_freq[j]` in fp32, where axis(j) is the
    interleaved-MRoPE assignment of `_mrope_axis` when `mrope_section` is given (3 entries, [T, H, W]); the
    tables are `cos/sin(cat(angle, angle))`, cast to `dtype` last (transformers casts to the activation dtype).

    Shapes: positions `[T]` (1-D positions; the same as `[3, T]` with three equal rows) or `[3, T]`
    (temporal/height/width rows; needs `mrope_section`), any integer dtype, any device; returns cos, sin
    `[T, rotary_dim]` in `dtype` on positions' device. rotary_dim must be even.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rope_cos_sin: rotary_dim must be a positive even number, got {rotary_dim}")
    inv_freq = rope_inv_freq(rotary_dim, theta).to(positions.device)
    if positions.dim() == 1:
        per_freq_pos = positions[None, :].expand(rotary_dim // 2, -1)  # [R/2, T]
    elif positions.dim() == 2 and positions.shape[0] == 3:
        if mrope_section is None or len(mrope_section) != 3:
            raise ValueError(f"rope_cos_sin: [3, T] positions need a 3-entry mrope_section, got {mrope_section}")
        per_freq_pos = positions[_mrope_axis(rotary_dim // 2, mrope_section).to(positions.device)]  # [R/2, T]
    else:
        raise ValueError(f"rope_cos_sin: positions must be [T] or [3, T], got shape {list(positions.shape)}")
    angle = per_freq_pos.T.float() * inv_freq  # [T, R/2]
    angle = torch.cat((angle, angle), dim=-1)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """NeoX rotate-half over the last dim: `[a, b] -> [-b, a]` (a, b the two halves)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first rotary_dim dims of every head, NeoX style; the remaining dims pass through.

    Math: `x_rot * cos + rotate_half(x_rot) * sin` with `rotate_half([a, b]) = [-b, a]`, i.e. dim i pairs
    with dim i + rotary_dim/2. cos and sin are cast to `x.dtype` first, so the products run in x's dtype
    exactly as transformers' `apply_rotary_pos_emb` (which receives tables already in the activation dtype).

    Shapes: x `[T, heads, head_dim]`; cos, sin `[T, rotary_dim]` from `rope_cos_sin`, rotary_dim ≤ head_dim;
    returns `[T, heads, head_dim]` in `x.dtype`.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim > x.shape[-1] or cos.shape[0] != x.shape[0]:
        raise ValueError(f"apply_rope: x {list(x.shape)} does not fit cos/sin {list(cos.shape)}")
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x_rot = (x_rot * cos) + (rotate_half(x_rot) * sin)
    return torch.cat((x_rot, x_pass), dim=-1)
