"""Source checkpoints: tensors read a block of rows at a time, never a whole model.

A `TensorSource` names its tensors with shapes and dtypes, and reads rows of a tensor viewed as a matrix:
`read_rows(name, lead, start, stop)` indexes the leading dimensions `lead` (e.g. one expert of a fused
[E, 2I, H] bank), then returns rows [start, stop) of what is left viewed as [rows, prod(rest)]. A vector is
one row. `SafetensorsSource` reads HF folders (one file, shards with an index, shards without one);
synthetic sources (ninfer synth) generate rows instead.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from pathlib import Path

import torch
from safetensors import safe_open

from ninfer.errors import ConversionError

INDEX_NAME = "model.safetensors.index.json"
FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def matrix_rows(shape: tuple[int, ...], lead: int) -> tuple[int, int]:
    """(rows, columns) of a tensor of `shape` once `lead` leading dimensions are indexed away."""
    rest = shape[lead:]
    if len(rest) <= 1:
        return 1, math.prod(rest)
    return rest[0], math.prod(rest[1:])


class TensorSource(ABC):
    @abstractmethod
    def names(self) -> list[str]: ...

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]: ...

    @abstractmethod
    def dtype(self, name: str) -> str:
        """The tensor's dtype as safetensors spells it ('BF16', 'F32', ...)."""

    @abstractmethod
    def read_rows(self, name: str, lead: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` indexed by `lead`, as a [stop - start, columns] tensor."""

    def files(self) -> list[Path]:
        """The files the tensors come from (for provenance and hashing); none for synthetic sources."""
        return []


class SafetensorsSource(TensorSource):
    """The safetensors files of a Hugging Face model folder, memory-mapped."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._files = self._find_files(folder)
        self._handles = {}
        self._where: dict[str, Path] = {}
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        for path in self._files:
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for damaged headers
                raise ConversionError(f"{path}: cannot read safetensors header ({exc})") from None
            self._handles[path] = handle
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name in self._where:
                    raise ConversionError(f"tensor {name!r} appears in both {self._where[name].name} and "
                                          f"{path.name}")
                piece = handle.get_slice(name)
                self._where[name] = path
                self._meta[name] = (tuple(piece.get_shape()), piece.get_dtype())
        self._check_index()

    @staticmethod
    def _find_files(folder: Path) -> list[Path]:
        index = folder / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ConversionError(f"{index}: not a safetensors index ({exc})") from None
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (folder / n).is_file()]
            if missing:
                raise ConversionError(f"{folder}: shard {missing[0]} named by {INDEX_NAME} is missing")
            return [folder / n for n in names]
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ConversionError(f"{folder}: no *.safetensors files")
        return files

    def _check_index(self) -> None:
        index = self.folder / INDEX_NAME
        if not index.is_file():
            return
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        for name, file_name in weight_map.items():
            where = self._where.get(name)
            if where is None or where.name != file_name:
                raise ConversionError(f"{index.name} places {name!r} in {file_name}, but that shard lacks it")

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> str:
        return self._meta[name][1]

    def read_rows(self, name: str, lead: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        shape = self.shape(name)
        piece = self._handles[self._where[name]].get_slice(name)
        if len(shape) - len(lead) <= 1:
            tensor = piece[lead] if lead else piece[:]
        else:
            tensor = piece[(*lead, slice(start, stop))]
        return tensor.reshape(stop - start, -1)

    def files(self) -> list[Path]:
        return list(self._files)
