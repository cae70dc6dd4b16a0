"""OutputParser: reasoning / content / tool calls from streamed Qwen3.5 output."""

from __future__ import annotations

import random

import pytest

from ninfer.frontend import (
    ChatTemplate,
    ContentDelta,
    OutputParser,
    ReasoningDelta,
    ToolCall,
    parse_output,
)
from ninfer.frontend.vocab import chat_template_bytes


def _call(name: str, **params: str) -> str:
    """A tool call in the template's spelling; values are written as given."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _merged(events: list) -> list:
    """Consecutive deltas of one kind joined, so that differently split streams compare equal."""
    merged: list = []
    for event in events:
        if merged and isinstance(event, ReasoningDelta | ContentDelta) and type(merged[-1]) is type(event):
            merged[-1] = type(event)(merged[-1].text + event.text)
        else:
            merged.append(event)
    return merged


def _run(text: str, pieces: list[str] | None = None, **mode: bool) -> list:
    parser = OutputParser(**mode)
    events = []
    for piece in [text] if pieces is None else pieces:
        events += parser.feed(piece)
    events += parser.finish()
    assert all(not isinstance(e, ReasoningDelta | ContentDelta) or e.text for e in events)  # no empty deltas
    return _merged(events)


THINK_TOOLS = {"thinking": True, "tools_enabled": True}
NO_THINK_TOOLS = {"thinking": False, "tools_enabled": True}


# --- reasoning ------------------------------------------------------------------------------------


def test_thinking_on_starts_in_reasoning():
    text = "The user greets.\n\nReply kindly.\n</think>\n\nHello! <b>Hi</b>"
    assert _run(text, **THINK_TOOLS) == [
        ReasoningDelta("The user greets.\n\nReply kindly."),
        ContentDelta("Hello! <b>Hi</b>"),
    ]
    # a model that repeats the opening tag is read the same way
    assert _run("<think>\n" + text, **THINK_TOOLS) == _run(text, **THINK_TOOLS)


def test_thinking_off_is_content_unless_a_think_block_opens_the_output():
    assert _run("Just the answer.\n", thinking=False, tools_enabled=False) == [ContentDelta("Just the answer.\n")]
    text = "<think>\nquick check\n</think>\n\nAnswer: 4"
    assert _run(text, thinking=False, tools_enabled=False) == [ReasoningDelta("quick check"), ContentDelta("Answer: 4")]
    # only at the start: later it is content
    later = "Answer <think>x</think> done"
    assert _run(later, thinking=False, tools_enabled=False) == [ContentDelta(later)]
    # an empty reasoning block makes no reasoning event
    assert _run("<think>\n\n</think>\n\nOK", **NO_THINK_TOOLS) == [ContentDelta("OK")]


def test_reasoning_that_never_closes():
    assert _run("step one\nstep two\n\n", **THINK_TOOLS) == [ReasoningDelta("step one\nstep two")]
    assert _run("<think>\nstarted but cut", **NO_THINK_TOOLS) == [ReasoningDelta("started but cut")]
    assert _run("", **THINK_TOOLS) == []
    assert _run("\n", **NO_THINK_TOOLS) == []


def test_a_tool_call_ends_the_reasoning():
    text = "I should look it up.\n" + _call("search", query="qwen") + "\n"
    events = _run(text, **THINK_TOOLS)
    assert events == [
        ReasoningDelta("I should look it up."),
        ToolCall("search", {"query": "qwen"}, _call("search", query="qwen")),
    ]
    # without tools the markup is just reasoning
    assert _run(text, thinking=True, tools_enabled=False) == [ReasoningDelta(text.rstrip("\n"))]


# --- tool calls -----------------------------------------------------------------------------------


def test_one_tool_call_after_content():
    call = _call("get_weather", city="Paris", days="3")
    text = "Weighing options.\n</think>\n\nLet me check.\n\n" + call + "\n"
    assert _run(text, **THINK_TOOLS) == [
        ReasoningDelta("Weighing options."),
        ContentDelta("Let me check."),
        ToolCall("get_weather", {"city": "Paris", "days": 3}, call),
    ]


def test_several_tool_calls():
    calls = [_call("a", x="1"), _call("b"), _call("c", y="[1, 2]", z="text")]
    text = "\n".join(calls) + "\n"
    assert _run(text, **NO_THINK_TOOLS) == [
        ToolCall("a", {"x": 1}, calls[0]),
        ToolCall("b", {}, calls[1]),
        ToolCall("c", {"y": [1, 2], "z": "text"}, calls[2]),
    ]
    # content between or after calls stays content, without the separating whitespace
    text = calls[0] + "\n\nthen\n" + calls[1] + "\n done"
    assert _run(text, **NO_THINK_TOOLS) == [
        ToolCall("a", {"x": 1}, calls[0]),
        ContentDelta("then"),
        ToolCall("b", {}, calls[1]),
        ContentDelta("done"),
    ]


@pytest.mark.parametrize(
    ("written", "value"),
    [
        ("Paris", "Paris"),
        ("line one\nline two\n  indented", "line one\nline two\n  indented"),
        ("\nkeeps inner newlines\n", "\nkeeps inner newlines\n"),  # only one newline each side is the frame
        ("42", 42),
        ("-3.5e2", -350.0),
        ("true", True),
        ("false", False),
        ("null", None),
        ('{"a": [1, {"b": null}], "c": "d"}', {"a": [1, {"b": None}], "c": "d"}),
        ('[1, "two", 3.0]', [1, "two", 3.0]),
        ('"quoted"', "quoted"),
        ("NaN", "NaN"),  # not JSON
        ("{broken", "{broken"),
        ("", ""),
        ("[" * 100_000, "[" * 100_000),  # too deep for the JSON reader: kept as text
    ],
)
def test_parameter_values(written, value):
    call = _call("f", v=written)
    [event] = _run(call, **NO_THINK_TOOLS)
    assert event == ToolCall("f", {"v": value}, call)
    assert type(event.arguments["v"]) is type(value)


@pytest.mark.parametrize(
    "markup",
    [
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>",  # parameter never closed
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</parameter>\n</tool_call>",  # crossed tags
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>",  # no </function>
        "<tool_call>\nchatter <function=f>\n</function>\n</tool_call>",  # text outside the function
        "<tool_call>\n<function=f>\nloose text\n</function>\n</tool_call>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",  # no name
        "<tool_call>\n<function=f>\n</function>\n<function=g>\n</function>\n</tool_call>",  # two functions
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n</parameter>\n</function>\n"
        "</tool_call>",  # duplicate key
        "<tool_call>\n<tool_call>\n<function=f>\n</function>\n</tool_call>",  # nested
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n",  # unclosed at the end
    ],
)
def test_malformed_markup_falls_back_to_content_byte_for_byte(markup):
    text = "Before.\n\n" + markup
    assert _run(text, **NO_THINK_TOOLS) == [ContentDelta(text)]
    assert parse_output(text, **NO_THINK_TOOLS).tool_calls == []
    if markup.endswith("</tool_call>"):  # a good call after a bad one still parses
        good = _call("g", k="v")
        assert _run(markup + "\n" + good, **NO_THINK_TOOLS) == [ContentDelta(markup), ToolCall("g", {"k": "v"}, good)]


def test_tool_markup_is_content_when_tools_are_disabled():
    text = "Here:\n\n" + _call("f", a="1")
    assert _run(text, thinking=False, tools_enabled=False) == [ContentDelta(text)]


# --- streaming ------------------------------------------------------------------------------------

SAMPLES = [
    "Plan: look up.\n\n</think>\n\nI'll search.\n\n" + _call("search", query="a < b", n="3") + "\n",
    "<think>\nr\n</think>\n\n" + _call("f", s="x\ny") + "\n" + _call("g") + "\ntrailing <tool_ca",
    "reasoning with < and </thin and <tool_c inside\n</think>\ncontent with </think> and <think> and <",
    "no close at all <\n\n",
    "\n\n<think>\n\n\nx\n\n</think>\n\n\n<tool_call>\n<function=broken>\n</tool_call> after",
    "émoji 🤖 and 中文\n</think>\n\n答案 🎉" + _call("f", v='{"k": "ü"}'),
    "<thinking is not a tag\n</think>\n\nok",
    "",
    "<",
    "<think",
]


@pytest.mark.parametrize("text", SAMPLES)
@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("tools_enabled", [True, False])
def test_streaming_in_any_pieces_equals_one_shot(text, thinking, tools_enabled):
    mode = {"thinking": thinking, "tools_enabled": tools_enabled}
    whole = _run(text, **mode)
    assert _run(text, list(text), **mode) == whole
    rng = random.Random(len(text))
    for _ in range(5):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _run(text, pieces, **mode) == whole
    parsed = parse_output(text, **mode)
    assert parsed.reasoning == "".join(e.text for e in whole if isinstance(e, ReasoningDelta))
    assert parsed.content == "".join(e.text for e in whole if isinstance(e, ContentDelta))
    assert parsed.tool_calls == [e for e in whole if isinstance(e, ToolCall)]


def test_possible_tag_starts_are_held_until_decided():
    parser = OutputParser(**NO_THINK_TOOLS)
    assert parser.feed("<") == []  # could be <think>
    assert parser.feed("b") == [ContentDelta("<b")]
    assert parser.feed(" 2 <") == [ContentDelta(" 2")]  # " <" could begin " <tool_call>"
    assert parser.feed("tool_ca") == []
    assert parser.feed("r") == [ContentDelta(" <tool_car")]
    assert parser.feed(" x <tool_ca") == [ContentDelta(" x")]
    assert parser.finish() == [ContentDelta(" <tool_ca")]  # nothing stays held after finish

    parser = OutputParser(thinking=True, tools_enabled=False)
    assert parser.feed("a\n</thi") == [ReasoningDelta("a")]
    assert parser.feed("nk>") == []
    assert parser.feed("\n\nb <") == [ContentDelta("b <")]  # tools off: "<" cannot start a tag in content
    assert parser.finish() == []

    parser = OutputParser(thinking=True, tools_enabled=True)
    assert parser.feed("x </thi") == [ReasoningDelta("x ")]
    assert parser.finish() == [ReasoningDelta("</thi")]


def test_rendered_assistant_turns_parse_back():
    """What the template renders for an assistant turn is what the parser reads back."""
    template = ChatTemplate(chat_template_bytes().decode("utf-8"))
    arguments = {"city": "São Paulo", "days": 3, "opts": {"metric": True}, "tags": ["a"], "note": "l1\nl2"}
    call = {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    for content in ["", "Checking the forecast."]:
        messages = [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "reasoning_content": "Need the tool.",
                "content": content,
                "tool_calls": [call, call],
            },
        ]
        rendered = template.render(messages, add_generation_prompt=False)
        generated = rendered.split("<|im_start|>assistant\n<think>\n", 1)[1].removesuffix("<|im_end|>\n")
        parsed = parse_output(generated, thinking=True, tools_enabled=True)
        assert parsed.reasoning == "Need the tool."
        assert parsed.content == content
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", arguments)] * 2
