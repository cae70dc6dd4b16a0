"""Causal grouped-query attention of T new queries over a key/value cache (one sequence): the reference
(`causal_attention`) and the fast path's prefill (`prefill_attention`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right


def _shapes(name: str, q: Tensor, k: Tensor, v: Tensor, q_start: int) -> tuple[int, int, int, int]:
    """(T, nh, S, kvh) of q `[T, nh, hd]` and k, v `[S, kvh, hd]`, checked: S = q_start + T, nh a multiple of
    kvh."""
    T, nh, hd = q.shape
    S, kvh, _ = k.shape
    if q_start + T != S or v.shape[:2] != (S, kvh) or nh % kvh or k.shape[-1] != hd:
        raise ValueError(f"{name}: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not fit "
                         f"q_start={q_start}")
    return T, nh, S, kvh


def causal_attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, scale: float) -> Tensor:
    """Softmax attention where query t (absolute position q_start + t) sees keys 0 … q_start + t.

    Math: per query head h with kv head `h // (nh // kvh)`: `o_t = Σ_s p_ts v_s`,
    `p_t = softmax_s(scale · q_t·k_s)` over s ≤ q_start + t. Cast order of transformers' eager attention:
    the scores `q kᵀ · scale` are computed in q's dtype, the softmax in fp32, the probabilities are cast back
    to q's dtype before `@ v`.

    Shapes: q `[T, nh, hd]`; k, v `[S, kvh, hd]` with S = q_start + T (the whole cache including the T new
    tokens), same dtype as q; nh a multiple of kvh. Returns `[T, nh, hd]` in q's dtype.
    """
    _, nh, S, kvh = _shapes("causal_attention", q, k, v, q_start)
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


# Fused SDPA backends for prefill. cuDNN's attention is left out: it builds an execution plan for every new (query,
# key) length, which took 1.9 s for a 17-token chunk on the H200 (torch 2.11), and a server
# meets a new length with almost every prompt. Flash attention takes bf16 / fp16, memory-efficient attention fp32.
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, scale: float) -> Tensor:
    """`causal_attention` (same contract, same masking) through PyTorch's fused attention: the key/value heads are
    repeated to the query heads, and the mask is the lower-right causal bias (query t sees keys ≤ q_start + t),
    which the flash and memory-efficient kernels apply without a materialised mask. Softmax in fp32 inside the
    kernel, so the result matches `causal_attention` to rounding, not bit for bit."""
    T, nh, S, kvh = _shapes("prefill_attention", q, k, v, q_start)
    group = nh // kvh
    keys = k.repeat_interleave(group, dim=1).transpose(0, 1)[None]  # [1, nh, S, hd]
    values = v.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    with sdpa_kernel(PREFILL_BACKENDS):
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=causal_lower_right(T, S),
                                           scale=scale)
    return o[0].transpose(0, 1)
