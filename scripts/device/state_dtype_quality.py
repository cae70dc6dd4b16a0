"""What a bf16 recurrent-state pool (`--state-dtype bf16`) costs in quality, on the project's trained small models.

Usage (GPU machine, repository root): python3 scripts/device/state_dtype_quality.py [TOKENS] [SEQUENCES]

Teacher-forced decode on the fast path: SEQUENCES windows of the held-out split (`data/corpus/test.txt.xz`,
tokenized as plain text), each fed one token a step through `decode_batch` for TOKENS steps (default 2,048 and 8),
once with the fp32 state pool and once with the bf16 one. Decode steps are where a bf16 pool rounds the state after
every token; a prefill chunk rounds it only at its end. Prints, per model: the mean KL(fp32 ‖ bf16) of the next-token
distributions, its largest value, the top-1 agreement, and each pool's held-out perplexity over the same positions.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from ninfer.artifact.reader import Artifact
from ninfer.eval.perplexity import read_text
from ninfer.fast.runner import FastQwen35
from ninfer.frontend import Tokenizer

MODELS = {"dense": Path("ninfer/assets/demo.ninfer"), "moe": Path("data/models/small-moe-q8.ninfer")}


def teacher_forced(path: Path, state_dtype: str, windows: torch.Tensor) -> torch.Tensor:
    """Log-probabilities `[steps, B, V]` after each of the windows' tokens but the last, one decode step a token."""
    sequences, tokens = windows.shape
    with Artifact.open(path) as artifact:
        fast = FastQwen35.from_artifact(artifact, "cuda", max_sequences=sequences, max_context=tokens + 64,
                                        state_dtype=state_dtype)
    states = [fast.new_state(tokens + 1) for _ in range(sequences)]
    out = []
    for step in range(tokens - 1):
        out.append(torch.log_softmax(fast.decode_batch(states, windows[:, step]), -1))
    return torch.stack(out)


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    sequences = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    with Artifact.open(MODELS["dense"]) as artifact:
        tokenizer = Tokenizer.from_artifact(artifact)
    ids = torch.tensor(tokenizer.encode(read_text(Path("data/corpus/test.txt.xz")), special=False))
    stride = (ids.numel() - tokens) // sequences
    windows = torch.stack([ids[i * stride : i * stride + tokens] for i in range(sequences)]).cuda()
    targets = windows[:, 1:].T  # [steps, B]
    print(f"{sequences} windows of {tokens} held-out tokens, teacher-forced decode steps")
    for name, path in MODELS.items():
        exact, narrow = (teacher_forced(path, dtype, windows) for dtype in ("fp32", "bf16"))
        kl = (exact.exp() * (exact - narrow)).sum(-1)  # [steps, B]
        agree = (exact.argmax(-1) == narrow.argmax(-1)).float().mean()
        nll = [-(lp.gather(-1, targets[..., None]).mean()) for lp in (exact, narrow)]
        late = kl[tokens // 2 :].mean()
        print(f"{name}: KL mean {kl.mean():.2e} (second half {late:.2e}), max {kl.max():.2e}; top-1 agreement "
              f"{agree:.4f}; perplexity fp32 {math.exp(nll[0]):.3f}, bf16 {math.exp(nll[1]):.3f}")


if __name__ == "__main__":
    main()
