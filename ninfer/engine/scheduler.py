"""The serving engine: a bounded FIFO queue, admission by context budget, continuous batching with chunked prefill
interleaved with decode, prefix reuse, cancellation; consumed through an async generator per request.

    engine = Engine(llm, max_concurrency=8, max_pending=64)
    async for event in engine.generate(Request(prompt_ids, params, thinking=True, tools_enabled=False)):
        ...   # ReasoningDelta / ContentDelta / ToolCall as decided, then Finished(result)

One worker thread owns the model. Each scheduler step gives every running sequence one unit of work: the next
prefill chunk or one decode step, each with its own sampling parameters. While other sequences decode, a prefill
chunk is at most `prefill_chunk` tokens, so a long prompt never stalls the running streams for long; with no stream
to hold up, a prompt goes to the model up to its next turn boundary at once (the model splits it into its own,
larger prefill chunks), so a request alone gets its first token at the model's full prefill rate. Admission is first
come, first served: a request enters when a running slot is free and the context budget (`kv_capacity` tokens over
all running sequences, prompt plus output budget reserved up front) has room for it; the queue holds at most
`max_pending` requests (more: QueueFullError) and a request that waits longer than `queue_timeout` seconds gets
QueueTimeoutError. Closing the generator (a client that disconnects) cancels the sequence and frees its memory at
the next step.

Prefix reuse (PrefixCache): the full sequence state (KV rows, GDN conv and recurrent state) is snapshotted at turn
boundaries of a prompt (after each `<|im_end|>` and before the generation prompt) — the recurrent state cannot be
cut back, so a prefix can only be reused where a snapshot was taken. A new request resumes from its longest cached
boundary and prefills the rest; prefill chunks always break at boundaries, so a reused prefix gives the logits of a
fresh prefill chunked the same way. Snapshots live in a bounded LRU pool (on the model's device, spilling to pinned
host memory), and usage reports the reused tokens as cached.
"""
from __future__ import annotations

import asyncio
import hashlib
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ninfer.devices import synchronize
from ninfer.engine.llm import LLM, Finished, PromptTooLongError
from ninfer.engine.output import Completion, OutputPipeline, sample_rows
from ninfer.errors import NinferError
from ninfer.sampling import SamplingParams


class QueueFullError(NinferError):
    """The waiting queue already holds `max_pending` requests."""


class QueueTimeoutError(NinferError):
    """The request waited longer than `queue_timeout` seconds for a slot."""


class EngineClosedError(NinferError):
    """The engine is shutting down and takes no more work."""


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    thinking: bool = True  # the prompt's generation prompt opened <think>: the output starts as reasoning
    tools_enabled: bool = False  # parse <tool_call> blocks
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])


# The result of a request is the Completion of its output pipeline; its `stats` carry the token counts and the
# queue / prefill / decode timings (cached_tokens: prompt tokens resumed from the prefix cache).
Result = Completion


@dataclass
class _Snapshot:
    """A sequence's whole state after `length` prompt tokens (KV rows, conv and recurrent state), as the model's
    `snapshot` gives it: tensors, and on the fast path a lease on shared KV pages (not a tensor: it stays on the
    device, is not counted in the cache's byte budgets and passes through moves unchanged)."""

    length: int
    tensors: dict[tuple[str, int], Any]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values() if isinstance(t, torch.Tensor))

    def to(self, device: torch.device | str, pin: bool = False) -> _Snapshot:
        moved = {}
        for key, value in self.tensors.items():
            if isinstance(value, torch.Tensor):  # to pinned memory in one copy, not through a pageable one
                target = torch.empty(value.shape, dtype=value.dtype, device=device, pin_memory=pin)
                value = target.copy_(value)
            moved[key] = value
        return _Snapshot(self.length, moved)


PREFIX_CACHE_CPU_BYTES = 256 << 20
PREFIX_CACHE_MAX_BYTES = 8 << 30


class PrefixCache:
    """Snapshots of sequence states keyed by the exact token prefix they follow; LRU within two byte budgets:
    on the model's device, then (CUDA only) in pinned host memory, then dropped."""

    def __init__(self, device: torch.device, device_bytes: int, host_bytes: int):
        self.device = device
        self.device_bytes = device_bytes
        self.host_bytes = host_bytes if device.type == "cuda" else 0
        self._device: OrderedDict[bytes, _Snapshot] = OrderedDict()
        self._host: OrderedDict[bytes, _Snapshot] = OrderedDict()
        self.hits = 0

    @staticmethod
    def key(ids: list[int]) -> bytes:
        return hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).digest()

    def __contains__(self, key: bytes) -> bool:
        return key in self._device or key in self._host

    def put(self, key: bytes, snapshot: _Snapshot) -> None:
        if snapshot.nbytes > self.device_bytes:
            return
        self._device[key] = snapshot
        self._device.move_to_end(key)
        while sum(s.nbytes for s in self._device.values()) > self.device_bytes:
            old_key, old = self._device.popitem(last=False)
            if self.host_bytes and old.nbytes <= self.host_bytes:
                self._host[old_key] = old.to("cpu", pin=True)
        while sum(s.nbytes for s in self._host.values()) > self.host_bytes:
            self._host.popitem(last=False)

    def get(self, key: bytes) -> _Snapshot | None:
        if key in self._device:
            self._device.move_to_end(key)
            return self._device[key]
        if key in self._host:
            snapshot = self._host.pop(key).to(self.device)
            self.put(key, snapshot)
            return snapshot
        return None

    def __len__(self) -> int:
        return len(self._device) + len(self._host)

    def drop_oldest(self) -> bool:
        """Forget the least recently used snapshot (host first): the model needs the KV pages it holds."""
        for store in (self._host, self._device):
            if store:
                store.popitem(last=False)
                return True
        return False


class _Sequence:
    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.request = request
        self.loop = loop
        self.queue = queue
        self.enqueued = time.perf_counter()
        self.cancelled = False
        self.finished = False
        self.state: Any = None  # the model's sequence state (SequenceState or the fast path's SlotState)
        self.output: OutputPipeline | None = None
        self.position = 0  # prompt tokens in the state
        self.boundaries: set[int] = set()
        self.logits: torch.Tensor | None = None
        self.reserved = 0
        self.prefill_started = 0.0
        self.decode_started = 0.0

    def send(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is left to tell
            self.cancelled = True


class Engine:
    """See the module docstring."""

    def __init__(self, llm: LLM, *, max_concurrency: int = 8, max_pending: int = 64, queue_timeout: float = 60.0,
                 prefill_chunk: int = 256, kv_capacity: int | None = None, prefix_cache_bytes: int | None = None,
                 host_cache_bytes: int = 1 << 30):
        if max_concurrency < 1 or max_pending < 0 or prefill_chunk < 1:
            raise ValueError("max_concurrency and prefill_chunk must be positive, max_pending non-negative")
        self.llm = llm
        self.max_concurrency = max_concurrency
        self.max_pending = max_pending
        self.queue_timeout = queue_timeout
        self.prefill_chunk = prefill_chunk
        slots = getattr(llm.model, "max_batch", None)  # the fast path decodes at most this many sequences
        if slots is not None and max_concurrency > slots:
            raise NinferError(f"max_concurrency {max_concurrency} exceeds the model's {slots} sequence slots "
                              "(load it with max_sequences >= max_concurrency)")
        model_capacity = getattr(llm.model, "kv_capacity", None)
        self.kv_capacity = kv_capacity or model_capacity or max_concurrency * llm.max_context
        if model_capacity is not None and self.kv_capacity > model_capacity:
            raise NinferError(f"kv_capacity {self.kv_capacity} exceeds the {model_capacity} tokens of the model's "
                              "KV pool")
        if prefix_cache_bytes is None:
            prefix_cache_bytes = self.default_prefix_cache_bytes(llm.device)
        self.cache = PrefixCache(llm.device, prefix_cache_bytes, host_cache_bytes)
        pool = getattr(llm.model, "cache", None)
        if pool is not None:  # the fast path's KV pool: snapshots hold pages it may need back
            pool.reclaim = self.cache.drop_oldest
        im_end = llm.tokenizer.im_end_id
        self._boundary_ids = {im_end} if im_end is not None else set()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._reserved = 0
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    @staticmethod
    def default_prefix_cache_bytes(device: torch.device) -> int:
        """The device budget of the prefix cache when none is given: on CUDA a quarter of the memory still free
        once the model and its pools are loaded, at most PREFIX_CACHE_MAX_BYTES (a 27B snapshot holds 151 MB of
        GDN state: 256 MB kept one, and every new one spilled the last to host memory); elsewhere
        PREFIX_CACHE_CPU_BYTES."""
        if device.type != "cuda":
            return PREFIX_CACHE_CPU_BYTES
        free, _ = torch.cuda.mem_get_info(device)
        return min(PREFIX_CACHE_MAX_BYTES, free // 4)

    @staticmethod
    def plan_kv_capacity(llm: LLM, max_concurrency: int, margin: float = 0.1) -> int:
        """`--kv-capacity auto`: context tokens for all running sequences. On the CPU, every sequence may use the
        full context. On CUDA, what the free device memory holds after a `margin` fraction is kept back: KV rows
        of the attention layers per token, plus each sequence's fixed GDN conv and recurrent state."""
        ceiling = max_concurrency * llm.max_context
        if getattr(llm.model, "kv_capacity", None) is not None:  # the fast path planned its pool at load
            return min(ceiling, llm.model.kv_capacity)
        if llm.device.type != "cuda":
            return ceiling
        c = llm.model.config
        element = torch.empty((), dtype=llm.dtype).element_size()
        attention_layers = sum(1 for t in c.layer_types if t == "full_attention")
        per_token = attention_layers * 2 * c.kv_heads * c.head_dim * element
        gdn_layers = c.layers - attention_layers
        per_sequence = gdn_layers * (c.v_heads * c.k_dim * c.v_dim * 4 + c.conv_dim * (c.conv_kernel - 1) * element)
        free, _ = torch.cuda.mem_get_info(llm.device)
        usable = int(free * (1 - margin)) - max_concurrency * per_sequence
        if usable <= per_token * llm.max_context:
            raise NinferError(f"only {free / 2**30:.1f} GiB of device memory is free: not enough for one sequence "
                              f"of {llm.max_context} tokens; lower --max-context or --max-concurrency")
        return min(ceiling, usable // per_token)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="ninfer-engine", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def stats(self) -> dict[str, int]:
        with self._wake:
            return {"running": len(self._running), "waiting": len(self._waiting), "reserved_tokens": self._reserved,
                    "cached_prefixes": len(self.cache), "prefix_hits": self.cache.hits}

    # -- requests ----------------------------------------------------------------------------------------------

    async def generate(self, request: Request) -> AsyncIterator[Any]:
        """Events of one request (see the module docstring); raises QueueFullError, QueueTimeoutError or
        PromptTooLongError before the first event."""
        self.llm.check_prompt(request.prompt_ids)
        if len(request.prompt_ids) + 1 > self.kv_capacity:
            raise PromptTooLongError(f"the prompt has {len(request.prompt_ids)} tokens; the engine's KV capacity "
                                     f"is {self.kv_capacity} tokens")
        if self._stop:
            raise EngineClosedError("the engine is shutting down")
        sequence = _Sequence(request, asyncio.get_running_loop(), asyncio.Queue())
        with self._wake:
            if len(self._waiting) >= self.max_pending and len(self._running) >= self.max_concurrency:
                raise QueueFullError(f"the queue is full ({self.max_pending} waiting requests)")
            self._waiting.append(sequence)
            self._wake.notify_all()
        try:
            while True:
                item = await sequence.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if isinstance(item, Finished):
                    return
        finally:
            if not sequence.finished:
                with self._wake:
                    sequence.cancelled = True
                    self._wake.notify_all()

    # -- the worker --------------------------------------------------------------------------------------------

    def _work(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    if self._stop:
                        break
                    self._admit()
                    if not self._running:
                        self._wake.wait(timeout=0.05)
                        continue
                    running = list(self._running)
                sampling = []
                # a prompt is prefilled in short chunks only while some stream is decoding
                shared = any(s.position >= len(s.request.prompt_ids) for s in running if not s.cancelled)
                for sequence in running:
                    if sequence.cancelled:
                        self._release(sequence)
                        continue
                    try:
                        if self._advance(sequence, shared):
                            sampling.append(sequence)
                    except Exception as exc:  # a failing request must not stop the engine
                        sequence.send(exc)
                        self._release(sequence)
                decoding = self._sample(sampling) if sampling else []
                if decoding:
                    self._decode(decoding)
        for sequence in list(self._running) + list(self._waiting):
            sequence.send(EngineClosedError("the engine is shutting down"))

    def _admit(self) -> None:
        """FIFO admission under the lock: expire and drop cancelled waiters, then admit from the front while a
        slot and the context budget allow."""
        now = time.perf_counter()
        for sequence in list(self._waiting):
            if sequence.cancelled:
                self._waiting.remove(sequence)
            elif now - sequence.enqueued > self.queue_timeout:
                self._waiting.remove(sequence)
                sequence.finished = True
                sequence.send(QueueTimeoutError(f"waited more than {self.queue_timeout:g} s for a free slot"))
        while self._waiting and len(self._running) < self.max_concurrency:
            sequence = self._waiting[0]
            request = sequence.request
            need = self._budget(request)
            if self._reserved + need > self.kv_capacity:
                break
            self._waiting.popleft()
            sequence.reserved = need
            self._reserved += need
            self._start(sequence, need)
            self._running.append(sequence)

    def _budget(self, request: Request) -> int:
        """Context tokens reserved for a request: prompt plus output budget, within the context and KV capacity,
        rounded up to whole KV pages on the fast path."""
        need = min(self.llm.max_context, self.kv_capacity, len(request.prompt_ids) + request.params.max_tokens)
        page = getattr(self.llm.model, "page", 1)
        return -(-need // page) * page

    def _start(self, sequence: _Sequence, capacity: int) -> None:
        request = sequence.request
        ids = request.prompt_ids
        llm = self.llm
        sequence.state = llm.model.new_state(capacity)
        sequence.output = OutputPipeline(llm.tokenizer, request.params, torch.tensor(ids, device=llm.device),
                                         thinking=request.thinking, tools_enabled=request.tools_enabled,
                                         device=llm.device)
        sequence.output.completion.stats.prompt_tokens = len(ids)
        sequence.output.completion.stats.queue_seconds = time.perf_counter() - sequence.enqueued
        # turn boundaries: right after each <|im_end|> (never the whole prompt: its last logits are needed)
        sequence.boundaries = {i + 1 for i, t in enumerate(ids[:-1]) if t in self._boundary_ids}
        for boundary in sorted(sequence.boundaries, reverse=True):
            snapshot = self.cache.get(PrefixCache.key(ids[:boundary]))
            if snapshot is not None:
                llm.model.restore(sequence.state, snapshot.length, snapshot.tensors)
                sequence.position = boundary
                sequence.output.completion.stats.cached_tokens = boundary
                self.cache.hits += 1
                break
        sequence.prefill_started = time.perf_counter()

    def _release(self, sequence: _Sequence) -> None:
        with self._wake:
            if sequence in self._running:
                self._running.remove(sequence)
                self._reserved -= sequence.reserved
            sequence.state = None  # frees the KV and recurrent state
            sequence.finished = True
            self._wake.notify_all()

    def _advance(self, sequence: _Sequence, shared: bool) -> bool:
        """The sequence's next prefill chunk, if any: up to its next turn boundary, at most `prefill_chunk` tokens
        when the step is `shared` with decoding streams; True when it has logits to sample from — after a decode
        step, or after the prompt's last chunk in this very step (taken for all such sequences together by
        `_sample`)."""
        model = self.llm.model
        ids = sequence.request.prompt_ids
        state = sequence.state
        assert state is not None and sequence.output is not None
        if sequence.position >= len(ids):
            return True
        end = min((b for b in sequence.boundaries if b > sequence.position), default=len(ids))
        if shared:
            end = min(end, sequence.position + self.prefill_chunk)
        chunk = torch.tensor(ids[sequence.position : end], device=self.llm.device)
        logits = model.forward(chunk, state)
        sequence.position = end
        if end in sequence.boundaries:
            key = PrefixCache.key(ids[:end])
            if key not in self.cache:
                self.cache.put(key, _Snapshot(state.length, model.snapshot(state)))
        if end == len(ids):
            sequence.logits = logits
            synchronize(self.llm.device)
            sequence.output.completion.stats.prefill_seconds = time.perf_counter() - sequence.prefill_started
            sequence.decode_started = time.perf_counter()
            return True
        return False

    def _sample(self, sequences: list[_Sequence]) -> list[_Sequence]:
        """The next token of every sequence with fresh logits, sampled together (one device round trip), and its
        events; returns the sequences that go on to a decode step."""
        outputs = [s.output for s in sequences]
        try:
            tokens = sample_rows(outputs, torch.stack([s.logits for s in sequences]))
        except Exception as exc:  # the batch failed: fail its requests, keep the engine
            for sequence in sequences:
                sequence.send(exc)
                self._release(sequence)
            return []
        decoding = []
        for sequence, token in zip(sequences, tokens, strict=True):
            state, output = sequence.state, sequence.output
            try:
                for event in output.advance(token, state.capacity - state.length):
                    sequence.send(event)
            except Exception as exc:  # this request's sampling or text pipeline failed: fail it alone
                sequence.send(exc)
                self._release(sequence)
                continue
            if output.done:
                stats = output.completion.stats
                stats.generated_tokens = len(output.completion.token_ids)
                stats.decode_seconds = time.perf_counter() - sequence.decode_started
                sequence.finished = True
                sequence.send(Finished(output.completion))
                self._release(sequence)
            else:
                decoding.append(sequence)
        return decoding

    def _decode(self, sequences: list[_Sequence]) -> None:
        """One decode step for every sequence that sampled a token: one batched forward of the model."""
        tokens = torch.tensor([s.output.completion.token_ids[-1] for s in sequences], device=self.llm.device)
        try:
            logits = self.llm.model.decode_batch([s.state for s in sequences], tokens)
        except Exception as exc:  # the batch failed: fail its requests, keep the engine
            for sequence in sequences:
                sequence.send(exc)
                self._release(sequence)
            return
        for sequence, row in zip(sequences, logits, strict=True):
            sequence.logits = row
