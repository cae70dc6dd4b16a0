"""The converter on tiny transformers-generated checkpoints: every source tensor lands in exactly one object,
decodes back within its format's bound, conversion is deterministic and streams, and bad input fails cleanly.

The expected objects are rebuilt here from the checkpoint tensors by the documented object contract
(ninfer/convert/qwen3_5.py, docs/artifact-format.md), independently of the converter's plan.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ninfer.artifact import open_artifact
from ninfer.artifact.checksums import read_sums
from ninfer.cli import main
from ninfer.convert import converter
from ninfer.convert.checkpoint import convert_checkpoint
from ninfer.convert.recipes import RECIPES
from ninfer.frontend.vocab import byte_tokenizer_files
from ninfer.quant import codec_for
from tests.fixtures.hf_checkpoints import CheckpointSpec, write_checkpoint

H, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 32
K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 4, 16, 24
EXPERTS, EXPERT_WIDTH = 8, 32
LAYER_TYPES = ["L", "L", "L", "F"]
ARTIFACT_ID = "00112233-4455-6677-8899-aabbccddeeff"

VARIANTS = {
    "dense_official": CheckpointSpec(),
    "dense_text_tied": CheckpointSpec(layout="text", tied=True),
    "moe_official": CheckpointSpec(moe=True),
    "moe_text": CheckpointSpec(moe=True, layout="text"),
    "moe_official_tied_bf16": CheckpointSpec(moe=True, tied=True, dtype="bfloat16", vision=False),
    "dense_text_no_mtp": CheckpointSpec(layout="text", mtp=False),
}


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """The variants' folders and tensors (tests/conftest.py's session checkpoints: copy a folder to change it)."""
    return {name: hf_checkpoint(spec) for name, spec in VARIANTS.items()}


def _layer_objects(state: dict[str, torch.Tensor], src: str, dst: str, kind: str, moe: bool,
                   used: set[str]) -> dict[str, torch.Tensor]:
    def take(name: str) -> torch.Tensor:
        used.add(src + name)
        return state[src + name].float()

    out = {f"{dst}input_norm": take("input_layernorm.weight"),
           f"{dst}post_attention_norm": take("post_attention_layernorm.weight")}
    if kind == "F":
        q = take("self_attn.q_proj.weight").view(HEADS, 2, HEAD_DIM, H)
        out[f"{dst}attention/query_key"] = torch.cat([q[:, 0].reshape(-1, H), take("self_attn.k_proj.weight")])
        out[f"{dst}attention/gate_value"] = torch.cat([q[:, 1].reshape(-1, H), take("self_attn.v_proj.weight")])
        out[f"{dst}attention/output"] = take("self_attn.o_proj.weight")
        out[f"{dst}attention/query_norm"] = take("self_attn.q_norm.weight")
        out[f"{dst}attention/key_norm"] = take("self_attn.k_norm.weight")
    else:
        qkv = take("linear_attn.in_proj_qkv.weight")
        keys = 2 * K_HEADS * K_DIM
        out[f"{dst}gdn/query_key"] = qkv[:keys]
        out[f"{dst}gdn/value_z"] = torch.cat([qkv[keys:], take("linear_attn.in_proj_z.weight")])
        out[f"{dst}gdn/a_b_projection"] = torch.cat([take("linear_attn.in_proj_a.weight"),
                                                     take("linear_attn.in_proj_b.weight")])
        out[f"{dst}gdn/convolution"] = take("linear_attn.conv1d.weight")[:, 0, :]
        out[f"{dst}gdn/a_log"] = take("linear_attn.A_log")
        out[f"{dst}gdn/dt_bias"] = take("linear_attn.dt_bias")
        out[f"{dst}gdn/norm"] = take("linear_attn.norm.weight")
        out[f"{dst}gdn/output"] = take("linear_attn.out_proj.weight")
    if not moe:
        out[f"{dst}mlp/gate_up"] = torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")])
        out[f"{dst}mlp/down"] = take("mlp.down_proj.weight")
        return out
    out[f"{dst}moe/router_shared_gate"] = torch.cat([take("mlp.gate.weight"), take("mlp.shared_expert_gate.weight")])
    if src + "mlp.experts.gate_up_proj" in state:
        out[f"{dst}moe/routed_gate_up"] = take("mlp.experts.gate_up_proj").reshape(-1, H)
        out[f"{dst}moe/routed_down"] = take("mlp.experts.down_proj").reshape(-1, EXPERT_WIDTH)
    else:
        out[f"{dst}moe/routed_gate_up"] = torch.cat([torch.cat([take(f"mlp.experts.{e}.gate_proj.weight"),
                                                                take(f"mlp.experts.{e}.up_proj.weight")])
                                                     for e in range(EXPERTS)])
        out[f"{dst}moe/routed_down"] = torch.cat([take(f"mlp.experts.{e}.down_proj.weight") for e in range(EXPERTS)])
    out[f"{dst}moe/shared_gate_up"] = torch.cat([take("mlp.shared_expert.gate_proj.weight"),
                                                 take("mlp.shared_expert.up_proj.weight")])
    out[f"{dst}moe/shared_down"] = take("mlp.shared_expert.down_proj.weight")
    return out


def expected_objects(state: dict[str, torch.Tensor], spec: CheckpointSpec) -> tuple[dict[str, torch.Tensor], set]:
    """Object id -> float32 values by the documented contract, and the source names it used."""
    prefix = "model.language_model." if spec.layout == "official" else "model."
    used: set[str] = set()
    out = {"text/token_embedding": state[prefix + "embed_tokens.weight"].float()}
    used.add(prefix + "embed_tokens.weight")
    for i, kind in enumerate(LAYER_TYPES):
        out.update(_layer_objects(state, f"{prefix}layers.{i}.", f"text/layers/{i}/", kind, spec.moe, used))
    out["text/final_norm"] = state[prefix + "norm.weight"].float()
    used.add(prefix + "norm.weight")
    if not spec.tied:
        out["text/output_head"] = state["lm_head.weight"].float()
        used.add("lm_head.weight")
    if spec.mtp:
        for name, object_id in (("fc.weight", "input_projection"), ("pre_fc_norm_embedding.weight", "embedding_norm"),
                                ("pre_fc_norm_hidden.weight", "hidden_norm"), ("norm.weight", "final_norm")):
            out[f"mtp/{object_id}"] = state[f"mtp.{name}"].float()
            used.add(f"mtp.{name}")
        out.update(_layer_objects(state, "mtp.layers.0.", "mtp/layers/0/", "F", spec.moe, used))
    for name, tensor in state.items():
        if name.startswith("model.visual."):
            object_id = "vision/" + name.removeprefix("model.visual.").replace(".", "/")
            out[object_id] = tensor.float().reshape(tensor.shape[0], -1) if tensor.dim() > 1 else tensor.float()
            used.add(name)
    return out, used


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_source_tensor_lands_in_one_object_within_its_bound(checkpoints, tmp_path, variant, recipe):
    folder, state = checkpoints[variant]
    spec = VARIANTS[variant]
    out = tmp_path / "model.ninfer"
    convert_checkpoint(folder, recipe, out, quiet=True)
    expected, used = expected_objects(state, spec)
    assert used == set(state), "the contract must account for every tensor of the checkpoint"
    with open_artifact(out) as artifact:
        tensors = {o.id: o for o in artifact.objects if o.kind == "tensor"}
        assert set(tensors) == set(expected)
        stored = sum(torch.Size(o.shape).numel() for o in tensors.values())
        assert stored == sum(t.numel() for t in expected.values())
        for object_id, values in expected.items():
            obj = tensors[object_id]
            assert obj.shape == tuple(values.shape), object_id
            decoded = artifact.tensor(object_id).float()
            bound = codec_for(obj.format).error_bound(values)
            error = (decoded - values).abs()
            assert bool((error <= bound).all()), f"{object_id} ({obj.format}): max error {float(error.max())}"
        components = set(artifact.components)
    assert components == {"text"} | ({"mtp"} if spec.mtp else set()) | (
        {"vision"} if spec.vision and spec.layout == "official" else set())


def test_recipes_choose_the_documented_formats(checkpoints, tmp_path):
    folder, _ = checkpoints["moe_official"]
    formats = {}
    for recipe in ("q4", "fp8", "bf16"):
        convert_checkpoint(folder, recipe, tmp_path / f"{recipe}.ninfer", quiet=True)
        with open_artifact(tmp_path / f"{recipe}.ninfer") as artifact:
            formats[recipe] = {o.id: o.format for o in artifact.objects if o.kind == "tensor"}
    q4 = formats["q4"]
    assert q4["text/layers/3/attention/query_key"] == "q4_g64_fp16"
    assert q4["text/layers/3/attention/gate_value"] == "q5_g64_fp16"
    assert q4["text/layers/0/gdn/query_key"] == "q4_g64_fp16"
    assert q4["text/layers/0/gdn/value_z"] == "q5_g64_fp16"
    assert q4["text/layers/0/moe/routed_gate_up"] == "q4_g64_fp16"
    assert q4["text/layers/0/moe/routed_down"] == "q5_g64_fp16"
    assert q4["text/token_embedding"] == q4["text/output_head"] == "q6_g64_fp16"
    assert q4["mtp/layers/0/moe/routed_gate_up"] == "q8_g32_fp16"
    assert q4["text/layers/0/moe/router_shared_gate"] == "bf16"
    assert q4["text/layers/0/gdn/a_log"] == formats["bf16"]["text/layers/0/gdn/a_log"] == "fp32"
    assert formats["fp8"]["text/layers/3/attention/output"] == "fp8_e4m3fn_row_bf16"
    assert formats["fp8"]["text/layers/3/input_norm"] == "bf16"


def test_conversion_is_deterministic_and_independent_of_chunking(checkpoints, tmp_path, monkeypatch):
    folder, _ = checkpoints["moe_official"]
    first, second, third = (tmp_path / f"{n}" for n in ("a", "b", "c"))
    for out in (first, second, third):
        out.mkdir()
    args = ["convert", "--model", str(folder), "--recipe", "q4", "--artifact-id", ARTIFACT_ID, "--quiet"]
    assert main([*args, "--out", str(first / "m.ninfer")]) == 0
    assert main([*args, "--out", str(second / "m.ninfer")]) == 0
    monkeypatch.setattr(converter, "CHUNK_ELEMENTS", 100)  # many tiny row blocks, pieces split across blocks
    assert main([*args, "--out", str(third / "m.ninfer")]) == 0
    data = (first / "m.ninfer").read_bytes()
    assert data == (second / "m.ninfer").read_bytes() == (third / "m.ninfer").read_bytes()


def test_layouts_and_shards_give_the_same_text_objects(tmp_path):
    tokenizer = byte_tokenizer_files(320)
    payloads = []
    for name, spec in (("official", CheckpointSpec(moe=True, vision=False, mtp=False)),
                       ("text", CheckpointSpec(moe=True, layout="text", mtp=False)),
                       ("sharded", CheckpointSpec(moe=True, layout="text", mtp=False, shards=3)),
                       ("unindexed", CheckpointSpec(moe=True, layout="text", mtp=False, shards=3, index=False))):
        write_checkpoint(tmp_path / name, spec, tokenizer)
        convert_checkpoint(tmp_path / name, "q8", tmp_path / f"{name}.ninfer", quiet=True)
        with open_artifact(tmp_path / f"{name}.ninfer") as artifact:
            payloads.append({o.id: bytes(artifact.raw(o.id).numpy()) for o in artifact.objects})
    assert payloads[0] == payloads[1] == payloads[2] == payloads[3]


def test_report_sums_and_resources(checkpoints, tmp_path):
    folder, _ = checkpoints["dense_official"]
    out = tmp_path / "d.ninfer"
    convert_checkpoint(folder, "q4", out, quiet=True, part_cap=64 * 4096)
    report = json.loads((tmp_path / "d.ninfer.conversion.json").read_text())
    assert report["recipe"] == "q4"
    source = {f["name"]: f for f in report["source"]["files"]}
    data = (folder / "model.safetensors").read_bytes()
    assert source["model.safetensors"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert source["model.safetensors"]["bytes"] == len(data)
    by_id = {t["id"]: t for t in report["tensors"]}
    assert by_id["text/layers/3/attention/query_key"]["format"] == "q4_g64_fp16"
    assert by_id["text/layers/3/attention/query_key"]["bits_per_weight"] > 4.25 - 1e-9
    assert set(report["components"]) == {"text", "mtp", "vision"}
    assert sum(c["bytes"] for c in report["components"].values()) == sum(t["bytes"] for t in report["tensors"])
    for key in ("ninfer", "torch", "safetensors", "python"):
        assert key in report["tools"]
    sums = read_sums(tmp_path)
    assert len(report["files"]) > 1, "the small part cap must have split the artifact"
    for entry in report["files"]:
        assert sums[entry["name"]] == hashlib.sha256((tmp_path / entry["name"]).read_bytes()).hexdigest()
    with open_artifact(out) as artifact:
        for role in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
            assert artifact.component_resource("text", role) == (folder / role).read_bytes()
        assert artifact.directory.metadata["architecture"] == "Qwen3_5ForConditionalGeneration"
        config = artifact.components["text"]["config"]
        assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
        assert config["architectures"] == ["Qwen3_5ForCausalLM"]


def test_chat_template_is_taken_from_the_tokenizer_config_and_tokenizer_dir(checkpoints, tmp_path):
    folder, _ = checkpoints["dense_official"]
    model = tmp_path / "model"
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(folder, model)
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tokenizer / name).write_bytes((model / name).read_bytes())
        (model / name).unlink()
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    (tokenizer / "chat_template.jinja").unlink()
    convert_checkpoint(model, "bf16", tmp_path / "m.ninfer", tokenizer_dir=tokenizer, quiet=True)
    with open_artifact(tmp_path / "m.ninfer") as artifact:
        assert artifact.component_resource("text", "chat_template.jinja") == b"{{ messages[0]['content'] }}"
        assert artifact.component_resource("text", "tokenizer.json") == (tokenizer / "tokenizer.json").read_bytes()


def _break(folder: Path, case: str) -> None:
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    weights = folder / "model.safetensors"
    if case == "unknown architecture":
        config["architectures"] = ["LlamaForCausalLM"]
    elif case == "shape mismatch":
        config["text_config"]["linear_num_value_heads"] = 8
    elif case == "no tokenizer":
        (folder / "tokenizer.json").unlink()
    elif case in ("nan", "inf", "dtype", "unconsumed"):
        state = load_file(weights)
        name = "model.language_model.layers.1.linear_attn.out_proj.weight"
        if case == "nan":
            state[name][3, 5] = float("nan")
        elif case == "inf":
            state[name][0, 0] = float("-inf")
        elif case == "dtype":
            state[name] = state[name].to(torch.int32)
        else:
            state["model.language_model.layers.1.linear_attn.extra_bias"] = torch.zeros(4)
        save_file(state, weights)
    elif case == "missing shard":
        state = load_file(weights)
        names = sorted(state)
        save_file({n: state[n] for n in names[:10]}, folder / "model-00001-of-00002.safetensors")
        weight_map = {n: "model-00001-of-00002.safetensors" if i < 10 else "model-00002-of-00002.safetensors"
                      for i, n in enumerate(names)}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        weights.unlink()
    config_path.write_text(json.dumps(config))


BAD_INPUTS = {
    "unknown architecture": "unknown architecture 'LlamaForCausalLM'",
    "shape mismatch": "the config implies",
    "no tokenizer": "no tokenizer.json",
    "nan": "holds NaN or Inf",
    "inf": "holds NaN or Inf",
    "dtype": "has dtype I32",
    "unconsumed": "extra_bias' is not consumed",
    "missing shard": "shard model-00002-of-00002.safetensors named by model.safetensors.index.json is missing",
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_with_one_line_exit_2_and_no_output(checkpoints, tmp_path, capsys, case):
    folder = tmp_path / "model"
    shutil.copytree(checkpoints["dense_official"][0], folder)
    _break(folder, case)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code = main(["convert", "--model", str(folder), "--recipe", "q4", "--out", str(out_dir / "m.ninfer"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("ninfer convert: error:")
    assert BAD_INPUTS[case] in err
    assert list(out_dir.iterdir()) == []


def test_bad_flags_are_rejected(checkpoints, tmp_path, capsys):
    folder, _ = checkpoints["dense_official"]
    assert main(["convert", "--model", str(folder), "--recipe", "q3", "--out", str(tmp_path / "m.ninfer")]) == 2
    assert "argument --recipe: invalid choice: 'q3'" in capsys.readouterr().err
    assert main(["convert", "--model", str(folder), "--recipe", "q4", "--out", str(tmp_path / "m.bin")]) == 2
    assert "must end in .ninfer" in capsys.readouterr().err
    missing = tmp_path / "nope"
    assert main(["convert", "--model", str(missing), "--recipe", "q4", "--out", str(tmp_path / "m.ninfer")]) == 2
    assert f"{missing}: no such folder" in capsys.readouterr().err
    assert main(["convert", "--model", str(folder), "--recipe", "q4", "--out", str(tmp_path / "m.ninfer"),
                 "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err
