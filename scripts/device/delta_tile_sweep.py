"""The delta-rule launch's tile and warps (`gdn_decode.DELTA_BLOCK_V`, `DELTA_WARPS`) at the 27B GDN shapes:
µs of `gated_delta_decode` (delta rule + gated norm, a captured graph, the states cold after a 512 MiB
reduction and a 100 µs spin, as `delta_l2_probe.py` times it; median of 40) at B sequences, and whether its output
and the states it writes have the bits of the shipped setting. Usage:
python3 scripts/device/delta_tile_sweep.py [B,...] [BLOCK_V:WARPS,...]"""

import sys

import torch

import ninfer.kernels.gdn_decode as gdn

K_HEADS, K_DIM, V_HEADS, V_DIM = 16, 128, 48, 128  # qwen3.8-27b's Gated DeltaNet
SPIN_CYCLES = 200_000  # about 100 µs at the H200's clock
batches = [int(b) for b in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8]
settings = [tuple(int(n) for n in s.split(":")) for s in (sys.argv[2] if len(sys.argv) > 2 else
                                                          "32:4,32:2,64:4,64:8,16:2").split(",")]
shipped = (gdn.DELTA_BLOCK_V, gdn.DELTA_WARPS)
torch.manual_seed(0)
flush_buffer = torch.ones(1 << 27, device="cuda")
flush_out = torch.empty((), device="cuda")
start_state = torch.randn(17, V_HEADS, K_DIM, V_DIM, device="cuda") * 0.01
a_log = torch.randn(V_HEADS, device="cuda")
dt_bias = torch.randn(V_HEADS, device="cuda")
norm_weight = torch.randn(V_DIM, device="cuda", dtype=torch.bfloat16)


def run(inputs, setting, state):
    gdn.DELTA_BLOCK_V, gdn.DELTA_WARPS = setting
    mixed, z, a_b, slots = inputs
    return gdn.gated_delta_decode(mixed, z, a_b, a_log, dt_bias, norm_weight, state, slots, K_HEADS, K_DIM, V_HEADS,
                                  V_DIM, 1e-6)


for batch in batches:
    batch_inputs = (torch.randn(batch, 2 * K_HEADS * K_DIM + V_HEADS * V_DIM, device="cuda", dtype=torch.bfloat16),
                    torch.randn(batch, V_HEADS * V_DIM, device="cuda", dtype=torch.bfloat16),
                    torch.randn(batch, 2 * V_HEADS, device="cuda", dtype=torch.bfloat16),
                    torch.arange(1, batch + 1, device="cuda", dtype=torch.int32) * 2 % 17)
    reference_state = start_state.clone()
    reference_out = run(batch_inputs, shipped, reference_state)
    for setting in settings:
        state = start_state.clone()
        same = torch.equal(run(batch_inputs, setting, state), reference_out) and torch.equal(state, reference_state)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(batch_inputs, setting, state)
        times = []
        for _ in range(40):
            torch.sum(flush_buffer, dim=0, out=flush_out)
            torch.cuda._sleep(SPIN_CYCLES)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        print(f"B={batch} BLOCK_V={setting[0]} warps={setting[1]}: {sorted(times)[20]:.1f} µs cold, "
              f"bits of {shipped[0]}:{shipped[1]}: {same}", flush=True)
