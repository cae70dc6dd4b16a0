"""Perplexity, KL divergence and the unigram baseline (`ninfer.eval.perplexity`) and `ninfer ppl` / `ninfer kl`.

Tolerances:
    SAME_PATH_RTOL: the same forwards summed in another order (float64 sums of the same float64 terms).
    TILED_RTOL: a window forwarded in several calls vs one call; the GDN chunking and the attention over the
        cache change fp32 rounding only (per-position NLLs of about 6 nats).
    EXACT_RTOL: closed-form values computed in float64 both ways.
    KL_Q8_MAX: KL(bf16 || q8) of the tiny synth model: q8 with group 32 is close, so the mean stays far below it.
"""

from __future__ import annotations

import json
import lzma
import math
import random

import pytest
import torch

from ninfer.artifact import open_artifact
from ninfer.cli import main
from ninfer.convert.synth import synth_artifact
from ninfer.eval.perplexity import (
    EvalError,
    Window,
    kl_divergence,
    perplexity,
    unigram_perplexity,
    windows,
)
from ninfer.frontend import Tokenizer
from ninfer.model.qwen3_5 import Qwen35Model

SAME_PATH_RTOL = 1e-12
TILED_RTOL = 1e-6
EXACT_RTOL = 1e-12
KL_Q8_MAX = 0.1
TEXT = ("Perplexity measures how surprised a model is by a text; ünïcödé and 中文 count as bytes here. " * 3).strip()


# -- fixtures ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, synth_artifact_path) -> dict[str, object]:
    """bf16 and q8 recipes of the same synth model, and a bf16 one whose tokenizer has one extra merge."""
    import ninfer.convert.synth as synth

    root = tmp_path_factory.mktemp("eval")
    paths = {"bf16": synth_artifact_path("tiny-dense", "bf16"), "q8": synth_artifact_path("tiny-dense", "q8"),
             "other": root / "other-tokenizer.ninfer"}
    original = synth.synth_resources

    def with_a_merge(config):
        resources = original(config)
        tokenizer = json.loads(resources["text"]["tokenizer.json"])
        tokenizer["model"]["vocab"]["ab"] = 300
        tokenizer["model"]["merges"].append(["a", "b"])
        resources["text"]["tokenizer.json"] = json.dumps(tokenizer).encode()
        return resources

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(synth, "synth_resources", with_a_merge)
        synth_artifact("tiny-dense", "bf16", paths["other"], quiet=True)
    text = root / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    compressed = root / "text.txt.xz"
    compressed.write_bytes(lzma.compress(TEXT.encode("utf-8")))
    return {**paths, "text": text, "xz": compressed}


def _load(path) -> Qwen35Model:
    with open_artifact(path) as artifact:
        return Qwen35Model.from_artifact(artifact, "cpu", torch.float32)


@pytest.fixture(scope="module")
def models(artifacts) -> dict[str, Qwen35Model]:
    return {name: _load(artifacts[name]) for name in ("bf16", "q8")}


def _ids(n: int, vocab: int = 320, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


class FakeModel:
    """Logits from a function of the new ids; records what each fresh state was fed."""

    device = torch.device("cpu")

    def __init__(self, logits_of):
        self.logits_of = logits_of
        self.fed: list[list[int]] = []
        self.capacities: list[int] = []
        self.freed: list[list[int]] = []

    def new_state(self, capacity: int) -> list[int]:
        self.capacities.append(capacity)
        self.fed.append([])
        return self.fed[-1]

    def free_state(self, state: list[int]) -> None:
        self.freed.append(state)

    def prefill(self, ids: torch.Tensor, state: list[int], all_logits: bool = False) -> torch.Tensor:
        state.extend(ids.tolist())
        logits = self.logits_of(ids)
        return logits if all_logits else logits[-1]


# -- windows ---------------------------------------------------------------------------------------------------


def test_windows_score_every_position_once_with_the_minimum_left_context():
    checked = 0
    for n in range(0, 70):
        for context in range(2, 24):
            for stride in range(1, context + 1):
                plan = windows(n, context, stride)
                step = min(stride, context - 1)  # a window's first token cannot be scored
                if n < 2:
                    assert plan == []
                    continue
                assert plan[0] == Window(0, min(context, n), 1)
                assert len(plan) == 1 + math.ceil(max(0, n - context) / step)
                scored = []
                for k, (begin, end, score_from) in enumerate(plan):
                    assert begin == k * step and 0 < end - begin <= context and begin < score_from < end
                    for t in range(score_from, end):
                        assert t - begin >= min(t, context - stride)  # at least context - stride tokens before t
                    scored.extend(range(score_from, end))
                assert scored == list(range(1, n)), (n, context, stride)
                checked += 1
    assert checked > 10_000


def test_windows_reject_sizes_that_cannot_score():
    for context, stride in ((1, 1), (0, 1), (8, 0), (8, 9)):
        with pytest.raises(EvalError):
            windows(100, context, stride)
    for n in (0, 1):
        with pytest.raises(EvalError, match="at least 2"):
            perplexity(FakeModel(lambda ids: torch.zeros(len(ids), 5)), list(range(n)), 4, 2, progress=False)


# -- perplexity ------------------------------------------------------------------------------------------------


def _independent_nll(model: Qwen35Model, ids: list[int], context: int, stride: int) -> float:
    """One full forward of each window's tokens from a fresh state; score the positions no window scored yet."""
    total, scored_to, begin = 0.0, 1, 0
    while scored_to < len(ids):
        end = min(begin + context, len(ids))
        with torch.no_grad():
            logits = model.prefill(torch.tensor(ids[begin:end]), model.new_state(end - begin), all_logits=True)
        logp = torch.log_softmax(logits.double(), dim=-1)
        for t in range(scored_to, end):
            total -= float(logp[t - 1 - begin, ids[t]])
        scored_to, begin = end, begin + min(stride, context - 1)
    return total


@pytest.mark.parametrize(("n", "context", "stride"), [(150, 32, 12), (150, 24, 24), (20, 64, 32)])
def test_perplexity_equals_an_independent_computation(models, n, context, stride):
    model, ids = models["bf16"], _ids(n)
    result = perplexity(model, ids, context, stride, progress=False)
    expected = _independent_nll(model, ids, context, stride)
    assert result.tokens == n - 1 and result.windows == len(windows(n, context, stride))
    assert result.nll_sum == pytest.approx(expected, rel=SAME_PATH_RTOL)
    assert result.ppl == pytest.approx(math.exp(expected / (n - 1)), rel=SAME_PATH_RTOL)
    tiled = perplexity(model, ids, context, stride, progress=False, tile=5)
    assert tiled.nll_sum == pytest.approx(expected, rel=TILED_RTOL)


def test_uniform_logits_give_the_vocabulary_size():
    vocab = 37
    model = FakeModel(lambda ids: torch.zeros(len(ids), vocab))
    ids = _ids(200, vocab)
    result = perplexity(model, ids, 16, 6, progress=False)
    assert result.ppl == pytest.approx(vocab, rel=EXACT_RTOL)
    assert result.nll_sum == pytest.approx(199 * math.log(vocab), rel=EXACT_RTOL)
    # each window ran from its own empty state on ids[begin : end]
    plan = windows(200, 16, 6)
    assert model.fed == [ids[w.begin : w.end] for w in plan]
    assert model.capacities == [w.end - w.begin for w in plan]
    assert len(model.freed) == len(plan)  # every window's state is given back


def test_logits_are_aligned_with_the_next_token():
    vocab = 11
    ids = [i % vocab for i in range(60)]
    successor = FakeModel(lambda x: 40.0 * torch.nn.functional.one_hot((x + 1) % vocab, vocab).float())
    predecessor = FakeModel(lambda x: 40.0 * torch.nn.functional.one_hot(x, vocab).float())  # off by one
    assert perplexity(successor, ids, 8, 3, progress=False).ppl == pytest.approx(1.0, abs=1e-12)
    assert perplexity(predecessor, ids, 8, 3, progress=False).ppl > 1e15


def test_ids_outside_the_vocabulary_are_refused():
    model = FakeModel(lambda ids: torch.zeros(len(ids), 8))
    with pytest.raises(EvalError, match="outside the model's vocabulary of 8"):
        perplexity(model, [1, 2, 8, 3], 4, 2, progress=False)
    with pytest.raises(EvalError, match="non-negative"):
        perplexity(model, [1, -2, 3], 4, 2, progress=False)


# -- KL divergence -----------------------------------------------------------------------------------------------


def test_kl_of_a_model_with_itself_is_zero(models):
    ids = _ids(120, seed=1)
    result = kl_divergence(models["bf16"], models["bf16"], ids, 32, 16, progress=False)
    assert (result.mean, result.p99, result.max) == (0.0, 0.0, 0.0)
    assert result.top1_agreement == 1.0 and result.tokens == 119
    assert result.ref_ppl == result.ppl == pytest.approx(perplexity(models["bf16"], ids, 32, 16, progress=False).ppl,
                                                         rel=SAME_PATH_RTOL)


def test_kl_of_bf16_against_q8_is_small_but_positive(models):
    ids = _ids(150, seed=2)
    result = kl_divergence(models["bf16"], models["q8"], ids, 32, 16, progress=False)
    assert 0.0 < result.mean < KL_Q8_MAX
    assert result.mean <= result.p99 <= result.max
    assert 0.5 < result.top1_agreement < 1.0
    assert result.ppl == pytest.approx(perplexity(models["q8"], ids, 32, 16, progress=False).ppl, rel=SAME_PATH_RTOL)


def test_kl_matches_the_closed_form_and_its_direction():
    vocab, peak = 9, 3.0
    uniform = FakeModel(lambda ids: torch.zeros(len(ids), vocab))
    peaked = FakeModel(lambda ids: torch.tensor([0.0, peak] + [0.0] * (vocab - 2)).expand(len(ids), vocab))
    ids = _ids(40, vocab, seed=3)
    z = math.exp(peak) + vocab - 1
    log_q = [-math.log(z), peak - math.log(z)] + [-math.log(z)] * (vocab - 2)
    kl_uniform_peaked = -math.log(vocab) - sum(log_q) / vocab  # KL(U || q)
    kl_peaked_uniform = sum(math.exp(lq) * (lq + math.log(vocab)) for lq in log_q)  # KL(q || U)
    result = kl_divergence(uniform, peaked, ids, 8, 4, progress=False)
    assert result.mean == pytest.approx(kl_uniform_peaked, rel=EXACT_RTOL)
    assert result.max == pytest.approx(kl_uniform_peaked, rel=EXACT_RTOL)
    assert result.top1_agreement == 0.0  # argmax 0 (first of equals) vs 1
    assert result.ref_ppl == pytest.approx(vocab, rel=EXACT_RTOL)
    reverse = kl_divergence(peaked, uniform, ids, 8, 4, progress=False)
    assert reverse.mean == pytest.approx(kl_peaked_uniform, rel=EXACT_RTOL)
    assert abs(reverse.mean - result.mean) > 0.05


def test_kl_refuses_models_with_different_vocabularies():
    small, large = (FakeModel(lambda ids, v=v: torch.zeros(len(ids), v)) for v in (8, 9))
    with pytest.raises(EvalError, match="vocabularies differ: 8 vs 9"):
        kl_divergence(small, large, [1, 2, 3], 4, 2, progress=False)


# -- unigram baseline ----------------------------------------------------------------------------------------------


def test_unigram_perplexity_by_hand():
    # train [0, 0, 1], vocabulary 3: p = (2+1, 1+1, 0+1) / (3+3) = 1/2, 1/3, 1/6
    # test [0, 1, 2]: ppl = (1/2 * 1/3 * 1/6) ** (-1/3) = 36 ** (1/3)
    assert unigram_perplexity([0, 0, 1], [0, 1, 2], 3) == pytest.approx(36 ** (1 / 3), rel=EXACT_RTOL)
    assert unigram_perplexity([], [4, 1], 5) == pytest.approx(5.0, rel=EXACT_RTOL)  # no data: uniform
    with pytest.raises(EvalError):
        unigram_perplexity([0, 3], [0], 3)
    with pytest.raises(EvalError):
        unigram_perplexity([0], [], 3)


# -- the CLI -----------------------------------------------------------------------------------------------------


def _text_ids(artifacts) -> list[int]:
    with open_artifact(artifacts["bf16"]) as artifact:
        return Tokenizer.from_artifact(artifact).encode(TEXT, special=False)


def test_cli_ppl(artifacts, models, capsys):
    ids = _text_ids(artifacts)
    assert len(ids) == len(TEXT.encode("utf-8"))  # the byte tokenizer: one token per byte
    expected = perplexity(models["bf16"], ids, 64, 32, progress=False)
    for text in ("text", "xz"):
        assert main(["ppl", str(artifacts["bf16"]), "--text", str(artifacts[text]), "--context", "64",
                     "--stride", "32", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["tokens"] == len(ids) - 1 and report["windows"] == expected.windows
        assert report["ppl"] == pytest.approx(expected.ppl, rel=SAME_PATH_RTOL)
    assert main(["ppl", str(artifacts["bf16"]), "--text", str(artifacts["text"]), "--max-tokens", "50"]) == 0
    out = capsys.readouterr().out
    truncated = perplexity(models["bf16"], ids[:50], 512, 256, progress=False)
    assert "50 tokens" in out and "49 positions" in out and f"perplexity  {truncated.ppl:.6g}" in out


def test_cli_kl(artifacts, models, capsys):
    ids = _text_ids(artifacts)
    expected = kl_divergence(models["bf16"], models["q8"], ids, 64, 32, progress=False)
    assert main(["kl", str(artifacts["bf16"]), str(artifacts["q8"]), "--text", str(artifacts["text"]),
                 "--context", "64", "--stride", "32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mean"] == pytest.approx(expected.mean, rel=SAME_PATH_RTOL)
    assert report["top1_agreement"] == expected.top1_agreement and report["tokens"] == len(ids) - 1
    assert main(["kl", str(artifacts["bf16"]), str(artifacts["q8"]), "--text", str(artifacts["xz"]),
                 "--context", "64", "--stride", "32"]) == 0
    out = capsys.readouterr().out
    for line in (f"KL mean          {expected.mean:.6g} nats", f"KL p99           {expected.p99:.6g} nats",
                 f"top-1 agreement  {100 * expected.top1_agreement:.2f} %", f"reference {expected.ref_ppl:.6g}"):
        assert line in out


@pytest.mark.parametrize("case", ["missing text", "missing model", "not xz", "not utf-8", "tokenizers differ",
                                  "stride beyond context", "empty text"])
def test_cli_errors_are_one_line_and_exit_2(artifacts, tmp_path, capsys, case):
    model, text = str(artifacts["bf16"]), str(artifacts["text"])
    bad_xz, bad_utf8, empty = tmp_path / "bad.txt.xz", tmp_path / "latin1.txt", tmp_path / "empty.txt"
    bad_xz.write_bytes(b"plain text, not xz")
    bad_utf8.write_bytes("café".encode("latin-1"))
    empty.write_text("")
    argv, expected = {
        "missing text": (["ppl", model, "--text", str(tmp_path / "nope.txt")], "nope.txt: no such file"),
        "missing model": (["kl", model, str(tmp_path / "nope.ninfer"), "--text", text], "nope.ninfer: no such file"),
        "not xz": (["ppl", model, "--text", str(bad_xz)], "not a valid xz file"),
        "not utf-8": (["ppl", model, "--text", str(bad_utf8)], "not UTF-8 text"),
        "tokenizers differ": (["kl", model, str(artifacts["other"]), "--text", text], "different tokenizers"),
        "stride beyond context": (["ppl", model, "--text", text, "--context", "8", "--stride", "9"],
                                  "stride 9 must lie in [1, context]"),
        "empty text": (["ppl", model, "--text", str(empty)], "scoring needs at least 2"),
    }[case]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"ninfer {argv[0]}: error: ") and expected in lines[0]
