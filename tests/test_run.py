"""`ninfer.LLM` and `ninfer run`: streaming, stops, seeds, the embedded default model and clean errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import ninfer
from ninfer.cli import main
from ninfer.engine.llm import DEFAULT_ARTIFACT, LLM, Finished
from ninfer.frontend import ContentDelta, ReasoningDelta
from ninfer.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


def _manual_greedy(llm: LLM, ids: list[int], count: int) -> list[int]:
    with torch.no_grad():
        state = llm.model.new_state(len(ids) + count)
        logits = llm.model.prefill(torch.tensor(ids), state)
        out = []
        for _ in range(count):
            out.append(int(torch.argmax(logits[: llm.tokenizer.vocab_size])))
            logits = llm.model.prefill(torch.tensor(out[-1:]), state)
    return out


def test_embedded_default_writes_corpus_style_text(llm):
    """The embedded default is the small model trained on the CPython standard library (docs/quality.md)."""
    completion = llm.generate("import os\nimport sys\n\n\ndef ", SamplingParams(temperature=0.0, max_tokens=48),
                              raw=True)
    assert completion.finish_reason == "length"
    text = completion.text
    assert "(" in text and ")" in text and ":" in text  # Python, not noise


def test_embedded_default_generates_like_a_manual_greedy_loop(llm):
    assert llm.path == DEFAULT_ARTIFACT and DEFAULT_ARTIFACT.is_file()
    completion = llm.generate("Hello", GREEDY)
    ids = llm.prompt_ids("Hello")
    assert completion.token_ids == _manual_greedy(llm, ids, 16)
    assert completion.finish_reason == "length"
    assert completion.stats.prompt_tokens == len(ids) and completion.stats.generated_tokens == 16
    # thinking on: the embedded model, taught chats, closes an empty reasoning block and answers in the content
    assert completion.text and not completion.reasoning
    assert ninfer.LLM is LLM


def test_padding_rows_of_the_embedding_are_never_sampled(tmp_path):
    from ninfer.convert.synth import synth_artifact

    synth_artifact("tiny-dense", "q8", tmp_path / "tiny.ninfer", quiet=True)  # random weights, 31 padding rows
    llm = LLM(tmp_path / "tiny.ninfer")
    assert llm.model.config.vocab > llm.tokenizer.vocab_size
    for seed in range(4):
        params = SamplingParams(temperature=1.5, seed=seed, max_tokens=64, ignore_eos=True)
        assert max(llm.generate("Hello", params).token_ids) < llm.tokenizer.vocab_size


def test_stream_events_concatenate_to_the_completion(llm):
    events = list(llm.stream("Hi there", GREEDY, thinking=False))
    assert isinstance(events[-1], Finished)
    completion = events[-1].completion
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == completion.text
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == completion.reasoning


def test_raw_and_id_prompts(llm):
    text = "<|im_start|>user\nhey<|im_end|>\n"
    ids = llm.tokenizer.encode(text)
    by_text = llm.generate(text, GREEDY, raw=True)
    by_ids = llm.generate(ids, GREEDY)
    assert by_text.token_ids == by_ids.token_ids == _manual_greedy(llm, ids, 16)


def test_stop_string_cuts_the_text_and_stop_ids_end_generation(llm):
    ids = llm.tokenizer.encode("abc")
    free = llm.generate(ids, GREEDY)
    assert free.finish_reason == "length"
    stop_token = free.token_ids[5]
    cut = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                           stop_token_ids=(stop_token,)))
    assert cut.finish_reason == "stop"
    assert cut.token_ids == free.token_ids[: free.token_ids.index(stop_token)]


def test_seed_reproduces_and_changes_samples(llm):
    def sample(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, top_k=50, seed=seed, max_tokens=24, ignore_eos=True)
        return llm.generate("Hello", params).token_ids

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_prompt_longer_than_the_context_is_refused():
    small = LLM(max_context=8)
    with pytest.raises(ninfer.engine.llm.PromptTooLongError, match="context holds 8"):
        small.generate("a fairly long prompt for eight positions", GREEDY)


def test_generation_stops_at_the_context_limit():
    small = LLM(max_context=40)
    ids = list(range(100, 130))
    completion = small.generate(ids, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    assert completion.finish_reason == "length" and len(ids) + len(completion.token_ids) == 40


def test_cli_run_prints_text_ids_and_stats(capsys, llm):
    assert main(["run", "--prompt", "Hello", "--greedy", "--max-new", "8", "--print-token-ids", "--no-thinking"]) == 0
    out, err = capsys.readouterr()
    ids_line = out.rstrip("\n").splitlines()[-1]
    ids = [int(t) for t in ids_line.split(",")]
    expected = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=8), thinking=False)
    assert ids == expected.token_ids
    assert "prompt" in err and "tok/s" in err and "finish" in err


def test_cli_messages_file_and_prompt_ids(tmp_path, capsys, llm):
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    messages = tmp_path / "chat.json"
    messages.write_text(json.dumps(chat))
    assert main(["run", "--messages", str(messages), "--greedy", "--max-new", "4", "--print-token-ids"]) == 0
    prompt_tokens = len(llm.prompt_ids(chat["messages"], tools=chat["tools"]))
    assert f"prompt {prompt_tokens} tokens" in capsys.readouterr().err
    assert main(["run", "--prompt-ids", "257,104,105", "--greedy", "--max-new", "4", "--print-token-ids"]) == 0
    out, err = capsys.readouterr()
    expected = llm.generate([257, 104, 105], SamplingParams(temperature=0.0, max_tokens=4)).token_ids
    assert out.rstrip("\n").splitlines()[-1] == ",".join(map(str, expected)) and "prompt 3 tokens" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["run", "missing.ninfer", "--prompt", "x"], "no such file"),
    (["run", "--prompt", "x", "--top-p", "2"], "top_p"),
    (["run", "--prompt", "x", "--temperature", "-1"], "temperature"),
    (["run", "--prompt", "x", "--max-context", "4"], "context holds 4"),
    (["run", "--prompt-ids", "1,2,99999", "--greedy"], "token ids must lie in"),
    (["run", "--prompt", "x", "--device", "tpu"], "unknown device"),
])
def test_cli_errors_are_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


IMAGE_PARTS = [
    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},  # OpenAI
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}},  # Anthropic
]


@pytest.mark.parametrize("part", IMAGE_PARTS)
def test_an_image_part_is_refused_not_dropped(tmp_path, capsys, llm, part):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    with pytest.raises(ValueError, match=r"messages\[1\]\.content\[1\]: images are not supported yet"):
        llm.generate(messages, GREEDY)
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"messages": messages}))
    assert main(["run", "--messages", str(chat), "--max-new", "4"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "images are not supported yet" in err
    text_only = [messages[0], {"role": "user", "content": [{"type": "text", "text": "What is this?"}]}]
    assert llm.generate(text_only, GREEDY).token_ids  # text parts still pass


def test_cli_rejects_a_file_that_is_not_an_artifact(tmp_path, capsys):
    bogus = tmp_path / "notes.ninfer"
    bogus.write_text("hello")
    assert main(["run", str(bogus), "--prompt", "x"]) == 2
    assert "not a .ninfer file" in capsys.readouterr().err


def test_bad_flag_values_exit_2_from_argparse():
    result = subprocess.run([sys.executable, "-m", "ninfer", "run", "--prompt", "x", "--max-new", "0"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "must be positive" in result.stderr and "Traceback" not in result.stderr
