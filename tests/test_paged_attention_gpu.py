"""The paged-KV decode kernels on CUDA (`pytest -m gpu`) at the attention shapes of the qwen3.8-27b and
qwen3.6-35b-a3b presets, bf16 activations, every kv dtype, contexts up to 8192 positions, and a decode step
captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.fused import sigmoid_mul
from ninfer.kernels.norm import rms_norm
from ninfer.kernels.paged_attention import (
    paged_attention_decode,
    paged_attention_reference,
    qk_norm_rope,
    quantize_kv_reference,
    write_kv,
    write_kv_reference,
)
from ninfer.kernels.rope import apply_rope, rope_cos_sin

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPES = {"27b": (24, 4), "35b": (16, 2)}  # (heads, kv_heads); head_dim 256, rotary_dim 64, theta 1e7 for both
HEAD_DIM, ROTARY_DIM, THETA, EPS = 256, 64, 10_000_000.0, 1e-6
KV_DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
LENGTHS = {1: [8192], 8: [1, 100, 1000, 4096, 8192, 33, 7000, 2500]}
MAX_LENGTH = 8192
ROPE_BF16_REL = 1e-2  # bf16 output (one rounding) against the fp32 oracle
DECODE_BF16_REL = 1e-2  # K/V tiles and probabilities rounded to bf16, accumulation fp32, against the fp32 oracle


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("batch", [1, 8])
def test_qk_norm_rope_on_cuda(shape, batch):
    heads, kv_heads = SHAPES[shape]
    generator = torch.Generator(device="cuda").manual_seed(batch)
    query_key = torch.randn(batch, (heads + kv_heads) * HEAD_DIM, device="cuda", generator=generator)
    query_key = query_key.to(torch.bfloat16)
    q_norm = torch.randn(HEAD_DIM, device="cuda", generator=generator) * 0.1
    k_norm = torch.randn(HEAD_DIM, device="cuda", generator=generator) * 0.1
    positions = torch.randint(0, 262_144, (batch,), device="cuda", generator=generator)
    inv_freq = 1.0 / (THETA ** (torch.arange(0, ROTARY_DIM, 2, dtype=torch.float) / ROTARY_DIM))
    q, k = qk_norm_rope(query_key, q_norm, k_norm, positions, heads, kv_heads, HEAD_DIM, ROTARY_DIM,
                        inv_freq.cuda(), EPS)
    cos, sin = rope_cos_sin(positions, ROTARY_DIM, THETA)
    x = query_key.float()
    expected_q = apply_rope(rms_norm(x[:, : heads * HEAD_DIM].reshape(batch, heads, HEAD_DIM), q_norm, EPS), cos, sin)
    expected_k = apply_rope(rms_norm(x[:, heads * HEAD_DIM :].reshape(batch, kv_heads, HEAD_DIM), k_norm, EPS), cos,
                            sin)
    assert q.dtype == k.dtype == torch.bfloat16
    assert relative_error(q, expected_q) < ROPE_BF16_REL
    assert relative_error(k, expected_k) < ROPE_BF16_REL


def empty_pool(kv_dtype: torch.dtype, num_pages: int, page: int, kv_heads: int):
    pages = torch.zeros(num_pages, page, kv_heads, HEAD_DIM, device="cuda").to(kv_dtype)
    scales = None
    if kv_dtype != torch.bfloat16:
        scales = torch.zeros(num_pages, page, kv_heads, HEAD_DIM // 64, dtype=torch.float16, device="cuda")
    return pages, scales


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_write_kv_on_cuda_stores_the_reference_bits(shape, kv_dtype):
    heads, kv_heads = SHAPES[shape]
    batch, page, max_pages = 8, 64, 8
    generator = torch.Generator(device="cuda").manual_seed(3)
    table = torch.randperm(batch * max_pages, device="cuda", generator=generator).reshape(batch, max_pages).int()
    positions = torch.randint(0, max_pages * page, (batch,), device="cuda", generator=generator)
    k = torch.randn(batch, kv_heads, HEAD_DIM, device="cuda", generator=generator).to(torch.bfloat16)
    gate_value = torch.randn(batch, (heads + kv_heads) * HEAD_DIM, device="cuda", generator=generator)
    v = gate_value.to(torch.bfloat16)[:, heads * HEAD_DIM :].reshape(batch, kv_heads, HEAD_DIM)
    got_k, got_k_scales = empty_pool(KV_DTYPES[kv_dtype], batch * max_pages, page, kv_heads)
    got_v, got_v_scales = empty_pool(KV_DTYPES[kv_dtype], batch * max_pages, page, kv_heads)
    want_k, want_k_scales = empty_pool(KV_DTYPES[kv_dtype], batch * max_pages, page, kv_heads)
    want_v, want_v_scales = empty_pool(KV_DTYPES[kv_dtype], batch * max_pages, page, kv_heads)
    write_kv(k, v, got_k, got_v, got_k_scales, got_v_scales, table, positions)
    write_kv_reference(k, v, want_k, want_v, want_k_scales, want_v_scales, table, positions)
    assert torch.equal(bits(got_k), bits(want_k)) and torch.equal(bits(got_v), bits(want_v))
    if got_k_scales is not None:
        assert torch.equal(got_k_scales, want_k_scales) and torch.equal(got_v_scales, want_v_scales)


def filled_cache(kv_dtype: torch.dtype, lengths: list[int], page: int, kv_heads: int, generator: torch.Generator):
    """A block table of shuffled pages and K/V pools holding random keys/values at positions < lengths[b]."""
    batch, max_pages = len(lengths), MAX_LENGTH // page
    table = torch.randperm(batch * max_pages, device="cuda", generator=generator).reshape(batch, max_pages).int()
    pools = []
    for _ in range(2):
        dense = torch.randn(batch * max_pages, page, kv_heads, HEAD_DIM, device="cuda", generator=generator)
        pages, scales = (dense.to(kv_dtype), None) if kv_dtype == torch.bfloat16 else quantize_kv_reference(
            dense, kv_dtype)
        pools.append((pages, scales))
    (key_pages, key_scales), (value_pages, value_scales) = pools
    return (key_pages, value_pages, key_scales, value_scales), table


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_on_cuda_equals_the_reference(shape, batch, page, kv_dtype):
    heads, kv_heads = SHAPES[shape]
    generator = torch.Generator(device="cuda").manual_seed(batch * page)
    cache, table = filled_cache(KV_DTYPES[kv_dtype], LENGTHS[batch], page, kv_heads, generator)
    lengths = torch.tensor(LENGTHS[batch], dtype=torch.int32, device="cuda")
    q = (torch.randn(batch, heads, HEAD_DIM, device="cuda", generator=generator) * 2).to(torch.bfloat16)
    scale = HEAD_DIM**-0.5
    got = paged_attention_decode(q, *cache, table, lengths, scale, MAX_LENGTH)
    expected = paged_attention_reference(q.float(), *cache, table, lengths, scale)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    error = relative_error(got, expected)
    assert error < DECODE_BF16_REL, f"{shape} B={batch} page {page} {kv_dtype}: relative error {error:.2e}"


@pytest.mark.parametrize("max_length", [MAX_LENGTH, 32], ids=["many splits", "one split"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gated_decode_on_cuda_gives_the_bits_of_sigmoid_mul_after_it(shape, max_length):
    heads, kv_heads = SHAPES[shape]
    batch, width = 8, heads * HEAD_DIM
    generator = torch.Generator(device="cuda").manual_seed(max_length)
    lengths = [min(length, max_length) for length in LENGTHS[batch]]
    cache, table = filled_cache(torch.int8, lengths, 64, kv_heads, generator)
    q = (torch.randn(batch, heads, HEAD_DIM, device="cuda", generator=generator) * 2).to(torch.bfloat16)
    gate_value = (torch.randn(batch, 2 * width, device="cuda", generator=generator) * 3).to(torch.bfloat16)
    gate = gate_value[:, :width]  # a column slice of the gate/value projection, as in the model
    args = (q, *cache, table, torch.tensor(lengths, dtype=torch.int32, device="cuda"), HEAD_DIM**-0.5, max_length)
    o = paged_attention_decode(*args)
    plain = paged_attention_decode(*args, gate=gate)
    acts = paged_attention_decode(*args, gate=gate, quantize=True)
    expected = sigmoid_mul(o.view(batch, -1), gate, quantize=True)
    assert torch.equal(plain, expected.source) and torch.equal(acts.source, expected.source)
    assert torch.equal(acts.blocks, expected.blocks)


def test_decode_step_replays_in_a_cuda_graph():
    heads, kv_heads = SHAPES["27b"]
    batch, page = 8, 64
    generator = torch.Generator(device="cuda").manual_seed(11)
    cache, table = filled_cache(torch.int8, [MAX_LENGTH] * batch, page, kv_heads, generator)
    lengths = torch.tensor(LENGTHS[batch], dtype=torch.int32, device="cuda")
    query_key = torch.randn(batch, (heads + kv_heads) * HEAD_DIM, device="cuda", generator=generator)
    query_key = query_key.to(torch.bfloat16)
    value = torch.randn(batch, kv_heads, HEAD_DIM, device="cuda", generator=generator).to(torch.bfloat16)
    norm = torch.zeros(HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    inv_freq = (1.0 / (THETA ** (torch.arange(0, ROTARY_DIM, 2, dtype=torch.float) / ROTARY_DIM))).cuda()

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        positions = lengths - 1
        q, k = qk_norm_rope(query_key, norm, norm, positions, heads, kv_heads, HEAD_DIM, ROTARY_DIM, inv_freq, EPS)
        write_kv(k, value, *cache, table, positions)
        return q, paged_attention_decode(q, *cache, table, lengths, HEAD_DIM**-0.5, MAX_LENGTH)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, out = step()
    for new_lengths in ([5, 64, 65, 1000, 8192, 2, 4097, 300], [1] * batch):
        lengths.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        graph.replay()
        q, expected = step()  # eager, on the cache the replay just wrote (the same k, v again)
        assert torch.equal(out, expected), f"graph replay differs from eager at lengths {new_lengths}"
        reference = paged_attention_reference(q.float(), *cache, table, lengths, HEAD_DIM**-0.5)
        assert relative_error(out, reference) < DECODE_BF16_REL
