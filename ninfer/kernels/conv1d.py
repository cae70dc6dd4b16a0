"""Depthwise causal conv1d + SiLU of the Gated DeltaNet input, with a carried window of past inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_conv1d(x: Tensor, weight: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
    """`silu(depthwise causal conv)` over T new tokens, continuing from the previous K-1 inputs.

    Math: with `u = [state | xᵀ]` (`[C, K-1+T]`, columns in time order), `out[t, c] = silu(Σ_j w[c, j] ·
    u[c, t + j])`, i.e. `out[t] = Σ_j w[:, j] · in[t-K+1+j]`; no bias. The conv and the silu run in the
    weight's dtype, the output is cast to `x.dtype` (transformers' `causal_conv1d_fn/_update`). A fresh
    sequence (`state=None`) sees zeros, like transformers' left zero-padding.

    Shapes: x `[T, C]`, T ≥ 1 (decode T = 1 and T < K-1 included); weight `[C, K]` (the checkpoint's
    `conv1d.weight[:, 0, :]`); state `[C, K-1]` or None. Returns (out `[T, C]` in `x.dtype`, new state
    `[C, K-1]` in `x.dtype` = the last K-1 columns of u, pre-conv inputs).
    """
    T, C = x.shape
    K = weight.shape[1]
    if weight.shape[0] != C or T < 1:
        raise ValueError(f"causal_conv1d: x {list(x.shape)} and weight {list(weight.shape)} disagree (or T = 0)")
    if state is None:
        state = x.new_zeros(C, K - 1)
    elif state.shape != (C, K - 1):
        raise ValueError(f"causal_conv1d: state must be [{C}, {K - 1}], got {list(state.shape)}")
    window = torch.cat((state.to(x.dtype), x.T), dim=1)  # [C, K-1+T]
    out = F.conv1d(window[None].to(weight.dtype), weight[:, None, :], groups=C)[0]  # [C, T]
    out = F.silu(out).to(x.dtype)
    return out.T.contiguous(), window[:, T:].contiguous()
