"""The reference Qwen3.5 model against transformers, teacher-forced, on tiny checkpoints the suite generates.

Tolerances (logit std is about 4 on these models):
    FP32_LOGITS_ATOL: fp32 on both sides; differences come from summation order only.
    BF16_ERROR_RATIO, BF16_ERROR_FLOOR: the bf16 path's relative L2 error against the exact logits may be at
        most this multiple (plus floor) of transformers' own bf16 error (2 % dense, 9 % MoE on these models).
"""

from __future__ import annotations

import pytest
import torch

from ninfer.artifact import open_artifact
from ninfer.convert.checkpoint import convert_checkpoint
from ninfer.frontend.vocab import byte_tokenizer_files
from ninfer.model.qwen3_5 import Qwen35Model
from tests.fixtures.hf_checkpoints import VOCAB_SIZE, CheckpointSpec, build_model, write_checkpoint

FP32_LOGITS_ATOL = 2e-4
FP32_HIDDEN_ATOL = 1e-4
BF16_ERROR_RATIO, BF16_ERROR_FLOOR = 1.6, 5e-3  # our bf16 error vs the exact logits, relative to transformers'
LONG, SHORT = 150, 3  # longer than two GDN chunks of 64; shorter than the conv width 4

VARIANTS = {
    "dense_official": CheckpointSpec(),
    "dense_text_tied": CheckpointSpec(layout="text", tied=True),
    "moe_official": CheckpointSpec(moe=True),
    "moe_text_tied": CheckpointSpec(moe=True, layout="text", tied=True),
}


def _prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """variant -> (our fp32 model, transformers fp32 model)."""
    root = tmp_path_factory.mktemp("models")
    built = {}
    for name, spec in VARIANTS.items():
        write_checkpoint(root / name, spec, byte_tokenizer_files(VOCAB_SIZE))
        out = root / f"{name}.ninfer"
        convert_checkpoint(root / name, "fp32", out, quiet=True)
        with open_artifact(out) as artifact:
            ours = Qwen35Model.from_artifact(artifact)
        built[name] = (ours, build_model(spec))
    return built


def _reference(hf_model, ids: torch.Tensor):
    with torch.no_grad():
        out = hf_model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    return out.logits[0].float(), [h[0].float() for h in out.hidden_states]


def _first_divergence(ours: list[torch.Tensor], theirs: list[torch.Tensor], atol: float) -> str:
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        error = float((a.float() - b).abs().max())
        if error > atol:
            where = f"the input of layer {index}" if index < len(ours) - 1 else "the final norm's output"
            return f"first divergence at {where}: max abs error {error:.3g}"
    return "hidden states agree; the head differs"


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("length", [LONG, SHORT])
def test_fp32_logits_match_transformers(models, variant, length):
    ours, hf = models[variant]
    ids = _prompt(length)
    expected, hidden_expected = _reference(hf, ids)
    collect: list[torch.Tensor] = []
    with torch.no_grad():
        state = ours.new_state(length)
        logits = ours.hidden_states(ids, state, collect) @ ours.head.T
    error = float((logits - expected).abs().max())
    assert error <= FP32_LOGITS_ATOL, _first_divergence(collect, hidden_expected, FP32_HIDDEN_ATOL)


@pytest.mark.parametrize("variant", ["dense_official", "moe_official"])
def test_cached_decode_equals_uncached_forward(models, variant):
    ours, _ = models[variant]
    ids = _prompt(LONG + 10, seed=1)
    with torch.no_grad():
        full = ours.prefill(ids, ours.new_state(ids.numel()), all_logits=True)
        state = ours.new_state(ids.numel())
        steps = [ours.prefill(ids[:LONG], state, all_logits=True)]
        steps += [ours.prefill(ids[i : i + 1], state, all_logits=True) for i in range(LONG, LONG + 6)]
        steps.append(ours.prefill(ids[LONG + 6 :], state, all_logits=True))  # a multi-token continuation
    assert state.length == ids.numel()
    torch.testing.assert_close(torch.cat(steps), full, atol=FP32_LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["dense_official", "moe_official"])
def test_greedy_tokens_equal_transformers_generate(models, variant):
    ours, hf = models[variant]
    prompt = _prompt(20, seed=2)
    with torch.no_grad():
        expected = hf.generate(input_ids=prompt[None], max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, 20:]
        state = ours.new_state(40)
        logits = ours.prefill(prompt, state)
        tokens = []
        for _ in range(12):
            token = int(torch.argmax(logits))
            tokens.append(token)
            logits = ours.prefill(torch.tensor([token]), state)
    assert tokens == expected.tolist()


@pytest.mark.parametrize("moe", [False, True])
def test_bf16_path_is_as_accurate_as_transformers_bf16(tmp_path, moe):
    """bf16 on both sides, measured against the exact (fp32) forward of the same bf16-rounded weights."""
    spec = CheckpointSpec(moe=moe, dtype="bfloat16")
    write_checkpoint(tmp_path / "ck", spec, byte_tokenizer_files(VOCAB_SIZE))
    convert_checkpoint(tmp_path / "ck", "bf16", tmp_path / "m.ninfer", quiet=True)
    with open_artifact(tmp_path / "m.ninfer") as artifact:
        ours = Qwen35Model.from_artifact(artifact, dtype=torch.bfloat16)
        exact = Qwen35Model.from_artifact(artifact, dtype=torch.float32)  # equal to transformers' fp32 (above)
    ids = _prompt(LONG, seed=3)
    theirs, _ = _reference(build_model(spec), ids)
    with torch.no_grad():
        logits = ours.prefill(ids, ours.new_state(LONG), all_logits=True)
        reference = exact.prefill(ids, exact.new_state(LONG), all_logits=True)

    def relative(a: torch.Tensor) -> float:
        return float((a - reference).norm() / reference.norm())

    assert relative(logits) <= BF16_ERROR_RATIO * relative(theirs) + BF16_ERROR_FLOOR
    assert relative(logits) < 0.15  # and bf16 at all: not drifting


@pytest.mark.parametrize("moe", [False, True])
def test_mtp_head_matches_the_transformers_layer_form(tmp_path, moe):
    """Our MTP head against the training script's MTPHead (transformers' decoder layer) with the same weights."""
    from tools.train_small import MTPHead

    spec = CheckpointSpec(moe=moe, vision=False)
    state = write_checkpoint(tmp_path / "ck", spec, byte_tokenizer_files(VOCAB_SIZE))
    convert_checkpoint(tmp_path / "ck", "fp32", tmp_path / "m.ninfer", quiet=True)
    with open_artifact(tmp_path / "m.ninfer") as artifact:
        ours = Qwen35Model.from_artifact(artifact)
    hf = build_model(spec)
    head = MTPHead(hf.config.text_config, moe)
    head.load_state_dict({k.removeprefix("mtp."): v for k, v in state.items() if k.startswith("mtp.")})
    head.eval()
    ids = _prompt(40, seed=4)
    language = hf.model.language_model
    with torch.no_grad():
        hidden = language(input_ids=ids[None]).last_hidden_state
        expected = hf.lm_head(head(hidden[:, :-1], language.embed_tokens(ids[None, 1:]), language.rotary_emb))[0]
        trunk = ours.hidden_states(ids, ours.new_state(40))
        mtp_state = ours.new_mtp_state(39)
        first = ours.mtp_logits(trunk[:20], ids[1:21], mtp_state)  # in two calls: the head's cache carries
        second = ours.mtp_logits(trunk[20:-1], ids[21:], mtp_state)
    torch.testing.assert_close(torch.cat([first, second]), expected.float(), atol=FP32_LOGITS_ATOL, rtol=0)


def test_reference_verify_equals_token_by_token_decode_and_accept_resumes():
    """The reference's verify step (the `Model` protocol's, for speculative decoding) gives the logits of decoding
    the drafts one by one, and accepting j of them leaves each sequence where decoding those j tokens would."""
    with open_artifact("ninfer/assets/demo.ninfer") as artifact:
        model = Qwen35Model.from_artifact(artifact)
    prompts = [torch.tensor([5, 17, 300, 42]), torch.tensor([7, 99, 1000])]
    drafts = torch.tensor([[3, 8, 12], [40, 41, 42]])
    verified = [model.new_state(16) for _ in prompts]
    stepped = [model.new_state(16) for _ in prompts]
    for prompt, a, b in zip(prompts, verified, stepped, strict=True):
        model.prefill(prompt, a)
        model.prefill(prompt, b)
    logits = model.verify(verified, drafts)
    expected = torch.stack([model.decode(stepped, drafts[:, t]) for t in range(3)], dim=1)
    assert torch.equal(logits, expected)
    with pytest.raises(ValueError, match="accept the previous verify step"):
        model.verify(verified, drafts)
    model.accept(verified, [1, 3])  # sequence 0 keeps its first draft, sequence 1 all three
    assert [s.length for s in verified] == [5, 6]
    kept = model.new_state(16)
    model.prefill(torch.cat([prompts[0], drafts[0, :1]]), kept)
    nxt = torch.tensor([30, 31])
    assert torch.allclose(model.decode(verified, nxt), model.decode([kept, stepped[1]], nxt), rtol=0, atol=1e-5)
