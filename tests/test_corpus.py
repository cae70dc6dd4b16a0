"""The committed corpus (data/corpus) and tokenizer (data/tokenizer): integrity, reproducibility, behaviour."""

from __future__ import annotations

import hashlib
import json
import lzma
import random
import shutil
import sys
import unicodedata
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

from ninfer.frontend import ChatTemplate, Tokenizer
from ninfer.frontend.vocab import NON_SPECIAL_TOKENS, QWEN3_5_PRETOKENIZE_REGEX, QWEN3_5_SPECIAL_TOKENS, frontend_files
from tools import build_corpus, corpus, train_tokenizer

ROOT = Path(__file__).resolve().parent.parent

CORPUS_DIR = ROOT / "data" / "corpus"
TOKENIZER_DIR = ROOT / "data" / "tokenizer"
CORPUS_FILES = ("manifest.json", "train.txt.xz", "test.txt.xz", "LICENSE.md")
PINNED = sys.implementation.name == "cpython" and sys.version_info[:3] == build_corpus.PINNED_PYTHON
NOT_PINNED_REASON = (
    f"the corpus is built from CPython {'.'.join(map(str, build_corpus.PINNED_PYTHON))}'s standard library; "
    f"this is {sys.implementation.name} {sys.version.split()[0]}"
)
MAX_TEST_TOKENS_PER_BYTE = 0.35  # measured 0.312; a byte-level tokenizer without merges gives 1.0
BPE_SIZE = 4063
IM_END_ID = 4065
ENDOFTEXT_ID = 4063


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((CORPUS_DIR / "manifest.json").read_bytes())


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    return {name: corpus.load_split(name) for name in corpus.SPLITS}


@pytest.fixture(scope="module")
def hf_tokenizer() -> HFTokenizer:
    return HFTokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))


def _path_of(document: str) -> str:
    header, _, _ = document.partition("\n")
    assert header.startswith("# file: "), header[:80]
    return header.removeprefix("# file: ")


# --- corpus ---------------------------------------------------------------------------------------


def test_split_texts_match_the_manifest(manifest: dict, texts: dict[str, str]) -> None:
    for name in corpus.SPLITS:
        data = lzma.decompress((CORPUS_DIR / f"{name}.txt.xz").read_bytes())
        entry = manifest["splits"][name]
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
        assert len(data) == entry["bytes"]
        assert texts[name].encode("utf-8") == data
        assert texts[name].count(corpus.SEPARATOR) == entry["files"]
        assert len(corpus.documents(texts[name])) == entry["files"]
    assert manifest["python"] == {"implementation": "cpython", "version": "3.11.7"}


def test_splits_are_disjoint_sorted_and_cover_the_manifest(manifest: dict, texts: dict[str, str]) -> None:
    entries = {entry["path"]: entry for entry in manifest["files"]}
    seen: dict[str, str] = {}
    for name in corpus.SPLITS:
        paths = []
        for document in corpus.documents(texts[name]):
            path = _path_of(document)
            body = document.partition("\n")[2].encode("utf-8")
            assert path not in seen, f"{path} is in both {seen.get(path)} and {name}"
            seen[path] = name
            paths.append(path)
            assert entries[path]["split"] == name
            assert hashlib.sha256(body).hexdigest() == entries[path]["sha256"], path
            assert len(body) == entries[path]["bytes"], path
        assert paths == sorted(paths)
    assert seen.keys() == entries.keys()
    counts = {name: sum(split == name for split in seen.values()) for name in corpus.SPLITS}
    assert counts["test"] >= 20 and counts["train"] >= 500, counts


def test_split_rule_and_exclusions(manifest: dict) -> None:
    for entry in manifest["files"]:
        path = entry["path"]
        digest = int(hashlib.sha256(path.encode("utf-8")).hexdigest(), 16)
        assert entry["split"] == ("test" if digest % 20 == 0 else "train"), path
        parts = path.split("/")
        assert parts[-1].endswith(".py") and not parts[-1].startswith(("test_", "_sysconfigdata_")), path
        assert not {"test", "tests", "idlelib", "lib2to3", "tkinter", "site-packages"} & set(parts[:-1]), path


def test_load_split_rejects_a_corrupted_split(tmp_path: Path, manifest: dict) -> None:
    for name in CORPUS_FILES:
        shutil.copy(CORPUS_DIR / name, tmp_path / name)
    tampered = dict(manifest, splits=dict(manifest["splits"], test=dict(manifest["splits"]["test"], sha256="0" * 64)))
    (tmp_path / "manifest.json").write_text(json.dumps(tampered))
    with pytest.raises(corpus.CorpusError, match=r"test\.txt\.xz decompresses to text with SHA-256"):
        corpus.load_split("test", tmp_path)
    (tmp_path / "train.txt.xz").write_bytes(b"not xz")
    with pytest.raises(corpus.CorpusError, match="not a valid xz file"):
        corpus.load_split("train", tmp_path)
    with pytest.raises(ValueError, match="unknown corpus split 'valid'"):
        corpus.load_split("valid", tmp_path)
    with pytest.raises(corpus.CorpusError, match="does not end with the document separator"):
        corpus.documents("# file: a.py\nx = 1\n")


@pytest.mark.skipif(not PINNED, reason=NOT_PINNED_REASON)
def test_rebuild_reproduces_the_committed_bytes(tmp_path: Path) -> None:
    assert build_corpus.main(["--out", str(tmp_path)]) == 0
    for name in CORPUS_FILES:
        assert (tmp_path / name).read_bytes() == (CORPUS_DIR / name).read_bytes(), name


@pytest.mark.skipif(not PINNED, reason=NOT_PINNED_REASON)
def test_check_names_the_first_differing_source_file(
    tmp_path: Path, texts: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    for name in CORPUS_FILES:
        shutil.copy(CORPUS_DIR / name, tmp_path / name)
    documents = corpus.documents(texts["test"])
    victim = _path_of(documents[3])
    documents[3] = documents[3].replace("def ", "def  ", 1)
    tampered = "".join(document + corpus.SEPARATOR for document in documents)
    (tmp_path / "test.txt.xz").write_bytes(lzma.compress(tampered.encode("utf-8"), preset=0))
    assert build_corpus.main(["--check", "--out", str(tmp_path)]) == 1  # found before anything is compressed
    assert f"test.txt.xz: the text of {victim} differs" in capsys.readouterr().err


# --- tokenizer ------------------------------------------------------------------------------------


def test_vocabulary_layout(hf_tokenizer: HFTokenizer) -> None:
    assert hf_tokenizer.get_vocab_size(with_added_tokens=True) == 4096
    assert hf_tokenizer.get_vocab_size(with_added_tokens=False) == BPE_SIZE
    assert sorted(hf_tokenizer.get_vocab(with_added_tokens=False).values()) == list(range(BPE_SIZE))
    added = hf_tokenizer.get_added_tokens_decoder()
    assert [added[BPE_SIZE + i].content for i in range(33)] == list(QWEN3_5_SPECIAL_TOKENS)
    assert all(
        added[BPE_SIZE + i].special == (t not in NON_SPECIAL_TOKENS) for i, t in enumerate(QWEN3_5_SPECIAL_TOKENS)
    )
    assert hf_tokenizer.token_to_id("<|im_end|>") == IM_END_ID
    assert hf_tokenizer.token_to_id("<|endoftext|>") == ENDOFTEXT_ID
    # every byte has a token, so every byte string encodes
    assert set(pre_tokenizers.ByteLevel.alphabet()) <= hf_tokenizer.get_vocab(with_added_tokens=False).keys()
    config = json.loads(hf_tokenizer.to_str())
    assert config["normalizer"] == {"type": "NFC"}
    assert config["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == QWEN3_5_PRETOKENIZE_REGEX


def test_round_trip_and_compression_on_the_test_split(hf_tokenizer: HFTokenizer, texts: dict[str, str]) -> None:
    text = unicodedata.normalize("NFC", texts["test"])
    ids = hf_tokenizer.encode(text, add_special_tokens=False).ids
    assert hf_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert ids.count(ENDOFTEXT_ID) == text.count(corpus.SEPARATOR)
    assert len(ids) / len(text.encode("utf-8")) < MAX_TEST_TOKENS_PER_BYTE


def test_any_text_encodes_to_its_exact_bytes() -> None:
    tokenizer = Tokenizer.from_files((TOKENIZER_DIR / "tokenizer.json").read_bytes())
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(0x300)] + list("我们日本語한국어👍🏽👩‍👧\u200d\ufeff\U0010fffd")
    samples = ["".join(rng.choice(alphabet) for _ in range(200)) for _ in range(50)]
    samples.append("".join(chr(b) for b in range(256)))
    for sample in [unicodedata.normalize("NFC", sample) for sample in samples]:
        ids = tokenizer.encode(sample, special=False)
        assert all(0 <= i < BPE_SIZE for i in ids)
        assert b"".join(tokenizer.token_bytes(i) for i in ids) == sample.encode("utf-8")
        assert tokenizer.decode(ids) == sample


def test_chat_template_renders_a_user_turn_to_the_expected_ids() -> None:
    tokenizer = Tokenizer.from_files(
        (TOKENIZER_DIR / "tokenizer.json").read_bytes(),
        (TOKENIZER_DIR / "tokenizer_config.json").read_bytes(),
        (TOKENIZER_DIR / "generation_config.json").read_bytes(),
    )
    template = ChatTemplate((TOKENIZER_DIR / "chat_template.jinja").read_text(encoding="utf-8"))
    prompt = template.render([{"role": "user", "content": "What does os.path.join do?"}])
    assert prompt == "<|im_start|>user\nWhat does os.path.join do?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    im_start, think = BPE_SIZE + 1, BPE_SIZE + QWEN3_5_SPECIAL_TOKENS.index("<think>")

    def plain(text: str) -> list[int]:
        return tokenizer.encode(text, special=False)

    assert plain("\n") == [tokenizer.token_id("Ċ")]  # the byte symbol of "\n"
    expected = [
        im_start,
        *plain("user\nWhat does os.path.join do?"),
        IM_END_ID,
        *plain("\n"),
        im_start,
        *plain("assistant\n"),
        think,
        *plain("\n"),
    ]
    assert tokenizer.encode(prompt) == expected
    assert tokenizer.eos_ids == [IM_END_ID, ENDOFTEXT_ID]
    assert tokenizer.pad_id == ENDOFTEXT_ID
    assert (tokenizer.vocab_size, tokenizer.im_start_id, tokenizer.im_end_id, tokenizer.think_start_id) == (
        4096,
        im_start,
        IM_END_ID,
        think,
    )
    assert IM_END_ID in tokenizer.special_ids and think not in tokenizer.special_ids


def test_committed_tokenizer_is_what_training_on_the_train_split_gives(texts: dict[str, str]) -> None:
    trained = train_tokenizer.train(corpus.documents(texts["train"]), show_progress=False)
    files = frontend_files(trained, BPE_SIZE)
    for name, data in files.items():
        assert data == (TOKENIZER_DIR / name).read_bytes(), name
