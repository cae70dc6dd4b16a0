"""`ninfer draft-head` on the embedded demo model: a sound copy with every object unchanged, draft rows that are the
head's rows of the chosen ids, the id choice itself, and one-line refusals of bad input."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ninfer
from ninfer.artifact import open_artifact
from ninfer.artifact.checksums import read_sums
from ninfer.cli import main
from ninfer.convert import draft_head
from ninfer.convert.draft_head import (
    DRAFT_HEAD,
    DRAFT_HEAD_IDS,
    add_draft_head,
    always_kept,
    draft_token_ids,
    token_counts,
)
from ninfer.errors import ConversionError
from ninfer.eval.perplexity import read_text
from ninfer.frontend import Tokenizer
from ninfer.quant import codec_for

DEMO = Path(ninfer.__file__).resolve().parent / "assets" / "demo.ninfer"
DEMO_VOCAB = 4096
ROWS = 300
CALIBRATION = "the cat sat on the mat, and the dog sat on the log.\n" * 30 + "A fox ran past the barn twice.\n"
STORED = {"q4": "q4_g64_fp16", "q8": "q8_g32_fp16", "bf16": "bf16", "head": "q8_g32_fp16"}  # the demo's head is q8

Build = Callable[[str], tuple[Path, dict[str, Any]]]


@pytest.fixture(scope="module")
def calibration(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("calibration") / "calibration.txt"
    path.write_text(CALIBRATION, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def drafted(tmp_path_factory: pytest.TempPathFactory, calibration: Path) -> Build:
    """The demo model with a ROWS-row draft head in a format, written once per format."""
    folder = tmp_path_factory.mktemp("drafted")
    built: dict[str, tuple[Path, dict[str, Any]]] = {}

    def build(fmt: str) -> tuple[Path, dict[str, Any]]:
        if fmt not in built:
            out = folder / f"demo-{fmt}.ninfer"
            built[fmt] = out, add_draft_head(DEMO, calibration, ROWS, out, fmt=fmt, quiet=True)
        return built[fmt]

    return build


def test_cli_writes_a_sound_copy_with_every_object_unchanged(tmp_path: Path, calibration: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "models" / "demo-draft.ninfer"
    assert main(["draft-head", str(DEMO), "--calibration", str(calibration), "--rows", str(ROWS),
                 "--out", str(out), "--quiet"]) == 0
    assert f"draft head {ROWS} rows q4_g64_fp16" in capsys.readouterr().out
    assert main(["verify", str(out), "--quiet"]) == 0
    assert read_sums(out.parent) == {out.name: hashlib.sha256(out.read_bytes()).hexdigest()}
    with open_artifact(DEMO) as source, open_artifact(out) as copy:
        added = [o.id for o in copy.objects if o.id not in {s.id for s in source.objects}]
        assert added == [DRAFT_HEAD, DRAFT_HEAD_IDS] and len(copy.objects) == len(source.objects) + 2
        for obj in source.objects:
            entry = copy.object(obj.id)
            assert (entry.kind, entry.shape, entry.format, entry.sha256) == (obj.kind, obj.shape, obj.format,
                                                                             obj.sha256)
            assert torch.equal(copy.raw(obj.id), source.raw(obj.id)), obj.id
        assert copy.directory.components == source.directory.components
        assert copy.directory.metadata == source.directory.metadata
        provenance = dict(copy.directory.provenance)
        record = provenance.pop("draft_head")
        assert provenance == source.directory.provenance
        assert (record["rows"], record["format"]) == (ROWS, "q4_g64_fp16")
        assert record["calibration"]["name"] == calibration.name
        assert record["calibration"]["sha256"] == hashlib.sha256(calibration.read_bytes()).hexdigest()
        assert copy.object(DRAFT_HEAD).shape == (ROWS, 256)
        assert (copy.object(DRAFT_HEAD_IDS).shape, copy.object(DRAFT_HEAD_IDS).format) == ((ROWS,), "i32")


@pytest.mark.parametrize("fmt", list(STORED))
def test_draft_rows_are_the_head_rows_of_their_ids(drafted: Build, fmt: str) -> None:
    out, report = drafted(fmt)
    with open_artifact(DEMO) as source, open_artifact(out) as copy:
        assert copy.object(DRAFT_HEAD).format == report["format"] == STORED[fmt]
        ids = copy.tensor(DRAFT_HEAD_IDS).long()
        expected = source.tensor("text/output_head").float()[ids]
        draft = copy.tensor(DRAFT_HEAD).float()
        if fmt == "head":  # the head's own format: its rows, bit for bit
            assert torch.equal(draft, expected)
            return
        codec = codec_for(STORED[fmt])
        assert torch.equal(copy.raw(DRAFT_HEAD), codec.encode(expected))  # re-quantized from the decoded rows
        if fmt == "bf16":
            assert torch.equal(draft, expected.to(torch.bfloat16).float())
        assert bool(((draft - expected).abs() <= codec.error_bound(expected)).all())


def test_ids_are_unique_in_range_tags_first_then_by_frequency(drafted: Build) -> None:
    out, report = drafted("q4")
    with open_artifact(out) as copy:
        ids = copy.tensor(DRAFT_HEAD_IDS).tolist()
        tokenizer = Tokenizer.from_artifact(copy)
    text_ids = tokenizer.encode(CALIBRATION, special=False)
    counts = torch.bincount(torch.tensor(text_ids), minlength=DEMO_VOCAB)
    always = always_kept(tokenizer)
    assert len(ids) == len(set(ids)) == ROWS and all(0 <= i < tokenizer.vocab_size for i in ids)
    assert set(tokenizer.eos_ids) <= set(always) and tokenizer.im_end_id in always
    assert ids[: len(always)] == always
    seen = sorted((i for i in range(DEMO_VOCAB) if counts[i] > 0 and i not in always), key=lambda i: (-counts[i], i))
    assert ids[len(always) : len(always) + len(seen)] == seen  # the most frequent calibration token leads
    unused = [i for i in range(DEMO_VOCAB) if i not in always and counts[i] == 0]
    assert ids[len(always) + len(seen) :] == unused[: ROWS - len(always) - len(seen)]
    assert report["coverage"] == 1.0 and report["calibration"]["tokens"] == len(text_ids)


def test_a_draft_head_replaces_the_one_the_source_had(drafted: Build, calibration: Path, tmp_path: Path) -> None:
    first, _ = drafted("q4")
    out = tmp_path / "again.ninfer"
    add_draft_head(first, calibration, 50, out, fmt="bf16", quiet=True)
    with open_artifact(first) as before, open_artifact(out) as after:
        assert [o.id for o in after.objects] == [o.id for o in before.objects]
        assert (after.object(DRAFT_HEAD).shape, after.object(DRAFT_HEAD).format) == ((50, 256), "bf16")
        assert after.tensor(DRAFT_HEAD_IDS).tolist() == before.tensor(DRAFT_HEAD_IDS).tolist()[:50]
        assert after.directory.provenance["draft_head"]["rows"] == 50


def test_counting_a_text_piece_by_piece_equals_encoding_it_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    text = read_text(Path(__file__).resolve().parents[2] / "data" / "corpus" / "test.txt.xz")
    with open_artifact(DEMO) as artifact:
        tokenizer = Tokenizer.from_artifact(artifact)
    whole = torch.bincount(torch.tensor(tokenizer.encode(text, special=False)), minlength=DEMO_VOCAB)
    monkeypatch.setattr(draft_head, "TEXT_PIECE", 500)  # hundreds of cuts
    assert torch.equal(token_counts(tokenizer, text), whole)


# -- choosing the ids -------------------------------------------------------------------------------------------


def test_ties_go_to_the_lower_id() -> None:
    assert draft_token_ids([3, 5, 5, 0, 3], 5, [], 5) == [1, 2, 0, 4, 3]


def test_always_kept_ids_come_first_once() -> None:
    assert draft_token_ids([9, 0, 1, 0], 4, [3, 3, 1], 4) == [3, 1, 0, 2]
    assert draft_token_ids([9, 0, 1, 0], 2, [3, 1], 4) == [3, 1]  # even above more frequent ids


def test_unseen_ids_fill_lowest_first() -> None:
    assert draft_token_ids([0, 0, 7, 0, 0, 0], 4, [5], 6) == [5, 2, 0, 1]


@pytest.mark.parametrize(("rows", "always", "message"), [
    (0, [], "rows 0 out of range: give 1 to 4"),
    (5, [], "rows 5 out of range: give 1 to 4"),
    (3, [4], r"token ids \[4\] .* outside the vocabulary of 4 ids"),
    (1, [0, 2], "cannot hold the 2 ids every draft head keeps"),
])
def test_impossible_choices_are_refused(rows: int, always: list[int], message: str) -> None:
    with pytest.raises(ConversionError, match=message):
        draft_token_ids([1, 1, 1, 1], rows, always, 4)


# -- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("flags", "message"), [
    (["--rows", "0"], "argument --rows: '0' must be positive"),
    (["--rows", str(DEMO_VOCAB + 1)], f"draft head rows {DEMO_VOCAB + 1} out of range: give 1 to {DEMO_VOCAB}"),
    (["--rows", "10", "--calibration", "missing.txt"], "argument --calibration: missing.txt: no such file"),
    (["--rows", "10", "--format", "q6"], "argument --format: invalid choice: 'q6'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, calibration: Path, capsys: pytest.CaptureFixture[str],
                                          flags: list[str], message: str) -> None:
    out = tmp_path / "out.ninfer"
    argv = ["draft-head", str(DEMO), "--calibration", str(calibration), "--out", str(out), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ninfer draft-head: error: ") and message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_an_existing_output_is_kept_without_force(tmp_path: Path, calibration: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.ninfer"
    out.write_bytes(b"keep me")
    argv = ["draft-head", str(DEMO), "--calibration", str(calibration), "--rows", "10", "--out", str(out), "--quiet"]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"ninfer draft-head: error: {out} exists; pass --force to replace it\n"
    assert out.read_bytes() == b"keep me"
    assert main([*argv, "--force"]) == 0
    with open_artifact(out) as copy:
        assert copy.object(DRAFT_HEAD).shape == (10, 256)
