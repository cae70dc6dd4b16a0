"""The Qwen3.5 text model on the GPU fast path: packed weights, paged KV, slot-pooled GDN state, CUDA-graph decode.

Same math and the same interface as the reference `Qwen35Model` (`new_state`, `forward`, `decode_batch`,
`snapshot`, `restore`), which stays the oracle; the GPU tests compare the two. Per step:
  * decode (`decode_batch`, B sequences, one token each): every matrix through the Triton GEMV (groupwise or
    FP8 rows), the fused residual-add + norm, q/k norm + rotary, the paged-KV write and split-K attention, the
    GDN conv-update and gated-delta-step kernels, MoE routing in one kernel and the experts through the gathering
    GEMV; captured once per batch-size bucket as a CUDA graph (no host sync, no allocation inside a step) and
    replayed;
  * prefill (`forward` with T > 1): in chunks of `prefill_chunk` tokens carrying KV, conv and recurrent state;
    matrices dequantized to a scratch buffer and multiplied by cuBLAS, routed experts in one grouped launch per
    matrix, attention by fused SDPA over the sequence's pages, the delta rule by flash-linear-attention's chunked
    kernel when installed (else the torch reference); only the last position goes through the head. A short
    prompt piece (at most SHORT_PREFILL_TOKENS: a chat turn's tail, a generation prompt) instead takes one pass
    of the decode kernels over its T tokens, as a verify step does, replayed as a CUDA graph per (B, T) (27B, 16
    tokens: 19 ms, where the same launches made eagerly took 46 ms and the prefill route's about 100).
docs/fast-path.md describes the whole path.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ninfer.artifact.reader import Artifact
from ninfer.devices import free_memory, synchronize
from ninfer.fast.branches import Branches
from ninfer.fast.cache import MemoryPlan, SequenceCache, SlotState, logit_rows, plan_memory
from ninfer.fast.linear import PackedLinear, Scratch, is_packed, project, shared_input, shares_launch
from ninfer.kernels.activation_quant import Int8Activations
from ninfer.kernels.attention import prefill_attention
from ninfer.kernels.conv1d import causal_conv1d
from ninfer.kernels.dense_linear import dense_linear_gemv
from ninfer.kernels.fused import add_rms_norm, moe_combine, route_top_k, sigmoid_mul, silu_mul
from ninfer.kernels.gated_delta_rule import gated_delta_rule_chunked, l2_normalize
from ninfer.kernels.gdn_decode import AB_IN_KERNEL_MAX_K, gated_delta_decode
from ninfer.kernels.l2_prefetch import L2Prefetch, prefetch_to_l2
from ninfer.kernels.norm import rms_norm_gated
from ninfer.kernels.paged_attention import paged_attention_decode, qk_norm_rope, write_kv
from ninfer.kernels.quant_linear import INTERPRETED, MAX_GEMV_TOKENS, group_pairs
from ninfer.kernels.rope import rope_inv_freq
from ninfer.model.config import FULL_ATTENTION, TextConfig

try:  # flash-linear-attention: the chunked delta rule for long prefills (optional GPU dependency)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
except ImportError:  # pragma: no cover - depends on the environment
    chunk_gated_delta_rule = None

FP32_OBJECTS = ("gdn/a_log", "gdn/dt_bias")
# decode graphs' batch sizes: a step of B sequences replays the graph of the smallest bucket ≥ B, whose padding
# rows cost what live ones do, so every size up to the default 8 slots has its own graph (27B: 3 sequences 6.95 ms
# a step against 7.30 in the 4-row graph; docs/performance.md, thirty-fifth session), and above it every multiple
# of 8, the batch GEMV's token tile (`quant_linear.BATCH_TOKENS`)
DECODE_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64)
GDN_PROJECTIONS = ("query_key", "value_z", "a_b_projection")  # the GDN layer's matrices that read its input
# prompt pieces of up to this many tokens take the decode kernels (`_steps`) instead of the prefill route: the gated
# delta step unrolls its T tokens (one compiled kernel per T, all made by `warm_up`). Off (0) under the interpreter,
# which runs those kernels program by program, far slower than the prefill route's torch ops (the tests set it)
SHORT_PREFILL_TOKENS = 0 if INTERPRETED else 16
STEP_TOKENS = 16  # the most tokens a sequence appends in one pass of the decode kernels (short prompt or verify)
# prefill-route prompt lengths of `warm_up`: every specialisation class of T and T · top_k (32: both divisible by 16;
# 33: neither; 34: T · top_k only, for top_k 8)
WARM_UP_LENGTHS = (32, 33, 34)
MOE_TILE = 16 if INTERPRETED else 64  # (token, expert) pairs per tile of the grouped MoE prefill
# bytes of the next GEMV's first rows that a captured step streams into L2 in its second branch while the small
# kernels before that GEMV run (`_prefetch`), at every site; 0: none (27B on the H200: 2-4 MiB best, 8 MiB and more
# outlast the window, docs/performance.md)
L2_PREFETCH_BYTES = int(float(os.environ.get("NINFER_L2_PREFETCH_MIB", "4")) * 2**20)


def _device_bytes(fmt: str, shape: tuple[int, ...], stored: int) -> int:
    """Device bytes of an object on this path: packed formats as stored, the rest as bf16 matrices / as is."""
    if is_packed(fmt) or len(shape) != 2:
        return stored
    return math.prod(shape) * 2


def decode_buckets(slots: int) -> list[int]:
    """The batch sizes of the decode graphs for `slots` sequence slots: DECODE_BUCKETS below it, and `slots`."""
    return [b for b in DECODE_BUCKETS if b < slots] + [slots]


def delta_rule_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       initial: torch.Tensor, k_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens of one sequence from `initial` `[H, Dk, Dv]` (fp32): q, k `[T, H, Dk]`
    before their L2 norm (already repeated to the value heads), v `[T, H, Dv]`, log-decay g and beta `[T, H]`.
    flash-linear-attention's chunked kernel for bf16/fp16 inputs when installed, else the torch reference
    (`gated_delta_rule_chunked`). Returns (o `[T, H, Dv]`, final state `[H, Dk, Dv]` fp32)."""
    if chunk_gated_delta_rule is not None and q.dtype in (torch.bfloat16, torch.float16) and q.is_cuda:
        o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], scale=k_dim**-0.5,
                                          initial_state=initial[None], output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
        return o[0], final[0]
    return gated_delta_rule_chunked(l2_normalize(q) * k_dim**-0.5, l2_normalize(k), v.float(), g, beta.float(),
                                    initial)


class FastQwen35:
    """Qwen3.5 text model on CUDA (see the module docstring). Build with `from_artifact`."""

    def __init__(self, config: TextConfig, linears: dict[str, PackedLinear], vectors: dict[str, torch.Tensor],
                 cache: SequenceCache, plan: MemoryPlan, *, dtype: torch.dtype, prefill_chunk: int, graphs: bool,
                 int8_activations: bool = True):
        self.config = config
        self.linears = linears
        self.vectors = vectors
        self.cache = cache
        self.plan = plan
        self.device = cache.device
        self.dtype = dtype
        self.prefill_chunk = prefill_chunk
        self.int8_activations = int8_activations
        self.head = linears["output_head"] if "output_head" in linears else linears["token_embedding"]
        self.inv_freq = rope_inv_freq(config.rotary_dim, config.rope_theta).to(self.device)
        self.max_batch = cache.slots
        self.buckets = decode_buckets(self.max_batch)  # the graphs share one memory pool (`_graph`)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_pool = None  # the memory pool every decode graph captures into (made on the first capture)
        # every step's inputs (`_step`): ids [B·T], slots [B], lengths before the step [B], snapshot slots [B·T];
        # the T-token steps' graphs by (B, T, verify); the first T positions after a sequence's length
        width = max(self.max_batch * cache.max_verify_tokens, STEP_TOKENS, self.max_batch)
        self.inputs = torch.zeros((4, width), dtype=torch.int32, device=self.device)
        # the slots and lengths that rows 1-2 of `inputs` hold once every queued step has run, as the host tracks
        # them (None: unknown): a decode step advances its live rows' lengths itself, so that the next step of the
        # same sequences transfers only its ids (`decode_batch`)
        self.staged: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.step_graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.offsets = torch.arange(STEP_TOKENS, dtype=torch.int32, device=self.device)
        # every step's logits, written by the head's GEMV (a decode step's row b: sequence b; a verify step's
        # sequence-major rows), so that all the graphs share one buffer instead of each keeping its own in the pool
        self.logits = torch.empty((logit_rows(self.max_batch, cache.max_verify_tokens), self.head.shape[0]),
                                  dtype=torch.float32, device=self.device)
        self.prefetches: dict[tuple[str, ...], L2Prefetch | None] = {}
        self.use_graphs = graphs and self.device.type == "cuda"
        self.branches = Branches(self.device)  # independent work of a captured step runs as a second graph branch

    @property
    def kv_capacity(self) -> int:
        return self.plan.kv_tokens

    @property
    def page(self) -> int:
        return self.cache.page

    @property
    def graph_bytes(self) -> int:
        """Device bytes the decode graphs' memory pool holds (its segments in the caching allocator)."""
        if self.graph_pool is None:
            return 0
        return sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
                   if tuple(segment["segment_pool_id"]) == tuple(self.graph_pool))

    @property
    def weight_bytes(self) -> int:
        return sum(m.nbytes for m in self.linears.values()) + sum(
            t.numel() * t.element_size() for t in self.vectors.values())

    def matrices(self) -> dict[str, tuple[int, int, int]]:
        """Name → (rows, columns, bytes as held) of every weight matrix (speed accounting)."""
        return {name: (*m.shape, m.nbytes) for name, m in self.linears.items()}

    @classmethod
    def from_artifact(cls, artifact: Artifact, device: str | torch.device = "cuda", *, max_sequences: int = 8,
                      max_context: int = 32768, kv_capacity: int | None = None, kv_dtype: str = "bf16",
                      state_dtype: str = "fp32", prefill_chunk: int = 4096, dtype: torch.dtype = torch.bfloat16,
                      graphs: bool = True, max_verify_tokens: int = 0, int8_activations: bool = True,
                      progress: bool = False) -> FastQwen35:
        """Plan the memory (refusing what does not fit before loading anything), then load the weights and
        allocate the pools. `dtype` is the activation dtype (bf16; fp32 serves the CPU tests under the Triton
        interpreter) and the dtype of "bf16" KV pages. `state_dtype` is the GDN recurrent state's as pooled (fp32 or
        bf16; computed in fp32 either way). `max_verify_tokens` > 0 reserves GDN snapshot slots for `verify` steps
        of up to that many draft tokens per sequence. `int8_activations=False` gives decode and verify steps the
        prefill's exact numerics (every product through the decoded weights: slow, and the head's decoded matrix
        needs its size in scratch) — for checking the fast path against the reference."""
        config = TextConfig.from_dict(artifact.components["text"]["config"])
        device = torch.device(device)
        objects = [o for o in artifact.objects if o.kind == "tensor" and o.component == "text"]
        weight_bytes = sum(_device_bytes(o.format, o.shape, o.bytes) for o in objects)
        plan = plan_memory(config, weight_bytes, free_memory(device), slots=max_sequences, max_context=max_context,
                           kv_capacity=kv_capacity, kv_dtype=kv_dtype, prefill_chunk=prefill_chunk,
                           state_dtype=state_dtype, max_verify_tokens=max_verify_tokens,
                           decode_graphs=graphs and device.type == "cuda")
        scratch = Scratch(device, dtype)
        linears, vectors = {}, {}
        for obj in tqdm(objects, desc="loading weights", unit="object", disable=not progress):
            name = obj.id.removeprefix("text/")
            if len(obj.shape) == 2 and not name.endswith("gdn/convolution"):
                linears[name] = PackedLinear(artifact.raw(obj.id).to(device), obj.shape, obj.format, scratch,
                                             whole=name != "token_embedding" and "/moe/routed_" not in name)
            else:
                tensor = artifact.tensor(obj.id, device)
                vectors[name] = tensor.to(torch.float32 if name.endswith(FP32_OBJECTS) else dtype)
        cache = SequenceCache(config, device, slots=max_sequences, kv_tokens=plan.kv_tokens,
                              max_context=max_context, kv_dtype=kv_dtype, float_dtype=dtype, state_dtype=state_dtype,
                              max_verify_tokens=max_verify_tokens)
        return cls(config, linears, vectors, cache, plan, dtype=dtype, prefill_chunk=prefill_chunk, graphs=graphs,
                   int8_activations=int8_activations)

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
        long = min(self.prefill_chunk + WARM_UP_LENGTHS[-1], self.cache.max_pages * self.cache.page)
        for length in (*WARM_UP_LENGTHS, long, *range(SHORT_PREFILL_TOKENS, 1, -1)):
            self.forward(torch.arange(1, length + 1, device=self.device) % self.config.vocab, self.new_state(length))
        limit = min(max_batch or self.max_batch, len(self.cache.free_slots))
        buckets = [b for b in self.buckets if b <= limit]
        if self.use_graphs:
            self.capture_graphs(buckets)
        else:  # an eager step per bucket compiles its kernels
            for bucket in buckets:
                states = [self.new_state(2) for _ in range(bucket)]
                self.decode_batch(states, torch.ones(bucket, dtype=torch.long, device=self.device))
                del states
        synchronize(self.device)
        return time.perf_counter() - started

    def capture_graphs(self, batch_sizes: Iterable[int]) -> None:
        """Capture the decode graphs that steps of these batch sizes replay (graphs already captured are kept),
        largest first: the smaller graphs then fit in the blocks of the shared pool that the largest one's capture
        freed (`_graph`), where captured smallest first each larger one adds segments. A no-op without graphs."""
        if self.use_graphs:
            for bucket in sorted({self._bucket(size) for size in batch_sizes}, reverse=True):
                self._graph(bucket)

    # -- sequences -------------------------------------------------------------------------------------------

    def new_state(self, capacity: int) -> SlotState:
        return self.cache.allocate(capacity)

    def snapshot(self, state: SlotState) -> dict[tuple[str, int], object]:
        """A sequence's state for prefix reuse: a lease on its full KV pages (shared, not copied), copies of its
        partial last page and of its GDN slot."""
        page = self.cache.page
        full = state.length // page
        snapshot: dict[tuple[str, int], object] = {("pages", 0): self.cache.lease(state.pages[:full])}
        if state.length % page:
            index = torch.tensor(state.pages[full : full + 1], device=self.device)
            for kind in ("key_pages", "value_pages", "key_scales", "value_scales"):
                for layer, pool in getattr(self.cache, kind).items():
                    snapshot[(kind, layer)] = pool[index].clone()
        snapshot[("conv", 0)] = self.cache.conv[:, state.slot].clone()
        snapshot[("recurrent", 0)] = self.cache.recurrent[:, state.slot].clone()
        return snapshot

    def restore(self, state: SlotState, length: int, snapshot: dict[tuple[str, int], object]) -> None:
        """Put a `snapshot` of a `length`-token prefix into a fresh state: its block table points at the leased
        full pages, the partial page and the GDN state are copied."""
        full = length // self.cache.page
        for index, page in enumerate(snapshot[("pages", 0)].pages):
            self.cache.share(state, index, page)
        for (kind, layer), tensor in snapshot.items():
            if kind == "conv":
                self.cache.conv[:, state.slot] = tensor.to(self.device)
            elif kind == "recurrent":
                self.cache.recurrent[:, state.slot] = tensor.to(self.device)
            elif kind != "pages":
                index = torch.tensor(state.pages[full : full + 1], device=self.device)
                getattr(self.cache, kind)[layer][index] = tensor.to(self.device)
        state.length = length

    # -- the forward pass ------------------------------------------------------------------------------------

    def forward(self, ids: torch.Tensor, state: SlotState, all_logits: bool = False) -> torch.Tensor:
        """Logits (fp32) of the last new position `[V]` (all new positions `[T, V]` with `all_logits`)."""
        ids = ids.to(self.device)
        if state.pending:
            raise ValueError("accept the verify step before decoding on")
        if state.length + ids.numel() > state.capacity:
            raise ValueError(f"sequence of {state.length + ids.numel()} tokens exceeds the state's capacity of "
                             f"{state.capacity}")
        if ids.numel() == 1 and not all_logits:
            return self.decode_batch([state], ids)[0]
        if ids.numel() <= SHORT_PREFILL_TOKENS and not all_logits:
            return self._steps([state], ids.view(1, -1), None)[0]
        outputs = [self._prefill_chunk(chunk, state, all_logits) for chunk in ids.split(self.prefill_chunk)]
        return torch.cat(outputs) if all_logits else outputs[-1]

    def decode_batch(self, states: Sequence[SlotState], ids: torch.Tensor) -> torch.Tensor:
        """One token for each of B sequences: logits `[B, V]` fp32 (a copy: the graph's output is reused)."""
        batch = len(states)
        bucket = self._bucket(batch)
        for state in states:
            if state.length + 1 > state.capacity:
                raise ValueError(f"sequence of {state.length + 1} tokens exceeds its capacity of {state.capacity}")
            if state.pending:
                raise ValueError("accept the verify step before decoding on")
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
        if self.use_graphs:
            graph, logits = self._graph(bucket)
            graph.replay()
        else:
            logits = self._step(bucket, 1, False)
        self.staged = (slots, tuple(n + (slot != scratch) for slot, n in zip(slots, starts, strict=True)))
        for state in states:
            state.length += 1
        return logits[:batch].clone()

    def verify(self, states: Sequence[SlotState], ids: torch.Tensor) -> torch.Tensor:
        """A speculative verify step: T draft tokens `ids` `[B, T]` appended to each of B sequences in one
        forward; returns the logits `[B, T, V]` (fp32) after each of them. The GDN state after every draft token is
        kept in the sequence's verify slots; `accept` then keeps a prefix of the drafts. On CUDA replayed as a graph
        per (B, T) (`_steps`)."""
        batch, tokens = ids.shape
        if not 1 <= tokens <= self.cache.max_verify_tokens:
            raise ValueError(f"a verify step takes 1..{self.cache.max_verify_tokens} tokens per sequence "
                             f"(max_verify_tokens), not {tokens}")
        for state in states:
            if state.pending:
                raise ValueError("accept the previous verify step before the next one")
            if state.length + tokens > state.capacity:
                raise ValueError(f"sequence of {state.length + tokens} tokens exceeds its capacity of {state.capacity}")
        snapshots = [self.cache.verify_slot(s.slot, t) for s in states for t in range(tokens)]
        logits = self._steps(states, ids, snapshots)
        for state in states:
            state.pending = tokens
        return logits.view(batch, tokens, -1)

    def _steps(self, states: Sequence[SlotState], ids: torch.Tensor, snapshots: list[int] | None) -> torch.Tensor:
        """T tokens `ids` `[B, T]` appended to each of B sequences in one pass of the decode kernels (GEMVs, paged
        attention over each row's own length, the GDN steps). A verify step (`snapshots`: the GDN pool slots
        `[B·T]`, sequence-major, that keep the state after every token) returns the logits after every token
        `[B·T, V]`, sequence-major; a short prompt (B = 1, no snapshots) those after its last token `[1, V]`. On
        CUDA replayed as a graph per (B, T, verify) (`_step_graph`): eagerly, the hundreds of launches took ten
        times the decode step's time on the host (27B: 50-65 ms against 5, docs/performance.md, thirty-sixth
        session). Returns a copy (the graphs' output buffer is reused)."""
        batch, tokens = ids.shape
        verify = snapshots is not None
        rows = batch * tokens
        if not (1 <= tokens <= STEP_TOKENS and rows <= self.inputs.shape[1] and (verify or batch == 1)):
            raise ValueError(f"a step of {tokens} tokens for {batch} sequences is larger than the step buffers")
        self._stage(ids.reshape(-1), [torch.tensor([s.slot for s in states], dtype=torch.int32),
                                      torch.tensor([s.length for s in states], dtype=torch.int32),
                                      torch.tensor(snapshots or [], dtype=torch.int32)])
        self.staged = None  # a T-token step leaves its starts in the buffer, and other ids in the padding columns
        if self.use_graphs:
            graph, logits = self._step_graph(batch, tokens, verify)
            graph.replay()
        else:
            logits = self._step(batch, tokens, verify)
        for state in states:
            state.length += tokens
        return logits.clone()

    def _stage(self, ids: torch.Tensor, rows: list[torch.Tensor]) -> None:
        """A step's inputs into the static buffer `self.inputs` with no host synchronisation: `ids` into row 0,
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

    def accept(self, states: Sequence[SlotState], accepted: Sequence[int]) -> None:
        """Keep the first `accepted[b]` (≥ 1) draft tokens of each sequence's last verify step: its length drops to
        that prefix and its GDN state becomes the snapshot after the last kept token (KV rows past the length are
        simply overwritten later)."""
        for state, count in zip(states, accepted, strict=True):
            if not 1 <= count <= state.pending:
                raise ValueError(f"accept 1..{state.pending} tokens of the verify step, not {count}")
            if count < state.pending:
                snapshot = self.cache.verify_slot(state.slot, count - 1)
                self.cache.conv[:, state.slot] = self.cache.conv[:, snapshot]
                self.cache.recurrent[:, state.slot] = self.cache.recurrent[:, snapshot]
            state.length -= state.pending - count
            state.pending = 0

    def _bucket(self, batch: int) -> int:
        """The graph bucket a step of `batch` rows replays: the smallest bucket that holds it."""
        if batch > self.max_batch:
            raise ValueError(f"a decode batch of {batch} exceeds the {self.max_batch} sequence slots")
        return next(b for b in self.buckets if b >= batch)

    def _graph(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The decode graph of `bucket` rows, captured on first use (`_capture`)."""
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(lambda: self._step(bucket, 1, False))
        return self.graphs[bucket]

    def _step_graph(self, batch: int, tokens: int, verify: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of a T-token step (`_steps`), captured on first use (`_capture`)."""
        key = (batch, tokens, verify)
        if key not in self.step_graphs:
            self.step_graphs[key] = self._capture(lambda: self._step(*key))
        return self.step_graphs[key]

    def _capture(self, step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """`step` (device work over the static `self.inputs` only) as a CUDA graph, and its output. It runs on
        padding rows only (id 0, the scratch slot from its first position, the scratch slot as every snapshot), once
        eagerly to compile its kernels outside the capture, then captured; the inputs are restored after. Every graph
        captures into one memory pool: a step's buffers live only inside its replay, and replays run one at a time
        on one stream, so a graph may reuse what another's capture freed (CUDA-graph pool sharing, as vLLM shares
        one pool across its batch sizes); the logits go to `self.logits`, outside the pool. Capturing the largest
        decode bucket first (`capture_graphs`) lets the smaller ones fit in its blocks."""
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

    def _step(self, batch: int, tokens: int, verify: bool) -> torch.Tensor:
        """T tokens for each of the first `batch` sequences of `self.inputs` (device tensors only: graph-capturable):
        a decode step (T = 1, logits of every row), a verify step (logits of every token) or a short prompt (one
        sequence, logits of its last token); see `decode_batch` and `_steps`."""
        rows = batch * tokens
        ids, slots, starts = self.inputs[0, :rows], self.inputs[1, :batch], self.inputs[2, :batch]
        snapshots = self.inputs[3, :rows].view(batch, tokens) if verify else None
        # the embedding rows before the fork: a graph with two streams starts its first few kernels and then
        # pauses about 10 µs; forked after the rows, the pause falls less on the main chain (docs/performance.md,
        # thirty-first session)
        x = self.linears["token_embedding"].rows(ids)
        with self.branches.beside():  # first needed by the first attention layer (which joins)
            positions = (starts[:, None] + self.offsets[:tokens]).view(-1)
            lengths = positions + 1
            tables = self.cache.block_tables.index_select(0, slots).repeat_interleave(tokens, dim=0)
            if tokens == 1 and not verify:  # a decode step: its live rows' lengths for the next step (`staged`)
                starts += slots != self.cache.scratch_slot
        h = self._layers(x, lambda h, i: self._attention_decode(h, i, positions, lengths, tables),
                         lambda h, i: self._gdn_decode(h, i, slots, tokens, snapshots), self.int8_activations)
        if tokens > 1 and not verify:  # a short prompt: only its last position goes through the head
            h, rows = (h.rows(slice(-1, None)) if isinstance(h, Int8Activations) else h[-1:]), 1
        logits = project(self._input(h, [self.head], self.int8_activations), [self.head],
                         outs=[self.logits[:rows]])[0]
        self.branches.join()  # the head's prefetch, or positions and tables unused by a model without attention
        return logits

    def _linears(self, readers: list[PackedLinear], x: torch.Tensor, integer: bool,
                 out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """x through the matrices `readers`: with `integer` (decode and verify steps) the integer GEMV over x's int8
        image, made once for all of them; else the exact route (packed weights decoded for cuBLAS: the prefill's
        numerics)."""
        return project(self._input(x, readers, integer), readers, out_dtype=out_dtype)

    @staticmethod
    def _input(x: torch.Tensor, readers: list[PackedLinear], integer: bool) -> torch.Tensor | Int8Activations:
        """x as the matrices `readers` take it: its int8 image, made once, in decode and verify steps (`integer`)."""
        return shared_input(x, readers) if integer else x

    def _linear(self, reader: PackedLinear, x: torch.Tensor, integer: bool,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._linears([reader], x, integer, out_dtype)[0]

    @staticmethod
    def _quantizes(x: torch.Tensor, integer: bool) -> bool:
        """Whether a kernel making x's rows should also make their int8 records: a decode or verify step's input of
        the integer GEMV (at most MAX_GEMV_TOKENS rows)."""
        return integer and x.shape[0] <= MAX_GEMV_TOKENS

    def _quantizes_for(self, reader: PackedLinear, x: torch.Tensor, integer: bool) -> bool:
        """Whether a kernel making x, the input of `reader` alone, should also make x's int8 records: when `reader`
        takes the integer GEMV."""
        return reader.groupwise and self._quantizes(x, integer)

    def _layers(self, x: torch.Tensor, attention, gdn, integer: bool) -> torch.Tensor:
        """The decoder layers and the final norm over embedded tokens x `[T, H]`; the residual adds are fused into
        the next norm. `attention(h, layer)` / `gdn(h, layer)` are the mixers; `integer`: decode-step numerics
        (int8 activations in the GEMVs, MoE experts gathered per token) rather than the prefill's — then h comes
        as `Int8Activations`, quantized by the norm that made it."""
        c = self.config
        quantize = self._quantizes(x, integer)  # the norms emit the GEMVs' int8 records themselves
        x, h = add_rms_norm(x, None, self.vectors["layers/0/input_norm"], c.rms_eps, quantize)
        for i, kind in enumerate(c.layer_types):
            prefix = f"layers/{i}/"
            mixed = attention(h, i) if kind == FULL_ATTENTION else gdn(h, i)
            self._prefetch([prefix + "mlp/gate_up"])
            x, h = add_rms_norm(x, mixed, self.vectors[prefix + "post_attention_norm"], c.rms_eps, quantize)
            following = f"layers/{i + 1}/input_norm" if i + 1 < c.layers else "final_norm"
            mlp = self._mlp(h, prefix, integer)
            self._prefetch(self._inputs_of(i + 1))
            x, h = add_rms_norm(x, mlp, self.vectors[following], c.rms_eps, quantize)
        return h

    def _inputs_of(self, layer: int) -> list[str]:
        """The matrices that read layer `layer`'s normed input (the head's after the last layer)."""
        c = self.config
        if layer == c.layers:
            return ["output_head" if "output_head" in self.linears else "token_embedding"]
        if c.layer_types[layer] == FULL_ATTENTION:
            return [f"layers/{layer}/attention/{n}" for n in ("query_key", "gate_value")]
        return [f"layers/{layer}/gdn/{n}" for n in GDN_PROJECTIONS[:2]]

    def _prefetch(self, names: list[str]) -> None:
        """In a captured step, stream the first L2_PREFETCH_BYTES of the packed matrices `names` (those present)
        into L2 in the step's second branch, from when the kernels launched so far have finished: the small kernels
        launched next run meanwhile, and the GEMV after them reads those rows from L2 (`kernels.l2_prefetch`)."""
        if not (L2_PREFETCH_BYTES and self.branches.side is not None):
            return
        key = tuple(names)
        if key not in self.prefetches:  # made by the eager step before a capture (its ranges are a host copy)
            packed = [self.linears[n] for n in names if n in self.linears and self.linears[n].packed]
            self.prefetches[key] = L2Prefetch([(m.data, m.shape, m.format) for m in packed],
                                              L2_PREFETCH_BYTES) if packed else None
        if self.prefetches[key] is not None and self.branches.active:
            with self.branches.beside():
                prefetch_to_l2(self.prefetches[key])

    def _attention_inputs(self, h: torch.Tensor, layer: int, positions: torch.Tensor, tables: torch.Tensor,
                          integer: bool) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """An attention layer up to its scores, for T rows at `positions`: the query/key and gate/value
        projections, q/k norm + rotary, and the new keys and values written into the pages of `tables` `[T, ·]`.
        Returns q `[T, heads, hd]`, the output gate `[T, heads·hd]` and the layer's (key, value, scale) pools."""
        c, cache = self.config, self.cache
        prefix = f"layers/{layer}/attention/"
        q_rows = c.heads * c.head_dim
        readers = [self.linears[prefix + n] for n in ("query_key", "gate_value")]
        source = self._input(h, readers, integer)
        if shares_launch(source, *readers):
            query_key, gate_value = project(source, readers)
        else:  # two launches: q|k beside gate|v
            with self.branches.beside(self._independent(source, readers)):
                query_key = project(source, readers[:1])[0]
            gate_value = project(source, readers[1:])[0]
        self.branches.join()  # q|k, and the step's positions and block tables
        self._prefetch([prefix + "output"])
        q, k = qk_norm_rope(query_key, self.vectors[prefix + "query_norm"], self.vectors[prefix + "key_norm"],
                            positions, c.heads, c.kv_heads, c.head_dim, c.rotary_dim, self.inv_freq, c.rms_eps)
        v = gate_value[:, q_rows:].view(h.shape[0], c.kv_heads, c.head_dim)
        pools = (cache.key_pages[layer], cache.value_pages[layer], cache.key_scales.get(layer),
                 cache.value_scales.get(layer))
        write_kv(k, v, *pools, tables, positions)
        return q, gate_value[:, :q_rows], pools

    def _attention_decode(self, h: torch.Tensor, layer: int, positions: torch.Tensor, lengths: torch.Tensor,
                          tables: torch.Tensor) -> torch.Tensor:
        c, cache = self.config, self.cache
        q, gate, pools = self._attention_inputs(h, layer, positions, tables, self.int8_activations)
        output = self.linears[f"layers/{layer}/attention/output"]
        # the output gate (and the output projection's int8 records) applied by the kernel that writes the output
        gated = paged_attention_decode(q, *pools, tables, lengths, c.head_dim**-0.5,
                                       max_length=cache.max_pages * cache.page, gate=gate,
                                       quantize=self._quantizes_for(output, gate, self.int8_activations))
        return self._linear(output, gated, self.int8_activations)

    def _gdn_decode(self, h: torch.Tensor, layer: int, slots: torch.Tensor, tokens: int = 1,
                    snapshots: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        prefix = f"layers/{layer}/gdn/"
        value_rows = c.v_heads * c.v_dim
        query_key, value_z, a_b = (self.linears[prefix + n] for n in GDN_PROJECTIONS)
        output = self.linears[prefix + "output"]
        key_columns = query_key.shape[0]
        # q | k and v | z side by side in one buffer: the conv reads q | k | v as one row view
        projected = torch.empty((h.shape[0], key_columns + value_z.shape[0]), dtype=self.dtype, device=self.device)
        source = self._input(h, [query_key, value_z, a_b], self.int8_activations)
        outs = [projected[:, :key_columns], projected[:, key_columns:]]
        one_launch = shares_launch(source, query_key, value_z)
        # the a/b projection, and q|k when it has a launch of its own, beside v|z
        with self.branches.beside(self._independent(source, [query_key, value_z, a_b])):
            if not one_launch:
                project(source, [query_key], outs[:1])
            a_b = self._gdn_a_b(source, a_b)
        project(source, [query_key, value_z] if one_launch else [value_z], outs if one_launch else outs[1:])

        def joined() -> None:
            self.branches.join()
            self._prefetch([prefix + "output"])

        # the branch's a/b is first read by the delta rule: with q|k in v|z's launch, the conv (a launch of its own
        # above one sequence) reads nothing from the branch and runs before the join, under PDL; else q|k, made in
        # the branch, is the conv's input too
        if not one_launch:
            joined()

        index = self.cache.gdn_index[layer]
        o = gated_delta_decode(projected[:, : key_columns + value_rows], projected[:, key_columns + value_rows :], a_b,
                               self.vectors[prefix + "convolution"], self.cache.conv[index],
                               self.vectors[prefix + "a_log"], self.vectors[prefix + "dt_bias"],
                               self.vectors[prefix + "norm"], self.cache.recurrent[index], slots, c.k_heads, c.k_dim,
                               c.v_heads, c.v_dim, c.rms_eps, tokens=tokens, snapshot_slots=snapshots,
                               quantize=self._quantizes_for(output, projected, self.int8_activations),
                               before_delta_rule=joined if one_launch else None)
        return self._linear(output, o, self.int8_activations)

    @staticmethod
    def _independent(x: torch.Tensor | Int8Activations, readers: list[PackedLinear]) -> bool:
        """Whether products of x (or of inputs of its rows) by `readers` may run in two graph branches: none of them
        decodes its matrix into the one scratch buffer (decode steps of more than MAX_GEMV_TOKENS rows do, as do
        steps with exact activations)."""
        return not any(reader.route(x) == "scratch" for reader in readers)

    def _gdn_a_b(self, source: torch.Tensor | Int8Activations,
                 reader: PackedLinear) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The GDN a/b projection of a step's rows, or the pair (x, W) for the delta-rule kernel to compute it. A
        dense a/b (the 27B's 0.5 M bf16 elements) takes the dense GEMV's fixed-order sums on either route, so a
        token's bits never depend on the batch. One row computes it in the delta-rule launch (one launch fewer),
        unless the step runs it in a graph branch of its own (`Branches`), beside the input projections; more rows
        always take the GEMV, since the kernel's programs would each read the rows again (one per column tile)."""
        if reader.weight is None or reader.shape[1] > AB_IN_KERNEL_MAX_K or source.shape[0] > MAX_GEMV_TOKENS:
            return reader(source)
        x = (source.source if isinstance(source, Int8Activations) else source).to(reader.weight.dtype)
        if x.shape[0] == 1 and self.branches.side is None:
            return x, reader.weight
        return dense_linear_gemv(x, reader.weight, self.dtype, pairwise=True)

    def _mlp(self, h: torch.Tensor, prefix: str, integer: bool) -> torch.Tensor:
        """SwiGLU MLP or sparse MoE. With `integer` (decode, verify) every (token, expert) pair goes through the
        gathering GEMV (no host sync: graph-capturable), else tokens are grouped by expert (`_moe_prefill`)."""
        c = self.config
        if not c.moe:
            gate_up = self._linear(self.linears[prefix + "mlp/gate_up"], h, integer)
            self._prefetch([prefix + "mlp/down"])
            down = self.linears[prefix + "mlp/down"]
            return self._linear(down, silu_mul(gate_up, self._quantizes_for(down, gate_up, integer), down.stripes),
                                integer)
        routed_gate_up = self.linears[prefix + "moe/routed_gate_up"]
        routed_down = self.linears[prefix + "moe/routed_down"]
        readers = [self.linears[prefix + "moe/router_shared_gate"], self.linears[prefix + "moe/shared_gate_up"]]
        source = self._input(h, [*readers, routed_gate_up], integer)
        shared_down = self.linears[prefix + "moe/shared_down"]
        # the shared expert beside the routing and the routed experts
        with self.branches.beside(self._independent(source, [*readers, routed_gate_up, shared_down, routed_down])):
            shared_gate_up = readers[1](source)
            shared = self._linear(shared_down, silu_mul(shared_gate_up, self._quantizes_for(
                shared_down, shared_gate_up, integer)), integer)
        logits = readers[0](source)
        weights, ids = route_top_k(logits, c.experts, c.top_k)
        if integer:
            flat = ids.reshape(-1)
            activation = silu_mul(routed_gate_up.gather(source, flat, 2 * c.expert_width, c.top_k),
                                  quantize=routed_down.groupwise)
            routed = routed_down.gather(activation, flat, c.hidden, 1)
        else:
            routed = self._moe_prefill(h, ids, routed_gate_up, routed_down)
        self.branches.join()
        return moe_combine(routed, weights, shared, logits[:, c.experts :])

    def _moe_prefill(self, h: torch.Tensor, ids: torch.Tensor, routed_gate_up: PackedLinear,
                     routed_down: PackedLinear) -> torch.Tensor:
        """Routed experts for many tokens: `[T·k, H]`, row t·k + j = token t through its j-th expert, unweighted.
        Groupwise experts: pairs tiled by expert on the device (`group_pairs`), one grouped launch per matrix.
        Other formats (bf16, fp8 rows): one cuBLAS product per expert hit (the expert counts come to the host once per
        layer; prefill is never graph-captured)."""
        c = self.config
        width = c.expert_width
        pairs = ids.numel()
        if routed_gate_up.groupwise and routed_down.groupwise:
            plan = group_pairs(ids, c.experts, MOE_TILE)
            activation = silu_mul(routed_gate_up.grouped(h, plan, pairs, 2 * width, c.top_k))
            return routed_down.grouped(activation, plan, pairs, c.hidden, 1)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=c.experts).tolist()
        out = torch.empty((pairs, c.hidden), dtype=h.dtype, device=h.device)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            chosen = order[start : start + count]
            start += count
            activation = silu_mul(routed_gate_up.block(h[chosen // c.top_k], expert * 2 * width, 2 * width))
            out[chosen] = routed_down.block(activation, expert * c.hidden, c.hidden)
        return out

    # -- prefill ---------------------------------------------------------------------------------------------

    def _prefill_chunk(self, ids: torch.Tensor, state: SlotState, all_logits: bool) -> torch.Tensor:
        start, tokens = state.length, ids.numel()
        positions = torch.arange(start, start + tokens, device=self.device, dtype=torch.int32)
        x = self.linears["token_embedding"].rows(ids.to(torch.int32))
        h = self._layers(x, lambda h, i: self._attention_prefill(h, i, state, positions),
                         lambda h, i: self._gdn_prefill(h, i, state), integer=False)
        state.length = start + tokens
        # the head reads one row (or few): the integer GEMV, as in decode steps, not a dequantized vocabulary matrix
        logits = self._linear(self.head, h if all_logits else h[-1:], self.int8_activations, torch.float32)
        return logits if all_logits else logits[0]

    def _attention_prefill(self, h: torch.Tensor, layer: int, state: SlotState,
                           positions: torch.Tensor) -> torch.Tensor:
        c, cache = self.config, self.cache
        tokens = h.shape[0]
        tables = cache.block_tables[state.slot : state.slot + 1].expand(tokens, -1)
        q, gate, _ = self._attention_inputs(h, layer, positions, tables, integer=False)
        start = state.length
        keys, values = cache.dense_kv(layer, state, start + tokens, q.dtype)
        o = prefill_attention(q, keys, values, start, c.head_dim**-0.5).reshape(tokens, -1)
        return self.linears[f"layers/{layer}/attention/output"](sigmoid_mul(o, gate))

    def _gdn_prefill(self, h: torch.Tensor, layer: int, state: SlotState) -> torch.Tensor:
        c, cache = self.config, self.cache
        prefix = f"layers/{layer}/gdn/"
        tokens = h.shape[0]
        key_rows, value_rows = c.k_heads * c.k_dim, c.v_heads * c.v_dim
        query_key, value_z, a_b = self._linears([self.linears[prefix + n] for n in GDN_PROJECTIONS], h, integer=False)
        index = cache.gdn_index[layer]
        mixed, window = causal_conv1d(torch.cat([query_key, value_z[:, :value_rows]], dim=1),
                                      self.vectors[prefix + "convolution"], cache.conv[index, state.slot])
        cache.conv[index, state.slot] = window
        q = mixed[:, :key_rows].reshape(tokens, c.k_heads, c.k_dim)
        k = mixed[:, key_rows : 2 * key_rows].reshape(tokens, c.k_heads, c.k_dim)
        v = mixed[:, 2 * key_rows :].reshape(tokens, c.v_heads, c.v_dim)
        a, b = a_b[:, : c.v_heads], a_b[:, c.v_heads :]
        beta = torch.sigmoid(b)
        g = -torch.exp(self.vectors[prefix + "a_log"]) * F.softplus(a.float() + self.vectors[prefix + "dt_bias"])
        repeat = c.v_heads // c.k_heads
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
        o, final = delta_rule_prefill(q, k, v, g, beta, cache.recurrent[index, state.slot].float(), c.k_dim)
        cache.recurrent[index, state.slot] = final  # rounded to a bf16 pool's dtype
        o = rms_norm_gated(o.to(h.dtype), value_z[:, value_rows:].reshape(tokens, c.v_heads, c.v_dim),
                           self.vectors[prefix + "norm"], c.rms_eps)
        return self.linears[prefix + "output"](o.reshape(tokens, value_rows))
