"""`ninfer draft-head`: a copy of an artifact with a restricted proposal head (upstream's `--lm-head-draft`).

The draft head is the output head's rows of the N most frequent tokens of a calibration text, so that a draft
step's head matmul reads N rows instead of the whole vocabulary; verification keeps the full head, so outputs never
change, only acceptance does. Every object of the source is copied byte for byte, a chunk at a time from the mapped
file (whose pages are released once copied), the calibration text is tokenized a piece at a time, and the head's
chosen rows are gathered plane by plane and re-quantized a block of rows at a time. So memory stays bounded by the
head's pages (plus a copy of its planes only when it spans two part files); docs/performance.md gives the peak
memory for a 27B-shaped artifact.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import ninfer
from ninfer.artifact.checksums import hash_files, sha256_file, update_sums
from ninfer.artifact.directory import ObjectEntry
from ninfer.artifact.framing import DEFAULT_PART_CAP
from ninfer.artifact.reader import Artifact
from ninfer.artifact.writer import ArtifactWriter, ResourceSpec, TensorSpec, plan_objects
from ninfer.devices import parse_device
from ninfer.errors import ConversionError
from ninfer.eval.perplexity import read_text
from ninfer.frontend import Tokenizer
from ninfer.quant import codec_for

DRAFT_HEAD = "text/draft_head"
DRAFT_HEAD_IDS = "text/draft_head_token_ids"
DRAFT_FORMATS = {"q4": "q4_g64_fp16", "q8": "q8_g32_fp16", "bf16": "bf16", "head": None}  # None: the head's own
CHAT_TAGS = ("<|im_end|>", "<|im_start|>", "<think>", "</think>", "<tool_call>", "</tool_call>")
COPY_CHUNK = 64 << 20  # bytes per write when copying an object
BLOCK_ELEMENTS = 1 << 24  # values per re-quantized block of draft rows: 64 MiB of fp32
TEXT_PIECE = 1 << 20  # characters per tokenized piece of the calibration text (about 200 MB of tokenizer memory)
PIECE_CUT = re.compile(r"\n(?=\S)")  # a newline before a non-space: Qwen's and GPT-2's pre-tokenizers split there


def always_kept(tokenizer: Tokenizer) -> list[int]:
    """The ids every draft head holds, first and in this order: the EOS ids, then the chat tags the vocabulary has."""
    tags = [tokenizer.token_id(tag) for tag in CHAT_TAGS]
    return list(dict.fromkeys([*tokenizer.eos_ids, *(t for t in tags if t is not None)]))


def token_counts(tokenizer: Tokenizer, text: str) -> torch.Tensor:
    """Occurrences of each id (`tokenizer.vocab_size` entries) in `text` encoded as plain text. The text is encoded
    a piece of about TEXT_PIECE characters at a time, cut only after a newline that a non-space character follows,
    where no pre-token spans the cut: the counts are those of encoding it whole, in bounded memory."""
    counts = torch.zeros(tokenizer.vocab_size, dtype=torch.int64)
    start = 0
    while start < len(text):
        cut = PIECE_CUT.search(text, start + TEXT_PIECE)
        end = cut.end() if cut else len(text)
        ids = torch.tensor(tokenizer.encode(text[start:end], special=False), dtype=torch.int64)
        counts += torch.bincount(ids, minlength=tokenizer.vocab_size)[: tokenizer.vocab_size]
        start = end
    return counts


def check_rows(rows: int, always: Sequence[int], vocab: int) -> None:
    """Raise ConversionError unless a draft head of `rows` rows can hold the `always` ids of a `vocab`-id vocabulary."""
    if not 1 <= rows <= vocab:
        raise ConversionError(f"draft head rows {rows} out of range: give 1 to {vocab} (the vocabulary)")
    bad = [i for i in always if not 0 <= i < vocab]
    if bad:
        raise ConversionError(f"token ids {bad} (EOS or chat tags) are outside the vocabulary of {vocab} ids")
    kept = len(set(always))
    if rows < kept:
        raise ConversionError(f"draft head rows {rows} cannot hold the {kept} ids every draft head keeps (the EOS "
                              f"ids and chat tags); give at least {kept}")


def draft_token_ids(counts: torch.Tensor | Sequence[int], rows: int, always: Sequence[int], vocab: int) -> list[int]:
    """The draft head's token ids: the `always` ids first (in order, duplicates dropped), then the other ids by
    descending count, ties by ascending id, so that ids the text never holds fill the rest lowest first.

    counts: occurrences of each id, `vocab` entries. Raises ConversionError when `rows` is not 1..vocab, an
    `always` id is outside the vocabulary or `rows` cannot hold them all.
    """
    counts = torch.as_tensor(counts, dtype=torch.int64)
    if counts.shape != (vocab,) or (counts < 0).any():
        raise ValueError(f"counts must be {vocab} non-negative integers, got shape {list(counts.shape)}")
    check_rows(rows, always, vocab)
    kept = list(dict.fromkeys(always))
    keys = -counts
    keys[kept] = 1  # after every other id, whose keys are <= 0
    order = torch.sort(keys, stable=True).indices
    return kept + order[: rows - len(kept)].tolist()


def head_object(artifact: Artifact) -> ObjectEntry:
    """The output head: `text/output_head`, or `text/token_embedding` when the model ties them."""
    for object_id in ("text/output_head", "text/token_embedding"):
        if any(o.id == object_id for o in artifact.objects):
            head = artifact.object(object_id)
            if head.kind != "tensor" or len(head.shape) != 2:
                raise ConversionError(f"{artifact.path}: {object_id} is not a [V, H] matrix")
            return head
    raise ConversionError(f"{artifact.path}: no text/output_head or text/token_embedding; not a Qwen3.5 artifact")


def draft_format(fmt: str, head: ObjectEntry) -> str:
    if fmt not in DRAFT_FORMATS:
        raise ConversionError(f"unknown draft head format {fmt!r}; choose one of {', '.join(DRAFT_FORMATS)}")
    return DRAFT_FORMATS[fmt] or head.format


def _write_rows(writer: ArtifactWriter, artifact: Artifact, head: ObjectEntry, ids: list[int], fmt: str,
                device: torch.device, progress: tqdm) -> None:
    """Write `text/draft_head`: the head's rows `ids`, copied when `fmt` is the head's format, else decoded and
    encoded again, a block of rows at a time."""
    source, target = codec_for(head.format, head.layout), codec_for(fmt)
    vocab, hidden = head.shape
    source_planes = [artifact.raw(head.id, p.offset, p.offset + vocab * p.row_bytes).view(vocab, p.row_bytes)
                     for p in source.planes(head.shape)]
    target_planes = target.planes((len(ids), hidden))
    block_rows = max(1, BLOCK_ELEMENTS // hidden)
    for first in range(0, len(ids), block_rows):
        block = torch.tensor(ids[first : first + block_rows])
        rows = [plane[block] for plane in source_planes]
        if fmt != head.format:
            shape = (len(block), hidden)
            data = torch.zeros(source.encoded_bytes(shape), dtype=torch.uint8)
            for plane, part in zip(source.planes(shape), rows, strict=True):
                data[plane.offset : plane.offset + part.numel()] = part.reshape(-1)
            rows = target.encode_rows(source.decode(data, shape).to(device, torch.float32))
        for plane, part in zip(target_planes, rows, strict=True):
            writer.write(DRAFT_HEAD, part, plane.offset + first * plane.row_bytes)
            progress.update(part.numel())


def _copy_object(writer: ArtifactWriter, artifact: Artifact, obj: ObjectEntry, progress: tqdm) -> None:
    for start in range(0, obj.bytes, COPY_CHUNK):
        stop = min(obj.bytes, start + COPY_CHUNK)
        writer.write(obj.id, artifact.raw(obj.id, start, stop), start)
        artifact.release(obj.id, start, stop)
        progress.update(stop - start)


def _specs(objects: list[ObjectEntry], ids: int, hidden: int, fmt: str) -> list[TensorSpec | ResourceSpec]:
    """The source's objects in order, the draft head's two after the last `text/` object."""
    specs: list[TensorSpec | ResourceSpec] = [
        TensorSpec(o.id, o.shape, o.format) if o.kind == "tensor" else ResourceSpec(o.id, o.bytes) for o in objects]
    last_text = max((i for i, o in enumerate(objects) if o.component == "text"), default=len(objects) - 1)
    specs[last_text + 1 : last_text + 1] = [TensorSpec(DRAFT_HEAD, (ids, hidden), fmt),
                                            TensorSpec(DRAFT_HEAD_IDS, (ids,), "i32")]
    return specs


def add_draft_head(source: Path, calibration: Path, rows: int, out: Path, *, fmt: str = "q4",
                   artifact_id: bytes | None = None, part_cap: int = DEFAULT_PART_CAP, device: str = "cpu",
                   quiet: bool = False) -> dict[str, Any]:
    """Write `out`: the artifact `source` with a draft head of `rows` rows chosen by the token frequencies of the
    text file `calibration` (replacing a draft head it had), and its lines in `out`'s folder's SHA256SUMS.

    fmt: q4 (upstream's), q8, bf16, or head (the head's own format: its rows copied exactly). Returns a report
    (files, rows, format, calibration file, its tokens and the fraction of them the draft head covers, seconds).
    """
    started = time.time()
    source, calibration, out = Path(source), Path(calibration), Path(out)
    if out.suffix != ".ninfer":
        raise ConversionError(f"output {out} must end in .ninfer")
    if not out.parent.is_dir():
        raise ConversionError(f"output folder {out.parent} does not exist")
    if out.resolve() == source.resolve():
        raise ConversionError(f"output {out} is the source artifact; write the copy to another file")
    torch_device = parse_device(device)
    with Artifact.open(source) as artifact:
        head = head_object(artifact)
        stored = draft_format(fmt, head)
        tokenizer = Tokenizer.from_artifact(artifact)
        vocab = min(tokenizer.vocab_size, head.shape[0])
        always = always_kept(tokenizer)
        check_rows(rows, always, vocab)  # before the text is read: a bad --rows fails at once
        counts = token_counts(tokenizer, read_text(calibration))
        tokens = int(counts.sum())
        if tokens == 0:
            raise ConversionError(f"{calibration}: the calibration text holds no tokens")
        ids = draft_token_ids(counts[:vocab], rows, always, vocab)
        calibration_entry = {"name": calibration.name, "bytes": calibration.stat().st_size,
                             "sha256": sha256_file(calibration), "tokens": tokens}
        coverage = int(counts[ids].sum()) / tokens
        provenance = {**artifact.directory.provenance,
                      "draft_head": {"rows": rows, "format": stored, "calibration": calibration_entry,
                                     "coverage": round(coverage, 6), "created_by": f"ninfer {ninfer.__version__}"}}
        copied = [o for o in artifact.objects if o.id not in (DRAFT_HEAD, DRAFT_HEAD_IDS)]
        objects = plan_objects(_specs(copied, rows, head.shape[1], stored))
        directory = artifact.directory
        writer = ArtifactWriter(out, objects, directory.components, directory.metadata, provenance, artifact_id,
                                part_cap, directory.extra)
        try:
            total = sum(o.bytes for o in objects)
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out.name}",
                      disable=True if quiet else None, file=sys.stderr) as progress:
                for obj in copied:
                    _copy_object(writer, artifact, obj, progress)
                _write_rows(writer, artifact, head, ids, stored, torch_device, progress)
                encoded_ids = codec_for("i32").encode(torch.tensor(ids, dtype=torch.int32))
                writer.write(DRAFT_HEAD_IDS, encoded_ids)
                progress.update(encoded_ids.numel())
            paths = writer.commit()
        except BaseException:
            writer.abort()
            raise
    digests = hash_files(paths, "hashing artifact", quiet)
    update_sums(out.parent, digests)
    return {"artifact": out.name, "source": source.name,
            "files": [{"name": p.name, "bytes": p.stat().st_size, "sha256": d} for p, d in digests.items()],
            "rows": rows, "format": stored, "head": head.id, "calibration": calibration_entry,
            "coverage": coverage, "seconds": round(time.time() - started, 3)}
