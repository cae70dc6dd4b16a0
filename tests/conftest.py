"""Test-session settings and the fixtures that several test folders share.

Where the Triton kernels run is chosen by the `gpu` marker alone. Triton fixes per process, when it is first imported,
whether it compiles for CUDA or runs its interpreter on the CPU: a run whose `-m` expression can select a `gpu`-marked
test (`pytest -m gpu`, `-m "gpu or not gpu"`) on a machine with CUDA compiles; every other run (the CPU suite:
pyproject's `-m 'not gpu'`, on any machine) interprets. A kernel test takes the `device` fixture: its unmarked
"interpreter" case runs in the CPU suite, its `gpu`-marked "cuda" case under `pytest -m gpu`. A `gpu`-marked test is
skipped where no CUDA device or no compiling Triton is at hand, so it needs no `skipif` of its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _pytest.mark.expression import Expression  # pytest's own `-m` evaluation; no public API exposes it

from ninfer.flags import triton_interpreted

GPU_MARKER = "gpu"
NO_CUDA_REASON = "needs a CUDA device and Triton compiling for it: run `pytest -m gpu` on the GPU machine"
COMPILING_REASON = "Triton compiles for CUDA in this run; the interpreter cases run in the CPU suite (no -m gpu)"


def _can_select_gpu_tests(markexpr: str) -> bool:
    """Whether `-m markexpr` selects a test marked `gpu` (with every other marker absent, or every one present)."""
    if not markexpr:
        return True
    expression = Expression.compile(markexpr)
    return any(expression.evaluate(lambda name, others=others, **_: name == GPU_MARKER or others)
               for others in (False, True))


def pytest_configure(config: pytest.Config) -> None:
    # before any test module imports triton (transformers and torch may import it early); an explicit
    # TRITON_INTERPRET from the environment wins
    if not torch.cuda.is_available() or not _can_select_gpu_tests(config.option.markexpr):
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available() and not triton_interpreted():
        return
    skip = pytest.mark.skip(reason=NO_CUDA_REASON)
    for item in items:
        if item.get_closest_marker(GPU_MARKER) is not None:
            item.add_marker(skip)


@pytest.fixture(params=[pytest.param("cpu", id="interpreter"),
                        pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")])
def device(request: pytest.FixtureRequest) -> torch.device:
    """Where a Triton kernel test runs: the CPU under the interpreter (the CPU suite), or CUDA (`pytest -m gpu`).
    A test that needs other cases (a dtype on CUDA only, say) parametrizes `device` indirectly with its own
    `pytest.param("cuda", ..., marks=pytest.mark.gpu)`."""
    if request.param == "cpu" and not triton_interpreted():
        pytest.skip(COMPILING_REASON)
    return torch.device(request.param)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, dict[str, torch.Tensor]]]:
    """`hf_checkpoint(spec)`: the folder and tensors of the tiny transformers checkpoint of a
    `tests.fixtures.hf_checkpoints.CheckpointSpec`, with the byte tokenizer's files, written once a session (per
    xdist worker). Shared: read it, never change it (copy the folder first)."""
    from ninfer.frontend.vocab import byte_tokenizer_files
    from tests.fixtures.hf_checkpoints import VOCAB_SIZE, write_checkpoint  # imports transformers: only when needed

    root = tmp_path_factory.mktemp("hf_checkpoints")
    written: dict = {}

    def checkpoint(spec) -> tuple[Path, dict[str, torch.Tensor]]:
        if spec not in written:
            folder = root / f"checkpoint-{len(written)}"
            written[spec] = (folder, write_checkpoint(folder, spec, byte_tokenizer_files(VOCAB_SIZE)))
        return written[spec]

    return checkpoint


@pytest.fixture(scope="session")
def synth_artifact_path(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """`synth_artifact_path(preset, recipe)`: the artifact `ninfer synth` makes of a preset (default seed), written
    once a session (per xdist worker). Shared: read it, never change it."""
    from ninfer.convert.synth import synth_artifact

    root = tmp_path_factory.mktemp("synth")
    written: dict[tuple[str, str], Path] = {}

    def artifact(preset: str, recipe: str) -> Path:
        if (preset, recipe) not in written:
            path = root / f"{preset}-{recipe}" / "model.ninfer"  # a folder each: its checksums and report beside it
            path.parent.mkdir()
            synth_artifact(preset, recipe, path, quiet=True)
            written[preset, recipe] = path
        return written[preset, recipe]

    return artifact
