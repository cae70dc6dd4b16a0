"""Per-object SHA-256 digests (ninfer's directory extension): the writer records them however bytes arrive, and a
damaged object fails `ninfer verify`, the load check (`--verify-weights`, `verify_weights=True`) and, always, the
embedded model's load; artifacts without digests (another writer's) still open, verify and load."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

import ninfer.engine.llm as llm_module
from ninfer.artifact import ArtifactWriter, DigestError, ResourceSpec, TensorSpec, open_artifact, plan_objects
from ninfer.artifact.checksums import SUMS_NAME
from ninfer.config import ConfigError, EngineConfig
from ninfer.convert import converter
from ninfer.convert.synth import synth_artifact
from ninfer.engine.llm import DEFAULT_ARTIFACT, LLM
from ninfer.errors import ArtifactError, NinferError
from tests.artifact.test_cli import NO_DIGESTS, build, run_cli, strip_digests
from tests.artifact.test_read_write import COMPONENTS, PART_CAP, align_up, edit_directory, read_entry

MOE_ARTIFACT = Path(__file__).resolve().parents[2] / "data" / "models" / "small-moe-q8.ninfer"
DAMAGED = "text/layers/4/mlp/gate_up"
NO_SUMS = "note: no SHA256SUMS beside the artifact: checksums not checked"


def stored_digests(entry: Path) -> dict[str, str]:
    """id -> SHA-256 of the object's bytes, read straight from the files (entry and parts) without the reader."""
    _, _, _, root, start = read_entry(entry)
    payload = entry.read_bytes()[start:]
    for index in range(1, len(root["files"])):
        payload += entry.with_name(f"{entry.name}.part-{index:04d}").read_bytes()[PART_CAP // 3:]
    return {o["id"]: hashlib.sha256(payload[o["offset"] : o["offset"] + o["bytes"]]).hexdigest()
            for o in root["objects"]}


def recorded_digests(entry: Path) -> dict[str, str]:
    return {o["id"]: o["sha256"] for o in read_entry(entry)[3]["objects"]}


# -- the writer --------------------------------------------------------------------------------------------------


def test_writer_hashes_writes_in_any_order_across_parts(tmp_path: Path) -> None:
    """Chunks in order, ahead of the hashed prefix, rewritten after hashing, never written at all, objects
    interleaved, and objects spanning parts: every recorded digest is that of the bytes stored."""
    g = torch.Generator().manual_seed(0)
    specs = [ResourceSpec("frontend/tokenizer.json", 300), TensorSpec("text/wide", (96, 128), "bf16"),
             TensorSpec("text/q8", (40, 128), "q8_g32_fp16"), TensorSpec("text/zeros", (8, 64), "bf16"),
             TensorSpec("text/last", (33,), "fp32")]
    objects = plan_objects(specs)
    data = {o.id: torch.randint(0, 256, (o.bytes,), dtype=torch.uint8, generator=g).numpy() for o in objects}
    with ArtifactWriter(tmp_path / "model.ninfer", objects, {"text": COMPONENTS["text"] | {"resources": {}}}, {}, {},
                        part_cap=PART_CAP) as writer:
        wide, q8, last = data["text/wide"], data["text/q8"], data["text/last"]
        writer.write("text/wide", wide[:5000])
        writer.write("text/wide", wide[9000:], 9000)  # ahead of the hashed prefix: read back later
        writer.write("text/wide", wide[5000:9000], 5000)
        writer.write("text/q8", q8[1000:], 1000)
        writer.write("frontend/tokenizer.json", data["frontend/tokenizer.json"])  # another object in between
        writer.write("text/q8", q8[:1000])
        writer.write("text/last", last)
        writer.write("text/last", last[:16][::-1].copy())  # rewrites bytes already hashed
    entry = writer.final_paths[0]
    assert len(writer.final_paths) > 2
    expected = stored_digests(entry)
    assert recorded_digests(entry) == expected
    assert expected["text/zeros"] == hashlib.sha256(bytes(objects[3].bytes)).hexdigest()  # never written: zeros
    assert expected["text/wide"] == hashlib.sha256(data["text/wide"].tobytes()).hexdigest()
    with open_artifact(entry) as artifact:
        assert [o.sha256 for o in artifact.objects] == list(expected.values())
        assert artifact.verify_digests() == len(objects)


def test_converter_writes_digests_of_interleaved_planes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The converter writes a row-split object's planes chunk by chunk, interleaved; small chunks and small parts
    make every object take that path."""
    monkeypatch.setattr(converter, "CHUNK_ELEMENTS", 64 * 8)
    entry = tmp_path / "tiny.ninfer"
    synth_artifact("tiny-dense", "q4", entry, quiet=True, part_cap=64 * 1024)
    assert entry.with_name(entry.name + ".part-0001").is_file()
    assert recorded_digests(entry) == stored_digests(entry)
    report = json.loads(entry.with_name(entry.name + ".conversion.json").read_text())
    assert report["files"][0]["sha256"] == hashlib.sha256(entry.read_bytes()).hexdigest()  # the final bytes


# -- the directory -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["AB" * 32, "ab" * 31, 12, None])
def test_a_malformed_digest_is_refused_at_open(tmp_path: Path, value: object) -> None:
    entry = build(tmp_path)[0]

    def mutate(root: dict) -> None:
        root["objects"][1]["sha256"] = value

    edit_directory(entry, mutate)
    with pytest.raises(ArtifactError, match=r"object 'text/embed': sha256 must be 64 lowercase hex digits"):
        open_artifact(entry)


def test_an_artifact_without_digests_opens_verifies_and_loads(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "demo.ninfer"
    shutil.copyfile(DEFAULT_ARTIFACT, copy)
    edit_directory(copy, strip_digests)  # what an upstream writer makes
    with open_artifact(copy) as artifact:
        assert all(o.sha256 is None for o in artifact.objects)
        assert artifact.verify_digests() == 0
    code, out, err = run_cli(capsys, "verify", str(copy), "--quiet")
    assert (code, out) == (0, f"{copy}: OK (110 objects)\n")
    assert err.splitlines() == [NO_SUMS, f"note: {NO_DIGESTS}"]
    llm = LLM(copy)
    assert llm.generate([5, 6, 7], llm.default_params(max_tokens=2, temperature=0.0)).token_ids
    with pytest.raises(NinferError, match="records no object digests"):  # asked to verify, it cannot
        LLM(copy, verify_weights=True)


# -- a damaged copy of the embedded model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the embedded model with three bytes flipped inside `DAMAGED`, located by the reader's offsets."""
    copy = tmp_path_factory.mktemp("damaged") / "demo.ninfer"
    shutil.copyfile(DEFAULT_ARTIFACT, copy)
    with open_artifact(copy) as artifact:
        obj = artifact.object(DAMAGED)
    _, json_bytes, _ = struct.unpack_from("<8sQ16s", copy.read_bytes())
    start = align_up(32 + json_bytes, 4096) + obj.offset
    data = bytearray(copy.read_bytes())
    for position in (start + 3, start + obj.bytes // 2, start + obj.bytes - 5):
        data[position] ^= 0x01
    copy.write_bytes(bytes(data))
    return copy


def test_verify_names_the_damaged_object(damaged: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "verify", str(damaged), "--quiet")
    assert code == 1 and out == ""
    note, problem = err.splitlines()
    assert note == NO_SUMS
    assert problem.startswith(f"{damaged}: object '{DAMAGED}': SHA-256 ")
    assert problem.endswith("differs from its directory entry (" + recorded_digests(damaged)[DAMAGED] + "): the "
                            "stored bytes are damaged")
    assert problem.count(damaged.name) == 1


def test_verify_with_the_shipped_checksums_names_the_file_once(damaged: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / damaged.name
    shutil.copyfile(damaged, copy)
    shutil.copyfile(DEFAULT_ARTIFACT.with_name(SUMS_NAME), tmp_path / SUMS_NAME)
    code, out, err = run_cli(capsys, "verify", str(copy), "--quiet")
    assert code == 1 and out == ""
    checksum, digest = err.splitlines()
    assert checksum.startswith(f"{copy}: SHA-256 ") and checksum.endswith("differs from SHA256SUMS "
                                                                           f"({hashlib.sha256(DEFAULT_ARTIFACT.read_bytes()).hexdigest()})")
    assert digest.startswith(f"{copy}: object '{DAMAGED}': SHA-256 ")
    assert checksum.count(copy.name) == 1 and digest.count(copy.name) == 1


def test_run_with_verify_weights_refuses_the_damaged_copy(damaged: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "run", str(damaged), "--verify-weights", "--prompt", "hi", "--max-new", "1")
    assert code == 2 and out == ""
    assert err == (f"ninfer run: error: {damaged}: object '{DAMAGED}': the stored bytes do not match the SHA-256 in "
                   "the directory; the file is damaged (copy or convert it again)\n")


def test_python_api_with_verify_weights_raises(damaged: Path) -> None:
    with pytest.raises(DigestError) as caught:
        LLM(damaged, verify_weights=True)
    assert caught.value.objects == [DAMAGED] and caught.value.path == damaged
    with open_artifact(damaged) as artifact:
        assert artifact.digest_mismatches() == [DAMAGED]
        assert artifact.verify_digests(["text/final_norm", "text/layers/3/mlp/gate_up"]) == 2  # others are sound
        with pytest.raises(DigestError, match=f"object '{DAMAGED}'"):
            artifact.verify_digests([DAMAGED])


def test_verify_weights_is_a_boolean_option() -> None:
    assert EngineConfig.create(verify_weights=True).runtime.verify_weights
    with pytest.raises(ConfigError, match="verify_weights must be True or False"):
        EngineConfig.create(verify_weights="yes")


def test_the_embedded_model_is_always_checked(damaged: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llm_module, "DEFAULT_ARTIFACT", damaged)
    with pytest.raises(DigestError, match=f"object '{DAMAGED}'"):
        LLM()


# -- the shipped artifacts ----------------------------------------------------------------------------------------


def test_shipped_artifacts_record_a_digest_of_every_object() -> None:
    for path in (DEFAULT_ARTIFACT, MOE_ARTIFACT):
        with open_artifact(path) as artifact:
            assert artifact.verify_digests() == len(artifact.objects) > 100, path


def test_verify_of_the_embedded_model_checks_its_shipped_sums_line(capsys: pytest.CaptureFixture[str]) -> None:
    sums = DEFAULT_ARTIFACT.with_name(SUMS_NAME).read_text()
    assert sums == f"{hashlib.sha256(DEFAULT_ARTIFACT.read_bytes()).hexdigest()}  {DEFAULT_ARTIFACT.name}\n"
    code, out, err = run_cli(capsys, "verify", str(DEFAULT_ARTIFACT), "--quiet")
    assert (code, out, err) == (0, f"{DEFAULT_ARTIFACT}: OK (110 objects)\n", "")  # no note: sums and digests checked
