"""The `.ninfer` v3 container: framing read back byte by byte, parts, zero-copy reads, determinism, writer
clean-up, and rejection of malformed files (each built from a good artifact by one computed corruption)."""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ninfer.artifact import ArtifactWriter, TensorSpec, open_artifact, plan_objects, write_artifact
from ninfer.errors import ArtifactError, FormatError
from ninfer.quant import codec_for

# The framing, restated from the spec (reference/ninfer-forks.md §b.1) rather than imported, so that these
# tests check the writer against the format and not against itself.
HEADER = struct.Struct("<8sQ16s")
ENTRY_MAGIC = b"NINFER\x00\x03"
PART_MAGIC = b"NINPRT\x00\x03"
PAGE = 4096
TENSOR_ALIGN = 256
ARTIFACT_ID = bytes(range(16))
PART_CAP = 3 * PAGE  # 8192 payload bytes per file: small tensors spread over several parts

COMPONENTS = {
    "text": {
        "config": {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 64,
                   "layer_types": ["linear_attention", "full_attention"]},
        "resources": {"tokenizer.json": "frontend/tokenizer.json",
                      "chat_template.jinja": "frontend/chat_template.jinja"},
    },
    "vision": {"config": {"depth": 1, "out_hidden_size": 64}, "resources": {}},
}
RESOURCES = {
    "frontend/tokenizer.json": json.dumps({"model": {"vocab": {"ä": 0, "日本": 1}}}, ensure_ascii=False).encode(),
    "frontend/chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
    "frontend/blob.bin": bytes(range(256)) * 3 + b"\x00",  # every byte value, odd length: packs unaligned
    "frontend/empty.txt": b"",
}
METADATA = {"name": "tiny-mixed", "recipe": "test", "nested": {"list": [1, 2.5, None, "ü"]}}
PROVENANCE = {"source": "tests/artifact/test_read_write.py", "seed": 0}


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def mixed_tensors(seed: int = 0) -> dict[str, tuple[torch.Tensor, str]]:
    """Every format, plain tensors of rank 0 to 3, two components."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g)

    return {
        "text/scalar": (randn(), "fp32"),
        "text/norm": (randn(7), "fp16"),
        "text/embed": (randn(16, 40).to(torch.bfloat16), "bf16"),
        "text/conv": (randn(2, 3, 5), "bf16"),
        "text/positions": (torch.arange(-3, 9, dtype=torch.int32).reshape(3, 4), "i32"),
        "text/q4": (randn(4, 130), "q4_g64_fp16"),
        "text/q5": (randn(3, 200), "q5_g64_fp16"),
        "text/q6": (randn(2, 64), "q6_g64_fp16"),
        "text/q8": (randn(5, 96), "q8_g32_fp16"),
        "text/fp8": (randn(3, 40), "fp8_e4m3fn_row_bf16"),
        "vision/patch": (randn(8, 8).to(torch.bfloat16), "bf16"),
    }


def spanning_tensors(seed: int = 1) -> dict[str, tuple[torch.Tensor, str]]:
    """About 32 KiB of payload: with PART_CAP, `text/wide` (24 KiB) covers at least three files."""
    g = torch.Generator().manual_seed(seed)
    return {
        "text/a": (torch.randn(16, 64, generator=g).to(torch.bfloat16), "bf16"),
        "text/wide": (torch.randn(96, 128, generator=g).to(torch.bfloat16), "bf16"),
        "text/q8": (torch.randn(40, 128, generator=g), "q8_g32_fp16"),
        "vision/p": (torch.randn(4, 4, generator=g), "fp16"),
    }


def expected_decode(tensor: torch.Tensor, fmt: str) -> torch.Tensor:
    codec = codec_for(fmt)
    return codec.decode(codec.encode(tensor), tuple(tensor.shape))


def read_entry(path: Path) -> tuple[bytes, int, bytes, dict, int]:
    """(magic, json length, artifact id, directory, payload start) read straight from the entry file."""
    data = path.read_bytes()
    magic, json_len, artifact_id = HEADER.unpack_from(data)
    return magic, json_len, artifact_id, json.loads(data[32 : 32 + json_len]), align_up(32 + json_len, PAGE)


def write_spanning(folder: Path, artifact_id: bytes = ARTIFACT_ID, part_cap: int = PART_CAP) -> list[Path]:
    folder.mkdir(exist_ok=True)
    return write_artifact(folder / "model.ninfer", spanning_tensors(), RESOURCES, COMPONENTS, metadata=METADATA,
                          provenance=PROVENANCE, artifact_id=artifact_id, part_cap=part_cap)


# -- round trips ------------------------------------------------------------------------------------------------


def test_single_file_round_trip_matches_the_format_byte_for_byte(tmp_path: Path) -> None:
    tensors = mixed_tensors()
    path = tmp_path / "mixed.ninfer"
    written = write_artifact(path, tensors, RESOURCES, COMPONENTS, metadata=METADATA, provenance=PROVENANCE,
                             artifact_id=ARTIFACT_ID)
    assert written == [path]
    assert [p.name for p in tmp_path.iterdir()] == ["mixed.ninfer"]

    data = path.read_bytes()
    magic, json_len, artifact_id, root, start = read_entry(path)
    assert (magic, artifact_id) == (ENTRY_MAGIC, ARTIFACT_ID)
    assert start % PAGE == 0 and start >= 32 + json_len
    assert data[32 + json_len : start].strip(b"\x00") == b""  # zero padding up to the payload
    assert root["metadata"] == METADATA and root["provenance"] == PROVENANCE and root["components"] == COMPONENTS
    assert root["files"] == [{"path": None, "payload_bytes": len(data) - start}]

    objects = {o["id"]: o for o in root["objects"]}
    assert set(objects) == set(tensors) | set(RESOURCES)
    ordered = sorted(root["objects"], key=lambda o: o["offset"])
    for before, after in itertools.pairwise(ordered):
        assert before["offset"] + before["bytes"] <= after["offset"]
    for object_id, (tensor, fmt) in tensors.items():
        obj = objects[object_id]
        encoded = bytes(codec_for(fmt).encode(tensor).numpy())
        assert (obj["kind"], obj["format"], obj["shape"]) == ("tensor", fmt, list(tensor.shape))
        assert obj["offset"] % TENSOR_ALIGN == 0, object_id
        assert data[start + obj["offset"] : start + obj["offset"] + obj["bytes"]] == encoded, object_id
    for object_id, payload in RESOURCES.items():
        obj = objects[object_id]
        assert (obj["kind"], obj["encoding"], obj["bytes"]) == ("resource", "raw_bytes_v1", len(payload))
        assert data[start + obj["offset"] : start + obj["offset"] + obj["bytes"]] == payload

    with open_artifact(path) as artifact:
        assert artifact.artifact_id == ARTIFACT_ID
        assert artifact.directory.metadata == METADATA
        assert artifact.directory.provenance == PROVENANCE
        assert artifact.components == COMPONENTS
        for object_id, (tensor, fmt) in tensors.items():
            got, want = artifact.tensor(object_id), expected_decode(tensor, fmt)
            assert (got.dtype, got.shape) == (want.dtype, want.shape), object_id
            assert torch.equal(got, want), object_id
        # plain formats of a source already in that dtype are stored exactly
        for object_id in ("text/embed", "text/positions", "vision/patch"):
            assert torch.equal(artifact.tensor(object_id), tensors[object_id][0])
        assert artifact.tensor("text/scalar").shape == ()
        for object_id, payload in RESOURCES.items():
            assert artifact.resource(object_id) == payload
        assert artifact.component_resource("text", "tokenizer.json") == RESOURCES["frontend/tokenizer.json"]
        assert artifact.component_resource("vision", "tokenizer.json") is None


@pytest.mark.parametrize("part_cap", [PART_CAP, PART_CAP + 1000])  # caps are floored to whole pages
def test_parts_split_objects_across_files_and_read_back(tmp_path: Path, part_cap: int) -> None:
    tensors = spanning_tensors()
    paths = write_spanning(tmp_path, part_cap=part_cap)
    count = len(paths)
    names = ["model.ninfer"] + [f"model.ninfer.part-{i:04d}" for i in range(1, count)]
    assert count >= 4
    assert [p.name for p in paths] == names
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)

    _, _, _, root, entry_start = read_entry(paths[0])
    files = root["files"]
    assert [f["path"] for f in files] == [None, *names[1:]]
    starts = [entry_start] + [PAGE] * (count - 1)
    for index, (path, entry, start) in enumerate(zip(paths, files, starts, strict=True)):
        data = path.read_bytes()
        assert len(data) <= PART_CAP, path.name
        assert len(data) == start + entry["payload_bytes"], path.name
        if index < count - 1:
            assert entry["payload_bytes"] > 0 and entry["payload_bytes"] % PAGE == 0, path.name
        if index:
            assert HEADER.unpack_from(data) == (PART_MAGIC, index, ARTIFACT_ID), path.name
            assert data[32:PAGE] == bytes(PAGE - 32), path.name

    # which files each object's logical byte range touches, from the directory alone
    bounds, cursor = [], 0
    for entry in files:
        bounds.append((cursor, cursor + entry["payload_bytes"]))
        cursor += entry["payload_bytes"]
    objects = {o["id"]: o for o in root["objects"]}
    touched = {object_id: [i for i, (lo, hi) in enumerate(bounds) if obj["offset"] < hi
                           and obj["offset"] + obj["bytes"] > lo] for object_id, obj in objects.items()}
    assert len(touched["text/wide"]) >= 3

    logical = b"".join(path.read_bytes()[start:] for path, start in zip(paths, starts, strict=True))
    for object_id, (tensor, fmt) in tensors.items():
        obj = objects[object_id]
        assert logical[obj["offset"] : obj["offset"] + obj["bytes"]] == bytes(codec_for(fmt).encode(tensor).numpy())
    for object_id, payload in RESOURCES.items():
        obj = objects[object_id]
        assert logical[obj["offset"] : obj["offset"] + obj["bytes"]] == payload

    with open_artifact(paths[0]) as artifact:
        assert artifact.files == paths
        for object_id, (tensor, fmt) in tensors.items():
            assert torch.equal(artifact.tensor(object_id), expected_decode(tensor, fmt)), object_id
        for object_id, payload in RESOURCES.items():
            assert artifact.resource(object_id) == payload


def test_plain_tensor_in_one_file_is_a_view_of_the_mapping(tmp_path: Path) -> None:
    path = tmp_path / "mixed.ninfer"
    write_artifact(path, mixed_tensors(), RESOURCES, COMPONENTS, artifact_id=ARTIFACT_ID)
    before = path.read_bytes()
    with open_artifact(path) as artifact:
        first, second = artifact.tensor("text/embed"), artifact.tensor("text/embed")
        raw, other = artifact.raw("text/embed"), artifact.raw("vision/patch")
        assert first.data_ptr() == second.data_ptr() == raw.data_ptr()
        offsets = {o.id: o.offset for o in artifact.objects}
        assert other.data_ptr() - raw.data_ptr() == offsets["vision/patch"] - offsets["text/embed"]
        first[0, 0] = -3.5  # exact in bf16; visible through every view of the same mapping
        assert second[0, 0].item() == -3.5
        assert artifact.tensor("text/embed")[0, 0].item() == -3.5
    assert first[0, 0].item() == -3.5  # the mapping outlives close() while a tensor views it
    assert path.read_bytes() == before  # copy-on-write: the file itself never changes


def test_object_spanning_parts_decodes_exactly(tmp_path: Path) -> None:
    paths = write_spanning(tmp_path)
    wide = spanning_tensors()["text/wide"][0]
    with open_artifact(paths[0]) as artifact:
        assert torch.equal(artifact.tensor("text/wide"), wide)
        assert bytes(artifact.raw("text/wide").numpy()) == bytes(wide.view(torch.uint8).reshape(-1).numpy())


def test_same_content_and_id_give_identical_files(tmp_path: Path) -> None:
    first = write_spanning(tmp_path / "first")
    second = write_spanning(tmp_path / "second")
    other_id = write_spanning(tmp_path / "other", artifact_id=bytes(16 * [0xA5]))
    assert [p.name for p in first] == [p.name for p in second] == [p.name for p in other_id]
    for a, b, c in zip(first, second, other_id, strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name
        x, z = a.read_bytes(), c.read_bytes()
        assert len(x) == len(z) and [i for i in range(len(x)) if x[i] != z[i]] == list(range(16, 32)), a.name


# -- writer clean-up ---------------------------------------------------------------------------------------------


def _planned_wide() -> list:
    return plan_objects([TensorSpec("text/wide", (96, 128), "bf16")])


MINIMAL_COMPONENTS = {"text": {"config": {}, "resources": {}}}


def test_exception_inside_writer_removes_every_incomplete_file(tmp_path: Path) -> None:
    path = tmp_path / "model.ninfer"
    with pytest.raises(RuntimeError, match="conversion interrupted"), \
            ArtifactWriter(path, _planned_wide(), MINIMAL_COMPONENTS, {}, {}, part_cap=PART_CAP) as writer:
        writer.write("text/wide", torch.ones(96, 128, dtype=torch.bfloat16))
        temporary = [p.name for p in tmp_path.iterdir()]
        assert len(temporary) >= 3 and all(name.endswith(".incomplete") for name in temporary)
        raise RuntimeError("conversion interrupted")
    assert list(tmp_path.iterdir()) == []


def test_abort_removes_every_incomplete_file(tmp_path: Path) -> None:
    writer = ArtifactWriter(tmp_path / "model.ninfer", _planned_wide(), MINIMAL_COMPONENTS, {}, {},
                            part_cap=PART_CAP)
    writer.write("text/wide", torch.ones(96, 128, dtype=torch.bfloat16))
    assert len(list(tmp_path.iterdir())) >= 3
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_failed_rewrite_keeps_the_older_artifact_intact(tmp_path: Path) -> None:
    paths = write_spanning(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    bad = torch.ones(96, 128)
    bad[5, 7] = float("nan")
    with pytest.raises(FormatError, match="NaN"):
        write_artifact(paths[0], {"text/wide": (bad, "bf16")}, {}, MINIMAL_COMPONENTS, part_cap=PART_CAP)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize(("shape", "file_count"), [((8, 8), 1), ((48, 128), 2)])
def test_rewrite_with_fewer_parts_removes_stale_parts(tmp_path: Path, shape: tuple[int, int],
                                                      file_count: int) -> None:
    old = write_spanning(tmp_path)
    assert len(old) >= 4
    tensor = torch.randn(shape).to(torch.bfloat16)
    new = write_artifact(old[0], {"text/w": (tensor, "bf16")}, {}, MINIMAL_COMPONENTS, part_cap=PART_CAP)
    assert len(new) == file_count
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in new)
    with open_artifact(new[0]) as artifact:
        assert [o.id for o in artifact.objects] == ["text/w"]
        assert torch.equal(artifact.tensor("text/w"), tensor)


def test_writer_rejects_an_artifact_id_that_is_not_16_bytes(tmp_path: Path) -> None:
    for artifact_id in (b"short", bytes(17)):
        with pytest.raises(ArtifactError, match="16 bytes"):
            write_artifact(tmp_path / "model.ninfer", {"text/w": (torch.ones(2), "bf16")}, {}, MINIMAL_COMPONENTS,
                           artifact_id=artifact_id)
    assert list(tmp_path.iterdir()) == []


# -- malformed files --------------------------------------------------------------------------------------------


Case = Callable[[Path], tuple[Path, Path]]  # entry -> (path to open, the file the message must name)


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def part(entry: Path, index: int) -> Path:
    return entry.with_name(f"{entry.name}.part-{index:04d}")


def edit_directory(entry: Path, mutate: Callable[[dict], object]) -> None:
    """Re-serialise the entry's JSON directory after `mutate`, padded with spaces to the room the original had
    (so the payload does not move) and with the header's length fixed."""
    data = bytearray(entry.read_bytes())
    _, json_len, _ = HEADER.unpack_from(data)
    start = align_up(32 + json_len, PAGE)
    root = json.loads(data[32 : 32 + json_len])
    mutate(root)
    text = json.dumps(root, separators=(",", ":"), ensure_ascii=False).encode()
    assert len(text) <= start - 32, "the edited directory no longer fits before the payload"
    text = text.ljust(start - 32, b" ")
    data[8:16] = struct.pack("<Q", len(text))
    data[32:start] = text
    entry.write_bytes(bytes(data))


def objects_by_id(root: dict) -> dict[str, dict]:
    return {o["id"]: o for o in root["objects"]}


def payload_total(root: dict) -> int:
    return sum(f["payload_bytes"] for f in root["files"])


def last_part(entry: Path) -> Path:
    _, _, _, root, _ = read_entry(entry)
    return part(entry, len(root["files"]) - 1)


def _in_directory(mutate: Callable[[dict], object]) -> Callable[[Path], tuple[Path, Path]]:
    def case(entry: Path) -> tuple[Path, Path]:
        edit_directory(entry, mutate)
        return entry, entry

    return case


def _object(object_id: str, member: str, value: Callable[[dict, dict], object]) -> Callable[[dict], None]:
    """Set one member of one object to value(object, root)."""
    def mutate(root: dict) -> None:
        obj = objects_by_id(root)[object_id]
        obj[member] = value(obj, root)

    return mutate


def _truncate_to(size: Callable[[int], int], which: Callable[[Path], Path]) -> Callable[[Path], tuple[Path, Path]]:
    def case(entry: Path) -> tuple[Path, Path]:
        target = which(entry)
        data = target.read_bytes()
        target.write_bytes(data[: size(len(data))])
        return entry, target

    return case


def _append(which: Callable[[Path], Path]) -> Callable[[Path], tuple[Path, Path]]:
    def case(entry: Path) -> tuple[Path, Path]:
        target = which(entry)
        with open(target, "ab") as f:
            f.write(b"\x00" * 16)
        return entry, target

    return case


def _patch(which: Callable[[Path], Path], offset: int, data: bytes) -> Callable[[Path], tuple[Path, Path]]:
    def case(entry: Path) -> tuple[Path, Path]:
        target = which(entry)
        patch(target, offset, data)
        return entry, target

    return case


def _open_instead(which: Callable[[Path], Path]) -> Callable[[Path], tuple[Path, Path]]:
    def case(entry: Path) -> tuple[Path, Path]:
        return which(entry), which(entry)

    return case


def _deeply_nested_directory(entry: Path) -> tuple[Path, Path]:
    text = b"[" * 100_000
    entry.write_bytes(HEADER.pack(ENTRY_MAGIC, len(text), ARTIFACT_ID) + text)
    return entry, entry


def _replace_directory(text: bytes) -> Case:
    def case(entry: Path) -> tuple[Path, Path]:
        data = bytearray(entry.read_bytes())
        _, json_len, _ = HEADER.unpack_from(data)
        room = align_up(32 + json_len, PAGE) - 32
        data[8:16] = struct.pack("<Q", room)
        data[32 : 32 + room] = text.ljust(room, b" ")
        entry.write_bytes(bytes(data))
        return entry, entry

    return case


def _missing_part(entry: Path) -> tuple[Path, Path]:
    part(entry, 2).unlink()
    return entry, part(entry, 2)


def _drop(key: str) -> Callable[[dict], None]:
    return lambda root: root.pop(key)


def _overlap(root: dict) -> None:
    ordered = root["objects"]
    index = next(i for i, o in enumerate(ordered) if o["id"] == "text/wide")
    ordered[index]["offset"] = ordered[index - 1]["offset"]  # aligned, but starts inside its predecessor


def _duplicate_id(root: dict) -> None:
    objects_by_id(root)["text/wide"]["id"] = "text/a"


def _role(value: object) -> Callable[[dict], None]:
    def mutate(root: dict) -> None:
        root["components"]["text"]["resources"]["tokenizer.json"] = value

    return mutate


def _rename(old: str, new: str) -> Callable[[dict], None]:
    return lambda root: objects_by_id(root)[old].update(id=new)


def _files(index: int, member: str, value: Callable[[object], object]) -> Callable[[dict], None]:
    return lambda root: root["files"][index].update({member: value(root["files"][index][member])})


MALFORMED: dict[str, tuple[Case, str]] = {
    # framing of the entry file
    "truncated header": (_truncate_to(lambda n: 20, lambda e: e), "truncated header (20 of 32 bytes)"),
    "empty file": (_truncate_to(lambda n: 0, lambda e: e), "truncated header (0 of 32 bytes)"),
    "bad magic": (_patch(lambda e: e, 0, b"GGUF\x03\x00\x00\x00"), "bad magic b'GGUF"),
    "continuation part as entry": (_open_instead(lambda e: part(e, 1)), "this is a continuation part"),
    "container version 2": (_patch(lambda e: e, 0, b"NINFER\x00\x02"), "container version 2 is not supported"),
    "directory length beyond the file": (_patch(lambda e: e, 8, struct.pack("<Q", 1 << 40)),
                                         f"directory length {1 << 40} does not fit"),
    "zero directory length": (_patch(lambda e: e, 8, struct.pack("<Q", 0)), "directory length 0 does not fit"),
    "invalid UTF-8 in the directory": (_patch(lambda e: e, 33, b"\xff"), "can't decode byte 0xff"),
    "invalid JSON": (_patch(lambda e: e, 32, b"["), "is not valid UTF-8 JSON (Expecting"),
    "deeply nested JSON": (_deeply_nested_directory, "maximum recursion depth"),
    # the directory schema
    "root not an object": (_replace_directory(b"[]"), "the directory root must be a JSON object"),
    "unknown root member": (_in_directory(lambda root: root.update(weights={})),
                            "the directory root has unknown member(s) weights"),
    "missing root member": (_in_directory(_drop("provenance")), "the directory root lacks member(s) provenance"),
    "missing text component": (_in_directory(lambda root: root["components"].pop("text")),
                               "with a 'text' component"),
    "unknown component member": (_in_directory(lambda root: root["components"]["vision"].update(weights=1)),
                                 "component 'vision' has unknown member(s) weights"),
    "unknown object member": (_in_directory(_object("text/a", "dtype", lambda o, r: "bf16")),
                              "object 'text/a' has unknown member(s) dtype"),
    "missing object member": (_in_directory(lambda root: objects_by_id(root)["text/a"].pop("layout")),
                              "object 'text/a' lacks member(s) layout"),
    "unknown object kind": (_in_directory(_object("text/a", "kind", lambda o, r: "weights")),
                            "kind must be 'tensor' or 'resource', not 'weights'"),
    "overlapping objects": (_in_directory(_overlap), "overlaps or precedes the previous object"),
    "misaligned tensor offset": (_in_directory(_object("text/wide", "offset", lambda o, r: o["offset"] + 64)),
                                 "is not 256-byte aligned"),
    "wrong byte count": (_in_directory(_object("text/a", "bytes", lambda o, r: o["bytes"] + 2)),
                         "bytes is 2050 but bf16 [16, 64] encodes to 2048"),
    "object beyond the payload": (_in_directory(_object("vision/p", "offset",
                                                        lambda o, r: align_up(payload_total(r), TENSOR_ALIGN))),
                                  "beyond the payload's"),
    "negative offset": (_in_directory(_object("text/a", "offset", lambda o, r: -256)),
                        "offset must be a non-negative integer"),
    "unknown format": (_in_directory(_object("text/q8", "format", lambda o, r: "q3_g64_fp16")),
                       "unknown numeric format 'q3_g64_fp16'"),
    "wrong layout": (_in_directory(_object("text/q8", "layout", lambda o, r: "contiguous_le_v1")),
                     "is stored in layout 'row_split_k128_v1', not 'contiguous_le_v1'"),
    "shape the layout cannot hold": (_in_directory(_object("text/q8", "shape", lambda o, r: [40 * 128])),
                                     "stores [N, K] matrices, not [5120]"),
    "tensor of an unlisted component": (_in_directory(_rename("vision/p", "mtp/p")),
                                        "its component 'mtp' is not in components"),
    "resource outside frontend/": (_in_directory(_rename("frontend/blob.bin", "text/blob.bin")),
                                   "resource ids start with 'frontend/'"),
    "resource role naming a tensor": (_in_directory(_role("text/a")),
                                      "'tokenizer.json' names 'text/a', which is not a resource object"),
    "resource role that is not a string": (_in_directory(_role(["frontend/tokenizer.json"])),
                                           "names ['frontend/tokenizer.json'], which is not a resource object"),
    "duplicate ids": (_in_directory(_duplicate_id), "'text/a': id appears twice"),
    "part path outside the folder": (_in_directory(_files(1, "path", lambda p: "../" + p)),
                                     "files[1]: path is '../model.ninfer.part-0001'"),
    "non-final payload not page-sized": (_in_directory(_files(0, "payload_bytes", lambda n: n - 256)),
                                         "of a non-final file is not a multiple of 4096"),
    # parts and file sizes
    "part with another artifact id": (_patch(lambda e: part(e, 1), 16, bytes(16 * [0xAB])),
                                      "belongs to artifact abababab-"),
    "part with the wrong index": (_patch(lambda e: part(e, 2), 8, struct.pack("<Q", 1)),
                                  "header says part 1, expected part 2"),
    "part with entry magic": (_patch(lambda e: part(e, 1), 0, ENTRY_MAGIC), "bad part magic"),
    "part with a truncated header": (_truncate_to(lambda n: 10, lambda e: part(e, 1)), "truncated part header"),
    "missing part": (_missing_part, "continuation part 2 of model.ninfer is missing"),
    "truncated last part": (_truncate_to(lambda n: n - 1, last_part), "(truncated)"),
    "longer part": (_append(lambda e: part(e, 1)), "(longer than its directory says)"),
    "entry longer than its directory says": (_append(lambda e: e), "(longer than its directory says)"),
    "entry shorter than its directory says": (_truncate_to(lambda n: n - PAGE, lambda e: e), "(truncated)"),
    # paths that are not artifacts at all
    "no such file": (_open_instead(lambda e: e.with_name("absent.ninfer")), "no such file"),
    "a directory": (_open_instead(lambda e: e.parent), "is a directory"),
}


def rejection_message(folder: Path, case: Case) -> tuple[str, Path]:
    entry = write_spanning(folder)[0]
    opened, named = case(entry)
    with pytest.raises(ArtifactError) as caught:
        open_artifact(opened)
    return str(caught.value), named


def test_edit_directory_without_a_change_keeps_the_artifact_sound(tmp_path: Path) -> None:
    entry = write_spanning(tmp_path)[0]
    edit_directory(entry, lambda root: None)
    _, json_len, _, _, start = read_entry(entry)
    assert json_len == start - 32
    with open_artifact(entry) as artifact:
        for object_id, (tensor, fmt) in spanning_tensors().items():
            assert torch.equal(artifact.tensor(object_id), expected_decode(tensor, fmt))


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_file_is_rejected_naming_file_and_rule(tmp_path: Path, name: str) -> None:
    case, rule = MALFORMED[name]
    message, named = rejection_message(tmp_path, case)
    assert message.startswith(f"{named}: "), message
    assert rule in message, message
    assert "\n" not in message


def test_malformed_files_give_distinct_messages(tmp_path: Path) -> None:
    messages = {}
    for index, (name, (case, _)) in enumerate(MALFORMED.items()):
        folder = tmp_path / f"case{index}"
        message, _ = rejection_message(folder, case)
        messages[name] = message.replace(f"{folder}/", "")
    by_message: dict[str, list[str]] = {}
    for name, message in messages.items():
        by_message.setdefault(message, []).append(name)
    assert [names for names in by_message.values() if len(names) > 1] == []


# -- access by id -------------------------------------------------------------------------------------------------


def test_access_by_the_wrong_kind_or_an_unknown_id_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "mixed.ninfer"
    write_artifact(path, mixed_tensors(), RESOURCES, COMPONENTS)
    with open_artifact(path) as artifact:
        with pytest.raises(ArtifactError, match=r"'frontend/tokenizer\.json' is a resource, not a tensor"):
            artifact.tensor("frontend/tokenizer.json")
        with pytest.raises(ArtifactError, match="'text/q4' is a tensor, not a resource"):
            artifact.resource("text/q4")
        for access in (artifact.tensor, artifact.resource, artifact.raw):
            with pytest.raises(ArtifactError, match="no object 'text/missing'"):
                access("text/missing")
