"""One-time costs of the prefill route: the first and the later prefills of each prompt length, in the order given
(a length's first prefill pays what its shapes meet for the first time: kernel compilation, autotuning, plans).

    python3 scripts/device/first_prefill.py ARTIFACT [--lengths 32,1000,8192] [--warm-up] [--repeat 2]

With --warm-up, `FastQwen35.warm_up` runs first (what `ninfer serve` does before it listens), so the first
prefills show what it leaves uncovered."""

from __future__ import annotations

import argparse
import time

import torch

from ninfer.engine.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--lengths", default="32,1000,8192", help="prompt lengths, comma-separated")
    parser.add_argument("--warm-up", action="store_true")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(args.artifact, device="cuda", max_sequences=8)
    model = llm.model
    if args.warm_up:
        print(f"warm_up: {model.warm_up(8):.1f} s")
    generator = torch.Generator().manual_seed(0)
    for length in (int(n) for n in args.lengths.split(",")):
        ids = torch.randint(0, model.config.vocab, (length,), generator=generator).cuda()
        times = []
        for _ in range(args.repeat):
            state = model.new_state(length)
            torch.cuda.synchronize()
            started = time.perf_counter()
            model.forward(ids, state)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
            del state
        print(f"prefill {length:>6} tokens: " + ", ".join(f"{t:.3f} s" for t in times))


if __name__ == "__main__":
    main()
