"""`ninfer synth`: real-shape plans, deterministic random weights scaled like a trained model's, sound artifacts."""

from __future__ import annotations

import math

import pytest
import torch

from ninfer.artifact import open_artifact
from ninfer.cli import main
from ninfer.convert.qwen3_5 import plan_qwen3_5
from ninfer.convert.synth import PRESETS, SyntheticSource, checkpoint_shapes, synth_artifact
from ninfer.errors import ConversionError


def _parameters(preset: str) -> dict[str, int]:
    config = PRESETS[preset]
    plan = plan_qwen3_5(config, SyntheticSource(config))
    totals: dict[str, int] = {}
    for obj in plan.objects:
        totals[obj.component] = totals.get(obj.component, 0) + math.prod(obj.shape)
    return totals


def test_27b_preset_has_the_published_shapes():
    config = PRESETS["qwen3.8-27b"]
    shapes = checkpoint_shapes(config)
    assert config["layer_types"].count("full_attention") == 16 and len(config["layer_types"]) == 64
    assert shapes["model.layers.3.self_attn.q_proj.weight"] == (2 * 24 * 256, 5120)
    assert shapes["model.layers.0.linear_attn.in_proj_qkv.weight"] == (2 * 16 * 128 + 48 * 128, 5120)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (5120, 17408)
    assert shapes["lm_head.weight"] == (248_320, 5120)
    params = _parameters("qwen3.8-27b")
    # 27B-class trunk (embedding and head included) plus one MTP layer of about 0.4-0.5 B weights
    assert 26.0e9 < params["text"] < 28.5e9
    assert 0.3e9 < params["mtp"] < 0.6e9


def test_35b_a3b_preset_has_the_published_shapes():
    config = PRESETS["qwen3.6-35b-a3b"]
    shapes = checkpoint_shapes(config)
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (256, 1024, 2048)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (256, 2048, 512)
    assert shapes["model.layers.0.linear_attn.in_proj_qkv.weight"] == (8192, 2048)
    assert config["num_experts_per_tok"] == 8
    assert 33e9 < _parameters("qwen3.6-35b-a3b")["text"] < 36.5e9


def test_synthetic_rows_do_not_depend_on_how_they_are_read():
    source = SyntheticSource(PRESETS["tiny-moe"], seed=3)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    whole = torch.cat([source.read_rows(name, (e,), 0, 64) for e in range(8)])
    pieces = torch.cat([source.read_rows(name, (e,), a, b) for e in range(8) for a, b in ((0, 5), (5, 41), (41, 64))])
    assert torch.equal(whole, pieces)
    assert not torch.equal(whole, torch.cat([SyntheticSource(PRESETS["tiny-moe"], seed=4).read_rows(name, (e,), 0, 64)
                                             for e in range(8)]))


def test_synthetic_weights_are_scaled_like_a_trained_model():
    config = PRESETS["qwen3.5-0.8b"]
    source = SyntheticSource(config)

    def rows(name: str, count: int = 64) -> torch.Tensor:
        return source.read_rows(name, (), 0, count).float()

    hidden = config["hidden_size"]
    assert rows("model.layers.0.linear_attn.in_proj_qkv.weight").std() == pytest.approx(hidden**-0.5, rel=0.05)
    down = rows("model.layers.0.mlp.down_proj.weight")
    assert down.std() == pytest.approx(config["intermediate_size"] ** -0.5 / math.sqrt(48), rel=0.05)
    a_log = source.read_rows("model.layers.0.linear_attn.A_log", (), 0, 1).float()
    assert bool((a_log >= 0).all()) and bool((a_log <= math.log(16) + 1e-2).all())
    step = torch.nn.functional.softplus(source.read_rows("model.layers.0.linear_attn.dt_bias", (), 0, 1).float())
    assert bool((step > 0.9e-3).all()) and bool((step < 0.11).all())
    gated = source.read_rows("model.layers.0.linear_attn.norm.weight", (), 0, 1).float()
    assert gated.mean() == pytest.approx(1.0, abs=0.05)
    # A random token's residual update through one GDN input projection stays O(1): not zero, not exploding
    x = torch.randn(8, hidden)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    projected = x @ source.read_rows("model.layers.0.linear_attn.in_proj_qkv.weight", (), 0, 6144).float().T
    assert 0.5 < float(projected.std()) < 2.0


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_tiny_presets_build_verify_and_are_deterministic(tmp_path, capsys, preset):
    args = ["synth", "--preset", preset, "--recipe", "q4", "--artifact-id", "0" * 32, "--quiet"]
    assert main([*args, "--out", str(tmp_path / "a.ninfer")]) == 0
    assert main([*args, "--out", str(tmp_path / "b.ninfer")]) == 0
    assert main([*args, "--seed", "1", "--out", str(tmp_path / "c.ninfer")]) == 0
    a, b, c = ((tmp_path / f"{n}.ninfer").read_bytes() for n in "abc")
    assert a == b and a != c
    assert main(["verify", str(tmp_path / "a.ninfer"), "--quiet"]) == 0
    with open_artifact(tmp_path / "a.ninfer") as artifact:
        assert set(artifact.components) == {"text", "mtp"}
        resources = artifact.components["text"]["resources"]
        assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= set(
            resources)
        embedding = artifact.tensor("text/token_embedding")
        assert embedding.shape == (320, 64)
        assert 0.01 < float(embedding.std()) < 0.04


def test_unknown_preset_is_rejected(tmp_path, capsys):
    assert main(["synth", "--preset", "gpt-5", "--recipe", "q4", "--out", str(tmp_path / "x.ninfer")]) == 2
    assert "argument --preset: invalid choice: 'gpt-5'" in capsys.readouterr().err
    assert not (tmp_path / "x.ninfer").exists()


def test_layers_keeps_a_slice_of_the_preset(tmp_path):
    synth_artifact("tiny-dense", "bf16", tmp_path / "slice.ninfer", quiet=True, layers=2)
    with open_artifact(tmp_path / "slice.ninfer") as artifact:
        config = artifact.components["text"]["config"]
        assert config["num_hidden_layers"] == 2 and config["layer_types"] == PRESETS["tiny-dense"]["layer_types"][:2]
        assert not any(o.id.startswith("text/layers/2/") for o in artifact.objects)
        assert any(o.id.startswith("text/layers/1/") for o in artifact.objects)
    with pytest.raises(ConversionError, match=r"--layers must lie in 1\.\.4"):
        synth_artifact("tiny-dense", "bf16", tmp_path / "bad.ninfer", quiet=True, layers=5)
