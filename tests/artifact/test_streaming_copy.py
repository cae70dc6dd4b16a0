"""What a streaming copy of an artifact needs from the container code: byte ranges of an object (within one file
and across parts), mapped pages released and read back, and the optional root members kept by the writer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer.artifact import ArtifactWriter, TensorSpec, open_artifact, plan_objects
from tests.artifact.test_read_write import MINIMAL_COMPONENTS, spanning_tensors, write_spanning


def test_raw_reads_a_byte_range_within_one_file_and_across_parts(tmp_path: Path) -> None:
    paths = write_spanning(tmp_path)
    wide = bytes(spanning_tensors()["text/wide"][0].view(torch.uint8).reshape(-1).numpy())
    with open_artifact(paths[0]) as artifact:
        obj = artifact.object("text/wide")
        for start, stop in ((0, obj.bytes), (5, 6), (7, 7), (100, obj.bytes - 3), (obj.bytes - 1, obj.bytes)):
            assert bytes(artifact.raw("text/wide", start, stop).numpy()) == wide[start:stop], (start, stop)
        for start, stop in ((-1, 4), (4, 3), (0, obj.bytes + 1)):
            with pytest.raises(ValueError, match="outside object 'text/wide'"):
                artifact.raw("text/wide", start, stop)


def test_released_pages_read_back_from_the_file(tmp_path: Path) -> None:
    paths = write_spanning(tmp_path)
    with open_artifact(paths[0]) as artifact:
        before = {o.id: bytes(artifact.raw(o.id).numpy()) for o in artifact.objects}
        for obj in artifact.objects:
            artifact.release(obj.id, 1, max(1, obj.bytes - 1))
        assert {o.id: bytes(artifact.raw(o.id).numpy()) for o in artifact.objects} == before


def test_writer_keeps_the_optional_root_members(tmp_path: Path) -> None:
    extra = {"bindings": {"head": ["text/w", 1]}, "uses": [{"object": "text/w", "allow": "a8"}]}
    path = tmp_path / "model.ninfer"
    with ArtifactWriter(path, plan_objects([TensorSpec("text/w", (2, 4), "bf16")]), MINIMAL_COMPONENTS, {}, {},
                        extra=extra) as writer:
        writer.write("text/w", torch.ones(2, 4, dtype=torch.bfloat16))
    with open_artifact(path) as artifact:
        assert artifact.directory.extra == extra
