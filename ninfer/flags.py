"""The environment switches of ninfer, each typed and documented once (the README's table lists them).

A switch reads its variable when `get()` is called, not at import, so a test or a launcher may set it late. A
variable that is unset or empty takes the switch's default; a value the switch cannot read raises `NinferError`
naming the variable and what it accepts. Code never reads `os.environ` for a NINFER_ variable itself.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ninfer.errors import NinferError

_TRUE = ("1", "true")
_FALSE = ("0", "false")


@dataclass(frozen=True)
class BoolSwitch:
    """A switch that is on or off: 1 / true or 0 / false (any case)."""

    name: str
    default: bool
    help: str

    def get(self) -> bool:
        value = os.environ.get(self.name, "").strip().lower()
        if not value:
            return self.default
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise NinferError(f"{self.name}={os.environ[self.name]!r}: expected one of 0, 1, false, true")


@dataclass(frozen=True)
class FloatSwitch:
    """A finite number, at least `minimum`."""

    name: str
    default: float
    help: str
    minimum: float = 0.0

    def get(self) -> float:
        text = os.environ.get(self.name, "").strip()
        if not text:
            return self.default
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < self.minimum:
            raise NinferError(f"{self.name}={os.environ[self.name]!r}: expected a number ≥ {self.minimum:g}")
        return value


PDL = BoolSwitch("NINFER_PDL", True, "Launch the decode step's Triton kernels with programmatic dependent launch "
                 "(CUDA, compute capability 9.0 and newer): each kernel is scheduled while the one before it "
                 "finishes. 0 launches them one after another.")
BRANCHES = BoolSwitch("NINFER_BRANCHES", True, "Capture the decode step's independent work (the GDN a/b projection, "
                      "the attention q/k, a MoE layer's shared expert, the L2 prefetches) in a second CUDA-graph "
                      "branch. 0 keeps the whole step on one stream.")
L2_PREFETCH_MIB = FloatSwitch("NINFER_L2_PREFETCH_MIB", 4.0, "MiB of the next matrices' first rows the second "
                              "graph branch streams into L2 while the small kernels between two GEMVs run. 0 turns "
                              "the prefetch off.")
STRIPES = BoolSwitch("NINFER_STRIPES", True, "Keep q5 matrices with long rows (K ≥ 8,192, rows a multiple of 16) "
                     "as stripe chunks for the int8 tensor-core GEMV (CUDA, compute capability 8.0 and newer). 0 "
                     "keeps every matrix in its artifact layout.")

ALL: tuple[BoolSwitch | FloatSwitch, ...] = (PDL, BRANCHES, L2_PREFETCH_MIB, STRIPES)

# Triton's own switch, read as Triton reads it (`triton.knobs.runtime.interpret`)
_TRITON_TRUE = ("1", "true", "on", "yes")


def triton_interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET set to 1, true, on or yes): kernels then run
    on the CPU, without inline PTX, and the kernels' tile choices are the interpreter's (`kernels.tuning`)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRITON_TRUE
