"""What the device scripts share to time a kernel against the memory limit: the read bandwidth measured now (a
reduction over 1 GiB, median of triton's `do_bench`), and copies of a matrix to rotate through so that the 50 MiB
L2 never holds the one a call reads; and the fast path on a 4-layer slice of a preset, for the step profiles."""

import torch
import triton

from ninfer.artifact.reader import Artifact
from ninfer.convert.synth import synth_artifact
from ninfer.fast.runner import FastQwen35
from ninfer.kernels.gdn_decode import gated_delta_decode


def read_bandwidth() -> float:
    """Bytes per second of a 1 GiB fp32 reduction on the current CUDA device, printed in TB/s as well."""
    buffer = torch.ones(1 << 28, device="cuda")
    bandwidth = buffer.numel() * 4 / (triton.testing.do_bench(buffer.sum, return_mode="median") / 1e3)
    print(f"read bandwidth {bandwidth / 1e12:.2f} TB/s")
    return bandwidth


def rotating_copies(data: torch.Tensor, at_most: int = 63) -> list[torch.Tensor]:
    """`data` and up to `at_most` clones of it, about 256 MiB in all (far past L2)."""
    return [data, *(data.clone() for _ in range(min(at_most, (256 << 20) // data.numel())))]


SPIN_CYCLES = 200_000  # about 100 µs at the H200's clock


class DeltaRule27B:
    """`gated_delta_decode` (conv + delta rule, gated norm) at qwen3.8-27b's Gated DeltaNet shapes, its per-layer
    tensors seeded: pools of POOL_SLOTS conv windows and states (fp32, or `state_dtype`), the conv weight, a_log,
    dt_bias, the norm weight."""

    K_HEADS, K_DIM, V_HEADS, V_DIM = 16, 128, 48, 128
    POOL_SLOTS = 17  # B sequences take slots 2, 4, … (mod 17)

    def __init__(self, state_dtype: torch.dtype = torch.float32):
        torch.manual_seed(0)
        self.state = (torch.randn(self.POOL_SLOTS, self.V_HEADS, self.K_DIM, self.V_DIM, device="cuda") * 0.01).to(
            state_dtype)
        channels = 2 * self.K_HEADS * self.K_DIM + self.V_HEADS * self.V_DIM
        self.conv_weight = torch.randn(channels, 4, device="cuda", dtype=torch.bfloat16) * 0.5
        self.conv_state = torch.randn(self.POOL_SLOTS, channels, 3, device="cuda", dtype=torch.bfloat16)
        self.a_log = torch.randn(self.V_HEADS, device="cuda")
        self.dt_bias = torch.randn(self.V_HEADS, device="cuda")
        self.norm_weight = torch.randn(self.V_DIM, device="cuda", dtype=torch.bfloat16)

    def inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        """One step's inputs for `batch` sequences: the conv input (q | k | v), z, a | b, and the pool slots."""
        return (torch.randn(batch, 2 * self.K_HEADS * self.K_DIM + self.V_HEADS * self.V_DIM, device="cuda",
                            dtype=torch.bfloat16),
                torch.randn(batch, self.V_HEADS * self.V_DIM, device="cuda", dtype=torch.bfloat16),
                torch.randn(batch, 2 * self.V_HEADS, device="cuda", dtype=torch.bfloat16),
                torch.arange(1, batch + 1, device="cuda", dtype=torch.int32) * 2 % self.POOL_SLOTS)

    def __call__(self, inputs: tuple[torch.Tensor, ...], state: torch.Tensor | None = None,
                 conv_state: torch.Tensor | None = None, quantize: bool = False):
        """One step on the given pools (by default the seeded ones, which it moves on)."""
        x, z, a_b, slots = inputs
        return gated_delta_decode(x, z, a_b, self.conv_weight, self.conv_state if conv_state is None else conv_state,
                                  self.a_log, self.dt_bias, self.norm_weight, self.state if state is None else state,
                                  slots, self.K_HEADS, self.K_DIM, self.V_HEADS, self.V_DIM, 1e-6, quantize=quantize)


def l2_flush():
    """A function that evicts the 50 MiB L2 (a reduction over 512 MiB)."""
    buffer, out = torch.ones(1 << 27, device="cuda"), torch.empty((), device="cuda")
    return lambda: torch.sum(buffer, dim=0, out=out)


def median_replay_us(setup, call, repeats: int = 40) -> float:
    """Median µs of `call` between CUDA events, `setup()` queued before each (not timed)."""
    times = []
    for _ in range(repeats):
        setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def captured(run) -> torch.cuda.CUDAGraph:
    """`run()` (run once before, so that its kernels are compiled) captured as a CUDA graph on a side stream."""
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        run()
    torch.cuda.synchronize()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, replays: int = 20, warm: int = 3) -> float:
    """Mean µs of a replay of `graph` over `replays` back to back between CUDA events, after `warm` untimed."""
    for _ in range(warm):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def slice_model(preset: str, max_context: int, device: str = "cuda") -> FastQwen35:
    """The fast path on the first 4 layers of `preset`'s synthetic q4 artifact (/tmp/PRESET-slice.ninfer): the
    kernels of a step at the real widths, with room for 8 sequences of `max_context` tokens."""
    path = f"/tmp/{preset}-slice.ninfer"
    synth_artifact(preset, "q4", path, quiet=True, layers=4, device=device)
    with Artifact.open(path) as artifact:
        return FastQwen35.from_artifact(artifact, device, max_sequences=8, max_context=max_context)
