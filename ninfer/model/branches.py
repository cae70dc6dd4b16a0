"""A captured decode step's independent work as a second branch of its CUDA graph.

A decode step is one chain of launches, yet some of them do not depend on each other: the GDN layer's a/b
projection and its q|k GEMV only need the normed row, as does the v|z GEMV beside them; the step's block tables
and positions are first needed by its first attention layer; a MoE layer's shared expert does not wait for the
routing. In one stream each of these waits for the one before it; a small launch that cannot fill the GPU then
holds up everything behind it. `Branches.beside()` records such work on a second stream, forked from the main
stream at that point, and `join()` makes the main stream wait for everything recorded there; captured into a CUDA
graph, the two streams become two branches that the GPU runs at once (CUDA's stream capture with events: "Cross-
stream Dependencies and Events"). The kernels, their inputs and so their bits are the same as in one stream.

Only while a graph is being captured: eager steps (without graphs, and each graph's first run, which compiles its
kernels) stay on one stream, since every fork and join would cost the host a few microseconds of event calls per
layer. Off on the CPU, and with NINFER_BRANCHES=0.

Contract for callers: every tensor that branch work reads was made before the fork, every tensor it makes is
read on the main stream only after a `join()`, and each function that forks joins before it returns, so that a
buffer freed on either stream is never reused while the other may still use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ninfer import flags


class Branches:
    """A second stream for the independent work of a decode step on `device` (see the module docstring)."""

    def __init__(self, device: torch.device):
        enabled = device.type == "cuda" and flags.BRANCHES.get()
        self.side = torch.cuda.Stream(device) if enabled else None
        self.pending = False

    @property
    def active(self) -> bool:
        """Whether work put `beside()` now runs beside the main stream (a graph is being captured on it)."""
        return self.side is not None and torch.cuda.is_current_stream_capturing()

    @contextlib.contextmanager
    def beside(self, allowed: bool = True) -> Iterator[None]:
        """Launches made inside go to the second stream, after everything launched on the current stream so far;
        in place (on the current stream) when not `active` or not `allowed` (the caller's word that the work
        shares no scratch buffer with the main stream's work until the join)."""
        if not (allowed and self.active):
            yield
            return
        self.side.wait_stream(torch.cuda.current_stream(self.side.device))
        with torch.cuda.stream(self.side):
            yield
        self.pending = True

    def join(self) -> None:
        """The current stream waits for all work put beside so far (nothing when none is pending)."""
        if self.pending:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            self.pending = False
