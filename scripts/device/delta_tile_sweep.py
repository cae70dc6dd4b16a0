"""The delta-rule launch's tile and warps (`gdn_decode.DELTA_BLOCK_V`, `DELTA_WARPS`) at the 27B GDN shapes:
µs of `gated_delta_decode` (conv + delta rule, gated norm, a captured graph, the states cold after a 512 MiB
reduction and a 100 µs spin, as `delta_l2_probe.py` times it; median of 40) at B sequences, and whether its output
and the states and windows it writes have the bits of the shipped setting, on an fp32 (default) or bf16 state pool.
Usage: python3 scripts/device/delta_tile_sweep.py [B,...] [BLOCK_V:WARPS,...] [fp32|bf16]"""

import sys

import torch
from device_timing import SPIN_CYCLES, DeltaRule27B, l2_flush, median_replay_us

import ninfer.kernels.gdn_decode as gdn

batches = [int(b) for b in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8]
settings = [tuple(int(n) for n in s.split(":")) for s in (sys.argv[2] if len(sys.argv) > 2 else
                                                          "32:4,32:2,64:4,64:8,16:2").split(",")]
state_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[3] if len(sys.argv) > 3 else "fp32"]
shipped = (gdn.DELTA_BLOCK_V, gdn.DELTA_WARPS)
delta_rule = DeltaRule27B(state_dtype)
start_state, start_conv = delta_rule.state, delta_rule.conv_state
flush = l2_flush()


def run(inputs, setting, state, conv):
    gdn.DELTA_BLOCK_V, gdn.DELTA_WARPS = setting
    return delta_rule(inputs, state, conv)


def cold():
    flush()
    torch.cuda._sleep(SPIN_CYCLES)


for batch in batches:
    batch_inputs = delta_rule.inputs(batch)
    reference_state, reference_conv = start_state.clone(), start_conv.clone()
    reference_out = run(batch_inputs, shipped, reference_state, reference_conv)
    for setting in settings:
        state, conv = start_state.clone(), start_conv.clone()
        same = torch.equal(run(batch_inputs, setting, state, conv), reference_out) and \
            torch.equal(state, reference_state) and torch.equal(conv, reference_conv)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(batch_inputs, setting, state, conv)
        us = median_replay_us(cold, graph.replay)
        print(f"B={batch} {state_dtype} state BLOCK_V={setting[0]} warps={setting[1]}: {us:.1f} µs cold, "
              f"bits of {shipped[0]}:{shipped[1]}: {same}", flush=True)
