"""The serving engine: continuous batching gives each request its single-request output; admission, queue
limits, cancellation; prefix reuse with logits bit-identical to a fresh prefill."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ninfer.engine import LLM, Engine, Finished, QueueFullError, QueueTimeoutError, Request
from ninfer.engine.prefix_cache import PrefixCache
from ninfer.sampling import SamplingError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


def _chat(llm: LLM, system: str, *turns: str) -> list[int]:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return llm.prompt_ids(messages)


async def _collect(engine: Engine, request: Request):
    async for event in engine.generate(request):
        if isinstance(event, Finished):
            return event.completion
    raise AssertionError("no Finished event")


def test_concurrent_requests_each_get_their_single_request_output(llm):
    prompts = [llm.tokenizer.encode(f"def function_{i}(x):\n    ") for i in range(8)]
    expected = [llm.generate(ids, GREEDY).token_ids for ids in prompts]
    engine = llm.engine_with(max_concurrency=8, interleaved_prefill_chunk=4).start()
    try:
        async def main():
            return await asyncio.gather(*(_collect(engine, Request(ids, GREEDY, thinking=False)) for ids in prompts))

        results = asyncio.run(main())
    finally:
        engine.close()
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" and r.prompt_tokens == len(p) for r, p in zip(results, prompts, strict=True))


def test_requests_with_different_sampling_share_steps_and_keep_their_own_draws(llm):
    """Sampled together (one device round trip per step), each request draws what it draws alone: seeded
    temperature sampling, penalties and greedy in one batch."""
    params = [GREEDY, SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.2, top_k=40, repetition_penalty=1.3, seed=12, max_tokens=24,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5, max_tokens=24,
                             ignore_eos=True)]
    prompts = [llm.tokenizer.encode(f"class Widget{i}:\n    ") for i in range(len(params))]
    expected = [llm.generate(ids, p).token_ids for ids, p in zip(prompts, params, strict=True)]
    engine = llm.engine_with(max_concurrency=4, interleaved_prefill_chunk=4).start()
    try:
        async def main():
            return await asyncio.gather(*(_collect(engine, Request(ids, p, thinking=False))
                                          for ids, p in zip(prompts, params, strict=True)))

        results = asyncio.run(main())
    finally:
        engine.close()
    assert [r.token_ids for r in results] == expected


def test_a_prompt_alone_is_prefilled_at_once_and_in_short_chunks_beside_a_stream(llm, monkeypatch):
    """With no stream to hold up, a prompt goes to the model whole (TTFT at the model's prefill rate); while
    another request decodes, it goes in chunks of at most `prefill_chunk` tokens between that request's steps.
    Both requests still get their single-request output."""
    prompts = [llm.tokenizer.encode(f"def long_function_number_{i}(alpha, beta, gamma, delta):\n    return " * 3)
               for i in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    pieces: list[int] = []
    prefill = llm.model.prefill

    def recording(ids, state, *args, **kwargs):  # prefill pieces (the reference model decodes through it too)
        if ids.numel() > 1:
            pieces.append(ids.numel())
        return prefill(ids, state, *args, **kwargs)

    monkeypatch.setattr(llm.model, "prefill", recording)
    engine = llm.engine_with(max_concurrency=2, interleaved_prefill_chunk=8).start()
    try:
        async def main():
            first = engine.generate(Request(prompts[0], params, thinking=False))
            await anext(first)  # the first request is decoding now
            alone = list(pieces)
            rest = asyncio.ensure_future(_collect(engine, Request(prompts[1], params, thinking=False)))
            tokens = [event async for event in first]
            return alone, tokens[-1].completion, await rest

        alone, first, second = asyncio.run(main())
    finally:
        engine.close()
        monkeypatch.undo()
    assert alone == [len(prompts[0])] and len(prompts[1]) > 16 and len(prompts[1]) % 8 != 1
    beside = pieces[1:]
    assert sum(beside) == len(prompts[1]) and max(beside) == 8 and len(beside) == -(-len(prompts[1]) // 8)
    assert first.token_ids == llm.generate(prompts[0], params).token_ids
    assert second.token_ids == llm.generate(prompts[1], params).token_ids


def test_a_request_whose_sampling_fails_fails_alone(llm):
    engine = llm.engine_with(max_concurrency=2).start()
    broken = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={10**7: 1.0})  # an id past the vocabulary
    prompt = llm.tokenizer.encode("x = 1\n")
    try:
        async def main():
            return await asyncio.gather(_collect(engine, Request(prompt, broken, thinking=False)),
                                        _collect(engine, Request(prompt, GREEDY, thinking=False)),
                                        return_exceptions=True)

        failed, finished = asyncio.run(main())
    finally:
        engine.close()
    assert isinstance(failed, SamplingError) and "outside the vocabulary" in str(failed)
    assert finished.token_ids == llm.generate(prompt, GREEDY).token_ids


def test_cancelling_a_stream_frees_its_sequence(llm):
    engine = llm.engine_with(max_concurrency=2).start()
    params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)

    async def main():
        stream = engine.generate(Request(llm.tokenizer.encode("import os\n"), params, thinking=False))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()
        for _ in range(200):
            if engine.stats()["running"] == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    try:
        assert asyncio.run(main())
        assert engine.stats()["reserved_tokens"] == 0
    finally:
        engine.close()


def test_a_full_queue_refuses_and_a_long_wait_times_out(llm):
    long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    ids = llm.tokenizer.encode("class A:\n")

    async def main(engine: Engine, expect: type[Exception]):
        first = engine.generate(Request(ids, long, thinking=False))
        await first.__anext__()  # running now
        waiting = asyncio.ensure_future(_collect(engine, Request(ids, GREEDY, thinking=False)))
        await asyncio.sleep(0.05)
        with pytest.raises(expect):
            await _collect(engine, Request(ids, GREEDY, thinking=False))
        await first.aclose()
        if expect is QueueFullError:  # the waiter is served once the first request is cancelled
            assert len((await waiting).token_ids) == GREEDY.max_tokens
        else:
            with pytest.raises(QueueTimeoutError):
                await waiting

    engine = llm.engine_with(max_concurrency=1, max_pending=1).start()
    try:
        asyncio.run(main(engine, QueueFullError))
    finally:
        engine.close()
    engine = llm.engine_with(max_concurrency=1, max_pending=4, queue_timeout=0.1).start()
    try:
        asyncio.run(main(engine, QueueTimeoutError))
    finally:
        engine.close()


def test_a_burst_beyond_running_plus_waiting_is_refused_at_submit(llm):
    """Requests that arrive before the engine admits any (a burst) count against max_concurrency + max_pending
    together: the excess is refused at once, not queued to time out; a cancelled request frees its place."""
    engine = llm.engine_with(max_concurrency=1, max_pending=1)  # not started: nothing is admitted meanwhile
    request = Request(llm.tokenizer.encode("class A:\n"), GREEDY, thinking=False)
    held = [engine.submit(request, lambda item: None) for _ in range(2)]
    for _ in range(2):
        with pytest.raises(QueueFullError, match="1 running \\+ 1 waiting"):
            engine.submit(request, lambda item: None)
    assert engine.stats()["waiting"] == 2
    engine.cancel(held[1])
    engine.submit(request, lambda item: None)
    engine.close()


def test_prefix_reuse_across_clients_and_turns_gives_identical_logits(llm):
    system = "You are a careful Python reviewer. " * 8
    first = _chat(llm, system, "Review: def f(): pass")
    second = _chat(llm, system, "Review: class B: ...")
    third = _chat(llm, system, "Review: def f(): pass", "It is fine.", "And now: import os")
    engine = llm.engine_with(max_concurrency=2, interleaved_prefill_chunk=16).start()
    try:
        results = [asyncio.run(_collect(engine, Request(ids, GREEDY))) for ids in (first, second, third)]
    finally:
        engine.close()
    im_end = llm.tokenizer.token_id("<|im_end|>")
    system_end = first.index(im_end) + 1
    assert results[0].cached_tokens == 0
    assert results[1].cached_tokens == system_end  # the shared system block
    user_end = system_end + first[system_end:].index(im_end) + 1
    assert results[2].cached_tokens == user_end  # the first turn of the chat
    assert engine.stats()["prefix_hits"] == 2
    for ids, result in zip((second, third), results[1:], strict=True):
        assert result.token_ids == llm.generate(ids, GREEDY).token_ids
        # logits after resuming from the snapshot equal those of a fresh prefill with the same chunk plan (each
        # request ran alone: chunks end at the turn boundaries only)
        boundary = result.cached_tokens
        ends = sorted({i + 1 for i, t in enumerate(ids[:-1]) if t == im_end} | {len(ids)})
        model = llm.model
        with torch.no_grad():
            fresh = model.new_state(len(ids))
            start = 0
            for end in ends:
                fresh_logits = model.prefill(torch.tensor(ids[start:end]), fresh)
                start = end
            resumed = model.new_state(len(ids))
            snapshot = engine.cache.get(PrefixCache.key(ids[:boundary]))
            model.restore(resumed, snapshot.length, snapshot.tensors)
            start = boundary
            for end in (e for e in ends if e > boundary):
                resumed_logits = model.prefill(torch.tensor(ids[start:end]), resumed)
                start = end
        assert torch.equal(fresh_logits, resumed_logits)
