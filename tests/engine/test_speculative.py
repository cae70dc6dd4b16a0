"""MTP speculative decoding: greedy output identical to plain decoding, sampling with plain sampling's distribution,
and the round's bookkeeping (stops inside a round, prefix reuse, mixed batches, statistics, the draft length)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer.config import ConfigError, SpeculativeConfig
from ninfer.engine.llm import LLM
from ninfer.engine.speculative import DraftLength, SpeculationStats
from ninfer.errors import NinferError
from ninfer.kernels.sampling import next_token_probs, speculative_accept
from ninfer.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
SMALL_MOE = ROOT / "data" / "models" / "small-moe-q8.ninfer"
PROMPTS = ("def parse_args(argv):\n", "import os\nimport sys\n\n\nclass ")
GREEDY = SamplingParams(temperature=0, max_tokens=32)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(runner="reference")


@pytest.fixture(scope="module")
def drafting() -> LLM:
    return LLM(runner="reference", spec="mtp", draft_tokens=3)


def _engine(llm: LLM, k: int | None):
    from ninfer.config import SchedulerConfig
    from ninfer.engine.engine import Engine

    return Engine(llm, SchedulerConfig(), speculative=SpeculativeConfig("mtp", k))


def _generate(llm: LLM, engine, prompt, params: SamplingParams, **options):
    from ninfer.engine.sequence import Finished, Request

    ids = llm.prompt_ids(prompt, raw=options.pop("raw", True), thinking=False)
    for event in engine.stream(Request(ids, params, thinking=False)):
        if isinstance(event, Finished):
            return event.completion
    raise AssertionError("no Finished event")


@pytest.mark.parametrize("k", [1, 2, 3, 5, None], ids=["k1", "k2", "k3", "k5", "chosen"])
def test_greedy_equals_plain_on_the_demo_model(plain: LLM, drafting: LLM, k: int | None) -> None:
    engine = _engine(drafting, k)
    for prompt in PROMPTS:
        expected = plain.generate(prompt, GREEDY, raw=True)
        got = _generate(drafting, engine, prompt, GREEDY)
        assert got.token_ids == expected.token_ids
        assert got.text == expected.text and got.finish_reason == expected.finish_reason
        spec = got.stats.speculation
        if k is None and prompt == PROMPTS[0]:  # the first choices are plain steps (they measure the unit)
            assert spec.fallback_steps >= DraftLength.FIRST_PLAIN_STEPS
        assert k is None or spec.rounds > 0
        assert spec.drafted == sum(spec.drafted_per_position)
        assert spec.accepted == sum(spec.accepted_per_position)
        assert k is None or spec.accepted > 0  # a trained head drafts some right
        # the prefill's token, then each round's accepted drafts and one more (the last round may be cut short)
        assert spec.rounds + 1 < len(got.token_ids) <= spec.accepted + spec.rounds + 1 + spec.fallback_steps


@pytest.mark.parametrize("path", [SMALL_MOE, "tiny-dense", "tiny-moe"], ids=["small-moe", "tiny-dense", "tiny-moe"])
def test_greedy_equals_plain_on_other_models(path, synth_artifact_path) -> None:
    path = path if isinstance(path, Path) else synth_artifact_path(path, "q8")
    expected = LLM(path, runner="reference").generate(PROMPTS[0], GREEDY, raw=True)
    for k in (1, 4):
        got = LLM(path, runner="reference", spec="mtp", draft_tokens=k).generate(PROMPTS[0], GREEDY, raw=True)
        assert got.token_ids == expected.token_ids


def test_stops_inside_a_round_end_where_plain_decoding_ends(plain: LLM, drafting: LLM) -> None:
    engine = _engine(drafting, 5)
    reference = plain.generate(PROMPTS[0], GREEDY, raw=True)
    for max_tokens in (1, 2, 3, 7, 11):  # budgets that end inside a 5-draft round
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        got = _generate(drafting, engine, PROMPTS[0], params)
        assert got.token_ids == reference.token_ids[:max_tokens] and got.finish_reason == "length"
    stop_id = reference.token_ids[9]  # a stop id the round meets mid-way
    params = SamplingParams(temperature=0, max_tokens=32, stop_token_ids=(stop_id,))
    got = _generate(drafting, engine, PROMPTS[0], params)
    assert got.token_ids == reference.token_ids[: reference.token_ids.index(stop_id)] and got.finish_reason == "stop"
    stop = reference.text[len(reference.text) // 2 :][:4]
    params = SamplingParams(temperature=0, max_tokens=32, stop=(stop,))
    want = plain.generate(PROMPTS[0], params, raw=True)
    got = _generate(drafting, engine, PROMPTS[0], params)
    assert (got.text, got.token_ids, got.stop_string) == (want.text, want.token_ids, want.stop_string)


def test_prefix_reuse_keeps_the_drafter_in_step(plain: LLM, drafting: LLM) -> None:
    engine = _engine(drafting, 3)
    system = [{"role": "system", "content": "You write Python."}]
    first = [*system, {"role": "user", "content": "Write a function to add two numbers."}]
    second = [*system, {"role": "user", "content": "Write a function to read a file."}]
    for messages in (first, second):
        expected = plain.generate(messages, GREEDY, thinking=False)
        got = _generate(drafting, engine, messages, GREEDY, raw=False)
        assert got.token_ids == expected.token_ids
    assert got.stats.cached_tokens > 0  # the second prompt resumed the system turn, drafter state included


def test_a_batch_mixing_speculating_and_plain_sequences(plain: LLM, drafting: LLM, monkeypatch) -> None:
    from ninfer.engine.sequence import Finished, Request

    engine = _engine(drafting, 2)
    chosen = engine._round_length
    requests = [Request(drafting.prompt_ids(p, raw=True), GREEDY) for p in PROMPTS * 2]
    plain_ids = {requests[1].request_id, requests[2].request_id}
    monkeypatch.setattr(engine, "_round_length",
                        lambda s: 0 if s.request.request_id in plain_ids else chosen(s))
    done = {}
    sequences = [engine.submit(r, lambda item, r=r: done.__setitem__(r.request_id, item)
                               if isinstance(item, Finished | Exception) else None) for r in requests]
    while any(not s.finished for s in sequences):
        engine.step()
    for request, prompt in zip(requests, PROMPTS * 2, strict=True):
        completion = done[request.request_id].completion
        assert completion.token_ids == plain.generate(prompt, GREEDY, raw=True).token_ids
        spec = completion.stats.speculation
        assert (spec is None or spec.rounds == 0) == (request.request_id in plain_ids)


def test_speculative_sampling_draws_from_the_target_distribution() -> None:
    """Each emitted token has the target's processed distribution given the ones before it: the first token's
    histogram matches p_0 and, when the first draft was emitted, the second token's matches p_1."""
    torch.manual_seed(0)
    vocab, trials = 12, 12000
    logits = torch.randn(3, vocab) * 1.5
    drafts = torch.tensor([int(logits[0].argmax()), 5])
    params = SamplingParams(temperature=0.8, top_p=0.9)
    generator = torch.Generator().manual_seed(1)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(trials):
        accepted, token, broken, empty = speculative_accept(logits, drafts, params, generator, None, None).tolist()
        assert not broken and not empty
        emitted = [*drafts[:accepted].tolist(), token]
        first[emitted[0]] += 1
        if emitted[0] == drafts[0] and len(emitted) > 1:
            second[emitted[1]] += 1
    for counts, column in ((first, 0), (second, 1)):
        target = next_token_probs(logits[column], params)
        observed = counts / counts.sum()
        tv = 0.5 * (observed - target).abs().sum()
        assert tv < 4.0 / counts.sum().sqrt(), (column, tv)  # ~3-4 standard errors for 12 cells
        assert observed[target == 0].sum() == 0  # nothing outside top-p is ever emitted


def test_speculative_sampling_end_to_end_matches_plain_sampling(plain: LLM, drafting: LLM) -> None:
    """The token after the first one, given the first (sampled from the prefill's logits as plainly), has the
    model's processed distribution: each token's frequency over seeds within 4.5 standard errors of its exact
    probability, and no token outside top-p ever."""
    engine = _engine(drafting, 2)
    base = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=2)
    pairs = [tuple(_generate(drafting, engine, PROMPTS[1], SamplingParams(**{**base.__dict__, "seed": seed}))
                   .token_ids) for seed in range(300)]
    first = max(set(p[0] for p in pairs), key=[p[0] for p in pairs].count)
    seconds = torch.tensor([p[1] for p in pairs if p[0] == first])
    n = seconds.numel()
    assert n >= 60
    state = plain.model.new_state(64)
    logits = plain.model.prefill(torch.tensor([*plain.prompt_ids(PROMPTS[1], raw=True), first]), state)
    logits[plain.tokenizer.vocab_size :] = float("-inf")
    exact = next_token_probs(logits, base)
    observed = torch.bincount(seconds, minlength=exact.numel()).float() / n
    bound = 4.5 * (exact * (1 - exact) / n).sqrt() + 1 / n
    assert bool(((observed - exact).abs() <= bound).all())
    assert observed[exact == 0].sum() == 0


def test_greedy_acceptance_is_argmax_with_penalties() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0], [5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 4.0]])
    plain_greedy = SamplingParams(temperature=0)
    accepted, token, *_ = speculative_accept(logits, torch.tensor([1, 0]), plain_greedy, None, None, None).tolist()
    assert (accepted, token) == (2, 3)
    # a presence penalty on id 1 (already generated) makes id 2 the target: the first draft is rejected
    penalised = SamplingParams(temperature=0, presence_penalty=1.0)
    accepted, token, *_ = speculative_accept(logits, torch.tensor([1, 0]), penalised, None, None,
                                             torch.tensor([1])).tolist()
    assert (accepted, token) == (0, 2)


def test_statistics_and_draft_length_choice() -> None:
    stats = SpeculationStats()
    stats.record(3, 2)
    stats.record(3, 0)
    assert stats.as_dict() == {"rounds": 2, "drafted_tokens": 6, "accepted_tokens": 2,
                               "accepted_per_position": [1, 1, 0], "fallback_steps": 0}
    assert stats.reached_per_position == [2, 1, 1] and stats.tokens_per_round == 2.0
    chooser = DraftLength()
    for _ in range(DraftLength.FIRST_PLAIN_STEPS):
        assert chooser.choose(stats) == 0  # plain steps first: they measure the unit
        chooser.measured(0, 1.0)
    good = SpeculationStats()
    for _ in range(50):
        good.record(8, 8)
    chooser.measured(2, 1.1)
    assert chooser.choose(good) >= 4  # cheap rounds, every draft accepted: long drafts pay
    dear = DraftLength()
    for _ in range(DraftLength.FIRST_PLAIN_STEPS):
        dear.choose(stats)
        dear.measured(0, 1.0)
    for k in range(1, 9):
        dear.measured(k, 10.0 + k)  # rounds far dearer than a plain step: never worth it
    assert dear.choose(good) == 0


def test_configuration_and_errors(hf_checkpoint, tmp_path: Path) -> None:
    from ninfer.convert.checkpoint import convert_checkpoint
    from tests.fixtures.hf_checkpoints import CheckpointSpec

    with pytest.raises(ConfigError, match=r"needs spec=.mtp."):
        SpeculativeConfig("none", 3)
    with pytest.raises(ConfigError, match=r"1\.\.8"):
        SpeculativeConfig("mtp", 9)
    with pytest.raises(ConfigError, match="spec must be one of"):
        SpeculativeConfig("dflash")
    folder, _ = hf_checkpoint(CheckpointSpec(mtp=False, vision=False))
    no_mtp = tmp_path / "no-mtp.ninfer"
    convert_checkpoint(folder, "bf16", no_mtp, quiet=True)
    with pytest.raises(NinferError, match="no mtp component"):
        LLM(no_mtp, runner="reference", spec="mtp")


def test_a_restricted_proposal_head_changes_drafts_not_outputs(plain: LLM) -> None:
    """Drafts over a proposal head of every token (in another order) are the whole head's; over a head without the
    tokens greedy decoding picks, every draft is rejected, and the output is still plain greedy decoding's."""
    from ninfer.model.qwen3_5 import Qwen35Model

    model = plain.model
    expected = plain.generate(PROMPTS[0], GREEDY, raw=True).token_ids
    vocab = plain.tokenizer.vocab_size
    everything = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    missing = torch.tensor(sorted(set(range(vocab)) - set(expected)))
    full = Qwen35Model(model.config, model.weights, model.device, model.dtype, drafter=True)
    for ids, all_rejected in ((everything, False), (missing, True)):
        weights = {**model.weights, "draft_head": model.head[ids], "draft_head_token_ids": ids.int()}
        restricted = Qwen35Model(model.config, weights, model.device, model.dtype, drafter=True, draft_head=True)
        state, reference = restricted.new_state(64), full.new_state(64)
        prompt = torch.tensor(plain.prompt_ids(PROMPTS[0], raw=True))
        restricted.prefill(prompt, state)
        full.prefill(prompt, reference)
        drafts = restricted.draft([state], torch.tensor([expected[0]]), 4)
        assert set(drafts.view(-1).tolist()) <= set(ids.tolist())
        if not all_rejected:
            assert drafts.tolist() == full.draft([reference], torch.tensor([expected[0]]), 4).tolist()
        restricted.kv_capacity = model.kv_capacity
        llm = LLM.__new__(LLM)
        llm.__dict__.update(plain.__dict__, model=restricted)
        got = _generate(llm, _engine(llm, 3), PROMPTS[0], GREEDY)
        assert got.token_ids == expected
        assert (got.stats.speculation.accepted == 0) == all_rejected


def test_lm_head_draft_from_the_draft_head_command(plain: LLM, tmp_path: Path) -> None:
    from ninfer.convert.draft_head import add_draft_head

    calibration = tmp_path / "calibration.txt"
    calibration.write_text("import os\n\n\ndef main(argv):\n    return os.path.join(*argv)\n" * 20)
    out = tmp_path / "drafting.ninfer"
    add_draft_head(plain.path, calibration, 512, out, fmt="bf16", quiet=True)
    llm = LLM(out, runner="reference", spec="mtp", draft_tokens=3, lm_head_draft=True)
    assert llm.model.proposal[0].shape[0] == 512
    got = llm.generate(PROMPTS[0], GREEDY, raw=True)
    assert got.token_ids == plain.generate(PROMPTS[0], GREEDY, raw=True).token_ids
    assert got.stats.speculation.rounds > 0
    with pytest.raises(NinferError, match="has none; add one with `ninfer draft-head`"):
        LLM(runner="reference", spec="mtp", lm_head_draft=True)
