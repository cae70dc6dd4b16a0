"""Speculative verify steps and short prompts on the fast path, timed: one sequence after a 128-token prompt, a
verify step of T draft tokens (accepted whole) for T = 1 … --tokens, against the decode step; then a 16-token
prompt on a fresh sequence (the short-prompt route). Times are host and device together, synchronised after each
step as a drafter that reads the logits would be (until they were graphed, verify steps and short prompts ran
eagerly, and their launches took ten times the device's time: docs/performance.md, thirty-sixth session).
Prints the median ms a step, and T decode steps over one verify step: the most a draft of T tokens that is always
accepted could gain.

    python3 scripts/device/verify_steps.py ARTIFACT [--tokens 8] [--repeats 20] [--batch 1]

With --batch B, B sequences decode and verify together (each its own prompt).

It runs on older trees too (started from the tree's folder with it first on PYTHONPATH), for before / after
comparisons."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ninfer.artifact.reader import Artifact
from ninfer.fast.runner import FastQwen35


def _median_seconds(step, repeats: int) -> float:
    step()  # compiles what this token count needs
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    with Artifact.open(args.artifact) as artifact:
        # a slot more than the batch: the short prompt at the end takes one beside the batch's sequences
        model = FastQwen35.from_artifact(artifact, "cuda", max_sequences=args.batch + 1, max_context=4096,
                                         max_verify_tokens=args.tokens)
    generator = torch.Generator().manual_seed(0)
    batch = args.batch
    states = [model.new_state(4096) for _ in range(batch)]
    with torch.inference_mode():
        for state in states:
            model.forward(torch.randint(0, model.config.vocab, (128,), generator=generator).cuda(), state)
        token = torch.randint(0, model.config.vocab, (batch,), generator=generator).cuda()
        decode = _median_seconds(lambda: model.decode_batch(states, token), args.repeats)
        print(f"batch {batch}: decode step (graph): {1000 * decode:.3f} ms")
        for tokens in range(1, args.tokens + 1):
            ids = torch.randint(0, model.config.vocab, (batch, tokens), generator=generator).cuda()

            def verify(ids=ids, tokens=tokens):
                model.verify(states, ids)
                model.accept(states, [tokens] * batch)

            seconds = _median_seconds(verify, args.repeats)
            print(f"verify T={tokens}: {1000 * seconds:.3f} ms, {tokens} decode steps / verify step "
                  f"{tokens * decode / seconds:.2f}")
        prompt = torch.randint(0, model.config.vocab, (16,), generator=generator).cuda()
        seconds = _median_seconds(lambda: model.forward(prompt, model.new_state(32)), args.repeats)
        print(f"16-token prompt: {1000 * seconds:.3f} ms")


if __name__ == "__main__":
    main()
