"""The model frontend: tokenizer and chat-template resources that an artifact embeds."""

from ninfer.frontend.chat import ChatTemplate, ChatTemplateError, UnsupportedContentError, check_text_only
from ninfer.frontend.detokenizer import IncrementalDetokenizer
from ninfer.frontend.parser import (
    ContentDelta,
    Event,
    OutputParser,
    ParsedOutput,
    ReasoningDelta,
    ToolCall,
    parse_output,
)
from ninfer.frontend.stops import StopMatcher
from ninfer.frontend.tokenizer import Tokenizer, TokenizerError

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "ContentDelta",
    "Event",
    "IncrementalDetokenizer",
    "OutputParser",
    "ParsedOutput",
    "ReasoningDelta",
    "StopMatcher",
    "Tokenizer",
    "TokenizerError",
    "ToolCall",
    "UnsupportedContentError",
    "check_text_only",
    "parse_output",
]
