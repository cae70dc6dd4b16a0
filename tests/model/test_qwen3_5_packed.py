"""The GPU fast path's model runner against the reference model in fp32 — on the CPU under the Triton interpreter
(CI), on CUDA when there is one: chunked prefill, batched decode, the MoE routes, quantized KV pages, prefix
snapshots with shared pages, verify steps, the memory plan and slot accounting. The models are small random-weight
ones (`tests/model/support.py: small_artifact`, dense and MoE, q8: an interpreted decode step takes about 3 s, the
demo model's 8–9 s); the engine over the fast runner (GPU only) runs the demo model, whose tokenizer it needs. Decode
steps are compared with the reference whose groupwise products see int8 activations (tests/model/support.py), as
the fast path's integer GEMV does; prefill with the reference whose head alone does (the fast path's prefill head
is the integer GEMV too). The same comparisons at real shapes on CUDA are in tests/test_fast_runner_gpu.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ninfer.artifact.reader import Artifact
from ninfer.config import CacheConfig
from ninfer.engine import runner
from ninfer.engine.kv_cache import CacheFullError
from ninfer.engine.memory import MemoryPlanError, plan_memory
from ninfer.errors import NinferError
from ninfer.flags import triton_interpreted
from ninfer.kernels import quant_linear
from ninfer.model.config import TextConfig
from ninfer.model.qwen3_5 import Qwen35Model
from tests.conftest import COMPILING_REASON
from tests.model.support import int8_activations, packed_model, small_artifact

DEMO = "ninfer/assets/demo.ninfer"
FP32_TOLERANCE = 1e-4  # relative to the largest logit: fp32 on both sides, summation orders differ
QUANTIZED_KV_TOLERANCE = {"int8": 0.03, "fp8": 0.1}  # KV rounding, relative to the largest logit
BF16_STATE_TOLERANCE = 0.03  # the GDN state rounded to bf16 after each token, relative to the largest logit
# decode steps against the int8 oracle: equal up to fp32 rounding, unless a code sits on a rounding boundary and the
# two paths' rounding-level differences flip it (seen under triton 3.9's interpreter), which moves the logits ~1 %
DECODE_TOLERANCE = 0.02
SHORT = 16  # the short-prompt route's limit on CUDA; the interpreter's default is 0 (tests set it where they need it)
PROMPT = [5, 17, 300, 42, 7, 99, 1000, 3, 8, 12, 13, 40, 41, 42, 43, 44, 45, 46, 47, 48, 200, 201, 202, 60, 61, 62,
          63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76]


def _models(path, device: str, **options):
    with Artifact.open(path) as artifact:
        reference = Qwen35Model.from_artifact(artifact, device, torch.float32)
        fast = packed_model(artifact, device, dtype=torch.float32, max_context=128, **options)
    return reference, fast


def _relative(got, expected):
    return float((got - expected).abs().max() / expected.abs().max())


def _prompt_then_one_step_error(reference, fast, path) -> float:
    """PROMPT through both models, then one decode step of the reference's greedy token (the reference with int8
    activations, as the fast path's decode step): the step's largest logit error relative to the largest logit."""
    ref_state, fast_state = reference.new_state(64), fast.new_state(64)
    expected = reference.prefill(torch.tensor(PROMPT), ref_state)
    fast.prefill(torch.tensor(PROMPT), fast_state)
    token = torch.tensor([int(expected.argmax())])
    with int8_activations(reference, path):
        expected = reference.prefill(token, ref_state)
    return _relative(fast.prefill(token, fast_state), expected)


def _greedy_alone(fast, ids: list[int], tokens: int, ends: list[int] | None = None) -> list[int]:
    """`tokens` greedy tokens of the fast runner alone, its prompt prefilled in pieces ending at `ends` (default:
    the whole prompt at once, as the engine does for a request with no stream beside it and no turn boundary)."""
    state = fast.new_state(len(ids) + tokens)
    start = 0
    for end in ends or [len(ids)]:
        logits = fast.prefill(torch.tensor(ids[start:end]), state)
        start = end
    out = [int(logits.argmax())]
    while len(out) < tokens:
        out.append(int(fast.decode([state], torch.tensor(out[-1:]))[0].argmax()))
    fast.free_state(state)
    return out


@pytest.fixture(scope="module", params=[pytest.param("cpu", id="interpreter"),
                                        pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")])
def paths(request, tmp_path_factory):
    """The small artifacts, and the device every test of the module runs on (as tests/conftest.py's `device`: the
    interpreter in the CPU suite, CUDA under `pytest -m gpu`)."""
    if request.param == "cpu" and not triton_interpreted():
        pytest.skip(COMPILING_REASON)
    folder = tmp_path_factory.mktemp("small")
    return {"device": request.param, "dense": small_artifact(folder / "dense.ninfer"),
            "moe": small_artifact(folder / "moe.ninfer", moe=True)}


@pytest.fixture(scope="module")
def dense(paths):
    return _models(paths["dense"], paths["device"], max_sequences=3, prefill_chunk=20)


@pytest.fixture(scope="module")
def moe(paths):
    return _models(paths["moe"], paths["device"], max_sequences=2, prefill_chunk=60)


@pytest.fixture(scope="module")
def demo(paths):
    return _models(DEMO, paths["device"], max_sequences=3, prefill_chunk=20)


def test_chunked_prefill_and_batched_decode_equal_the_reference(dense, paths, monkeypatch):
    """40 tokens: two chunks of 20 through the prefill route (cuBLAS, its head the integer GEMV); 3 tokens: the
    short-prompt route (one pass of the decode kernels, int8 activations in every product); then batched decode."""
    reference, fast = dense
    monkeypatch.setattr(runner, "SHORT_PREFILL_TOKENS", SHORT)
    prompts = [torch.tensor(PROMPT), torch.tensor([9, 8, 7])]
    ref_states = [reference.new_state(64) for _ in prompts]
    fast_states = [fast.new_state(64) for _ in prompts]
    with int8_activations(reference, paths["dense"], head_only=True):
        expected = [reference.prefill(prompts[0], ref_states[0])]
    with int8_activations(reference, paths["dense"]):
        expected.append(reference.prefill(prompts[1], ref_states[1]))
    got = [fast.prefill(p, s) for p, s in zip(prompts, fast_states, strict=True)]
    assert _relative(got[0], expected[0]) < FP32_TOLERANCE
    assert _relative(got[1], expected[1]) < DECODE_TOLERANCE
    staged = []  # the rows each step stages besides its ids: the second decode step of the same sequences needs none
    stage = fast._stage
    monkeypatch.setattr(fast, "_stage", lambda ids, rows: (staged.append(len(rows)), stage(ids, rows)))
    for step in range(2):
        tokens = torch.tensor([int(e.argmax()) for e in expected])
        with int8_activations(reference, paths["dense"]):
            expected = [reference.prefill(t[None], s) for t, s in zip(tokens, ref_states, strict=True)]
        got = fast.decode(fast_states, tokens)
        for row, e in enumerate(expected):
            assert _relative(got[row], e) < DECODE_TOLERANCE, f"decode step {step}, sequence {row}"
    assert staged == [2, 0]
    assert [s.length for s in fast_states] == [len(PROMPT) + 2, 5]


@pytest.mark.parametrize("model, head", [("dense", PROMPT[:20]), ("moe", [])])
def test_a_short_prompt_gives_the_bits_of_decoding_its_tokens_one_by_one(model, head, request, monkeypatch, paths):
    """A prompt piece of at most SHORT_PREFILL_TOKENS takes one pass of the decode kernels over its T tokens: the
    logits and the state it leaves are those of T single-token decode steps, bit for bit (the same kernels, which
    do not depend on the row count), after a prefill-route chunk (dense) and from an empty state (MoE)."""
    monkeypatch.setattr(runner, "SHORT_PREFILL_TOKENS", SHORT)
    _, fast = request.getfixturevalue(model)
    short, stepped = fast.new_state(64), fast.new_state(64)
    if head:
        fast.prefill(torch.tensor(head), short)
        fast.prefill(torch.tensor(head), stepped)
    piece = torch.tensor(PROMPT[20:23])
    assert 1 < len(piece) <= SHORT
    got = fast.prefill(piece, short)
    for token in piece:
        expected = fast.decode([stepped], token[None])[0]
    assert torch.equal(got, expected) and short.length == stepped.length
    assert torch.equal(fast.prefill(torch.tensor([3]), short), fast.prefill(torch.tensor([3]), stepped))


def test_snapshot_restore_continues_like_the_original(dense):
    _, fast = dense
    original = fast.new_state(64)
    fast.prefill(torch.tensor(PROMPT[:10]), original)
    saved = fast.snapshot(original)
    expected = fast.prefill(torch.tensor(PROMPT[10:14]), original)
    copy = fast.new_state(64)
    fast.restore(copy, 10, saved)
    got = fast.prefill(torch.tensor(PROMPT[10:14]), copy)
    fast.release_snapshot(saved)
    assert copy.length == 14
    assert torch.equal(got, expected)


def test_warm_up_captures_every_bucket_and_leaves_the_pools_as_they_were(dense, monkeypatch):
    _, fast = dense
    if fast.device.type == "cpu":  # each interpreted prompt takes seconds: fewer lengths of both routes, the same
        # bookkeeping
        monkeypatch.setattr(runner, "SHORT_PREFILL_TOKENS", 2)
        monkeypatch.setattr(runner, "WARM_UP_LENGTHS", (17,))
    before, during = fast.new_state(64), fast.new_state(64)
    fast.prefill(torch.tensor(PROMPT[:10]), before)
    fast.prefill(torch.tensor(PROMPT[:10]), during)
    expected = fast.decode([before], torch.tensor([7]))
    free_slots, free_pages = len(fast.cache.free_slots), len(fast.cache.free_pages)
    # interpreted, one decode step per bucket would cost seconds each: the bucket of one only (no graphs on the CPU)
    assert fast.warm_up(max_batch=1 if fast.device.type == "cpu" else None) > 0
    assert (len(fast.cache.free_slots), len(fast.cache.free_pages)) == (free_slots, free_pages)
    if fast.use_graphs:  # (earlier tests of the module may have captured others)
        decode_graphs = {batch for batch, tokens, verify in fast.graphs if (tokens, verify) == (1, False)}
        assert {b for b in fast.buckets if b <= free_slots} <= decode_graphs
    assert torch.equal(fast.decode([during], torch.tensor([7])), expected)  # its pages and GDN slot untouched


def test_slots_are_bounded_and_returned_when_a_state_is_freed(dense):
    _, fast = dense
    free = len(fast.cache.free_slots)
    states = [fast.new_state(16) for _ in range(free)]
    with pytest.raises(CacheFullError, match="free slots"):
        fast.new_state(16)
    with pytest.raises(CacheFullError, match="exceeds the context"):
        fast.cache.allocate(10_000)
    for state in states:
        fast.free_state(state)
    assert len(fast.cache.free_slots) == free
    with pytest.raises(ValueError, match="already free"):
        fast.free_state(states[0])
    with pytest.raises(ValueError, match="capacity"):
        fast.prefill(torch.tensor(PROMPT), fast.new_state(8))


def test_moe_prefill_and_decode_routes_equal_the_reference(moe, paths):
    reference, fast = moe
    prompt = torch.tensor(PROMPT * 2)  # chunks of 60 and 20 tokens: the grouped route for both
    ref_state, fast_state = reference.new_state(96), fast.new_state(96)
    with int8_activations(reference, paths["moe"], head_only=True):
        expected = reference.prefill(prompt, ref_state)
    got = fast.prefill(prompt, fast_state)
    assert _relative(got, expected) < FP32_TOLERANCE
    token = torch.tensor([int(expected.argmax())])  # a decode step: experts gathered per token
    with int8_activations(reference, paths["moe"]):
        expected = reference.prefill(token, ref_state)
    assert _relative(fast.prefill(token, fast_state), expected) < DECODE_TOLERANCE


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_exact_activations_give_decode_steps_the_references_numerics(model, paths):
    """`int8_activations=False`: batched decode steps (dense MLP or gathered experts, graphs on CUDA) equal the plain
    reference to fp32 rounding — the checking mode the real-shape GPU tests use."""
    reference, fast = _models(paths[model], paths["device"], max_sequences=2, int8_activations=False)
    prompts = [torch.tensor(PROMPT), torch.tensor([9, 8, 7])]
    ref_states = [reference.new_state(64) for _ in prompts]
    fast_states = [fast.new_state(64) for _ in prompts]
    expected = [reference.prefill(p, s) for p, s in zip(prompts, ref_states, strict=True)]
    got = [fast.prefill(p, s) for p, s in zip(prompts, fast_states, strict=True)]
    for step in range(3):
        for row, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert _relative(g, e) < FP32_TOLERANCE, f"step {step}, sequence {row}"
        tokens = torch.tensor([int(e.argmax()) for e in expected])
        expected = [reference.prefill(t[None], s) for t, s in zip(tokens, ref_states, strict=True)]
        got = fast.decode(fast_states, tokens)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_kv_stays_close_to_the_reference(kv_dtype, paths):
    models = _models(paths["dense"], paths["device"], max_sequences=1, kv_dtype=kv_dtype)
    error = _prompt_then_one_step_error(*models, paths["dense"])
    assert 0 < error < QUANTIZED_KV_TOLERANCE[kv_dtype]  # nonzero: the pages really are quantized


def test_a_bf16_state_pool_stays_close_to_the_reference(paths):
    """`state_dtype="bf16"`: the GDN recurrent state pooled in bf16 (computed in fp32, rounded as stored after each
    token; the bits of a several-token call against one-token calls are tests/test_gdn_decode.py's). A prompt through
    the prefill route (two chunks, the state carried through the pool) and a decode step stay close to the fp32
    reference."""
    reference, fast = _models(paths["dense"], paths["device"], max_sequences=1, prefill_chunk=20, state_dtype="bf16")
    assert fast.cache.recurrent.dtype == torch.bfloat16
    assert _prompt_then_one_step_error(reference, fast, paths["dense"]) < BF16_STATE_TOLERANCE


def test_decode_graphs_cover_every_batch_size_to_eight_then_every_multiple_of_eight():
    assert runner.decode_buckets(1) == [1]
    assert runner.decode_buckets(8) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert runner.decode_buckets(12) == [1, 2, 3, 4, 5, 6, 7, 8, 12]  # 9-11 sequences pad to the slots' graph
    assert runner.decode_buckets(44) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 44]


def test_graphs_are_captured_once_per_bucket_largest_first(dense, monkeypatch):
    """`warm_up` and `ninfer bench` capture through `prepare`: the largest step first sizes the shared pool,
    and each batch size captures the bucket its steps replay."""
    _, fast = dense
    captured = []
    monkeypatch.setattr(fast, "buckets", runner.decode_buckets(44))
    monkeypatch.setattr(fast, "max_batch", 44)
    monkeypatch.setattr(fast, "use_graphs", True)
    monkeypatch.setattr(fast, "_graph", lambda batch, tokens, verify: captured.append((batch, tokens, verify)))
    fast.prepare([1, 3, 20, 44, 3, 17, 9])
    assert captured == [(44, 1, False), (24, 1, False), (16, 1, False), (3, 1, False), (1, 1, False)]
    with pytest.raises(ValueError, match="exceeds the 44 sequence slots"):
        fast.prepare([45])


def test_memory_plan_sizes_the_kv_and_refuses_what_does_not_fit():
    with Artifact.open(DEMO) as artifact:
        config = TextConfig.from_dict(artifact.components["text"]["config"])
    options = dict(slots=4, max_context=1000, kv_capacity=None, kv_dtype="bf16", prefill_chunk=256)
    roomy = plan_memory(config, 10**8, 10**10, **options)
    assert roomy.kv_tokens == 4 * 1024  # capped at slots × context in whole 64-position pages
    tight = plan_memory(config, 10**8, roomy.total - roomy.kv // 2, **options, margin=0.0)
    assert tight.kv_tokens == 2048  # what is left after weights, state and workspace
    assert plan_memory(config, 10**8, 10**10, **{**options, "kv_dtype": "int8"}).kv < roomy.kv
    conv = sum(t != "full_attention" for t in config.layer_types) * config.conv_dim * (config.conv_kernel - 1) * 2
    narrow = plan_memory(config, 10**8, 10**10, **options, state_dtype="bf16")
    assert narrow.state - 5 * conv == (roomy.state - 5 * conv) // 2  # 4 slots + scratch: bf16 recurrent state
    assert "(4 slots, bf16)" in narrow.describe() and "(4 slots, fp32)" in roomy.describe()
    assert roomy.graphs > 0 and "decode graphs" in roomy.describe()  # the graphs' shared pool is planned
    eager = plan_memory(config, 10**8, roomy.total - roomy.kv // 2, **options, margin=0.0, decode_graphs=False)
    assert eager.graphs == 0 and eager.kv_tokens > tight.kv_tokens  # without graphs their memory goes to the KV
    with pytest.raises(NinferError, match="state_dtype must be one of fp32, bf16, not 'fp16'"):
        CacheConfig(state_dtype="fp16")
    with pytest.raises(MemoryPlanError, match=r"does not fit.*lower --max-context"):
        plan_memory(config, 10**10, 10**10, **options)


# the engine over the fast runner runs in the GPU suite only: interpreted it cost CI over two minutes, and its parts
# run here on their own (the scheduler's batching and prefix reuse over the reference runner in tests/test_engine.py;
# a batch's rows against the rows alone, and the snapshots' pages, below)
@pytest.mark.gpu
def test_engine_batches_decode_steps_on_the_fast_runner(demo):
    """The serving engine over the fast runner: concurrent greedy requests decode together (one decode_batch per
    step, budgets in whole KV pages) and each gets the tokens of the fast runner alone (decode steps do not depend
    on the batch); slots return."""
    import asyncio

    from ninfer.engine import LLM, Finished, Request
    from ninfer.sampling import SamplingParams

    _, fast = demo
    llm = LLM(device=fast.device.type, dtype=torch.float32, runner="reference")  # the demo model, then the fast runner
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [llm.tokenizer.encode(f"def f{i}(x):\n    return") for i in range(3)]
    expected = [_greedy_alone(fast, ids, params.max_tokens) for ids in prompts]
    llm.model = fast
    free = len(fast.cache.free_slots)
    steps = []
    decode = fast.decode
    fast.decode = lambda states, ids: steps.append(len(states)) or decode(states, ids)
    engine = llm.engine_with(max_concurrency=3).start()
    try:
        async def collect(ids):
            async for event in engine.generate(Request(ids, params, thinking=False)):
                if isinstance(event, Finished):
                    return event.completion.token_ids
            raise AssertionError("no Finished event")

        async def main():
            return await asyncio.gather(*(collect(ids) for ids in prompts))

        results = asyncio.run(main())
    finally:
        engine.close()
        del fast.decode
    assert results == expected
    assert max(steps) == 3  # the three sequences decoded in one batched step
    assert len(fast.cache.free_slots) == free


@pytest.mark.parametrize("recipe", ["fp8", "q4", "bf16"])
def test_every_recipe_runs_on_the_fast_path(tmp_path, recipe, paths):
    """fp8 rows (FP8 GEMV, decoded prefill rows), the q4 mix (q4/q5/q6/q8 GEMV and dequantized prefill) and bf16
    (cuBLAS) on the small model (q8 in the other tests)."""
    path = small_artifact(tmp_path / f"{recipe}.ninfer", recipe)
    reference, fast = _models(path, paths["device"], max_sequences=1)
    prompt = torch.tensor(PROMPT[:23])  # 23 tokens: the prefill route of every matrix
    ref_state, fast_state = reference.new_state(32), fast.new_state(32)
    with int8_activations(reference, path, head_only=True):
        expected = reference.prefill(prompt, ref_state)
    assert _relative(fast.prefill(prompt, fast_state), expected) < FP32_TOLERANCE
    token = torch.tensor([7])
    with int8_activations(reference, path):
        expected = reference.prefill(token, ref_state)
    assert _relative(fast.prefill(token, fast_state), expected) < DECODE_TOLERANCE


def test_runner_choice_and_its_errors():
    from ninfer.engine import LLM
    from ninfer.engine.load import fast_path_unsupported
    from ninfer.errors import NinferError

    assert LLM().fast is False  # auto on the CPU: the reference runner
    with pytest.raises(NinferError, match="the fast path cannot run this model: it runs on CUDA only"):
        LLM(runner="fast")
    with pytest.raises(NinferError, match="runner must be one of auto, fast, reference, not 'turbo'"):
        LLM(runner="turbo")
    with Artifact.open(DEMO) as artifact:
        config = TextConfig.from_dict(artifact.components["text"]["config"])
    narrow = TextConfig(**{**config.__dict__, "head_dim": 32})
    if torch.cuda.is_available():
        assert fast_path_unsupported(config, torch.device("cuda")) is None
    assert "head_dim 32 is not a power of two of at least 64" in fast_path_unsupported(narrow, torch.device("cuda"))


@pytest.mark.gpu  # see the engine test above
def test_engine_prefix_reuse_on_the_fast_runner(demo):
    """Two chats sharing a system turn, one after the other, through the engine over the fast runner: the second
    resumes from the snapshot of the first's system block (pages and GDN slot copied) and still produces the fast
    runner's tokens for the request alone, prefilled fresh in the same pieces (cut at the turn boundaries)."""
    import asyncio

    from ninfer.engine import LLM, Finished, Request
    from ninfer.sampling import SamplingParams

    _, fast = demo
    llm = LLM(device=fast.device.type, dtype=torch.float32, runner="reference")
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    system = "You write short Python helpers."
    prompts = [llm.prompt_ids([{"role": "system", "content": system}, {"role": "user", "content": question}],
                              thinking=False) for question in ("def add(a, b):", "def sub(a, b):")]
    im_end = llm.tokenizer.token_id("<|im_end|>")
    expected = [_greedy_alone(fast, ids, params.max_tokens,
                              [i + 1 for i, t in enumerate(ids[:-1]) if t == im_end] + [len(ids)]) for ids in prompts]
    llm.model = fast
    engine = llm.engine_with(max_concurrency=2, interleaved_prefill_chunk=64).start()
    try:
        async def run(ids):
            async for event in engine.generate(Request(ids, params, thinking=False)):
                if isinstance(event, Finished):
                    return event.completion
            raise AssertionError("no Finished event")

        results = [asyncio.run(run(ids)) for ids in prompts]
    finally:
        engine.close()
    assert [r.token_ids for r in results] == expected
    assert results[0].cached_tokens == 0 and results[1].cached_tokens > 0
    assert engine.stats()["prefix_hits"] == 1


def test_verify_equals_token_by_token_decode_and_accept_resumes(paths):
    """A verify step of T draft tokens gives the bits of T single-token decode steps; accepting j of them leaves
    each sequence exactly where decoding those j tokens would (GDN state from the verify snapshots). On the dense
    model only: snapshots and accept do not depend on the MLP, and the MoE's T-row pass of the decode kernels is
    `test_a_short_prompt_gives_the_bits_of_decoding_its_tokens_one_by_one`'s."""
    _, fast = _models(paths["dense"], paths["device"], max_sequences=6, max_verify_tokens=2)
    prompts = [torch.tensor(PROMPT[:9]), torch.tensor(PROMPT[9:14])]
    drafts = torch.tensor([[11, 12], [21, 22]])
    verified = [fast.new_state(32) for _ in prompts]
    stepped = [fast.new_state(32) for _ in prompts]
    prefilled = []  # each prompt prefilled once (interpreted prefills are slow), its state copied to the others
    for prompt, a, b in zip(prompts, verified, stepped, strict=True):
        fast.prefill(prompt, a)
        prefilled.append(fast.snapshot(a))
        fast.restore(b, len(prompt), prefilled[-1])
    logits = fast.verify(verified, drafts)
    expected = torch.stack([fast.decode(stepped, drafts[:, t]) for t in range(2)], dim=1)
    assert torch.equal(logits, expected)  # the same bits: verifying drafts never changes greedy decoding
    with pytest.raises(ValueError, match="accept the verify step"):
        fast.decode(verified, drafts[:, 0])
    fast.accept(verified, [1, 2])  # sequence 0 keeps one draft (its snapshot), sequence 1 both
    assert [s.length for s in verified] == [10, 7]
    # where decoding the kept drafts leaves each sequence: sequence 1 kept both, as `stepped[1]` decoded them;
    # sequence 0 its prompt and its first draft
    reference = [fast.new_state(32), stepped[1]]
    fast.restore(reference[0], len(prompts[0]), prefilled[0])
    fast.decode(reference[:1], drafts[:1, 0])
    nxt = torch.tensor([30, 31])
    assert torch.equal(fast.decode(verified, nxt), fast.decode(reference, nxt))
    with pytest.raises(ValueError, match=r"1\.\.2 tokens"):
        fast.verify(verified, torch.zeros((2, 3), dtype=torch.long))
    for snapshot in prefilled:
        fast.release_snapshot(snapshot)


def test_a_batch_wider_than_the_batch_routes_token_tile_gives_each_sequence_its_own_bits(paths, monkeypatch):
    """10 rows through the batch GEMV route — its K tile lowered to 256 lanes so that the small model's matrices take
    it here — in two token tiles (8 + 2, the second masked), against the row decoded alone: the same bits over two
    steps, so what else is batched never changes a sequence's tokens."""
    monkeypatch.setattr(quant_linear, "BATCH_BLOCK_K", 256)
    routes = []
    route = quant_linear.gemv_route
    monkeypatch.setattr(quant_linear, "gemv_route", lambda *args: routes.append(route(*args)) or routes[-1])
    _, fast = _models(paths["dense"], paths["device"], max_sequences=10)
    steps = [torch.arange(10) + 3, torch.arange(10) * 7 + 40]
    states = [fast.new_state(4) for _ in range(10)]
    batch = [fast.decode(states, tokens) for tokens in steps]
    assert set(routes) == {"batch"}
    for state in states:
        fast.free_state(state)
    for i in (0, 9):  # a row of each token tile
        alone = fast.new_state(4)
        for step, tokens in enumerate(steps):
            assert torch.equal(fast.decode([alone], tokens[i : i + 1])[0], batch[step][i]), f"{i}, {step}"


def test_snapshots_share_full_pages_by_reference_and_give_them_back(dense):
    _, fast = dense
    cache = fast.cache
    free_pages = len(cache.free_pages)
    prompt = torch.tensor((PROMPT * 4)[:70])  # one full 64-position page and 6 positions of the next
    original = fast.new_state(80)
    fast.prefill(prompt, original)
    saved = fast.snapshot(original)
    shared = original.pages[0]
    assert saved[("pages", 0)].pages == [shared] and cache.refs[shared] == 2  # the sequence and the lease
    expected = fast.prefill(torch.tensor([5, 6, 7]), original)
    copy = fast.new_state(80)
    fast.restore(copy, 70, saved)
    assert copy.pages[0] == shared and cache.refs[shared] == 3
    assert int(cache.block_tables[copy.slot, 0]) == shared and copy.pages[1] != original.pages[1]
    assert torch.equal(fast.prefill(torch.tensor([5, 6, 7]), copy), expected)  # wrote only its own page
    fast.free_state(original)
    fast.free_state(copy)
    assert cache.refs[shared] == 1  # the lease alone
    fast.release_snapshot(saved)
    assert len(cache.free_pages) == free_pages and all(r == 0 for r in cache.refs)


def test_allocation_reclaims_pages_held_by_snapshots(dense):
    _, fast = dense
    cache = fast.cache
    with pytest.raises(ValueError, match="free page"):
        cache.lease([cache.free_pages[-1]])
    leases = []
    while len(cache.free_pages) >= 2:  # sequences come and go; only leases (as snapshots take) keep their pages
        state = fast.new_state(128)
        leases.append(cache.lease(state.pages))
        fast.free_state(state)
    calls = []

    def reclaim() -> bool:  # the engine drops its oldest snapshot
        calls.append(len(leases))
        if not leases:
            return False
        cache.release(leases.pop(0))
        return True

    cache.reclaim = reclaim
    try:
        state = fast.new_state(128)  # two pages: only after a snapshot gave them back
        assert len(state.pages) == 2 and calls
        fast.free_state(state)
        while leases:
            cache.release(leases.pop())
        cache.reclaim = lambda: False
        held = [fast.new_state(16) for _ in cache.free_slots[:1]]
        with pytest.raises(CacheFullError, match="free slots"):
            held += [fast.new_state(16) for _ in range(len(cache.free_slots) + 1)]
    finally:
        cache.reclaim = None
