"""Every Triton kernel compiles for the H200 (sm_90) and for an older GPU without FP8 hardware (sm_80), without a
GPU: `python -m ninfer.kernels.compile_check` records each wrapper's launch and runs triton's compiler (ptxas ships
with triton). The interpreter-based tests cannot catch code that only the compiler rejects. On sm_90 every kernel
is compiled with programmatic dependent launch (ninfer.kernels.dependent_launch), on sm_80 without."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ["_gemv_kernel", "_gemv_batch_kernel", "_gemv_batch_pair_kernel", "_dequantize_kernel", "_fp8_gemv_kernel",
           "_add_rms_norm_kernel", "_silu_mul_kernel", "_sigmoid_mul_kernel", "_route_top_k_kernel",
           "_moe_combine_kernel", "_conv_kernel", "_gated_delta_decode_kernel", "_gated_norm_kernel",
           "_qk_norm_rope_kernel", "_write_kv_kernel", "_paged_decode_kernel", "_merge_splits_kernel",
           "_quantize_kernel", "_dense_gemv_kernel", "_stripe_kernel", "_dequantize_stripes_kernel",
           "_quantize_tiles_kernel"]


# what a layout conversion or a spill puts in a loop: shuffles, shared memory, local memory
CONVERSION_OPCODES = {"SHFL", "LDS", "STS", "LDSM", "STSM", "LDL", "STL", "BAR"}


def test_every_kernel_compiles_for_sm90_and_sm80():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "ninfer.kernels.compile_check", "--targets", "90,80",
                             "--resources", "--opcodes"], capture_output=True, text=True, env=env, cwd=ROOT,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    compiled = set(re.findall(r"^sm_(\d+) ok\s+(\w+)\(", result.stdout, re.MULTILINE))
    for capability in ("90", "80"):
        missing = [k for k in KERNELS if (capability, k) not in compiled]
        assert not missing, f"not compiled for sm_{capability}: {missing}"
    # programmatic dependent launch (griddepcontrol) is compiled in for sm_90 only
    for capability, pdl in (("90", "True"), ("80", "False")):
        lines = re.findall(rf"^sm_{capability} ok\s+\w+\(.*\)", result.stdout, re.MULTILINE)
        assert lines and all(f"PDL={pdl}" in line for line in lines), f"sm_{capability} without PDL={pdl}"
    assert re.search(r"\b0 failed$", result.stdout.strip())
    # the batch GEMV keeps its tiles in the layout they are loaded in (lanes over the 32-lane blocks): no spill and
    # no data exchanged between lanes in its K loop, with the Triton installed here (the placement of the blocks
    # axis depends on the version: quant_gemv_kernels.BLOCKS_FIRST)
    batch = re.findall(r"^sm_\d+ ok\s+(_gemv_batch(?:_pair)?_kernel\(.*\))\s+\[registers \d+, stack (\d+), "
                       r"shared \d+\], loop \d+ instructions (\{.*?\})(?:, \d+ loads before the PDL wait)?$",
                       result.stdout, re.MULTILINE)
    assert len(batch) >= 2 * 10, result.stdout[-3000:]
    for label, stack, opcodes in batch:
        exchanged = CONVERSION_OPCODES & set(ast.literal_eval(opcodes))
        assert stack == "0" and not exchanged, f"{label}: stack {stack}, {sorted(exchanged)} in the loop"
    # on sm_90 the batch GEMV's first weight tiles are issued before its PDL wait (a measured gain at batch 1);
    # ptxas decides that, not the source order
    early = re.findall(r"^sm_90 ok\s+(_gemv_batch(?:_pair)?_kernel\(.*\)).*, (\d+) loads before the PDL wait$",
                       result.stdout, re.MULTILINE)
    assert len(early) >= 10 and all(int(count) > 0 for _, count in early), early
    # the stripe GEMV: at one token exactly its first group's three loads before the wait (faster at batch 1), for
    # tiles none (all DEPTH groups early measured slower at batch 1 and 8)
    stripes = dict(re.findall(r"^sm_90 ok\s+_stripe_kernel\(.*ONE_TOKEN=(\w+).*, (\d+) loads before the PDL wait$",
                              result.stdout, re.MULTILINE))
    assert stripes == {"True": "3", "False": "0"}, stripes


def _listing(instructions: list[tuple[str, int, int]]) -> list[str]:
    """An `nvdisasm -c -hex` listing of one loop: (instruction, write scoreboard or 7, wait mask) each, the
    control bits where sm_70+ encodings keep them (high 64 bits: write scoreboard at 46, wait mask at 52)."""
    lines = [".L_x_0:"]
    for offset, (text, board, mask) in enumerate(instructions):
        high = board << 46 | 7 << 49 | mask << 52
        lines += [f"        /*{16 * offset:04x}*/                   {text} ;        /* 0x0000000000000000 */",
                  f"                                                                /* 0x{high:016x} */"]
    return lines


def test_scoreboard_waits_names_every_load_a_wait_covers():
    from ninfer.kernels.compile_check import scoreboard_waits

    loop = [("LOP3.LUT R9, R4, 0xff, RZ, 0x3c, !PT", 7, 0b100000),  # waits on SB5: the turn before's weight load
            ("LDG.E.128 R4, desc[UR4][R20.64]", 5, 0),
            ("LDG.E.64 R10, desc[UR4][R22.64+0x20]", 1, 0),
            ("IADD3 R1, R1, 0x1, RZ", 7, 0),
            ("LDG.E.U16.CONSTANT R12, desc[UR4][R24.64]", 1, 0),
            ("IMAD R13, R11, R2, 0x4b400000", 7, 0b000010),  # reads R11 only, waits for R12's load as well
            ("@!P0 BRA `(.L_x_0)", 7, 0)]
    waits = [re.match(r"\+(\d+)\s+SB(\d) (.+?)\s+waits for: (.*)$", line).groups()
             for line in scoreboard_waits(_listing(loop))]
    assert waits == [("0", "5", "LOP3.LUT R9, R4, 0xff, RZ, 0x3c, !PT", "LDG.E.128 R4 6 back"),
                     ("5", "1", "IMAD R13, R11, R2, 0x4b400000",
                      "LDG.E.64 R10 3 back, LDG.E.U16.CONSTANT R12 1 back")]
    with pytest.raises(ValueError, match="-hex"):
        scoreboard_waits([line for line in _listing(loop) if not line.strip().startswith("/* 0x")])


def test_loads_before_the_pdl_wait_are_counted_from_the_listing():
    from ninfer.kernels.compile_check import loads_before_wait

    kernel = [("LDG.E.128.CONSTANT R4, desc[UR4][R20.64]", 7, 0), ("@!P0 LDG.E R10, desc[UR4][R22.64]", 7, 0),
              ("IADD3 R1, R1, 0x1, RZ", 7, 0), ("ACQBULK", 7, 0), ("LDG.E R12, desc[UR4][R24.64]", 7, 0)]
    assert loads_before_wait(_listing(kernel)) == 2
    assert loads_before_wait(_listing([kernel[3], *kernel[:3]])) == 0
    assert loads_before_wait(_listing(kernel[:3])) is None  # no PDL wait at all
