"""`ninfer bench`: prefill and decode speed of an artifact, each as a fraction of the machine's own limit measured
in the same run.

Limits (METHOD: write the floor first):
  * read bandwidth — the time to reduce a large buffer (bytes read once; on CUDA several reductions back to back,
    READ_BURST) — bounds decode: a decode step must read every weight once, plus the KV rows and the recurrent
    state of each sequence;
  * matmul rate — a large square matmul in the compute dtype — bounds prefill: 2 FLOPs per weight per token
    plus the attention scores.
Decode fraction = (bytes read per step / measured bandwidth) / measured step time; prefill fraction =
(FLOPs / measured rate) / measured time. "Bytes read" counts the weight matrices as the model holds them (packed
on the fast path, decoded on the reference path) except the untied token embedding (a decode step reads B rows of
it), and of a MoE's routed experts only the expected share that B tokens × top-k choices touch; a batch decodes in
one `decode` step (the reference path runs its sequences one after another). On CUDA a batch's timed decode
steps follow its prompts' prefill and one warm-up step after an idle pause (DECODE_SETTLE_SECONDS).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ninfer.devices import synchronize
from ninfer.engine import LLM
from ninfer.errors import NinferError
from ninfer.kernels.dependent_launch import pdl_supported
from ninfer.model.config import FULL_ATTENTION
from ninfer.model.protocol import Model


@dataclass
class Limits:
    device: str
    read_bytes_per_second: float
    matmul_flops_per_second: float
    dtype: str


LIMIT_REPEATS = 21  # timed calls per limit (the median is reported)
# reductions per timing of the read bandwidth on CUDA: back to back, as a decode step's kernels read. One 1 GiB
# reduction alone, with the GPU idle around it, read 2-7 % lower and varied more from run to run (H200: 4.02-4.17
# against 4.29 TB/s in one process)
READ_BURST = 10
# idle seconds on CUDA between a batch's prompts and its timed decode steps. Decode timed right after a long
# prompt's prefill (which runs the tensor cores at full power) read slower than after an idle pause (27B at an
# 8,192-token context on the H200: 5.43-5.48 ms a step without the pause, 5.13 ms with it; the GPU's clocks after the
# prefill are the likely cause, not read)
DECODE_SETTLE_SECONDS = 1.0
DEFAULT_BENCH_DRAFTS = 3  # draft tokens of the benchmarked rounds when the configuration leaves K to the engine


@dataclass
class BenchReport:
    model: str
    limits: Limits
    weight_bytes: int
    runner: str = "reference"
    dependent_launch: bool = False  # the fast path's kernels launch with PDL (ninfer.kernels.dependent_launch)
    kv_dtype: str | None = None  # the fast path's KV pages and GDN state pool (`--kv-dtype`, `--state-dtype`)
    state_dtype: str | None = None
    prefill: list[dict[str, float]] = field(default_factory=list)
    decode: list[dict[str, float]] = field(default_factory=list)
    speculative: list[dict[str, float]] = field(default_factory=list)  # MTP rounds, beside `decode`'s plain steps
    peak_memory_bytes: int = 0
    graph_memory_bytes: int = 0  # the fast path's decode graphs' shared memory pool (`FastQwen35.graph_bytes`)


def _timed(device: torch.device, work, repeats: int = 5) -> float:
    """Median seconds of `work()` after one warm-up call. On CUDA each call is timed by device events around it, so
    no host launch or synchronisation time enters a short measurement (timed by the host clock, the 0.25 ms
    bandwidth read gave 3.78 and 4.11 TB/s in two runs on one H200); elsewhere by the host
    clock."""
    work()
    synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            work()
            synchronize(device)
            times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def measure_limits(device: torch.device, dtype: torch.dtype) -> Limits:
    """The read bandwidth (sum over a buffer several times the last-level cache) and the matmul rate."""
    gpu = device.type == "cuda"
    bandwidth = _read_bandwidth(device, (1 << 30) if gpu else (1 << 27))
    n = 8192 if gpu else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = _timed(device, lambda: a @ b, repeats=LIMIT_REPEATS)
    return Limits(str(device), bandwidth, 2 * n**3 / seconds, str(dtype).removeprefix("torch."))


def _read_bandwidth(device: torch.device, nbytes: int, burst: int | None = None) -> float:
    """Bytes per second of reductions over an `nbytes` buffer, `burst` of them back to back per timing (by default
    READ_BURST on CUDA, one elsewhere)."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    out = torch.empty((), dtype=torch.float32, device=device)
    burst = burst or (READ_BURST if device.type == "cuda" else 1)

    def reductions() -> None:
        for _ in range(burst):
            torch.sum(buffer, dim=0, out=out)

    return burst * nbytes / _timed(device, reductions, repeats=LIMIT_REPEATS)


def _state_bytes(llm: LLM, length: int) -> int:
    """Bytes a decode step reads from one sequence's state at `length` tokens: KV rows of the attention layers
    and the recurrent (fp32, or as the fast path pools it) plus conv state of the GDN layers."""
    c = llm.model.config
    element = torch.empty((), dtype=llm.dtype).element_size()
    cache = llm.model.cache if llm.fast else None  # the packed model's pools, in their own dtypes
    kv_element = cache.kv_element_bytes if cache is not None else element
    state_element = cache.recurrent.element_size() if cache is not None else 4
    attention = sum(1 for t in c.layer_types if t == FULL_ATTENTION)
    gdn = c.layers - attention
    return (attention * 2 * length * c.kv_heads * c.head_dim * kv_element
            + gdn * (c.v_heads * c.k_dim * c.v_dim * state_element + c.conv_dim * (c.conv_kernel - 1) * element))


def _weight_bytes_per_step(llm: LLM, batch: int) -> float:
    """Weight bytes a decode step of `batch` tokens must read (see the module docstring)."""
    c = llm.model.config
    total = 0.0
    touched = 1 - (1 - c.top_k / c.experts) ** batch if c.moe else 1.0  # expected share of the experts hit
    for name, (_, _, nbytes) in llm.model.matrices().items():
        if name == "token_embedding" and not c.tied:
            continue
        total += nbytes * (touched if "/moe/routed_" in name else 1.0)
    return total


def _prefill_flops(llm: LLM, tokens: int) -> float:
    c = llm.model.config
    matmul_weights = 0.0
    for name, (rows, columns, _) in llm.model.matrices().items():
        if name == "token_embedding" or name.endswith("convolution"):
            continue
        share = c.top_k / c.experts if "/moe/routed_" in name else 1.0  # only top_k of the experts work per token
        matmul_weights += rows * columns * share
    attention_layers = sum(1 for t in c.layer_types if t == FULL_ATTENTION)
    scores = attention_layers * 2 * 2 * c.heads * c.head_dim * tokens * tokens / 2  # causal QK^T and PV
    return 2 * matmul_weights * tokens + scores


def run_bench(llm: LLM, prompt_lengths: list[int], new_tokens: int, batch_sizes: list[int],
              limits: Limits | None = None, acceptance: float | None = None) -> BenchReport:
    """With a speculating `llm` (`spec="mtp"`) each batch also runs MTP rounds of its draft length (3 when it is
    chosen per round) for `new_tokens` tokens a sequence: real greedy acceptance, or with `acceptance` P a synthetic
    one (draft i is accepted with probability P when drafts 1..i-1 were; every kernel of the round still runs)."""
    device = llm.device
    limits = limits or measure_limits(device, llm.dtype)
    model = llm.model
    vocab = llm.tokenizer.vocab_size
    report = BenchReport(str(llm.path), limits, model.weight_bytes, runner="fast" if llm.fast else "reference",
                         dependent_launch=llm.fast and pdl_supported(device))
    if llm.fast:
        report.kv_dtype, report.state_dtype = model.cache.kv_dtype, model.cache.state_dtype
    generator = torch.Generator().manual_seed(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        for length in prompt_lengths:
            if length + new_tokens > llm.max_context:
                raise NinferError(f"prompt {length} + {new_tokens} new tokens exceed the context {llm.max_context}")
            ids = torch.randint(0, vocab, (length,), generator=generator).to(device)
            seconds = _timed(device, lambda ids=ids, n=length: _prefill_once(model, ids, n), repeats=3)
            floor = _prefill_flops(llm, length) / limits.matmul_flops_per_second
            report.prefill.append({"tokens": length, "seconds": seconds, "tokens_per_second": length / seconds,
                                   "fraction_of_matmul_limit": floor / seconds})
        context = min(prompt_lengths)
        model.prepare(batch_sizes)  # the graphs, largest first as a server's warm-up captures them
        for batch in batch_sizes:
            states, first = [], []
            for _ in range(batch):
                state = model.new_state(context + new_tokens + 1)
                ids = torch.randint(0, vocab, (context,), generator=generator).to(device)
                first.append(model.prefill(ids, state).argmax())
                states.append(state)
            tokens = torch.stack(first)
            model.decode(states, tokens)  # warm-up
            synchronize(device)
            if device.type == "cuda":
                time.sleep(DECODE_SETTLE_SECONDS)
            started = time.perf_counter()
            for _ in range(new_tokens - 1):
                tokens = model.decode(states, tokens).argmax(-1)
            synchronize(device)
            seconds = time.perf_counter() - started
            for state in states:
                model.free_state(state)
            steps = new_tokens - 1
            step_bytes = _weight_bytes_per_step(llm, batch) + batch * _state_bytes(llm, context + new_tokens // 2)
            floor = step_bytes / limits.read_bytes_per_second
            report.decode.append({"batch": batch, "context": context, "new_tokens": new_tokens,
                                  "seconds_per_step": seconds / steps,
                                  "tokens_per_second": batch * steps / seconds,
                                  "bytes_per_step": step_bytes,
                                  "fraction_of_bandwidth_limit": floor / (seconds / steps)})
            if llm.config.speculative.spec != "none":
                k = llm.config.speculative.draft_tokens or DEFAULT_BENCH_DRAFTS
                row = _bench_rounds(llm, batch, context, new_tokens, k, acceptance, generator)
                row["speedup"] = row["tokens_per_second"] / report.decode[-1]["tokens_per_second"]
                report.speculative.append(row)
    if device.type == "cuda":
        report.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
        report.graph_memory_bytes = model.graph_bytes if llm.fast else 0
    return report


def _bench_rounds(llm: LLM, batch: int, context: int, new_tokens: int, k: int, acceptance: float | None,
                  generator: torch.Generator) -> dict[str, Any]:
    """Seconds and tokens of `new_tokens` // 2 + 1 MTP rounds of K drafts for `batch` sequences (see `run_bench`):
    draft, verify, the accept decision, accept, as the engine's round does them."""
    model, device = llm.model, llm.device
    vocab = llm.tokenizer.vocab_size
    rounds = new_tokens // 2 + 1
    states, tokens = [], []
    for _ in range(batch):
        state = model.new_state(context + rounds * (k + 1) + 1)
        ids = torch.randint(0, vocab, (context,), generator=generator).to(device)
        tokens.append(model.prefill(ids, state).argmax())
        states.append(state)
    tokens = torch.stack(tokens)
    emitted = [0] * batch
    accepted_total = 0
    synchronize(device)
    started = time.perf_counter()
    for _ in range(rounds):
        drafts = model.draft(states, tokens, k)
        logits = model.verify(states, torch.cat([tokens.view(-1, 1), drafts], dim=1))
        targets = logits[..., :vocab].argmax(-1)  # [B, K+1]
        if acceptance is None:  # greedy: accept while the draft is the target's argmax
            accepted = torch.cumprod((targets[:, :k] == drafts).long(), 1).sum(1)
        else:
            draws = torch.rand(batch, k, generator=generator).to(device) < acceptance
            accepted = torch.cumprod(draws.long(), 1).sum(1)
        counts = accepted.tolist()
        model.accept(states, [a + 1 for a in counts])
        tokens = targets.gather(1, accepted.view(-1, 1)).view(-1)
        emitted = [e + a + 1 for e, a in zip(emitted, counts, strict=True)]
        accepted_total += sum(counts)
    synchronize(device)
    seconds = time.perf_counter() - started
    for state in states:
        model.free_state(state)
    return {"batch": batch, "draft_tokens": k, "synthetic_acceptance": acceptance, "rounds": rounds,
            "seconds_per_round": seconds / rounds, "tokens_per_round": 1 + accepted_total / (rounds * batch),
            "tokens_per_second": sum(emitted) / seconds}


def _prefill_once(model: Model, ids: torch.Tensor, capacity: int) -> torch.Tensor:
    state = model.new_state(capacity)
    try:
        return model.prefill(ids, state)
    finally:
        model.free_state(state)


def format_report(report: BenchReport) -> str:
    lim = report.limits
    launch = ", programmatic dependent launch" if report.dependent_launch else ""
    if report.kv_dtype is not None:
        launch += f", {report.kv_dtype} KV, {report.state_dtype} recurrent state"
    lines = [f"{report.model} on {lim.device} ({report.runner} runner{launch}): weights "
             f"{report.weight_bytes / 2**20:.1f} MiB as held in memory",
             f"limits measured now: read {lim.read_bytes_per_second / 1e9:.1f} GB/s, "
             f"{lim.dtype} matmul {lim.matmul_flops_per_second / 1e12:.2f} TFLOP/s",
             "prefill  tokens   tok/s      fraction of the matmul limit"]
    for row in report.prefill:
        lines.append(f"         {row['tokens']:>6}  {row['tokens_per_second']:>9.1f}  "
                     f"{row['fraction_of_matmul_limit']:.3f}")
    lines.append("decode   batch    tok/s      ms/step   fraction of the bandwidth limit")
    for row in report.decode:
        lines.append(f"         {row['batch']:>6}  {row['tokens_per_second']:>9.1f}  "
                     f"{1000 * row['seconds_per_step']:>8.2f}   {row['fraction_of_bandwidth_limit']:.3f}")
    if report.speculative:
        lines.append("mtp      batch    tok/s      ms/round  drafts  tokens/round  speed-up over plain decode")
        for row in report.speculative:
            synthetic = f"  (synthetic acceptance {row['synthetic_acceptance']:g})" \
                if row["synthetic_acceptance"] is not None else ""
            lines.append(f"         {row['batch']:>6}  {row['tokens_per_second']:>9.1f}  "
                         f"{1000 * row['seconds_per_round']:>8.2f}  {row['draft_tokens']:>6}  "
                         f"{row['tokens_per_round']:>12.2f}  {row['speedup']:.2f}x{synthetic}")
    if report.peak_memory_bytes:
        lines.append(f"peak device memory {report.peak_memory_bytes / 2**30:.2f} GiB"
                     + (f", decode graphs {report.graph_memory_bytes / 2**20:.1f} MiB"
                        if report.graph_memory_bytes else ""))
    return "\n".join(lines)


def report_json(report: BenchReport) -> dict[str, Any]:
    data = asdict(report)
    data["limits"] = asdict(report.limits)
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in data.items()}
