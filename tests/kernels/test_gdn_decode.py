"""The batched Gated DeltaNet decode step against the torch reference path of `Qwen35Model.gated_deltanet`: at a
tiny non-power-of-two config under the Triton interpreter on the CPU and on CUDA; on CUDA only (`pytest -m gpu`)
also at the real shapes of the qwen3.8-27b and qwen3.6-35b-a3b presets, fp32 and bf16, B = 1 and 8, four steps with
the pooled states carried, and on a bf16 state pool (`--state-dtype bf16`), which the Triton interpreter cannot
check: it rounds fp32 to bf16 by truncation."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from ninfer.kernels import gdn_decode
from ninfer.kernels.activation_quant import quantize_activations
from ninfer.kernels.conv1d import causal_conv1d
from ninfer.kernels.dense_linear import dense_linear_gemv
from ninfer.kernels.gated_delta_rule import gated_delta_rule_recurrent, l2_normalize
from ninfer.kernels.gdn_decode import gated_delta_decode
from ninfer.kernels.norm import rms_norm_gated


class Dims(NamedTuple):
    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int
    conv_kernel: int = 4

    @property
    def channels(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


class Tolerance(NamedTuple):
    atol: float
    rtol: float


TINY = Dims(k_heads=2, k_dim=16, v_heads=4, v_dim=24)
EPS = 1e-6
# fp32: both sides compute in fp32, only the summation order (and exp/rsqrt ulps) differ
FP32_OUT, FP32_STATE = Tolerance(1e-5, 1e-4), Tolerance(1e-6, 1e-5)


def reference_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """`causal_conv1d` row by row on the pooled windows (updated in place), as the model runs one sequence, in fp32
    and rounded once to x's dtype as the kernel rounds it (the model's bf16 conv rounds the conv and the silu
    apart: within an ulp)."""
    rows = []
    for b, slot in enumerate(slots):
        out, window = causal_conv1d(x[b : b + 1].float(), weight.float(), conv_state[slot].float())
        conv_state[slot] = window.to(conv_state.dtype)
        rows.append(out.to(x.dtype))
    return torch.cat(rows)


def reference_gdn(mixed: torch.Tensor, z: torch.Tensor, a_b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                  norm_weight: torch.Tensor, state: torch.Tensor, slots: list[int], d: Dims) -> torch.Tensor:
    """`Qwen35Model.gated_deltanet` after the conv for T = 1, row by row on the pooled states (updated in place)."""
    key_rows = d.k_heads * d.k_dim
    rows = []
    for b, slot in enumerate(slots):
        m = mixed[b : b + 1]
        q = m[:, :key_rows].reshape(1, d.k_heads, d.k_dim)
        k = m[:, key_rows : 2 * key_rows].reshape(1, d.k_heads, d.k_dim)
        v = m[:, 2 * key_rows :].reshape(1, d.v_heads, d.v_dim)
        a, b_gate = a_b[b : b + 1, : d.v_heads], a_b[b : b + 1, d.v_heads :]
        beta = torch.sigmoid(b_gate).float()
        g = -torch.exp(a_log) * F.softplus(a.float() + dt_bias)
        q = l2_normalize(q) * d.k_dim**-0.5
        k = l2_normalize(k)
        repeat = d.v_heads // d.k_heads
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
        o, state[slot] = gated_delta_rule_recurrent(q, k, v.float(), g, beta, state[slot])
        o = rms_norm_gated(o.to(mixed.dtype), z[b : b + 1].reshape(1, d.v_heads, d.v_dim), norm_weight, EPS)
        rows.append(o.reshape(1, -1))
    return torch.cat(rows)


def decode_and_compare(d: Dims, slots: list[int], pool: int, steps: int, dtype: torch.dtype, device: torch.device,
                       out_tol: Tolerance, state_tol: Tolerance, slot_dtype: torch.dtype = torch.int64,
                       ab_in_kernel: bool = False, state_dtype: torch.dtype = torch.float32) -> None:
    """`steps` decode steps of B = len(slots) rows through both paths, the pools carried: each step the GDN outputs
    and the recurrent states must agree, the conv windows exactly, and the slots no row uses must stay bit-identical.
    With `ab_in_kernel` the kernel computes a/b from the projection's input and weight, and the reference gets
    their product rounded to the activation dtype. The recurrent pools hold `state_dtype` (the reference rounds its
    fp32 state into a bf16 pool after each token, as the kernel stores it)."""
    generator = torch.Generator().manual_seed(len(slots) * 1000 + steps)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(device)

    B, C, K = len(slots), d.channels, d.conv_kernel
    value_rows = d.v_heads * d.v_dim
    weight = randn(C, K, scale=0.5).to(dtype)
    a_log, dt_bias = randn(d.v_heads, scale=0.5), randn(d.v_heads)
    norm_weight = (1.0 + randn(d.v_dim, scale=0.1)).to(dtype)
    conv_pool = randn(pool, C, K - 1).to(dtype)
    state_pool = randn(pool, d.v_heads, d.k_dim, d.v_dim, scale=0.1).to(state_dtype)
    ref_conv_pool, ref_state_pool = conv_pool.clone(), state_pool.clone()
    initial_conv, initial_state = conv_pool.clone(), state_pool.clone()
    untouched = [s for s in range(pool) if s not in slots]
    slot_tensor = torch.tensor(slots, dtype=slot_dtype, device=device)
    for step in range(steps):
        # row-slice views with a row stride, as the model's projections give them
        x = randn(B, C + 7).to(dtype)[:, 3 : 3 + C]
        z = randn(B, 2 * value_rows).to(dtype)[:, value_rows:]
        a_b = randn(B, 2 * d.v_heads + 5, scale=2.0).to(dtype)[:, 5:]
        if ab_in_kernel:  # a 40-lane input row view; the projection scaled to a/b of about the same size
            ab_input = (randn(B, 43).to(dtype)[:, 3:], randn(2 * d.v_heads, 40, scale=0.3).to(dtype))
            a_b = (ab_input[0].float() @ ab_input[1].float().T).to(dtype)

        mixed = reference_conv(x, weight, ref_conv_pool, slots)
        expected = reference_gdn(mixed, z, a_b, a_log, dt_bias, norm_weight, ref_state_pool, slots, d)
        got = gated_delta_decode(x, z, ab_input if ab_in_kernel else a_b, weight, conv_pool, a_log, dt_bias,
                                 norm_weight, state_pool, slot_tensor, d.k_heads, d.k_dim, d.v_heads, d.v_dim, EPS)
        assert got.dtype == dtype and got.shape == (B, value_rows) and state_pool.dtype == state_dtype
        torch.testing.assert_close(got, expected, atol=out_tol.atol, rtol=out_tol.rtol,
                                   msg=lambda m, step=step: f"gdn out, step {step}: {m}")
        assert torch.equal(conv_pool, ref_conv_pool), f"conv windows differ after step {step}"
        torch.testing.assert_close(state_pool, ref_state_pool, atol=state_tol.atol, rtol=state_tol.rtol,
                                   msg=lambda m, step=step: f"recurrent state, step {step}: {m}")
    for s in untouched:
        assert torch.equal(state_pool[s], initial_state[s]), f"state slot {s} was written"
        assert torch.equal(conv_pool[s], initial_conv[s]), f"conv slot {s} was written"


# the interpreter runs fp32 only; on CUDA bf16 too
DEVICE_DTYPES = [pytest.param("cpu", torch.float32, id="interpreter-fp32"),
                 pytest.param("cuda", torch.float32, marks=pytest.mark.gpu, id="cuda-fp32"),
                 pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu, id="cuda-bf16")]


@pytest.mark.parametrize("slots", [[0], [2, 0, 5]])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_decode_steps_equal_the_reference(device, slots, slot_dtype):
    decode_and_compare(TINY, slots, pool=6, steps=3, dtype=torch.float32, device=device, out_tol=FP32_OUT,
                       state_tol=FP32_STATE, slot_dtype=slot_dtype)


def test_decode_handles_one_key_head_per_value_head(device):
    decode_and_compare(Dims(k_heads=3, k_dim=8, v_heads=3, v_dim=8, conv_kernel=2), [1, 3], pool=4, steps=2,
                       dtype=torch.float32, device=device, out_tol=FP32_OUT, state_tol=FP32_STATE)


def test_decode_computes_the_a_b_projection_in_the_kernel(device):
    decode_and_compare(Dims(k_heads=2, k_dim=16, v_heads=4, v_dim=64), [1, 3], pool=4, steps=2,
                       dtype=torch.float32, device=device, out_tol=FP32_OUT, state_tol=FP32_STATE, ab_in_kernel=True)


@pytest.mark.parametrize("hidden", [40, 256, 300])
def test_the_a_b_product_in_the_kernel_has_the_pairwise_dense_gemvs_bits(device, hidden):
    """The runner computes a/b in the delta-rule launch for one row and through `dense_linear_gemv(pairwise=True)`
    for more: both must give a token the same bits (a verify step's rows equal the decode steps'), here checked on
    the whole outputs and states (K of 40, 256 and 300 lanes: padded tiles of 64, 256 and 512)."""
    d = Dims(k_heads=2, k_dim=16, v_heads=4, v_dim=32)
    generator = torch.Generator().manual_seed(hidden)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device)

    B = 3
    mixed, z = randn(B, d.channels), randn(B, d.v_heads * d.v_dim)
    x, weight = randn(B, hidden), randn(2 * d.v_heads, hidden, scale=hidden**-0.5)
    conv = (randn(d.channels, d.conv_kernel), randn(4, d.channels, d.conv_kernel - 1))
    vectors = (randn(d.v_heads), randn(d.v_heads), randn(d.v_dim))
    state, slots = randn(4, d.v_heads, d.k_dim, d.v_dim, scale=0.1), torch.tensor([2, 0, 3], device=device)
    args = (d.k_heads, d.k_dim, d.v_heads, d.v_dim, EPS)
    separate_state, fused_state = state.clone(), state.clone()
    separate = gated_delta_decode(mixed, z, dense_linear_gemv(x, weight, torch.float32, pairwise=True), conv[0],
                                  conv[1].clone(), *vectors, separate_state, slots, *args)
    fused = gated_delta_decode(mixed, z, (x, weight), conv[0], conv[1].clone(), *vectors, fused_state, slots, *args)
    assert torch.equal(fused, separate) and torch.equal(fused_state, separate_state)
    assert not torch.equal(fused_state, state)  # the step ran


def test_decode_splits_a_heads_state_into_column_tiles(device):
    # v_dim 64: two 32-column programs per head, whose outputs meet again in the gated norm
    decode_and_compare(Dims(k_heads=2, k_dim=16, v_heads=4, v_dim=64), [2, 0], pool=4, steps=2,
                       dtype=torch.float32, device=device, out_tol=FP32_OUT, state_tol=FP32_STATE)


@pytest.mark.parametrize("slots", [[1], [2, 0, 3]])
def test_the_hook_before_the_delta_rule_runs_after_the_conv(device, slots):
    """`before_delta_rule` is where the runner joins the graph branch that computes a/b: the delta rule must read
    a/b as the hook leaves it, and where the conv has a launch of its own (more than FUSED_CONV_SEQUENCES
    sequences) that launch must already have read x, so the hook may overlap the conv with the branch."""
    d, B = TINY, len(slots)
    generator = torch.Generator().manual_seed(B)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    x, z, a_b = randn(B, d.channels), randn(B, d.v_heads * d.v_dim), randn(B, 2 * d.v_heads)
    weight, conv = randn(d.channels, d.conv_kernel), randn(4, d.channels, d.conv_kernel - 1)
    vectors = (randn(d.v_heads), randn(d.v_heads), randn(d.v_dim))
    state, slot_tensor = randn(4, d.v_heads, d.k_dim, d.v_dim) * 0.1, torch.tensor(slots, device=device)
    args = (d.k_heads, d.k_dim, d.v_heads, d.v_dim, EPS)
    expected_conv, expected_state = conv.clone(), state.clone()
    expected = gated_delta_decode(x, z, a_b, weight, expected_conv, *vectors, expected_state, slot_tensor, *args)
    late_a_b, late_x, calls = torch.full_like(a_b, float("nan")), x.clone(), []

    def hook():
        calls.append(1)
        late_a_b.copy_(a_b)  # the branch's a/b lands only now
        if B > gdn_decode.FUSED_CONV_SEQUENCES:
            late_x.zero_()  # the conv launch has read x already

    got = gated_delta_decode(late_x, z, late_a_b, weight, conv, *vectors, state, slot_tensor, *args,
                             before_delta_rule=hook)
    assert calls == [1]
    assert torch.equal(got, expected) and torch.equal(state, expected_state) and torch.equal(conv, expected_conv)


# records made by the norm kernel, with a zero record padding 96 lanes to 128, and by the quantizer after it
@pytest.mark.parametrize(("v_heads", "v_dim"), [(4, 64), (3, 32), (4, 24)])
def test_decode_output_comes_with_the_quantizers_records(device, v_heads, v_dim):
    d, B = Dims(k_heads=1, k_dim=16, v_heads=v_heads, v_dim=v_dim), 2
    generator = torch.Generator().manual_seed(v_dim)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    mixed, z, a_b = randn(B, d.channels), randn(B, d.v_heads * v_dim), randn(B, 2 * d.v_heads)
    weight, conv = randn(d.channels, d.conv_kernel), randn(3, d.channels, d.conv_kernel - 1)
    vectors = (randn(d.v_heads), randn(d.v_heads), randn(v_dim))
    state, slots = randn(3, d.v_heads, d.k_dim, v_dim), torch.tensor([2, 0], device=device)
    args = (d.k_heads, d.k_dim, d.v_heads, v_dim, EPS)
    plain = gated_delta_decode(mixed, z, a_b, weight, conv.clone(), *vectors, state.clone(), slots, *args)
    acts = gated_delta_decode(mixed, z, a_b, weight, conv, *vectors, state, slots, *args, quantize=True)
    assert torch.equal(acts.source, plain)
    assert torch.equal(acts.blocks, quantize_activations(plain).blocks)


def test_conv_window_shifts_in_the_new_inputs_exactly(device):
    """Each step moves the window one input on (exact copies), over more steps than the window is long."""
    d, K = TINY, TINY.conv_kernel
    C = d.channels
    pool = torch.randn(3, C, K - 1, device=device)
    initial = pool.clone()
    weight = torch.randn(C, K, device=device)
    z, a_b = torch.randn(2, d.v_heads * d.v_dim, device=device), torch.randn(2, 2 * d.v_heads, device=device)
    vectors = (torch.zeros(d.v_heads, device=device), torch.zeros(d.v_heads, device=device),
               torch.ones(d.v_dim, device=device))
    state, slots = torch.zeros(3, d.v_heads, d.k_dim, d.v_dim, device=device), torch.tensor([2, 0], device=device)
    inputs = [torch.randn(2, C, device=device) for _ in range(K + 1)]
    for step, x in enumerate(inputs):
        gated_delta_decode(x, z, a_b, weight, pool, *vectors, state, slots, d.k_heads, d.k_dim, d.v_heads, d.v_dim,
                           EPS)
        for row, slot in enumerate((2, 0)):
            history = torch.cat([initial[slot], torch.stack([x_[row] for x_ in inputs[: step + 1]], dim=1)], dim=1)
            assert torch.equal(pool[slot], history[:, -(K - 1) :]), f"slot {slot} after step {step}"
    assert torch.equal(pool[1], initial[1])


def test_kernels_refuse_inconsistent_inputs():
    d, B = TINY, 2
    mixed, z, a_b = torch.randn(B, d.channels), torch.randn(B, d.v_heads * d.v_dim), torch.randn(B, 2 * d.v_heads)
    conv = (torch.randn(d.channels, d.conv_kernel), torch.zeros(3, d.channels, d.conv_kernel - 1))
    vectors = (torch.zeros(d.v_heads), torch.zeros(d.v_heads), torch.ones(d.v_dim))
    state, slots = torch.zeros(3, d.v_heads, d.k_dim, d.v_dim), torch.tensor([0, 1])
    dims = (d.k_heads, d.k_dim, d.v_heads, d.v_dim, EPS)
    with pytest.raises(ValueError, match="x must be"):
        gated_delta_decode(mixed[:, :-1], z, a_b, *conv, *vectors, state, slots, *dims)
    with pytest.raises(ValueError, match="unit column stride"):
        gated_delta_decode(mixed, z.T.contiguous().T, a_b, *conv, *vectors, state, slots, *dims)
    with pytest.raises(ValueError, match="state must be"):
        gated_delta_decode(mixed, z, a_b, *conv, *vectors, state.double(), slots, *dims)
    with pytest.raises(ValueError, match="multiple of k_heads"):
        gated_delta_decode(mixed, z, a_b, *conv, *vectors, state, slots, 3, d.k_dim, d.v_heads, d.v_dim, EPS)
    with pytest.raises(ValueError, match="slots must be"):
        gated_delta_decode(mixed, z, a_b, *conv, *vectors, state, slots.float(), *dims)
    with pytest.raises(ValueError, match="conv_state must be"):
        gated_delta_decode(mixed, z, a_b, conv[0], torch.zeros(3, d.channels, d.conv_kernel), *vectors, state, slots,
                           *dims)
    with pytest.raises(ValueError, match="conv_state must be"):
        gated_delta_decode(mixed, z, a_b, conv[0], conv[1].bfloat16(), *vectors, state, slots, *dims)
    with pytest.raises(ValueError, match="conv_weight must be"):
        gated_delta_decode(mixed, z, a_b, conv[0][1:], conv[1], *vectors, state, slots, *dims)


@pytest.mark.parametrize("tokens", [1, 3, 5])
@pytest.mark.parametrize("ab_in_kernel", [False, True])
def test_several_tokens_per_sequence_with_snapshots_equal_single_steps(device, tokens, ab_in_kernel):
    """T tokens per sequence in one call (speculative verify) equal T single-token steps, and the snapshot slots
    hold the conv window and recurrent state after each token; the running slot holds the last ones."""
    d, slots, pool = TINY, [4, 1], 16
    generator = torch.Generator().manual_seed(tokens)
    batch = len(slots)
    x = torch.randn(batch * tokens, d.channels, generator=generator)
    weight = torch.randn(d.channels, d.conv_kernel, generator=generator) * 0.5
    z = torch.randn(batch * tokens, d.v_heads * d.v_dim, generator=generator)
    ab_input = (torch.randn(batch * tokens, 24, generator=generator),
                torch.randn(2 * d.v_heads, 24, generator=generator))
    a_b = ab_input[0] @ ab_input[1].T if ab_in_kernel else torch.randn(batch * tokens, 2 * d.v_heads,
                                                                        generator=generator)
    a_log, dt_bias = torch.randn(d.v_heads, generator=generator) * 0.3, torch.randn(d.v_heads, generator=generator)
    norm_weight = 1 + 0.1 * torch.randn(d.v_dim, generator=generator)
    conv = torch.randn(pool, d.channels, d.conv_kernel - 1, generator=generator)
    state = torch.randn(pool, d.v_heads, d.k_dim, d.v_dim, generator=generator) * 0.1
    snapshots = torch.tensor([[6 + t for t in range(tokens)], [11 + t for t in range(tokens)]])
    ref_conv, ref_state = conv.clone(), state.clone()
    expected_out, expected_conv, expected_state = [], {}, {}
    for b, slot in enumerate(slots):
        for t in range(tokens):
            row = b * tokens + t
            mixed = reference_conv(x[row : row + 1], weight, ref_conv, [slot])
            out = reference_gdn(mixed, z[row : row + 1], a_b[row : row + 1], a_log, dt_bias, norm_weight, ref_state,
                                [slot], d)
            expected_out.append(out)
            expected_conv[int(snapshots[b, t])] = ref_conv[slot].clone()
            expected_state[int(snapshots[b, t])] = ref_state[slot].clone()
    x, weight, z, a_b, a_log, dt_bias, norm_weight, conv, state, snapshots = (
        t.to(device) for t in (x, weight, z, a_b, a_log, dt_bias, norm_weight, conv, state, snapshots))
    a_b = tuple(t.to(device) for t in ab_input) if ab_in_kernel else a_b
    slot_tensor = torch.tensor(slots, device=device)
    out = gated_delta_decode(x, z, a_b, weight, conv, a_log, dt_bias, norm_weight, state, slot_tensor, d.k_heads,
                             d.k_dim, d.v_heads, d.v_dim, EPS, tokens=tokens, snapshot_slots=snapshots)
    out, conv, state = out.cpu(), conv.cpu(), state.cpu()
    torch.testing.assert_close(out, torch.cat(expected_out), atol=FP32_OUT.atol, rtol=FP32_OUT.rtol)
    for slot, window in expected_conv.items():
        assert torch.equal(conv[slot], window), f"conv snapshot slot {slot}"
        torch.testing.assert_close(state[slot], expected_state[slot], atol=FP32_STATE.atol, rtol=FP32_STATE.rtol)
    for slot in slots:
        assert torch.equal(conv[slot], ref_conv[slot])
        torch.testing.assert_close(state[slot], ref_state[slot], atol=FP32_STATE.atol, rtol=FP32_STATE.rtol)
    untouched = [s for s in range(pool) if s not in slots and s not in expected_conv]
    assert torch.equal(conv[untouched], ref_conv[untouched]) and torch.equal(state[untouched], ref_state[untouched])


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES, indirect=["device"])
@pytest.mark.parametrize("d", [TINY, Dims(k_heads=2, k_dim=64, v_heads=4, v_dim=64)])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_a_several_token_call_has_the_bits_of_one_token_calls(device, d, dtype, state_dtype):
    """Speculative verify must give each token the bits decoding it alone would: T tokens per sequence in one call
    against T calls of one token, outputs, windows and states bit for bit (the kernels of the two differ in what
    the compiler may fuse; a bf16 state is rounded after each token in both). The interpreter rounds fp32 to bf16
    otherwise than the GPU and torch (it truncates), so the bf16 state's values are checked on CUDA only
    (`test_decode_steps_on_a_bf16_state_pool_equal_the_reference_rounding_it_per_token`); its bits between the two
    calls hold here too."""
    generator = torch.Generator().manual_seed(d.v_dim)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device)

    batch, tokens, pool = 2, 4, 6
    x = randn(batch, tokens, d.channels).to(dtype)
    z = randn(batch, tokens, d.v_heads * d.v_dim).to(dtype)
    a_b = randn(batch, tokens, 2 * d.v_heads).to(dtype)
    weight = randn(d.channels, d.conv_kernel, scale=0.5).to(dtype)
    vectors = (randn(d.v_heads, scale=0.5), randn(d.v_heads), (1 + randn(d.v_dim, scale=0.1)).to(dtype))
    conv = randn(pool, d.channels, d.conv_kernel - 1).to(dtype)
    state = randn(pool, d.v_heads, d.k_dim, d.v_dim).to(state_dtype)
    slots, dims = torch.tensor([4, 1], device=device), (d.k_heads, d.k_dim, d.v_heads, d.v_dim, EPS)
    together_conv, together_state = conv.clone(), state.clone()
    together = gated_delta_decode(x.flatten(0, 1), z.flatten(0, 1), a_b.flatten(0, 1), weight, together_conv,
                                  *vectors, together_state, slots, *dims, tokens=tokens)
    alone = [gated_delta_decode(x[:, t].contiguous(), z[:, t].contiguous(), a_b[:, t].contiguous(), weight, conv,
                                *vectors, state, slots, *dims) for t in range(tokens)]
    assert torch.equal(together, torch.stack(alone, dim=1).flatten(0, 1))
    assert torch.equal(together_conv, conv) and torch.equal(together_state, state)


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES, indirect=["device"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_the_conv_in_the_delta_rule_launch_has_the_bits_of_its_own_launch(device, monkeypatch, dtype, tokens):
    """Steps of up to FUSED_CONV_SEQUENCES sequences make the conv in the delta-rule launch, larger ones in a launch
    of its own: a token's output, windows, states and snapshots must not depend on which."""
    d = Dims(k_heads=2, k_dim=64, v_heads=4, v_dim=64)
    generator = torch.Generator().manual_seed(tokens)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device)

    batch, pool = 2, 12
    rows = batch * tokens
    x, z = randn(rows, d.channels).to(dtype), randn(rows, d.v_heads * d.v_dim).to(dtype)
    a_b, weight = randn(rows, 2 * d.v_heads).to(dtype), randn(d.channels, d.conv_kernel, scale=0.5).to(dtype)
    vectors = (randn(d.v_heads, scale=0.5), randn(d.v_heads), (1 + randn(d.v_dim, scale=0.1)).to(dtype))
    conv, state = randn(pool, d.channels, d.conv_kernel - 1).to(dtype), randn(pool, d.v_heads, d.k_dim, d.v_dim)
    slots = torch.tensor([4, 1], device=device)
    snapshots = torch.arange(6, 6 + rows, device=device).view(batch, tokens) if tokens > 1 else None
    results = []
    for fused_up_to in (batch, 0):
        monkeypatch.setattr(gdn_decode, "FUSED_CONV_SEQUENCES", fused_up_to)
        pools = (conv.clone(), state.clone())
        out = gated_delta_decode(x, z, a_b, weight, pools[0], *vectors, pools[1], slots, d.k_heads, d.k_dim,
                                 d.v_heads, d.v_dim, EPS, tokens=tokens, snapshot_slots=snapshots, quantize=True)
        results.append((out.source, out.blocks, *pools))
    for fused, apart in zip(*results, strict=True):
        assert torch.equal(fused, apart)
    assert not torch.equal(results[0][2], conv)  # the windows moved on


# --- on CUDA only (`pytest -m gpu`): the presets' real shapes -----------------------------------------------------

SHAPES = {
    "qwen3.8-27b": Dims(k_heads=16, k_dim=128, v_heads=48, v_dim=128),  # conv channels 10240
    "qwen3.6-35b-a3b": Dims(k_heads=16, k_dim=128, v_heads=32, v_dim=128),  # conv channels 8192
}
# fp32 state: the GPU's approximate exp/rsqrt and 128-term sums; bf16 state: both sides see the same bf16 inputs,
# but a one-ulp fp32 sigmoid difference can round beta to a neighbouring bf16 value (one part in 256 of one update)
CUDA_FP32_STATE, BF16_STATE = Tolerance(1e-5, 1e-4), Tolerance(1e-3, 1e-3)
# bf16 outputs: both sides round the conv output once (their fp32 sums may differ in order), and the norm rounds o,
# x̂ and w·x̂, so a flipped rounding moves the result by an ulp or two (2^-8 relative each)
BF16_OUT = Tolerance(2e-2, 3e-2)
# a bf16 state pool: both sides round the same fp32 state into it after each token, but a last-bit fp32 difference
# can round an element to the neighbouring bf16 value (2^-8 relative), which the next steps carry
BF16_POOL_STATE = Tolerance(1e-3, 8e-3)


@pytest.fixture
def exact_fp32_reference():
    # F.conv1d and matmuls would otherwise round to TF32; saved and restored by hand: monkeypatch cannot delete the
    # attribute it finds missing from torch.backends.cuda.matmul's __dict__
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_fp32_reference")
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [[5], [9, 0, 3, 14, 7, 1, 12, 4]])
@pytest.mark.parametrize("ab_in_kernel", [False, True])  # a/b given, or computed in the delta rule's launch
def test_decode_steps_on_cuda_equal_the_reference(name, dtype, slots, ab_in_kernel):
    fp32 = dtype == torch.float32
    decode_and_compare(SHAPES[name], slots, pool=16, steps=4, dtype=dtype, device=torch.device("cuda"),
                       out_tol=FP32_OUT if fp32 else BF16_OUT, state_tol=CUDA_FP32_STATE if fp32 else BF16_STATE,
                       ab_in_kernel=ab_in_kernel)


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_fp32_reference")
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("slots", [[5], [9, 0, 3, 14, 7, 1, 12, 4]])
def test_decode_steps_on_a_bf16_state_pool_equal_the_reference_rounding_it_per_token(name, slots):
    decode_and_compare(SHAPES[name], slots, pool=16, steps=4, dtype=torch.bfloat16, device=torch.device("cuda"),
                       out_tol=BF16_OUT, state_tol=BF16_POOL_STATE, state_dtype=torch.bfloat16)
