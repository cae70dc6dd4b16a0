"""One-time costs of the prefill route: the first and the later prefills of each prompt length, in the order given
(a length's first prefill pays what its shapes meet for the first time: kernel compilation, autotuning, plans).

    python3 scripts/device/first_prefill.py ARTIFACT [--lengths 32,1000,8192] [--warm-up] [--repeat 2]

With --warm-up, `FastQwen35.warm_up` runs first (what `ninfer serve` does before it listens), so the first
prefills show what it leaves uncovered. With --cprofile, the first prefill of the last length runs under cProfile
and the host functions that took its time are printed (Triton compilation and autotuning show there)."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from ninfer.engine.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--lengths", default="32,1000,8192", help="prompt lengths, comma-separated")
    parser.add_argument("--warm-up", action="store_true")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--cprofile", action="store_true", help="profile the last length's first prefill on the host")
    args = parser.parse_args()
    llm = LLM(args.artifact, device="cuda", max_sequences=8)
    model = llm.model
    if args.warm_up:
        print(f"warm_up: {model.warm_up(8):.1f} s")
    generator = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in args.lengths.split(",")]
    for index, length in enumerate(lengths):
        ids = torch.randint(0, model.config.vocab, (length,), generator=generator).cuda()
        times = []
        for attempt in range(args.repeat):
            state = model.new_state(length)
            profiler = cProfile.Profile() if args.cprofile and index == len(lengths) - 1 and attempt == 0 else None
            torch.cuda.synchronize()
            started = time.perf_counter()
            if profiler:
                profiler.enable()
            model.forward(ids, state)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
            if profiler:
                profiler.disable()
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
            del state
        print(f"prefill {length:>6} tokens: " + ", ".join(f"{t:.3f} s" for t in times))


if __name__ == "__main__":
    main()
