"""The converter: a plan, a recipe and a source in; a streamed `.ninfer` artifact, its report and
SHA256SUMS line out.

Memory stays bounded by a chunk of rows (about CHUNK_ELEMENTS values) whatever the model's size: every
offset is planned from shapes alone, then each object is read, encoded and written a block of rows at a
time. Any failure removes the partial files.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import ninfer
from ninfer.artifact.checksums import hash_files, update_sums
from ninfer.artifact.framing import DEFAULT_PART_CAP, format_artifact_id
from ninfer.artifact.writer import ArtifactWriter, ResourceSpec, TensorSpec, plan_objects
from ninfer.convert.qwen3_5 import ModelPlan, ObjectPlan
from ninfer.convert.recipes import check_recipe, format_for
from ninfer.convert.source import FLOAT_DTYPES, TensorSource
from ninfer.devices import parse_device
from ninfer.errors import ConversionError, FormatError
from ninfer.quant import codec_for

CHUNK_ELEMENTS = 1 << 25  # values per encoded block: 128 MiB of fp32 working set
REPORT_SUFFIX = ".conversion.json"


def resource_id(role: str) -> str:
    return f"frontend/{role}"


def object_formats(plan: ModelPlan, recipe: str) -> dict[str, str]:
    check_recipe(recipe)
    return {obj.id: format_for(recipe, obj.role, obj.component) for obj in plan.objects}


def _check_dtypes(plan: ModelPlan, source: TensorSource) -> None:
    for obj in plan.objects:
        for name in obj.sources:
            dtype = source.dtype(name)
            if dtype not in FLOAT_DTYPES:
                raise ConversionError(f"source tensor {name!r} has dtype {dtype}; expected one of "
                                      f"{', '.join(FLOAT_DTYPES)}")


def _row_chunks(obj: ObjectPlan, source: TensorSource, device: torch.device, rows_per_chunk: int):
    """Yield (first row, rows) blocks of the object's matrix, read piece by piece from the source."""
    pending: list[torch.Tensor] = []
    pending_rows = 0
    first = 0
    for piece in obj.pieces:
        start = piece.start
        while start < piece.stop:
            stop = min(piece.stop, start + rows_per_chunk - pending_rows)
            block = source.read_rows(piece.tensor, piece.lead, start, stop).to(device)
            if block.is_floating_point() and not bool(torch.isfinite(block).all()):
                raise ConversionError(f"source tensor {piece.tensor!r} holds NaN or Inf (rows {start}..{stop})")
            pending.append(block)
            pending_rows += stop - start
            start = stop
            if pending_rows == rows_per_chunk:
                yield first, torch.cat(pending) if len(pending) > 1 else pending[0]
                first += pending_rows
                pending, pending_rows = [], 0
    if pending:
        yield first, torch.cat(pending) if len(pending) > 1 else pending[0]


def _write_object(writer: ArtifactWriter, obj: ObjectPlan, fmt: str, source: TensorSource, device: torch.device,
                  progress: tqdm) -> None:
    codec = codec_for(fmt)
    planes = codec.planes(obj.shape)
    columns = obj.shape[-1] if obj.shape else 1
    rows_per_chunk = obj.shape[0] if len(obj.shape) < 2 else max(1, CHUNK_ELEMENTS // columns)
    for first, rows in _row_chunks(obj, source, device, rows_per_chunk):
        if len(obj.shape) < 2:
            rows = rows.reshape(obj.shape)
        try:
            buffers = codec.encode_rows(rows)
        except FormatError as exc:
            raise ConversionError(f"object {obj.id!r} (from {', '.join(obj.sources)}): {exc}") from None
        for plane, buffer in zip(planes, buffers, strict=True):
            writer.write(obj.id, buffer, plane.offset + first * plane.row_bytes)
        progress.update(rows.numel())


def _tool_versions() -> dict[str, str]:
    import safetensors

    return {"ninfer": ninfer.__version__, "torch": torch.__version__, "safetensors": safetensors.__version__,
            "python": platform.python_version()}


def build_artifact(plan: ModelPlan, source: TensorSource, resources: dict[str, dict[str, bytes]], recipe: str,
                   out: Path, *, name: str, artifact_id: bytes | None = None, part_cap: int = DEFAULT_PART_CAP,
                   device: str = "cpu", provenance: dict[str, Any] | None = None,
                   quiet: bool = False) -> dict[str, Any]:
    """Write the artifact for `plan` and return the conversion report (also written beside it).

    `resources` maps component -> role -> verbatim file bytes (tokenizer.json, chat_template.jinja, ...).
    """
    started = time.time()
    out = Path(out)
    if out.suffix != ".ninfer":
        raise ConversionError(f"output {out} must end in .ninfer")
    if not out.parent.is_dir():
        raise ConversionError(f"output folder {out.parent} does not exist")
    formats = object_formats(plan, recipe)
    _check_dtypes(plan, source)
    torch_device = parse_device(device)

    components = {}
    resource_specs: list[TensorSpec | ResourceSpec] = []
    resource_bytes = {}
    for component, entry in plan.components.items():
        roles = resources.get(component, {})
        components[component] = {"config": entry["config"], "resources": {r: resource_id(r) for r in roles}}
        for role, data in roles.items():
            resource_specs.append(ResourceSpec(resource_id(role), len(data)))
            resource_bytes[resource_id(role)] = data
    tensor_specs = [TensorSpec(obj.id, obj.shape, formats[obj.id]) for obj in plan.objects]
    objects = plan_objects(resource_specs + tensor_specs)
    metadata = {"name": name, "architecture": plan.architecture, "recipe": recipe,
                "created_by": f"ninfer {ninfer.__version__}"}
    provenance = {"converter": f"ninfer {ninfer.__version__}", "recipe": recipe, "source_layout": plan.layout,
                  **(provenance or {})}

    source_files = source.files()
    with ThreadPoolExecutor(1) as pool:
        source_hashes = pool.submit(hash_files, source_files, "hashing sources", True)
        writer = ArtifactWriter(out, objects, components, metadata, provenance, artifact_id, part_cap)
        try:
            for object_id, data in resource_bytes.items():
                writer.write(object_id, data)
            total = sum(torch.Size(o.shape).numel() for o in plan.objects)
            with tqdm(total=total, unit="w", unit_scale=True, desc=f"converting {out.name}",
                      disable=True if quiet else None, file=sys.stderr) as progress:
                for obj in plan.objects:
                    _write_object(writer, obj, formats[obj.id], source, torch_device, progress)
            paths = writer.commit()
        except BaseException:
            writer.abort()
            raise
        hashes = source_hashes.result()

    digests = hash_files(paths, "hashing artifact", quiet)
    update_sums(out.parent, digests)
    report = _report(plan, writer, formats, source_files, hashes, digests, recipe, started)
    report_path = out.with_name(out.name + REPORT_SUFFIX)
    report_path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return report


def _report(plan: ModelPlan, writer: ArtifactWriter, formats: dict[str, str], source_files: list[Path],
            source_hashes: dict[Path, str], digests: dict[Path, str], recipe: str, started: float) -> dict[str, Any]:
    directory = writer.directory
    sizes = {o.id: o.bytes for o in directory.objects}
    tensors = []
    per_component: dict[str, dict[str, float]] = {}
    for obj in plan.objects:
        numel = torch.Size(obj.shape).numel()
        fmt = formats[obj.id]
        tensors.append({"id": obj.id, "format": fmt, "shape": list(obj.shape), "bytes": sizes[obj.id],
                        "bits_per_weight": round(8 * sizes[obj.id] / numel, 4), "sources": obj.sources})
        totals = per_component.setdefault(obj.component, {"objects": 0, "parameters": 0, "bytes": 0})
        totals["objects"] += 1
        totals["parameters"] += numel
        totals["bytes"] += sizes[obj.id]
    for totals in per_component.values():
        totals["bits_per_weight"] = round(8 * totals["bytes"] / max(1, totals["parameters"]), 4)
    return {
        "artifact": writer.path.name,
        "artifact_id": format_artifact_id(writer.artifact_id),
        "recipe": recipe,
        "architecture": plan.architecture,
        "source": {
            "layout": plan.layout,
            "files": [{"name": p.name, "bytes": p.stat().st_size, "sha256": source_hashes[p]} for p in source_files],
            "aliases": plan.aliases,
        },
        "files": [{"name": p.name, "bytes": p.stat().st_size, "sha256": d} for p, d in digests.items()],
        "components": per_component,
        "tensors": tensors,
        "tools": _tool_versions(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started, 3),
    }
