"""The trained small models (the embedded dense default and the MoE fixture) still model their corpus through
the runtime: held-out perplexity far below the unigram baseline, an MTP head far above chance, experts in use.

Bounds are loose on purpose (the full numbers are in docs/quality.md, measured on the whole held-out split):
a broken kernel, layout or converter sends the perplexity to hundreds or thousands.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer.artifact import open_artifact
from ninfer.engine.llm import DEFAULT_ARTIFACT
from ninfer.eval.mtp import mtp_top1_accuracy
from ninfer.eval.perplexity import perplexity
from ninfer.frontend import Tokenizer
from ninfer.kernels.moe import route_top_k
from ninfer.model.qwen3_5 import Qwen35Model

ROOT = Path(__file__).resolve().parents[2]
MOE_FIXTURE = ROOT / "data" / "models" / "small-moe-q8.ninfer"
TOKENS = 2048
PPL_BOUND = 40.0  # measured about 15 (dense) and 12 (MoE) on the whole split; the unigram baseline is hundreds
MTP_TOP1_BOUND = 0.3  # measured about 0.5; chance is 1/4096


@pytest.fixture(scope="module")
def held_out_ids() -> list[int]:
    from tools.corpus import load_split

    with open_artifact(DEFAULT_ARTIFACT) as artifact:
        tokenizer = Tokenizer.from_artifact(artifact)
    return tokenizer.encode(load_split("test"), special=False)[:TOKENS]


@pytest.mark.parametrize("path", [DEFAULT_ARTIFACT, MOE_FIXTURE], ids=["dense", "moe"])
def test_held_out_perplexity_and_mtp_accuracy(held_out_ids, path):
    with open_artifact(path) as artifact:
        model = Qwen35Model.from_artifact(artifact)
    assert model.has_mtp
    result = perplexity(model, held_out_ids, context=512, stride=256, progress=False)
    assert result.ppl < PPL_BOUND
    correct, total = mtp_top1_accuracy(model, held_out_ids, context=512, stride=256)
    assert correct / total > MTP_TOP1_BOUND


def test_moe_fixture_routes_to_every_expert(held_out_ids):
    with open_artifact(MOE_FIXTURE) as artifact:
        model = Qwen35Model.from_artifact(artifact)
    c = model.config
    assert (c.experts, c.top_k) == (16, 2)
    mlp_inputs: list[torch.Tensor] = []
    original = model.mlp

    def recording(x: torch.Tensor, w) -> torch.Tensor:
        mlp_inputs.append(x)
        return original(x, w)

    model.mlp = recording
    with torch.no_grad():
        model.hidden_states(torch.tensor(held_out_ids[:512]), model.new_state(512))
    assert len(mlp_inputs) == c.layers
    for layer, x in enumerate(mlp_inputs):
        router = model.weights[f"layers/{layer}/moe/router_shared_gate"][: c.experts]
        _, ids = route_top_k(x @ router.T, c.top_k)
        share = torch.bincount(ids.flatten(), minlength=c.experts).float() / ids.numel()
        # measured on these 512 tokens: 7 to 16 experts above 1 % per layer, the busiest at most 37 %
        assert int((share > 0.01).sum()) >= 6, f"layer {layer}: routing collapsed onto few experts {share}"
        assert float(share.max()) < 0.5, f"layer {layer}: one expert takes {float(share.max()):.0%}"
