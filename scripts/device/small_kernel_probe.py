"""What each small kernel of a decode step costs between two GEMVs, and how much of it is its int8 records.

Chains of STAGES stages as CUDA graphs under PDL, each stage a GEMV-like kernel B (8 KiB of weights a program,
9-11 MB a stage, the first half loaded before its wait, writing N bf16 values from the input it reads) followed by
one of the step's small kernels at the 27B's widths, which the next B reads:

  * `norm`: `fused.add_rms_norm` of a 5,120-wide row (B's output as the residual's delta), with or without its
    int8 records (`quantize`);
  * `swiglu`: `fused.silu_mul` of a 2 × 17,408 row, plain, with records, or with the stripe GEMV's tiles;
  * `normk SLICE:WARPS`: the norm's records launch with other program sizes (the same bits);
  * `tiles BLOCK:WARPS`: the tile variant's kernel launched with other program sizes (the same bits);
  * `alone`: B reading the previous B's output itself: the floor each chain is held against.

Prints µs a stage and each small kernel's cost (its chain's stage minus the floor at the same width).
Usage (GPU, from scripts/device): PYTHONPATH=$PWD/../.. python3 small_kernel_probe.py [STAGES]"""

import sys

import torch
import triton
import triton.language as tl
from device_timing import captured, replay_us

from ninfer.kernels.activation_quant import Int8Activations, empty_records
from ninfer.kernels.dependent_launch import launch_options
from ninfer.kernels.fused import _add_rms_norm_kernel, _silu_mul_kernel, add_rms_norm, silu_mul
from ninfer.kernels.stripe_linear import TileActivations, empty_tiles

STAGES = int(sys.argv[1]) if len(sys.argv) > 1 else 64
WEIGHT_BYTES = 12 << 20  # room for every B: programs × WORDS int32
WORDS = 2048  # a B program's weights (8 KiB)
REPLAYS = 20
HIDDEN, INTER = 5120, 17408


@triton.jit
def _b_kernel(w_ptr, x_ptr, X, out_ptr, N, WORDS: tl.constexpr, VALS: tl.constexpr):
    program = tl.program_id(0)
    HALF: tl.constexpr = WORDS // 2
    first = tl.load(w_ptr + program.to(tl.int64) * WORDS + tl.arange(0, HALF))
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    second = tl.load(w_ptr + program.to(tl.int64) * WORDS + HALF + tl.arange(0, HALF))
    cols = program * VALS + tl.arange(0, VALS)
    x = tl.load(x_ptr + cols % X).to(tl.float32)
    bias = tl.sum((first & 255) + (second & 255)).to(tl.float32) * 1e-9
    tl.store(out_ptr + cols, (x * 0.999 + bias).to(tl.bfloat16), mask=cols < N)


def _b(weights: torch.Tensor, x: torch.Tensor, n: int, vals: int) -> torch.Tensor:
    out = torch.empty((1, n), dtype=torch.bfloat16, device="cuda")
    programs = triton.cdiv(n, vals)
    _b_kernel[(programs,)](weights, x, x.numel(), out, n, WORDS=WORDS, VALS=vals, launch_pdl=True)
    return out


def _source(h) -> torch.Tensor:
    return h.source if isinstance(h, Int8Activations | TileActivations) else h


def chain(kind: str, weights: list[torch.Tensor], start: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    x = start
    if kind.startswith("normk"):  # "normk SLICE:WARPS": add_rms_norm's records launch with other programs
        slice_, warps = (int(v) for v in kind.split()[1].split(":"))
        residual = start
        for w in weights:
            delta = _b(w, x, HIDDEN, 4)
            total, x = torch.empty_like(residual), torch.empty_like(residual)
            records = empty_records(1, HIDDEN, x.device)
            _add_rms_norm_kernel[(1, triton.cdiv(HIDDEN, slice_))](
                residual, delta, norm_weight, total, x, records, HIDDEN, residual.stride(0), delta.stride(0),
                x.stride(0), 1e-6, records.shape[1], HAS_H=True, QUANTIZE=True, BLOCK=8192, SLICE=slice_,
                num_warps=warps, **launch_options(x.device))
            residual = total
    elif kind.startswith("norm"):
        residual = start
        for w in weights:
            delta = _b(w, x, HIDDEN, 4)
            residual, h = add_rms_norm(residual, delta, norm_weight, 1e-6, quantize=kind == "norm+records")
            x = _source(h)
    elif kind.startswith("tiles"):  # "tiles BLOCK:WARPS": silu_mul's tile launch with other programs (same bits)
        block, warps = (int(v) for v in kind.split()[1].split(":"))
        for w in weights:
            gate_up = _b(w, x, 2 * INTER, 32)
            x = torch.empty((1, INTER), dtype=torch.bfloat16, device="cuda")
            tiles = empty_tiles(1, INTER, x.device)
            _silu_mul_kernel[(1, triton.cdiv(INTER, block))](gate_up, x, tiles, INTER, gate_up.stride(0),
                                                             2 * tiles.shape[1], QUANTIZE=True, TILES=True,
                                                             BLOCK=block, num_warps=warps,
                                                             **launch_options(x.device))
    elif kind.startswith("swiglu"):
        for w in weights:
            gate_up = _b(w, x, 2 * INTER, 32)
            x = _source(silu_mul(gate_up, quantize=kind != "swiglu", tiles=kind == "swiglu+tiles"))
    else:
        n, vals = (HIDDEN, 4) if kind == "alone-5120" else (2 * INTER, 32)
        for w in weights:
            x = _b(w, x, n, vals)
    return x


def main() -> None:
    torch.manual_seed(0)
    weights = [torch.randint(0, 1 << 30, (WEIGHT_BYTES // 4,), dtype=torch.int32, device="cuda")
               for _ in range(STAGES)]
    norm_weight = torch.randn(HIDDEN, device="cuda").to(torch.bfloat16) * 0.1
    stage_us = {}
    kinds = ("alone-5120", "norm", "norm+records", "normk 1024:16", "normk 512:8", "normk 512:16", "normk 256:8",
             "alone-34816", "swiglu", "swiglu+records", "swiglu+tiles",
             "tiles 1024:8", "tiles 512:4", "tiles 256:2", "tiles 512:8", "tiles 256:4", "tiles 2048:8")
    for kind in kinds * 2:
        width = HIDDEN if kind.startswith(("alone-5120", "norm")) else 2 * INTER
        start = torch.randn(1, width, device="cuda").to(torch.bfloat16)
        chain(kind, weights, start, norm_weight)  # compile
        graph = captured(lambda k=kind, x=start: chain(k, weights, x, norm_weight))
        us = replay_us(graph, REPLAYS) / STAGES
        floor = stage_us.get("alone-5120" if width == HIDDEN else "alone-34816")
        stage_us[kind] = us
        extra = f", the small kernel {us - floor:5.2f} us" if floor is not None and not kind.startswith("alone") else ""
        print(f"{kind:15s}: {us:6.2f} us a stage{extra}", flush=True)


if __name__ == "__main__":
    main()
