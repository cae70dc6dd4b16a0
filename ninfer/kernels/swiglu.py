"""The SwiGLU activation, silu(gate) · up, as the GPU kernels compute it: one definition, so that every kernel that
applies it (`fused.silu_mul`, and the stripe GEMV that applies it to its own input at one token) gives the same
bits. The rounding follows `moe.swiglu_mlp` in the activation dtype: silu in fp32 rounded to gate's dtype, then the
product rounded to it."""

from __future__ import annotations

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

if triton is not None:

    @triton.jit
    def swiglu(gate, up):
        """silu(gate) · up elementwise, in gate's dtype (up in the same dtype)."""
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        return (silu * up).to(gate.dtype)
