"""`ninfer bench`: the decode floor counts the weight matrices a step reads (not the untied embedding table; of a
MoE's routed experts the expected share B tokens touch) and each sequence's state; the report's numbers are
consistent with each other and the command's output parses."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from ninfer.cli import main
from ninfer.engine import LLM
from ninfer.eval.bench import Limits, _state_bytes, _weight_bytes_per_step, run_bench


def test_bytes_per_step_and_fractions_follow_from_the_limits():
    llm = LLM()
    limits = Limits("cpu", read_bytes_per_second=1e10, matmul_flops_per_second=1e11, dtype="float32")
    report = run_bench(llm, [32], new_tokens=4, batch_sizes=[1, 3], limits=limits)
    assert report.weight_bytes == sum(t.numel() * t.element_size() for t in llm.model.weights.values())
    c = llm.model.config
    weights = sum(t.numel() * 4 for name, t in llm.model.weights.items()  # fp32 matrices of the trunk
                  if t.dim() == 2 and not name.startswith("mtp/") and (c.tied or name != "token_embedding"))
    # 2 attention layers x (K and V) x rows x heads x dim x 4 bytes, plus 6 GDN layers' fp32 state and conv rows
    state = 2 * 2 * 34 * c.kv_heads * c.head_dim * 4 + 6 * (c.v_heads * c.k_dim * c.v_dim * 4 + c.conv_dim * 3 * 4)
    assert _state_bytes(llm, 34) == state
    for row in report.decode:
        assert row["bytes_per_step"] == weights + row["batch"] * state
        expected = row["bytes_per_step"] / limits.read_bytes_per_second / row["seconds_per_step"]
        assert abs(row["fraction_of_bandwidth_limit"] - expected) < 1e-9
        assert abs(row["tokens_per_second"] * row["seconds_per_step"] - row["batch"]) < 1e-9
    (prefill,) = report.prefill
    assert prefill["tokens"] == 32 and abs(prefill["tokens_per_second"] * prefill["seconds"] - 32) < 1e-6


def test_bench_command_json(capsys):
    torch.manual_seed(0)
    assert main(["bench", "-p", "16", "-n", "2", "-b", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["limits"]["read_bytes_per_second"] > 0 and data["limits"]["matmul_flops_per_second"] > 0
    assert [row["batch"] for row in data["decode"]] == [1] and data["prefill"][0]["tokens"] == 16
    assert data["runner"] == "reference" and data["dependent_launch"] is False  # PDL is the fast path's, on sm_90+
    assert data["kv_dtype"] is None and data["state_dtype"] is None  # the fast path's pools


def test_state_bytes_follow_the_fast_paths_pools():
    """A step reads each GDN layer's recurrent state as pooled: half the bytes from a bf16 pool, and KV rows at the
    pool's bytes per element (int8 codes and their scales)."""
    llm = LLM()
    c = llm.model.config
    fp32 = _state_bytes(llm, 100)
    for state_dtype, kv_element in ((torch.float32, 1 + 2 / 64), (torch.bfloat16, 4.0)):
        cache = SimpleNamespace(recurrent=torch.empty(0, dtype=state_dtype), kv_element_bytes=kv_element)
        fast = SimpleNamespace(model=SimpleNamespace(config=c, cache=cache), dtype=llm.dtype, fast=True)
        kv = 2 * 2 * 100 * c.kv_heads * c.head_dim  # 2 attention layers x (K and V) elements
        recurrent = 6 * c.v_heads * c.k_dim * c.v_dim * 4  # 6 GDN layers, fp32
        expected = fp32 - kv * 4 + kv * kv_element - (recurrent // 2 if state_dtype == torch.bfloat16 else 0)
        assert _state_bytes(fast, 100) == expected


def test_moe_decode_reads_the_expected_share_of_the_experts():
    llm = LLM("data/models/small-moe-q8.ninfer")
    c = llm.model.config
    routed = sum(t.numel() * 4 for name, t in llm.model.weights.items()
                 if "/moe/routed_" in name and not name.startswith("mtp/"))
    rest = _weight_bytes_per_step(llm, 1) - routed * c.top_k / c.experts
    for batch in (1, 2, 8):
        share = 1 - (1 - c.top_k / c.experts) ** batch  # chance that a given expert is among a step's choices
        assert abs(_weight_bytes_per_step(llm, batch) - (rest + routed * share)) < 1e-3
    assert _weight_bytes_per_step(llm, 8) > _weight_bytes_per_step(llm, 1)


def test_speculative_rounds_with_synthetic_acceptance():
    """Acceptance 1 emits K+1 tokens a round and 0 emits one; real acceptance lies between; the rows name it."""
    llm = LLM(runner="reference", spec="mtp", draft_tokens=3)
    limits = Limits("cpu", read_bytes_per_second=1e10, matmul_flops_per_second=1e11, dtype="float32")
    for acceptance, low, high in ((1.0, 4.0, 4.0), (0.0, 1.0, 1.0), (None, 1.0, 4.0)):
        report = run_bench(llm, [16], new_tokens=6, batch_sizes=[2], limits=limits, acceptance=acceptance)
        (row,) = report.speculative
        assert row["draft_tokens"] == 3 and row["synthetic_acceptance"] == acceptance and row["rounds"] == 4
        assert low <= row["tokens_per_round"] <= high
        speed = row["tokens_per_round"] * row["batch"] / row["seconds_per_round"]
        assert abs(row["tokens_per_second"] - speed) < 1e-6 * speed
        assert abs(row["speedup"] - row["tokens_per_second"] / report.decode[0]["tokens_per_second"]) < 1e-9
