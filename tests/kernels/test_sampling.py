"""The reference sampler and SamplingParams: kept sets computed by hand, penalties, seeds, distribution, validation."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from ninfer.errors import NinferError
from ninfer.kernels.sampling import (
    apply_penalties,
    filter_logits,
    make_generator,
    next_token_probs,
    sample_batch,
    sample_next,
)
from ninfer.sampling import SamplingError, SamplingParams

# chi-square critical value for 3 degrees of freedom at p = 0.001: a correct sampler fails 1 seed in 1000
CHI2_3DOF_P001 = 16.27
PROB_ATOL = 1e-6  # fp32 softmax of a handful of tokens


def kept(logits: torch.Tensor) -> set[int]:
    return {i for i, value in enumerate(logits.tolist()) if value != -math.inf}


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


# ---------------------------------------------------------------------------------------------- top-k


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0, 0.0])
    assert kept(filter_logits(logits, top_k=1)) == {1}
    assert kept(filter_logits(logits, top_k=2)) == {1, 2}
    assert kept(filter_logits(logits, top_k=4)) == {0, 1, 2, 3}


def test_top_k_at_or_above_vocab_keeps_all():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0, 0.0])
    assert kept(filter_logits(logits, top_k=5)) == set(range(5))
    assert kept(filter_logits(logits, top_k=1000)) == set(range(5))
    assert kept(filter_logits(logits, top_k=0)) == set(range(5))


def test_top_k_tie_at_the_kth_value_keeps_exactly_k_lower_ids_first():
    logits = torch.tensor([2.0, 3.0, 3.0, 3.0, 1.0])
    assert kept(filter_logits(logits, top_k=2)) == {1, 2}
    assert kept(filter_logits(logits, top_k=1)) == {1}


def test_filter_keeps_values_of_kept_tokens_and_does_not_modify_input():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    before = logits.clone()
    out = filter_logits(logits, top_k=2)
    assert torch.equal(logits, before)
    assert out.tolist() == [-math.inf, 4.0, 3.0, -math.inf]


# ---------------------------------------------------------------------------------------------- top-p


def test_top_p_keeps_the_smallest_set_reaching_top_p():
    # ids 2, 0, 3, 1 have probabilities 0.5, 0.3, 0.15, 0.05 (ranked): cumulative 0.5, 0.8, 0.95, 1.0
    logits = logits_of([0.3, 0.05, 0.5, 0.15])
    assert kept(filter_logits(logits, top_p=0.4)) == {2}
    assert kept(filter_logits(logits, top_p=0.7)) == {2, 0}
    assert kept(filter_logits(logits, top_p=0.85)) == {2, 0, 3}
    assert kept(filter_logits(logits, top_p=0.97)) == {0, 1, 2, 3}
    assert kept(filter_logits(logits, top_p=1.0)) == {0, 1, 2, 3}


def test_top_p_cumulative_exactly_at_top_p_stops_there():
    # 8 equal logits: each probability is exactly 1/8 in fp32, cumulative sums are exact
    logits = torch.zeros(8)
    assert kept(filter_logits(logits, top_p=0.375)) == {0, 1, 2}  # 3/8 reached exactly by the 3rd token
    assert kept(filter_logits(logits, top_p=0.25)) == {0, 1}
    assert kept(filter_logits(logits, top_p=0.375 + 1e-6)) == {0, 1, 2, 3}  # 3/8 falls short: one more
    assert kept(filter_logits(logits, top_p=1e-6)) == {0}  # always at least one token


def test_top_p_just_below_and_above_a_cumulative_value():
    # ranked probabilities 0.5 (id 1), 0.25 (id 0), 0.25 (id 2): cumulative 0.5, 0.75, 1.0
    logits = logits_of([0.25, 0.5, 0.25])
    eps = 1e-6  # far above the float64 rounding of the mass, far below the gaps
    assert kept(filter_logits(logits, top_p=0.5 - eps)) == {1}
    assert kept(filter_logits(logits, top_p=0.5 + eps)) == {1, 0}  # ties: lower id first
    assert kept(filter_logits(logits, top_p=0.75 - eps)) == {1, 0}
    assert kept(filter_logits(logits, top_p=0.75 + eps)) == {0, 1, 2}


def test_top_p_applies_to_the_top_k_distribution():
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    # without top-k, 0.4 < 0.55 needs a second token; after top-k=2 the top token has 4/7 ≈ 0.571 ≥ 0.55
    assert kept(filter_logits(logits, top_p=0.55)) == {0, 1}
    assert kept(filter_logits(logits, top_k=2, top_p=0.55)) == {0}
    assert kept(filter_logits(logits, top_k=2, top_p=0.6)) == {0, 1}


# ---------------------------------------------------------------------------------------------- min-p


def test_min_p_keeps_tokens_at_least_min_p_times_the_max():
    logits = logits_of([0.15, 0.5, 0.05, 0.3])
    assert kept(filter_logits(logits, min_p=0.2)) == {0, 1, 3}  # threshold 0.1
    assert kept(filter_logits(logits, min_p=0.5)) == {1, 3}  # threshold 0.25
    assert kept(filter_logits(logits, min_p=0.7)) == {1}  # threshold 0.35


def test_min_p_boundary_is_inclusive():
    # token 1 sits exactly at p = min_p · p_max (log-ratio log(0.25), evaluated in fp32 as the filter does)
    top = torch.tensor(1.5)
    at = top + math.log(0.25)
    below = torch.nextafter(at, torch.tensor(-math.inf))
    logits = torch.stack([top, at, below, torch.tensor(-5.0)])
    assert kept(filter_logits(logits, min_p=0.25)) == {0, 1}
    assert math.isclose(math.exp(at.item() - top.item()), 0.25, rel_tol=1e-6)


def test_filters_compose_in_order():
    logits = logits_of([0.35, 0.3, 0.2, 0.1, 0.05])
    # top-k 4 → renormalised 0.368, 0.316, 0.211, 0.105; top-p 0.9 keeps 4; min-p 0.5 (of 0.368) keeps 3
    assert kept(filter_logits(logits, top_k=4, top_p=0.9, min_p=0.5)) == {0, 1, 2}
    assert kept(filter_logits(logits, top_k=4, top_p=0.9)) == {0, 1, 2, 3}


def test_filter_works_row_wise_on_batches():
    rows = torch.stack([logits_of([0.1, 0.2, 0.7]), logits_of([0.6, 0.3, 0.1])])
    out = filter_logits(rows, top_k=1)
    assert kept(out[0]) == {2} and kept(out[1]) == {0}


# ------------------------------------------------------------------------------------- temperature and greedy


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([1.0, 3.0, 3.0, -2.0])
    assert sample_next(logits, SamplingParams.greedy_params(), None) == 1


def test_greedy_does_not_touch_the_generator():
    generator = make_generator(7, "cpu")
    state = generator.get_state()
    sample_next(torch.randn(32), SamplingParams.greedy_params(), generator)
    assert torch.equal(generator.get_state(), state)


def test_temperature_to_zero_is_greedy():
    logits = torch.randperm(50, generator=torch.Generator().manual_seed(0)).float() * 0.1  # gaps of 0.1
    greedy = sample_next(logits, SamplingParams.greedy_params(), None)
    for temperature in (1e-4, 1e-30):  # 0.1 / 1e-4: the runner-up's weight exp(-1000) is 0 in fp32
        params = SamplingParams(temperature=temperature)
        probs = next_token_probs(logits, params)
        assert torch.equal(probs, next_token_probs(logits, SamplingParams.greedy_params()))
        generator = make_generator(3, "cpu")
        assert {sample_next(logits, params, generator) for _ in range(100)} == {greedy}


def test_temperature_scales_the_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0])
    probs = next_token_probs(logits, SamplingParams(temperature=2.0))
    expected = torch.softmax(logits / 2.0, 0)
    torch.testing.assert_close(probs, expected, atol=PROB_ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------- penalties


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([3.0, -1.0, 2.0, -4.0, 0.0, 0.5, 0.25])
    params = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits, params, prompt_ids=torch.tensor([0, 4]), generated_ids=torch.tensor([1, 1, 6]))
    # ids 0 and 4 (prompt; zero stays zero), 1 (generated twice: penalised once) and 6 are seen; 2, 3, 5 are not
    assert out.tolist() == [1.5, -2.0, 2.0, -4.0, 0.0, 0.5, 0.125]


def test_presence_penalty_is_subtracted_once_per_generated_token():
    logits = torch.zeros(5)
    params = SamplingParams(presence_penalty=0.5)
    out = apply_penalties(logits, params, prompt_ids=torch.tensor([0, 1]), generated_ids=torch.tensor([2, 2, 2, 4]))
    assert out.tolist() == [0.0, 0.0, -0.5, 0.0, -0.5]  # the prompt is not penalised


def test_frequency_penalty_is_subtracted_per_occurrence():
    logits = torch.ones(5)
    params = SamplingParams(frequency_penalty=0.25)
    out = apply_penalties(logits, params, prompt_ids=torch.tensor([0]), generated_ids=torch.tensor([2, 2, 2, 4]))
    assert out.tolist() == [1.0, 1.0, 0.25, 1.0, 0.75]


def test_penalty_order_repetition_then_presence_and_frequency_then_bias():
    logits = torch.tensor([3.0, 0.0])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={0: 0.25})
    out = apply_penalties(logits, params, generated_ids=torch.tensor([0, 0]))
    assert out.tolist() == [3.0 / 2 - 1.0 - 2 * 0.5 + 0.25, 0.0]  # -0.25


def test_penalties_leave_the_input_alone_and_return_fp32():
    logits = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    before = logits.clone()
    out = apply_penalties(logits, SamplingParams(presence_penalty=1.0), generated_ids=torch.tensor([2]))
    assert torch.equal(logits, before)
    assert out.dtype == torch.float32 and out.tolist() == [1.0, 2.0, 2.0]


def test_logit_bias_forces_and_bans_tokens():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(1))
    forced = SamplingParams(logit_bias={57: 100.0})
    assert sample_next(logits, dataclasses.replace(forced, temperature=0.0), None) == 57
    generator = make_generator(5, "cpu")
    assert {sample_next(logits, forced, generator) for _ in range(20)} == {57}
    best = int(logits.argmax())
    banned = SamplingParams.greedy_params(logit_bias={best: -100.0})
    assert sample_next(logits, banned, None) == int(logits.topk(2).indices[1])


def test_ids_outside_the_vocabulary_are_rejected():
    logits = torch.zeros(10)
    with pytest.raises(SamplingError, match=r"generated_ids holds an id outside the vocabulary \[0, 10\)"):
        apply_penalties(logits, SamplingParams(presence_penalty=1.0), generated_ids=torch.tensor([3, 10]))
    with pytest.raises(SamplingError, match="logit_bias token id 12 is outside the vocabulary of 10"):
        apply_penalties(logits, SamplingParams(logit_bias={12: 1.0}))


def test_broken_logits_are_rejected():
    with pytest.raises(SamplingError, match="NaN"):
        sample_next(torch.tensor([0.0, math.nan]), SamplingParams(), None)
    with pytest.raises(SamplingError, match="every one of the 2 logits is -inf"):
        sample_next(torch.full((2,), -math.inf), SamplingParams(), None)


# ------------------------------------------------------------------------------------------ seeds and draws


def draw_sequence(seed: int, steps: int = 50) -> list[int]:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(seed=seed, top_k=200, frequency_penalty=0.1)
    generator = make_generator(params.seed, "cpu")
    generated: list[int] = []
    for _ in range(steps):
        generated.append(sample_next(logits, params, generator, generated_ids=torch.tensor(generated)))
    return generated


def test_same_seed_same_sequence_different_seed_different_sequence():
    first = draw_sequence(1234)
    assert first == draw_sequence(1234)
    assert first != draw_sequence(1235)
    assert len(set(first)) > 10  # the draws really are random


def test_make_generator_without_seed_is_the_global_generator():
    assert make_generator(None, "cpu") is None


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_draws_follow_the_softmax():
    draws = 20_000
    logits = torch.tensor([0.3, -1.2, 1.1, 0.0])
    params = SamplingParams(temperature=0.8)
    generator = make_generator(2024, "cpu")
    counts = torch.zeros(4)
    for _ in range(draws):
        counts[sample_next(logits, params, generator)] += 1
    expected = torch.softmax(logits.double() / 0.8, 0).float()
    assert chi_square(counts, expected) < CHI2_3DOF_P001


def test_draws_follow_the_filtered_distribution():
    draws = 5_000
    logits = torch.tensor([0.3, -1.2, 1.1, 0.0, -0.5])
    params = SamplingParams(top_k=4, min_p=0.3)  # top-k drops id 1; min-p (0.3 · p(id 2)) drops id 4
    generator = make_generator(7, "cpu")
    counts = torch.zeros(5)
    for _ in range(draws):
        counts[sample_next(logits, params, generator)] += 1
    assert counts[1] == 0 and counts[4] == 0
    kept_ids = [0, 2, 3]
    expected = torch.softmax(logits[kept_ids].double(), 0).float()
    assert chi_square(counts[kept_ids], expected) < 13.82  # 2 degrees of freedom, p = 0.001


def test_no_hidden_top_k_cap():
    vocab = 1000
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    logits = torch.empty(vocab)
    logits[order] = -0.001 * torch.arange(vocab, dtype=torch.float32)  # order[r] has rank r
    rank_of = {int(token): rank for rank, token in enumerate(order)}
    params = SamplingParams(top_k=100, seed=11)
    assert len(kept(filter_logits(logits, top_k=100))) == 100
    generator = make_generator(params.seed, "cpu")
    ranks = [rank_of[sample_next(logits, params, generator)] for _ in range(200)]
    assert max(ranks) < 100
    assert max(ranks) > 20


# ---------------------------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -0.1}, "temperature must be finite and >= 0 (0 = greedy), got -0.1"),
        ({"temperature": math.inf}, "temperature must be finite and >= 0 (0 = greedy), got inf"),
        ({"temperature": math.nan}, "temperature must be finite and >= 0 (0 = greedy), got nan"),
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"top_k": -1}, "top_k must be >= 0 (0 = off), got -1"),
        ({"top_k": 2.5}, "top_k must be an integer, got 2.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1] (1 = off), got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1] (1 = off), got 1.5"),
        ({"top_p": math.nan}, "top_p must be in (0, 1] (1 = off), got nan"),
        ({"min_p": 1.0}, "min_p must be in [0, 1) (0 = off), got 1.0"),
        ({"min_p": -0.01}, "min_p must be in [0, 1) (0 = off), got -0.01"),
        ({"presence_penalty": math.inf}, "presence_penalty must be finite, got inf"),
        ({"frequency_penalty": math.nan}, "frequency_penalty must be finite, got nan"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be finite and > 0 (1 = off), got 0.0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be finite and > 0 (1 = off), got -1.0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token id must be >= 0, got -1"),
        ({"logit_bias": {5: math.inf}}, "logit_bias value for token 5 must be finite, got inf"),
        ({"logit_bias": {5: math.nan}}, "logit_bias value for token 5 must be finite, got nan"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be int token ids, got '5'"),
        ({"logit_bias": [(5, 1.0), (5, 2.0)]}, "logit_bias lists token 5 twice"),
        ({"seed": 2**64}, "seed must be in [-2^63, 2^64 - 1], got 18446744073709551616"),
        ({"stop": "</s>"}, "stop must be a sequence of strings, not the single string '</s>'"),
        ({"stop": ("",)}, "stop entries must be non-empty strings, got ''"),
        ({"stop_token_ids": (-3,)}, "stop_token_ids entries must be >= 0, got -3"),
    ],
)
def test_validate_rejects_each_bad_value_with_its_own_message(fields, message):
    with pytest.raises(SamplingError, match=re.escape(message)):
        SamplingParams(**fields)


def test_sampling_error_is_a_ninfer_error():
    assert issubclass(SamplingError, NinferError)


def test_boundary_values_are_accepted():
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1e-3, max_tokens=1, seed=-1)
    SamplingParams(top_p=1e-9, min_p=0.999, presence_penalty=-2.0, seed=2**64 - 1)


def test_params_are_frozen_and_hashable():
    params = SamplingParams(logit_bias={7: 1.0, 3: -2.0}, stop=["a", "b"], stop_token_ids=[1])
    assert params.logit_bias == ((3, -2.0), (7, 1.0))
    assert dict(params.logit_bias) == {3: -2.0, 7: 1.0}
    assert params.stop == ("a", "b") and params.stop_token_ids == (1,)
    same = SamplingParams(logit_bias={3: -2.0, 7: 1}, stop=("a", "b"), stop_token_ids=(1,))
    assert params == same and hash(params) == hash(same)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.top_k = 5  # type: ignore[misc]
    with pytest.raises(SamplingError, match="top_k must be >= 0"):
        dataclasses.replace(params, top_k=-1)


def test_greedy_property_and_constructor():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams().greedy
    params = SamplingParams.greedy_params(max_tokens=8, stop=("x",))
    assert params.greedy and params.max_tokens == 8 and params.stop == ("x",)


def test_from_generation_config():
    qwen = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [1, 2]}
    params = SamplingParams.from_generation_config(qwen)
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.6, 20, 0.95, 0.0)
    assert params.repetition_penalty == 1.0
    assert SamplingParams.from_generation_config(qwen, top_k=0, max_tokens=9) == dataclasses.replace(
        params, top_k=0, max_tokens=9
    )
    assert SamplingParams.from_generation_config({**qwen, "do_sample": False}).greedy
    assert SamplingParams.from_generation_config({"temperature": 0.7}).greedy  # transformers: do_sample defaults off
    assert SamplingParams.from_generation_config({"do_sample": False}, temperature=0.3).temperature == 0.3
    with_nulls = {"do_sample": True, "top_k": None, "min_p": 0.05, "repetition_penalty": 1.1}
    params = SamplingParams.from_generation_config(with_nulls)
    assert (params.temperature, params.top_k, params.min_p, params.repetition_penalty) == (1.0, 0, 0.05, 1.1)
    with pytest.raises(SamplingError, match="top_p must be in"):
        SamplingParams.from_generation_config({"do_sample": True, "top_p": 0.0})


BATCH_PARAMS = [
    SamplingParams.greedy_params(),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5),
    SamplingParams(temperature=1.3, min_p=0.05, repetition_penalty=1.2, seed=6),
    SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={3: 4.0}),
    SamplingParams(temperature=1.0, seed=7),
]


def test_sample_batch_gives_each_row_the_token_sample_next_gives_it_alone():
    generator = torch.Generator().manual_seed(0)
    prompt, generated = torch.tensor([1, 3, 3, 8]), torch.tensor([2, 2, 5])
    for step in range(20):
        logits = torch.randn(len(BATCH_PARAMS), 64, generator=generator) * 3
        batch_generators = [make_generator(p.seed and p.seed + step, "cpu") for p in BATCH_PARAMS]
        alone_generators = [make_generator(p.seed and p.seed + step, "cpu") for p in BATCH_PARAMS]
        got = sample_batch(logits, BATCH_PARAMS, batch_generators, [prompt] * 5, [generated] * 5)
        expected = [sample_next(row, p, g, prompt, generated)
                    for row, p, g in zip(logits, BATCH_PARAMS, alone_generators, strict=True)]
        assert got == expected, f"step {step}"


def test_sample_batch_fails_only_the_rows_that_cannot_be_sampled():
    logits = torch.randn(4, 10)
    logits[1, 4] = float("nan")
    logits[2] = float("-inf")
    params = [SamplingParams(temperature=1.0, seed=1)] * 3 + [SamplingParams(logit_bias={12: 1.0})]
    got = sample_batch(logits, params, [make_generator(1, "cpu")] * 4, [None] * 4, [None] * 4)
    assert isinstance(got[0], int) and 0 <= got[0] < 10
    assert isinstance(got[1], SamplingError) and "NaN" in str(got[1])
    assert isinstance(got[2], SamplingError) and "every one of the 10 logits is -inf" in str(got[2])
    assert isinstance(got[3], SamplingError) and "logit_bias token id 12" in str(got[3])


def test_sample_batch_reads_the_device_back_once(monkeypatch):
    reads = []

    def counted(name, original):
        def read(self, *args):
            reads.append(name)
            return original(self, *args)

        return read

    for name in ("item", "tolist", "__bool__", "__int__", "__index__"):  # every way a device value reaches Python
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    logits = torch.randn(len(BATCH_PARAMS), 64)
    generators = [make_generator(p.seed, "cpu") for p in BATCH_PARAMS]
    sample_batch(logits, BATCH_PARAMS, generators, [torch.tensor([1, 2])] * 5, [torch.tensor([3])] * 5)
    assert reads == ["tolist"]


def test_sample_batch_greedy_rows_without_penalties_match_sample_next_on_ties_and_broken_rows():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 32, generator=generator).to(torch.bfloat16)
    logits[0, [5, 9]] = 40.0  # a tie: the lower id wins
    logits[2, 3] = float("nan")
    logits[3, 30] = float("inf")
    logits[4] = float("-inf")
    logits[5, :31] = float("-inf")  # only the last id is samplable
    logits[6] = 0.0
    logits[6, 0], logits[6, 1] = 2.0, 1.75
    prompt = torch.tensor([0])  # the penalty takes row 6's argmax from 0 (2 / 1.5) to 1
    plain = SamplingParams.greedy_params()
    params = [plain, plain, plain, plain, plain, plain, SamplingParams.greedy_params(repetition_penalty=1.5)]
    got = sample_batch(logits, params, [None] * 7, [prompt] * 7, [None] * 7)
    assert got[0] == 5 and got[5] == 31 and got[6] == 1
    for b, row_params in enumerate(params):
        try:
            expected = sample_next(logits[b], row_params, None, prompt, None)
        except SamplingError as error:
            assert isinstance(got[b], SamplingError) and str(got[b]) == str(error), b
        else:
            assert got[b] == expected, b
    assert [isinstance(g, SamplingError) for g in got] == [False, False, True, True, True, False, False]


def test_sample_batch_picks_the_plain_greedy_rows_in_one_pass(monkeypatch):
    logits = torch.randn(8, 64)
    expected = [int(torch.argmax(row)) for row in logits]
    calls = []
    original_function, original_method = torch.argmax, torch.Tensor.argmax
    monkeypatch.setattr(torch, "argmax", lambda *a, **k: calls.append(1) or original_function(*a, **k))
    monkeypatch.setattr(torch.Tensor, "argmax", lambda self, *a, **k: calls.append(1) or original_method(self, *a, **k))
    assert sample_batch(logits, [SamplingParams.greedy_params()] * 8, [None] * 8, [None] * 8, [None] * 8) == expected
    assert len(calls) == 1
