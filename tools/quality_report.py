"""Held-out quality of a trained small model's artifacts: perplexity of each recipe, KL against bf16, the
unigram baseline, and the MTP head's top-1 accuracy. Prints a markdown table and writes JSON.

    python tools/quality_report.py --artifacts DIR --model dense [--max-tokens N] [--json out.json]

DIR holds MODEL-bf16.ninfer, MODEL-fp8.ninfer, MODEL-q8.ninfer, MODEL-q4.ninfer (from `ninfer convert`). The text
is the corpus' held-out split, tokenized as plain text like `ninfer ppl`; windows of 512 with stride 256.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

from corpus import load_split  # noqa: E402

from ninfer.artifact import open_artifact  # noqa: E402
from ninfer.eval.mtp import mtp_top1_accuracy  # noqa: E402
from ninfer.eval.perplexity import kl_divergence, perplexity, unigram_perplexity  # noqa: E402
from ninfer.frontend import Tokenizer  # noqa: E402
from ninfer.model.qwen3_5 import Qwen35Model  # noqa: E402

RECIPES = ("fp8", "q8", "q4")
CONTEXT, STRIDE = 512, 256


def load(path: Path) -> Qwen35Model:
    with open_artifact(path) as artifact:
        return Qwen35Model.from_artifact(artifact, dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.time()
    bf16_path = args.artifacts / f"{args.model}-bf16.ninfer"
    with open_artifact(bf16_path) as artifact:
        tokenizer = Tokenizer.from_artifact(artifact)
    test_ids = tokenizer.encode(load_split("test"), special=False)[: args.max_tokens]
    train_ids = tokenizer.encode(load_split("train"), special=False)
    reference = load(bf16_path)
    rows = {"unigram": {"ppl": unigram_perplexity(train_ids, test_ids, reference.config.vocab)}}
    rows["bf16"] = {"ppl": perplexity(reference, test_ids, CONTEXT, STRIDE, progress=False).ppl, "kl": 0.0,
                    "bytes": bf16_path.stat().st_size}
    for recipe in RECIPES:
        path = args.artifacts / f"{args.model}-{recipe}.ninfer"
        result = kl_divergence(reference, load(path), test_ids, CONTEXT, STRIDE, progress=False)
        rows[recipe] = {"ppl": result.ppl, "kl": result.mean, "kl_p99": result.p99, "top1_agreement":
                        result.top1_agreement, "bytes": path.stat().st_size}
    correct, total = mtp_top1_accuracy(reference, test_ids, CONTEXT, STRIDE)
    report = {"model": args.model, "test_tokens": len(test_ids), "train_tokens": len(train_ids),
              "vocab": reference.config.vocab, "context": CONTEXT, "stride": STRIDE, "rows": rows,
              "mtp_top1": correct / total, "mtp_positions": total, "seconds": round(time.time() - started, 1)}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
