"""Function tools, whichever API they come through.

Each API's wire model of a tool maps onto `FunctionTool` (name, description, parameters' JSON schema); the chat
template takes them as OpenAI function JSON (`template_json`), and an assistant's earlier calls as `template_call`.
Chat Completions and Responses share OpenAI's function fields (`OpenAIFunction`); Anthropic's client tools name
their schema `input_schema` and follow their own name rule.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from ninfer.serve.errors import APIError
from ninfer.serve.schema import StrictModel

OPENAI_FUNCTION_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"


@dataclass(frozen=True)
class FunctionTool:
    """A function the model may call: its name, what it does (None: not said) and its parameters' JSON schema."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def template_json(self) -> dict[str, Any]:
        """The tool as the chat template takes it: {"type": "function", "function": {name, description (left out
        when None), parameters}}."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


class OpenAIFunction(StrictModel):
    """OpenAI's function fields: Chat Completions nests them under a tool's `function`, Responses puts them beside
    its `type`. A missing `parameters` is an empty object schema."""

    name: str = Field(pattern=OPENAI_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # recorded, not enforced (no constrained decoding)

    def tool(self) -> FunctionTool:
        return FunctionTool(self.name, self.description, self.parameters or {"type": "object", "properties": {}})


def tools_by_name(tools: Iterable[FunctionTool], name_param: str,
                  code: str | None = "invalid_value") -> dict[str, FunctionTool]:
    """The tools by name, in their order. 400 (with `code`) naming the first tool whose name an earlier one has;
    `name_param` is the field path of a tool's name, `{}` standing for its index (e.g. "tools[{}].name")."""
    by_name: dict[str, FunctionTool] = {}
    for index, tool in enumerate(tools):
        if tool.name in by_name:
            param = name_param.format(index)
            raise APIError(400, f"{param}: {tool.name!r} is defined twice", code=code, param=param)
        by_name[tool.name] = tool
    return by_name


def arguments_json(arguments: Mapping[str, Any]) -> str:
    """A tool call's arguments as the JSON object string the APIs send."""
    return json.dumps(arguments, ensure_ascii=False)


def template_call(call_id: str | None, name: str, arguments: str) -> dict[str, Any]:
    """An earlier tool call of the assistant as the chat template takes it (`arguments`: a JSON object string)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
