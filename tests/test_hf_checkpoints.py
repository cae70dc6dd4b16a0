"""The tiny Qwen3.5 checkpoint generator: bytes, names, shapes, configs; transformers loads it back."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.fixtures.hf_checkpoints import (
    EOS_TOKEN_ID,
    IMAGE_TOKEN_ID,
    PAD_TOKEN_ID,
    VIDEO_TOKEN_ID,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    CheckpointSpec,
    build_model,
    write_checkpoint,
)

# Dense reloads are exact; MoE differs by ~1e-5: BLAS sees differently aligned (mmapped) expert weights.
RELOAD_ATOL = 1e-4
INPUT_IDS = torch.tensor([[PAD_TOKEN_ID, *b"Hello, world", EOS_TOKEN_ID]])


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        part = load_file(path)
        assert not tensors.keys() & part.keys(), f"{path.name} repeats tensors"
        tensors.update(part)
    return tensors


def shapes(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, tuple[int, ...]]:
    return {k[len(prefix) :]: tuple(v.shape) for k, v in tensors.items() if k.startswith(prefix)}


def logits(model: PreTrainedModel) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT_IDS).logits.float()


def load_with_transformers(
    folder: Path, spec: CheckpointSpec, model_cls: type
) -> tuple[PreTrainedModel, dict]:
    kwargs = {"attn_implementation": "eager", "output_loading_info": True}
    if spec.moe:
        kwargs["experts_implementation"] = "eager"
    return model_cls.from_pretrained(folder, **kwargs)


def test_same_seed_writes_byte_identical_files(tmp_path: Path) -> None:
    spec = CheckpointSpec(moe=True, shards=2)
    tokenizer = {"tokenizer.json": b'{"version": "1.0"}'}
    for name, seed in [("a", 0), ("b", 0), ("c", 1)]:
        write_checkpoint(tmp_path / name, dataclasses.replace(spec, seed=seed), tokenizer)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    shard = "model-00001-of-00002.safetensors"
    assert (tmp_path / "a" / shard).read_bytes() != (tmp_path / "c" / shard).read_bytes()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layout", ["official", "text"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_reload_gives_in_memory_logits(tmp_path: Path, moe: bool, layout: str, tied: bool) -> None:
    spec = CheckpointSpec(moe=moe, layout=layout, tied=tied)
    written = write_checkpoint(tmp_path, spec)
    assert ("lm_head.weight" in written) == (not tied)
    model = build_model(spec)
    expected = logits(model)

    reloaded, info = load_with_transformers(tmp_path, spec, type(model))
    assert info["missing_keys"] == set() and info["mismatched_keys"] == set(), info
    assert (reloaded.lm_head.weight is reloaded.get_input_embeddings().weight) == tied
    torch.testing.assert_close(logits(reloaded), expected, rtol=0, atol=RELOAD_ATOL)

    if layout == "official":  # the text-only view of the VLM folder, as a converter's reference would load it
        text_only, info = load_with_transformers(tmp_path, spec, AutoModelForCausalLM)
        assert info["missing_keys"] == set(), info
        torch.testing.assert_close(logits(text_only), expected, rtol=0, atol=RELOAD_ATOL)


def test_bfloat16_files_reload_in_bfloat16(tmp_path: Path) -> None:
    spec = CheckpointSpec(moe=True, dtype="bfloat16")
    written = write_checkpoint(tmp_path, spec)
    assert {t.dtype for t in read_folder(tmp_path).values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    model = build_model(spec)
    assert all(torch.equal(written[k], v) for k, v in model.state_dict().items() if k in written)
    reloaded, _ = load_with_transformers(tmp_path, spec, type(model))
    assert reloaded.dtype == torch.bfloat16
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=RELOAD_ATOL)


def test_returned_tensors_are_the_written_ones(tmp_path: Path) -> None:
    written = write_checkpoint(tmp_path, CheckpointSpec(moe=True, layout="text"))
    on_disk = read_folder(tmp_path)
    assert list(written) == sorted(on_disk)
    for name, tensor in written.items():
        assert torch.equal(on_disk[name], tensor), name


def test_shards_and_index_hold_the_same_tensors(tmp_path: Path) -> None:
    single = write_checkpoint(tmp_path / "one", CheckpointSpec(moe=True))
    write_checkpoint(tmp_path / "indexed", CheckpointSpec(moe=True, shards=3))
    write_checkpoint(tmp_path / "bare", CheckpointSpec(moe=True, shards=3, index=False))
    shard_names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in (tmp_path / "one").glob("model*")) == ["model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "indexed").glob("model*")) == [
        *shard_names,
        "model.safetensors.index.json",
    ]
    assert sorted(p.name for p in (tmp_path / "bare").glob("model*")) == shard_names
    for folder in ("indexed", "bare"):
        tensors = read_folder(tmp_path / folder)
        assert tensors.keys() == single.keys()
        assert all(torch.equal(tensors[k], v) for k, v in single.items())

    index = json.loads((tmp_path / "indexed" / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == single.keys()
    for file_name in shard_names:
        with safe_open(tmp_path / "indexed" / file_name, "pt") as f:
            assert {k for k, v in index["weight_map"].items() if v == file_name} == set(f.keys())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())


H, V = 64, 320
LINEAR_ATTENTION_LAYER = {  # layers 0, 1, 2
    "input_layernorm.weight": (H,),
    "linear_attn.A_log": (4,),
    "linear_attn.conv1d.weight": (2 * 2 * 16 + 4 * 24, 1, 4),  # 2·Hk·Dk + Hv·Dv = 160
    "linear_attn.dt_bias": (4,),
    "linear_attn.in_proj_a.weight": (4, H),
    "linear_attn.in_proj_b.weight": (4, H),
    "linear_attn.in_proj_qkv.weight": (160, H),
    "linear_attn.in_proj_z.weight": (96, H),
    "linear_attn.norm.weight": (24,),
    "linear_attn.out_proj.weight": (H, 96),
    "post_attention_layernorm.weight": (H,),
}
FULL_ATTENTION_LAYER = {  # layer 3 and mtp.layers.0
    "input_layernorm.weight": (H,),
    "post_attention_layernorm.weight": (H,),
    "self_attn.k_norm.weight": (32,),
    "self_attn.k_proj.weight": (64, H),
    "self_attn.o_proj.weight": (H, 128),
    "self_attn.q_norm.weight": (32,),
    "self_attn.q_proj.weight": (256, H),  # 4 heads x [query | gate] x head_dim 32
    "self_attn.v_proj.weight": (64, H),
}
DENSE_MLP = {"mlp.down_proj.weight": (H, 96), "mlp.gate_proj.weight": (96, H), "mlp.up_proj.weight": (96, H)}
SHARED_EXPERT = {
    "mlp.gate.weight": (8, H),
    "mlp.shared_expert.down_proj.weight": (H, 48),
    "mlp.shared_expert.gate_proj.weight": (48, H),
    "mlp.shared_expert.up_proj.weight": (48, H),
    "mlp.shared_expert_gate.weight": (1, H),
}
FUSED_MOE_MLP = {**SHARED_EXPERT, "mlp.experts.down_proj": (8, H, 32), "mlp.experts.gate_up_proj": (8, 64, H)}
UNFUSED_MOE_MLP = {
    **SHARED_EXPERT,
    **{f"mlp.experts.{e}.{proj}_proj.weight": (32, H) for e in range(8) for proj in ("gate", "up")},
    **{f"mlp.experts.{e}.down_proj.weight": (H, 32) for e in range(8)},
}
MTP_HEAD = {
    "fc.weight": (H, 2 * H),
    "norm.weight": (H,),
    "pre_fc_norm_embedding.weight": (H,),
    "pre_fc_norm_hidden.weight": (H,),
}
VISUAL = {
    "patch_embed.proj.weight": (32, 3, 2, 16, 16),
    "patch_embed.proj.bias": (32,),
    "pos_embed.weight": (2304, 32),
    "blocks.0.norm1.weight": (32,),
    "blocks.0.norm1.bias": (32,),
    "blocks.0.norm2.weight": (32,),
    "blocks.0.norm2.bias": (32,),
    "blocks.0.attn.qkv.weight": (96, 32),
    "blocks.0.attn.qkv.bias": (96,),
    "blocks.0.attn.proj.weight": (32, 32),
    "blocks.0.attn.proj.bias": (32,),
    "blocks.0.mlp.linear_fc1.weight": (64, 32),
    "blocks.0.mlp.linear_fc1.bias": (64,),
    "blocks.0.mlp.linear_fc2.weight": (32, 64),
    "blocks.0.mlp.linear_fc2.bias": (32,),
    "merger.norm.weight": (32,),
    "merger.norm.bias": (32,),
    "merger.linear_fc1.weight": (128, 128),
    "merger.linear_fc1.bias": (128,),
    "merger.linear_fc2.weight": (H, 128),
    "merger.linear_fc2.bias": (H,),
}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_official_layout_names_and_shapes(tmp_path: Path, moe: bool) -> None:
    written = write_checkpoint(tmp_path, CheckpointSpec(moe=moe))
    mlp = FUSED_MOE_MLP if moe else DENSE_MLP
    lm = "model.language_model."
    for i in (0, 1, 2):
        assert shapes(written, f"{lm}layers.{i}.") == {**LINEAR_ATTENTION_LAYER, **mlp}
    assert shapes(written, f"{lm}layers.3.") == {**FULL_ATTENTION_LAYER, **mlp}
    mtp_layer = {f"layers.0.{k}": v for k, v in {**FULL_ATTENTION_LAYER, **mlp}.items()}
    assert shapes(written, "mtp.") == {**MTP_HEAD, **mtp_layer}
    assert shapes(written, "model.visual.") == VISUAL
    top_level = {
        k: v for k, v in written.items() if not k.startswith((f"{lm}layers.", "mtp.", "model.visual."))
    }
    rest = {k: tuple(v.shape) for k, v in top_level.items()}
    assert rest == {f"{lm}embed_tokens.weight": (V, H), f"{lm}norm.weight": (H,), "lm_head.weight": (V, H)}


def test_text_layout_names_and_shapes(tmp_path: Path) -> None:
    written = write_checkpoint(tmp_path, CheckpointSpec(moe=True, layout="text", tied=True))
    assert shapes(written, "model.layers.0.") == {**LINEAR_ATTENTION_LAYER, **UNFUSED_MOE_MLP}
    assert shapes(written, "model.layers.3.") == {**FULL_ATTENTION_LAYER, **UNFUSED_MOE_MLP}
    assert shapes(written, "mtp.layers.0.") == {**FULL_ATTENTION_LAYER, **UNFUSED_MOE_MLP}
    assert not [k for k in written if "language_model" in k or "visual" in k or k == "lm_head.weight"]


def test_no_vision_and_no_mtp(tmp_path: Path) -> None:
    written = write_checkpoint(tmp_path, CheckpointSpec(vision=False, mtp=False))
    assert not [k for k in written if k.startswith(("model.visual.", "mtp."))]
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in written


def test_layouts_share_the_weights_of_one_seed(tmp_path: Path) -> None:
    official = write_checkpoint(tmp_path / "official", CheckpointSpec(moe=True))
    text = write_checkpoint(tmp_path / "text", CheckpointSpec(moe=True, layout="text"))
    for name, tensor in official.items():
        if name.startswith("model.visual."):
            continue
        text_name = name.replace("model.language_model.", "model.")
        if name.endswith("experts.gate_up_proj"):
            base = text_name.removesuffix("gate_up_proj")
            for e in range(tensor.shape[0]):  # rows [0, I) gate, [I, 2I) up
                gate, up = tensor[e].chunk(2)
                assert torch.equal(text[f"{base}{e}.gate_proj.weight"], gate)
                assert torch.equal(text[f"{base}{e}.up_proj.weight"], up)
        elif name.endswith("experts.down_proj"):
            base = text_name.removesuffix("down_proj")
            assert torch.equal(torch.stack([text[f"{base}{e}.down_proj.weight"] for e in range(8)]), tensor)
        else:
            assert torch.equal(text[text_name], tensor), name


def test_weights_make_conventions_visible(tmp_path: Path) -> None:
    written = write_checkpoint(tmp_path, CheckpointSpec())
    zero_centred = torch.cat(
        [v for k, v in written.items() if k.endswith(("layernorm.weight", "_norm.weight"))]
    )
    assert abs(zero_centred.mean().item()) < 0.05 and 0.15 < zero_centred.std().item() < 0.25
    gated = written["model.language_model.layers.0.linear_attn.norm.weight"]
    assert abs(gated.mean().item() - 1.0) < 0.2 and gated.std().item() > 0.05
    decay = written["model.language_model.layers.0.linear_attn.A_log"].exp()
    assert ((decay >= 0.05) & (decay <= 3.0)).all() and decay.std().item() > 0.1
    assert written["model.language_model.layers.1.linear_attn.dt_bias"].abs().max().item() > 0.1
    for tied in (False, True):
        logit_std = logits(build_model(CheckpointSpec(tied=tied))).std().item()
        assert 3.0 < logit_std < 5.5, (tied, logit_std)


def test_config_files(tmp_path: Path) -> None:
    spec = CheckpointSpec(moe=True, tied=True, num_layers=8)
    write_checkpoint(tmp_path / "official", spec)
    write_checkpoint(tmp_path / "text", CheckpointSpec(layout="text"))
    config = json.loads((tmp_path / "official" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe"
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert (config["image_token_id"], config["video_token_id"]) == (IMAGE_TOKEN_ID, VIDEO_TOKEN_ID)
    vision_ids = (config["vision_start_token_id"], config["vision_end_token_id"])
    assert vision_ids == (VISION_START_TOKEN_ID, VISION_END_TOKEN_ID)
    text = config["text_config"]
    assert config["tie_word_embeddings"] is True and text["tie_word_embeddings"] is True
    assert text["model_type"] == "qwen3_5_moe_text" and text["full_attention_interval"] == 4
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"
    ]
    assert (text["mtp_num_hidden_layers"], text["mtp_use_dedicated_embeddings"]) == (1, False)
    rope = text["rope_parameters"]
    assert (rope["mrope_section"], rope["rope_theta"], rope["partial_rotary_factor"]) == (
        [2, 1, 1],
        1e7,
        0.25,
    )
    assert config["vision_config"]["out_hidden_size"] == text["hidden_size"] == 64

    # what transformers' save_pretrained writes, plus full_attention_interval
    build_model(spec).save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    text.pop("full_attention_interval")
    assert config == saved

    flat = json.loads((tmp_path / "text" / "config.json").read_text())
    assert flat["model_type"] == "qwen3_5_text" and flat["architectures"] == ["Qwen3_5ForCausalLM"]
    assert "text_config" not in flat and flat["intermediate_size"] == 96
    generation = json.loads((tmp_path / "text" / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == ([EOS_TOKEN_ID], PAD_TOKEN_ID)


def test_tokenizer_files_are_written_verbatim(tmp_path: Path) -> None:
    files = {"tokenizer.json": b'{"model": {}}\n', "tokenizer_config.json": b"\x00\xff"}
    write_checkpoint(tmp_path, CheckpointSpec(layout="text"), files)
    assert {name: (tmp_path / name).read_bytes() for name in files} == files
    with pytest.raises(ValueError, match="bare file name"):
        write_checkpoint(tmp_path, CheckpointSpec(layout="text"), {"../escape.json": b""})


@pytest.mark.parametrize("bad", [{"layout": "gguf"}, {"dtype": "float16"}, {"shards": 0}, {"num_layers": 0}])
def test_spec_rejects_unsupported_values(bad: dict) -> None:
    with pytest.raises(ValueError, match="CheckpointSpec"):
        CheckpointSpec(**bad)
