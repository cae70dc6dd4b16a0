"""Every recipe runs in the reference model and stays within a stated KL divergence of the bf16 artifact.

KL(bf16 ‖ recipe), mean over the positions of a 150-token teacher-forced prompt, nats per token, on the tiny
random dense and MoE checkpoints. Random weights with logit std about 4 are chaotic, far harsher than trained
weights: bf16 rounding alone flips MoE routing (fp32 vs bf16 differs by 0.056 nats on the MoE model). Measured
when the bounds were set (2026-11-30), dense / MoE: fp32 0.0011 / 0.056, q8 0.0096 / 0.100, fp8 0.244 / 0.701,
q4 1.057 / 1.598. The bounds leave 2x headroom; the formats' quality on trained weights is not what this
measures. A decoder that misreads a layout gives several nats (log 320 = 5.8 is uniform).
"""

from __future__ import annotations

import pytest
import torch

from ninfer.artifact import open_artifact
from ninfer.convert.checkpoint import convert_checkpoint
from ninfer.model.qwen3_5 import Qwen35Model
from tests.fixtures.hf_checkpoints import VOCAB_SIZE, CheckpointSpec

KL_BOUND = {  # moe -> recipe -> bound (nats per token)
    False: {"fp32": 3e-3, "q8": 2e-2, "fp8": 0.5, "q4": 2.1},
    True: {"fp32": 0.12, "q8": 0.2, "fp8": 1.4, "q4": 3.2},
}


def _logits(path, ids: torch.Tensor) -> torch.Tensor:
    with open_artifact(path) as artifact:
        model = Qwen35Model.from_artifact(artifact, dtype=torch.float32)
    with torch.no_grad():
        return model.prefill(ids, model.new_state(ids.numel()), all_logits=True)


@pytest.mark.parametrize("moe", [False, True])
def test_recipes_stay_within_their_kl_bound_of_bf16(hf_checkpoint, tmp_path, moe):
    checkpoint, _ = hf_checkpoint(CheckpointSpec(moe=moe))
    ids = torch.randint(0, VOCAB_SIZE, (150,), generator=torch.Generator().manual_seed(5))
    logits = {}
    bounds = KL_BOUND[moe]
    for recipe in ["bf16", *bounds]:
        convert_checkpoint(checkpoint, recipe, tmp_path / f"{recipe}.ninfer", quiet=True)
        logits[recipe] = _logits(tmp_path / f"{recipe}.ninfer", ids).log_softmax(-1)
    reference = logits["bf16"]
    kl = {r: float((reference.exp() * (reference - logits[r])).sum(-1).mean()) for r in bounds}
    for recipe, bound in bounds.items():
        assert kl[recipe] <= bound, f"{recipe}: KL {kl[recipe]:.3g} > {bound} ({kl})"
    assert kl["q8"] < kl["fp8"] < kl["q4"], f"precision must order the divergences: {kl}"
