"""What a decode step costs outside its CUDA graph: on a 4-layer slice of a preset, the step as `ninfer bench` times
it (`decode_batch`, then `argmax` of its logits), against the captured graph replayed back to back, per batch size;
and every GPU event from the end of one step's last GEMV to the first add + RMSNorm of the next (offset from the
first of them, duration), in a profiled run of the bench's loop.
Usage: python3 scripts/device/step_boundary.py PRESET [PROMPT_TOKENS]"""

import sys
import time

import torch
from device_timing import slice_model
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

preset = sys.argv[1]
prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 128
model = slice_model(preset, prompt + 256)
ids = torch.randint(0, 240_000, (prompt,), device="cuda")


def seconds_per_call(call, repeats: int = 50) -> float:
    call()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


for batch in (1, 8):
    states = [model.new_state(prompt + 200) for _ in range(batch)]
    for state in states:
        model.forward(ids, state)
    tokens = torch.zeros(batch, dtype=torch.long, device="cuda")
    model.decode_batch(states, tokens)  # captures the bucket's graph
    graph, _ = model.graphs[next(b for b in model.buckets if b >= batch)]
    step = seconds_per_call(lambda s=states, t=tokens: model.decode_batch(s, t).argmax(-1))
    replay = seconds_per_call(graph.replay)
    print(f"batch {batch}: bench step {step * 1e6:.1f} us, graph replay alone {replay * 1e6:.1f} us, outside the "
          f"graph {(step - replay) * 1e6:.1f} us", flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            tokens = model.decode_batch(states, tokens).argmax(-1)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    clones = [i for i, e in enumerate(events) if "Memcpy DtoD" in e.name]  # each step's logits copy
    clone = clones[len(clones) // 2]
    last = max(i for i, e in enumerate(events[:clone]) if "gemv" in e.name)  # the head GEMV of a middle step
    first = min(i for i, e in enumerate(events) if i > clone and "rms_norm" in e.name)
    origin = events[last].time_range.end
    print(f"== batch {batch}: from the end of a step's head GEMV to the next step's first add + RMSNorm ==")
    for e in events[last : first + 1]:
        print(f"  {e.time_range.start - origin:8.1f} us {e.time_range.elapsed_us():7.1f} us  {e.name[:100]}")
    del states, state
