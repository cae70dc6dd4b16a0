"""RMSNorm variants of Qwen3.5: the zero-centred `Qwen3_5RMSNorm` and the gated `Qwen3_5RMSNormGated`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float, zero_centered: bool = True) -> Tensor:
    """RMSNorm over the last dim, computed in fp32 and cast back once.

    Math: `x̂ = x * rsqrt(mean(x²) + eps)`; `y = x̂ * (1 + w)` when `zero_centered` (Qwen3_5RMSNorm: the stored
    weight is the offset from one) else `y = x̂ * w`. `x`, the weight (`1 + w` formed in fp32) and the product
    are all fp32; only the result is rounded to `x.dtype` (transformers: `(x̂ * w).to(dtype)`, not Llama's
    `x̂.to(dtype) * w`).

    Shapes: x `[..., D]` (any float dtype), weight `[D]` (any float dtype); returns `[..., D]` in `x.dtype`.
    """
    xf = x.float()
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    scale = 1.0 + weight.float() if zero_centered else weight.float()
    return (x_hat * scale).to(x.dtype)


def rms_norm_gated(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gated RMSNorm of the Gated DeltaNet output (Qwen3_5RMSNormGated), over the last dim.

    Math: `x̂ = x * rsqrt(mean(x²) + eps)` in fp32; `y = (w * x̂.to(x.dtype)) * silu(z in fp32)`; result in
    `x.dtype`. The weight is plain (initialised to ones, no `1 +`). Cast order as in transformers: x̂ is
    rounded to `x.dtype` *before* the weight multiply (which runs in torch's promoted dtype of w and x, e.g.
    bf16 for a bf16 model), the silu gate and the product with it are fp32, and the result is rounded once more.
    Feed `x` in the activation dtype (transformers casts the delta-rule output back before this norm).

    Shapes: x, z `[..., D]` (same shape), weight `[D]`; returns `[..., D]` in `x.dtype`.
    """
    dtype = x.dtype
    xf = x.float()
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * x_hat.to(dtype)
    y = y * F.silu(z.float())
    return y.to(dtype)
