"""Device memory and capture time of the fast path's decode graphs: one decode step per bucket up to --slots
sequences, largest first (as `FastQwen35.warm_up` captures them), after one prefill has set up the general pool.
Prints the bytes of the caching allocator's segments outside its default pool (the graphs' pools: one shared
pool, or one private pool per graph on trees before the shared one) and the seconds the captures took
(`torch.cuda.memory_reserved` deltas do not show it: each capture empties the allocator's cache first).

    python3 scripts/device/graph_memory.py ARTIFACT [--slots 8] [--warm-up]

With --warm-up it runs `FastQwen35.warm_up(slots)` instead, which also captures the short-prompt graphs (16 … 2
tokens) into the same pool.

It runs on older trees too (they may lack `graph_bytes`), for before / after comparisons."""

from __future__ import annotations

import argparse
import collections
import time

import torch

from ninfer.engine.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--warm-up", action="store_true", help="capture what warm_up captures (short prompts too)")
    args = parser.parse_args()
    model = LLM(args.artifact, device="cuda", max_sequences=args.slots).model
    with torch.inference_mode():
        model.forward(torch.arange(1, 41, device="cuda"), model.new_state(40))
        torch.cuda.synchronize()
        started = time.perf_counter()
        buckets = sorted((b for b in model.buckets if b <= args.slots), reverse=True)
        if args.warm_up:
            model.warm_up(args.slots)
        else:
            for bucket in buckets:
                states = [model.new_state(2) for _ in range(bucket)]
                model.decode_batch(states, torch.ones(bucket, dtype=torch.long, device="cuda"))
                del states
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    pools = collections.Counter()  # bytes per pool outside the default one (0, 0)
    for segment in torch.cuda.memory_snapshot():
        pools[tuple(segment["segment_pool_id"])] += segment["total_size"]
    del pools[(0, 0)]
    # trees from 037ba76 to 5ebc23d kept each graph's logits in the pool; later ones write them to `model.logits`
    kept = sum(buckets) * model.config.vocab * 4 / 2**20
    logits = "one buffer outside" if getattr(model, "logits", None) is not None else f"{kept:.1f} MiB inside"
    print(f"buckets {buckets}: captured in {seconds:.1f} s; {len(pools)} graph pool(s) hold "
          f"{sum(pools.values()) / 2**20:.1f} MiB (the runner's graph_bytes: "
          f"{getattr(model, 'graph_bytes', 0) / 2**20:.1f} MiB; the graphs' logits: {logits})")


if __name__ == "__main__":
    main()
