"""`ninfer bench`: the decode floor counts every weight and each sequence's state; the report's numbers are
consistent with each other and the command's output parses."""

from __future__ import annotations

import json

import torch

from ninfer.cli import main
from ninfer.engine.llm import LLM
from ninfer.eval.bench import Limits, _state_bytes, run_bench


def test_bytes_per_step_and_fractions_follow_from_the_limits():
    llm = LLM()
    limits = Limits("cpu", read_bytes_per_second=1e10, matmul_flops_per_second=1e11, dtype="float32")
    report = run_bench(llm, [32], new_tokens=4, batch_sizes=[1, 3], limits=limits)
    weights = sum(t.numel() * t.element_size() for t in llm.model.weights.values())
    assert report.weight_bytes == weights
    c = llm.model.config
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
