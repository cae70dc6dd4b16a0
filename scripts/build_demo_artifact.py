"""Build ninfer/assets/demo.ninfer: the embedded default model of `ninfer run` and `ninfer.LLM()`.

A tiny random-weight Qwen3.5 (the `tiny-dense` synth preset: 4 layers, hidden 64, byte-level tokenizer with the
Qwen3.5 special tokens and chat template), stored with the q8 recipe, made by the project's own `synth` and
converter. Reruns are byte-identical (fixed seed and artifact id). It prints noise: it shows the pipeline,
not a language model (a trained one replaces it later).
    python scripts/build_demo_artifact.py
"""

from __future__ import annotations

from pathlib import Path

from ninfer.convert.synth import synth_artifact

OUT = Path(__file__).resolve().parent.parent / "ninfer" / "assets" / "demo.ninfer"


def main() -> None:
    OUT.parent.mkdir(exist_ok=True)
    synth_artifact("tiny-dense", "q8", OUT, seed=2026, artifact_id=bytes(range(16)), quiet=True)
    # the report and SHA256SUMS are for distribution folders; the package ships only the artifact
    for extra in (OUT.with_name(OUT.name + ".conversion.json"), OUT.with_name("SHA256SUMS")):
        extra.unlink(missing_ok=True)
    print(f"{OUT}: {OUT.stat().st_size:,d} bytes")


if __name__ == "__main__":
    main()
