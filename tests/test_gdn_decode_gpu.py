"""The batched Gated DeltaNet decode kernels on CUDA (`pytest -m gpu`): equal to the torch reference path at the
real shapes of the qwen3.8-27b and qwen3.6-35b-a3b presets, fp32 and bf16, B = 1 and 8, four steps with the pooled
states carried (the comparison itself is tests/test_gdn_decode.py's `decode_and_compare`), and on a bf16 state
pool (`--state-dtype bf16`), which the Triton interpreter cannot check: it rounds fp32 to bf16 by truncation."""

from __future__ import annotations

import pytest
import torch

from tests.test_gdn_decode import FP32_OUT, Dims, Tolerance, decode_and_compare

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPES = {
    "qwen3.8-27b": Dims(k_heads=16, k_dim=128, v_heads=48, v_dim=128),  # conv channels 10240
    "qwen3.6-35b-a3b": Dims(k_heads=16, k_dim=128, v_heads=32, v_dim=128),  # conv channels 8192
}
# fp32 state: the GPU's approximate exp/rsqrt and 128-term sums; bf16 state: both sides see the same bf16 inputs,
# but a one-ulp fp32 sigmoid difference can round beta to a neighbouring bf16 value (one part in 256 of one update)
FP32_STATE, BF16_STATE = Tolerance(1e-5, 1e-4), Tolerance(1e-3, 1e-3)
# bf16 outputs: both sides round the conv output once (their fp32 sums may differ in order), and the norm rounds o,
# x̂ and w·x̂, so a flipped rounding moves the result by an ulp or two (2^-8 relative each)
BF16_OUT = Tolerance(2e-2, 3e-2)
# a bf16 state pool: both sides round the same fp32 state into it after each token, but a last-bit fp32 difference
# can round an element to the neighbouring bf16 value (2^-8 relative), which the next steps carry
BF16_POOL_STATE = Tolerance(1e-3, 8e-3)


@pytest.fixture(autouse=True)
def _exact_fp32_reference(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # F.conv1d would otherwise round to TF32
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [[5], [9, 0, 3, 14, 7, 1, 12, 4]])
@pytest.mark.parametrize("ab_in_kernel", [False, True])  # a/b given, or computed in the delta rule's launch
def test_decode_steps_on_cuda_equal_the_reference(name, dtype, slots, ab_in_kernel):
    fp32 = dtype == torch.float32
    decode_and_compare(SHAPES[name], slots, pool=16, steps=4, dtype=dtype, device="cuda",
                       out_tol=FP32_OUT if fp32 else BF16_OUT, state_tol=FP32_STATE if fp32 else BF16_STATE,
                       ab_in_kernel=ab_in_kernel)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("slots", [[5], [9, 0, 3, 14, 7, 1, 12, 4]])
def test_decode_steps_on_a_bf16_state_pool_equal_the_reference_rounding_it_per_token(name, slots):
    decode_and_compare(SHAPES[name], slots, pool=16, steps=4, dtype=torch.bfloat16, device="cuda", out_tol=BF16_OUT,
                       state_tol=BF16_POOL_STATE, state_dtype=torch.bfloat16)
