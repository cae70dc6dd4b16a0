"""Writing `.ninfer` artifacts: plan every offset first, then stream object bytes into place.

Because object sizes follow from (format, shape), the whole directory — offsets, files, parts — is known
before any payload byte exists. The writer lays the files out at their final sizes under temporary names,
accepts object bytes in any order (`write`), and renames the files into place on `commit`; `abort` (or an
exception inside `with`) deletes them, so a failed conversion leaves nothing behind.

Every object's SHA-256 is recorded in its directory entry. The directory is written with placeholder digests of
the same length and rewritten in place on `commit`, so the payload never moves. Digests are computed as bytes
arrive: a write that continues an object where its hashed prefix ends is hashed from memory; bytes written ahead of
that point (the planes of a row-split format, written interleaved) are read back from the file once the writes move
on to another object, in bounded chunks while they are still in the page cache.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ninfer.artifact.directory import DIGEST_HEX, Directory, FileEntry, ObjectEntry, check_geometry
from ninfer.artifact.framing import (
    DEFAULT_PART_CAP,
    ENTRY_MAGIC,
    HEADER_BYTES,
    ID_BYTES,
    PART_MAGIC,
    PART_PAYLOAD_OFFSET,
    PAYLOAD_ALIGN,
    TENSOR_ALIGN,
    align_up,
    new_artifact_id,
    pack_header,
    part_name,
    payload_offset,
)
from ninfer.errors import ArtifactError
from ninfer.quant import codec_for

TEMP_SUFFIX = ".incomplete"
DIGEST_PLACEHOLDER = "0" * DIGEST_HEX  # holds each digest's room in the directory until commit
READ_BACK_CHUNK = 16 << 20


@dataclass(frozen=True)
class TensorSpec:
    id: str
    shape: tuple[int, ...]
    format: str

    @property
    def layout(self) -> str:
        return codec_for(self.format).layout

    @property
    def bytes(self) -> int:
        return codec_for(self.format).encoded_bytes(self.shape)


@dataclass(frozen=True)
class ResourceSpec:
    id: str
    bytes: int


def plan_objects(specs: list[TensorSpec | ResourceSpec]) -> list[ObjectEntry]:
    """Assign payload offsets in the given order: tensors 256-byte aligned, resources packed."""
    cursor = 0
    objects = []
    for spec in specs:
        if isinstance(spec, TensorSpec):
            cursor = align_up(cursor, TENSOR_ALIGN)
            codec = codec_for(spec.format)
            codec.check_shape(spec.shape)
            objects.append(ObjectEntry(spec.id, "tensor", cursor, spec.bytes, spec.shape, spec.format,
                                       codec.layout))
        else:
            objects.append(ObjectEntry(spec.id, "resource", cursor, spec.bytes))
        cursor += objects[-1].bytes
    return objects


def _split_payload(total: int, entry_capacity: int, part_capacity: int) -> list[int]:
    sizes = [min(total, entry_capacity)]
    remaining = total - sizes[0]
    while remaining > 0:
        sizes.append(min(remaining, part_capacity))
        remaining -= sizes[-1]
    return sizes


def layout_directory(path: Path, objects: list[ObjectEntry], components: dict[str, Any],
                     metadata: dict[str, Any], provenance: dict[str, Any], part_cap: int = DEFAULT_PART_CAP,
                     extra: dict[str, Any] | None = None) -> tuple[Directory, bytes]:
    """The directory with its `files` split under `part_cap` bytes per file, and its JSON text (padded so
    that the payload starts exactly where the files were sized for). `extra`: the optional root members
    (`bindings`, `uses`), written verbatim."""
    cap = part_cap // PAYLOAD_ALIGN * PAYLOAD_ALIGN
    if cap <= PART_PAYLOAD_OFFSET:
        raise ArtifactError(f"part size cap {part_cap} is too small (needs more than {PART_PAYLOAD_OFFSET})")
    total = max((o.offset + o.bytes for o in objects), default=0)
    start = PAYLOAD_ALIGN
    while True:  # the JSON's length depends on the file sizes, which depend on where the payload starts
        entry_capacity = cap - start
        if entry_capacity <= 0:
            raise ArtifactError(f"part size cap {part_cap} leaves no room for the payload after the "
                                f"{start}-byte header and directory")
        sizes = _split_payload(total, entry_capacity, cap - PART_PAYLOAD_OFFSET)
        files = [FileEntry(None if i == 0 else part_name(path.name, i), size) for i, size in enumerate(sizes)]
        directory = Directory(components, objects, files, metadata, provenance, dict(extra or {}))
        text = directory.dumps().encode("utf-8")
        needed = payload_offset(len(text))
        if needed <= start:
            break
        start = needed
    if payload_offset(len(text)) < start:  # pad with JSON whitespace so the reader finds the same start
        text += b" " * (start - HEADER_BYTES - len(text))
    check_geometry(directory)
    return directory, text


class _ObjectHash:
    """The SHA-256 of an object's first `cursor` bytes."""

    def __init__(self) -> None:
        self.hasher = hashlib.sha256()
        self.cursor = 0


class ArtifactWriter:
    """Streams object bytes into a planned artifact; see the module docstring."""

    def __init__(self, path: str | os.PathLike[str], objects: list[ObjectEntry], components: dict[str, Any],
                 metadata: dict[str, Any], provenance: dict[str, Any], artifact_id: bytes | None = None,
                 part_cap: int = DEFAULT_PART_CAP, extra: dict[str, Any] | None = None):
        self.path = Path(path)
        self.artifact_id = artifact_id or new_artifact_id()
        if len(self.artifact_id) != ID_BYTES:  # the header would silently pad or cut it
            raise ArtifactError(f"artifact id must be {ID_BYTES} bytes, not {len(self.artifact_id)}")
        objects = [replace(o, sha256=DIGEST_PLACEHOLDER) for o in objects]
        self.directory, text = layout_directory(self.path, objects, components, metadata, provenance, part_cap,
                                                extra)
        self._json_bytes = len(text)
        self._objects = {o.id: o for o in objects}
        self._hashes = {o.id: _ObjectHash() for o in objects}
        self._current: str | None = None  # the object the last write went to
        self.final_paths = [self.path] + [self.path.with_name(f.path) for f in self.directory.files[1:] if f.path]
        self._temp_paths = [p.with_name(p.name + TEMP_SUFFIX) for p in self.final_paths]
        self._fds: list[int] = []
        self._spans: list[tuple[int, int, int]] = []  # (logical start, size, file offset) per file
        try:
            self._create_files(text)
        except BaseException:
            self.abort()
            raise

    def _create_files(self, text: bytes) -> None:
        logical = 0
        for index, (temp, entry) in enumerate(zip(self._temp_paths, self.directory.files, strict=True)):
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            self._fds.append(fd)
            if index == 0:
                start = payload_offset(len(text))
                prefix = pack_header(ENTRY_MAGIC, len(text), self.artifact_id) + text
            else:
                start = PART_PAYLOAD_OFFSET
                prefix = pack_header(PART_MAGIC, index, self.artifact_id)
            os.ftruncate(fd, start + entry.payload_bytes)
            os.pwrite(fd, prefix, 0)
            self._spans.append((logical, entry.payload_bytes, start))
            logical += entry.payload_bytes

    def write(self, object_id: str, data: bytes | np.ndarray | torch.Tensor, offset: int = 0) -> None:
        """Write `data` at byte `offset` inside object `object_id`."""
        obj = self._objects[object_id]
        if isinstance(data, torch.Tensor):
            data = data.detach().to("cpu").contiguous().view(torch.uint8).numpy()
        view = memoryview(data).cast("B")
        if offset < 0 or offset + len(view) > obj.bytes:
            raise ValueError(f"write of {len(view)} bytes at {offset} overflows object {object_id!r} "
                             f"({obj.bytes} bytes)")
        if self._current is not None and self._current != object_id:
            self._finish_hash(self._current)
        self._current = object_id
        begin = obj.offset + offset
        end = begin + len(view)
        for fd, (logical, size, start) in zip(self._fds, self._spans, strict=True):
            lo, hi = max(begin, logical), min(end, logical + size)
            if lo < hi:
                os.pwrite(fd, view[lo - begin : hi - begin], start + lo - logical)
        state = self._hashes[object_id]
        if offset == state.cursor:
            state.hasher.update(view)
            state.cursor += len(view)
        elif offset < state.cursor:  # bytes already hashed were rewritten: hash the object again from the file
            self._hashes[object_id] = _ObjectHash()

    def _read(self, begin: int, size: int) -> bytes:
        """`size` bytes of the logical payload from `begin`, read back from the files being written."""
        end = begin + size
        pieces = []
        for fd, (logical, span, start) in zip(self._fds, self._spans, strict=True):
            lo, hi = max(begin, logical), min(end, logical + span)
            if lo < hi:
                pieces.append(os.pread(fd, hi - lo, start + lo - logical))
        return b"".join(pieces)

    def _finish_hash(self, object_id: str) -> None:
        """Hash the rest of the object (bytes written ahead of its hashed prefix, and gaps never written) from
        the files."""
        obj, state = self._objects[object_id], self._hashes[object_id]
        while state.cursor < obj.bytes:
            size = min(READ_BACK_CHUNK, obj.bytes - state.cursor)
            state.hasher.update(self._read(obj.offset + state.cursor, size))
            state.cursor += size

    def _write_digests(self) -> None:
        """Replace the placeholder digests in the entry file's directory with the objects' SHA-256."""
        for object_id in self._hashes:
            self._finish_hash(object_id)
        self.directory.objects = [replace(o, sha256=self._hashes[o.id].hasher.hexdigest())
                                  for o in self.directory.objects]
        text = self.directory.dumps().encode("utf-8")
        if len(text) > self._json_bytes:
            raise AssertionError("the directory with digests outgrew the room its placeholders held")
        os.pwrite(self._fds[0], text.ljust(self._json_bytes, b" "), HEADER_BYTES)

    def commit(self) -> list[Path]:
        """Record the digests, flush, close and move the files into place; remove parts of an older artifact left
        at the path."""
        self._write_digests()
        for fd in self._fds:
            os.fsync(fd)
            os.close(fd)
        self._fds = []
        for temp, final in zip(self._temp_paths, self.final_paths, strict=True):
            os.replace(temp, final)
        index = len(self.final_paths)
        while (stale := self.path.with_name(part_name(self.path.name, index))).exists():
            stale.unlink()
            index += 1
        return list(self.final_paths)

    def abort(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        for temp in self._temp_paths:
            temp.unlink(missing_ok=True)

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def write_artifact(path: str | os.PathLike[str], tensors: dict[str, tuple[torch.Tensor, str]],
                   resources: dict[str, bytes], components: dict[str, Any], metadata: dict[str, Any] | None = None,
                   provenance: dict[str, Any] | None = None, artifact_id: bytes | None = None,
                   part_cap: int = DEFAULT_PART_CAP) -> list[Path]:
    """Write a small artifact from in-memory tensors (id -> (tensor, format)) and resources (id -> bytes):
    resources first, then tensors in the given order. For tests and tools; converters stream instead."""
    specs: list[TensorSpec | ResourceSpec] = [ResourceSpec(i, len(b)) for i, b in resources.items()]
    specs += [TensorSpec(i, tuple(t.shape), fmt) for i, (t, fmt) in tensors.items()]
    with ArtifactWriter(path, plan_objects(specs), components, metadata or {}, provenance or {}, artifact_id,
                        part_cap) as writer:
        for object_id, data in resources.items():
            writer.write(object_id, data)
        for object_id, (tensor, fmt) in tensors.items():
            writer.write(object_id, codec_for(fmt).encode(tensor))
    return writer.final_paths
