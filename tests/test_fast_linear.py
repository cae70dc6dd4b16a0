"""The fast path's matrix products (`ninfer.fast.linear`) under the Triton interpreter: the switch that sends decode
steps to the integer GEMV's "dot" route (the tensor-core experiment) from a token count on."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ninfer.fast import linear
from ninfer.kernels.activation_quant import quantize_activations
from ninfer.quant import codec_for


def test_the_dot_route_switch_takes_that_route_from_its_token_count_with_the_same_bits(monkeypatch):
    fmt, shape = "q4_g64_fp16", (40, 2048)
    generator = torch.Generator().manual_seed(3)
    matrix = linear.PackedLinear(codec_for(fmt).encode(torch.randn(*shape, generator=generator) * 0.02), shape, fmt,
                                 linear.Scratch(torch.device("cpu"), torch.float32))
    inputs = {t: quantize_activations(torch.randn(t, shape[1], generator=generator)) for t in (2, 5)}
    plain = {t: matrix(x) for t, x in inputs.items()}
    routes = []
    gemv = linear.quant_linear_gemv

    def recorded(*args, route=None, **kwargs):
        routes.append(route)
        return gemv(*args, route=route, **kwargs)

    monkeypatch.setattr(linear, "quant_linear_gemv", recorded)
    monkeypatch.setattr(linear, "DOT_ROUTE_TOKENS", 4)
    for t, x in inputs.items():
        assert torch.equal(matrix(x), plain[t]), f"{t} tokens"
    assert routes == [None, "dot"]  # 2 tokens: the default route; 5: the dot route
