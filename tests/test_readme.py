"""The README's code blocks work as written: its setup commands are what CI runs, and every other block runs — the
shell ones as commands in a scratch folder (the example checkpoint beside them), the Python ones in order in one
process, the client ones against a loopback server over the embedded model at the port they name. Answers of the
embedded model to the README's chat requests carry text."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUP = ("python3 -m venv .venv", ". .venv/bin/activate", "pip install ")
PORT = "127.0.0.1:8080"  # where the README's client snippets expect `ninfer serve`


def code_blocks() -> list[tuple[str, str]]:
    """(language, code) of the README's fenced bash and python blocks, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(r"^```(bash|python)\n(.*?)^```", text, flags=re.S | re.M)


def commands(code: str) -> tuple[list[str], list[str]]:
    """(setup steps, the rest) of a shell block written as one `&&` chain."""
    steps = [step.strip() for step in code.strip().split(" && ")]
    setup = [s for s in steps if s.startswith(SETUP)]
    return setup, steps[len(setup):]


def test_the_setup_blocks_are_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    shell = [code for language, code in code_blocks() if language == "bash"]
    setups = [commands(code) for code in shell if commands(code)[0]]
    assert len(setups) == 2  # the two commands: run the demo, run the tests
    for setup, _ in setups:
        assert setup[:3] == ["python3 -m venv .venv", ". .venv/bin/activate", "pip install torch==2.13.0"]
        assert setup[3].startswith("pip install -e .") or setup[3] == "pip install -e '.[test]'"
    _, tests = setups[1]
    assert "pip install -q torch==2.13.0" in ci.replace("python -m ", "") and "-e '.[test]'" in ci
    for command in tests:
        assert command in ci, f"the README's test command {command!r} is not what .ci/run runs"


def test_the_blocks_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ninfer.engine import LLM
    from ninfer.engine.llm import DEFAULT_ARTIFACT
    from ninfer.serve.app import create_app
    from ninfer.serve.main import model_id_of
    from ninfer.serve.state import ServeConfig
    from tests.serve.support import Loopback

    engine = LLM().engine.start()
    server = Loopback(create_app(engine, ServeConfig(model_id=model_id_of(DEFAULT_ARTIFACT))))  # as `ninfer serve`
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    try:
        for language, code in code_blocks():
            if language == "bash":
                _, rest = commands(code)
                if any("pytest" in command for command in rest):
                    continue  # the test command: the test above checks it is CI's
                done = subprocess.run(" && ".join(rest), shell=True, cwd=tmp_path, env=env, capture_output=True,
                                      text=True, timeout=600)
                assert done.returncode == 0, f"{rest}\n{done.stderr[-2000:]}"
                if any(c.startswith("ninfer run") and "out/tiny" not in c for c in rest):
                    assert done.stdout.strip(), f"{rest} printed no answer"  # the demo answers a chat request
                continue
            namespace: dict = {"__name__": "__main__"}
            with contextlib.redirect_stdout(io.StringIO()) as printed:
                exec(compile(code.replace(PORT, server.url.removeprefix("http://")), "README.md", "exec"), namespace)
            assert printed.getvalue().strip()
            if "reply" in namespace:
                assert namespace["reply"].choices[0].message.content.strip()
            if "message" in namespace:
                assert namespace["message"].content[-1].text.strip()
            if "done" in namespace:
                assert namespace["done"].text.strip()
    finally:
        server.stop()
        engine.close()


def test_every_flag_of_run_serve_and_bench_is_in_the_readme() -> None:
    import argparse

    from ninfer.cli import build_parser

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("run", "serve", "bench"):  # each has a table of its flags
        for action in commands.choices[name]._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert re.search(rf"(?<![\w-]){flag}(?![\w-])", text), f"ninfer {name} {flag} is not in the README"
