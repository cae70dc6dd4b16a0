"""The format registry: one `Codec` per stored (format, layout) identity.

A codec knows the encoded size of a shape, how its bytes split into planes that can be written a block
of rows at a time (so a converter never holds more than a few rows of a large matrix), how to encode
rows, how to decode bytes exactly into a torch tensor on the bytes' device, how to check that stored
bytes are legal, and an element-wise bound on the reconstruction error. The container code only
talks to this interface; a new format registers a codec and nothing else changes.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ninfer.errors import FormatError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Plane:
    """A region of an encoded object: starts at `offset` (relative to the object) and holds
    `row_bytes` bytes for each row, rows stored one after another."""

    offset: int
    row_bytes: int


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def row_count(shape: Shape) -> int:
    """Rows of a tensor for plane-wise writing: the first dimension of a matrix, 1 for scalars and vectors."""
    return shape[0] if len(shape) >= 2 else 1


class Codec(ABC):
    """Encoder, exact decoder and size function of one (format, layout) pair."""

    format: str
    layout: str
    alignment: int = 256  # required alignment of the object's offset in the payload
    # what encode_rows accepts: "float" (any float dtype) or "int" (integer dtypes)
    source_kind: str = "float"

    @abstractmethod
    def check_shape(self, shape: Shape) -> None:
        """Raise FormatError when the layout cannot hold a tensor of this shape."""

    @abstractmethod
    def planes(self, shape: Shape) -> list[Plane]:
        """The object's planes in storage order; rows come from `row_count(shape)`."""

    @abstractmethod
    def encoded_bytes(self, shape: Shape) -> int:
        """Exact byte count of an encoded object of this shape (the directory's `bytes`)."""

    @abstractmethod
    def encode_rows(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Encode a block of whole rows (shape [r, *shape[1:]], or the whole tensor for rank < 2) into one
        uint8 tensor per plane, each holding r * plane.row_bytes bytes. Raises FormatError on values the
        format cannot represent (non-finite input, out of range)."""

    @abstractmethod
    def decode(self, data: torch.Tensor, shape: Shape) -> torch.Tensor:
        """Decode the object's bytes (a 1-D uint8 tensor of `encoded_bytes(shape)` bytes, on any device)
        into a tensor of `shape` on the same device; exact, in the codec's natural dtype."""

    @abstractmethod
    def error_bound(self, source: torch.Tensor) -> torch.Tensor:
        """Element-wise upper bound of |decode(encode(source)) - source| (float32, source's shape)."""

    def validate(self, data: torch.Tensor, shape: Shape) -> None:
        """Raise FormatError when stored bytes hold an illegal value (default: every bit pattern is legal)."""

    def bits_per_weight(self, shape: Shape) -> float:
        numel = math.prod(shape)
        return 8.0 * self.encoded_bytes(shape) / numel if numel else 0.0

    def encode(self, tensor: torch.Tensor) -> torch.Tensor:
        """Encode a whole tensor into its object bytes (a 1-D uint8 tensor), planes at their offsets."""
        shape = tuple(tensor.shape)
        self.check_shape(shape)
        out = torch.zeros(self.encoded_bytes(shape), dtype=torch.uint8, device=tensor.device)
        for plane, buf in zip(self.planes(shape), self.encode_rows(tensor), strict=True):
            out[plane.offset : plane.offset + buf.numel()] = buf.reshape(-1)
        return out


_REGISTRY: dict[str, Codec] = {}


def register(codec: Codec) -> Codec:
    if codec.format in _REGISTRY:
        raise ValueError(f"format {codec.format!r} is registered twice")
    _REGISTRY[codec.format] = codec
    return codec


def codec_for(fmt: str, layout: str | None = None) -> Codec:
    """The codec of a stored format (and, when given, check that its layout matches)."""
    _load_builtin_codecs()
    codec = _REGISTRY.get(fmt)
    if codec is None:
        known = ", ".join(sorted(_REGISTRY))
        raise FormatError(f"unknown numeric format {fmt!r} (known: {known})")
    if layout is not None and layout != codec.layout:
        raise FormatError(f"format {fmt!r} is stored in layout {codec.layout!r}, not {layout!r}")
    return codec


def registered_formats() -> list[str]:
    _load_builtin_codecs()
    return sorted(_REGISTRY)


def _load_builtin_codecs() -> None:
    # Importing the modules registers their codecs; done lazily to avoid an import cycle.
    from ninfer.quant import contiguous, fp8_row, groupwise  # noqa: F401


def check_finite(rows: torch.Tensor, what: str) -> None:
    if rows.is_floating_point() and not bool(torch.isfinite(rows).all()):
        bad = (~torch.isfinite(rows)).nonzero()[0].tolist()
        raise FormatError(f"{what}: non-finite value at index {bad}; NaN and Inf cannot be encoded")
