"""Reading `.ninfer` artifacts: validated framing and directory, memory-mapped payload, zero-copy tensors.

Opening checks everything that can be checked without reading the payload: magic numbers, the directory
schema and geometry, every part's header (index and artifact id) and every file's size. Any violation
raises ArtifactError naming the file, the object and the rule; nothing is read from a file that failed.
The payload's integrity is checked on request: `verify_digests` hashes objects against the SHA-256 their
directory entries record (objects without one are not checked).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ninfer.artifact.directory import Directory, DirectoryError, ObjectEntry, parse_directory
from ninfer.artifact.framing import (
    ENTRY_MAGIC,
    HEADER_BYTES,
    PART_MAGIC,
    PART_PAYLOAD_OFFSET,
    format_artifact_id,
    payload_offset,
    unpack_header,
)
from ninfer.errors import ArtifactError, FormatError
from ninfer.quant import codec_for

if sys.byteorder != "little":  # formats are little-endian and decoded by viewing bytes
    raise ImportError("ninfer artifacts can only be read on little-endian machines")

HASH_THREADS = min(8, os.cpu_count() or 1)  # hashlib releases the GIL: objects hash in parallel
NAMED_OBJECTS = 3  # objects a DigestError names before "and N more"


class DigestError(ArtifactError):
    """Stored object bytes differ from the SHA-256 their directory entries record: the file is damaged."""

    def __init__(self, path: Path, objects: list[str]):
        self.path = path
        self.objects = objects
        named = ", ".join(repr(o) for o in objects[:NAMED_OBJECTS])
        more = f" and {len(objects) - NAMED_OBJECTS} more" if len(objects) > NAMED_OBJECTS else ""
        what = f"object {named}" if len(objects) == 1 else f"objects {named}{more}"
        super().__init__(f"{path}: {what}: the stored bytes do not match the SHA-256 in the directory; the file is "
                         "damaged (copy or convert it again)")


class _Span:
    """One file's payload: where it starts in the logical payload and its memory map."""

    def __init__(self, path: Path, logical_start: int, file_offset: int, size: int):
        self.path = path
        self.logical_start = logical_start
        self.file_offset = file_offset
        self.size = size
        self.buffer: mmap.mmap | None = None

    def map(self) -> mmap.mmap | None:
        if self.buffer is None and self.size:
            with open(self.path, "rb") as f:
                # copy-on-write mapping: tensors on it are writable views that never touch the file
                self.buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self.buffer


class Artifact:
    """An opened `.ninfer` artifact. Use `Artifact.open(path)` or `with open_artifact(path) as a:`."""

    def __init__(self, path: Path, artifact_id: bytes, directory: Directory, spans: list[_Span]):
        self.path = path
        self.artifact_id = artifact_id
        self.directory = directory
        self._spans = spans
        self._objects = {o.id: o for o in directory.objects}

    # -- opening -------------------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Artifact:
        path = Path(path)
        if path.is_dir():
            raise ArtifactError(f"{path}: is a directory; give the entry .ninfer file")
        if not path.is_file():
            raise ArtifactError(f"{path}: no such file")
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
            if len(header) < HEADER_BYTES:
                raise ArtifactError(f"{path}: truncated header ({len(header)} of {HEADER_BYTES} bytes); "
                                    "not a .ninfer file")
            magic, json_bytes, artifact_id = unpack_header(header)
            if magic == PART_MAGIC:
                raise ArtifactError(f"{path}: this is a continuation part; open the entry .ninfer file")
            if magic != ENTRY_MAGIC:
                if magic[:6] == ENTRY_MAGIC[:6]:
                    raise ArtifactError(f"{path}: container version {magic[7]} is not supported (only 3)")
                raise ArtifactError(f"{path}: bad magic {magic!r}; not a .ninfer file")
            file_size = os.fstat(f.fileno()).st_size
            if json_bytes == 0 or HEADER_BYTES + json_bytes > file_size:
                raise ArtifactError(f"{path}: directory length {json_bytes} does not fit in the file "
                                    f"({file_size} bytes); the file is truncated or damaged")
            text = f.read(json_bytes)
        try:
            root = json.loads(text.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
            raise ArtifactError(f"{path}: the directory is not valid UTF-8 JSON ({exc})") from None
        try:
            directory = parse_directory(root, path.name)
        except DirectoryError as exc:
            raise ArtifactError(f"{path}: {exc}") from None
        spans = cls._check_files(path, directory, payload_offset(json_bytes), file_size, artifact_id)
        return cls(path, artifact_id, directory, spans)

    @staticmethod
    def _check_files(path: Path, directory: Directory, entry_payload: int, entry_size: int,
                     artifact_id: bytes) -> list[_Span]:
        spans = []
        logical = 0
        for index, entry in enumerate(directory.files):
            if index == 0:
                file_path, start, size = path, entry_payload, entry_size
            else:
                file_path = path.with_name(entry.path or "")
                if not file_path.is_file():
                    raise ArtifactError(f"{file_path}: continuation part {index} of {path.name} is missing")
                size = file_path.stat().st_size
                start = PART_PAYLOAD_OFFSET
                with open(file_path, "rb") as f:
                    header = f.read(HEADER_BYTES)
                if len(header) < HEADER_BYTES:
                    raise ArtifactError(f"{file_path}: truncated part header")
                magic, part_index, part_id = unpack_header(header)
                if magic != PART_MAGIC:
                    raise ArtifactError(f"{file_path}: bad part magic {magic!r}")
                if part_index != index:
                    raise ArtifactError(f"{file_path}: header says part {part_index}, expected part {index}")
                if part_id != artifact_id:
                    raise ArtifactError(f"{file_path}: belongs to artifact {format_artifact_id(part_id)}, "
                                        f"not {format_artifact_id(artifact_id)}")
            expected = start + entry.payload_bytes
            if size != expected:
                state = "truncated" if size < expected else "longer than its directory says"
                raise ArtifactError(f"{file_path}: {size} bytes but the directory implies {expected} "
                                    f"({state})")
            spans.append(_Span(file_path, logical, start, entry.payload_bytes))
            logical += entry.payload_bytes
        return spans

    # -- access ----------------------------------------------------------------------------------------------

    def __enter__(self) -> Artifact:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        # Maps stay alive while tensors view them; dropping our references lets them close with the last view.
        for span in self._spans:
            span.buffer = None

    @property
    def objects(self) -> list[ObjectEntry]:
        return self.directory.objects

    @property
    def components(self) -> dict[str, dict[str, Any]]:
        return self.directory.components

    def object(self, object_id: str) -> ObjectEntry:
        obj = self._objects.get(object_id)
        if obj is None:
            raise ArtifactError(f"{self.path}: no object {object_id!r}")
        return obj

    def raw(self, object_id: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The object's stored bytes [start, stop) (default: all) as a 1-D uint8 CPU tensor: a zero-copy view of
        the mapped file when the range lies in one file, a copy when it spans parts."""
        obj = self.object(object_id)
        stop = obj.bytes if stop is None else stop
        if not 0 <= start <= stop <= obj.bytes:
            raise ValueError(f"byte range [{start}, {stop}) is outside object {object_id!r} ({obj.bytes} bytes)")
        pieces = [torch.frombuffer(buffer, dtype=torch.uint8, count=count, offset=offset)
                  for buffer, offset, count in self._pieces(obj, start, stop)]
        if not pieces:
            return torch.empty(0, dtype=torch.uint8)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def release(self, object_id: str, start: int = 0, stop: int | None = None) -> None:
        """Let the kernel drop the mapped pages of the object's bytes [start, stop) (default: all) from this
        process's memory; they are read from the file again if touched. For a stream that reads each byte once (a
        copy of a large artifact), so that its resident memory stays bounded. Writes made through tensors that view
        those pages are lost: only release what nobody writes."""
        if not hasattr(mmap, "MADV_DONTNEED"):  # no such advice on this platform: the pages stay until unmapped
            return
        for buffer, offset, count in self._pieces(self.object(object_id), start, stop):
            first = offset - offset % mmap.PAGESIZE
            buffer.madvise(mmap.MADV_DONTNEED, first, offset + count - first)

    def _pieces(self, obj: ObjectEntry, start: int = 0, stop: int | None = None
                ) -> Iterator[tuple[mmap.mmap, int, int]]:
        """(mapped file, offset in it, byte count) of each file that the object's bytes [start, stop) lie in, in
        order."""
        begin, end = obj.offset + start, obj.offset + (obj.bytes if stop is None else stop)
        for span in self._spans:
            lo, hi = max(begin, span.logical_start), min(end, span.logical_start + span.size)
            if lo < hi:
                buffer = span.map()
                assert buffer is not None  # a span holding object bytes is not empty
                yield buffer, span.file_offset + lo - span.logical_start, hi - lo

    def object_digest(self, object_id: str) -> str:
        """The hex SHA-256 of the object's stored bytes, hashed in place on the mapped files."""
        digest = hashlib.sha256()
        for buffer, offset, count in self._pieces(self.object(object_id)):
            with memoryview(buffer) as whole, whole[offset : offset + count] as view:
                digest.update(view)
        return digest.hexdigest()

    def digest_mismatches(self, names: Iterable[str] | None = None, *, progress: bool = False) -> list[str]:
        """Ids of the objects (all, or those named) whose stored bytes differ from the SHA-256 their directory
        entries record, in directory order. Objects without a recorded digest are not checked."""
        objects = self.objects if names is None else [self.object(name) for name in names]
        checked = [o for o in objects if o.sha256 is not None]
        for span in self._spans:  # map here, not racing in the hashing threads
            span.map()
        bad = []
        with tqdm(total=sum(o.bytes for o in checked), unit="B", unit_scale=True, desc="verifying weights",
                  disable=not progress, leave=False, file=sys.stderr) as bar, \
                ThreadPoolExecutor(HASH_THREADS) as pool:
            for obj, digest in zip(checked, pool.map(self.object_digest, [o.id for o in checked]), strict=True):
                bar.update(obj.bytes)
                if digest != obj.sha256:
                    bad.append(obj.id)
        return bad

    def verify_digests(self, names: Iterable[str] | None = None, *, progress: bool = False) -> int:
        """Hash the objects (all, or those named) against their recorded SHA-256; raise DigestError naming the
        damaged ones. Returns how many objects had a digest to check (0: the writer recorded none)."""
        objects = self.objects if names is None else [self.object(name) for name in names]
        bad = self.digest_mismatches([o.id for o in objects], progress=progress)
        if bad:
            raise DigestError(self.path, bad)
        return sum(o.sha256 is not None for o in objects)

    def tensor(self, object_id: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Decode a tensor object exactly (plain formats: a zero-copy view on the CPU)."""
        obj = self.object(object_id)
        if obj.kind != "tensor":
            raise ArtifactError(f"{self.path}: object {object_id!r} is a resource, not a tensor")
        data = self.raw(object_id).to(device)
        try:
            return codec_for(obj.format, obj.layout).decode(data, obj.shape)
        except FormatError as exc:
            raise ArtifactError(f"{self.path}: object {object_id!r}: {exc}") from None

    def resource(self, object_id: str) -> bytes:
        obj = self.object(object_id)
        if obj.kind != "resource":
            raise ArtifactError(f"{self.path}: object {object_id!r} is a tensor, not a resource")
        return bytes(self.raw(object_id).numpy())

    def component_resource(self, component: str, role: str) -> bytes | None:
        """A frontend resource by role (e.g. 'tokenizer.json'), or None when the component has none."""
        object_id = self.components.get(component, {}).get("resources", {}).get(role)
        return None if object_id is None else self.resource(object_id)

    @property
    def files(self) -> list[Path]:
        return [span.path for span in self._spans]


def open_artifact(path: str | os.PathLike[str]) -> Artifact:
    return Artifact.open(path)
