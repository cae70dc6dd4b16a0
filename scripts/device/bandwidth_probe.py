"""How steady is `ninfer bench`'s read-bandwidth limit, and does the way it is taken move it? The bench reduces 1 GiB
once as a warm-up, then times 21 single reductions between CUDA events (the GPU idles between them) and keeps the
median. This probe takes that reading and three variants, interleaved, several rounds, in one process:
  * bench: `ninfer.eval.bench._read_bandwidth` as the bench calls it;
  * warm: the same after about a second of back-to-back reductions (clocks and memory as in a long decode run);
  * burst: 21 timings of 10 back-to-back reductions each (no idle gap inside a timing), median;
  * copy: the read half of a 1 GiB device-to-device copy timed the same way (reads 1 GiB, writes 1 GiB), for scale.
Usage (GPU): python3 scripts/device/bandwidth_probe.py [ROUNDS]"""

import sys

import torch

from ninfer.eval.bench import _read_bandwidth

NBYTES = 1 << 30


def _median_seconds(work, repeats: int = 21) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    device = torch.device("cuda")
    buffer = torch.ones(NBYTES // 4, device=device)
    target = torch.empty_like(buffer)
    out = torch.empty((), device=device)

    def burst():
        for _ in range(10):
            torch.sum(buffer, dim=0, out=out)

    for round_ in range(rounds):
        cells = [f"bench {_read_bandwidth(device, NBYTES) / 1e12:.3f}"]
        for _ in range(400):  # about a second of reductions
            torch.sum(buffer, dim=0, out=out)
        cells.append(f"warm {_read_bandwidth(device, NBYTES) / 1e12:.3f}")
        cells.append(f"burst {10 * NBYTES / _median_seconds(burst) / 1e12:.3f}")
        cells.append(f"copy(read) {NBYTES / _median_seconds(lambda: target.copy_(buffer)) / 1e12:.3f}")
        torch.cuda.synchronize()
        print(f"round {round_}: TB/s " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
