"""`ninfer convert`: a Hugging Face Qwen3.5 folder (config, safetensors, tokenizer files) to a `.ninfer` artifact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ninfer.artifact.framing import DEFAULT_PART_CAP
from ninfer.convert.converter import build_artifact
from ninfer.convert.qwen3_5 import plan_qwen3_5
from ninfer.convert.source import SafetensorsSource
from ninfer.errors import ConversionError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json")
TEXT_FILES = ("generation_config.json",)
VISION_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
CHAT_TEMPLATE = "chat_template.jinja"


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConversionError(f"{path}: missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConversionError(f"{path}: not valid JSON ({exc})") from None


def _embedded_template(files: dict[str, bytes]) -> str | None:
    """The chat template of a tokenizer folder that has no chat_template.jinja: chat_template.json's, or
    tokenizer_config.json's `chat_template` string."""
    for role in ("chat_template.json", "tokenizer_config.json"):
        if role in files:
            try:
                template = json.loads(files[role]).get("chat_template")
            except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
                raise ConversionError(f"{role}: not a JSON object") from None
            if isinstance(template, str):
                return template
    return None


def collect_resources(model_dir: Path, tokenizer_dir: Path | None, vision: bool) -> dict[str, dict[str, bytes]]:
    """Frontend files stored verbatim, by component and role. The chat template is always available as
    `chat_template.jinja` (extracted from the tokenizer config when the folder has no such file)."""
    tokenizer_source = tokenizer_dir or model_dir
    text = {role: (tokenizer_source / role).read_bytes() for role in TOKENIZER_FILES
            if (tokenizer_source / role).is_file()}
    if "tokenizer.json" not in text:
        hint = "" if tokenizer_dir else "; pass --tokenizer DIR to take the tokenizer files from another folder"
        raise ConversionError(f"{tokenizer_source}: no tokenizer.json (the artifact must carry its tokenizer){hint}")
    if CHAT_TEMPLATE not in text and (template := _embedded_template(text)) is not None:
        text[CHAT_TEMPLATE] = template.encode("utf-8")
    text.update({role: (model_dir / role).read_bytes() for role in TEXT_FILES if (model_dir / role).is_file()})
    resources = {"text": text}
    if vision:
        resources["vision"] = {role: (model_dir / role).read_bytes() for role in VISION_FILES
                               if (model_dir / role).is_file()}
    return resources


def convert_checkpoint(model_dir: Path, recipe: str, out: Path, *, tokenizer_dir: Path | None = None,
                       name: str | None = None, artifact_id: bytes | None = None,
                       part_cap: int = DEFAULT_PART_CAP, device: str = "cpu", quiet: bool = False) -> dict[str, Any]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConversionError(f"{model_dir}: not a folder")
    if tokenizer_dir is not None and not Path(tokenizer_dir).is_dir():
        raise ConversionError(f"{tokenizer_dir}: not a folder")
    config = read_json(model_dir / "config.json")
    if not isinstance(config, dict):
        raise ConversionError(f"{model_dir / 'config.json'}: not a JSON object")
    source = SafetensorsSource(model_dir)
    plan = plan_qwen3_5(config, source)
    tokenizer = Path(tokenizer_dir) if tokenizer_dir else None
    resources = collect_resources(model_dir, tokenizer, "vision" in plan.components)
    provenance = {"source_name": model_dir.resolve().name,
                  "source_files": [{"name": p.name, "bytes": p.stat().st_size} for p in source.files()]}
    return build_artifact(plan, source, resources, recipe, Path(out), name=name or model_dir.resolve().name,
                          artifact_id=artifact_id, part_cap=part_cap, device=device, provenance=provenance,
                          quiet=quiet)
