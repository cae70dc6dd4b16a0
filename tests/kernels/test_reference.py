"""The torch reference kernels against naive float64 math and against transformers' qwen3_5 / qwen3_5_moe code."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

from ninfer.kernels.attention import causal_attention, prefill_attention
from ninfer.kernels.conv1d import causal_conv1d
from ninfer.kernels.gated_delta_rule import gated_delta_rule_chunked, gated_delta_rule_recurrent, l2_normalize
from ninfer.kernels.moe import moe_mlp, route_top_k, swiglu_mlp
from ninfer.kernels.norm import rms_norm, rms_norm_gated
from ninfer.kernels.rope import apply_rope, rope_cos_sin

# Errors are measured as max|actual - expected| / max|expected| (see rel_err).
FP32_REL = 1e-5  # fp32 compute against float64, or against transformers' fp32 code
FP32_SCAN_REL = 5e-5  # two fp32 delta-rule evaluations that sum in different orders (chunk sizes, split points)
BF16_ULP_REL = 2**-8  # bf16 against transformers with the same cast order: at most one bf16 rounding step apart


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --------------------------------------------------------------------------------------------------- norm


def test_rms_norm_matches_float64_both_weightings():
    x, w = torch.randn(5, 64), torch.randn(64) * 0.1
    xd = x.double()
    x_hat = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert rel_err(rms_norm(x, w, 1e-6), x_hat * (1 + w.double())) < FP32_REL
    assert rel_err(rms_norm(x, w, 1e-6, zero_centered=False), x_hat * w.double()) < FP32_REL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_bit_exact_with_transformers(dtype):
    module = hf.Qwen3_5RMSNorm(64, eps=1e-6)
    module.weight.data.normal_(0, 0.3)
    module = module.to(dtype)
    x = (torch.randn(7, 3, 64) * 3).to(dtype)
    out = rms_norm(x, module.weight, 1e-6)
    assert out.dtype == dtype
    assert torch.equal(out, module(x))


def test_rms_norm_gated_matches_float64():
    x, z, w = torch.randn(6, 32), torch.randn(6, 32), torch.rand(32) + 0.5
    xd = x.double()
    expected = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double() * F.silu(z.double())
    assert rel_err(rms_norm_gated(x, z, w, 1e-6), expected) < FP32_REL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gated_is_bit_exact_with_transformers(dtype):
    module = hf.Qwen3_5RMSNormGated(32, eps=1e-6)
    module.weight.data.uniform_(0.5, 1.5)
    module = module.to(dtype)
    x, z = torch.randn(9, 32).to(dtype), torch.randn(9, 32).to(dtype)
    out = rms_norm_gated(x, z, module.weight, 1e-6)
    assert out.dtype == dtype
    assert torch.equal(out, module(x, z))


def test_rms_norm_gated_rounds_x_hat_before_the_weight():
    # With an fp32 weight on bf16 activations the weight multiply is fp32, but x̂ is still rounded to bf16 first.
    x, z, w = torch.randn(4, 32).bfloat16(), torch.randn(4, 32).bfloat16(), torch.rand(32) + 0.5
    xf = x.float()
    x_hat_bf16 = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert torch.equal(rms_norm_gated(x, z, w, 1e-6), (w * x_hat_bf16 * F.silu(z.float())).bfloat16())


# --------------------------------------------------------------------------------------------------- rope

HEAD_DIM, ROTARY_DIM, THETA, SECTION = 32, 16, 1e4, [3, 3, 2]  # 8 frequencies: T 0,3,6  H 1,4,7  W 2,5


def hf_rotary(dtype_probe: torch.Tensor, position_ids: torch.Tensor, section: list[int]):
    config = Qwen3_5TextConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=HEAD_DIM,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": THETA,
            "partial_rotary_factor": ROTARY_DIM / HEAD_DIM,
            "mrope_section": section,
        },
    )
    return hf.Qwen3_5TextRotaryEmbedding(config)(dtype_probe, position_ids)


def test_rope_cos_sin_matches_float64_per_axis_assignment():
    positions = torch.stack([torch.arange(10), torch.arange(10) * 3 + 1, 50 - torch.arange(10)])
    theta = 100.0  # a small base, so that every frequency turns visibly over these positions
    cos, sin = rope_cos_sin(positions, ROTARY_DIM, theta, SECTION)
    inv_freq = theta ** (-torch.arange(0, ROTARY_DIM, 2, dtype=torch.float64) / ROTARY_DIM)
    axis = [0, 1, 2, 0, 1, 2, 0, 1]  # j%3==1 and j<9 -> H; j%3==2 and j<6 -> W; else T
    angle = torch.stack([positions[axis[j]].double() * inv_freq[j] for j in range(ROTARY_DIM // 2)], dim=-1)
    angle = torch.cat([angle, angle], dim=-1)
    assert cos.shape == sin.shape == (10, ROTARY_DIM)
    assert rel_err(cos, angle.cos()) < FP32_REL and rel_err(sin, angle.sin()) < FP32_REL


def test_rope_text_positions_equal_three_equal_rows():
    pos = torch.arange(5, 17)
    flat = rope_cos_sin(pos, ROTARY_DIM, THETA)
    mrope = rope_cos_sin(pos.expand(3, -1), ROTARY_DIM, THETA, SECTION)
    assert torch.equal(flat[0], mrope[0]) and torch.equal(flat[1], mrope[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("section", [SECTION, [4, 2, 2], [6, 1, 1]])  # short H/W sections hand j back to T
def test_rope_cos_sin_is_bit_exact_with_transformers_mrope(dtype, section):
    positions = torch.stack([torch.arange(12), torch.arange(12) % 4 + 7, torch.arange(12) // 4 + 7])
    hf_cos, hf_sin = hf_rotary(torch.empty(1, dtype=dtype), positions[:, None, :], section)
    cos, sin = rope_cos_sin(positions, ROTARY_DIM, THETA, section, dtype=dtype)
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])


def test_rope_cos_sin_real_section_matches_transformers():
    # Qwen3.5's real geometry: head_dim 256, rotary 64, sections [11, 11, 10], theta 1e7.
    config = Qwen3_5TextConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )
    positions = torch.stack([torch.arange(40) + 1000, torch.arange(40) % 5 + 1000, torch.arange(40) // 5 + 1000])
    hf_cos, hf_sin = hf.Qwen3_5TextRotaryEmbedding(config)(torch.empty(1), positions[:, None, :])
    cos, sin = rope_cos_sin(positions, 64, 1e7, [11, 11, 10])
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_is_bit_exact_with_transformers(dtype):
    positions = torch.stack([torch.arange(6), torch.arange(6) + 2, torch.arange(6) * 2])
    cos, sin = rope_cos_sin(positions, ROTARY_DIM, THETA, SECTION, dtype=dtype)
    q, k = torch.randn(6, 4, HEAD_DIM).to(dtype), torch.randn(6, 2, HEAD_DIM).to(dtype)
    hf_q, hf_k = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(apply_rope(q, cos, sin), hf_q[0].transpose(0, 1))
    assert torch.equal(apply_rope(k, cos, sin), hf_k[0].transpose(0, 1))


def test_apply_rope_matches_float64_rotation():
    pos = torch.arange(100, 107)
    x = torch.randn(7, 3, HEAD_DIM)
    out = apply_rope(x, *rope_cos_sin(pos, ROTARY_DIM, THETA))
    half = ROTARY_DIM // 2
    inv_freq = THETA ** (-torch.arange(0, ROTARY_DIM, 2, dtype=torch.float64) / ROTARY_DIM)
    angle = (pos.double()[:, None] * inv_freq)[:, None, :]  # pair (i, i + half) rotates by angle i
    a, b = x[..., :half].double(), x[..., half:ROTARY_DIM].double()
    expected = torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], dim=-1)
    assert rel_err(out[..., :ROTARY_DIM], expected) < FP32_REL
    assert torch.equal(out[..., ROTARY_DIM:], x[..., ROTARY_DIM:])
    assert torch.equal(apply_rope(x, *rope_cos_sin(torch.zeros(7, dtype=torch.long), ROTARY_DIM, THETA)), x)


# ------------------------------------------------------------------------------------------------- conv1d

C, K = 12, 4


def conv_float64(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    u = torch.cat([state.double(), x.double().T], dim=1)  # [C, K-1+T]
    out = torch.stack([sum(w[:, j].double() * u[:, t + j] for j in range(K)) for t in range(x.shape[0])])
    return F.silu(out)


def test_causal_conv1d_matches_float64_and_returns_last_inputs():
    x, w, state = torch.randn(9, C), torch.randn(C, K), torch.randn(C, K - 1)
    out, new_state = causal_conv1d(x, w, state)
    assert out.shape == (9, C) and rel_err(out, conv_float64(x, w, state)) < FP32_REL
    assert torch.equal(new_state, x[-(K - 1) :].T)
    out0, _ = causal_conv1d(x, w, None)
    assert rel_err(out0, conv_float64(x, w, torch.zeros(C, K - 1))) < FP32_REL


@pytest.mark.parametrize(
    ("dtype", "weight_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_causal_conv1d_matches_transformers_prefill_and_decode(dtype, weight_dtype):
    x, w = torch.randn(10, C).to(dtype), torch.randn(C, K).to(weight_dtype)
    out, state = causal_conv1d(x, w, None)
    hf_out = hf.causal_conv1d_fn(x.T[None], w, activation="silu")[0].T
    tol = FP32_REL if dtype == torch.float32 else BF16_ULP_REL
    assert out.dtype == state.dtype == dtype and rel_err(out, hf_out) < tol
    if dtype != weight_dtype:  # conv and silu run in the weight's fp32, then one rounding to bf16
        assert torch.equal(out, hf_out)
    # transformers' decode cache keeps K columns; the oldest one does not reach the next output.
    step = torch.randn(1, C).to(dtype)
    hf_state = torch.cat([torch.randn(C, 1).to(dtype), state], dim=1)[None].clone()
    hf_step = hf.causal_conv1d_update(step.T[None], hf_state, w, activation="silu")[0].T
    out_step, new_state = causal_conv1d(step, w, state)
    assert rel_err(out_step, hf_step) < tol
    assert torch.equal(new_state, hf_state[0, :, 1:])


def test_causal_conv1d_carried_state_equals_one_call_including_short_chunks():
    x, w = torch.randn(11, C), torch.randn(C, K)
    full, full_state = causal_conv1d(x, w, None)
    pieces, state = [], None
    for lo, hi in [(0, 1), (1, 3), (3, 4), (4, 9), (9, 11)]:  # T = 1, 2 (< K-1), 1, 5, 2
        out, state = causal_conv1d(x[lo:hi], w, state)
        pieces.append(out)
    assert rel_err(torch.cat(pieces), full) < FP32_REL
    assert torch.equal(state, full_state)
    # a call shorter than K-1 keeps part of the old window in the new state
    old = torch.randn(C, K - 1)
    _, short_state = causal_conv1d(x[:1], w, old)
    assert torch.equal(short_state, torch.cat([old[:, 1:], x[:1].T], dim=1))


# -------------------------------------------------------------------------------------- gated delta rule

H, DK, DV = 3, 16, 8


def delta_inputs(T: int, dtype=torch.float32, heads: int = H):
    q = l2_normalize(torch.randn(T, heads, DK)) * DK**-0.5
    k = l2_normalize(torch.randn(T, heads, DK))
    v = torch.randn(T, heads, DV)
    g = -F.softplus(torch.randn(T, heads)) * 0.5  # log-decay in (-inf, 0)
    beta = torch.rand(T, heads)
    return tuple(t.to(dtype) for t in (q, k, v, g, beta))


def delta_float64(q, k, v, g, beta, state=None):
    """The literal recurrence, one head and one token at a time, in float64."""
    T, heads, _ = k.shape
    S = torch.zeros(heads, DK, DV, dtype=torch.float64) if state is None else state.double().clone()
    o = torch.zeros(T, heads, DV, dtype=torch.float64)
    for t in range(T):
        for h in range(heads):
            qt, kt, vt = q[t, h].double(), k[t, h].double(), v[t, h].double()
            S[h] = S[h] * torch.exp(g[t, h].double())
            S[h] = S[h] + torch.outer(kt, (vt - kt @ S[h]) * beta[t, h].double())
            o[t, h] = qt @ S[h]
    return o, S


@pytest.mark.parametrize("with_state", [False, True])
def test_delta_rule_recurrent_and_chunked_match_float64(with_state):
    inputs = delta_inputs(70)
    state = torch.randn(H, DK, DV) if with_state else None
    o64, s64 = delta_float64(*inputs, state)
    for fn in (gated_delta_rule_recurrent, gated_delta_rule_chunked):
        o, s = fn(*inputs, state)
        assert o.dtype == s.dtype == torch.float32 and o.shape == (70, H, DV) and s.shape == (H, DK, DV)
        assert rel_err(o, o64) < FP32_REL and rel_err(s, s64) < FP32_REL, fn.__name__


@pytest.mark.parametrize("T", [1, 3, 63, 64, 65, 130, 200])
@pytest.mark.parametrize("with_state", [False, True])
def test_delta_rule_chunked_equals_recurrent(T, with_state):
    inputs = delta_inputs(T)
    state = torch.randn(H, DK, DV) if with_state else None
    o_rec, s_rec = gated_delta_rule_recurrent(*inputs, state)
    o_chk, s_chk = gated_delta_rule_chunked(*inputs, state)
    assert rel_err(o_chk, o_rec) < FP32_SCAN_REL and rel_err(s_chk, s_rec) < FP32_SCAN_REL


@pytest.mark.parametrize("fn", [gated_delta_rule_recurrent, gated_delta_rule_chunked])
def test_delta_rule_split_sequence_with_carried_state_equals_one_call(fn):
    q, k, v, g, beta = delta_inputs(150)
    init = torch.randn(H, DK, DV)
    o_full, s_full = fn(q, k, v, g, beta, init)
    o1, s1 = fn(q[:70], k[:70], v[:70], g[:70], beta[:70], init)
    o2, s2 = fn(q[70:], k[70:], v[70:], g[70:], beta[70:], s1)
    assert rel_err(torch.cat([o1, o2]), o_full) < FP32_SCAN_REL and rel_err(s2, s_full) < FP32_SCAN_REL


def test_delta_rule_chunk_sizes_agree():
    inputs = delta_inputs(100)
    state = torch.randn(H, DK, DV)
    o64, s64 = gated_delta_rule_chunked(*inputs, state, chunk_size=64)
    for chunk in (16, 32):
        o, s = gated_delta_rule_chunked(*inputs, state, chunk_size=chunk)
        assert rel_err(o, o64) < FP32_SCAN_REL and rel_err(s, s64) < FP32_SCAN_REL, chunk


def test_delta_rule_strong_decay_stays_finite_and_forgets():
    q, k, v, g, beta = delta_inputs(80)
    g[40] = -200.0  # exp(g) underflows to 0: the state before token 40 is forgotten
    state = torch.randn(H, DK, DV) * 100
    o, s = gated_delta_rule_chunked(q, k, v, g, beta, state)
    o_fresh, s_fresh = gated_delta_rule_chunked(q[40:], k[40:], v[40:], g[40:], beta[40:], None)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o[40:], o_fresh) < FP32_SCAN_REL and rel_err(s, s_fresh) < FP32_SCAN_REL


def test_delta_rule_bf16_inputs_compute_in_fp32():
    inputs = delta_inputs(90, dtype=torch.bfloat16)
    o64, s64 = delta_float64(*inputs)
    for fn in (gated_delta_rule_recurrent, gated_delta_rule_chunked):
        o, s = fn(*inputs)
        assert o.dtype == s.dtype == torch.float32
        assert rel_err(o, o64) < FP32_REL and rel_err(s, s64) < FP32_REL, fn.__name__


@pytest.mark.parametrize("T", [1, 5, 100])
@pytest.mark.parametrize("with_state", [False, True])
def test_delta_rule_matches_transformers_kernels(T, with_state):
    # transformers takes raw q, k with Hk key heads, normalises them in the kernel and expands to Hv heads.
    hk, hv = 2, 4
    q_raw, k_raw = torch.randn(T, hk, DK), torch.randn(T, hk, DK)
    _, _, v, g, beta = delta_inputs(T, heads=hv)
    state = torch.randn(hv, DK, DV) if with_state else None
    q = (l2_normalize(q_raw) * DK**-0.5).repeat_interleave(hv // hk, dim=1)
    k = l2_normalize(k_raw).repeat_interleave(hv // hk, dim=1)
    hf_args = (q_raw[None], k_raw[None], v[None], g[None], beta[None])
    hf_state = None if state is None else state[None]
    for ours, theirs in [
        (gated_delta_rule_chunked, hf.torch_chunk_gated_delta_rule),
        (gated_delta_rule_recurrent, hf.torch_recurrent_gated_delta_rule),
    ]:
        o, s = ours(q, k, v, g, beta, state)
        hf_o, hf_s = theirs(*hf_args, initial_state=hf_state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert rel_err(o, hf_o[0]) < FP32_SCAN_REL and rel_err(s, hf_s[0]) < FP32_SCAN_REL, ours.__name__


def test_l2_normalize_matches_transformers_and_float64():
    x = torch.randn(5, 4, 16).bfloat16()
    out = l2_normalize(x)
    xd = x.double()
    assert out.dtype == torch.float32
    assert torch.equal(out, hf.l2norm(x.float()))
    assert rel_err(out, xd / torch.sqrt((xd * xd).sum(-1, keepdim=True) + 1e-6)) < FP32_REL
    assert torch.equal(l2_normalize(torch.zeros(3, 8)), torch.zeros(3, 8))


# ---------------------------------------------------------------------------------------------- attention


def attention_float64(q, k, v, q_start, scale):
    T, nh, _ = q.shape
    group = nh // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t in range(T):
        for h in range(nh):
            keys, values = k[: q_start + t + 1, h // group].double(), v[: q_start + t + 1, h // group].double()
            p = torch.softmax(keys @ q[t, h].double() * scale, dim=0)
            out[t, h] = p @ values
    return out


def test_causal_attention_matches_float64_with_gqa_and_offset():
    q, k, v = torch.randn(5, 6, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    out = causal_attention(q, k, v, q_start=7, scale=16**-0.5)
    assert out.shape == (5, 6, 16) and rel_err(out, attention_float64(q, k, v, 7, 16**-0.5)) < FP32_REL


@pytest.mark.parametrize("q_start", [0, 7])
def test_prefill_attention_matches_float64_with_gqa_and_offset(q_start):
    """The fast path's fused prefill attention (lower-right causal bias, no materialised mask): the masking of
    `causal_attention`, against float64, with and without earlier keys."""
    q, k, v = torch.randn(5, 6, 16), torch.randn(q_start + 5, 2, 16), torch.randn(q_start + 5, 2, 16)
    out = prefill_attention(q, k, v, q_start=q_start, scale=16**-0.5)
    assert out.shape == (5, 6, 16) and rel_err(out, attention_float64(q, k, v, q_start, 16**-0.5)) < FP32_REL
    with pytest.raises(ValueError, match="do not fit"):
        prefill_attention(q, k[1:], v[1:], q_start=q_start, scale=1.0)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_attention_matches_transformers_eager(dtype):
    T, nh, kvh, hd = 9, 4, 2, 16
    q, k, v = (torch.randn(T, n, hd).to(dtype) for n in (nh, kvh, kvh))
    mask = torch.full((T, T), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]
    module = types.SimpleNamespace(num_key_value_groups=nh // kvh, training=False)
    hf_out, _ = hf.eager_attention_forward(
        module, *(t.transpose(0, 1)[None] for t in (q, k, v)), mask, scaling=hd**-0.5
    )
    out = causal_attention(q, k, v, q_start=0, scale=hd**-0.5)
    assert out.dtype == dtype
    assert rel_err(out, hf_out[0]) < (FP32_REL if dtype == torch.float32 else BF16_ULP_REL)


def test_causal_attention_decode_step_equals_rows_of_full_pass():
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 1, 8), torch.randn(10, 1, 8)
    full = causal_attention(q, k, v, q_start=0, scale=0.3)
    for start in (6, 9):
        part = causal_attention(q[start:], k, v, q_start=start, scale=0.3)
        assert rel_err(part, full[start:]) < FP32_REL
    first = causal_attention(q[:1], k[:1], v[:1], q_start=0, scale=0.3)
    assert torch.allclose(first, v[:1].expand(1, 4, 8), rtol=0, atol=1e-6)  # one key: its value


def test_causal_attention_gqa_maps_query_head_to_kv_head_by_integer_division():
    nh, kvh = 6, 3
    q, k = torch.randn(4, nh, 8), torch.randn(4, kvh, 8)
    v = torch.arange(kvh, dtype=torch.float32)[None, :, None].expand(4, kvh, 8)  # kv head j holds the value j
    out = causal_attention(q, k, v, q_start=0, scale=1.0)
    expected_head = (torch.arange(nh) // (nh // kvh)).float()[None, :, None].expand(4, nh, 8)
    assert torch.allclose(out, expected_head, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- moe

HID, E, INTER, SHARED, TOP_K = 32, 8, 16, 24, 2


def test_swiglu_mlp_matches_transformers_mlp_and_float64():
    config = Qwen3_5TextConfig(hidden_size=HID, intermediate_size=INTER)
    mlp = hf.Qwen3_5MLP(config, INTER)
    x = torch.randn(5, HID)
    gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
    out = swiglu_mlp(x, gate_up, mlp.down_proj.weight.detach())
    with torch.no_grad():
        assert rel_err(out, mlp(x)) < FP32_REL
    xd, gd, ud, dd = x.double(), mlp.gate_proj.weight.double(), mlp.up_proj.weight.double(), mlp.down_proj.weight
    assert rel_err(out, (F.silu(xd @ gd.T) * (xd @ ud.T)) @ dd.double().T) < FP32_REL


def test_route_top_k_renormalises_the_softmax_top_k():
    logits = torch.randn(20, E)  # fp32: no ties between experts
    weights, ids = route_top_k(logits, TOP_K)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (20, TOP_K)
    assert route_top_k(logits.bfloat16(), TOP_K)[0].dtype == torch.float32  # fp32 weights whatever the logits
    probs = torch.softmax(logits.double(), dim=-1)
    expected_ids = probs.argsort(dim=-1, descending=True)[:, :TOP_K]
    assert torch.equal(ids, expected_ids)
    top = probs.gather(1, expected_ids)
    assert rel_err(weights, top / top.sum(-1, keepdim=True)) < FP32_REL
    assert torch.allclose(weights.sum(-1), torch.ones(20), rtol=0, atol=1e-6)


def moe_block(dtype=torch.float32):
    config = Qwen3_5MoeTextConfig(
        hidden_size=HID,
        moe_intermediate_size=INTER,
        shared_expert_intermediate_size=SHARED,
        num_experts=E,
        num_experts_per_tok=TOP_K,
    )
    config._experts_implementation = "eager"
    block = Qwen3_5MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return block.to(dtype)


def ninfer_moe_weights(block):
    return dict(
        router_shared_gate=torch.cat([block.gate.weight, block.shared_expert_gate.weight]).detach(),
        routed_gate_up=block.experts.gate_up_proj.detach().reshape(E * 2 * INTER, HID),
        routed_down=block.experts.down_proj.detach().reshape(E * HID, INTER),
        shared_gate_up=torch.cat([block.shared_expert.gate_proj.weight, block.shared_expert.up_proj.weight]).detach(),
        shared_down=block.shared_expert.down_proj.weight.detach(),
        top_k=TOP_K,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_mlp_matches_transformers_sparse_moe_block(dtype):
    block = moe_block(dtype)
    x = torch.randn(13, HID).to(dtype)
    with torch.no_grad():
        expected = block(x[None])[0]
    out = moe_mlp(x, **ninfer_moe_weights(block))
    assert out.dtype == dtype
    assert rel_err(out, expected) < (FP32_REL if dtype == torch.float32 else BF16_ULP_REL)


def test_moe_mlp_matches_float64_per_token_and_the_shared_gate_applies():
    block = moe_block()
    weights = ninfer_moe_weights(block)
    x = torch.randn(6, HID)
    xd = x.double()
    gate_up = weights["routed_gate_up"].double().view(E, 2 * INTER, HID)
    down = weights["routed_down"].double().view(E, HID, INTER)
    logits = xd @ weights["router_shared_gate"].double().T
    shared = swiglu_mlp(xd, weights["shared_gate_up"].double(), weights["shared_down"].double())
    expected = torch.zeros(6, HID, dtype=torch.float64)
    for t in range(6):
        p = torch.softmax(logits[t, :E], dim=0)
        ids = p.argsort(descending=True)[:TOP_K]
        for e in ids.tolist():
            expected[t] += p[e] / p[ids].sum() * swiglu_mlp(xd[t : t + 1], gate_up[e], down[e])[0]
    expected += torch.sigmoid(logits[:, E:]) * shared
    assert rel_err(moe_mlp(x, **weights), expected) < FP32_REL


def test_moe_mlp_shared_expert_is_gated_by_sigmoid_of_the_last_router_row():
    weights = ninfer_moe_weights(moe_block())
    x = torch.randn(6, HID)
    routed_only = moe_mlp(x, **dict(weights, shared_down=torch.zeros(HID, SHARED)))
    shared = swiglu_mlp(x, weights["shared_gate_up"], weights["shared_down"])
    gate = torch.sigmoid(x @ weights["router_shared_gate"][E])[:, None]
    assert rel_err(moe_mlp(x, **weights) - routed_only, gate * shared) < FP32_REL
    half_open = weights["router_shared_gate"].clone()
    half_open[E] = 0.0  # sigmoid(0) = 1/2, and the routing rows are untouched
    assert rel_err(moe_mlp(x, **dict(weights, router_shared_gate=half_open)) - routed_only, shared / 2) < FP32_REL
