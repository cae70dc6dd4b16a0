"""The scheduler: a pure plan of what each engine step does, from the sequences' positions alone (no model, no
threads, no clocks), so that its policy is testable by itself.

Admission (`admit`) is first come, first served: the front request enters while a running slot is free and the
context budget (`kv_capacity` positions over all running sequences, prompt plus output budget reserved up front,
in whole pages) has room for it. Each step (`plan_step`) gives every running sequence one unit of work: its next
prefill piece or one decode step. A prefill piece ends at the prompt's next turn boundary (where a prefix snapshot
is taken), and while some other sequence is decoding it is at most `interleaved_chunk` tokens, so that a long prompt
never stalls the running streams for long; with no stream to hold up, the piece goes to the model whole (the model
splits it into its own prefill chunks), so a request alone gets its first token at the model's full prefill rate.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ninfer.engine.sequence import Sequence as EngineSequence


def budget(prompt_tokens: int, max_tokens: int, max_context: int, kv_capacity: int) -> int:
    """Context positions a request may fill: its prompt plus its output budget, within the context and the KV
    capacity."""
    return min(max_context, kv_capacity, prompt_tokens + max_tokens)


def reservation(limit: int, page: int) -> int:
    """KV positions reserved for a sequence of `limit` positions: whole pages."""
    return -(-limit // page) * page


def admit(waiting: Iterable[int], running: int, reserved: int, *, max_concurrency: int, kv_capacity: int) -> int:
    """How many requests at the front of the queue enter now, given their reservations `waiting` (in queue order),
    the number `running` and the positions `reserved` by them."""
    admitted = 0
    for need in waiting:
        if running + admitted >= max_concurrency or reserved + need > kv_capacity:
            break
        reserved += need
        admitted += 1
    return admitted


@dataclass
class StepPlan:
    """One engine step: sequences to drop (cancelled), prefill pieces `(sequence, start, end)` of prompt tokens,
    and the sequences that sample a token after them (those already decoding, then those whose prompt the step
    completes), each in running order."""

    cancelled: list[EngineSequence] = field(default_factory=list)
    prefills: list[tuple[EngineSequence, int, int]] = field(default_factory=list)
    sampling: list[EngineSequence] = field(default_factory=list)


def plan_step(running: Sequence[EngineSequence], interleaved_chunk: int) -> StepPlan:
    """The plan of one step over the running sequences (see the module docstring)."""
    plan = StepPlan()
    live = [s for s in running if not s.cancelled]
    shared = any(s.prompt_done for s in live)  # some stream decodes: prefill in short pieces between its steps
    for sequence in running:
        if sequence.cancelled:
            plan.cancelled.append(sequence)
            continue
        if sequence.prompt_done:
            plan.sampling.append(sequence)
            continue
        length = len(sequence.request.prompt_ids)
        end = min((b for b in sequence.boundaries if b > sequence.position), default=length)
        if shared:
            end = min(end, sequence.position + interleaved_chunk)
        plan.prefills.append((sequence, sequence.position, end))
        if end == length:
            plan.sampling.append(sequence)
    return plan
