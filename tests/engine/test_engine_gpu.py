"""The serving engine on CUDA (`pytest -m gpu` on the GPU machine): prefix snapshots spill to pinned host memory
and come back exactly; concurrent requests equal single-request runs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ninfer.engine import LLM, Finished, Request
from ninfer.engine.prefix_cache import PrefixCache, Snapshot
from ninfer.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_prefix_cache_spills_to_pinned_host_memory_and_restores_exactly():
    device = torch.device("cuda")
    snapshots = [Snapshot(10, {("keys", 3): torch.randn(10, 2, 64, device=device)}) for _ in range(3)]
    size = snapshots[0].nbytes
    cache = PrefixCache(device, device_bytes=2 * size, host_bytes=4 * size)
    for i, snapshot in enumerate(snapshots):
        cache.put(PrefixCache.key([i]), snapshot)
    spilled = cache._host[PrefixCache.key([0])]
    assert spilled.tensors[("keys", 3)].is_pinned()
    back = cache.get(PrefixCache.key([0]))
    assert back.tensors[("keys", 3)].device.type == "cuda"
    assert torch.equal(back.tensors[("keys", 3)], snapshots[0].tensors[("keys", 3)])


def test_concurrent_requests_on_cuda_equal_single_runs():
    """8 concurrent requests (decode steps batched) give each the tokens of its run alone through the same engine:
    decode steps are batch-invariant bit for bit. (The reference for a request is its own run with the same
    prefill chunks: chunking changes cuBLAS's shapes, so the prefill's rounding, and an int8 code on a rounding
    boundary can then flip a near-tied greedy token. The prompts are shorter than a chunk, so whether a prompt
    is prefilled beside decoding streams does not change its chunks; the CPU tests cover interleaved chunks.)"""
    llm = LLM(device="cuda", dtype=torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [llm.tokenizer.encode(f"def handler_{i}(event):\n    ") for i in range(8)]

    def collect(engine):
        async def run(ids):
            async for event in engine.generate(Request(ids, params, thinking=False)):
                if isinstance(event, Finished):
                    return event.completion.token_ids

        return run

    alone = llm.engine_with(max_concurrency=1, interleaved_prefill_chunk=64).start()
    try:
        expected = [_gather(collect(alone), [ids])[0] for ids in prompts]
    finally:
        alone.close()
    engine = llm.engine_with(max_concurrency=8, interleaved_prefill_chunk=64).start()
    try:
        results = _gather(collect(engine), prompts)
    finally:
        engine.close()
    assert results == expected


def _gather(collect, prompts):
    async def main():
        return await asyncio.gather(*(collect(ids) for ids in prompts))

    return asyncio.run(main())


def test_batched_sampling_on_cuda_draws_what_each_row_draws_alone():
    from ninfer.kernels.sampling import make_generator, sample_batch, sample_next

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, seed=3),
              SamplingParams(temperature=1.0, top_k=50, repetition_penalty=1.2, seed=4),
              SamplingParams(temperature=0.0, presence_penalty=0.5, logit_bias={7: 2.0})]
    generator = torch.Generator(device="cuda").manual_seed(0)
    prompt, generated = torch.tensor([1, 5, 9], device="cuda"), torch.tensor([7, 7, 2], device="cuda")
    for _ in range(10):
        logits = torch.randn(len(params), 248_320, device="cuda", generator=generator) * 4
        batch_generators = [make_generator(p.seed, "cuda") for p in params]
        alone_generators = [make_generator(p.seed, "cuda") for p in params]
        got = sample_batch(logits, params, batch_generators, [prompt] * 4, [generated] * 4)
        expected = [sample_next(row, p, g, prompt, generated)
                    for row, p, g in zip(logits, params, alone_generators, strict=True)]
        assert got == expected
