"""Real MTP acceptance of a small model on held-out prompts: per draft length K, the acceptance per draft position,
tokens per round, and whether greedy output equals plain decoding. Prints a markdown table and writes JSON.

    python tools/spec_report.py --model ninfer/assets/demo.ninfer [--k 1,2,3,4,5] [--prompts 29] [--new 64]

Prompts: the first PROMPT_TOKENS tokens of each document of the corpus' held-out split, as plain text (`--raw`);
greedy, NEW tokens each, on the reference runner.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

from corpus import documents, load_split  # noqa: E402

from ninfer import SamplingParams  # noqa: E402
from ninfer.engine import LLM  # noqa: E402
from ninfer.engine.speculative import SpeculationStats  # noqa: E402

PROMPT_TOKENS = 48


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--k", default="1,2,3,4,5")
    parser.add_argument("--prompts", type=int, default=29)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    started = time.time()
    plain = LLM(args.model, runner="reference")
    prompts = [plain.tokenizer.encode(doc, special=False)[:PROMPT_TOKENS]
               for doc in documents(load_split("test"))[: args.prompts]]
    params = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    expected = [plain.generate(ids, params).token_ids for ids in prompts]
    rows = []
    for k in map(int, args.k.split(",")):
        llm = LLM(args.model, runner="reference", spec="mtp", draft_tokens=k)
        total, identical = SpeculationStats(), 0
        for ids, want in zip(prompts, expected, strict=True):
            done = llm.generate(ids, params)
            identical += done.token_ids == want
            spec = done.stats.speculation
            for position in range(len(spec.drafted_per_position)):
                while len(total.drafted_per_position) <= position:
                    total.drafted_per_position.append(0)
                    total.accepted_per_position.append(0)
                total.drafted_per_position[position] += spec.drafted_per_position[position]
                total.accepted_per_position[position] += spec.accepted_per_position[position]
            total.rounds += spec.rounds
            total.drafted += spec.drafted
            total.accepted += spec.accepted
        rows.append({"k": k, "rounds": total.rounds, "tokens_per_round": total.tokens_per_round,
                     "acceptance": total.acceptance,
                     "acceptance_per_position": [a / d for a, d in zip(total.accepted_per_position,
                                                                       total.drafted_per_position, strict=True)],
                     "greedy_identical": f"{identical}/{len(prompts)}"})
    report = {"model": str(args.model), "prompts": len(prompts), "prompt_tokens": PROMPT_TOKENS,
              "new_tokens": args.new, "rows": rows, "seconds": round(time.time() - started, 1)}
    print("| K | tokens per round | acceptance | by draft position | greedy output identical |")
    print("|---|---|---|---|---|")
    for row in rows:
        positions = " / ".join(f"{a:.2f}" for a in row["acceptance_per_position"])
        print(f"| {row['k']} | {row['tokens_per_round']:.2f} | {row['acceptance']:.2f} | {positions} | "
              f"{row['greedy_identical']} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
