"""`ninfer inspect` and `ninfer verify` on small artifacts built here: what they print, and their exit codes."""

from __future__ import annotations

import hashlib
import json
import re
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from ninfer.artifact import write_artifact
from ninfer.artifact.checksums import update_sums
from ninfer.cli import main
from tests.artifact.test_read_write import edit_directory

NO_DIGESTS = "the directory records no object digests (another writer's artifact): object digests not checked"

HEADER = struct.Struct("<8sQ16s")
PAGE = 4096
ARTIFACT_ID = bytes(range(100, 116))
BPW_TOLERANCE = 1e-4  # the JSON rounds bits per weight to 4 decimals

COMPONENTS = {
    "text": {"config": {"architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 128, "vocab_size": 8},
             "resources": {"tokenizer.json": "frontend/tokenizer.json"}},
    "vision": {"config": {"depth": 1}, "resources": {}},
}
TOKENIZER = json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}).encode()
# bits per weight of these shapes, from the format definitions (K = 128: no padding groups)
EXPECTED = {
    "text/embed": ("bf16", [8, 128], 2048, 16.0),
    "text/q4": ("q4_g64_fp16", [8, 128], 8 * 2 * 32 + 8 * 2 * 2, 4.25),
    "text/q8": ("q8_g32_fp16", [8, 128], 8 * 4 * 32 + 8 * 4 * 2, 8.5),
    "text/norm": ("fp32", [128], 512, 32.0),
    "vision/patch": ("fp16", [4, 128], 1024, 16.0),
}


def tensors(seed: int = 0) -> dict[str, tuple[torch.Tensor, str]]:
    g = torch.Generator().manual_seed(seed)
    return {object_id: (torch.randn(shape, generator=g).to(torch.bfloat16 if fmt == "bf16" else torch.float32), fmt)
            for object_id, (fmt, shape, _, _) in EXPECTED.items()}


def build(folder: Path, part_cap: int | None = None, components: dict | None = None) -> list[Path]:
    folder.mkdir(exist_ok=True)
    extra = {} if part_cap is None else {"part_cap": part_cap}
    return write_artifact(folder / "model.ninfer", tensors(), {"frontend/tokenizer.json": TOKENIZER},
                          components or COMPONENTS, metadata={"name": "tiny"}, provenance={"by": "test"},
                          artifact_id=ARTIFACT_ID, **extra)


def write_sums(paths: list[Path]) -> None:
    update_sums(paths[0].parent, {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths})


def directory_of(entry: Path) -> tuple[dict, int]:
    """The JSON directory and the payload start, read from the entry file's bytes."""
    data = entry.read_bytes()
    _, json_len, _ = HEADER.unpack_from(data)
    return json.loads(data[32 : 32 + json_len]), (32 + json_len + PAGE - 1) // PAGE * PAGE


def object_position(entry: Path, object_id: str) -> int:
    """Where a single-file artifact stores the first byte of an object."""
    root, start = directory_of(entry)
    return start + next(o["offset"] for o in root["objects"] if o["id"] == object_id)


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def xor_byte(path: Path, offset: int, mask: int) -> None:
    patch(path, offset, bytes([path.read_bytes()[offset] ^ mask]))


def strip_digests(root: dict) -> None:
    """Make the directory what a writer without ninfer's digest extension writes."""
    for obj in root["objects"]:
        del obj["sha256"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- inspect -----------------------------------------------------------------------------------------------------


def _section(text: str, title: str) -> list[str]:
    lines = text.splitlines()
    begin = lines.index(title) + 1
    end = next((i for i in range(begin, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return lines[begin:end]


def test_inspect_lists_components_objects_and_totals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entry = build(tmp_path)[0]
    code, out, err = run_cli(capsys, "inspect", str(entry))
    assert (code, err) == (0, "")
    assert str(uuid.UUID(bytes=ARTIFACT_ID)) in out.splitlines()[0]
    components = _section(out, "components:")
    assert any(line.startswith("  text: architectures=Qwen3_5ForCausalLM") for line in components)
    assert "    resources: tokenizer.json" in components
    assert any(line.startswith("  vision: depth=1") for line in components)
    objects = _section(out, "objects:")
    listed = {line.split()[0] for line in objects}
    assert listed == {*EXPECTED, "frontend/tokenizer.json"}
    for line in objects:
        if line.split()[0] in EXPECTED:
            fmt, shape, size, _ = EXPECTED[line.split()[0]]
            assert line.split()[1:] == [fmt, "x".join(map(str, shape)), f"{size:,d}"]

    totals = re.compile(r"^  (\S+)\s+(\d+) objects\s+([\d,]+) weights .* (\S+) bits/weight$")
    by_format = {m[1]: m.groups()[1:] for m in map(totals.match, _section(out, "totals by format:"))}
    assert by_format == {"bf16": ("1", "1,024", "16.0"), "q4_g64_fp16": ("1", "1,024", "4.25"),
                         "q8_g32_fp16": ("1", "1,024", "8.5"), "fp32": ("1", "128", "32.0"),
                         "fp16": ("1", "512", "16.0")}
    by_component = {m[1]: m.groups()[1:3] for m in map(totals.match, _section(out, "totals by component:"))}
    assert by_component == {"text": ("4", "3,200"), "vision": ("1", "512")}


def test_inspect_json_totals_are_consistent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = build(tmp_path, part_cap=2 * PAGE)  # several parts: totals do not depend on the split
    assert len(paths) >= 2
    code, out, err = run_cli(capsys, "inspect", str(paths[0]), "--json")
    assert (code, err) == (0, "")
    summary = json.loads(out)
    assert summary["artifact_id"] == str(uuid.UUID(bytes=ARTIFACT_ID))
    assert [f["name"] for f in summary["files"]] == [p.name for p in paths]
    assert summary["components"] == COMPONENTS
    assert summary["metadata"] == {"name": "tiny"} and summary["provenance"] == {"by": "test"}

    tensors_ = [o for o in summary["objects"] if o["kind"] == "tensor"]
    assert {o["id"]: (o["format"], o["shape"], o["bytes"]) for o in tensors_} == \
        {object_id: spec[:3] for object_id, spec in EXPECTED.items()}
    groups = (("totals_by_format", lambda o: o["format"]), ("totals_by_component", lambda o: o["id"].split("/")[0]))
    for key, group in groups:
        expected: dict[str, dict[str, int]] = {}
        for obj in tensors_:
            entry = expected.setdefault(group(obj), {"objects": 0, "parameters": 0, "bytes": 0})
            entry["objects"] += 1
            entry["parameters"] += int(torch.tensor(obj["shape"]).prod())
            entry["bytes"] += obj["bytes"]
        totals = summary[key]
        assert {name: {k: t[k] for k in ("objects", "parameters", "bytes")} for name, t in totals.items()} == expected
        for name, t in totals.items():
            assert t["bits_per_weight"] == pytest.approx(8 * t["bytes"] / t["parameters"], abs=BPW_TOLERANCE), name
    for fmt, _, _, bpw in EXPECTED.values():
        assert summary["totals_by_format"][fmt]["bits_per_weight"] == pytest.approx(bpw, abs=BPW_TOLERANCE)
    assert summary["tensor_bytes"] == sum(o["bytes"] for o in tensors_)
    assert summary["parameters"] == sum(t["parameters"] for t in summary["totals_by_format"].values())
    assert summary["resource_bytes"] == len(TOKENIZER)


def test_inspect_shows_an_unusual_but_valid_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # component configs are open JSON; inspect must show what it cannot interpret, not crash on it
    odd = {"text": {"config": {"architectures": [], "layer_types": 3}, "resources": {}},
           "vision": {"config": {}, "resources": {}}}
    entry = build(tmp_path, components=odd)[0]
    code, out, err = run_cli(capsys, "inspect", str(entry))
    assert (code, err) == (0, "")
    assert "  text: architectures=[]" in out.splitlines()


def test_inspect_rejects_a_file_that_is_not_an_artifact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("these are notes, not a .ninfer artifact at all\n")
    code, out, err = run_cli(capsys, "inspect", str(path))
    assert code == 1 and out == ""
    assert err.splitlines() == [f"ninfer inspect: error: {path}: bad magic b'these ar'; not a .ninfer file"]


# -- verify ------------------------------------------------------------------------------------------------------


def test_verify_passes_a_sound_artifact_with_checksums(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = build(tmp_path, part_cap=2 * PAGE)
    write_sums(paths)
    code, out, err = run_cli(capsys, "verify", str(paths[0]), "--quiet")
    assert (code, err) == (0, "")
    assert out == f"{paths[0]}: OK (6 objects)\n"


def test_verify_without_checksums_passes_with_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entry = build(tmp_path)[0]
    code, out, err = run_cli(capsys, "verify", str(entry), "--quiet")
    assert code == 0 and out == f"{entry}: OK (6 objects)\n"
    assert err == "note: no SHA256SUMS beside the artifact: checksums not checked\n"


def test_verify_catches_one_flipped_payload_byte(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entry = build(tmp_path)[0]
    write_sums([entry])
    # the low byte of a bf16 element holds mantissa bits only: the value stays finite, the structure valid
    xor_byte(entry, object_position(entry, "text/embed") + 2 * 37, 0x01)
    code, out, err = run_cli(capsys, "verify", str(entry), "--quiet")
    assert code == 1 and out == ""
    checksum, digest = err.splitlines()
    assert checksum.startswith(f"{entry}: SHA-256 ") and "differs from SHA256SUMS" in checksum
    assert digest.startswith(f"{entry}: object 'text/embed': SHA-256 ") and "differs from its directory entry" in digest
    assert all(line.count(entry.name) == 1 for line in (checksum, digest))  # the path is named once
    # without SHA256SUMS the object's own digest still catches it
    (tmp_path / "SHA256SUMS").unlink()
    code, out, err = run_cli(capsys, "verify", str(entry), "--quiet")
    assert code == 1 and err.splitlines()[1:] == [digest]


def test_verify_names_the_damaged_part(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = build(tmp_path, part_cap=2 * PAGE)
    write_sums(paths)
    root, _ = directory_of(paths[0])
    logical = next(o["offset"] for o in root["objects"] if o["id"] == "vision/patch")
    first_in_part = root["files"][0]["payload_bytes"]
    assert len(paths) == 2 and logical >= first_in_part  # the fp16 tensor lies in the last part
    xor_byte(paths[-1], PAGE + logical - first_in_part, 0x01)  # a mantissa bit of an fp16 value
    code, out, err = run_cli(capsys, "verify", str(paths[0]), "--quiet")
    assert code == 1 and out == ""
    checksum, digest = err.splitlines()
    assert checksum.startswith(f"{paths[0]}: part {paths[-1].name}: SHA-256 ")
    assert digest.startswith(f"{paths[0]}: object 'vision/patch': SHA-256 ")


def test_verify_fails_when_checksums_skip_a_part(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = build(tmp_path, part_cap=2 * PAGE)
    write_sums(paths[:1])
    code, _, err = run_cli(capsys, "verify", str(paths[0]), "--quiet")
    assert code == 1
    assert f"SHA256SUMS lists part of the artifact but not {', '.join(p.name for p in paths[1:])}" in err


def _invalid_json_byte(entry: Path) -> None:
    patch(entry, 32, b"#")  # the directory's opening brace


def _misaligned_offset(entry: Path) -> None:
    data = bytearray(entry.read_bytes())
    root, start = directory_of(entry)
    next(o for o in root["objects"] if o["id"] == "text/q8")["offset"] += 16
    text = json.dumps(root).encode().ljust(start - 32, b" ")
    data[8:16] = struct.pack("<Q", len(text))
    data[32:start] = text
    entry.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "reason"), [
    (_invalid_json_byte, "the directory is not valid UTF-8 JSON (Expecting value"),
    (_misaligned_offset, "object 'text/q8': offset"),
])
def test_verify_rejects_a_damaged_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str], damage,
                                            reason: str) -> None:
    entry = build(tmp_path)[0]
    write_sums([entry])
    damage(entry)
    code, out, err = run_cli(capsys, "verify", str(entry), "--quiet")
    assert code == 1 and out == ""
    assert len(err.splitlines()) == 1
    assert err.startswith(f"ninfer verify: error: {entry}: ")
    assert reason in err


def _q8_code_minus_128(entry: Path) -> None:
    patch(entry, object_position(entry, "text/q8") + 5, b"\x80")  # a code in the base plane


def _bf16_nan(entry: Path) -> None:
    patch(entry, object_position(entry, "text/embed") + 2 * 11, struct.pack("<H", 0x7FC0))


@pytest.mark.parametrize(("damage", "reason"), [
    (_q8_code_minus_128, "object 'text/q8': q8_g32_fp16: code -128 is illegal"),
    (_bf16_nan, "object 'text/embed': decodes to NaN or Inf"),
])
def test_verify_rejects_an_illegal_stored_value(tmp_path: Path, capsys: pytest.CaptureFixture[str], damage,
                                                reason: str) -> None:
    entry = build(tmp_path)[0]
    edit_directory(entry, strip_digests)  # another writer's artifact: only the decode checks can catch it
    assert main(["verify", str(entry), "--quiet"]) == 0
    capsys.readouterr()
    damage(entry)
    code, out, err = run_cli(capsys, "verify", str(entry), "--quiet")
    assert code == 1 and out == ""
    assert err.splitlines() == ["note: no SHA256SUMS beside the artifact: checksums not checked",
                                f"note: {NO_DIGESTS}", f"{entry}: {reason}"]


# -- real processes ----------------------------------------------------------------------------------------------


def _ninfer(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ninfer", *argv], capture_output=True, text=True, timeout=120,
                          check=False)


def test_exit_codes_of_real_processes(tmp_path: Path) -> None:
    not_artifact = tmp_path / "weights.bin"
    not_artifact.write_bytes(bytes(range(64)))
    bad = _ninfer("inspect", str(not_artifact))
    assert bad.returncode == 1 and bad.stdout == ""
    assert len(bad.stderr.splitlines()) == 1 and "bad magic" in bad.stderr and "Traceback" not in bad.stderr

    entry = build(tmp_path / "art")[0]
    write_sums([entry])
    good = _ninfer("verify", str(entry), "--quiet")
    assert (good.returncode, good.stdout, good.stderr) == (0, f"{entry}: OK (6 objects)\n", "")
    xor_byte(entry, object_position(entry, "text/embed"), 0x01)
    flipped = _ninfer("verify", str(entry), "--quiet")
    assert flipped.returncode == 1 and "SHA-256" in flipped.stderr and "Traceback" not in flipped.stderr
