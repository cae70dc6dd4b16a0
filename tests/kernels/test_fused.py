"""The fused decode-step kernels against the torch reference ops, under the Triton interpreter (fp32) on the CPU
and in bf16 on CUDA (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from ninfer.kernels.activation_quant import quantize_activations
from ninfer.kernels.fused import add_rms_norm, moe_combine, route_top_k, sigmoid_mul, silu_mul
from ninfer.kernels.moe import route_top_k as route_top_k_reference
from ninfer.kernels.norm import rms_norm

TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}  # relative, largest element, by the activations' dtype


def _close(got, expected, dtype):
    scale = expected.float().abs().max()
    return float((got.float() - expected.float()).abs().max() / scale) <= TOLERANCE[dtype]


@pytest.mark.parametrize("width", [64, 300, 5120])
@pytest.mark.parametrize("residual", [True, False])
def test_add_rms_norm_quantizes_its_output_as_the_quantizer_does(device, activation_dtype, width, residual):
    generator = torch.Generator().manual_seed(width)
    x = torch.randn(3, width, generator=generator).to(device, activation_dtype)
    h = torch.randn(3, width, generator=generator).to(device, activation_dtype) if residual else None
    weight = torch.randn(width, generator=generator).to(device, activation_dtype)
    total, plain = add_rms_norm(x, h, weight, 1e-6)
    total_q, acts = add_rms_norm(x, h, weight, 1e-6, quantize=True)
    assert torch.equal(total_q, total) and torch.equal(acts.source, plain)
    assert torch.equal(acts.blocks, quantize_activations(plain).blocks)


@pytest.mark.parametrize("width", [64, 1500, 2048])
def test_silu_mul_quantizes_its_output_as_the_quantizer_does(device, activation_dtype, width):
    generator = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(3, 2 * width, generator=generator) * 3).to(device, activation_dtype)
    plain = silu_mul(gate_up)
    acts = silu_mul(gate_up, quantize=True)
    assert torch.equal(acts.source, plain)
    assert torch.equal(acts.blocks, quantize_activations(plain).blocks)


@pytest.mark.parametrize("width", [64, 1500, 6144])
def test_sigmoid_mul_quantizes_its_output_as_the_quantizer_does(device, activation_dtype, width):
    generator = torch.Generator().manual_seed(width)
    x, gate = ((torch.randn(3, width, generator=generator) * 3).to(device, activation_dtype) for _ in range(2))
    plain = sigmoid_mul(x, gate)
    acts = sigmoid_mul(x, gate, quantize=True)
    assert torch.equal(acts.source, plain)
    assert torch.equal(acts.blocks, quantize_activations(plain).blocks)


@pytest.mark.parametrize("width", [256, 300, 5120])
@pytest.mark.parametrize("rows", [3, 70])  # a decode step's rows spread over several programs each; prefill's not
def test_add_rms_norm_equals_add_then_rms_norm(device, activation_dtype, width, rows):
    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(rows, width, generator=generator) * 4).to(device, activation_dtype)
    h = torch.randn(rows, 2 * width, generator=generator).to(device, activation_dtype)[:, :width]  # a strided view
    weight = (torch.randn(width, generator=generator) * 0.1).to(device, activation_dtype)
    total, normed = add_rms_norm(x, h, weight, 1e-6)
    assert torch.equal(total, x + h)
    assert _close(normed, rms_norm(x + h, weight, 1e-6), activation_dtype)
    same, only_norm = add_rms_norm(x, None, weight, 1e-6)
    assert same is x and _close(only_norm, rms_norm(x, weight, 1e-6), activation_dtype)


def test_add_rms_norm_gives_a_row_the_same_bits_in_every_decode_step_size(device, activation_dtype):
    """A decode or verify step has 1 to 64 rows (MAX_GEMV_TOKENS); a sequence's row must come out the same whatever
    the others in its step (batch invariance), so every such step takes one program layout."""
    generator = torch.Generator().manual_seed(64)
    x = (torch.randn(64, 5120, generator=generator) * 4).to(device, activation_dtype)
    h = torch.randn(64, 5120, generator=generator).to(device, activation_dtype)
    weight = (torch.randn(5120, generator=generator) * 0.1).to(device, activation_dtype)
    _, alone = add_rms_norm(x[:1], h[:1], weight, 1e-6, quantize=True)
    for rows in (2, 63, 64):
        _, batched = add_rms_norm(x[:rows], h[:rows], weight, 1e-6, quantize=True)
        assert torch.equal(batched.source[:1], alone.source), f"{rows} rows"
        assert torch.equal(batched.blocks[:1], alone.blocks), f"{rows} rows"


def test_silu_mul_and_sigmoid_mul_equal_the_torch_ops(device, activation_dtype):
    generator = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(4, 2 * 1500, generator=generator) * 3).to(device, activation_dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert _close(silu_mul(gate_up), F.silu(gate) * up, activation_dtype)
    x = torch.randn(4, 1200, generator=generator).to(device, activation_dtype)
    projection = torch.randn(4, 2400, generator=generator).to(device, activation_dtype)
    assert _close(sigmoid_mul(x, projection[:, :1200]), x * torch.sigmoid(projection[:, :1200]), activation_dtype)


def test_fused_kernels_refuse_non_row_major_inputs():
    with pytest.raises(ValueError, match="stride 1"):
        silu_mul(torch.randn(8, 4).T)


def test_moe_combine_equals_weighted_sum_plus_gated_shared(device, activation_dtype):
    generator = torch.Generator().manual_seed(2)
    batch, top_k, width = 3, 8, 2048
    routed = torch.randn(batch * top_k, width, generator=generator).to(device, activation_dtype)
    weights = torch.softmax(torch.randn(batch, top_k, generator=generator), -1).to(device, activation_dtype)
    shared = torch.randn(batch, width, generator=generator).to(device, activation_dtype)
    logits = torch.randn(batch, 257, generator=generator).to(device, activation_dtype)
    expected = (routed.float().view(batch, top_k, width) * weights.float()[:, :, None]).sum(1)
    expected += torch.sigmoid(logits[:, 256:].float()) * shared.float()
    assert _close(moe_combine(routed, weights, shared, logits[:, 256:]), expected, activation_dtype)


@pytest.mark.parametrize(("experts", "top_k"), [(256, 8), (16, 2), (10, 3)])
def test_route_top_k_equals_softmax_top_k_renormalised(device, activation_dtype, experts, top_k):
    generator = torch.Generator().manual_seed(experts)
    # the last column: the shared gate
    logits = torch.randn(5, experts + 1, generator=generator).to(device, activation_dtype)
    weights, ids = route_top_k(logits, experts, top_k)
    expected_weights, expected_ids = route_top_k_reference(logits[:, :experts], top_k)
    # bf16 logits can tie, and then either order (or either of two tied experts at the cut) is right: compare the
    # choices in id order, and where the ids differ the logits they name must be equal
    ids, order = ids.long().sort(-1)
    expected_ids, expected_order = expected_ids.sort(-1)
    differ = ids != expected_ids
    assert torch.equal(logits.gather(1, ids)[differ], logits.gather(1, expected_ids)[differ])
    expected_weights = expected_weights.gather(1, expected_order).to(activation_dtype)
    assert _close(weights.gather(1, order), expected_weights, activation_dtype)
    with pytest.raises(ValueError, match="does not fit"):
        route_top_k(logits, experts + 2, top_k)
