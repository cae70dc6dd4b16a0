"""The paged-KV decode kernels against their torch oracles, under the Triton interpreter on the CPU (fp32
activations there) and on CUDA; on CUDA only (`pytest -m gpu`) also at the attention shapes of the qwen3.8-27b and
qwen3.6-35b-a3b presets, bf16 activations, every kv dtype, contexts up to 8192 positions, and a decode step captured
in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ninfer.kernels.attention import causal_attention
from ninfer.kernels.fused import sigmoid_mul
from ninfer.kernels.norm import rms_norm
from ninfer.kernels.paged_attention import (
    decode_split_plan,
    dequantize_kv,
    paged_attention_decode,
    paged_attention_reference,
    qk_norm_rope,
    quantize_kv_reference,
    write_kv,
    write_kv_reference,
)
from ninfer.kernels.rope import apply_rope, rope_cos_sin

KV_DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
ROPE_TOLERANCE = 1e-5  # fp32 both sides; cos/sin of the reduced angle differ from torch's by ~1e-7
DECODE_TOLERANCE = 1e-5  # fp32 both sides; only the summation order and exp2 vs exp differ
INT8_HALF_STEP_SLACK = 1 + 1e-5  # |x − x̂| ≤ scale/2, up to the rounding of the fp32 division x / scale
E4M3_RELATIVE = 2.0**-4  # half an ulp of a 3-bit mantissa, relative to |x / scale|
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # below 2^-6 the codes are steps of 2^-9 (times the scale)


def inv_freq_of(rotary_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


@pytest.mark.parametrize(("head_dim", "rotary_dim", "theta"), [(64, 16, 10_000_000.0), (128, 128, 10_000.0)])
def test_qk_norm_rope_equals_norm_then_rope(device, head_dim, rotary_dim, theta):
    heads, kv_heads, eps = 4, 2, 1e-6
    generator = torch.Generator().manual_seed(head_dim)
    rows = (heads + kv_heads) * head_dim
    projection = torch.randn(4, rows + 40, generator=generator) * 3  # query_key is a strided row view of it
    query_key = projection[:, :rows]
    q_norm, k_norm = torch.randn(head_dim, generator=generator) * 0.1, torch.randn(head_dim, generator=generator)
    positions = torch.tensor([0, 17, 300, 4095])
    q, k = qk_norm_rope(query_key.to(device), q_norm.to(device), k_norm.to(device), positions.to(device), heads,
                        kv_heads, head_dim, rotary_dim, inv_freq_of(rotary_dim, theta).to(device), eps)
    cos, sin = rope_cos_sin(positions, rotary_dim, theta)
    expected_q = apply_rope(rms_norm(query_key[:, : heads * head_dim].reshape(4, heads, head_dim), q_norm, eps),
                            cos, sin)
    expected_k = apply_rope(rms_norm(query_key[:, heads * head_dim :].reshape(4, kv_heads, head_dim), k_norm, eps),
                            cos, sin)
    assert q.shape == (4, heads, head_dim) and k.shape == (4, kv_heads, head_dim)
    for name, got, expected in (("q", q, expected_q), ("k", k, expected_k)):
        error = float((got.cpu() - expected).abs().max() / expected.abs().max())
        assert error < ROPE_TOLERANCE, f"{name}: relative error {error:.2e}"


def scattered_table(batch: int, max_pages: int, num_pages: int, generator: torch.Generator) -> torch.Tensor:
    """Distinct, shuffled page ids for every slot of the table."""
    return torch.randperm(num_pages, generator=generator)[: batch * max_pages].reshape(batch, max_pages).int()


def random_pool(kv_dtype: torch.dtype, num_pages: int, page: int, kv_heads: int, head_dim: int,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    x = torch.randn(num_pages, page, kv_heads, head_dim, generator=generator)
    if kv_dtype not in (torch.int8, torch.float8_e4m3fn):
        return x.to(kv_dtype), None
    return quantize_kv_reference(x, kv_dtype)


def test_quantize_reference_matches_the_stated_rounding():
    # one group with scale exactly 1: int8 ties round to even; e4m3 ties (normal and subnormal) round to even
    int8_group = torch.zeros(64)
    int8_group[:6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, 100.5])
    codes, scales = quantize_kv_reference(int8_group, torch.int8)
    assert scales.tolist() == [1.0]
    assert codes[:6].tolist() == [127, 0, 2, 2, -2, 100]
    fp8_group = torch.zeros(64)
    fp8_group[:6] = torch.tensor([448.0, 17.0, 19.0, -17.0, 2.0**-10, 3 * 2.0**-10])
    codes, scales = quantize_kv_reference(fp8_group, torch.float8_e4m3fn)
    assert scales.tolist() == [1.0]
    assert codes[:6].float().tolist() == [448.0, 16.0, 20.0, -16.0, 0.0, 2.0**-8]
    codes, scales = quantize_kv_reference(torch.zeros(2, 128), torch.int8)
    assert scales.abs().sum() == 0 and codes.abs().sum() == 0


def new_keys(batch: int, kv_heads: int, head_dim: int, generator: torch.Generator) -> torch.Tensor:
    """Values over ~5 decades (e4m3 subnormals, int8 zeros), an all-zero group and exact rounding ties."""
    x = torch.randn(batch, kv_heads, head_dim, generator=generator)
    x = x * torch.exp(torch.empty_like(x).uniform_(-12.0, 0.0, generator=generator))
    x[1, 1, 64:128] = 0.0
    x[0, 0, :64] = 0.0
    x[0, 0, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, 100.5])  # int8 scale 1: ties
    x[0, 1, :64] = 0.0
    x[0, 1, :6] = torch.tensor([448.0, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10, -0.0])  # fp8 scale 1: ties, -0
    return x


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
def test_write_kv_stores_what_the_reference_stores_and_nothing_else(device, kv_dtype):
    dtype = KV_DTYPES[kv_dtype]
    batch, heads, kv_heads, head_dim, page, num_pages, max_pages = 3, 4, 2, 128, 16, 12, 3
    generator = torch.Generator().manual_seed(len(kv_dtype))
    key_pages, key_scales = random_pool(dtype, num_pages, page, kv_heads, head_dim, generator)
    value_pages, value_scales = random_pool(dtype, num_pages, page, kv_heads, head_dim, generator)
    table = scattered_table(batch, max_pages, num_pages, generator)
    positions = torch.tensor([0, 17, 39])
    activation = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32  # bf16 pages: stored bit for bit
    k = new_keys(batch, kv_heads, head_dim, generator).to(activation)
    gate_value = torch.randn(batch, (heads + kv_heads) * head_dim, generator=generator).to(activation)
    v = gate_value[:, heads * head_dim :].reshape(batch, kv_heads, head_dim)  # a strided view, as in the model
    assert not v.is_contiguous()
    before = [t.clone() for t in (key_pages, value_pages, key_scales, value_scales) if t is not None]
    expected = [t.clone() for t in before]
    write_kv_reference(k, v, *expected[:2], *(expected[2:] or [None, None]), table, positions)
    on_device = [t.to(device) for t in before]
    write_kv(k.to(device), v.to(device), *on_device[:2], *(on_device[2:] or [None, None]), table.to(device),
             positions.to(device))
    for got, want, old in zip(on_device, expected, before, strict=True):
        bits = torch.uint8 if got.dtype == torch.float8_e4m3fn else got.dtype
        assert torch.equal(got.cpu().view(bits), want.view(bits)), "kernel and reference stored different bits"
        changed = (got.cpu().view(bits) != old.view(bits)).flatten(2).any(-1)  # [P, PAGE] slots touched
        touched = torch.zeros_like(changed)
        touched[table[torch.arange(batch), positions // page].long(), positions % page] = True
        assert not (changed & ~touched).any(), "a slot other than the written ones changed"

    if key_scales is None:
        return
    pages, rows = table[torch.arange(batch), positions // page].long(), positions % page
    for x, pool, scales in ((k, on_device[0], on_device[2]), (v, on_device[1], on_device[3])):
        slot_scales = scales.cpu()[pages, rows]
        x_hat = dequantize_kv(pool.cpu()[pages, rows], slot_scales, torch.float32)
        error = (x_hat - x).abs()
        scale = slot_scales.float().repeat_interleave(64, dim=-1)
        if dtype == torch.int8:
            bound = scale / 2 * INT8_HALF_STEP_SLACK
        else:
            bound = E4M3_RELATIVE * x.abs() + E4M3_SUBNORMAL_HALF_STEP * scale
        assert (error <= bound).all(), f"{kv_dtype} round trip error {float((error - bound).max()):.2e} over bound"
    assert float(on_device[2].cpu()[pages[1], rows[1], 1, 1]) == 0.0, "an all-zero group has scale 0"


def paged_cache(dense: torch.Tensor, lengths: list[int], kv_dtype: torch.dtype, table: torch.Tensor, num_pages: int,
                page: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first lengths[b] positions of dense `[B, S, kvh, hd]` scattered into pages by `table`; every other slot
    poisoned (NaN, or NaN scales), so that reading a slot past a length shows up in the output."""
    _, _, kv_heads, head_dim = dense.shape
    pool = torch.full((num_pages, page, kv_heads, head_dim), float("nan"))
    scales = None
    if kv_dtype in (torch.int8, torch.float8_e4m3fn):
        pool, scales = quantize_kv_reference(pool.nan_to_num(0.0), kv_dtype)
        scales.fill_(float("nan"))
    else:
        pool = pool.to(kv_dtype)
    for b, length in enumerate(lengths):
        positions = torch.arange(length)
        pages, rows = table[b, positions // page].long(), positions % page
        if scales is None:
            pool[pages, rows] = dense[b, :length].to(kv_dtype)
        else:
            pool[pages, rows], scales[pages, rows] = quantize_kv_reference(dense[b, :length], kv_dtype)
    return pool, scales


DECODE_CASES = {  # name: (heads, kv_heads, head_dim, page, lengths, max_pages, max_length)
    "gqa2 page16 two splits": (4, 2, 64, 16, [1, 17, 40], 4, None),
    "gqa6 page64 three splits": (6, 1, 128, 64, [5, 130], 3, None),
    "batch8": (4, 2, 64, 16, [1, 2, 15, 16, 17, 33, 48, 64], 4, None),
    "one tile, one split on any device": (4, 2, 64, 16, [1, 9, 16], 2, 16),
    "max_length below the table": (8, 2, 64, 16, [48, 7, 31], 6, 48),
    "three heads of 64 (a padded int8 record block)": (3, 1, 64, 16, [5, 40], 4, None),
}


def test_the_decode_cases_cover_one_and_several_splits(device):
    splits = {decode_split_plan(kvh, max_length or max_pages * page, device)
              for _, kvh, _, page, _, max_pages, max_length in DECODE_CASES.values()}
    assert 1 in splits and max(splits) >= 3, splits


def decode_inputs(case: str, kv_dtype: torch.dtype, seed: int):
    heads, kv_heads, head_dim, page, lengths, max_pages, _ = DECODE_CASES[case]
    generator = torch.Generator().manual_seed(seed)
    batch, num_pages = len(lengths), len(lengths) * max_pages + 3
    table = scattered_table(batch, max_pages, num_pages, generator)
    table[0, -1] = table[-1, 0]  # a slot past every length may name any page, even one in use
    keys = torch.randn(batch, max(lengths), kv_heads, head_dim, generator=generator)
    values = torch.randn(batch, max(lengths), kv_heads, head_dim, generator=generator)
    q = torch.randn(batch, heads, head_dim, generator=generator)
    key_pages, key_scales = paged_cache(keys, lengths, kv_dtype, table, num_pages, page)
    value_pages, value_scales = paged_cache(values, lengths, kv_dtype, table, num_pages, page)
    return q, keys, values, (key_pages, value_pages, key_scales, value_scales), table, torch.tensor(lengths).int()


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_equals_the_reference(device, case, kv_dtype):
    q, _, _, cache, table, lengths = decode_inputs(case, KV_DTYPES[kv_dtype], seed=len(case))
    max_length = DECODE_CASES[case][-1]
    scale = q.shape[-1] ** -0.5
    expected = paged_attention_reference(q, *cache, table, lengths, scale, max_length)
    assert expected.isfinite().all()
    device_cache = [None if t is None else t.to(device) for t in cache]
    got = paged_attention_decode(q.to(device), *device_cache, table.to(device), lengths.to(device), scale,
                                 max_length)
    assert got.shape == q.shape and got.dtype == q.dtype
    error = float((got.cpu() - expected).abs().max() / expected.abs().max())
    assert error < DECODE_TOLERANCE, f"{case} {kv_dtype}: relative error {error:.2e}"


def test_splits_past_a_sequence_leave_no_output_the_merge_reads(device, monkeypatch):
    """A short sequence leaves its later splits empty: they write only their max and sum, and the merge reads no
    output of theirs. Every fp32 buffer the call allocates starts as NaN here, so an empty split's unwritten
    output would show; the result must keep the bits of the call on fresh buffers."""
    q, _, _, cache, table, lengths = decode_inputs("gqa2 page16 two splits", torch.float32, seed=5)
    assert decode_split_plan(2, 64, device) > 1 and int(lengths.min()) <= 32  # an empty split
    cache = [None if t is None else t.to(device) for t in cache]
    q, table, lengths = q.to(device), table.to(device), lengths.to(device)
    expected = paged_attention_decode(q, *cache, table, lengths, 0.125)
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.dtype == torch.float32 else t

    monkeypatch.setattr(torch, "empty", poisoned)
    got = paged_attention_decode(q, *cache, table, lengths, 0.125)
    monkeypatch.undo()
    assert got.isfinite().all() and torch.equal(got, expected)


def test_decode_gives_a_sequence_the_same_bits_in_any_batch(device):
    """Speculative verify (many rows) must not change greedy decoding (few rows): a sequence's output does not depend
    on the rows beside it, whose count once chose the number of splits."""
    q, _, _, cache, table, lengths = decode_inputs("batch8", torch.float32, seed=3)
    cache = [None if t is None else t.to(device) for t in cache]
    q, table, lengths = q.to(device), table.to(device), lengths.to(device)
    together = paged_attention_decode(q, *cache, table, lengths, 0.125, max_length=64)
    for b in range(q.shape[0]):
        alone = paged_attention_decode(q[b : b + 1], *cache, table[b : b + 1], lengths[b : b + 1], 0.125, max_length=64)
        assert torch.equal(alone[0], together[b]), f"sequence {b}"


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_causal_attention_on_a_dense_cache(device, kv_dtype):
    q, keys, values, cache, table, lengths = decode_inputs("gqa2 page16 two splits", kv_dtype, seed=7)
    scale = 0.3
    got = paged_attention_decode(q.to(device), *[None if t is None else t.to(device) for t in cache],
                                 table.to(device), lengths.to(device), scale).cpu()
    for b, length in enumerate(lengths.tolist()):
        k, v = keys[b, :length].to(kv_dtype).float(), values[b, :length].to(kv_dtype).float()
        expected = causal_attention(q[b : b + 1], k, v, length - 1, scale)[0]
        error = float((got[b] - expected).abs().max() / expected.abs().max())
        assert error < DECODE_TOLERANCE, f"sequence {b} (length {length}): relative error {error:.2e}"


GATED_CASES = {  # DECODE_CASES name: splits on any device
    "gqa2 page16 two splits": 2,
    "one tile, one split on any device": 1,
    "three heads of 64 (a padded int8 record block)": 2,
}


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's bf16 o
@pytest.mark.parametrize("quantize", [False, True], ids=["y", "records"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("case", "kv_dtype"), [(case, "bf16") for case in GATED_CASES] +
                         [("gqa2 page16 two splits", "int8"), ("one tile, one split on any device", "fp8")])
def test_gated_decode_gives_the_bits_of_sigmoid_mul_after_it(device, case, kv_dtype, dtype, quantize):
    """The output gate (and the int8 records) in the kernel that writes the output: the merge of the splits, or the
    decode kernel itself with one split, whose GQA tile has padding rows that must not touch other heads. Compared
    as bits (bf16 under the interpreter: its bf16 `tl.dot` makes o wrong, even inf/NaN, but the same o on both
    paths, so the gate's roundings are still what is compared)."""
    heads, kv_heads, head_dim, page, _, max_pages, max_length = DECODE_CASES[case]
    assert decode_split_plan(kv_heads, max_length or max_pages * page, device) == GATED_CASES[case]
    q, _, _, cache, table, lengths = decode_inputs(case, KV_DTYPES[kv_dtype], seed=len(case))
    batch, width = q.shape[0], heads * head_dim
    gate_value = torch.randn(batch, width + 64, generator=torch.Generator().manual_seed(5)) * 3
    args = (q.to(device, dtype), *[None if t is None else t.to(device) for t in cache], table.to(device),
            lengths.to(device), head_dim**-0.5, max_length)
    gate = gate_value.to(device, dtype)[:, :width]  # a column slice of the gate/value projection, as in the model
    o = paged_attention_decode(*args)
    expected = sigmoid_mul(o.view(batch, -1), gate, quantize=quantize)
    got = paged_attention_decode(*args, gate=gate, quantize=quantize)
    if quantize:
        assert torch.equal(got.blocks, expected.blocks), "records differ"
        got, expected = got.source, expected.source
    assert got.shape == (batch, width) and got.dtype == dtype
    got, expected = (t.view(torch.int32 if dtype == torch.float32 else torch.int16) for t in (got, expected))
    assert torch.equal(got, expected), f"gated output differs in {int((got != expected).sum())} of {got.numel()}"


def test_decode_refuses_what_it_does_not_do():
    pages = torch.zeros(4, 16, 2, 64, dtype=torch.int8)
    table, lengths, q = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.zeros(1, 4, 64)
    with pytest.raises(ValueError, match="need key_scales"):
        paged_attention_decode(q, pages, pages, None, None, table, lengths, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention_decode(q[..., :48], pages[..., :48], pages[..., :48], None, None, table, lengths, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention_decode(torch.zeros(1, 3, 64), pages.float(), pages.float(), None, None, table, lengths, 1.0)
    float_pages = pages.float()
    with pytest.raises(ValueError, match="gate"):
        paged_attention_decode(q, float_pages, float_pages, None, None, table, lengths, 1.0, gate=torch.zeros(1, 64))
    with pytest.raises(ValueError, match="pass a gate"):
        paged_attention_decode(q, float_pages, float_pages, None, None, table, lengths, 1.0, quantize=True)


# --- on CUDA only (`pytest -m gpu`): the presets' attention shapes -------------------------------------------------

SHAPES = {"27b": (24, 4), "35b": (16, 2)}  # (heads, kv_heads); head_dim 256, rotary_dim 64, theta 1e7 for both
HEAD_DIM, ROTARY_DIM, THETA, EPS = 256, 64, 10_000_000.0, 1e-6
LENGTHS = {1: [8192], 8: [1, 100, 1000, 4096, 8192, 33, 7000, 2500]}
MAX_LENGTH = 8192
ROPE_BF16_REL = 1e-2  # bf16 output (one rounding) against the fp32 oracle
DECODE_BF16_REL = 1e-2  # K/V tiles and probabilities rounded to bf16, accumulation fp32, against the fp32 oracle


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


@pytest.mark.gpu
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


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.gpu
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
    assert torch.equal(as_bits(got_k), as_bits(want_k)) and torch.equal(as_bits(got_v), as_bits(want_v))
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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
