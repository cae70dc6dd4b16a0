"""Build the embedded default model and the MoE quality fixture from the trained small checkpoints.

    python scripts/build_demo_artifact.py [--dense CKPT_DIR] [--moe CKPT_DIR]

writes ninfer/assets/demo.ninfer (the dense model, q8: the default of `ninfer run` and `ninfer.LLM()`) with its
line in ninfer/assets/SHA256SUMS (shipped with the package; `ninfer verify` checks it), and
data/models/small-moe-q8.ninfer (the MoE model, q8), both with fixed artifact ids, so that the same checkpoints
give the same bytes. The checkpoints come from tools/train_small.py on a GPU (docs/quality.md says how:
`bash scripts/device/train.sh dense --steps 1718 --chat-steps 300` and `... moe --steps 850`, seed 0).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ninfer.convert.checkpoint import convert_checkpoint

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {  # model -> (output, artifact id, keep its SHA256SUMS line)
    "dense": (ROOT / "ninfer" / "assets" / "demo.ninfer", bytes(15) + b"\x01", True),
    "moe": (ROOT / "data" / "models" / "small-moe-q8.ninfer", bytes(15) + b"\x02", False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dense", type=Path, help="the dense checkpoint folder")
    parser.add_argument("--moe", type=Path, help="the MoE checkpoint folder")
    args = parser.parse_args()
    if args.dense is None and args.moe is None:
        parser.error("give --dense, --moe or both")
    for model, checkpoint in (("dense", args.dense), ("moe", args.moe)):
        if checkpoint is None:
            continue
        out, artifact_id, keep_sums = TARGETS[model]
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_checkpoint(checkpoint, "q8", out, name=f"ninfer-small-{model}", artifact_id=artifact_id, quiet=True)
        # the report is for distribution folders; the repository keeps the artifact and, for the embedded model,
        # the SHA256SUMS line the converter wrote beside it
        out.with_name(out.name + ".conversion.json").unlink(missing_ok=True)
        if not keep_sums:
            out.with_name("SHA256SUMS").unlink(missing_ok=True)
        print(f"{out.relative_to(ROOT)}: {out.stat().st_size:,d} bytes")


if __name__ == "__main__":
    main()
