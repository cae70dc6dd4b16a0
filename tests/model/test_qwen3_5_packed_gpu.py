"""The fast path on CUDA (`pytest -m gpu`): logits against the reference model on 4-layer slices of the
qwen3.8-27b and qwen3.6-35b-a3b presets at their real widths (q4 recipe), CUDA-graph replay equal to eager
decode for each KV dtype, a long greedy generation equal between the fast path and the reference, and what the
int8 activations of decode steps cost against the exact model. The structure of the path is checked with exact
activations (`int8_activations=False`: the reference's numerics); the integer GEMVs of decode steps against the
reference whose groupwise products see the same int8 activations (tests/model/support.py).

The model comparisons run both paths in fp32: random-weight models at these widths are so sensitive that the
reference in bf16 is itself 3-28 % (of the largest logit) away from the reference in fp32 (MoE routing flips
among near-tied experts), so a bf16 comparison could not tell a bug from rounding; the bf16 kernels are checked
one by one at these shapes in their own GPU tests."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ninfer.artifact.reader import Artifact
from ninfer.engine.runner import SHORT_PREFILL_TOKENS
from ninfer.model.qwen3_5 import Qwen35Model
from tests.model.support import int8_activations, packed_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FP32_TOLERANCE = 1e-3  # relative to the largest logit: fp32 on both paths, summation orders differ
# decode steps of the random-weight slices against the int8 oracle: a code on a rounding boundary flips on the
# rounding-level differences of the two paths, and these models amplify it (see above)
DECODE_TOLERANCE = 0.05
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
        fast, exact = (packed_model(artifact, "cuda", max_sequences=4, max_context=2048, prefill_chunk=256,
                                                dtype=torch.float32, int8_activations=int8, max_verify_tokens=3)
                       for int8 in (True, False))
    return reference, fast, exact, str(path)


def _prefill_then_decode(reference, fast, path, int8: bool):
    """Two prompts prefilled one by one (300 tokens: the prefill route; 7: the short-prompt route), then 4 batched
    decode steps; yields (step, row, got, expected) with the reference's groupwise products seeing int8
    activations where the fast path's do (`int8`)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 248_000, (n,), generator=generator) for n in (300, 7)]
    ref_states = [reference.new_state(512) for _ in prompts]
    fast_states = [fast.new_state(512) for _ in prompts]
    expected = []
    for p, s in zip(prompts, ref_states, strict=True):  # a short prompt takes the decode kernels: int8 throughout
        with int8_activations(reference, path, head_only=len(p) > SHORT_PREFILL_TOKENS) if int8 \
                else contextlib.nullcontext():
            expected.append(reference.prefill(p.cuda(), s))
    got = [fast.prefill(p.cuda(), s) for p, s in zip(prompts, fast_states, strict=True)]
    for row, (g, e, p) in enumerate(zip(got, expected, prompts, strict=True)):
        yield "prefill" if len(p) > SHORT_PREFILL_TOKENS else "short prefill", row, g, e
    for step in range(4):
        tokens = torch.stack([e.argmax() for e in expected])
        with int8_activations(reference, path) if int8 else contextlib.nullcontext():
            expected = [reference.prefill(t[None], s) for t, s in zip(tokens, ref_states, strict=True)]
        got = fast.decode(fast_states, tokens)
        for row, e in enumerate(expected):
            yield step, row, got[row], e


def test_real_shape_slice_prefill_and_batched_decode_with_exact_activations(sliced):
    """The whole fast path (paged attention, GDN decode, fused kernels, graphs, MoE) against the reference with
    the same numerics: every product in fp32 through the decoded weights."""
    reference, _, exact, path = sliced
    for step, row, got, expected in _prefill_then_decode(reference, exact, path, int8=False):
        assert _relative(got, expected) < FP32_TOLERANCE, f"step {step} sequence {row}"


@pytest.mark.parametrize("sliced", ["qwen3.8-27b"], indirect=True)
def test_real_shape_slice_integer_decode_against_the_int8_oracle(sliced):
    """The decode steps' integer GEMVs at real shapes against the reference seeing the same int8 activations. Only
    the dense preset: in the random-weight MoE slice a rounding-level difference that flips one int8 code also
    flips the choice among near-tied experts, and the logits then differ by ~10 % with no bug (the exact-activation
    test above checks the MoE decode path; the gathering GEMV has its own tests at these shapes)."""
    reference, fast, _, path = sliced
    for step, row, got, expected in _prefill_then_decode(reference, fast, path, int8=True):
        tolerance = FP32_TOLERANCE if step == "prefill" else DECODE_TOLERANCE  # the short prefill: integer GEMVs
        assert _relative(got, expected) < tolerance, f"step {step} sequence {row}"


@pytest.mark.parametrize("kv_dtype, state_dtype", [("bf16", "fp32"), ("int8", "fp32"), ("fp8", "fp32"),
                                                    ("bf16", "bf16")])
def test_graph_replay_equals_eager_decode(kv_dtype, state_dtype):
    """Graphs of several buckets, replayed in an order unlike their captures' (they share one memory pool and one
    logits buffer), and a bucket with a padding row, give the eager step's bits."""
    options = dict(max_sequences=10, max_context=512, kv_dtype=kv_dtype, state_dtype=state_dtype)
    with Artifact.open(DEMO) as artifact:
        graphed = packed_model(artifact, "cuda", **options)
        eager = packed_model(artifact, "cuda", **options, graphs=False)
    assert graphed.buckets == [1, 2, 3, 4, 5, 6, 7, 8, 10]
    prompts = [torch.arange(5 + 7 * i, 15 + 9 * i, device="cuda") % 1000 for i in range(9)]
    states = {m: [m.new_state(256) for _ in prompts] for m in (graphed, eager)}
    logits = {m: torch.stack([m.prefill(p, s) for p, s in zip(prompts, states[m], strict=True)])
              for m in (graphed, eager)}
    assert torch.equal(logits[graphed], logits[eager])
    tokens = logits[eager].argmax(-1)
    for batch in (3, 8, 5, 9, 3, 8, 9, 5):  # 9 replays the bucket-10 graph with one padding row
        step = {m: m.decode(states[m][:batch], tokens[:batch]) for m in (graphed, eager)}
        assert torch.equal(step[graphed], step[eager]), f"batch {batch}"
        tokens = torch.cat([step[eager].argmax(-1), tokens[batch:]])
    assert set(graphed.graphs) == {(3, 1, False), (5, 1, False), (8, 1, False), (10, 1, False)}  # (B, T, verify)
    assert len({graph.pool() for graph, _ in graphed.graphs.values()}) == 1
    # and every graph writes its logits into the one buffer of the model, not into a buffer of its own
    assert {logits.data_ptr() for _, logits in graphed.graphs.values()} == {graphed.logits.data_ptr()}
    assert graphed.graph_bytes > 0


@pytest.mark.parametrize("kv_dtype, state_dtype", [("bf16", "fp32"), ("int8", "bf16")])
def test_graphed_verify_steps_and_short_prompts_equal_eager_ones(kv_dtype, state_dtype):
    """Short prompts (one graph per length) and verify steps of several sizes, each followed by an accept of some
    prefix and a decode step (which starts from the kept snapshot), replayed as graphs from the pool the decode
    graphs share, give the eager steps' bits."""
    options = dict(max_sequences=3, max_context=512, kv_dtype=kv_dtype, state_dtype=state_dtype,
                   max_verify_tokens=4)
    with Artifact.open(DEMO) as artifact:
        graphed = packed_model(artifact, "cuda", **options)
        eager = packed_model(artifact, "cuda", **options, graphs=False)
    models = (graphed, eager)
    prompts = [torch.arange(5 + 7 * i, 12 + 9 * i, device="cuda") % 1000 for i in range(3)]  # 7, 9 and 11 tokens
    assert all(p.numel() <= SHORT_PREFILL_TOKENS for p in prompts)
    states = {m: [m.new_state(256) for _ in prompts] for m in models}
    logits = {m: torch.stack([m.prefill(p, s) for p, s in zip(prompts, states[m], strict=True)]) for m in models}
    assert torch.equal(logits[graphed], logits[eager])
    tokens = logits[eager].argmax(-1)
    for batch, kept in ((3, [1, 4, 2]), (1, [2]), (2, [3, 1]), (3, [4, 4, 1]), (1, [1])):
        drafts = max(kept)
        ids = torch.stack([(tokens[:batch] + 11 * t) % 1000 for t in range(drafts)], dim=1)
        verified = {m: m.verify(states[m][:batch], ids) for m in models}
        assert torch.equal(verified[graphed], verified[eager]), f"verify {batch} x {drafts}"
        for m in models:
            m.accept(states[m][:batch], kept)
        step = {m: m.decode(states[m][:batch], tokens[:batch]) for m in models}
        assert torch.equal(step[graphed], step[eager]), f"decode after verify {batch} x {drafts}"
        tokens = torch.cat([step[eager].argmax(-1), tokens[batch:]])
    # keyed (B, T, verify): the short prompts, the verify steps, the decode buckets
    assert set(graphed.graphs) == {(1, 7, False), (1, 9, False), (1, 11, False), (3, 4, True), (1, 2, True),
                                   (2, 3, True), (1, 1, True), (3, 1, False), (1, 1, False), (2, 1, False)}
    graphs = list(graphed.graphs.values())
    assert len({graph.pool() for graph, _ in graphs}) == 1
    assert {logits.data_ptr() for _, logits in graphs} == {graphed.logits.data_ptr()}


def test_a_decode_step_with_ids_on_the_device_never_waits_for_the_device():
    """Greedy decode with the sampled ids left on the device: no step synchronises with the host (torch's sync
    debug mode raises on any synchronising call), so the host can queue the next step while this one runs; the
    logits equal those of the same steps fed the ids from the host."""
    with Artifact.open(DEMO) as artifact:
        model = packed_model(artifact, "cuda", max_sequences=4, max_context=512)
    prompts = [torch.arange(5, 40, device="cuda"), torch.arange(100, 110, device="cuda")]
    runs = []
    for on_device in (True, False):
        states = [model.new_state(256) for _ in prompts]
        tokens = torch.stack([model.prefill(p, s) for p, s in zip(prompts, states, strict=True)]).argmax(-1)
        model.decode(states, tokens)  # the first call captures the graph (which synchronises)
        steps = []
        torch.cuda.set_sync_debug_mode("error" if on_device else "default")
        try:
            for _ in range(4):
                logits = model.decode(states, tokens if on_device else tokens.cpu())
                tokens = logits.argmax(-1)
                steps.append(logits)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        runs.append(torch.stack(steps))
    assert torch.equal(runs[0], runs[1])


def test_long_greedy_generation_equals_the_reference():
    """200 greedy tokens of the fast path (bf16 KV pages, graphs) equal the reference's, both in fp32 with exact
    activations: the KV cache, the GDN state and the positions stay right over a long generation. (With int8
    activations a rounding-level difference can flip a code and then a near-tied token; their cost in quality is
    the next test's.)"""
    with Artifact.open(DEMO) as artifact:
        reference = Qwen35Model.from_artifact(artifact, "cuda", torch.float32)
        fast = packed_model(artifact, "cuda", max_sequences=1, max_context=1024, dtype=torch.float32,
                                        int8_activations=False)
    prompt = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], device="cuda")
    tokens = {}
    for model in (reference, fast):
        state = model.new_state(512)
        logits = model.prefill(prompt, state)
        out = []
        for _ in range(200):
            out.append(int(logits.argmax()))
            logits = model.prefill(torch.tensor(out[-1:], device="cuda"), state)
        tokens[model] = out
    pairs = enumerate(zip(tokens[reference], tokens[fast], strict=True))
    agree = next((i for i, (a, b) in pairs if a != b), 200)
    assert agree == 200, f"greedy tokens diverge at step {agree}"


def test_int8_activations_keep_the_exact_models_next_token_choices():
    """What the integer GEMV costs in quality: teacher-forced over 300 tokens of its own greedy text, the fast path's
    decode steps (bf16, int8 activations) against the exact fp32 reference: top-1 agreement and the mean KL
    divergence of the next-token distributions."""
    with Artifact.open(DEMO) as artifact:
        reference = Qwen35Model.from_artifact(artifact, "cuda", torch.float32)
        fast = packed_model(artifact, "cuda", max_sequences=1, max_context=512)
    ref_state, fast_state = reference.new_state(512), fast.new_state(512)
    reference.prefill(torch.arange(1, 11, device="cuda"), ref_state)
    fast.prefill(torch.arange(1, 11, device="cuda"), fast_state)
    token, agree, divergence = torch.tensor([11], device="cuda"), 0, 0.0
    for _ in range(300):
        expected, got = reference.prefill(token, ref_state), fast.prefill(token, fast_state).float()
        agree += int(expected.argmax() == got.argmax())
        divergence += float(torch.nn.functional.kl_div(got.log_softmax(-1), expected.log_softmax(-1), log_target=True,
                                                       reduction="sum"))
        token = expected.argmax()[None]
    print(f"int8 activations: top-1 agreement {agree / 300:.3f}, mean KL {divergence / 300:.2e}")
    assert agree >= 0.95 * 300 and divergence / 300 < 0.01


def test_prefill_delta_rule_in_bf16_matches_the_fp32_reference():
    from ninfer.kernels.gated_delta_rule import gated_delta_rule_chunked, l2_normalize
    from ninfer.model.qwen3_5_packed import delta_rule_prefill

    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens, heads, dim = 1000, 48, 128  # the 27B's value heads (keys already repeated)
    q, k, v = (torch.randn(tokens, heads, dim, device="cuda", generator=generator) for _ in range(3))
    g = -torch.rand(tokens, heads, device="cuda", generator=generator) * 0.5
    beta = torch.rand(tokens, heads, device="cuda", generator=generator)
    initial = torch.randn(heads, dim, dim, device="cuda", generator=generator) * 0.1
    o, final = delta_rule_prefill(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), initial, dim)
    o_ref, final_ref = gated_delta_rule_chunked(l2_normalize(q) * dim**-0.5, l2_normalize(k), v, g, beta, initial)
    assert _relative(o, o_ref) < 2e-2 and _relative(final, final_ref) < 2e-2


@pytest.mark.parametrize("sliced", ["qwen3.8-27b"], indirect=True)
def test_real_shape_verify_equals_decode_bit_for_bit(sliced):
    """At the 27B's widths a decode step of one row takes the a/b product in the delta-rule launch, a verify step the
    dense GEMV with the same sums: a verify step's logits must still be the bits of the same tokens decoded one by
    one (int8 activations, the integer GEMVs, graph replay against eager)."""
    _, fast, _, _ = sliced
    prompt = torch.arange(5, 30, device="cuda")
    drafts = torch.tensor([[7, 8, 9]], device="cuda")
    verified, stepped = fast.new_state(64), fast.new_state(64)
    for state in (verified, stepped):
        fast.prefill(prompt, state)
    logits = fast.verify([verified], drafts)
    expected = torch.stack([fast.decode([stepped], drafts[:, t]) for t in range(3)], dim=1)
    assert torch.equal(logits, expected)


def test_verify_step_equals_token_by_token_decode_on_cuda():
    with Artifact.open(DEMO) as artifact:
        fast = packed_model(artifact, "cuda", max_sequences=4, max_context=512, dtype=torch.float32,
                                        max_verify_tokens=4)
    prompt = torch.arange(5, 30, device="cuda")
    drafts = torch.tensor([[7, 8, 9, 10], [40, 41, 42, 43]], device="cuda")
    verified, stepped = [fast.new_state(64) for _ in range(2)], [fast.new_state(64) for _ in range(2)]
    for state in verified + stepped:
        fast.prefill(prompt, state)
    logits = fast.verify(verified, drafts)
    expected = torch.stack([fast.decode(stepped, drafts[:, t]) for t in range(4)], dim=1)
    assert _relative(logits, expected) < FP32_TOLERANCE
