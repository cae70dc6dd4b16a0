"""The command line refuses bad flags and paths at parse time, before any work: one line `ninfer CMD: error: ...`
on stderr, exit code 2, never a traceback. `serve --port 0` names the port it actually bound."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import httpx
import pytest

from ninfer.artifact.reader import Artifact
from ninfer.cli import main

SERVE_START_SECONDS = 60.0  # the server process: torch import, the demo model's load, uvicorn's start

# {dir}: an existing folder, {file}: an existing file, {missing}: a path that does not exist
BAD_FLAGS = [
    (["run", "--prompt", "x", "--max-new", "0"], "argument --max-new: '0' must be positive"),
    (["run", "--prompt", "x", "--temperature", "nan"], "argument --temperature: 'nan' is not a finite number"),
    (["run", "--prompt", "x", "--top-p", "inf"], "argument --top-p: 'inf' is not a finite number"),
    (["run", "--prompt", "x", "--top-k", "-1"], "top_k must be >= 0"),
    (["run", "--prompt", "x", "--seed", "99999999999999999999999"], "seed must be in [-2^63, 2^64 - 1]"),
    (["run", "--prompt", "x", "--max-context", "1"], "max_context 1 is too small"),
    (["run", "--prompt", "x", "--prefill-chunk", "-4"], "argument --prefill-chunk: '-4' must be positive"),
    (["run", "--prompt-ids", "1,-2"], "token ids are 0 or more"),
    (["run", "{dir}", "--prompt", "x"], "{dir}: is a directory, not a file"),
    (["run", "--messages", "{missing}"], "argument --messages: {missing}: no such file"),
    (["bench", "-p", "0"], "argument -p/--prompt-lengths: '0': give positive integers"),
    (["run", "--prompt", "x", "--draft-tokens", "9"], "argument --draft-tokens: '9' must be 1..8"),
    (["run", "--prompt", "x", "--draft-tokens", "2"], "draft_tokens (--draft-tokens) needs spec='mtp'"),
    (["serve", "--spec", "eagle"], "argument --spec: invalid choice: 'eagle'"),
    (["bench", "--acceptance", "1.5"], "argument --acceptance: '1.5' is not a probability"),
    (["bench", "--acceptance", "0.5"], "--acceptance needs --spec mtp"),
    (["bench", "-n", "many"], "argument -n/--new-tokens: 'many' is not an integer"),
    (["serve", "--port", "70000"], "argument --port: '70000' is not a port (0 to 65535"),
    (["serve", "--port", "-1"], "argument --port: '-1' is not a port"),
    (["serve", "--max-pending", "-1"], "argument --max-pending: '-1' must be 0 or more"),
    (["serve", "--queue-timeout", "-5"], "argument --queue-timeout: '-5' must be positive"),
    (["serve", "--queue-timeout", "nan"], "argument --queue-timeout: 'nan' is not a finite number"),
    (["serve", "--max-concurrency", "0"], "argument --max-concurrency: '0' must be positive"),
    (["serve", "--kv-capacity", "0"], "argument --kv-capacity: '0' must be positive"),
    (["serve", "--max-body-mib", "0"], "argument --max-body-mib: '0' must be positive"),
    (["serve", "--request-log-jsonl", "{missing}/log.jsonl"],
     "argument --request-log-jsonl: {missing}: no such folder"),
    (["serve", "--request-log-jsonl", "{dir}"], "{dir}: is a directory; give a file name"),
    (["serve", "--log-level", "chatty"], "argument --log-level: invalid choice: 'chatty'"),
    (["serve", "{dir}"], "argument model: {dir}: is a directory, not a file"),
    (["ppl", "{file}", "--text", "{file}", "--context", "0"], "argument --context: '0' must be positive"),
    (["ppl", "{file}", "--text", "{dir}"], "argument --text: {dir}: is a directory, not a file"),
    (["kl", "{missing}", "{file}", "--text", "{file}"], "argument reference: {missing}: no such file"),
    (["convert", "--model", "{file}", "--recipe", "q4", "--out", "{dir}/m.ninfer"], "{file}: not a folder"),
    (["convert", "--model", "{dir}", "--recipe", "q4", "--out", "{file}/m.ninfer"], "{file}: is a file, not a folder"),
    (["convert", "--model", "{dir}", "--recipe", "q4", "--tokenizer", "{missing}", "--out", "{dir}/m.ninfer"],
     "argument --tokenizer: {missing}: no such folder"),
    (["synth", "--preset", "tiny-dense", "--recipe", "q8", "--out", "{dir}/m.ninfer", "--part-size", "4096"],
     "argument --part-size: '4096' must be at least 4097"),
    (["synth", "--preset", "tiny-dense", "--recipe", "q8", "--out", "{dir}/m.ninfer", "--layers", "0"],
     "argument --layers: '0' must be positive"),
    (["inspect", "{dir}"], "argument file: {dir}: is a directory, not a file"),
    (["verify", "{missing}"], "argument file: {missing}: no such file"),
]


@pytest.mark.parametrize(("argv", "expected"), BAD_FLAGS, ids=[" ".join(argv[:1] + argv[-2:]) for argv, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                           expected: str) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "file.txt").write_text("some text\n")
    places = {"dir": str(tmp_path / "folder"), "file": str(tmp_path / "file.txt"), "missing": str(tmp_path / "nope")}
    assert main([arg.format(**places) for arg in argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"ninfer {argv[0]}: error: ") and expected.format(**places) in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "folder"]  # nothing written


def test_no_command_is_one_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert capsys.readouterr().err.splitlines() == ["ninfer: error: the following arguments are required: command"]


@pytest.mark.parametrize("command", ["convert", "synth"])
def test_an_existing_output_is_replaced_only_with_force(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        command: str) -> None:
    out = tmp_path / "m.ninfer"
    out.write_bytes(b"an earlier artifact")
    source = ["--model", str(tmp_path), "--recipe", "q4"] if command == "convert" else ["--preset", "tiny-dense",
                                                                                        "--recipe", "q8"]
    assert main([command, *source, "--out", str(out), "--quiet"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"ninfer {command}: error: {out} exists; pass --force to "
                                                    "replace it"]
    assert out.read_bytes() == b"an earlier artifact"
    if command == "synth":
        assert main([command, *source, "--out", str(out), "--quiet", "--force"]) == 0
        with Artifact.open(out) as artifact:
            assert artifact.directory.metadata["name"] == "tiny-dense-synth"


def _lines(stream: IO[str]) -> tuple[queue.Queue[str], threading.Thread]:
    """The lines of a text stream, read by a background thread that ends at the stream's end."""
    lines: queue.Queue[str] = queue.Queue()
    pump = threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True)
    pump.start()
    return lines, pump


def _line_matching(lines: queue.Queue[str], pattern: str, seen: list[str]) -> re.Match[str]:
    deadline = time.monotonic() + SERVE_START_SECONDS
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        seen.append(line)
        if match := re.search(pattern, line):
            return match
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(seen)}")


def test_serve_on_port_0_names_the_port_it_bound_and_logs_each_request() -> None:
    process = subprocess.Popen([sys.executable, "-m", "ninfer", "serve", "--port", "0", "--device", "cpu"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    lines, pump = _lines(process.stderr)
    seen: list[str] = []
    try:
        port = int(_line_matching(lines, r"listening on http://127\.0\.0\.1:(\d+)$", seen)[1])
        assert 0 < port <= 65535
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models/nope", timeout=10).status_code == 404
        _line_matching(lines, r"ninfer\.serve: GET /v1/models/nope 404 model_not_found \d+ ms$", seen)
    finally:
        process.terminate()
        process.wait(timeout=SERVE_START_SECONDS)
    pump.join(timeout=SERVE_START_SECONDS)
    while not lines.empty():
        seen.append(lines.get())
    text = "".join(seen)
    assert "/health" not in text  # at info level the health checks leave no line; uvicorn's access log is off
    assert "Traceback" not in text
