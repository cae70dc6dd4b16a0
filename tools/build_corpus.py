"""Build data/corpus/ from the Python sources of the running CPython 3.11.7's standard library.

    python tools/build_corpus.py             # write data/corpus/{train,test}.txt.xz, manifest.json, LICENSE.md
    python tools/build_corpus.py --check     # exit 0 if a rebuild reproduces the committed files byte for byte

The corpus is pinned to CPython 3.11.7 (another version has other sources; `--allow-version-mismatch` builds
anyway, and `--check` then names the first file that differs). Files go to the test split when
int(sha256(path).hexdigest(), 16) % 20 == 0 (about 5 %), else to train; the output is deterministic.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))  # also when run as `python -m tools.build_corpus`

from corpus import (  # noqa: E402
    CORPUS_DIR,
    HEADER,
    MANIFEST,
    SEPARATOR,
    SPLITS,
    CorpusError,
    load_manifest,
    split_file,
)

PINNED_PYTHON = (3, 11, 7)
EXCLUDED_DIRS = (
    "site-packages",
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "__pycache__",
)
EXCLUDED_DIR_PREFIX = "config-"
EXCLUDED_FILE_PREFIXES = ("test_", "_sysconfigdata_")
EXCLUSION_RULES = (
    f"directories named {', '.join(EXCLUDED_DIRS)} (at any depth)",
    f"directories whose name starts with {EXCLUDED_DIR_PREFIX}",
    "files named test_*.py",
    "files named _sysconfigdata_*.py (generated when Python is built: paths and flags differ between installs)",
    "files that are not valid UTF-8",
)
TEST_MODULUS = 20  # int(sha256(path).hexdigest(), 16) % TEST_MODULUS == 0 -> test
XZ_PRESET = 9 | lzma.PRESET_EXTREME
LICENSE = "LICENSE.md"


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib root, with "/" separators
    split: str
    bytes: int
    sha256: str


def split_of(path: str) -> str:
    """The split of a file, decided by its relative path alone so that adding files moves no other file."""
    return "test" if int(hashlib.sha256(path.encode("utf-8")).hexdigest(), 16) % TEST_MODULUS == 0 else "train"


def read_sources(stdlib: Path) -> tuple[list[tuple[SourceFile, bytes]], list[str]]:
    """Every included .py file under `stdlib` with its bytes, sorted by relative path (as a string), and
    the relative paths of the .py files left out because they are not valid UTF-8."""
    included, not_utf8 = [], []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if any(part in EXCLUDED_DIRS or part.startswith(EXCLUDED_DIR_PREFIX) for part in rel.parts[:-1]):
            continue
        if rel.name.startswith(EXCLUDED_FILE_PREFIXES) or not path.is_file():
            continue
        data = path.read_bytes()
        name = rel.as_posix()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            not_utf8.append(name)
            continue
        if SEPARATOR.encode("utf-8") in data:
            raise CorpusError(f"{path} contains the document separator {SEPARATOR!r}; exclude it or change SEPARATOR")
        source = SourceFile(name, split_of(name), len(data), hashlib.sha256(data).hexdigest())
        included.append((source, data))
    included.sort(key=lambda item: item[0].path)
    return included, sorted(not_utf8)


def split_texts(sources: list[tuple[SourceFile, bytes]]) -> dict[str, bytes]:
    """Each split's UTF-8 text: per file, in path order, the header line, its bytes, the separator."""
    parts: dict[str, list[bytes]] = {name: [] for name in SPLITS}
    for source, data in sources:
        parts[source.split] += [HEADER.format(path=source.path).encode("utf-8"), data, SEPARATOR.encode("utf-8")]
    return {name: b"".join(chunks) for name, chunks in parts.items()}


def manifest_bytes(sources: list[SourceFile], texts: dict[str, bytes], not_utf8: list[str]) -> bytes:
    manifest = {
        "python": {"implementation": sys.implementation.name, "version": ".".join(map(str, sys.version_info[:3]))},
        "source": "the .py files under sysconfig.get_paths()['stdlib'] (the standard library) of the running "
        "interpreter; paths are relative to that folder",
        "exclusions": list(EXCLUSION_RULES),
        "excluded_not_utf8": not_utf8,
        "split_rule": f"int(sha256(path.encode('utf-8')).hexdigest(), 16) % {TEST_MODULUS} == 0 -> test, else train",
        "document": {"header": HEADER, "separator": SEPARATOR, "order": "sorted by relative path"},
        "splits": {
            name: {
                "file": split_file(name),
                "files": sum(source.split == name for source in sources),
                "bytes": len(texts[name]),
                "sha256": hashlib.sha256(texts[name]).hexdigest(),
            }
            for name in SPLITS
        },
        "files": [asdict(source) for source in sources],
    }
    return (json.dumps(manifest, indent=1, ensure_ascii=False) + "\n").encode("utf-8")


def python_license_text() -> bytes:
    """Python's own LICENSE.txt (history and the PSF License Agreement), as the interpreter ships it."""
    candidates = [Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt", Path(sys.base_prefix) / "LICENSE.txt"]
    for path in candidates:
        if path.is_file():
            return path.read_bytes()
    raise CorpusError(
        f"Python's LICENSE.txt is not at {' or '.join(map(str, candidates))}; build the corpus with a CPython "
        "install that ships it (python.org, pyenv, or the official Docker images)"
    )


def license_bytes(python_license: bytes, version: str) -> bytes:
    if b"```" in python_license:
        raise CorpusError("Python's LICENSE.txt contains ``` and cannot be quoted in a Markdown code block")
    notice = f"""# License of the corpus

`train.txt.xz` and `test.txt.xz` hold the Python source files of the standard library of CPython {version}:
Copyright (c) 2001-2023 Python Software Foundation; All Rights Reserved (and the earlier copyright holders
named below). They are distributed under the PSF License Agreement version 2 (SPDX: PSF-2.0), the license of
Python itself, whose full text follows.

Changes made (as clause 3 of the PSF License Agreement asks): a subset of the standard library's `.py` files
was selected (the rules are in `manifest.json`), the files were concatenated in sorted path order, each
preceded by a line `# file: <path>` and followed by a line `<|endoftext|>`, split into a train and a test
part, and compressed with xz. The text of every file is unchanged.

## Rebuilding

With CPython {version} (the version is checked):

    python tools/build_corpus.py            # rewrites this folder
    python tools/build_corpus.py --check    # exit 0 when the rebuild matches this folder byte for byte

## Python's LICENSE.txt (verbatim, from the CPython {version} installation)

```
"""
    return notice.encode("utf-8") + python_license + b"```\n"


def compress(text: bytes) -> bytes:
    """xz, preset 9e, CRC64: deterministic for a given liblzma (the format has no timestamps)."""
    return lzma.compress(text, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=XZ_PRESET)


def first_difference(
    out_dir: Path,
    sources: list[SourceFile],
    texts: dict[str, bytes],
    built: dict[str, bytes],
) -> str | None:
    """Compare a rebuild (`built`: manifest and license bytes; `texts`: the split texts) with `out_dir`.

    Returns None when every file is identical, else what differs first. Source files are compared through
    the manifest and the split texts, so a content difference names the source file; the splits are
    compressed and their xz bytes compared only once everything else matches.
    """
    try:
        committed = load_manifest(out_dir)
    except CorpusError as exc:
        return str(exc)
    committed_files = {entry["path"]: entry for entry in committed.get("files", [])}
    local_files = {source.path: asdict(source) for source in sources}
    for path in sorted(committed_files.keys() | local_files.keys()):
        if path not in local_files:
            return f"{path}: in the committed manifest, not in the local stdlib"
        if path not in committed_files:
            return f"{path}: in the local stdlib, not in the committed manifest"
        if committed_files[path] != local_files[path]:
            return f"{path}: committed {committed_files[path]}, local {local_files[path]}"
    if (out_dir / MANIFEST).read_bytes() != built[MANIFEST]:
        local = json.loads(built[MANIFEST])
        keys = [key for key in sorted(committed.keys() | local.keys()) if committed.get(key) != local.get(key)]
        return f"{MANIFEST}: differs in {', '.join(keys) or 'formatting'}"
    for name in SPLITS:
        path = out_dir / split_file(name)
        try:
            committed_text = lzma.decompress(path.read_bytes())
        except (FileNotFoundError, lzma.LZMAError) as exc:
            return f"{path.name}: cannot be read ({exc})"
        if committed_text != texts[name]:
            return f"{path.name}: {_first_differing_document(committed_text, texts[name])}"
    if not (out_dir / LICENSE).is_file() or (out_dir / LICENSE).read_bytes() != built[LICENSE]:
        return f"{LICENSE}: differs (Python's LICENSE.txt or the notice changed)"
    for name, data in _compressed(texts).items():
        if (out_dir / name).read_bytes() != data:
            return (
                f"{name}: same text, different xz bytes (this liblzma compresses differently from the one "
                "that built the committed file)"
            )
    return None


def _first_differing_document(committed: bytes, local: bytes) -> str:
    """Which document first differs between two split texts, named by its header path."""
    committed_docs = committed.decode("utf-8", errors="replace").split(SEPARATOR)
    local_docs = local.decode("utf-8", errors="replace").split(SEPARATOR)
    for old, new in zip(committed_docs, local_docs, strict=False):
        if old != new:
            return f"the text of {_document_path(new)} differs"
    return f"the committed text has {len(committed_docs) - 1} documents, the rebuild {len(local_docs) - 1}"


def _document_path(document: str) -> str:
    header = document.split("\n", 1)[0]
    prefix = HEADER.split("{", 1)[0]
    return header[len(prefix) :] if header.startswith(prefix) else repr(header[:80])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--out", type=Path, default=CORPUS_DIR, help="corpus folder (default: data/corpus)")
    parser.add_argument("--check", action="store_true", help="compare a rebuild with --out instead of writing it")
    parser.add_argument(
        "--allow-version-mismatch",
        action="store_true",
        help=f"build from a Python other than CPython {'.'.join(map(str, PINNED_PYTHON))}",
    )
    args = parser.parse_args(argv)

    running = (sys.implementation.name, tuple(sys.version_info[:3]))
    if running != ("cpython", PINNED_PYTHON) and not args.allow_version_mismatch:
        print(
            f"error: the corpus is pinned to CPython {'.'.join(map(str, PINNED_PYTHON))}, this is "
            f"{running[0]} {'.'.join(map(str, running[1]))}: run it with that interpreter, or pass "
            "--allow-version-mismatch",
            file=sys.stderr,
        )
        return 2

    start = time.perf_counter()
    try:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        loaded, not_utf8 = read_sources(stdlib)
        sources = [source for source, _ in loaded]
        texts = split_texts(loaded)
        built = {
            MANIFEST: manifest_bytes(sources, texts, not_utf8),
            LICENSE: license_bytes(python_license_text(), ".".join(map(str, sys.version_info[:3]))),
        }
        print(
            f"{len(sources)} files from {stdlib} ({sum(s.bytes for s in sources):,d} bytes); {len(not_utf8)} not UTF-8",
            file=sys.stderr,
        )
        if args.check:
            difference = first_difference(args.out, sources, texts, built)
            if difference is not None:
                print(f"{args.out}: differs from the rebuild: {difference}", file=sys.stderr)
                return 1
            print(f"{args.out}: matches the rebuild byte for byte ({time.perf_counter() - start:.1f} s)")
            return 0
        built.update(_compressed(texts))
    except CorpusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in built.items():
        (args.out / name).write_bytes(data)
    for name in SPLITS:
        count = sum(source.split == name for source in sources)
        print(
            f"{name}: {count} files, {len(texts[name]):,d} bytes of text, "
            f"{len(built[split_file(name)]):,d} bytes as {split_file(name)}"
        )
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")
    return 0


def _compressed(texts: dict[str, bytes]) -> dict[str, bytes]:
    compressed = {}
    for name in SPLITS:
        print(f"compressing {name} ({len(texts[name]):,d} bytes, xz -9e)", file=sys.stderr)
        compressed[split_file(name)] = compress(texts[name])
    return compressed


if __name__ == "__main__":
    sys.exit(main())
