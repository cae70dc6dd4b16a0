"""Programmatic dependent launch (PDL) for the fast path's Triton kernels, on NVIDIA sm_90 and newer.

A decode step is hundreds of short kernels in a row; without PDL each one starts only after the one before it has
finished, so every launch pays its start-up (scheduling its programs, their first loads) in series. With PDL
(`launch_pdl=True`), a kernel may be scheduled while the kernel before it still runs, and waits with
`griddepcontrol.wait` until that kernel — and through it every earlier one — has finished and its writes are
visible. The contract of every kernel launched with `launch_options`: it calls `wait_for_inputs(PDL)` before it
reads anything the kernel launched right before it may write and before it writes anything. Data no kernel writes
(packed weights, norm weights) may be loaded before it, which is how a GEMV streams its first weight tile while the
kernel before it finishes; so may data only earlier kernels write, since a launch starts only once every program of the
kernel before has passed its own wait, by when every earlier kernel has finished. A kernel that reads such data
early says which in its docstring, and its callers must not write it with a PDL kernel launched right before.
`wait_for_inputs` also lets the next kernel be scheduled at once. Kernels launched without PDL (torch's, cuBLAS)
keep the stream's full ordering on both sides. The method is NVIDIA's (CUDA programming guide,
"Programmatic Dependent Launch and Synchronization"; Triton exposes it as `launch_pdl` and
`tl.extra.cuda.gdc_wait` / `gdc_launch_dependents`). Off under the interpreter, on other backends and before sm_90:
there the kernels run as before.
"""

from __future__ import annotations

import functools

import torch

from ninfer import flags

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None


@functools.lru_cache
def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA (not ROCm) at compute capability 9.0 or newer, not under
    the Triton interpreter, and not switched off with NINFER_PDL=0."""
    if flags.triton_interpreted() or not flags.PDL.get():
        return False
    device = torch.device(device)
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (9, 0)


def launch_options(device: torch.device) -> dict[str, bool]:
    """The launch keywords of every fast-path kernel: its PDL constexpr and Triton's launch_pdl (the kernel follows
    the PDL contract above), and fused multiply-adds on. The kernels were tuned and their bits tested with them;
    Triton 3.9 warns that its default turns them off in 3.10, so the choice is explicit."""
    enabled = pdl_supported(device)
    return {"PDL": enabled, "launch_pdl": enabled, "enable_fp_fusion": True}


if triton is not None:

    @triton.jit
    def wait_for_inputs(PDL: tl.constexpr):
        """Wait until the kernels before this one have finished (their writes visible), then let the next kernel
        be scheduled; nothing without PDL."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
