"""The JSON directory of a `.ninfer` artifact: its data model and its validation.

The schema is closed: unknown or missing members are errors, so a reader never silently misreads a
file written by a newer or broken writer. Every error names the object and the rule it breaks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ninfer.artifact.framing import PAYLOAD_ALIGN, TENSOR_ALIGN, part_name
from ninfer.errors import FormatError
from ninfer.quant import codec_for

RESOURCE_ENCODING = "raw_bytes_v1"
ROOT_REQUIRED = ("components", "objects", "files", "metadata", "provenance")
ROOT_OPTIONAL = ("bindings", "uses")  # NInfer v3 members: kept verbatim, not interpreted yet
COMPONENT_REQUIRED = ("config", "resources")
COMPONENT_OPTIONAL = ("target", "proposal")
TENSOR_MEMBERS = ("id", "kind", "shape", "format", "layout", "offset", "bytes")
RESOURCE_MEMBERS = ("id", "kind", "encoding", "offset", "bytes")
RESOURCE_PREFIX = "frontend/"
DIGEST_MEMBER = "sha256"  # ninfer's extension: optional in every object entry (docs/artifact-format.md §2.1)
DIGEST_HEX = 64


class DirectoryError(ValueError):
    """A rule of the directory schema is broken; the message names the member and the rule."""


@dataclass(frozen=True)
class ObjectEntry:
    id: str
    kind: str  # "tensor" or "resource"
    offset: int  # in the logical payload (all files' payloads concatenated)
    bytes: int
    shape: tuple[int, ...] = ()
    format: str = ""
    layout: str = ""
    sha256: str | None = None  # lowercase hex SHA-256 of the stored bytes; None: not recorded (no check)

    @property
    def component(self) -> str:
        return self.id.split("/", 1)[0]

    def to_json(self) -> dict[str, Any]:
        if self.kind == "resource":
            entry = {"id": self.id, "kind": "resource", "encoding": RESOURCE_ENCODING,
                     "offset": self.offset, "bytes": self.bytes}
        else:
            entry = {"id": self.id, "kind": "tensor", "shape": list(self.shape), "format": self.format,
                     "layout": self.layout, "offset": self.offset, "bytes": self.bytes}
        if self.sha256 is not None:
            entry[DIGEST_MEMBER] = self.sha256
        return entry


@dataclass(frozen=True)
class FileEntry:
    path: str | None  # None for the entry file
    payload_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "payload_bytes": self.payload_bytes}


@dataclass
class Directory:
    components: dict[str, dict[str, Any]]
    objects: list[ObjectEntry]
    files: list[FileEntry]
    metadata: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # bindings / uses, verbatim

    def to_json(self) -> dict[str, Any]:
        root: dict[str, Any] = {
            "components": self.components,
            "objects": [o.to_json() for o in self.objects],
            "files": [f.to_json() for f in self.files],
            "metadata": self.metadata,
            "provenance": self.provenance,
        }
        root.update(self.extra)
        return root

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"), ensure_ascii=False)

    @property
    def payload_bytes(self) -> int:
        return sum(f.payload_bytes for f in self.files)

    def object(self, object_id: str) -> ObjectEntry:
        for obj in self.objects:
            if obj.id == object_id:
                return obj
        raise KeyError(object_id)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_digest(value: Any) -> bool:
    return (isinstance(value, str) and len(value) == DIGEST_HEX
            and all(c in "0123456789abcdef" for c in value))


def _exact_members(what: str, value: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    if not isinstance(value, dict):
        raise DirectoryError(f"{what} must be a JSON object")
    missing = [m for m in required if m not in value]
    unknown = [m for m in value if m not in required and m not in optional]
    if missing:
        raise DirectoryError(f"{what} lacks member(s) {', '.join(missing)}")
    if unknown:
        raise DirectoryError(f"{what} has unknown member(s) {', '.join(unknown)}")


def _parse_object(index: int, raw: Any) -> ObjectEntry:
    what = f"objects[{index}]"
    if isinstance(raw, dict) and isinstance(raw.get("id"), str):
        what = f"object {raw['id']!r}"
    kind = raw.get("kind") if isinstance(raw, dict) else None
    if kind == "tensor":
        _exact_members(what, raw, TENSOR_MEMBERS, (DIGEST_MEMBER,))
    elif kind == "resource":
        _exact_members(what, raw, RESOURCE_MEMBERS, (DIGEST_MEMBER,))
        if raw["encoding"] != RESOURCE_ENCODING:
            raise DirectoryError(f"{what}: unknown resource encoding {raw['encoding']!r}")
    else:
        raise DirectoryError(f"{what}: kind must be 'tensor' or 'resource', not {kind!r}")
    if not isinstance(raw["id"], str) or not raw["id"] or "/" not in raw["id"]:
        raise DirectoryError(f"{what}: id must be a non-empty 'component/name' string")
    for member in ("offset", "bytes"):
        if not _is_int(raw[member]) or raw[member] < 0:
            raise DirectoryError(f"{what}: {member} must be a non-negative integer")
    digest = raw.get(DIGEST_MEMBER)
    if DIGEST_MEMBER in raw and not is_digest(digest):
        raise DirectoryError(f"{what}: {DIGEST_MEMBER} must be {DIGEST_HEX} lowercase hex digits")
    if kind == "resource":
        return ObjectEntry(raw["id"], "resource", raw["offset"], raw["bytes"], sha256=digest)
    shape = raw["shape"]
    if not isinstance(shape, list) or len(shape) > 16 or not all(_is_int(d) and d > 0 for d in shape):
        raise DirectoryError(f"{what}: shape must be a list of at most 16 positive integers")
    for member in ("format", "layout"):
        if not isinstance(raw[member], str):
            raise DirectoryError(f"{what}: {member} must be a string")
    entry = ObjectEntry(raw["id"], "tensor", raw["offset"], raw["bytes"], tuple(shape), raw["format"],
                        raw["layout"], digest)
    try:
        codec = codec_for(entry.format, entry.layout)
        codec.check_shape(entry.shape)
        expected = codec.encoded_bytes(entry.shape)
    except FormatError as exc:
        raise DirectoryError(f"{what}: {exc}") from None
    if entry.bytes != expected:
        raise DirectoryError(
            f"{what}: bytes is {entry.bytes} but {entry.format} {list(entry.shape)} encodes to {expected}"
        )
    return entry


def parse_directory(root: Any, entry_name: str) -> Directory:
    """Validate a decoded JSON directory and build its data model (geometry included)."""
    _exact_members("the directory root", root, ROOT_REQUIRED, ROOT_OPTIONAL)
    for member in ("metadata", "provenance"):
        if not isinstance(root[member], dict):
            raise DirectoryError(f"{member} must be a JSON object")
    files = _parse_files(root["files"], entry_name)
    if not isinstance(root["objects"], list):
        raise DirectoryError("objects must be a JSON array")
    objects = [_parse_object(i, raw) for i, raw in enumerate(root["objects"])]
    components = _parse_components(root["components"], objects)
    directory = Directory(components, objects, files, root["metadata"], root["provenance"],
                          {k: root[k] for k in ROOT_OPTIONAL if k in root})
    check_geometry(directory)
    return directory


def _parse_files(raw: Any, entry_name: str) -> list[FileEntry]:
    if not isinstance(raw, list) or not raw:
        raise DirectoryError("files must be a non-empty JSON array (the entry file first)")
    files = []
    for i, item in enumerate(raw):
        _exact_members(f"files[{i}]", item, ("path", "payload_bytes"))
        expected = None if i == 0 else part_name(entry_name, i)
        if item["path"] != expected:
            raise DirectoryError(f"files[{i}]: path is {item['path']!r}, expected {expected!r}")
        size = item["payload_bytes"]
        if not _is_int(size) or size < 0:
            raise DirectoryError(f"files[{i}]: payload_bytes must be a non-negative integer")
        if i < len(raw) - 1 and size % PAYLOAD_ALIGN:
            raise DirectoryError(f"files[{i}]: payload_bytes {size} of a non-final file is not a multiple "
                                 f"of {PAYLOAD_ALIGN}")
        files.append(FileEntry(item["path"], size))
    return files


def _parse_components(raw: Any, objects: list[ObjectEntry]) -> dict[str, dict[str, Any]]:
    if not isinstance(raw, dict) or "text" not in raw:
        raise DirectoryError("components must be a JSON object with a 'text' component")
    kinds = {o.id: o.kind for o in objects}
    for name, component in raw.items():
        what = f"component {name!r}"
        _exact_members(what, component, COMPONENT_REQUIRED, COMPONENT_OPTIONAL)
        if not isinstance(component["config"], dict):
            raise DirectoryError(f"{what}: config must be a JSON object")
        resources = component["resources"]
        if not isinstance(resources, dict):
            raise DirectoryError(f"{what}: resources must map roles to object ids")
        for role, object_id in resources.items():
            if not isinstance(object_id, str) or kinds.get(object_id) != "resource":
                raise DirectoryError(f"{what}: resource {role!r} names {object_id!r}, which is not a resource "
                                     "object")
    for obj in objects:
        if obj.kind == "tensor" and obj.component not in raw:
            raise DirectoryError(f"object {obj.id!r}: its component {obj.component!r} is not in components")
        if obj.kind == "resource" and not obj.id.startswith(RESOURCE_PREFIX):
            raise DirectoryError(f"object {obj.id!r}: resource ids start with {RESOURCE_PREFIX!r}")
    return raw


def check_geometry(directory: Directory) -> None:
    """Objects are ordered by offset, aligned, non-overlapping, inside the payload, with unique ids."""
    total = directory.payload_bytes
    cursor = 0
    seen: set[str] = set()
    for obj in directory.objects:
        what = f"object {obj.id!r}"
        if obj.id in seen:
            raise DirectoryError(f"{what}: id appears twice")
        seen.add(obj.id)
        alignment = TENSOR_ALIGN if obj.kind == "tensor" else 1
        if obj.offset % alignment:
            raise DirectoryError(f"{what}: offset {obj.offset} is not {alignment}-byte aligned")
        if obj.offset < cursor:
            raise DirectoryError(f"{what}: offset {obj.offset} overlaps or precedes the previous object "
                                 f"(which ends at {cursor})")
        end = obj.offset + obj.bytes
        if end > total:
            raise DirectoryError(f"{what}: ends at {end}, beyond the payload's {total} bytes")
        cursor = end
