"""The scheduler's pure plan: admission by budget and slots, and which tokens each sequence runs in a step."""

from __future__ import annotations

from ninfer.engine import scheduler
from ninfer.engine.sequence import Request, Sequence
from ninfer.sampling import SamplingParams


def _sequence(prompt: int, position: int = 0, boundaries: set[int] | None = None) -> Sequence:
    sequence = Sequence(Request(list(range(prompt)), SamplingParams()), lambda item: None)
    sequence.position, sequence.boundaries = position, boundaries or set()
    return sequence


def test_budget_and_reservation():
    assert scheduler.budget(10, 100, max_context=64, kv_capacity=1000) == 64  # the context binds
    assert scheduler.budget(10, 5, max_context=64, kv_capacity=1000) == 15
    assert scheduler.budget(10, 100, max_context=64, kv_capacity=40) == 40
    assert scheduler.reservation(65, 64) == 128 and scheduler.reservation(64, 64) == 64
    assert scheduler.reservation(7, 1) == 7


def test_admission_is_first_come_first_served_within_slots_and_capacity():
    assert scheduler.admit([10, 10, 10], 0, 0, max_concurrency=2, kv_capacity=100) == 2
    assert scheduler.admit([10, 10], 1, 95, max_concurrency=8, kv_capacity=100) == 0  # the front one does not fit
    assert scheduler.admit([10, 10], 1, 85, max_concurrency=8, kv_capacity=100) == 1
    assert scheduler.admit([10, 50, 5], 0, 0, max_concurrency=8, kv_capacity=40) == 1  # no overtaking
    assert scheduler.admit([], 0, 0, max_concurrency=8, kv_capacity=40) == 0


def test_a_prompt_alone_goes_whole_up_to_its_boundary_and_in_pieces_beside_a_decoding_stream():
    alone = _sequence(100, boundaries={30})
    plan = scheduler.plan_step([alone], interleaved_chunk=8)
    assert [(start, end) for _, start, end in plan.prefills] == [(0, 30)] and plan.sampling == []
    decoding, prompt = _sequence(4, position=4), _sequence(100, position=30, boundaries={30})
    plan = scheduler.plan_step([decoding, prompt], interleaved_chunk=8)
    assert [(s, start, end) for s, start, end in plan.prefills] == [(prompt, 30, 38)]
    assert plan.sampling == [decoding]
    last = _sequence(100, position=95)
    plan = scheduler.plan_step([decoding, last], interleaved_chunk=8)
    assert plan.prefills == [(last, 95, 100)] and plan.sampling == [decoding, last]  # its first token this step


def test_cancelled_sequences_are_dropped_and_never_hold_up_the_others():
    cancelled, prompt = _sequence(4, position=4), _sequence(100)
    cancelled.cancelled = True
    plan = scheduler.plan_step([cancelled, prompt], interleaved_chunk=8)
    assert plan.cancelled == [cancelled]
    assert plan.prefills == [(prompt, 0, 100)]  # no live stream decodes: the prompt goes whole
