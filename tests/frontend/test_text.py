"""Tokenizer ids from resource bytes, the incremental detokenizer, stop strings."""

from __future__ import annotations

import json
import random

import pytest

from ninfer.errors import NinferError
from ninfer.frontend import ChatTemplate, IncrementalDetokenizer, StopMatcher, Tokenizer, TokenizerError
from ninfer.frontend.vocab import byte_tokenizer_files, generation_config_json

CJK_EMOJI = "我们在北京 👩‍👩‍👧‍👦 flag 🇯🇵 é 한국어 🤖🧠✨ 1️⃣ end"


@pytest.fixture(scope="module")
def byte_files() -> dict[str, bytes]:
    return byte_tokenizer_files(320)


@pytest.fixture(scope="module")
def byte_tok(byte_files) -> Tokenizer:
    return Tokenizer.from_files(
        byte_files["tokenizer.json"], byte_files["tokenizer_config.json"], generation_config_json([258, 256], 256)
    )


@pytest.fixture(scope="module")
def qwen_tok(qwen_files) -> Tokenizer:
    return Tokenizer.from_files(
        qwen_files["tokenizer.json"], qwen_files["tokenizer_config.json"],
        generation_config_json([248046, 248044], 248044),
    )


# --- tokenizer ------------------------------------------------------------------------------------


def test_byte_tokenizer_ids(byte_tok):
    assert byte_tok.vocab_size == 289
    assert byte_tok.encode("hi é") == [104, 105, 32, 0xC3, 0xA9]
    assert byte_tok.encode("<|im_start|>user\n<think>x") == [257, *b"user\n", 280, ord("x")]
    # special=False: every added token written in the text is plain text
    assert byte_tok.encode("<|im_end|><think>", special=False) == list(b"<|im_end|><think>")
    assert (byte_tok.im_start_id, byte_tok.im_end_id) == (257, 258)
    assert (byte_tok.think_start_id, byte_tok.think_end_id) == (280, 281)
    assert (byte_tok.tool_call_start_id, byte_tok.tool_call_end_id) == (270, 271)
    assert byte_tok.token_id("<|endoftext|>") == 256 and byte_tok.token_id("<nope>") is None
    ids = [257, *b"a\xc3\xa9", 280, 258]
    assert byte_tok.decode(ids) == "<|im_start|>aé<think><|im_end|>"
    assert byte_tok.decode(ids, skip_special=True) == "aé<think>"  # <think> is not a special token
    assert (byte_tok.eos_ids, byte_tok.pad_id) == ([258, 256], 256)


def test_eos_and_pad_sources(byte_files):
    tokenizer_json, config = byte_files["tokenizer.json"], byte_files["tokenizer_config.json"]
    # no generation_config: eos_token / pad_token of tokenizer_config
    tok = Tokenizer.from_files(tokenizer_json, config, None)
    assert (tok.eos_ids, tok.pad_id) == ([258], 256)
    # an int eos_token_id
    generation = {"eos_token_id": 256, "do_sample": False, "temperature": 0.7, "top_p": 0.8, "min_p": 0.05}
    tok = Tokenizer.from_files(tokenizer_json, config, json.dumps(generation).encode())
    assert (tok.eos_ids, tok.pad_id) == ([256], 256)
    # an AddedToken-shaped eos_token, no pad
    old_config = json.dumps({"eos_token": {"content": "<|endoftext|>"}}).encode()
    tok = Tokenizer.from_files(tokenizer_json, old_config, None)
    assert (tok.eos_ids, tok.pad_id) == ([256], None)
    assert Tokenizer.from_files(tokenizer_json).eos_ids == []


def test_tokenizer_errors(byte_files):
    tokenizer_json = byte_files["tokenizer.json"]
    with pytest.raises(TokenizerError, match=r"tokenizer\.json is not a valid"):
        Tokenizer.from_files(b'{"model": 3}')
    with pytest.raises(TokenizerError, match=r"generation_config\.json is not valid JSON"):
        Tokenizer.from_files(tokenizer_json, None, b"{oops")
    with pytest.raises(TokenizerError, match="eos_token '<eos>' is not a token"):
        Tokenizer.from_files(tokenizer_json, b'{"eos_token": "<eos>"}')
    with pytest.raises(TokenizerError, match="eos_token_id must be"):
        Tokenizer.from_files(tokenizer_json, None, b'{"eos_token_id": "x"}')
    assert issubclass(TokenizerError, NinferError)


class _Resources:
    def __init__(self, files: dict[str, bytes]):
        self.files = files

    def component_resource(self, component: str, role: str) -> bytes | None:
        return self.files.get(role) if component == "text" else None


def test_from_artifact(byte_files):
    files = {**byte_files, "generation_config.json": generation_config_json([258], 256)}
    tok = Tokenizer.from_artifact(_Resources(files))
    assert (tok.eos_ids, tok.pad_id, tok.vocab_size) == ([258], 256, 289)
    with pytest.raises(TokenizerError, match=r"no text/tokenizer\.json"):
        Tokenizer.from_artifact(_Resources({}))


def test_from_a_real_artifact(synth_artifact_path):
    from ninfer.artifact import open_artifact

    artifact = open_artifact(synth_artifact_path("tiny-dense", "q4"))
    tok = Tokenizer.from_artifact(artifact)
    assert (tok.vocab_size, tok.eos_ids, tok.pad_id) == (289, [258, 256], 256)
    prompt = ChatTemplate.from_artifact(artifact).render([{"role": "user", "content": "hi"}])
    assert tok.encode(prompt) == [257, *b"user\nhi", 258, ord("\n"), 257, *b"assistant\n", 280, ord("\n")]


def test_real_qwen_vocabulary(qwen_tok):
    assert qwen_tok.vocab_size == 248077
    assert (qwen_tok.im_start_id, qwen_tok.im_end_id) == (248045, 248046)
    assert (qwen_tok.think_start_id, qwen_tok.think_end_id) == (248068, 248069)
    assert (qwen_tok.tool_call_start_id, qwen_tok.tool_call_end_id) == (248058, 248059)
    assert (qwen_tok.eos_ids, qwen_tok.pad_id) == ([248046, 248044], 248044)
    assert qwen_tok.token_id("<|endoftext|>") == 248044
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ids = qwen_tok.encode(prompt)
    assert ids[0] == 248045 and ids[-2:] == [248068, 198] and 248046 in ids
    assert qwen_tok.decode(ids) == prompt
    plain = qwen_tok.encode(prompt, special=False)
    assert max(plain) < 248044 and qwen_tok.decode(plain) == prompt
    assert qwen_tok.decode([*qwen_tok.encode(CJK_EMOJI), 248046], skip_special=True) == CJK_EMOJI


# --- detokenizer ----------------------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_detokenizer_holds_split_characters(byte_tok):
    ids = byte_tok.encode(CJK_EMOJI)
    assert len(ids) == len(CJK_EMOJI.encode("utf-8"))  # one id per byte: every multi-byte char is split
    pieces = _stream(byte_tok, ids)
    assert "".join(pieces) == CJK_EMOJI == byte_tok.decode(ids)
    assert pieces.count("") > len(ids) // 2  # the continuation bytes were held, not guessed
    assert all("\ufffd" not in piece for piece in pieces)
    for piece in pieces:
        assert piece.encode("utf-8").decode("utf-8") == piece  # whole characters only


def test_detokenizer_replaces_only_invalid_bytes(byte_tok):
    assert _stream(byte_tok, [0xF0, 0x9F, 0x41]) == ["", "", "\ufffdA", ""]  # a broken 4-byte start
    assert _stream(byte_tok, [0x41, 0xE4, 0xBD]) == ["A", "", "", "\ufffd"]  # unfinished at the end
    # a special token cuts a character: its lead byte and the stray continuation bytes are each invalid
    assert _stream(byte_tok, [0xE4, 258, 0xBD, 0xA0]) == ["", "\ufffd<|im_end|>", "\ufffd", "\ufffd", ""]
    assert byte_tok.decode([0xE4, 258, 0xBD, 0xA0]) == "\ufffd<|im_end|>\ufffd\ufffd"
    assert "".join(_stream(byte_tok, [0xE4, 258, 0xA0], skip_special=True)) == byte_tok.decode(
        [0xE4, 258, 0xA0], skip_special=True
    )


def test_detokenizer_matches_decode_on_random_ids(byte_tok):
    rng = random.Random(0)
    for _ in range(2000):
        ids = [rng.randrange(320) for _ in range(rng.randint(0, 24))]  # also ids past the vocabulary
        for skip in (False, True):
            assert "".join(_stream(byte_tok, ids, skip_special=skip)) == byte_tok.decode(ids, skip_special=skip)


def test_detokenizer_on_the_real_vocabulary(qwen_tok):
    ids = qwen_tok.encode(CJK_EMOJI * 2)
    pieces = _stream(qwen_tok, ids)
    assert "".join(pieces) == CJK_EMOJI * 2
    assert all("\ufffd" not in piece for piece in pieces)
    assert "" in pieces[:-1]  # some token ended inside a character
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(248320) for _ in range(rng.randint(0, 16))]
        ids += [rng.choice([248046, 248068, 248059]) for _ in range(2)]
        rng.shuffle(ids)
        for skip in (False, True):
            assert "".join(_stream(qwen_tok, ids, skip_special=skip)) == qwen_tok.decode(ids, skip_special=skip)


def test_detokenizer_completes_a_character_the_prompt_started(byte_tok):
    emoji = "👍".encode()
    prompt = [*b"ab", emoji[0], emoji[1]]
    assert _stream(byte_tok, [emoji[2], emoji[3], ord("c")], prompt_ids=prompt) == ["", "👍", "c", ""]
    assert _stream(byte_tok, [ord("c")], prompt_ids=[*b"ab\xc3\xa9"]) == ["c", ""]  # a complete prompt


# --- stop strings ---------------------------------------------------------------------------------


def _stop_stream(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out, stopped = "", False
    for piece in pieces:
        emit, stopped = matcher.feed(piece)
        out += emit
        if stopped:
            return out, True
    return out + matcher.flush(), False


def test_stop_split_over_three_pieces():
    matcher = StopMatcher(["<END>"])
    assert matcher.feed("result: 42 <E") == ("result: 42 ", False)
    assert matcher.feed("N") == ("", False)
    assert matcher.feed("D> trailing") == ("", True)
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_partial_stop_at_the_end_is_text():
    matcher = StopMatcher(["STOP", "\n\n"])
    assert matcher.feed("almost ST") == ("almost ", False)
    assert matcher.feed("O") == ("", False)
    assert matcher.flush() == "STO"
    assert _stop_stream(["\n\n"], ["line\n"]) == ("line\n", False)
    assert _stop_stream(["STOP"], ["STAR", "T"]) == ("START", False)


def test_overlapping_stop_candidates():
    # the stop that completes first wins, though another started earlier
    assert _stop_stream(["abcd", "bc"], ["xab", "cd"]) == ("xa", True)
    # completing at the same place: the one starting first (the longer) is cut
    assert _stop_stream(["bc", "abc"], ["za", "bc"]) == ("z", True)
    # a stop overlapping itself
    assert _stop_stream(["aab"], ["a", "a", "a", "b"]) == ("a", True)
    assert _stop_stream(["aab"], ["aaa", "a"]) == ("aaaa", False)
    # several stops in one piece: the first in the text
    assert _stop_stream(["Y", "X"], ["..X..Y"]) == ("..", True)


def test_stop_matcher_does_not_depend_on_the_pieces():
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 20)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
        expected = (text[: min(ends)[1]], True) if ends else (text, False)
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _stop_stream(stops, pieces) == expected, (text, stops, pieces)


def test_stop_matcher_rejects_empty_stops_and_passes_text_without_stops():
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["ok", ""])
    assert _stop_stream([], ["a<", "b"]) == ("a<b", False)
