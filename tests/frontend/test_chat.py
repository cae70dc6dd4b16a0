"""ChatTemplate renders exactly what transformers' apply_chat_template renders."""

from __future__ import annotations

import copy
import json
from datetime import datetime

import pytest
from tokenizers import Tokenizer as HFTokenizer

from ninfer.errors import NinferError
from ninfer.frontend import ChatTemplate, ChatTemplateError, UnsupportedContentError, check_text_only
from ninfer.frontend.vocab import byte_tokenizer_files, chat_template_bytes

TEMPLATE = chat_template_bytes().decode("utf-8")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Prévisions météo pour une ville (°C).",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "units": {"type": "string", "enum": ["metric", "imperial"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {"type": "object", "properties": {"site": {"type": "string"}}},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["query"],
        },
    },
}


def _hf(template: str = TEMPLATE, **special_tokens: str):
    transformers = pytest.importorskip("transformers")
    files = byte_tokenizer_files(320)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=HFTokenizer.from_str(files["tokenizer.json"].decode("utf-8")),
        chat_template=template,
        **special_tokens,
    )


@pytest.fixture(scope="module")
def hf():
    return _hf()


@pytest.fixture(scope="module")
def ours() -> ChatTemplate:
    return ChatTemplate(TEMPLATE)


def _same(ours: ChatTemplate, hf, messages: list[dict], hf_messages: list[dict] | None = None, **kwargs) -> str:
    """Render with both and require equal text; `hf_messages` when transformers needs another spelling."""
    before = copy.deepcopy(messages)
    rendered = ours.render(messages, **kwargs)
    assert messages == before  # the caller's messages are untouched
    assert rendered == hf.apply_chat_template(hf_messages or messages, tokenize=False, **kwargs)
    return rendered


def test_plain_chat_with_system_prompt(ours, hf):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Bonjour, ça va? 你好"},
    ]
    rendered = _same(ours, hf, messages, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nBonjour, ça va? 你好<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    assert ours.render(messages) == rendered  # add_generation_prompt and thinking are on by default
    _same(ours, hf, messages, add_generation_prompt=True, enable_thinking=True)


def test_thinking_off(ours, hf):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = _same(ours, hf, messages, add_generation_prompt=True, enable_thinking=False)
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_two_tools_with_json_schema_parameters(ours, hf):
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}]
    rendered = _same(ours, hf, messages, tools=[WEATHER_TOOL, SEARCH_TOOL], add_generation_prompt=True)
    # one JSON line per tool, non-ASCII kept (transformers' tojson has ensure_ascii=False)
    tools_block = "<tools>\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in (WEATHER_TOOL, SEARCH_TOOL))
    assert tools_block + "\n</tools>" in rendered
    assert "Prévisions météo" in rendered
    assert rendered.count("<|im_start|>system") == 1
    assert "</IMPORTANT>\n\nUse tools.<|im_end|>\n" in rendered
    assert _same(ours, hf, messages, tools=[], add_generation_prompt=True) == ours.render(messages)


def test_tool_round_trip_with_dict_and_json_string_arguments(ours, hf):
    dict_call = {
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "units": "metric"}},
    }
    string_arguments = {"query": "weather\nOslo", "filters": {"site": "yr.no"}, "tags": ["a", "b"], "n": 2.5}
    string_call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "search", "arguments": json.dumps(string_arguments)},
    }
    messages = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [dict_call]},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "Now Oslo.", "tool_calls": [string_call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Rain, 9 °C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "extra"},
        {"role": "assistant", "content": "Paris 21, Oslo 9."},
        {"role": "user", "content": "Thanks!"},
    ]
    # transformers iterates `arguments|items` and so needs the object; the OpenAI wire form is a JSON string
    hf_messages = copy.deepcopy(messages)
    hf_messages[4]["tool_calls"][0]["function"]["arguments"] = string_arguments
    rendered = _same(ours, hf, messages, hf_messages, tools=[WEATHER_TOOL, SEARCH_TOOL], add_generation_prompt=True)
    first_call = (
        "<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=units>\nmetric\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n"
    )
    assert first_call in rendered
    # strings raw, other values as JSON; content and the call separated by a blank line
    assert (
        "Now Oslo.\n\n<tool_call>\n<function=search>\n<parameter=query>\nweather\nOslo\n</parameter>\n"
        '<parameter=filters>\n{"site": "yr.no"}\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n'
        "<parameter=n>\n2.5\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
    ) in rendered
    # consecutive tool results share one user turn
    assert (
        "<|im_start|>user\n<tool_response>\nRain, 9 °C\n</tool_response>\n<tool_response>\nextra\n"
        "</tool_response><|im_end|>\n"
    ) in rendered
    assert rendered.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_past_reasoning_dropped_before_the_last_query_and_kept_after(ours, hf):
    call = {"type": "function", "function": {"name": "search", "arguments": {"query": "x"}}}
    messages = [
        {"role": "user", "content": "First?"},
        {"role": "assistant", "reasoning_content": "OLD-TRACE-1", "content": "One."},
        {"role": "user", "content": "Second?"},
        {"role": "assistant", "reasoning": "OLD-TRACE-2", "content": "Two."},  # transformers' alias
        {"role": "user", "content": "Third?"},
        {"role": "assistant", "reasoning_content": "\nNEW-TRACE\n", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "result"},
        {"role": "assistant", "content": "<think>\nINLINE-TRACE\n</think>\n\nThree."},
    ]
    rendered = _same(ours, hf, messages, tools=[SEARCH_TOOL], add_generation_prompt=False)
    assert "OLD-TRACE" not in rendered
    assert "<|im_start|>assistant\nOne.<|im_end|>\n" in rendered
    assert "<|im_start|>assistant\nTwo.<|im_end|>\n" in rendered
    assert "<|im_start|>assistant\n<think>\nNEW-TRACE\n</think>\n\n<tool_call>\n<function=search>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n<think>\nINLINE-TRACE\n</think>\n\nThree.<|im_end|>\n")
    kept = _same(ours, hf, messages, tools=[SEARCH_TOOL], add_generation_prompt=True, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nOLD-TRACE-1\n</think>\n\nOne.<|im_end|>\n" in kept
    assert "<|im_start|>assistant\n<think>\nOLD-TRACE-2\n</think>\n\nTwo.<|im_end|>\n" in kept


def test_without_generation_prompt(ours, hf):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "List "}, {"type": "text", "text": "parts"}]},
    ]
    rendered = _same(ours, hf, messages, add_generation_prompt=False)
    assert rendered == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nList parts<|im_end|>\n"
    )


def test_environment_matches_transformers():
    """tojson arguments, loop controls, generation blocks, dict, strftime_now and special-token variables."""
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson(indent=2) }}{% endgeneration %}\n{% endfor %}"
        "{{ dict(a=1, b='é') | tojson(separators=(',', ':'), sort_keys=True) }}|{{ eos_token }}|"
        "{{ strftime_now('%Y') }}|{{ {'x': '<&>'} | tojson }}"
    )
    messages = [{"role": "user", "content": "é<b>"}, {"role": "assistant", "content": "2"}, {"role": "user"}]
    ours = ChatTemplate(template, {"eos_token": "<|im_end|>"})
    rendered = ours.render(messages, add_generation_prompt=False)
    transformers_rendered = _hf(template, eos_token="<|im_end|>").apply_chat_template(messages, tokenize=False)
    assert rendered == transformers_rendered
    assert json.dumps(messages[0], indent=2, ensure_ascii=False) in rendered
    assert f'{{"a":1,"b":"é"}}|<|im_end|>|{datetime.now().year}|{{"x": "<&>"}}' in rendered


def test_template_errors_are_ninfer_errors(ours):
    with pytest.raises(ChatTemplateError, match="No user query found in messages"):
        ours.render([{"role": "system", "content": "Alone."}])
    with pytest.raises(ChatTemplateError, match="System message must be at the beginning"):
        ours.render([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}])
    with pytest.raises(ChatTemplateError, match="Unexpected message role"):
        ours.render([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    bad_arguments = {"type": "function", "function": {"name": "f", "arguments": "{not json"}}
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"):
        ours.render([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [bad_arguments]}])
    with pytest.raises(ChatTemplateError, match="must be a JSON object"):
        bad_arguments["function"]["arguments"] = "[1, 2]"
        ours.render([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [bad_arguments]}])
    with pytest.raises(ChatTemplateError, match="line 1"):
        ChatTemplate("{% if %}")
    with pytest.raises(ChatTemplateError, match="_secret"):
        ChatTemplate("{% set ns = namespace(_secret=1) %}").render([])
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute escapes
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])
    assert issubclass(ChatTemplateError, NinferError)


class _Resources:
    def __init__(self, files: dict[str, bytes]):
        self.files = files

    def component_resource(self, component: str, role: str) -> bytes | None:
        return self.files.get(role) if component == "text" else None


def test_from_artifact_resources(ours):
    files = byte_tokenizer_files(320)
    messages = [{"role": "user", "content": "Hi"}]
    from_file = ChatTemplate.from_artifact(_Resources(files))
    assert from_file.render(messages) == ours.render(messages)
    assert from_file.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    # older checkpoints keep the template inside tokenizer_config.json, possibly as named templates
    config = json.loads(files["tokenizer_config.json"])
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    inline = ChatTemplate.from_artifact(_Resources({"tokenizer_config.json": json.dumps(config).encode()}))
    assert inline.render(messages) == "D"
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate.from_artifact(_Resources({}))


@pytest.mark.parametrize(("part", "message"), [
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "images are not supported yet"),
    ({"type": "input_image", "image_url": "https://example.com/a.png"}, "images are not supported yet"),
    ({"image": "file:///tmp/a.png"}, "images are not supported yet"),  # untyped, as the Qwen template reads it
    ({"type": "video", "video": "file:///tmp/a.mp4"}, "video inputs are not supported yet"),
])
def test_check_text_only_refuses_media_parts(part: dict, message: str) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": [{"type": "text", "text": "Look:"}, part]}]
    with pytest.raises(UnsupportedContentError, match=rf"^messages\[2\]\.content\[1\]: {message}") as refused:
        check_text_only(messages)
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, NinferError)
    check_text_only([*messages[:2], {"role": "user", "content": [{"type": "text", "text": "Look:"}]}])
