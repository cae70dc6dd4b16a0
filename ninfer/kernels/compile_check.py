"""Compile every Triton kernel of ninfer for NVIDIA targets without a GPU: the wrappers are called with small CPU
tensors while each kernel's launch is intercepted, and the recorded arguments become the kernel's signature for
`triton.compile` at each target (ptxas ships with triton). Each target's launches are recorded with the launch
choices of its architecture (`kernels.tuning`). Catches what the interpreter cannot: code the compiler rejects
(unsigned/negative shifts, statements after a return in a constexpr branch, unsupported types on an older
architecture). Prints one line per kernel and target; exits 1 when any fails.

Usage: python -m ninfer.kernels.compile_check [--targets 90,80] [--resources] [--opcodes] [--waits] [--only REGEX]
       [--set K=V,…] [--traceback]
(TRITON_INTERPRET must be unset)
`--resources` adds each kernel's registers, spill stack and shared memory per thread block (cuobjdump), the
length of its longest loop and the loads it issues before its PDL wait (nvdisasm): the first things to look at
when a kernel is slower than its memory traffic predicts; `--opcodes` adds that loop's instruction count per
opcode; `--waits` lists, below each kernel, the loop's waits on a load (`scoreboard_waits`): where a load's value
is waited for, and which other loads the same wait covers, which is how a load meant for a later turn ends up
waited for in this one; `--only` compiles the launches whose label (name and constants) matches; `--set` overrides
integer constants of the launches that have them (e.g. `DEPTH=1,CHAIN=8`: a variant the recorded wrapper calls do
not pick); `--traceback` prints each failure's traceback. The registers and the schedule depend on the Triton
version: to read what the GPU machine runs, put that version first on PYTHONPATH (`pip install --target DIR
triton==3.6.0`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from typing import NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ninfer import flags
from ninfer.kernels import (
    activation_quant,
    dense_linear,
    fp8_linear,
    fused,
    gdn_decode,
    paged_attention,
    quant_dequantize,
    quant_grouped,
    quant_linear,
    stripe_linear,
    tuning,
)
from ninfer.quant import codec_for

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "i8", torch.uint8: "u8",
         torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}
LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "enable_fp_fusion"}
# the modules whose wrappers launch the kernels (a kernel is intercepted where its wrapper looks it up)
LAUNCHING = (activation_quant, dense_linear, quant_linear, quant_grouped, quant_dequantize, fp8_linear, fused,
             gdn_decode, paged_attention, stripe_linear)


class Launch(NamedTuple):
    """A recorded launch: the kernel's name, the kernel, its arguments by parameter name, its launch options."""

    name: str
    kernel: triton.JITFunction
    values: dict
    options: dict


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the call instead of launching it."""

    def __init__(self, name: str, kernel: triton.JITFunction, launches: list[Launch]):
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            names = self.kernel.arg_names
            values = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
            options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
            self.launches.append(Launch(self.name, self.kernel, values, options))

        return record


@contextlib.contextmanager
def _intercepted(arch: tuple[int, int]) -> Iterator[list[Launch]]:
    """Within the block, every kernel launch of the LAUNCHING modules is recorded into the yielded list instead of
    run, and the wrappers take the launch choices of `arch`; both are restored afterwards."""
    launches: list[Launch] = []
    saved = [(tuning, "for_device", tuning.for_device)]
    for module in LAUNCHING:
        for name in dir(module):
            if name.startswith("_") and name.endswith("_kernel"):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, _Recorder(name, getattr(module, name), launches))
    tuning.for_device = lambda device: tuning.for_arch(arch)
    try:
        yield launches
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def record_launches(arch: tuple[int, int]) -> list[Launch]:
    """The launches the fast path's wrappers make on a GPU of compute capability `arch`, in the variants it uses
    (formats, T, gather, KV dtypes), recorded with small CPU tensors (no kernel runs)."""
    with _intercepted(arch) as launches:
        _call_wrappers()
    return launches


def _signature(kernel: triton.JITFunction, values: dict) -> tuple[dict, dict, dict]:
    """Triton's signature, constexprs and attributes for the recorded values, specialised as a launch would be:
    tensors and integers divisible by 16 are declared so (`tt.divisibility`), which decides vector loads, and
    integers equal to 1 become constants, which decides layouts (a unit stride makes a dimension contiguous)."""
    signature, constexprs, attrs = {}, {}, {}
    aligned = [["tt.divisibility", 16]]
    for index, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(index,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TYPES[value.dtype]
            attrs[(index,)] = aligned
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int) and value == 1:  # a launch makes an integer equal to 1 a constant (unit strides)
            signature[param.name] = "constexpr"
            constexprs[(index,)] = value
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = aligned
        else:
            signature[param.name] = "fp32"
    return signature, constexprs, attrs


def _call_wrappers() -> None:
    """Call every wrapper the fast path uses, in the variants it uses (formats, T, gather, KV dtypes)."""
    x = torch.randn(1, 512, dtype=torch.bfloat16)
    for fmt in ("q4_g64_fp16", "q5_g64_fp16", "q6_g64_fp16", "q8_g32_fp16"):
        data = codec_for(fmt).encode(torch.randn(64, 512))
        wide = codec_for(fmt).encode(torch.randn(64, 2048))
        for tokens in (1, 8):  # the batch route at K = 2048 (K tiles of 1,024 lanes), one and several tokens
            quant_linear.quant_linear_gemv(torch.randn(tokens, 2048), wide, (64, 2048), fmt, out_dtype=torch.bfloat16)
        quant_linear.quant_linear_gemv(x, data, (64, 512), fmt, out_dtype=torch.bfloat16)  # the token route
        quant_dequantize.dequantize(data, (64, 512), fmt, rows=torch.arange(4, dtype=torch.int32))
    for tokens in (1, 8):  # two matrices of one input in one launch (GDN q|k q4 and v|z q5)
        acts = activation_quant.quantize_activations(torch.randn(tokens, 2048))
        quant_linear.quant_linear_gemv_pair(
            acts, *((codec_for(fmt).encode(torch.randn(64, 2048)), (64, 2048), fmt, None)
                    for fmt in ("q4_g64_fp16", "q5_g64_fp16")))
    data = codec_for("q5_g64_fp16").encode(torch.randn(4 * 64, 512))
    quant_linear.quant_linear_gemv(x, data, (256, 512), "q5_g64_fp16", experts=torch.tensor([1, 3], dtype=torch.int32),
                                   expert_rows=64, x_per_slot=2, out_dtype=torch.bfloat16)
    ids = torch.randint(0, 4, (40,))
    quant_grouped.quant_linear_grouped(x.repeat(20, 1), data, (256, 512), "q5_g64_fp16", quant_grouped.group_pairs(
        ids, 4, 64), 40, 64, 2, 64)
    shape = (32, 2048)  # a q5 matrix kept as stripe chunks: one token, a tile of 8, its prefill decoding
    chunks = stripe_linear.repack(codec_for(stripe_linear.FORMAT).encode(torch.randn(shape)), shape)
    for tokens in (1, 8):
        stripe_linear.stripe_gemv(stripe_linear.quantize_tiles(torch.randn(tokens, shape[1], dtype=torch.bfloat16)),
                                  chunks, shape)
    stripe_linear.dequantize_stripes(chunks, shape)
    fp8 = codec_for(fp8_linear.FORMAT).encode(torch.randn(64, 512))
    fp8_linear.fp8_linear_gemv(x, fp8, (64, 512))
    fp8_linear.fp8_linear_gemv(x.repeat(4, 1), fp8, (64, 512))
    dense_linear.dense_linear_gemv(x.repeat(3, 1), torch.randn(40, 512, dtype=torch.bfloat16))
    dense_linear.dense_linear_gemv(x.repeat(3, 1), torch.randn(40, 512, dtype=torch.bfloat16), pairwise=True)
    h = torch.randn(2, 256, dtype=torch.bfloat16)
    fused.add_rms_norm(h, h, torch.randn(256, dtype=torch.bfloat16), 1e-6)
    fused.add_rms_norm(h, h, torch.randn(256, dtype=torch.bfloat16), 1e-6, quantize=True)
    wide = torch.randn(2, 5120, dtype=torch.bfloat16)  # a decode row spread over several programs
    fused.add_rms_norm(wide, wide, torch.randn(5120, dtype=torch.bfloat16), 1e-6, quantize=True)
    fused.silu_mul(torch.randn(2, 512, dtype=torch.bfloat16))
    fused.silu_mul(torch.randn(2, 512, dtype=torch.bfloat16), quantize=True)
    fused.silu_mul(torch.randn(2, 512, dtype=torch.bfloat16), quantize=True, tiles=True)
    fused.sigmoid_mul(h, h)
    fused.sigmoid_mul(h, h, quantize=True)
    fused.route_top_k(torch.randn(2, 257, dtype=torch.bfloat16), 256, 8)
    fused.moe_combine(torch.randn(16, 256, dtype=torch.bfloat16), torch.rand(2, 8, dtype=torch.bfloat16), h,
                      torch.randn(2, 1, dtype=torch.bfloat16))
    k_heads, k_dim, v_heads, v_dim = 2, 128, 4, 128
    channels = 2 * k_heads * k_dim + v_heads * v_dim
    slots, snapshots = torch.tensor([0, 1]), torch.tensor([[2, 3], [4, 5]])
    conv = (torch.randn(channels, 4), torch.zeros(6, channels, 3, dtype=torch.bfloat16))
    vectors = (torch.randn(v_heads), torch.randn(v_heads), torch.randn(v_dim, dtype=torch.bfloat16))
    state = torch.zeros(6, v_heads, k_dim, v_dim)
    for pool in (state, state.bfloat16()):  # a verify step of 2 × 2 tokens, on an fp32 and a bf16 state pool
        gdn_decode.gated_delta_decode(torch.randn(4, channels, dtype=torch.bfloat16),
                                      torch.randn(4, v_heads * v_dim, dtype=torch.bfloat16),
                                      torch.randn(4, 2 * v_heads, dtype=torch.bfloat16), *conv, *vectors, pool, slots,
                                      k_heads, k_dim, v_heads, v_dim, 1e-6, tokens=2, snapshot_slots=snapshots,
                                      quantize=True)
    gdn_decode.gated_delta_decode(torch.randn(8, channels, dtype=torch.bfloat16),  # batch 8
                                  torch.randn(8, v_heads * v_dim, dtype=torch.bfloat16),
                                  torch.randn(8, 2 * v_heads, dtype=torch.bfloat16), *conv, *vectors, state,
                                  torch.arange(6).repeat(2)[:8], k_heads, k_dim, v_heads, v_dim, 1e-6, quantize=True)
    gdn_decode.gated_delta_decode(torch.randn(1, channels, dtype=torch.bfloat16),  # a/b in the kernel (one row)
                                  torch.randn(1, v_heads * v_dim, dtype=torch.bfloat16),
                                  (torch.randn(1, 5120, dtype=torch.bfloat16),
                                   torch.randn(2 * v_heads, 5120, dtype=torch.bfloat16)), *conv, *vectors, state,
                                  slots[:1], k_heads, k_dim, v_heads, v_dim, 1e-6, quantize=True)
    heads, kv_heads, head_dim = 24, 4, 256
    query_key = torch.randn(2, (heads + kv_heads) * head_dim, dtype=torch.bfloat16)
    q, k = paged_attention.qk_norm_rope(query_key, torch.randn(head_dim), torch.randn(head_dim),
                                        torch.tensor([3, 9]), heads, kv_heads, head_dim, 64,
                                        torch.rand(32), 1e-6)
    q = torch.randn(2, heads, head_dim, dtype=torch.bfloat16)
    k = torch.randn(2, kv_heads, head_dim, dtype=torch.bfloat16)
    table, lengths = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), torch.tensor([70, 5], dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.int8, torch.float8_e4m3fn):
        pages = torch.zeros(5, 64, kv_heads, head_dim, dtype=dtype)
        scales = torch.zeros(5, 64, kv_heads, head_dim // 64, dtype=torch.float16) if dtype != torch.bfloat16 else None
        paged_attention.write_kv(k, k, pages, pages.clone(), scales, None if scales is None else scales.clone(), table,
                                 torch.tensor([69, 4]))
        for batch in (2, 1):  # one split per sequence, and several (with the merge kernel)
            paged_attention.paged_attention_decode(q[:batch], pages, pages.clone(), scales, None if scales is None
                                                   else scales.clone(), table[:batch], lengths[:batch], 0.0625,
                                                   max_length=8192)


def _resources(cubin: bytes) -> str:
    """REG, STACK and SHARED of a compiled kernel, from `cuobjdump -res-usage` (bundled with triton)."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        usage = subprocess.run([tool, "-res-usage", handle.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED):(\d+)", usage))
    return f"  [registers {found.get('REG', '?')}, stack {found.get('STACK', '?')}, shared {found.get('SHARED', '?')}]"


def _disassemble(cubin: bytes) -> list[str]:
    """`nvdisasm -c -hex` (bundled with triton) of a cubin: each instruction with the low 64 bits of its encoding on
    its line, and the high 64 bits (where the control bits are) on the next."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        return subprocess.run([tool, "-c", "-hex", handle.name], capture_output=True, text=True).stdout.splitlines()


# an instruction's line in an `nvdisasm -c` listing starts with its offset: "        /*0f80*/  @!P0 MOV.64 R1, R2 ;"
INSTRUCTION = r"\s*/\*[0-9a-f]{4}\*/"


def longest_loop(lines: list[str]) -> list[int]:
    """Indices into an `nvdisasm -c` listing of the instructions of its longest loop body: from the first
    instruction after a label to a backward branch to it."""
    labels = {line.strip().rstrip(":"): i for i, line in enumerate(lines) if re.match(r"\s*\.L_x_\d+:", line)}
    longest: list[int] = []
    for i, line in enumerate(lines):
        branch = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if branch and labels.get(branch.group(1), i) < i:
            body = [j for j in range(labels[branch.group(1)], i + 1) if re.match(INSTRUCTION, lines[j])]
            longest = max(longest, body, key=len)
    return longest


def _opcode(line: str) -> str:
    """An instruction line's opcode without its predicate and modifiers: "/*0f80*/  @!P0 MOV.64 R1, R2 ;" → MOV."""
    return re.sub(rf"^{INSTRUCTION}\s*(@!?U?P\w+\s+)?", "", line).split()[0].split(".")[0]


def _longest_loop(lines: list[str], opcodes: bool) -> str:
    """Instructions in the longest loop body of a kernel's listing (`_disassemble`): divided by the weights a thread
    handles per iteration, the instructions per weight that bound a GEMV. With `opcodes`, also their count per
    opcode (IDP, LOP3, …)."""
    longest = [lines[i] for i in longest_loop(lines)]
    text = f", loop {len(longest)} instructions"
    if opcodes:
        names = (_opcode(b) for b in longest)
        text += " " + str(dict(collections.Counter(names).most_common()))
    return text


def loads_before_wait(lines: list[str]) -> int | None:
    """Global loads (LDG) an `nvdisasm -c` listing issues before its first `griddepcontrol.wait` (SASS ACQBULK), or
    None without one: what a PDL kernel reads while the kernel before it finishes. ptxas may move the wait above
    loads that stand before it in the source (the stripe GEMV's non-coherent loads), so the source alone does not
    tell."""
    names = [_opcode(line) for line in lines if re.match(INSTRUCTION, line)]
    return names[: names.index("ACQBULK")].count("LDG") if "ACQBULK" in names else None


def scoreboard_waits(lines: list[str]) -> list[str]:
    """The waits on loads in the longest loop of an `nvdisasm -c -hex` listing. A load (LDG, LDS, LDL, LD) that
    reports to one of the warp's 6 scoreboards sets it; an instruction whose wait mask names a scoreboard waits for
    every load on it issued since the last wait on it, including loads it does not read. The control bits are
    bits 105-125 of the 128-bit instruction (the Volta-and-later layout described by Jia et al., "Dissecting the
    NVIDIA Volta GPU Architecture via Microbenchmarking", 2018): in the high 64 bits, the write scoreboard at bits
    46-48 (7: none) and the wait mask at 52-57. The loop runs twice (loads of the turn before count), and each
    wait of the second turn gives one line: its offset in the loop, scoreboard, instruction, and each load it
    covers with how many instructions back it was issued."""
    body = []
    for i in longest_loop(lines):
        encoding = re.search(r"/\* (0x[0-9a-f]{16}) \*/", lines[i + 1]) if i + 1 < len(lines) else None
        if encoding is None:
            raise ValueError("scoreboard_waits needs the listing of `nvdisasm -c -hex`")
        text = re.sub(rf"^{INSTRUCTION}\s*", "", lines[i]).split(";")[0].strip()
        body.append((text, int(encoding.group(1), 16)))
    pending: dict[int, list[tuple[int, str]]] = {board: [] for board in range(6)}
    report = []
    for turn in range(2):
        for k, (text, high) in enumerate(body):
            at = turn * len(body) + k
            mask = (high >> 52) & 0x3F
            for board in range(6):
                if mask >> board & 1 and pending[board]:
                    if turn == 1:
                        loads = ", ".join(f"{load} {at - issued} back" for issued, load in pending[board])
                        report.append(f"+{k:<4d} SB{board} {text[:44]:44s} waits for: {loads}")
                    pending[board] = []
            board = (high >> 46) & 7
            words = re.sub(r"^@!?U?P\w+\s+", "", text).split()  # the predicate off
            if board != 7 and re.fullmatch(r"LD[GSL]?(\..*)?", words[0]):
                pending[board].append((at, f"{words[0]} {words[1].rstrip(',')}"))
    return report


def main(argv: list[str] | None = None) -> int:
    if flags.triton_interpreted():
        sys.exit("unset TRITON_INTERPRET: the compile check compiles the kernels instead of interpreting them")
    parser = argparse.ArgumentParser(prog="python -m ninfer.kernels.compile_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="90,80", help="compute capabilities, comma-separated")
    parser.add_argument("--resources", action="store_true", help="print registers, stack and shared memory")
    parser.add_argument("--opcodes", action="store_true", help="with --resources: the longest loop's opcodes")
    parser.add_argument("--waits", action="store_true", help="the longest loop's waits on loads (scoreboard_waits)")
    parser.add_argument("--only", default="", help="compile the launches whose label matches this regex")
    parser.add_argument("--set", default="", help="K=V,…: integer constants to override where a launch has them")
    parser.add_argument("--traceback", action="store_true", help="print the traceback of each failure")
    args = parser.parse_args(argv)
    overrides = {key: int(value) for key, value in (item.split("=") for item in args.set.split(",") if item)}
    targets = [int(c) for c in args.targets.split(",")]
    failed = total = 0
    for capability in targets:
        target = GPUTarget("cuda", capability, 32)
        launches = record_launches(divmod(capability, 10))
        total += len(launches)
        for name, kernel, values, options in launches:
            values = values | {key: value for key, value in overrides.items() if key in values}
            if "PDL" in values:  # programmatic dependent launch where the target has it (sm_90+)
                values = values | {"PDL": capability >= 90}
            signature, constexprs, attrs = _signature(kernel, values)
            label = ", ".join(f"{k}={v}" for k, v in values.items() if (kernel.arg_names.index(k),) in constexprs)
            if not re.search(args.only, f"{name}({label})"):
                continue
            try:
                compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                          options={**options, "num_warps": options.get("num_warps", 4)})
                cubin = compiled.asm["cubin"]
                listing = _disassemble(cubin) if args.resources or args.waits else []
                extra = ""
                if args.resources:
                    early = loads_before_wait(listing)
                    extra = (_resources(cubin) + _longest_loop(listing, args.opcodes)
                             + ("" if early is None else f", {early} loads before the PDL wait"))
                print(f"sm_{capability} ok      {name}({label}){extra}")
                for wait in scoreboard_waits(listing) if args.waits else []:
                    print(f"    {wait}")
            except Exception as exc:  # report every failure, then exit 1
                failed += 1
                reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                print(f"sm_{capability} FAILED  {name}({label}): {reason}")
                if args.traceback:
                    traceback.print_exc()
    print(f"{total} launches on {len(targets)} targets, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
