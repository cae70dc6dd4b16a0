"""The engine: the one generation loop of the product. A bounded FIFO queue, admission by context budget,
continuous batching with prefill pieces interleaved with decode steps, prefix reuse, cancellation.

    engine = Engine(llm, SchedulerConfig(max_concurrency=8, max_pending=64)).start()
    async for event in engine.generate(Request(prompt_ids, params, thinking=True, tools_enabled=False)):
        ...   # ReasoningDelta / ContentDelta / ToolCall as decided, then Finished(result)

`step()` runs one scheduler step (`scheduler.plan_step`): the next prefill piece or one decode step of every
running sequence, each with its own sampling parameters, all decode steps in one batched model call. With
speculative decoding (`SpeculativeConfig`) a decoding sequence's step is a round instead (`speculative`: draft,
verify, accept), rounds of one draft length batched together beside the plain steps of the others. A server runs
`step()` on the engine's own thread (`start`); `LLM.stream` runs it in the caller's thread (`submit` + `step`).
The engine holds at most `max_concurrency + max_pending` requests, running or waiting (more: QueueFullError at
`submit`), and a request that waits longer than `queue_timeout` seconds gets QueueTimeoutError. Closing a request's
stream (a client that disconnects) cancels the sequence and frees its memory at the next step.

Prefix reuse (`prefix_cache.PrefixCache`): the sequence state is snapshotted at turn boundaries of a prompt (after
each `<|im_end|>` and before the generation prompt); a new request resumes from its longest cached boundary and
prefills the rest. Prefill pieces always break at boundaries, so a reused prefix gives the logits of a fresh
prefill split the same way; usage reports the reused tokens as cached.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ninfer.config import SchedulerConfig, SpeculativeConfig
from ninfer.devices import synchronize
from ninfer.engine import scheduler
from ninfer.engine.output import OutputPipeline, sample_rows
from ninfer.engine.prefix_cache import PrefixCache, Snapshot, default_prefix_cache_bytes
from ninfer.engine.sequence import Finished, Request, Sequence
from ninfer.engine.speculative import DraftLength, SpeculationStats, run_round
from ninfer.errors import NinferError
from ninfer.kernels.sampling import BROKEN_LOGITS, NOTHING_SAMPLABLE
from ninfer.sampling import SamplingError

if TYPE_CHECKING:
    from ninfer.engine.llm import LLM


class PromptTooLongError(NinferError):
    """The prompt (plus one generated token) does not fit in the context."""


class QueueFullError(NinferError):
    """The engine already holds `max_concurrency + max_pending` requests, running or waiting."""


class QueueTimeoutError(NinferError):
    """The request waited longer than `queue_timeout` seconds for a slot."""


class EngineClosedError(NinferError):
    """The engine is shutting down and takes no more work."""


class Engine:
    """See the module docstring. `llm` gives the loaded model (`model`, through the `Model` protocol), its tokenizer
    and context."""

    def __init__(self, llm: LLM, config: SchedulerConfig | None = None, *, speculative: SpeculativeConfig | None = None,
                 prefix_cache_bytes: int | None = None, host_cache_bytes: int = 1 << 30):
        self.llm = llm
        self.model = llm.model
        self.config = config = config or SchedulerConfig()
        self.speculative = speculative or SpeculativeConfig()
        self._speculating = self.speculative.spec != "none"
        # chooses each round's draft length when none is fixed, from measured round and plain-step times
        self._draft_length = DraftLength() if self._speculating and not self.speculative.draft_tokens else None
        slots = self.model.max_batch
        if slots is not None and config.max_concurrency > slots:
            raise NinferError(f"max_concurrency {config.max_concurrency} exceeds the model's {slots} sequence slots "
                              "(load it with sequences >= max_concurrency)")
        self.kv_capacity = self.model.kv_capacity
        if prefix_cache_bytes is None:
            prefix_cache_bytes = default_prefix_cache_bytes(llm.device)
        self.cache = PrefixCache(llm.device, prefix_cache_bytes, host_cache_bytes,
                                 release=lambda snapshot: self.model.release_snapshot(snapshot.tensors))
        self.model.set_reclaim(self.cache.drop_oldest)  # snapshots hold pool pages the model may need back
        im_end = llm.tokenizer.im_end_id
        self._boundary_ids = {im_end} if im_end is not None else set()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._reserved = 0
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> Engine:
        """Run the generation loop on the engine's own thread (a server's mode)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="ninfer-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def threaded(self) -> bool:
        return self._thread is not None

    def close(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        for sequence in list(self._running):
            self._release(sequence)

    def stats(self) -> dict[str, int]:
        with self._wake:
            return {"running": len(self._running), "waiting": len(self._waiting), "reserved_tokens": self._reserved,
                    "cached_prefixes": len(self.cache), "prefix_hits": self.cache.hits}

    # -- requests ----------------------------------------------------------------------------------------------

    def submit(self, request: Request, deliver: Any) -> Sequence:
        """Queue a request whose events go to `deliver(item)`; raises PromptTooLongError, EngineClosedError or
        QueueFullError at once."""
        self.llm.check_prompt(request.prompt_ids)
        if len(request.prompt_ids) + 1 > self.kv_capacity:
            raise PromptTooLongError(f"the prompt has {len(request.prompt_ids)} tokens; the engine's KV capacity "
                                     f"is {self.kv_capacity} tokens")
        if self._stop:
            raise EngineClosedError("the engine is shutting down")
        sequence = Sequence(request, deliver)
        with self._wake:
            # running + waiting, not the waiting alone: a burst arrives faster than `step` admits, and the excess
            # must be refused now, not left to wait out the queue timeout
            held = sum(not s.cancelled for s in (*self._running, *self._waiting))
            limit = self.config.max_concurrency + self.config.max_pending
            if held >= limit:
                raise QueueFullError(f"{held} requests running or waiting, the most it takes: "
                                     f"{self.config.max_concurrency} running + {self.config.max_pending} waiting")
            self._waiting.append(sequence)
            self._wake.notify_all()
        return sequence

    def cancel(self, sequence: Sequence) -> None:
        """Stop a sequence (its memory is freed at the next step); a no-op once it has finished."""
        if not sequence.finished:
            with self._wake:
                sequence.cancelled = True
                self._wake.notify_all()

    async def generate(self, request: Request) -> AsyncIterator[Any]:
        """Events of one request, consumed on an event loop while the engine runs on its thread (see the module
        docstring); raises QueueFullError, QueueTimeoutError or PromptTooLongError before the first event."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        sequence = self.submit(request, lambda item: loop.call_soon_threadsafe(events.put_nowait, item))
        try:
            while True:
                item = await events.get()
                last = _ends(item)
                yield item
                if last:
                    return
        finally:
            self.cancel(sequence)

    def stream(self, request: Request) -> Iterator[Any]:
        """Events of one request, consumed in this thread: on the engine's thread when it runs one, else by running
        the steps here."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        sequence = self.submit(request, events.put)
        try:
            while True:
                if self.threaded:
                    item = events.get()
                else:
                    while events.empty():
                        if not self.step() and events.empty():
                            raise NinferError("the engine has no work it can run for this request")
                    item = events.get()
                last = _ends(item)
                yield item
                if last:
                    return
        finally:
            self.cancel(sequence)
            if not self.threaded and sequence.cancelled:
                self.step()  # frees the cancelled sequence's memory now

    # -- the generation loop -----------------------------------------------------------------------------------

    def _work(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    if self._stop:
                        break
                if not self.step():
                    with self._wake:
                        if not self._stop:
                            self._wake.wait(timeout=0.05)
        for sequence in list(self._running) + list(self._waiting):
            sequence.send(EngineClosedError("the engine is shutting down"))

    def step(self) -> bool:
        """One scheduler step; False when no sequence was running."""
        with self._wake:
            self._admit()
            running = list(self._running)
        if not running:
            return False
        plan = scheduler.plan_step(running, self.config.interleaved_prefill_chunk)
        with torch.inference_mode():
            for sequence in plan.cancelled:
                self._release(sequence)
            for sequence, start, end in plan.prefills:
                try:
                    self._prefill(sequence, start, end)
                except Exception as exc:  # a failing request must not stop the engine
                    sequence.send(exc)
                    self._release(sequence)
            ready = [s for s in plan.sampling if not s.finished]
            fresh = [s for s in ready if s.logits is not None]
            held = [s for s in ready if s.logits is None]  # they hold a round's last token, not logits
            going = (self._sample(fresh) if fresh else []) + held
            if going:
                self._advance(going)
        return True

    def _admit(self) -> None:
        """Under the lock: expire and drop cancelled waiters, then admit from the front (`scheduler.admit`)."""
        now = time.perf_counter()
        for sequence in list(self._waiting):
            if sequence.cancelled:
                self._waiting.remove(sequence)
            elif now - sequence.enqueued > self.config.queue_timeout:
                self._waiting.remove(sequence)
                sequence.finished = True
                sequence.send(QueueTimeoutError(f"waited more than {self.config.queue_timeout:g} s for a free slot"))
        limits = [scheduler.budget(len(s.request.prompt_ids), s.request.params.max_tokens, self.llm.max_context,
                                   self.kv_capacity) for s in self._waiting]
        needs = [scheduler.reservation(limit, self.model.page) for limit in limits]
        count = scheduler.admit(needs, len(self._running), self._reserved,
                                max_concurrency=self.config.max_concurrency, kv_capacity=self.kv_capacity)
        for limit, need in zip(limits[:count], needs[:count], strict=True):
            sequence = self._waiting.popleft()
            sequence.limit, sequence.reserved = limit, need
            self._reserved += need
            self._running.append(sequence)
            try:
                self._start(sequence)
            except Exception as exc:  # e.g. the model's pools are full: fail this request alone
                sequence.send(exc)
                self._release(sequence)

    def _start(self, sequence: Sequence) -> None:
        request = sequence.request
        ids = request.prompt_ids
        llm = self.llm
        sequence.state = self.model.new_state(sequence.reserved)
        sequence.output = OutputPipeline(llm.tokenizer, request.params, torch.tensor(ids, device=llm.device),
                                         thinking=request.thinking, tools_enabled=request.tools_enabled,
                                         device=llm.device)
        stats = sequence.output.completion.stats
        stats.prompt_tokens = len(ids)
        stats.queue_seconds = time.perf_counter() - sequence.enqueued
        # turn boundaries: right after each <|im_end|> (never the whole prompt: its last logits are needed)
        sequence.boundaries = {i + 1 for i, t in enumerate(ids[:-1]) if t in self._boundary_ids}
        for boundary in sorted(sequence.boundaries, reverse=True):
            snapshot = self.cache.get(PrefixCache.key(ids[:boundary]))
            if snapshot is not None:
                self.model.restore(sequence.state, snapshot.length, snapshot.tensors)
                sequence.position = boundary
                stats.cached_tokens = boundary
                self.cache.hits += 1
                break
        sequence.prefill_started = time.perf_counter()

    def _release(self, sequence: Sequence) -> None:
        with self._wake:
            if sequence in self._running:
                self._running.remove(sequence)
                self._reserved -= sequence.reserved
            if sequence.state is not None:
                self.model.free_state(sequence.state)
                sequence.state = None
            sequence.finished = True
            self._wake.notify_all()

    def _prefill(self, sequence: Sequence, start: int, end: int) -> None:
        """Prompt tokens [start, end) into the sequence's state; a snapshot at a turn boundary; at the prompt's end
        the logits to sample its first token from."""
        ids = sequence.request.prompt_ids
        logits = self.model.prefill(torch.tensor(ids[start:end], device=self.llm.device), sequence.state)
        sequence.position = end
        if end in sequence.boundaries:
            key = PrefixCache.key(ids[:end])
            if key not in self.cache:
                self.cache.put(key, Snapshot(sequence.state.length, self.model.snapshot(sequence.state)))
        if end == len(ids):
            sequence.logits = logits
            synchronize(self.llm.device)
            sequence.output.completion.stats.prefill_seconds = time.perf_counter() - sequence.prefill_started
            sequence.decode_started = time.perf_counter()

    def _sample(self, sequences: list[Sequence]) -> list[Sequence]:
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
        going = []
        for sequence, token in zip(sequences, tokens, strict=True):
            sequence.logits = None
            if self._take(sequence, token, sequence.limit - sequence.state.length):
                going.append(sequence)
        return going

    def _take(self, sequence: Sequence, token: Any, free: int) -> bool:
        """Give a sampled token (or its SamplingError) to the sequence's output and send the events it decides;
        `free`: context positions still free before the token is fed. False when the sequence ended here."""
        output = sequence.output
        try:
            for event in output.advance(token, free):
                sequence.send(event)
        except Exception as exc:  # this request's sampling or text pipeline failed: fail it alone
            sequence.send(exc)
            self._release(sequence)
            return False
        if not output.done:
            return True
        stats = output.completion.stats
        stats.generated_tokens = len(output.completion.token_ids)
        stats.decode_seconds = time.perf_counter() - sequence.decode_started
        self._release(sequence)
        sequence.send(Finished(output.completion))
        return False

    def _advance(self, sequences: list[Sequence]) -> None:
        """Feed every sequence's last token: speculating sequences in rounds of their draft length (grouped by
        it), the others in one decode step."""
        plain, rounds = [], {}
        for sequence in sequences:
            k = self._round_length(sequence) if self._speculating else 0
            if k:
                rounds.setdefault(k, []).append(sequence)
            else:
                plain.append(sequence)
        if plain:
            seconds = self._decode(plain)
            if self._draft_length is not None and seconds is not None:
                self._draft_length.measured(0, seconds)
        for k, group in rounds.items():
            self._round(group, k)

    def _round_length(self, sequence: Sequence) -> int:
        """Drafts for the sequence's next round: the fixed or chosen length, within its output budget and the
        context it reserved (a round puts K+1 tokens into the state); 0: a plain step, counted as a fallback."""
        stats = sequence.output.completion.stats
        if stats.speculation is None:
            stats.speculation = SpeculationStats()
        room = min(sequence.request.params.max_tokens - len(sequence.output.completion.token_ids),
                   sequence.limit - sequence.state.length - 1)
        k = min(room, self.speculative.draft_tokens or self._draft_length.choose(stats.speculation))
        if k < 1:
            stats.speculation.fallback_steps += 1
        return max(k, 0)

    def _decode(self, sequences: list[Sequence]) -> float | None:
        """One decode step for every sequence that sampled a token: one batched call of the model. Returns its
        seconds (None when it failed)."""
        tokens = torch.tensor([s.output.completion.token_ids[-1] for s in sequences], device=self.llm.device)
        try:
            started = time.perf_counter()
            logits = self.model.decode([s.state for s in sequences], tokens)
            if self._draft_length is not None:  # the step is timed against the rounds: wait for its end
                synchronize(self.llm.device)
            seconds = time.perf_counter() - started
        except Exception as exc:  # the batch failed: fail its requests, keep the engine
            for sequence in sequences:
                sequence.send(exc)
                self._release(sequence)
            return None
        for sequence, row in zip(sequences, logits, strict=True):
            sequence.logits = row
        return seconds

    def _round(self, sequences: list[Sequence], k: int) -> None:
        """One speculative round of K drafts for these sequences (`speculative.run_round`), then their emitted
        tokens one by one, each with the free context plain decoding would have had when sampling it."""
        tokens = torch.tensor([s.output.completion.token_ids[-1] for s in sequences], device=self.llm.device)
        rows = [s.output.sampling_inputs() for s in sequences]
        try:
            started = time.perf_counter()  # run_round reads its results back: the device work is done after it
            results = run_round(self.model, [s.state for s in sequences], tokens, k, self.llm.tokenizer.vocab_size,
                                rows)
            seconds = time.perf_counter() - started
        except Exception as exc:  # the batch failed: fail its requests, keep the engine
            for sequence in sequences:
                sequence.send(exc)
                self._release(sequence)
            return
        if self._draft_length is not None:
            self._draft_length.measured(k, seconds)
        for sequence, (accepted, emitted, broken, empty) in zip(sequences, results, strict=True):
            sequence.output.completion.stats.speculation.record(k, accepted)
            if broken or empty:
                self._take(sequence, SamplingError(BROKEN_LOGITS if broken else NOTHING_SAMPLABLE.format(
                    self.llm.tokenizer.vocab_size)), 0)
                continue
            start = sequence.state.length - len(emitted)  # the length before the round
            for j, token in enumerate(emitted, 1):
                if not self._take(sequence, token, sequence.limit - (start + j)):
                    break


def _ends(item: Any) -> bool:
    """Whether an item of a request's queue is its last: Finished, or an exception (raised here)."""
    if isinstance(item, Exception):
        raise item
    return isinstance(item, Finished)
