"""SwiGLU MLP, top-k softmax routing and the sparse MoE block (routed experts + gated shared expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def swiglu_mlp(x: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """`down(silu(x @ gateᵀ) * (x @ upᵀ))` with gate and up stacked in one matrix.

    Everything runs in the dtype of x and the weights (no upcast, as transformers' `Qwen3_5MLP` and experts).
    Shapes: x `[T, H]`; gate_up `[2I, H]`, rows [0, I) gate and [I, 2I) up; down `[H, I]`; returns `[T, H]`.
    """
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def route_top_k(router_logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Softmax routing: `p = softmax(logits)` in fp32, keep the top_k experts, renormalise them to sum 1.

    Ties go to torch.topk's choice (as transformers). Shapes: router_logits `[T, E]` (any float dtype);
    returns (weights `[T, top_k]` **fp32**, ids `[T, top_k]` int64), sorted by descending weight.
    transformers casts the weights to the logits' dtype before weighting experts; `moe_mlp` does that.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def moe_mlp(
    x: Tensor,
    router_shared_gate: Tensor,
    routed_gate_up: Tensor,
    routed_down: Tensor,
    shared_gate_up: Tensor,
    shared_down: Tensor,
    top_k: int,
) -> Tensor:
    """Sparse MoE block of Qwen3.5-MoE: `y = Σ_j w_j · expert_{id_j}(x) + sigmoid(x · s) · shared(x)`.

    `logits = x @ router_shared_gateᵀ`: columns 0..E-1 route (`route_top_k`, weights cast to x's dtype), column
    E is the shared-expert gate s. Experts are SwiGLU (`swiglu_mlp`). The routed sum accumulates in x's dtype,
    expert by expert in ascending id, then the gated shared expert is added (transformers' eager order).
    This reference loops over the experts hit by at least one token (a host sync; the fast path does not).

    Shapes: x `[T, H]`; router_shared_gate `[E+1, H]`; routed_gate_up `[E·2I, H]` (expert e: rows
    [e·2I, e·2I+I) gate, the next I rows up); routed_down `[E·H, I]` (expert e: rows [e·H, (e+1)·H));
    shared_gate_up `[2S, H]`; shared_down `[H, S]`; all one dtype. Returns `[T, H]` in x's dtype.
    """
    H = x.shape[1]
    E = router_shared_gate.shape[0] - 1
    inter = routed_down.shape[1]
    if routed_gate_up.shape != (E * 2 * inter, H) or routed_down.shape != (E * H, inter) or not 0 < top_k <= E:
        raise ValueError(
            f"moe_mlp: router_shared_gate {list(router_shared_gate.shape)}, routed_gate_up "
            f"{list(routed_gate_up.shape)}, routed_down {list(routed_down.shape)}, top_k {top_k} are inconsistent"
        )
    logits = F.linear(x, router_shared_gate)  # [T, E+1]
    weights, ids = route_top_k(logits[:, :E], top_k)
    weights = weights.to(x.dtype)
    gate_up = routed_gate_up.view(E, 2 * inter, H)
    down = routed_down.view(E, H, inter)

    y = torch.zeros_like(x)
    for e in ids.unique().tolist():
        token, slot = torch.where(ids == e)
        y.index_add_(0, token, swiglu_mlp(x[token], gate_up[e], down[e]) * weights[token, slot, None])
    shared = torch.sigmoid(logits[:, E:]) * swiglu_mlp(x, shared_gate_up, shared_down)
    return y + shared
