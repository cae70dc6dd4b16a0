"""Is the batch-8 delta rule bound by reading its states from DRAM? Times `gated_delta_decode` (conv + delta rule,
gated norm, the 27B GDN shapes) at B sequences with the states cold (L2 flushed by a 512 MiB reduction
first), warm (the same call just before, so the states it wrote sit in L2 as far as they fit) and prefetched
(flushed, then `prefetch.global.L2` for every line of the B states from `kernels.l2_prefetch`). Each setup ends
with a 100 µs spin, so the lines have arrived and the GPU is busy while the host enqueues; the call is a captured
CUDA graph (as the runner replays decode steps). Median of 40 calls, CUDA events around the one replay.
Usage: python3 scripts/device/delta_l2_probe.py [B,...]"""

import sys
from types import SimpleNamespace

import torch
from device_timing import SPIN_CYCLES, DeltaRule27B, l2_flush, median_replay_us

from ninfer.kernels.l2_prefetch import prefetch_to_l2

batches = [int(b) for b in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8]
delta_rule = DeltaRule27B()
state = delta_rule.state
flush = l2_flush()


for batch in batches:
    step = delta_rule.inputs(batch)
    slots = step[3]
    slot_bytes = state.stride(0) * 4
    ranges = torch.tensor([[state.data_ptr() + int(s) * slot_bytes, slot_bytes] for s in slots.tolist()],
                          dtype=torch.int64, device="cuda")
    prefetch = SimpleNamespace(ranges=ranges, asm=True)

    def eager(step=step):
        return delta_rule(step, quantize=True)

    def captured(function):
        function()  # compiles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            function()
        return graph

    call = captured(eager).replay

    def cold():
        flush()
        torch.cuda._sleep(SPIN_CYCLES)

    def warm(call=call):
        flush()
        call()
        torch.cuda._sleep(SPIN_CYCLES)

    def prefetched(prefetch=prefetch):
        flush()
        prefetch_to_l2(prefetch)
        torch.cuda._sleep(SPIN_CYCLES)

    rows = {name: median_replay_us(setup, call) for name, setup in
            (("cold", cold), ("warm", warm), ("prefetched", prefetched), ("cold again", cold))}
    state_mb = batch * slot_bytes / 1e6
    print(f"B={batch} ({state_mb:.1f} MB of state read and written): "
          + ", ".join(f"{name} {us:.1f} µs" for name, us in rows.items()))
