"""When the fast path's kernels launch with programmatic dependent launch (ninfer.kernels.dependent_launch): CUDA
devices of compute capability 9.0 and newer only, never under the Triton interpreter, on ROCm or with NINFER_PDL=0.
(That the kernels compile with it for sm_90 and without it for sm_80 is tests/kernels/test_compile.py's check;
that graph replay and long generations stay exact with it is tests/model/test_qwen3_5_packed_gpu.py's, on the GPU.)"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels import dependent_launch


@pytest.fixture
def capability(monkeypatch):
    """A pretend CUDA device of the capability the test sets; the interpreter switched off for the rule under test."""
    found = {"value": (9, 0)}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("NINFER_PDL", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: found["value"])
    monkeypatch.setattr(torch.version, "hip", None)
    dependent_launch.pdl_supported.cache_clear()
    yield found
    dependent_launch.pdl_supported.cache_clear()


@pytest.mark.parametrize(("value", "expected"), [((9, 0), True), ((10, 0), True), ((12, 0), True), ((8, 9), False),
                                                 ((8, 0), False)])
def test_pdl_from_compute_capability_9_0(capability, value, expected):
    capability["value"] = value
    assert dependent_launch.launch_options(torch.device("cuda", 0)) == {"PDL": expected, "launch_pdl": expected,
                                                                         "enable_fp_fusion": True}


def test_no_pdl_off_cuda_under_the_interpreter_on_rocm_or_when_switched_off(capability, monkeypatch):
    assert dependent_launch.pdl_supported(torch.device("cpu")) is False
    for variable, value in (("NINFER_PDL", "0"), ("TRITON_INTERPRET", "1")):
        with monkeypatch.context() as patch:
            patch.setenv(variable, value)
            dependent_launch.pdl_supported.cache_clear()
            assert dependent_launch.pdl_supported(torch.device("cuda", 0)) is False, variable
    monkeypatch.setattr(torch.version, "hip", "6.2")
    dependent_launch.pdl_supported.cache_clear()
    assert dependent_launch.pdl_supported(torch.device("cuda", 0)) is False
