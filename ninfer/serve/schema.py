"""Request bodies: the pydantic bases of the APIs' request schemas, and their validation as 400s that name the field.

    body = await parse_body(http_request, MyRequest)     # 400 naming the field on any schema violation
    item = parse_tagged(raw, {"message": MessageItem, ...}, "input[2]")   # one object of a list, by its `type`
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from fastapi import Request as HTTPRequest
from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

from ninfer.serve.errors import APIError


class StrictModel(BaseModel):
    """Base of request schemas: unknown fields are errors (nothing is ignored silently), no type coercion (a string
    is not a number), NaN and infinities are refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class LenientModel(BaseModel):
    """Base of request sub-objects whose extra fields are harmless metadata (e.g. a message's `name`)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def check_json_object_string(value: str) -> str:
    """`value` unchanged if it is a JSON object written as a string (blank counts as `{}`), as function-call
    arguments are sent; else ValueError saying what it is instead (pydantic reports it as the field's 400)."""
    try:
        parsed = json.loads(value) if value.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"must be a JSON object string ({exc})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"must be a JSON object string, got a JSON {type(parsed).__name__}")
    return value


JSONObjectString = Annotated[str, AfterValidator(check_json_object_string)]

Model = TypeVar("Model", bound=BaseModel)


async def parse_body(request: HTTPRequest, schema: type[Model]) -> Model:
    """The request body validated against `schema` (JSON mode). Raises APIError 400 naming the first offending
    field: code invalid_json (not JSON / not UTF-8 / nested too deep), missing_required_parameter,
    unknown_parameter, invalid_type, unsupported_role or invalid_value."""
    body = await request.body()
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    """A pydantic ValidationError as a 400 APIError about its first error (the count of others is mentioned)."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    kind, loc = first["type"], list(first["loc"])
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                        code="invalid_json")
    tagged_object = kind in ("union_tag_invalid", "union_tag_not_found") and isinstance(first.get("input"), dict)
    if tagged_object:  # name the discriminator field: 'role' or role() (a callable)
        loc.append(str(first.get("ctx", {}).get("discriminator", "type")).strip("'").removesuffix("()"))
    param = format_loc(loc)
    message = first["msg"]
    if kind == "extra_forbidden":
        code, message = "unknown_parameter", "unknown parameter (not supported by this server)"
    elif kind == "missing":
        code = "missing_required_parameter"
    elif kind == "union_tag_not_found":
        code, message = (("missing_required_parameter", "field required (it selects the kind of object)")
                         if tagged_object else ("invalid_type", "must be an object"))
    elif kind.endswith("_type") or kind in ("model_attributes_type", "is_instance_of"):
        code = "invalid_type"
    elif kind == "union_tag_invalid" and loc[-1] == "role":
        ctx = first.get("ctx", {})
        roles = ", ".join(tag.strip("'").removesuffix(" message") for tag in ctx.get("expected_tags", "").split(", "))
        code, message = "unsupported_role", f"role {ctx.get('tag')!r} is not supported; use one of {roles}"
    else:
        code = "invalid_value"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    where = f"{param}: " if param else "body: "
    return APIError(400, f"{where}{message}{more}", code=code, param=param or None)


_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "any", "literal", "bytes"})


def format_loc(loc: list[Any] | tuple[Any, ...]) -> str:
    """A pydantic error location as a field path: ("messages", 2, "role") -> "messages[2].role". The union-member
    tags pydantic inserts ("literal['auto']", "NamedToolChoice", "str", "function-after[...]") are left out: field
    names are snake_case."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _FIELD_NAME.fullmatch(part) and part not in _TYPE_TAGS:
            text += f".{part}" if text else part
    return text


def parse_tagged(raw: Any, models: Mapping[str, type[Model]], where: str, default_type: str | None = None) -> Model:
    """One object of a list whose kind is its `type` field (`default_type` when absent), validated by the model that
    `models` gives for that kind. Errors are 400s whose param and message start at `where` (e.g. "input[2]"):
    not an object, a missing or unlisted `type`, or the first schema violation inside the object. (A pydantic
    union of str and such a list reports the str branch's error; parsing the list items here names the field.)"""
    if not isinstance(raw, dict):
        raise APIError(400, f"{where}: must be an object, got {type(raw).__name__}", code="invalid_type", param=where)
    kind = raw.get("type", default_type)
    if kind is None:
        raise APIError(400, f"{where}.type: field required", code="missing_required_parameter", param=f"{where}.type")
    model = models.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise APIError(400, f"{where}.type: {kind!r} is not supported here; use one of {sorted(models)}",
                       code="invalid_value", param=f"{where}.type")
    try:
        return model.model_validate(raw if "type" in raw else {**raw, "type": kind})
    except ValidationError as exc:
        error = validation_error(exc)
        inner = error.param or ""
        param = where + (inner if inner.startswith("[") or not inner else f".{inner}")
        message = error.message.split(": ", 1)[1] if ": " in error.message else error.message
        raise APIError(400, f"{param}: {message}", code=error.code, param=param) from None
