"""`SHA256SUMS` beside artifacts: the format `sha256sum` writes and `sha256sum -c` checks.

One line per file, `<64 hex digits>  <file name>`; names are relative to the folder holding SHA256SUMS.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tqdm import tqdm

SUMS_NAME = "SHA256SUMS"
CHUNK = 16 << 20


def sha256_file(path: Path, progress: tqdm | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return digest.hexdigest()


def hash_files(paths: list[Path], what: str = "hashing", quiet: bool = False) -> dict[Path, str]:
    total = sum(p.stat().st_size for p in paths)
    with tqdm(total=total, unit="B", unit_scale=True, desc=what, disable=True if quiet else None,
              leave=False) as bar:
        return {p: sha256_file(p, bar) for p in paths}


def read_sums(folder: Path) -> dict[str, str]:
    """name -> hex digest from the folder's SHA256SUMS (empty when there is none)."""
    path = folder / SUMS_NAME
    if not path.is_file():
        return {}
    sums = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        digest, sep, name = line.partition("  ")
        if sep and len(digest) == 64:
            sums[name.lstrip("*")] = digest.lower()
    return sums


def update_sums(folder: Path, digests: dict[Path, str]) -> Path:
    """Set the lines of the given files in the folder's SHA256SUMS, keeping every other line."""
    path = folder / SUMS_NAME
    sums = read_sums(folder)
    sums.update({p.name: d for p, d in digests.items()})
    path.write_text("".join(f"{d}  {name}\n" for name, d in sums.items()), encoding="utf-8")
    return path
