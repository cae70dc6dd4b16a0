"""Build examples/tiny-qwen3.5: the tiny random Qwen3.5 checkpoint the README converts.

It is an official-layout Hugging Face folder (Qwen3_5ForConditionalGeneration: 4 layers, hidden 64, a
vision tower and an MTP layer) with the project's byte-level tokenizer and the Qwen3.5 chat template, in
bf16, made by the same generator the tests use (transformers' own model classes). Needs the test extras:
    pip install -e '.[test]' && python scripts/build_tiny_checkpoint.py
Reruns write byte-identical files.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ninfer.frontend.vocab import byte_tokenizer_files  # noqa: E402
from tests.fixtures.hf_checkpoints import VOCAB_SIZE, CheckpointSpec, write_checkpoint  # noqa: E402

OUT = ROOT / "examples" / "tiny-qwen3.5"


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    write_checkpoint(OUT, CheckpointSpec(dtype="bfloat16", seed=2026), byte_tokenizer_files(VOCAB_SIZE))
    for path in sorted(OUT.iterdir()):
        print(f"{path.relative_to(ROOT)}  {path.stat().st_size:,d} bytes")


if __name__ == "__main__":
    main()
