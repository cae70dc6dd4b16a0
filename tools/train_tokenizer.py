"""Train the project's 4,096-id byte-level BPE tokenizer on the corpus train split; write data/tokenizer/.

    python tools/train_tokenizer.py          # after tools/build_corpus.py; about 20 s, byte-identical reruns

Ids 0..4062 are the BPE vocabulary (the 256 byte symbols, then the merges in training order) and
4063..4095 the 33 Qwen3.5 added tokens in the official order, so <|endoftext|> = 4063 and <|im_end|> = 4065.
Normalizer, pre-tokenizer, decoder, tokenizer_config.json and chat template are the real Qwen3.5 ones
(ninfer.frontend.vocab).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))  # also when run as `python -m tools.train_tokenizer`

from corpus import CorpusError, documents, load_split  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402

from ninfer.frontend.vocab import (  # noqa: E402
    EOS_TOKEN,
    PAD_TOKEN,
    QWEN3_5_SPECIAL_TOKENS,
    frontend_files,
    generation_config_json,
    set_qwen3_5_pipeline,
)

VOCAB_SIZE = 4096
BPE_SIZE = VOCAB_SIZE - len(QWEN3_5_SPECIAL_TOKENS)  # 4063: ids 0..4062
MIN_FREQUENCY = 2
TOKENIZER_DIR = ROOT / "data" / "tokenizer"


def train(train_documents: list[str], show_progress: bool) -> Tokenizer:
    """A byte-level BPE with BPE_SIZE tokens (all 256 byte symbols included) and Qwen3.5's text pipeline."""
    tokenizer = Tokenizer(models.BPE())
    set_qwen3_5_pipeline(tokenizer, normalize_nfc=True)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_SIZE,
        min_frequency=MIN_FREQUENCY,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(train_documents, trainer=trainer, length=len(train_documents))
    if tokenizer.get_vocab_size() != BPE_SIZE:
        raise RuntimeError(
            f"the BPE trainer made {tokenizer.get_vocab_size()} tokens, expected {BPE_SIZE}: "
            "the train split is too small for the vocabulary; rebuild data/corpus"
        )
    return tokenizer


def tokens_in(tokenizer: Tokenizer, text: str) -> int:
    """Token count of a whole split's text as training code encodes it (each separator is one token)."""
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def readme(stats: dict[str, tuple[int, int]]) -> bytes:
    rows = "\n".join(
        f"| {name} | {n_bytes:,d} | {n_tokens:,d} | {n_tokens / n_bytes:.4f} | {n_bytes / n_tokens:.3f} |"
        for name, (n_bytes, n_tokens) in stats.items()
    )
    specials = ", ".join(f"`{token}` = {BPE_SIZE + i}" for i, token in enumerate(QWEN3_5_SPECIAL_TOKENS[:3]))
    text = f"""# The project tokenizer

A byte-level BPE of {VOCAB_SIZE:,d} ids for the project's small Qwen3.5-architecture models, trained with
Hugging Face `tokenizers` on the train split of `data/corpus` (the CPython 3.11.7 standard library sources;
the test split is never seen). Built by

    python tools/build_corpus.py && python tools/train_tokenizer.py

Reruns give byte-identical files (the trainer runs with `RAYON_NUM_THREADS=1`, set by the script).

## Vocabulary

- ids 0..{BPE_SIZE - 1}: {BPE_SIZE:,d} BPE tokens: the 256 byte symbols (GPT-2's byte-to-character alphabet,
  so every byte string encodes), then {BPE_SIZE - 256:,d} merges in training order (minimum pair frequency
  {MIN_FREQUENCY}).
- ids {BPE_SIZE}..{VOCAB_SIZE - 1}: the 33 Qwen3.5 added tokens in the official order: {specials}, …,
  `<|audio_pad|>` = {VOCAB_SIZE - 1}.

The text pipeline is the real Qwen3.5 tokenizer's: NFC normalizer, the Qwen3.5 regex split then byte-level
mapping as pre-tokenizer, byte-level decoder. The documents are trained without their `<|endoftext|>`
separators; in the corpus text each separator encodes as the single added token `<|endoftext|>`.

## Files

- `tokenizer.json`: the `tokenizers` tokenizer.
- `tokenizer_config.json`, `chat_template.jinja`: the real Qwen3.5 ones (`ninfer.frontend.vocab.frontend_files`).
- `generation_config.json`: eos `<|im_end|>` ({BPE_SIZE + 2}) and `<|endoftext|>` ({BPE_SIZE}), pad
  `<|endoftext|>`, Qwen3.5's thinking-mode sampling defaults.

## Compression on the corpus

| split | bytes | tokens | tokens per byte | bytes per token |
|---|---|---|---|---|
{rows}
"""
    return text.encode("utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--out", type=Path, default=TOKENIZER_DIR, help="output folder (default: data/tokenizer)")
    args = parser.parse_args(argv)
    # The trainer gave the same merges with 1, 2 and 8 threads (tokenizers 0.23.3), but one thread makes
    # reruns identical by construction, and training takes seconds anyway. Read when the thread pool starts.
    os.environ["RAYON_NUM_THREADS"] = "1"

    start = time.perf_counter()
    try:
        texts = {name: load_split(name) for name in ("train", "test")}
    except CorpusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    train_documents = documents(texts["train"])
    print(f"training a {BPE_SIZE}-token BPE on {len(train_documents)} documents", file=sys.stderr)
    tokenizer = train(train_documents, show_progress=sys.stderr.isatty())
    files = frontend_files(tokenizer, BPE_SIZE)
    eos_ids = [tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN)]
    files["generation_config.json"] = generation_config_json(eos_ids=eos_ids, pad_id=tokenizer.token_to_id(PAD_TOKEN))
    train_seconds = time.perf_counter() - start

    stats = {name: (len(text.encode("utf-8")), tokens_in(tokenizer, text)) for name, text in texts.items()}
    files["README.md"] = readme(stats)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (args.out / name).write_bytes(data)
    for name, (n_bytes, n_tokens) in stats.items():
        print(
            f"{name}: {n_bytes:,d} bytes -> {n_tokens:,d} tokens ({n_tokens / n_bytes:.4f} tokens/byte, "
            f"{n_bytes / n_tokens:.3f} bytes/token)"
        )
    print(f"wrote {args.out} (trained in {train_seconds:.1f} s, {time.perf_counter() - start:.1f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
