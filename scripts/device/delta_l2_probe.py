"""Is the batch-8 delta rule bound by reading its states from DRAM? Times `gated_delta_decode` (delta rule + gated
norm, the 27B GDN shapes) at B sequences with the states cold (L2 flushed by a 512 MiB reduction
first), warm (the same call just before, so the states it wrote sit in L2 as far as they fit) and prefetched
(flushed, then `prefetch.global.L2` for every line of the B states from `kernels.l2_prefetch`). Each setup ends
with a 100 µs spin, so the lines have arrived and the GPU is busy while the host enqueues; the call is a captured
CUDA graph (as the runner replays decode steps). Median of 40 calls, CUDA events around the one replay.
Usage: python3 scripts/device/delta_l2_probe.py [B,...]"""

import sys
from types import SimpleNamespace

import torch

from ninfer.kernels.gdn_decode import gated_delta_decode
from ninfer.kernels.l2_prefetch import prefetch_to_l2

K_HEADS, K_DIM, V_HEADS, V_DIM = 16, 128, 48, 128  # qwen3.8-27b's Gated DeltaNet
SPIN_CYCLES = 200_000  # about 100 µs at the H200's clock
batches = [int(b) for b in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8]
torch.manual_seed(0)
flush_buffer = torch.ones(1 << 27, device="cuda")
flush_out = torch.empty((), device="cuda")
state = torch.randn(17, V_HEADS, K_DIM, V_DIM, device="cuda") * 0.01
a_log = torch.randn(V_HEADS, device="cuda")
dt_bias = torch.randn(V_HEADS, device="cuda")
norm_weight = torch.randn(V_DIM, device="cuda", dtype=torch.bfloat16)


def timed(setup, call, repeats=40):
    times = []
    for _ in range(repeats):
        setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


for batch in batches:
    mixed = torch.randn(batch, 2 * K_HEADS * K_DIM + V_HEADS * V_DIM, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(batch, V_HEADS * V_DIM, device="cuda", dtype=torch.bfloat16)
    a_b = torch.randn(batch, 2 * V_HEADS, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(1, batch + 1, device="cuda", dtype=torch.int32) * 2 % 17
    slot_bytes = state.stride(0) * 4
    ranges = torch.tensor([[state.data_ptr() + int(s) * slot_bytes, slot_bytes] for s in slots.tolist()],
                          dtype=torch.int64, device="cuda")
    prefetch = SimpleNamespace(ranges=ranges, asm=True)

    def eager(mixed=mixed, z=z, a_b=a_b, slots=slots):
        return gated_delta_decode(mixed, z, a_b, a_log, dt_bias, norm_weight, state, slots, K_HEADS, K_DIM, V_HEADS,
                                  V_DIM, 1e-6, quantize=True)

    def captured(function):
        function()  # compiles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            function()
        return graph

    call = captured(eager).replay

    def cold():
        torch.sum(flush_buffer, dim=0, out=flush_out)
        torch.cuda._sleep(SPIN_CYCLES)

    def warm(call=call):
        torch.sum(flush_buffer, dim=0, out=flush_out)
        call()
        torch.cuda._sleep(SPIN_CYCLES)

    def prefetched(prefetch=prefetch):
        torch.sum(flush_buffer, dim=0, out=flush_out)
        prefetch_to_l2(prefetch)
        torch.cuda._sleep(SPIN_CYCLES)

    rows = {"cold": timed(cold, call), "warm": timed(warm, call), "prefetched": timed(prefetched, call),
            "cold again": timed(cold, call)}
    state_mb = batch * slot_bytes / 1e6
    print(f"B={batch} ({state_mb:.1f} MB of state read and written): "
          + ", ".join(f"{name} {us:.1f} µs" for name, us in rows.items()))
