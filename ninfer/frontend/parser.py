"""The generated text of a Qwen3.5 chat turn -> reasoning, content and tool calls, streamed.

The format (what the chat template renders for an assistant turn, and so what the model writes):

    <think>\\nREASONING\\n</think>\\n\\nCONTENT\\n\\n<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>

With thinking on, the generation prompt already ends in `<think>\\n`, so the output starts inside the
reasoning. Boundary newlines are stripped the way the template splits a turn: newlines after `<think>`,
before `</think>` and after `</think>` (`.lstrip("\\n")` / `.rstrip("\\n")`), and the whitespace that
separates content from a tool call and tool calls from each other.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
_PARAMETER_END = "</parameter>"


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCall:
    """A complete tool call. `raw` is its markup, from `<tool_call>` to `</tool_call>` inclusive."""

    name: str
    arguments: dict[str, Any]
    raw: str


Event = ReasoningDelta | ContentDelta | ToolCall


@dataclass
class ParsedOutput:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class _State(Enum):
    START = "start"  # nothing decided yet: an opening <think> may come
    REASONING = "reasoning"
    CONTENT = "content"
    TOOL_CALL = "tool_call"  # inside <tool_call>, waiting for </tool_call>


class OutputParser:
    """Splits the streamed text of one assistant turn into events.

    `thinking`: the prompt opened the reasoning (`<think>\\n`), so the text starts as reasoning until
    `</think>`; otherwise it starts as content, except that a `<think>...</think>` block at the very start
    is still read as reasoning. `tools_enabled`: `<tool_call>` blocks become ToolCall events (and a
    `<tool_call>` inside the reasoning ends it); otherwise they are content.

    A ToolCall is emitted when its `</tool_call>` arrives. Its parameter values are the text between the
    parameter tags without one leading and one trailing newline, read as JSON when that parses (numbers,
    booleans, null, objects, arrays, quoted strings), else kept as the string. A block that does not
    parse (bad nesting, a missing closing tag, text outside the tags), or one still open at `finish`,
    is emitted as content, byte for byte. Nothing raises.

    Text that could be the start of a tag that matters in the current state, and newlines or whitespace
    that a boundary might strip, are held back until decided; `finish` releases what is still held.
    Concatenating consecutive deltas of one kind gives the same result however the text was split.
    One parser reads one turn; it is not fed again after `finish`.
    """

    def __init__(self, *, thinking: bool, tools_enabled: bool):
        self.thinking = thinking
        self.tools_enabled = tools_enabled
        self._state = _State.START
        self._buffer = ""  # text not yet decided
        self._strip = ""  # characters to drop from the start of the next text (a boundary's newlines)
        self._space_before_call = ""  # whitespace before the open <tool_call>: dropped if the call is valid

    def feed(self, text: str) -> list[Event]:
        """Add generated text; return the events it decides."""
        self._buffer += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        """End of the turn: decide everything still held and return the last events."""
        events: list[Event] = []
        if self._state is _State.START:  # only newlines or a partial "<think>" arrived
            self._state = _State.REASONING if self.thinking else _State.CONTENT
            self._buffer = self._buffer.lstrip("\n")
        rest = self._buffer.lstrip(self._strip) if self._strip else self._buffer
        if self._state is _State.REASONING:
            _append(events, ReasoningDelta, rest.rstrip("\n"))
        elif self._state is _State.TOOL_CALL:  # never closed
            _append(events, ContentDelta, self._space_before_call + rest)
        else:
            _append(events, ContentDelta, rest)
        self._state, self._buffer, self._strip, self._space_before_call = _State.CONTENT, "", "", ""
        return events

    # --- the state machine: each step consumes a decided prefix of the buffer -----------------------

    def _step(self, events: list[Event]) -> bool:
        """Advance once; False when the buffer holds nothing more that can be decided now."""
        if self._strip:
            self._buffer = self._buffer.lstrip(self._strip)
            if not self._buffer:
                return False
            self._strip = ""
        if self._state is _State.START:
            return self._start()
        if self._state is _State.TOOL_CALL:
            return self._tool_call(events)
        if self._state is _State.REASONING:
            return self._reasoning(events)
        return self._content(events)

    def _start(self) -> bool:
        head = self._buffer.lstrip("\n")  # both channels strip leading newlines
        if head.startswith(THINK_START):
            self._buffer = head[len(THINK_START) :]
            self._state, self._strip = _State.REASONING, "\n"
            return True
        if not head or THINK_START.startswith(head):
            return False
        self._buffer = head
        self._state = _State.REASONING if self.thinking else _State.CONTENT
        return True

    def _reasoning(self, events: list[Event]) -> bool:
        tags = (THINK_END, TOOL_CALL_START) if self.tools_enabled else (THINK_END,)
        found = _first_tag(self._buffer, tags)
        if found is None:
            keep = _partial_tag_length(self._buffer, tags)
            decided = self._buffer[: len(self._buffer) - keep]
            undecided_newlines = len(decided) - len(decided.rstrip("\n"))
            emit = decided[: len(decided) - undecided_newlines]
            self._buffer = self._buffer[len(emit) :]
            _append(events, ReasoningDelta, emit)
            return False
        start, tag = found
        _append(events, ReasoningDelta, self._buffer[:start].rstrip("\n"))
        if tag == THINK_END:
            self._buffer = self._buffer[start + len(tag) :]
        else:  # a tool call ends the reasoning; the content state reads it
            self._buffer = self._buffer[start:]
        self._state, self._strip = _State.CONTENT, "\n"
        return True

    def _content(self, events: list[Event]) -> bool:
        if not self.tools_enabled:
            _append(events, ContentDelta, self._buffer)
            self._buffer = ""
            return False
        found = _first_tag(self._buffer, (TOOL_CALL_START,))
        if found is None:
            keep = _partial_tag_length(self._buffer, (TOOL_CALL_START,))
            decided = self._buffer[: len(self._buffer) - keep]
            emit = decided.rstrip()  # whitespace before a tool call is dropped, so wait for what follows
            self._buffer = self._buffer[len(emit) :]
            _append(events, ContentDelta, emit)
            return False
        start, _ = found
        before = self._buffer[:start]
        _append(events, ContentDelta, before.rstrip())
        self._space_before_call = before[len(before.rstrip()) :]
        self._buffer = self._buffer[start:]
        self._state = _State.TOOL_CALL
        return True

    def _tool_call(self, events: list[Event]) -> bool:
        end = self._buffer.find(TOOL_CALL_END)
        if end < 0:
            return False
        raw = self._buffer[: end + len(TOOL_CALL_END)]
        self._buffer = self._buffer[len(raw) :]
        call = parse_tool_call(raw)
        if call is None:
            _append(events, ContentDelta, self._space_before_call + raw)
        else:
            events.append(call)
            self._strip = " \t\r\n"  # whitespace between and after tool calls
        self._space_before_call = ""
        self._state = _State.CONTENT
        return True


def parse_tool_call(raw: str) -> ToolCall | None:
    """One `<tool_call>...</tool_call>` block -> ToolCall, or None when its markup is malformed."""
    if not (raw.startswith(TOOL_CALL_START) and raw.endswith(TOOL_CALL_END)):
        return None
    body = raw[len(TOOL_CALL_START) : len(raw) - len(TOOL_CALL_END)].strip()
    if TOOL_CALL_START in body or TOOL_CALL_END in body:
        return None
    function = _FUNCTION.fullmatch(body)
    if function is None or not function.group(1).strip():
        return None
    inner, arguments, position = function.group(2), {}, 0
    while inner[position:].strip():
        opening = _PARAMETER.match(inner, position)
        if opening is None:
            return None
        end = inner.find(_PARAMETER_END, opening.end())
        if end < 0:
            return None
        key, value = opening.group(1).strip(), inner[opening.end() : end]
        if not key or key in arguments or "<parameter=" in value or "</function>" in value:
            return None
        arguments[key] = parameter_value(value)
        position = end + len(_PARAMETER_END)
    return ToolCall(function.group(1).strip(), arguments, raw)


def parameter_value(text: str) -> Any:
    """A parameter's value: one leading and one trailing newline removed, then JSON if it parses (NaN and
    Infinity are not JSON), else the string itself."""
    text = text.removeprefix("\n").removesuffix("\n")
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return text


def parse_output(text: str, *, thinking: bool, tools_enabled: bool) -> ParsedOutput:
    """The whole generated text of one turn at once; same rules as OutputParser."""
    parser = OutputParser(thinking=thinking, tools_enabled=tools_enabled)
    parsed = ParsedOutput()
    for event in [*parser.feed(text), *parser.finish()]:
        if isinstance(event, ReasoningDelta):
            parsed.reasoning += event.text
        elif isinstance(event, ContentDelta):
            parsed.content += event.text
        else:
            parsed.tool_calls.append(event)
    return parsed


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _append(events: list[Event], kind: type[ReasoningDelta] | type[ContentDelta], text: str) -> None:
    if text:
        events.append(kind(text))


def _first_tag(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest complete occurrence of any of `tags` in `text`: (position, tag)."""
    found = [(index, tag) for tag in tags if (index := text.find(tag)) >= 0]
    return min(found) if found else None


def _partial_tag_length(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    longest = 0
    for tag in tags:
        for length in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:length]):
                longest = length
                break
    return longest
