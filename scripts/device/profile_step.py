"""Where a fast-path step's time goes: per-kernel CUDA time of eager decode steps (batch 1 and 8) and of one
prefill chunk on a 4-layer slice of a preset (the same kernels at the real widths), plus the graph-replayed step
time and the kernels of one graph-replayed step in launch order (start offset and duration of each, to hold a
GEMV's time inside the step against its time in `gemv_bench.py`; with programmatic dependent launch a kernel's span
starts when it is scheduled, before the kernel ahead has finished, so run with NINFER_PDL=0 for serial spans; with
PDL, each kernel's share of the critical path — how much later it ends than every kernel before it — is what a
fusion that removes it can save).
Usage: python3 scripts/device/profile_step.py PRESET [PROMPT_TOKENS]"""

import sys
import time

import torch
from device_timing import slice_model
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

preset = sys.argv[1]
prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 512
model = slice_model(preset, prompt + 64)
ids = torch.randint(0, 240_000, (prompt,), device="cuda")
for batch in (1, 8):
    states = [model.new_state(prompt + 32) for _ in range(batch)]
    for state in states:
        model.forward(ids, state)
    tokens = torch.zeros(batch, dtype=torch.long, device="cuda")
    model.use_graphs = False
    model.decode_batch(states, tokens)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            model.decode_batch(states, tokens)
        torch.cuda.synchronize()
    print(f"== eager decode, batch {batch}, 3 steps, 4 layers ==")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
    model.use_graphs = True
    model.decode_batch(states, tokens)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(20):
        model.decode_batch(states, tokens)
    torch.cuda.synchronize()
    print(f"graph step batch {batch}: {(time.perf_counter() - started) / 20 * 1e3:.3f} ms (4 layers + head)")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            model.decode_batch(states, tokens)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    step = kernels[len(kernels) // 2 :]  # the second replay
    print(f"== graph-replayed step, batch {batch}: {len(step)} kernels, offset from the first one's start, duration, "
          "and how much later than every kernel before it the kernel ends (its share of the step's critical path) ==")
    latest, shares = step[0].time_range.start, {}
    for event in step:
        share = max(0.0, event.time_range.end - latest)
        latest = max(latest, event.time_range.end)
        shares[event.name] = shares.get(event.name, 0.0) + share
        print(f"  {event.time_range.start - step[0].time_range.start:9.1f} us {event.time_range.elapsed_us():7.1f} us "
              f"{share:7.1f} us {event.name[:90]}")
    print("  critical-path share by kernel:", ", ".join(f"{name[:40]} {us:.1f} us" for name, us in
                                                      sorted(shares.items(), key=lambda item: -item[1])))
    del states, state  # a sequence's slot and pages go back when its last reference goes
state = model.new_state(prompt + 32)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    model.forward(ids, state)
    torch.cuda.synchronize()
print(f"== prefill of {prompt} tokens, 4 layers ==")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
