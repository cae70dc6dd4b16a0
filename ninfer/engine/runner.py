"""The packed GPU model as the engine's `Model`: static input buffers, bucketed CUDA graphs, warm-up.

The model's `step` is a pure function of device tensors; this runner owns what makes it replayable. Every step's
inputs live in one static buffer `inputs` `[4, width]` int32 — row 0 the token ids `[B·T]`, row 1 the state slots
`[B]`, row 2 the lengths before the step `[B]`, row 3 a verify step's snapshot slots `[B·T]` — and every step's
logits in one buffer, so that all graphs share them. A decode step of B sequences replays the graph of the smallest
bucket ≥ B (padding rows: the scratch slot from position 0); a verify step and a short prompt piece (at most
SHORT_PREFILL_TOKENS tokens: a chat turn's tail, a generation prompt) replay a graph per (B, T). Eagerly, the
hundreds of launches of one step cost the host ten times the step's GPU time; replayed, the host queues one graph.
Without CUDA (the CPU tests, under the Triton interpreter) the same steps run eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch

from ninfer import flags
from ninfer.devices import synchronize
from ninfer.engine.kv_cache import KVCache, SlotState
from ninfer.engine.memory import MemoryPlan, logit_rows
from ninfer.errors import NinferError
from ninfer.model.qwen3_5_packed import STEP_TOKENS, PackedQwen35

# decode graphs' batch sizes: a step of B sequences replays the graph of the smallest bucket ≥ B, whose padding
# rows cost what live ones do, so every size up to the default 8 slots has its own graph, and above it every
# multiple of 8, the batch GEMV's token tile (`quant_linear.BATCH_TOKENS`)
DECODE_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64)
# prompt pieces of up to this many tokens take the model's `step` instead of its prefill route: the gated delta step
# unrolls its T tokens (one compiled kernel per T, all made by `warm_up`). Off (0) under the interpreter, which runs
# those kernels program by program, far slower than the prefill route's torch ops
SHORT_PREFILL_TOKENS = 0 if flags.triton_interpreted() else 16
# prefill-route prompt lengths of `warm_up`: every specialisation class of T and T · top_k (32: both divisible by 16;
# 33: neither; 34: T · top_k only, for top_k 8)
WARM_UP_LENGTHS = (32, 33, 34)


def decode_buckets(slots: int) -> list[int]:
    """The batch sizes of the decode graphs for `slots` sequence slots: DECODE_BUCKETS below it, and `slots`."""
    return [b for b in DECODE_BUCKETS if b < slots] + [slots]


class GraphRunner:
    """A `PackedQwen35` and its pools behind the `Model` protocol (see the module docstring)."""

    drafter = False

    def __init__(self, model: PackedQwen35, cache: KVCache, plan: MemoryPlan, *, graphs: bool = True):
        self.model = model
        self.cache = cache
        self.plan = plan
        self.config = model.config
        self.device = model.device
        self.dtype = model.dtype
        self.max_batch = cache.slots
        self.page = cache.page
        self.kv_capacity = plan.kv_tokens
        self.buckets = decode_buckets(self.max_batch)
        self.use_graphs = graphs and self.device.type == "cuda"
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_pool = None  # the memory pool every graph captures into (made on the first capture)
        width = max(self.max_batch * cache.max_verify_tokens, STEP_TOKENS, self.max_batch)
        self.inputs = torch.zeros((4, width), dtype=torch.int32, device=self.device)
        # the slots and lengths that rows 1-2 of `inputs` hold once every queued step has run, as the host tracks
        # them (None: unknown): a decode step advances its live rows' lengths itself, so that the next step of the
        # same sequences transfers only its ids (`decode`)
        self.staged: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.logits = torch.empty((logit_rows(self.max_batch, cache.max_verify_tokens), model.head.shape[0]),
                                  dtype=torch.float32, device=self.device)

    # -- the Model protocol ----------------------------------------------------------------------------------

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    def matrices(self) -> dict[str, tuple[int, int, int]]:
        return self.model.matrices()

    def describe_memory(self) -> str:
        return self.plan.describe()

    @property
    def graph_bytes(self) -> int:
        """Device bytes the graphs' memory pool holds (its segments in the caching allocator)."""
        if self.graph_pool is None:
            return 0
        return sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
                   if tuple(segment["segment_pool_id"]) == tuple(self.graph_pool))

    def new_state(self, capacity: int) -> SlotState:
        return self.cache.allocate(capacity)

    def free_state(self, state: SlotState) -> None:
        self.cache.free(state)

    def snapshot(self, state: SlotState) -> dict[tuple[str, int], object]:
        return self.cache.snapshot(state)

    def restore(self, state: SlotState, length: int, snapshot: dict[tuple[str, int], object]) -> None:
        self.cache.restore(state, length, snapshot)

    def release_snapshot(self, snapshot: dict[tuple[str, int], object]) -> None:
        self.cache.release_snapshot(snapshot)

    def set_reclaim(self, reclaim: Callable[[], bool] | None) -> None:
        self.cache.reclaim = reclaim

    def accept(self, states: Sequence[SlotState], accepted: Sequence[int]) -> None:
        self.cache.accept(states, accepted)

    def draft(self, states: Sequence[SlotState], ids: torch.Tensor, k: int) -> torch.Tensor:
        """The packed model has no MTP drafter yet (`drafter` is False; the loader refuses `spec="mtp"` here)."""
        raise NinferError("the fast path has no MTP drafter yet: use --runner reference with --spec mtp")

    def prefill(self, ids: torch.Tensor, state: SlotState, all_logits: bool = False) -> torch.Tensor:
        """Logits (fp32) of the last new position `[V]` (all new positions `[T, V]` with `all_logits`): a short
        piece through the model's `step`, the rest through its prefill route."""
        ids = ids.to(self.device)
        _check_room([state], ids.numel())
        if ids.numel() == 1 and not all_logits:
            return self.decode([state], ids)[0]
        if ids.numel() <= SHORT_PREFILL_TOKENS and not all_logits:
            return self._steps([state], ids.view(1, -1), None)[0]
        return self.model.prefill(ids, state, all_logits)

    def decode(self, states: Sequence[SlotState], ids: torch.Tensor) -> torch.Tensor:
        """One token for each of B sequences: logits `[B, V]` fp32 (a copy: the graph's output is reused)."""
        batch = len(states)
        bucket = self._bucket(batch)
        _check_room(states, 1)
        ids = ids.view(-1)
        if ids.numel() != batch:
            raise ValueError(f"{ids.numel()} ids for {batch} sequences")
        # the columns past the batch up to the bucket are padding rows (the scratch slot, its first position)
        padding = self.max_batch - batch
        scratch = self.cache.scratch_slot
        slots = tuple(s.slot for s in states) + (scratch,) * padding
        starts = tuple(s.length for s in states) + (0,) * padding
        # when the last decode step left these slots and lengths in the buffer, only the ids travel
        in_buffer, self.staged = self.staged == (slots, starts), None  # unknown until this step is queued
        self._stage(ids, [] if in_buffer else [torch.tensor(slots, dtype=torch.int32),
                                               torch.tensor(starts, dtype=torch.int32)])
        logits = self._run(bucket, 1, False)
        self.staged = (slots, tuple(n + (slot != scratch) for slot, n in zip(slots, starts, strict=True)))
        for state in states:
            state.length += 1
        return logits[:batch].clone()

    def verify(self, states: Sequence[SlotState], ids: torch.Tensor) -> torch.Tensor:
        """T draft tokens `ids` `[B, T]` appended to each of B sequences in one step; the logits `[B, T, V]` (fp32)
        after each of them. The GDN state after every draft token is kept in the sequence's verify slots; `accept`
        then keeps a prefix of the drafts."""
        batch, tokens = ids.shape
        if not 1 <= tokens <= self.cache.max_verify_tokens:
            raise ValueError(f"a verify step takes 1..{self.cache.max_verify_tokens} tokens per sequence "
                             f"(max_verify_tokens), not {tokens}")
        _check_room(states, tokens, "accept the previous verify step before the next one")
        snapshots = [self.cache.verify_slot(s.slot, t) for s in states for t in range(tokens)]
        logits = self._steps(states, ids, snapshots)
        for state in states:
            state.pending = tokens
        return logits.view(batch, tokens, -1)

    def prepare(self, batch_sizes: Iterable[int]) -> None:
        """Capture the decode graphs that steps of these batch sizes replay (graphs already captured are kept),
        largest first: the smaller graphs then fit in the blocks of the shared pool that the largest one's capture
        freed (`_capture`), where captured smallest first each larger one adds segments. A no-op without graphs."""
        if self.use_graphs:
            for bucket in sorted({self._bucket(size) for size in batch_sizes}, reverse=True):
                self._graph(bucket, 1, False)

    def warm_up(self, max_batch: int | None = None) -> float:
        """Compile the kernels and capture the decode graphs that serving meets, before the first request; returns
        the seconds it took. Triton compiles a kernel once per specialisation of its integer arguments (equal to 1,
        divisible by 16, other), and flash-linear-attention autotunes on first use: prefill-route prompts of 32, 33
        and 34 tokens meet every class of the token and (token, expert) pair counts; a prompt of one whole
        prefill chunk and 34 tokens more meets the full chunk and a chunk after earlier ones (on the H200 the first
        such prompt took 11 s, the next 0.5 s, for 8,192 tokens of the 35B-A3B); short prompts of SHORT_PREFILL_TOKENS
        … 2 tokens compile the gated delta step for each T and capture their graphs (largest first, as the decode
        graphs); the graph of every decode bucket up to `max_batch` (default: every slot; at most the free slots).
        Without it the first requests of a server wait seconds for compilation."""
        started = time.perf_counter()
        cache = self.cache
        long = min(self.model.prefill_chunk + WARM_UP_LENGTHS[-1], cache.max_pages * cache.page)
        for length in (*WARM_UP_LENGTHS, long, *range(SHORT_PREFILL_TOKENS, 1, -1)):
            state = self.new_state(length)
            try:
                self.prefill(torch.arange(1, length + 1, device=self.device) % self.config.vocab, state)
            finally:
                self.free_state(state)
        limit = min(max_batch or self.max_batch, len(cache.free_slots))
        buckets = [b for b in self.buckets if b <= limit]
        if self.use_graphs:
            self.prepare(buckets)
        else:  # an eager step per bucket compiles its kernels
            for bucket in buckets:
                states = [self.new_state(2) for _ in range(bucket)]
                try:
                    self.decode(states, torch.ones(bucket, dtype=torch.long, device=self.device))
                finally:
                    for state in states:
                        self.free_state(state)
        synchronize(self.device)
        return time.perf_counter() - started

    # -- steps -----------------------------------------------------------------------------------------------

    def _steps(self, states: Sequence[SlotState], ids: torch.Tensor, snapshots: list[int] | None) -> torch.Tensor:
        """T tokens `ids` `[B, T]` appended to each of B sequences in one model `step`: a verify step (`snapshots`:
        the GDN pool slots `[B·T]`, sequence-major, that keep the state after every token) returns the logits after
        every token `[B·T, V]`, sequence-major; a short prompt (B = 1, no snapshots) those after its last token
        `[1, V]`. Returns a copy (the graphs' output buffer is reused)."""
        batch, tokens = ids.shape
        verify = snapshots is not None
        rows = batch * tokens
        if not (1 <= tokens <= STEP_TOKENS and rows <= self.inputs.shape[1] and (verify or batch == 1)):
            raise ValueError(f"a step of {tokens} tokens for {batch} sequences is larger than the step buffers")
        self._stage(ids.reshape(-1), [torch.tensor([s.slot for s in states], dtype=torch.int32),
                                      torch.tensor([s.length for s in states], dtype=torch.int32),
                                      torch.tensor(snapshots or [], dtype=torch.int32)])
        self.staged = None  # a T-token step leaves its starts in the buffer, and other ids in the padding columns
        logits = self._run(batch, tokens, verify)
        for state in states:
            state.length += tokens
        return logits.clone()

    def _run(self, batch: int, tokens: int, verify: bool) -> torch.Tensor:
        """The step over the staged inputs: its graph replayed, or eagerly without graphs."""
        if self.use_graphs:
            graph, logits = self._graph(batch, tokens, verify)
            graph.replay()
            return logits
        return self._step(batch, tokens, verify)

    def _step(self, batch: int, tokens: int, verify: bool) -> torch.Tensor:
        """The model's step over the first `batch` sequences of `inputs` (device tensors only: graph-capturable)."""
        rows = batch * tokens
        inputs = self.inputs
        snapshots = inputs[3, :rows].view(batch, tokens) if verify else None
        decode = tokens == 1 and not verify
        return self.model.step(inputs[0, :rows], inputs[1, :batch], inputs[2, :batch], snapshots, self.logits,
                               last_only=tokens > 1 and not verify, advance=decode)

    def _stage(self, ids: torch.Tensor, rows: list[torch.Tensor]) -> None:
        """A step's inputs into the static buffer `inputs` with no host synchronisation: `ids` into row 0,
        `rows[r - 1]` into row r, each from column 0. The host rows go from pinned memory without blocking (the
        caching host allocator keeps the buffer until its copy has run) as one contiguous transfer of the whole
        buffer (a copy into strided columns takes a kernel after the transfer); ids already on the device (the last
        step's sampled tokens) are copied there in stream order. So the host can queue the next step at once. With
        no `rows`, only the ids travel: rows 1-3 keep what the queued steps leave there."""
        on_device = self.device.type != "cpu" and ids.device.type == self.device.type
        pinned = self.device.type == "cuda"
        if rows:
            host = torch.zeros(self.inputs.shape, dtype=torch.int32, pin_memory=pinned)
            if not on_device:
                host[0, : ids.numel()] = ids.to(torch.int32)
            for row, values in enumerate(rows, 1):
                host[row, : values.numel()] = values
            self.inputs.copy_(host, non_blocking=True)
        elif not on_device:
            host = ids.to(torch.int32)
            self.inputs[0, : ids.numel()].copy_(host.pin_memory() if pinned else host, non_blocking=True)
        if on_device:
            self.inputs[0, : ids.numel()].copy_(ids)

    # -- graphs ----------------------------------------------------------------------------------------------

    def _bucket(self, batch: int) -> int:
        """The graph bucket a step of `batch` rows replays: the smallest bucket that holds it."""
        if batch > self.max_batch:
            raise ValueError(f"a decode batch of {batch} exceeds the {self.max_batch} sequence slots")
        return next(b for b in self.buckets if b >= batch)

    def _graph(self, batch: int, tokens: int, verify: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of a step of `batch` sequences × `tokens` (a decode bucket: tokens 1, not verify), captured
        on first use (`_capture`)."""
        key = (batch, tokens, verify)
        if key not in self.graphs:
            self.graphs[key] = self._capture(lambda: self._step(*key))
        return self.graphs[key]

    def _capture(self, step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """`step` (device work over the static `inputs` only) as a CUDA graph, and its output. It runs on padding
        rows only (id 0, the scratch slot from its first position, the scratch slot as every snapshot), once
        eagerly to compile its kernels outside the capture, then captured; the inputs are restored after. Every graph
        captures into one memory pool: a step's buffers live only inside its replay, and replays run one at a time
        on one stream, so a graph may reuse what another's capture freed (CUDA-graph pool sharing, as vLLM shares
        one pool across its batch sizes); the logits go to `logits`, outside the pool. Capturing the largest
        decode bucket first (`prepare`) lets the smaller ones fit in its blocks."""
        saved = self.inputs.clone()
        scratch = self.cache.scratch_slot
        padding = torch.tensor([0, scratch, 0, scratch], dtype=torch.int32, device=self.device)
        self.inputs.copy_(padding[:, None].expand_as(self.inputs))
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        self.graph_pool = self.graph_pool or torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            output = step()
        self.inputs.copy_(saved)
        return graph, output


def _check_room(states: Sequence[SlotState], tokens: int, pending: str = "accept the verify step before decoding on"
                ) -> None:
    for state in states:
        if state.pending:
            raise ValueError(pending)
        if state.length + tokens > state.capacity:
            raise ValueError(f"sequence of {state.length + tokens} tokens exceeds its capacity of {state.capacity}")
