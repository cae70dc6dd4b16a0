"""Causal grouped-query attention of T new queries over a key/value cache (one sequence)."""

from __future__ import annotations

import torch
from torch import Tensor


def causal_attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, scale: float) -> Tensor:
    """Softmax attention where query t (absolute position q_start + t) sees keys 0 … q_start + t.

    Math: per query head h with kv head `h // (nh // kvh)`: `o_t = Σ_s p_ts v_s`,
    `p_t = softmax_s(scale · q_t·k_s)` over s ≤ q_start + t. Cast order of transformers' eager attention:
    the scores `q kᵀ · scale` are computed in q's dtype, the softmax in fp32, the probabilities are cast back
    to q's dtype before `@ v`.

    Shapes: q `[T, nh, hd]`; k, v `[S, kvh, hd]` with S = q_start + T (the whole cache including the T new
    tokens), same dtype as q; nh a multiple of kvh. Returns `[T, nh, hd]` in q's dtype.
    """
    T, nh, hd = q.shape
    S, kvh, _ = k.shape
    if q_start + T != S or v.shape[:2] != (S, kvh) or nh % kvh or k.shape[-1] != hd:
        raise ValueError(
            f"causal_attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not fit q_start={q_start}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"causal_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    group = nh // kvh
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [nh, S, hd]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q.transpose(0, 1) @ k.transpose(1, 2)) * scale  # [nh, T, S]
    key_pos = torch.arange(S, device=q.device)
    query_pos = torch.arange(q_start, S, device=q.device)
    scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ v).transpose(0, 1).contiguous()
