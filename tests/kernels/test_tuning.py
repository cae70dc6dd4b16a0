"""The kernels' launch choices per GPU architecture (`ninfer.kernels.tuning`): sm_90 gets the choices the kernels
were measured with, an architecture not in the table the default, the interpreter its wide programs; every entry
satisfies the kernels' constraints and covers every product; the wrappers launch with what the table says."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from ninfer.kernels import quant_linear, tuning

# the shapes the batch table is checked over: token tiles, formats, rows and padded K around every threshold
TILES = (1, 2, 4, 8, 16, 32, 64)
ROWS = (16, 1024, 8191, 8192, 8193, 12287, 12288, 12289, 17408, 248320)
K_PADS = (128, 1024, 2048, 5120, 6016, 6144, 6272, 8064, 8192, 8320, 17408, 27648)


# The sm_90 choices as the kernels made them before the table (the oracle of the table's sm_90 entry).
def _depth_unroll(tokens: int, rows: int, k_pad: int, bits: int) -> tuple[int, int]:
    if tokens == 1:
        return (2, 2) if rows <= 8192 and k_pad >= 6144 else (1, 1)
    if tokens >= 8:
        return (2, 1) if rows <= 8192 and bits != 8 and (bits != 5 or k_pad >= 8192) else (1, 1)
    return (2, 1) if tokens >= 4 and rows <= 12288 and bits != 8 else (1, 1)


def _block_t(tokens: int, bits: int, k_pad: int) -> int:
    return 4 if bits == 5 and tokens >= 8 and k_pad >= 8192 else min(8, tokens)


def _chain(tokens: int, bits: int, k_pad: int) -> int:
    if tokens < 8:
        return 2
    if bits == 5:
        return 8 if k_pad >= 6144 and _block_t(tokens, bits, k_pad) == 8 else 4
    return 8 if bits == 6 else 2


def _block_n(tokens: int, bits: int) -> int:
    return 2 if tokens == 1 or (bits == 5 and tokens < 8) else 4


def _lane_tree(tokens: int, bits: int, block_n: int, block_t: int) -> bool:
    return tokens >= 8 and bits in (4, 5) and block_n * block_t == 32


def test_sm90_gets_the_batch_gemv_choices_the_kernels_were_measured_with():
    table = tuning.for_arch((9, 0)).quant_linear
    for tokens, bits, rows, k_pad in itertools.product(TILES, tuning.ALL_BITS, ROWS, K_PADS):
        tile = table.batch_tile(tokens, bits, rows, k_pad)
        shape = f"T {tokens}, q{bits}, {rows} rows, K {k_pad}"
        assert (tile.block_n, tile.block_t) == (_block_n(tokens, bits), _block_t(tokens, bits, k_pad)), shape
        assert (tile.depth, tile.unroll) == _depth_unroll(tokens, rows, k_pad, bits), shape
        assert tile.chain == _chain(tokens, bits, k_pad), shape
        for block_n, block_t in itertools.product((1, 2, 4, 8, 16, 256), (1, 2, 4, 8)):  # callers' overrides too
            chosen = tile.lane_tree and block_n * block_t == 32  # as `quant_linear._Product.batch` decides
            assert chosen == _lane_tree(tokens, bits, block_n, block_t), f"{shape}, {block_n} × {block_t}"


def test_sm90_gets_the_other_kernels_choices_they_were_measured_with():
    sm90 = tuning.for_arch((9, 0))
    q = sm90.quant_linear
    assert (q.token_block_n, q.token_warps, q.gather_block_n, q.gather_warps, q.token_max_block_k) == (2, 1, 4, 2, 512)
    assert (q.grouped_block_n, q.grouped_warps, q.dequantize_block) == (64, 8, (16, 128))
    assert sm90.stripes == tuning.StripeTuning(warps=8, one_token_depth=4, tile_depth=3, dequantize_groups=8,
                                               dequantize_warps=4)
    assert sm90.dense == tuning.DenseTuning(block_n=1, block_k=None)
    assert sm90.fp8 == tuning.Fp8Tuning(block_n=8, block_k=512, warps=4)
    assert sm90.attention == tuning.AttentionTuning(block_positions=32, waves=2, max_splits=64, decode_warps=4,
                                                    merge_warps=4, write_warps=2, rope_warps=2)
    assert sm90.gated_delta == tuning.GatedDeltaTuning(conv_block_c=256, delta_block_v=32, delta_warps=4,
                                                       small_delta_warps=2, norm_heads=8, norm_warps=4,
                                                       early_state_sequences=1)
    assert sm90.elementwise == tuning.ElementwiseTuning(block=1024, warps=4, norm_split_warps=8)


def test_the_interpreter_keeps_its_wide_programs_and_nothing_else_differs():
    interpreter, default = tuning.INTERPRETER, tuning.DEFAULT
    q = interpreter.quant_linear
    assert {tile.block_n for tile in q.batch} == {256}
    assert q.batch == tuple(dataclasses.replace(tile, block_n=256) for tile in default.quant_linear.batch)
    assert (q.token_block_n, q.token_warps, q.gather_block_n, q.gather_warps) == (256, 2, 256, 2)
    assert (q.grouped_block_n, q.dequantize_block, q.token_max_block_k, q.grouped_warps) == (256, (256, 128), 512, 8)
    assert interpreter.dense == tuning.DenseTuning(block_n=64, block_k=256)
    assert interpreter.fp8 == dataclasses.replace(default.fp8, block_n=256)
    for section in ("stripes", "attention", "gated_delta", "elementwise"):
        assert getattr(interpreter, section) == getattr(default, section), section


@pytest.mark.parametrize("arch", [(7, 5), (8, 0), (8, 6), (8, 9), (10, 0), (12, 0)])
def test_an_architecture_not_in_the_table_gets_the_default(arch):
    assert arch not in tuning.TABLE
    assert tuning.for_arch(arch) is tuning.DEFAULT


def test_for_device_picks_the_interpreter_the_gpu_s_entry_or_the_default(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tuning.for_device(torch.device("cpu")) is tuning.INTERPRETER
    monkeypatch.delenv("TRITON_INTERPRET")
    assert tuning.for_device("cpu") is tuning.DEFAULT  # the compile check's CPU tensors
    other = dataclasses.replace(tuning.DEFAULT, fp8=tuning.Fp8Tuning(block_n=16, block_k=256, warps=8))
    monkeypatch.setitem(tuning.TABLE, (8, 6), other)
    capability = {"value": (8, 6)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability["value"])
    tuning._for_cuda.cache_clear()
    try:
        assert tuning.for_device(torch.device("cuda", 0)) is other
        capability["value"] = (9, 0)
        assert tuning.for_device(torch.device("cuda", 1)) is tuning.TABLE[(9, 0)]
        capability["value"] = (7, 0)
        assert tuning.for_device(torch.device("cuda", 2)) is tuning.DEFAULT
    finally:
        tuning._for_cuda.cache_clear()


ENTRIES = [pytest.param(tuning.DEFAULT, id="default"), pytest.param(tuning.INTERPRETER, id="interpreter"),
           *(pytest.param(entry, id=f"sm_{major}{minor}") for (major, minor), entry in tuning.TABLE.items())]


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_entry_covers_every_product_within_the_kernels_limits(entry, monkeypatch):
    for tokens, bits, rows, k_pad in itertools.product((*TILES, 128), tuning.ALL_BITS, ROWS, K_PADS):
        tile = entry.quant_linear.batch_tile(tokens, bits, rows, k_pad)
        assert tile.block_t <= min(tokens, quant_linear.BATCH_TOKENS), (tokens, bits, rows, k_pad)
    monkeypatch.setattr(tuning, "for_device", lambda device: entry)
    for k_pad in range(128, 32768, 128):  # the token route's K tile: whole 32-lane blocks dividing every padded K
        block_k = quant_linear.gemv_block_k(k_pad, "token")
        assert k_pad % block_k == 0 and block_k % 32 == 0 and block_k <= entry.quant_linear.token_max_block_k


@pytest.mark.parametrize(("make", "message"), [
    (lambda: tuning.BatchTile((1, 1), (4,), None, (0, None), 2, 1, 1, 1, 3, False), "chain"),
    (lambda: tuning.BatchTile((1, 1), (4,), None, (0, None), 3, 1, 1, 1, 2, False), "block_n"),
    (lambda: tuning.BatchTile((1, 1), (4,), None, (0, None), 2, 16, 1, 1, 2, False), "block_t"),
    (lambda: tuning.StripeTuning(warps=8, one_token_depth=5, tile_depth=3, dequantize_groups=8, dequantize_warps=4),
     "depths"),
    (lambda: tuning.AttentionTuning(block_positions=8, waves=2, max_splits=64, decode_warps=4, merge_warps=4,
                                    write_warps=2, rope_warps=2), "block_positions"),
    (lambda: tuning.ElementwiseTuning(block=96, warps=4, norm_split_warps=8), "elementwise block"),
])
def test_an_entry_outside_the_kernels_limits_is_refused_when_built(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_batch_table_without_a_row_for_a_product_says_which_product():
    table = dataclasses.replace(tuning.DEFAULT.quant_linear, batch=tuning.DEFAULT.quant_linear.batch[:2])
    with pytest.raises(ValueError, match=r"no batch GEMV row for 8 tokens, q4, 64 rows, K 1024"):
        table.batch_tile(8, 4, 64, 1024)


def test_the_wrappers_launch_with_the_choices_of_their_gpu(monkeypatch):
    """The compile check's recorder (no kernel runs): every launch of an architecture in the table takes that
    entry's choices, and sm_90's launches are the ones its entry gives."""
    pytest.importorskip("triton")
    from ninfer.kernels import compile_check

    sm90 = tuning.TABLE[(9, 0)]
    other = dataclasses.replace(
        sm90,
        quant_linear=dataclasses.replace(sm90.quant_linear, token_block_n=8, dequantize_block=(32, 64),
                                         batch=tuple(dataclasses.replace(t, chain=8) for t in sm90.quant_linear.batch)),
        stripes=dataclasses.replace(sm90.stripes, warps=4, tile_depth=2),
        fp8=tuning.Fp8Tuning(block_n=16, block_k=256, warps=8),
        attention=dataclasses.replace(sm90.attention, block_positions=64),
        gated_delta=dataclasses.replace(sm90.gated_delta, conv_block_c=128, norm_warps=8),
        elementwise=dataclasses.replace(sm90.elementwise, block=512, warps=2))
    monkeypatch.setitem(tuning.TABLE, (8, 6), other)

    def chosen(arch):
        seen: dict[str, set] = {}
        for name, _, values, options in compile_check.record_launches(arch):
            for key, value in (*values.items(), *options.items()):
                if isinstance(value, int):
                    seen.setdefault(f"{name}.{key}", set()).add(value)
        return seen

    for arch, entry in (((9, 0), sm90), ((8, 6), other)):
        seen = chosen(arch)
        q = entry.quant_linear
        assert seen["_fp8_gemv_kernel.BLOCK_N"] == {entry.fp8.block_n}
        assert seen["_fp8_gemv_kernel.BLOCK_K"] == {entry.fp8.block_k}
        assert seen["_fp8_gemv_kernel.num_warps"] == {entry.fp8.warps}
        assert seen["_stripe_kernel.WARPS"] == seen["_stripe_kernel.num_warps"] == {entry.stripes.warps}
        assert seen["_stripe_kernel.DEPTH"] == {entry.stripes.one_token_depth, entry.stripes.tile_depth}
        assert (seen["_dequantize_kernel.BLOCK_N"], seen["_dequantize_kernel.BLOCK_K"]) == (
            {q.dequantize_block[0]}, {q.dequantize_block[1]})
        assert seen["_gemv_kernel.BLOCK_N"] == {q.token_block_n, q.gather_block_n}
        # the recorded batch products: 64 × 2048 in every format at 1 and 8 tokens
        assert seen["_gemv_batch_kernel.CHAIN"] == {q.batch_tile(tokens, bits, 64, 2048).chain
                                                    for tokens in (1, 8) for bits in tuning.ALL_BITS}
        assert seen["_paged_decode_kernel.BLOCK_S"] == {entry.attention.block_positions}
        assert seen["_conv_kernel.BLOCK_C"] == {entry.gated_delta.conv_block_c}
        assert seen["_gated_norm_kernel.num_warps"] == {entry.gated_delta.norm_warps}
        assert seen["_silu_mul_kernel.BLOCK"] == {entry.elementwise.block}
        assert seen["_silu_mul_kernel.num_warps"] == {entry.elementwise.warps}
