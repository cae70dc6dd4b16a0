"""The fast path on CUDA (`pytest -m gpu`): logits against the reference model on the embedded model and on
4-layer slices of the qwen3.8-27b and qwen3.6-35b-a3b presets at their real widths (q4 recipe), CUDA-graph
replay equal to eager decode, and a long greedy generation equal between the fast path and the reference."""

from __future__ import annotations

import pytest
import torch

from ninfer.artifact.reader import Artifact
from ninfer.fast.runner import FastQwen35
from ninfer.model.qwen3_5 import Qwen35Model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BF16_TOLERANCE = 3e-2  # relative to the largest logit: bf16 activations against the fp32 reference
DEMO = "ninfer/assets/demo.ninfer"


def _relative(got, expected):
    return float((got.float() - expected.float()).abs().max() / expected.float().abs().max())


@pytest.fixture(scope="module", params=["qwen3.8-27b", "qwen3.6-35b-a3b"])
def sliced(request, tmp_path_factory):
    from ninfer.convert.synth import synth_artifact

    path = tmp_path_factory.mktemp("slice") / f"{request.param}-4l.ninfer"
    synth_artifact(request.param, "q4", path, quiet=True, layers=4, device="cuda")
    with Artifact.open(path) as artifact:
        reference = Qwen35Model.from_artifact(artifact, "cuda", torch.float32)
        fast = FastQwen35.from_artifact(artifact, "cuda", max_sequences=4, max_context=2048, prefill_chunk=256)
    return reference, fast


def test_real_shape_slice_prefill_and_batched_decode(sliced):
    reference, fast = sliced
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 248_000, (n,), generator=generator) for n in (300, 7)]
    ref_states = [reference.new_state(512) for _ in prompts]
    fast_states = [fast.new_state(512) for _ in prompts]
    expected = [reference.forward(p.cuda(), s) for p, s in zip(prompts, ref_states, strict=True)]
    got = [fast.forward(p.cuda(), s) for p, s in zip(prompts, fast_states, strict=True)]
    for e, g in zip(expected, got, strict=True):
        assert _relative(g, e) < BF16_TOLERANCE
    for step in range(4):
        tokens = torch.stack([e.argmax() for e in expected])
        expected = [reference.forward(t[None], s) for t, s in zip(tokens, ref_states, strict=True)]
        got = fast.decode_batch(fast_states, tokens)
        for row, e in enumerate(expected):
            assert _relative(got[row], e) < BF16_TOLERANCE, f"step {step} sequence {row}"


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "fp8"])
def test_graph_replay_equals_eager_decode(kv_dtype):
    with Artifact.open(DEMO) as artifact:
        graphed = FastQwen35.from_artifact(artifact, "cuda", max_sequences=4, max_context=512, kv_dtype=kv_dtype)
        eager = FastQwen35.from_artifact(artifact, "cuda", max_sequences=4, max_context=512, kv_dtype=kv_dtype,
                                         graphs=False)
    prompts = [torch.arange(5, 40, device="cuda"), torch.arange(100, 110, device="cuda"),
               torch.arange(7, 9, device="cuda")]
    states = {m: [m.new_state(256) for _ in prompts] for m in (graphed, eager)}
    logits = {m: torch.stack([m.forward(p, s) for p, s in zip(prompts, states[m], strict=True)])
              for m in (graphed, eager)}
    assert torch.equal(logits[graphed], logits[eager])
    for _ in range(6):  # batch 3 replays the bucket-4 graph with one padding row
        tokens = logits[eager].argmax(-1)
        logits = {m: m.decode_batch(states[m], tokens) for m in (graphed, eager)}
        assert torch.equal(logits[graphed], logits[eager])


def test_long_greedy_generation_equals_the_reference():
    with Artifact.open(DEMO) as artifact:
        reference = Qwen35Model.from_artifact(artifact, "cuda", torch.bfloat16)
        fast = FastQwen35.from_artifact(artifact, "cuda", max_sequences=1, max_context=1024)
    prompt = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], device="cuda")
    tokens = {}
    for model in (reference, fast):
        state = model.new_state(512)
        logits = model.forward(prompt, state)
        out = []
        for _ in range(200):
            out.append(int(logits.argmax()))
            logits = model.forward(torch.tensor(out[-1:], device="cuda"), state)
        tokens[model] = out
    pairs = enumerate(zip(tokens[reference], tokens[fast], strict=True))
    agree = next((i for i, (a, b) in pairs if a != b), 200)
    assert agree >= 100, f"greedy tokens diverge at step {agree}"
