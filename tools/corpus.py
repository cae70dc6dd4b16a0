"""Read the project corpus in data/corpus/ (built by tools/build_corpus.py): one text per split, checked.

A split's text is its source files in sorted path order, each written as `# file: <path>\\n`, the file's
text, then SEPARATOR. Standard library only, so training and evaluation code can import it anywhere:
    from corpus import documents, load_split      # with tools/ on sys.path
"""

from __future__ import annotations

import hashlib
import json
import lzma
from pathlib import Path

CORPUS_DIR = Path(__file__).resolve().parent.parent / "data" / "corpus"
MANIFEST = "manifest.json"
SPLITS = ("train", "test")
HEADER = "# file: {path}\n"
SEPARATOR = "\n<|endoftext|>\n"


class CorpusError(Exception):
    """A corpus file is missing, unreadable or does not match data/corpus/manifest.json."""


def split_file(name: str) -> str:
    """File name of a split's compressed text: `train.txt.xz`, `test.txt.xz`."""
    return f"{name}.txt.xz"


def load_manifest(corpus_dir: Path = CORPUS_DIR) -> dict:
    """The parsed manifest.json of `corpus_dir`; raises CorpusError if it is missing or not JSON."""
    path = corpus_dir / MANIFEST
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError as exc:
        raise CorpusError(f"{path} is missing: run `python tools/build_corpus.py`") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorpusError(f"{path} is not valid JSON ({exc}): rebuild it with `python tools/build_corpus.py`") from exc


def load_split(name: str, corpus_dir: Path = CORPUS_DIR) -> str:
    """The whole text of split `name` ("train" or "test"), decompressed and checked against the manifest.

    Raises ValueError for an unknown split, CorpusError when the file is missing, not xz, or its
    SHA-256 differs from the manifest's (a corrupted or hand-edited file: rebuild or re-check it out).
    """
    if name not in SPLITS:
        raise ValueError(f"unknown corpus split {name!r}; the splits are {', '.join(SPLITS)}")
    expected = load_manifest(corpus_dir)["splits"][name]["sha256"]
    path = corpus_dir / split_file(name)
    try:
        data = lzma.decompress(path.read_bytes())
    except FileNotFoundError as exc:
        raise CorpusError(f"{path} is missing: run `python tools/build_corpus.py`") from exc
    except lzma.LZMAError as exc:
        raise CorpusError(f"{path} is not a valid xz file ({exc}): restore it from git or rebuild it") from exc
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise CorpusError(
            f"{path} decompresses to text with SHA-256 {actual}, but {MANIFEST} says {expected}: "
            "the file is corrupted or was edited; restore it from git or rebuild with `python tools/build_corpus.py`"
        )
    return data.decode("utf-8")


def documents(text: str) -> list[str]:
    """The documents of a split's text, in order: each is `# file: <path>\\n` plus the file's text.

    Raises CorpusError if the text does not end with SEPARATOR (it is not a whole split).
    """
    if not text.endswith(SEPARATOR):
        raise CorpusError("corpus text does not end with the document separator: it is not a whole split")
    return text[: -len(SEPARATOR)].split(SEPARATOR)
