"""How steady is `ninfer bench`'s read-bandwidth limit, and does the way it is taken move it? Until the twenty-eighth
session the bench timed 21 single 1 GiB reductions between CUDA events (the GPU idle between them) after one
warm-up and kept the median; now each timing holds READ_BURST reductions back to back. Interleaved, several rounds,
in one process:
  * single: one reduction per timing, the old reading;
  * warm: the same after about a second of back-to-back reductions (clocks and memory as in a long decode run);
  * bench: `ninfer.eval.bench._read_bandwidth`, as the bench takes it now;
  * burst40: 40 reductions per timing, to see whether READ_BURST is long enough;
  * copy(read): the read half of a 1 GiB device-to-device copy timed per call (reads 1 GiB, writes 1 GiB), for scale.
Usage (GPU): python3 scripts/device/bandwidth_probe.py [ROUNDS]"""

import sys

import torch

from ninfer.eval.bench import _read_bandwidth, _timed

NBYTES = 1 << 30


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    device = torch.device("cuda")
    buffer = torch.ones(NBYTES // 4, device=device)
    target = torch.empty_like(buffer)
    out = torch.empty((), device=device)
    for round_ in range(rounds):
        cells = [f"single {_read_bandwidth(device, NBYTES, burst=1) / 1e12:.3f}"]
        for _ in range(400):  # about a second of reductions
            torch.sum(buffer, dim=0, out=out)
        cells.append(f"warm {_read_bandwidth(device, NBYTES, burst=1) / 1e12:.3f}")
        cells.append(f"bench {_read_bandwidth(device, NBYTES) / 1e12:.3f}")
        cells.append(f"burst40 {_read_bandwidth(device, NBYTES, burst=40) / 1e12:.3f}")
        cells.append(f"copy(read) {NBYTES / _timed(device, lambda: target.copy_(buffer), 21) / 1e12:.3f}")
        torch.cuda.synchronize()
        print(f"round {round_}: TB/s " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
