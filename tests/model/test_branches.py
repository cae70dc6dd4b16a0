"""`Branches`: a captured step's independent work on a second stream (a second CUDA-graph branch), in place
everywhere else. The decode paths that use it are checked end to end by the runner's GPU tests (graph replay
against eager steps, which run on one stream)."""

from __future__ import annotations

import pytest
import torch

from ninfer.model.branches import Branches

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_on_the_cpu_work_beside_runs_in_place():
    branches = Branches(torch.device("cpu"))
    x = torch.arange(4.0)
    with branches.beside():
        y = x * 2
    branches.join()
    assert branches.side is None and not branches.active
    assert torch.equal(y, torch.tensor([0.0, 2.0, 4.0, 6.0]))


@pytest.mark.gpu
@cuda
def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("NINFER_BRANCHES", "0")
    assert Branches(torch.device("cuda")).side is None


def _step(branches: Branches, x: torch.Tensor, streams: list) -> torch.Tensor:
    """A two-branch step: a chain on the main stream and one beside it, joined at the end."""
    with branches.beside():
        streams.append(torch.cuda.current_stream())
        side = (x * 3).tanh()
    main = (x + 1).sin()
    branches.join()
    return main * side


@pytest.mark.gpu
@cuda
def test_a_captured_step_runs_its_side_work_on_a_second_stream_and_replays_like_eager_steps():
    branches = Branches(torch.device("cuda"))
    x = torch.randn(1 << 16, device="cuda")
    streams: list = []
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):  # outside a capture: in place, on the current stream
        eager = _step(branches, x, streams)
        assert streams[-1] == warm and not branches.pending
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(branches, x, streams)
        capture_stream = torch.cuda.current_stream()
    assert streams[-1] == branches.side and streams[-1] != capture_stream
    graph.replay()
    assert torch.equal(captured, eager)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(captured, _step(branches, x, streams))
