"""The gated delta rule of Gated DeltaNet: a per-token recurrence (decode) and its chunked form (prefill).

Both compute, for each value head independently, with a state S `[Dk, Dv]` in fp32:

    S   = S * exp(g_t)                          decay (g_t ≤ 0 is a log-decay)
    S   = S + k_t ⊗ ((v_t − k_tᵀ S) * beta_t)   delta-rule write: the error is read from the decayed state
    o_t = q_tᵀ S

Inputs are cast to fp32; o and the final state are returned in fp32 (transformers casts o back to the
activation dtype afterwards; the caller does that).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """`x * rsqrt(sum(x²) + eps)` over the last dim, in fp32 (eps on the sum, as transformers' `l2norm`).

    Shapes: any `[..., D]`; returns the same shape in **fp32** whatever x's dtype (transformers normalises q
    and k inside the delta-rule kernel, after its fp32 cast; keep them fp32 into the kernel).
    """
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None) -> None:
    T, H, Dk = k.shape
    Dv = v.shape[-1]
    if q.shape != k.shape or v.shape[:2] != (T, H) or g.shape != (T, H) or beta.shape != (T, H):
        raise ValueError(
            "gated_delta_rule: expected q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H]; got "
            f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, g {list(g.shape)}, beta {list(beta.shape)}"
        )
    if state is not None and state.shape != (H, Dk, Dv):
        raise ValueError(f"gated_delta_rule: state must be [{H}, {Dk}, {Dv}], got {list(state.shape)}")


def gated_delta_rule_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The gated delta rule token by token (the literal recurrence in the module docstring).

    Shapes: q, k `[T, H, Dk]` (L2-normalised, q already scaled by Dk^-0.5, already repeated to the H value
    heads); v `[T, H, Dv]`; g `[T, H]` log-decay (≤ 0, finite); beta `[T, H]` (in [0, 1] for the model, any
    finite value works); state `[H, Dk, Dv]` or None (zeros). Any dtype in, fp32 inside.
    Returns (o `[T, H, Dv]` fp32, final state `[H, Dk, Dv]` fp32). The input state is not modified.
    """
    _check(q, k, v, g, beta, state)
    T, H, Dk = k.shape
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = v.new_zeros(H, Dk, v.shape[-1]) if state is None else state.float()
    o = v.new_empty(v.shape)
    for t in range(T):
        S = S * g[t].exp()[:, None, None]
        error = v[t] - torch.einsum("hk,hkv->hv", k[t], S)
        S = S + k[t][:, :, None] * (error * beta[t][:, None])[:, None, :]
        o[t] = torch.einsum("hk,hkv->hv", q[t], S)
    return o, S


def gated_delta_rule_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """The gated delta rule in chunks of C tokens (UT transform / WY form); same contract as the recurrent one.

    Per chunk, with the state S₀ at its start, `G = cumsum(g)` inside the chunk and `Dec[i, j] = exp(G_i − G_j)`
    for j ≤ i (0 above the diagonal), unrolling the recurrence gives, for the written values u_i:

        (I + A) u = β⊙V − β⊙exp(G)⊙K S₀,     A = strictly-lower((β⊙K) Kᵀ ⊙ Dec)
        so u = U − W S₀  with  U = (I + A)⁻¹ (β⊙V),  W = (I + A)⁻¹ (β⊙exp(G)⊙K)   (triangular solves)
        O    = (exp(G)⊙Q) S₀ + (Q Kᵀ ⊙ Dec) u            (Dec including the diagonal)
        S₁   = exp(G_last) S₀ + (exp(G_last − G)⊙K)ᵀ u

    Only the last product is sequential over chunks. T need not be a multiple of C: the tail is padded with
    k = v = q = 0, g = beta = 0, which writes nothing and does not decay the state. Every exponent is ≤ 0 for
    g ≤ 0, so nothing overflows.

    Shapes and dtypes as `gated_delta_rule_recurrent`; chunk_size ≥ 1. Returns (o `[T, H, Dv]` fp32, final
    state `[H, Dk, Dv]` fp32); equals the recurrent form up to fp32 rounding.
    """
    _check(q, k, v, g, beta, state)
    T, H, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    N = (T + pad) // C

    def chunked(t: Tensor) -> Tensor:  # [T, H, ...] -> [H, N, C, ...] fp32, zero-padded
        t = t.float().transpose(0, 1)
        t = F.pad(t, (0, 0, 0, pad)) if t.dim() == 3 else F.pad(t, (0, pad))
        return t.reshape(H, N, C, *t.shape[2:])

    q, k, v, g, beta = (chunked(t) for t in (q, k, v, g, beta))

    G = g.cumsum(-1)  # [H, N, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    Dec = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, N, C, C]

    k_beta = k * beta[..., None]
    A = ((k_beta @ k.transpose(-1, -2)) * Dec).tril(-1)
    I_plus_A = A + torch.eye(C, dtype=torch.float32, device=q.device)
    U = torch.linalg.solve_triangular(I_plus_A, v * beta[..., None], upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(I_plus_A, k_beta * G.exp()[..., None], upper=False, unitriangular=True)
    QK = (q @ k.transpose(-1, -2)) * Dec
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]  # each key decayed to the end of its chunk

    S = q.new_zeros(H, Dk, Dv) if state is None else state.float()
    o = q.new_empty(H, N, C, Dv)
    for n in range(N):
        u = U[:, n] - W[:, n] @ S  # [H, C, Dv]
        o[:, n] = q_decayed[:, n] @ S + QK[:, n] @ u
        S = S * G[:, n, -1].exp()[:, None, None] + k_to_end[:, n].transpose(-1, -2) @ u
    o = o.reshape(H, N * C, Dv)[:, :T].transpose(0, 1).contiguous()
    return o, S
