"""Chat templates: OpenAI-style messages -> the prompt text, rendered as transformers renders them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ninfer.errors import NinferError
from ninfer.frontend.tokenizer import ResourceSource

# Older names for a message's reasoning; transformers copies them to `reasoning_content`, which templates read.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# tokenizer_config.json entries that transformers passes to the template as variables
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# content-part kinds (a part's `type`, or a key of an untyped part) that carry media: image parts of the OpenAI
# (image_url), Responses (input_image) and Anthropic (image) shapes first, then the other media
IMAGE_PARTS = ("image", "image_url", "input_image")
MEDIA_PARTS = (*IMAGE_PARTS, "video", "video_url", "input_audio", "audio", "file", "input_file", "document")


class ChatTemplateError(NinferError):
    """The chat template rejected the messages (its own message is kept), or the template is unusable."""


class UnsupportedContentError(NinferError, ValueError):
    """A message holds a content part this engine cannot take yet (an image, video, audio or file)."""


def check_text_only(messages: list[Mapping[str, Any]]) -> None:
    """Raise UnsupportedContentError, naming the part (`messages[i].content[j]`), for a media content part: the
    template would render its placeholder tokens without the media, which the model never sees."""
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list | tuple):
            continue
        for part_index, part in enumerate(content):
            if not isinstance(part, Mapping):
                continue  # the template refuses it
            kind = part.get("type")
            media = kind if kind in MEDIA_PARTS else next((key for key in MEDIA_PARTS if key in part), None)
            if media is None:
                continue
            what = "images" if media in IMAGE_PARTS else f"{media} inputs"
            raise UnsupportedContentError(f"messages[{index}].content[{part_index}]: {what} are not supported yet "
                                          f"(part type {media!r}); send text only")


class ChatTemplate:
    """A Jinja chat template, rendered with the semantics of transformers' `apply_chat_template`.

    The environment is transformers': sandboxed and immutable, `trim_blocks` and `lstrip_blocks`, the
    loopcontrols extension, a `{% generation %}` block that renders its body, a `tojson` filter that is
    `json.dumps` (ensure_ascii=False, indent/separators/sort_keys arguments), and the globals
    `raise_exception`, `strftime_now`, `dict` and an underscore-refusing `namespace`. The messages are
    normalized as transformers does: keys whose value is None are dropped and `reasoning` / `thinking`
    are copied to `reasoning_content`. In addition a tool call's `arguments` given as a JSON string (the
    OpenAI wire form) is parsed to the object that templates iterate over.
    """

    def __init__(self, text: str, special_tokens: Mapping[str, str] | None = None):
        """`special_tokens`: template variables such as {"eos_token": "<|im_end|>"}; transformers passes
        the tokenizer's special-token strings, which some templates read."""
        try:
            self._template = _environment().from_string(text)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the chat template does not parse: line {exc.lineno}: {exc.message}") from exc
        self.text = text
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_artifact(cls, artifact: ResourceSource) -> ChatTemplate:
        """The text component's chat_template.jinja, else tokenizer_config.json's `chat_template` (a string,
        or a list of named templates of which "default" is used); raises ChatTemplateError if neither exists."""
        config_bytes = artifact.component_resource("text", "tokenizer_config.json")
        try:
            config = json.loads(config_bytes) if config_bytes is not None else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ChatTemplateError(f"tokenizer_config.json is not valid JSON: {exc}") from exc
        special = {}
        for key in SPECIAL_TOKEN_KEYS:
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                special[key] = value
        template = artifact.component_resource("text", "chat_template.jinja")
        if template is not None:
            return cls(template.decode("utf-8"), special)
        inline = config.get("chat_template")
        if isinstance(inline, list):
            named = {t.get("name"): t.get("template") for t in inline if isinstance(t, dict)}
            inline = named.get("default")
        if not isinstance(inline, str):
            raise ChatTemplateError(
                "the artifact has no chat template (no text/chat_template.jinja and no chat_template in "
                "tokenizer_config.json); reconvert it from a checkpoint that has one"
            )
        return cls(inline, special)

    def render(
        self,
        messages: list[Mapping[str, Any]],
        *,
        tools: list[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages` (system / user / assistant / tool dicts) and `tools` (OpenAI
        function tools). `enable_thinking=False` asks the template for a closed, empty reasoning block;
        further keyword arguments (e.g. `preserve_thinking`) become template variables.
        Raises ChatTemplateError with the template's message when it rejects the conversation, and for a
        tool call whose string `arguments` are not a JSON object. The caller's messages are not modified."""
        context = {
            **self.special_tokens,
            **kwargs,
            "messages": [_normalize_message(m, index) for index, m in enumerate(messages)],
            "tools": _plain(tools),
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            "enable_thinking": enable_thinking,
        }
        try:
            return self._template.render(**context)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc.message or exc}") from exc
        except (TypeError, ValueError) as exc:  # e.g. a filter given the wrong type by a malformed message
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from exc


def _normalize_message(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"messages[{index}] must be an object with a role, got {type(message).__name__}")
    plain = {key: _plain(value) for key, value in message.items() if value is not None}
    reasoning = next((plain[key] for key in REASONING_FIELDS if key in plain), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    for call_index, call in enumerate(plain.get("tool_calls") or ()):
        function = call.get("function", call) if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            where = f"messages[{index}].tool_calls[{call_index}]"
            function["arguments"] = _parse_arguments(function["arguments"], where)
    return plain


def _parse_arguments(text: str, where: str) -> dict[str, Any]:
    try:
        arguments = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ChatTemplateError(f"{where}.function.arguments is not valid JSON: {exc}") from exc
    if not isinstance(arguments, dict):
        raise ChatTemplateError(f"{where}.function.arguments must be a JSON object, got {type(arguments).__name__}")
    return arguments


def _plain(value: Any) -> Any:
    """A fresh copy made of dicts and lists, so that normalizing never touches the caller's objects."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' is plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` in templates: construction only, no attribute tricks."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace` in templates, refusing underscore-prefixed attributes (a sandbox escape route)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a template namespace cannot hold the attribute {name!r}")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env
