"""The delta-rule launch's warps (`gdn_decode.DELTA_WARPS`; a program holds a whole head) at the 27B GDN shapes:
µs of `gated_delta_decode` (conv + delta rule + gated norm, and the window move at one sequence; a captured graph,
the states cold after a 512 MiB reduction and a 100 µs spin, as `delta_l2_probe.py` times it; median of 40) at B
sequences, and whether its output and the states and windows it writes have the bits of the shipped setting.
Usage: python3 scripts/device/delta_tile_sweep.py [B,...] [WARPS,...]"""

import sys

import torch
from device_timing import SPIN_CYCLES, DeltaRule27B, l2_flush, median_replay_us

import ninfer.kernels.gdn_decode as gdn

batches = [int(b) for b in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8]
settings = [int(w) for w in (sys.argv[2] if len(sys.argv) > 2 else "8,16").split(",")]
shipped = gdn.DELTA_WARPS
delta_rule = DeltaRule27B()
start_state, start_conv = delta_rule.state, delta_rule.conv_state
flush = l2_flush()


def run(inputs, warps, state, conv):
    gdn.DELTA_WARPS = warps
    return delta_rule(inputs, state, conv)


def cold():
    flush()
    torch.cuda._sleep(SPIN_CYCLES)


for batch in batches:
    batch_inputs = delta_rule.inputs(batch)
    reference_state, reference_conv = start_state.clone(), start_conv.clone()
    reference_out = run(batch_inputs, shipped, reference_state, reference_conv)
    for warps in settings:
        state, conv = start_state.clone(), start_conv.clone()
        same = torch.equal(run(batch_inputs, warps, state, conv), reference_out) and \
            torch.equal(state, reference_state) and torch.equal(conv, reference_conv)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(batch_inputs, warps, state, conv)
        us = median_replay_us(cold, graph.replay)
        print(f"B={batch} warps={warps}: {us:.1f} µs cold, bits of {shipped} warps: {same}", flush=True)
gdn.DELTA_WARPS = shipped
