"""`ninfer inspect` and `ninfer verify`: what an artifact holds, and whether it is sound."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from ninfer.artifact.checksums import hash_files, read_sums
from ninfer.artifact.directory import ObjectEntry
from ninfer.artifact.framing import format_artifact_id
from ninfer.artifact.reader import Artifact
from ninfer.devices import parse_device
from ninfer.errors import ArtifactError, FormatError
from ninfer.quant import codec_for


def _totals(rows: list[tuple[str, int, int]]) -> dict[str, dict[str, Any]]:
    """Group (key, parameters, bytes) rows into totals with bits per weight."""
    totals: dict[str, dict[str, Any]] = {}
    for key, params, size in rows:
        entry = totals.setdefault(key, {"objects": 0, "parameters": 0, "bytes": 0})
        entry["objects"] += 1
        entry["parameters"] += params
        entry["bytes"] += size
    for entry in totals.values():
        entry["bits_per_weight"] = round(8 * entry["bytes"] / entry["parameters"], 4) if entry["parameters"] else None
    return totals


def summarize(artifact: Artifact) -> dict[str, Any]:
    """Everything `ninfer inspect` shows, as JSON-ready data."""
    objects = artifact.objects
    tensors = [o for o in objects if o.kind == "tensor"]
    return {
        "file": str(artifact.path),
        "artifact_id": format_artifact_id(artifact.artifact_id),
        "files": [{"name": p.name, "payload_bytes": f.payload_bytes}
                  for p, f in zip(artifact.files, artifact.directory.files, strict=True)],
        "metadata": artifact.directory.metadata,
        "provenance": artifact.directory.provenance,
        "components": artifact.components,
        "objects": [o.to_json() for o in objects],
        "totals_by_component": _totals([(o.component, math.prod(o.shape), o.bytes) for o in tensors]),
        "totals_by_format": _totals([(o.format, math.prod(o.shape), o.bytes) for o in tensors]),
        "resource_bytes": sum(o.bytes for o in objects if o.kind == "resource"),
        "tensor_bytes": sum(o.bytes for o in tensors),
        "parameters": sum(math.prod(o.shape) for o in tensors),
    }


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _config_line(config: dict[str, Any]) -> str:
    keys = ("architectures", "model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_experts",
            "num_experts_per_tok", "vocab_size", "depth", "out_hidden_size")
    shown = {k: config[k] for k in keys if k in config}
    if isinstance(shown.get("architectures"), list) and len(shown["architectures"]) == 1:  # config is open JSON
        shown["architectures"] = shown["architectures"][0]
    parts = [f"{k}={v}" for k, v in shown.items()]
    if isinstance(config.get("layer_types"), list):
        parts.append("layers=" + "".join("F" if t == "full_attention" else "L" for t in config["layer_types"]))
    return " ".join(parts)


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"{summary['file']}  id {summary['artifact_id']}",
             "files: " + ", ".join(f"{f['name']} ({_human_bytes(f['payload_bytes'])} payload)"
                                    for f in summary["files"])]
    meta = summary["metadata"]
    if meta:
        lines.append("metadata: " + ", ".join(f"{k}={v}" for k, v in meta.items()))
    lines.append("components:")
    for name, component in summary["components"].items():
        lines.append(f"  {name}: {_config_line(component['config'])}")
        if component["resources"]:
            lines.append(f"    resources: {', '.join(component['resources'])}")
    lines.append("objects:")
    width = max((len(o["id"]) for o in summary["objects"]), default=0)
    for obj in summary["objects"]:
        what = obj.get("format", "resource")
        shape = "x".join(map(str, obj["shape"])) if "shape" in obj else ""
        lines.append(f"  {obj['id']:<{width}}  {what:<20} {shape:<16} {obj['bytes']:>14,d}")
    for title, key in (("by component", "totals_by_component"), ("by format", "totals_by_format")):
        lines.append(f"totals {title}:")
        for name, t in summary[key].items():
            lines.append(f"  {name:<22} {t['objects']:>5} objects {t['parameters']:>15,d} weights "
                         f"{_human_bytes(t['bytes']):>12}  {t['bits_per_weight']} bits/weight")
    total_bpw = 8 * summary["tensor_bytes"] / summary["parameters"] if summary["parameters"] else 0
    lines.append(f"total: {summary['parameters']:,d} weights, {_human_bytes(summary['tensor_bytes'])} of tensors "
                 f"({total_bpw:.3f} bits/weight), {_human_bytes(summary['resource_bytes'])} of resources")
    return "\n".join(lines)


@dataclass
class VerifyReport:
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        self.ok = False
        self.problems.append(message)


def verify(artifact: Artifact, quiet: bool = False, device: str = "cpu") -> VerifyReport:
    """Check the SHA256SUMS lines (when the folder has them), every object's SHA-256 (when its directory entry
    records one) and that every object decodes to legal values. The structure was already checked when the
    artifact was opened. Problems name the object or the part, never the entry file (the caller names it)."""
    report = VerifyReport()
    device = str(parse_device(device))
    sums = read_sums(artifact.path.parent)
    listed = [p for p in artifact.files if p.name in sums]
    if not sums:
        report.notes.append("no SHA256SUMS beside the artifact: checksums not checked")
    elif not listed:
        report.notes.append("SHA256SUMS has no line for this artifact: checksums not checked")
    else:
        for path, digest in hash_files(listed, "hashing", quiet).items():
            if digest != sums[path.name]:
                which = "" if path == artifact.path else f"part {path.name}: "
                report.fail(f"{which}SHA-256 {digest} differs from SHA256SUMS ({sums[path.name]})")
        missing = [p.name for p in artifact.files if p.name not in sums]
        if missing:
            report.fail(f"SHA256SUMS lists part of the artifact but not {', '.join(missing)}")
    if all(o.sha256 is None for o in artifact.objects):
        report.notes.append("the directory records no object digests (another writer's artifact): object "
                            "digests not checked")
    total = sum(o.bytes for o in artifact.objects)
    with tqdm(total=total, unit="B", unit_scale=True, desc="decoding",
              disable=True if quiet else None, leave=False) as bar:
        for obj in artifact.objects:
            _verify_object(artifact, obj, report, device)
            bar.update(obj.bytes)
    return report


def _verify_object(artifact: Artifact, obj: ObjectEntry, report: VerifyReport, device: str) -> None:
    if obj.sha256 is not None and (digest := artifact.object_digest(obj.id)) != obj.sha256:
        report.fail(f"object {obj.id!r}: SHA-256 {digest} differs from its directory entry ({obj.sha256}): the "
                    "stored bytes are damaged")
        return  # its values are damaged too: one line per object
    data = artifact.raw(obj.id)
    if obj.kind == "resource":
        if obj.id.endswith(".json"):
            try:
                json.loads(bytes(data.numpy()).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                report.fail(f"resource {obj.id!r} is not valid JSON ({exc})")
        return
    codec = codec_for(obj.format, obj.layout)
    data = data.to(device)
    try:
        codec.validate(data, obj.shape)
        values = codec.decode(data, obj.shape)
    except (FormatError, ArtifactError) as exc:
        report.fail(f"object {obj.id!r}: {exc}")
        return
    if values.is_floating_point() and not bool(torch.isfinite(values).all()):
        report.fail(f"object {obj.id!r}: decodes to NaN or Inf")
