"""The tokenizer of a model: text <-> ids, its stop and pad ids, and its recommended sampling defaults.

Built from the resource files an artifact embeds (tokenizer.json, tokenizer_config.json,
generation_config.json) with the `tokenizers` library; never touches the network.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from typing import Any, Protocol

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from ninfer.errors import NinferError
from ninfer.frontend.vocab import _bytes_to_unicode


class TokenizerError(NinferError):
    """A tokenizer resource is missing or malformed, or the tokenizer cannot do what was asked."""


class ResourceSource(Protocol):
    """What `Tokenizer.from_artifact` needs of an artifact (`ninfer.artifact.Artifact` has it)."""

    def component_resource(self, component: str, role: str) -> bytes | None: ...


class Tokenizer:
    """A `tokenizers` tokenizer plus the ids and defaults the runtime needs.

    - `vocab_size`: ids the tokenizer knows, added tokens included (248,077 for Qwen3.5); the model's
      embedding may have more rows, whose ids decode to nothing.
    - `eos_ids`: generation_config `eos_token_id` (an int or a list), else tokenizer_config `eos_token`,
      else []. `pad_id`: generation_config `pad_token_id`, else tokenizer_config `pad_token`, else None.
    - `think_start_id`, `think_end_id`, `tool_call_start_id`, `tool_call_end_id`, `im_start_id`,
      `im_end_id`: the tag's id, None when the vocabulary lacks it.
    - `special_ids`: the added tokens marked special (dropped by `decode(skip_special=True)`).
    """

    def __init__(
        self,
        tokenizer: HFTokenizer,
        tokenizer_config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        tokenizer_config = tokenizer_config or {}
        generation_config = generation_config or {}
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_ids: list[int] = self._eos_ids(tokenizer_config, generation_config)
        self.pad_id: int | None = self._pad_id(tokenizer_config, generation_config)
        self.think_start_id = self.token_id("<think>")
        self.think_end_id = self.token_id("</think>")
        self.tool_call_start_id = self.token_id("<tool_call>")
        self.tool_call_end_id = self.token_id("</tool_call>")
        self.im_start_id = self.token_id("<|im_start|>")
        self.im_end_id = self.token_id("<|im_end|>")
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, token in added.items() if token.special)

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def from_files(
        cls,
        tokenizer_json: bytes,
        tokenizer_config: bytes | None = None,
        generation_config: bytes | None = None,
    ) -> Tokenizer:
        """Build from the bytes of tokenizer.json and, when present, tokenizer_config / generation_config.

        Raises TokenizerError naming the file when one is not valid JSON or not a tokenizers file.
        """
        try:
            tokenizer = HFTokenizer.from_str(tokenizer_json.decode("utf-8"))
        except Exception as exc:  # tokenizers raises a plain Exception for a malformed file
            raise TokenizerError(f"tokenizer.json is not a valid tokenizers file: {exc}") from exc
        return cls(
            tokenizer,
            _json_object(tokenizer_config, "tokenizer_config.json"),
            _json_object(generation_config, "generation_config.json"),
        )

    @classmethod
    def from_artifact(cls, artifact: ResourceSource) -> Tokenizer:
        """Build from the "text" component's resources; raises TokenizerError if it has no tokenizer.json."""
        tokenizer_json = artifact.component_resource("text", "tokenizer.json")
        if tokenizer_json is None:
            raise TokenizerError(
                "the artifact has no text/tokenizer.json resource; reconvert it with a checkpoint that has one"
            )
        return cls.from_files(
            tokenizer_json,
            artifact.component_resource("text", "tokenizer_config.json"),
            artifact.component_resource("text", "generation_config.json"),
        )

    # --- text <-> ids ----------------------------------------------------------------------------

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """Ids of `text`. No BOS/EOS is added. With `special`, added tokens written in the text
        (`<|im_start|>`, `<think>` ...) become their ids; without it every character is plain text,
        which is how untrusted user text must be encoded."""
        if special:
            return self._tokenizer.encode(text, add_special_tokens=False).ids
        return self._plain_tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`; ids outside the vocabulary contribute nothing. `skip_special` drops the special
        added tokens (`<|im_end|>` ...) but keeps the non-special ones (`<think>`, `<tool_call>` ...)."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def token_id(self, text: str) -> int | None:
        """The id of a single token spelled `text` (an added token or a vocabulary entry), else None."""
        return self._tokenizer.token_to_id(text)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The exact bytes the byte-level decoder produces for one id (None outside the vocabulary).

        Decoding a sequence is `b"".join(token_bytes(i) ...)` read as UTF-8 with U+FFFD for invalid bytes;
        `IncrementalDetokenizer` relies on this. Raises TokenizerError if the decoder is not byte-level.
        """
        table = self._byte_table
        return table[token_id] if 0 <= token_id < len(table) else None

    # --- internals -------------------------------------------------------------------------------

    @cached_property
    def _plain_tokenizer(self) -> HFTokenizer:
        """The same normalizer, pre-tokenizer and model without the added vocabulary (shares the model)."""
        plain = HFTokenizer(self._tokenizer.model)
        plain.normalizer = self._tokenizer.normalizer
        plain.pre_tokenizer = self._tokenizer.pre_tokenizer
        plain.decoder = self._tokenizer.decoder
        return plain

    @cached_property
    def _byte_table(self) -> list[bytes | None]:
        decoder = self._tokenizer.decoder
        if not isinstance(decoder, decoders.ByteLevel):
            raise TokenizerError(
                f"incremental detokenizing needs a ByteLevel decoder, this tokenizer has {type(decoder).__name__}"
            )
        char_bytes = {char: byte for byte, char in enumerate(_bytes_to_unicode())}
        table: list[bytes | None] = [None] * self.vocab_size
        for token, token_id in self._tokenizer.get_vocab(with_added_tokens=True).items():
            if token_id >= len(table):
                table.extend([None] * (token_id + 1 - len(table)))
            try:
                table[token_id] = bytes(char_bytes[char] for char in token)
            except KeyError:  # the ByteLevel decoder passes a token with a non-alphabet char through as UTF-8
                table[token_id] = token.encode("utf-8")
        return table

    def _eos_ids(self, tokenizer_config: dict[str, Any], generation_config: dict[str, Any]) -> list[int]:
        eos = generation_config.get("eos_token_id")
        if eos is not None:
            ids = eos if isinstance(eos, list) else [eos]
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise TokenizerError(f"generation_config.json: eos_token_id must be an int or a list of ints: {eos!r}")
            return list(dict.fromkeys(ids))
        token = _token_text(tokenizer_config.get("eos_token"))
        return [] if token is None else [self._required_id(token, "eos_token")]

    def _pad_id(self, tokenizer_config: dict[str, Any], generation_config: dict[str, Any]) -> int | None:
        pad = generation_config.get("pad_token_id")
        if isinstance(pad, int) and not isinstance(pad, bool):
            return pad
        token = _token_text(tokenizer_config.get("pad_token"))
        return None if token is None else self._required_id(token, "pad_token")

    def _required_id(self, token: str, key: str) -> int:
        token_id = self.token_id(token)
        if token_id is None:
            raise TokenizerError(f"tokenizer_config.json: {key} {token!r} is not a token of tokenizer.json")
        return token_id


def _json_object(data: bytes | None, name: str) -> dict[str, Any] | None:
    if data is None:
        return None
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise TokenizerError(f"{name} must hold a JSON object, got {type(value).__name__}")
    return value


def _token_text(value: Any) -> str | None:
    """A tokenizer_config token entry: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
