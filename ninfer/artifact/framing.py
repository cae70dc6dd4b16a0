"""Byte framing of `.ninfer` files (container version 3); see docs/artifact-format.md.

Entry file:  [0, 8) magic "NINFER\\0\\x03" | [8, 16) json_bytes u64 LE | [16, 32) artifact id
             [32, 32 + json_bytes) JSON directory | zeros | payload from align_up(32 + json_bytes, 4096)
Part file:   [0, 8) magic "NINPRT\\0\\x03" | [8, 16) part index u64 LE | [16, 32) artifact id
             zeros | payload from 4096
"""

from __future__ import annotations

import struct
import uuid

ENTRY_MAGIC = b"NINFER\x00\x03"
PART_MAGIC = b"NINPRT\x00\x03"
HEADER_BYTES = 32
PAYLOAD_ALIGN = 4096
PART_PAYLOAD_OFFSET = 4096
DEFAULT_PART_CAP = 32_000_000_000
TENSOR_ALIGN = 256
ID_BYTES = 16

_HEADER = struct.Struct("<8sQ16s")


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def payload_offset(json_bytes: int) -> int:
    """Where the entry file's payload starts for a directory of `json_bytes` bytes."""
    return align_up(HEADER_BYTES + json_bytes, PAYLOAD_ALIGN)


def part_name(entry_name: str, index: int) -> str:
    """File name of continuation part `index` (its position in `files`, 1-based for parts)."""
    return f"{entry_name}.part-{index:04d}"


def pack_header(magic: bytes, value: int, artifact_id: bytes) -> bytes:
    return _HEADER.pack(magic, value, artifact_id)


def unpack_header(data: bytes) -> tuple[bytes, int, bytes]:
    """(magic, json_bytes or part index, artifact id) of a 32-byte header."""
    return _HEADER.unpack(data)


def new_artifact_id() -> bytes:
    return uuid.uuid4().bytes


def parse_artifact_id(text: str) -> bytes:
    """An artifact id from 32 hex digits or a UUID string."""
    try:
        return uuid.UUID(text).bytes
    except ValueError as exc:
        raise ValueError(f"artifact id {text!r} is not 32 hex digits or a UUID") from exc


def format_artifact_id(raw: bytes) -> str:
    return str(uuid.UUID(bytes=raw))
