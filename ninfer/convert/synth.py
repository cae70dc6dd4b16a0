"""`ninfer synth`: random-weight artifacts at real shapes, with no source checkpoint, for benchmarks and tests.

A preset is a Qwen3.5 text config. `SyntheticSource` presents the checkpoint such a config implies (the
transformers text layout, experts fused, an MTP layer) and generates each tensor's rows on demand, so the
ordinary converter plans, quantizes and streams it like a real model, on the GPU when asked.

Weights are scaled like a trained model's so that activations stay in a realistic range through every
layer: input projections N(0, 1/fan_in); output projections (attention and GDN outputs, MLP and expert
down projections) further divided by sqrt(2 * layers) so the residual stream grows slowly; embeddings
N(0, 0.02^2); head N(0, 4/fan_in) (logit std about 2); zero-centred norm weights N(0, 0.05^2) (the runtime
adds 1); the GDN gated norm 1 + N(0, 0.05^2); A_log = log U(1, 16) and dt_bias = softplus^-1 of a
log-uniform step in [1e-3, 0.1] (the Mamba initialisation); router rows N(0, 1/fan_in) so routing is
spread but not uniform. Every block of rows comes from its own generator seeded by (seed, tensor, block),
so the bytes do not depend on how the converter chunks its reads, nor on the device.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import torch

from ninfer.artifact.framing import DEFAULT_PART_CAP
from ninfer.convert.converter import build_artifact
from ninfer.convert.qwen3_5 import plan_qwen3_5, resolve_layer_types
from ninfer.convert.source import TensorSource, matrix_rows
from ninfer.devices import parse_device
from ninfer.errors import ConversionError

QWEN_VOCAB = 248_320  # padded embedding rows of the real Qwen3.5/3.6 vocabulary
QWEN_EOS, QWEN_PAD = 248_046, 248_044  # <|im_end|>, <|endoftext|>
BYTE_EOS, BYTE_PAD = 258, 256  # the same tokens in the byte tokenizer (specials from id 256)
BLOCK_ELEMENTS = 1 << 22


def _text_config(*, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, k_heads: int,
                 v_heads: int, k_dim: int, v_dim: int, vocab: int, tied: bool, intermediate: int = 0,
                 experts: int = 0, top_k: int = 0, expert_width: int = 0, shared_width: int = 0,
                 mrope_section: tuple[int, int, int] = (11, 11, 10)) -> dict[str, Any]:
    moe = experts > 0
    eos, pad = (QWEN_EOS, QWEN_PAD) if vocab >= QWEN_VOCAB else (BYTE_EOS, BYTE_PAD)
    config: dict[str, Any] = {
        "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "linear_num_key_heads": k_heads, "linear_num_value_heads": v_heads, "linear_key_head_dim": k_dim,
        "linear_value_head_dim": v_dim, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False, "max_position_embeddings": 262_144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": list(mrope_section), "mrope_interleaved": True},
        "tie_word_embeddings": tied, "eos_token_id": eos, "pad_token_id": pad,
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "mamba_ssm_dtype": "float32",
    }
    config["layer_types"] = resolve_layer_types(config)
    if moe:
        config.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_width,
                      shared_expert_intermediate_size=shared_width)
    else:
        config["intermediate_size"] = intermediate
    return config


PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.8-27b": _text_config(layers=64, hidden=5120, intermediate=17408, heads=24, kv_heads=4, head_dim=256,
                                k_heads=16, v_heads=48, k_dim=128, v_dim=128, vocab=QWEN_VOCAB, tied=False),
    "qwen3.6-35b-a3b": _text_config(layers=40, hidden=2048, heads=16, kv_heads=2, head_dim=256, k_heads=16,
                                    v_heads=32, k_dim=128, v_dim=128, vocab=QWEN_VOCAB, tied=False, experts=256,
                                    top_k=8, expert_width=512, shared_width=512),
    "qwen3.5-0.8b": _text_config(layers=24, hidden=1024, intermediate=3584, heads=8, kv_heads=2, head_dim=256,
                                 k_heads=16, v_heads=16, k_dim=128, v_dim=128, vocab=QWEN_VOCAB, tied=True),
    "tiny-dense": _text_config(layers=4, hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=32, k_heads=2,
                               v_heads=4, k_dim=16, v_dim=24, vocab=320, tied=False, mrope_section=(2, 1, 1)),
    "tiny-moe": _text_config(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=32, k_heads=2, v_heads=4, k_dim=16,
                             v_dim=24, vocab=320, tied=False, experts=8, top_k=2, expert_width=32, shared_width=48,
                             mrope_section=(2, 1, 1)),
}


def checkpoint_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the transformers text-layout checkpoint (experts fused, one MTP layer) of `config`."""
    c = config
    h, v = c["hidden_size"], c["vocab_size"]
    hd, nh, kvh = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    key_rows = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value_rows = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    hv = c["linear_num_value_heads"]
    moe = "num_experts" in c
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}

    def layer(prefix: str, layer_type: str) -> None:
        shapes[f"{prefix}input_layernorm.weight"] = (h,)
        shapes[f"{prefix}post_attention_layernorm.weight"] = (h,)
        if layer_type == "full_attention":
            a = f"{prefix}self_attn."
            shapes.update({f"{a}q_proj.weight": (2 * nh * hd, h), f"{a}k_proj.weight": (kvh * hd, h),
                           f"{a}v_proj.weight": (kvh * hd, h), f"{a}o_proj.weight": (h, nh * hd),
                           f"{a}q_norm.weight": (hd,), f"{a}k_norm.weight": (hd,)})
        else:
            g = f"{prefix}linear_attn."
            conv_dim = 2 * key_rows + value_rows
            shapes.update({f"{g}in_proj_qkv.weight": (conv_dim, h), f"{g}in_proj_z.weight": (value_rows, h),
                           f"{g}in_proj_a.weight": (hv, h), f"{g}in_proj_b.weight": (hv, h),
                           f"{g}conv1d.weight": (conv_dim, 1, c["linear_conv_kernel_dim"]), f"{g}A_log": (hv,),
                           f"{g}dt_bias": (hv,), f"{g}norm.weight": (c["linear_value_head_dim"],),
                           f"{g}out_proj.weight": (h, value_rows)})
        m = f"{prefix}mlp."
        if moe:
            e, w, s = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
            shapes.update({f"{m}gate.weight": (e, h), f"{m}shared_expert_gate.weight": (1, h),
                           f"{m}experts.gate_up_proj": (e, 2 * w, h), f"{m}experts.down_proj": (e, h, w),
                           f"{m}shared_expert.gate_proj.weight": (s, h), f"{m}shared_expert.up_proj.weight": (s, h),
                           f"{m}shared_expert.down_proj.weight": (h, s)})
        else:
            i = c["intermediate_size"]
            shapes.update({f"{m}gate_proj.weight": (i, h), f"{m}up_proj.weight": (i, h),
                           f"{m}down_proj.weight": (h, i)})

    for index, layer_type in enumerate(c["layer_types"]):
        layer(f"model.layers.{index}.", layer_type)
    shapes["model.norm.weight"] = (h,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                   "mtp.pre_fc_norm_hidden.weight": (h,)})
    layer("mtp.layers.0.", "full_attention")
    shapes["mtp.norm.weight"] = (h,)
    return shapes


OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")


def _draw(name: str, shape: tuple[int, int], layers: int, generator: torch.Generator,
          device: torch.device) -> torch.Tensor:
    """Random rows [rows, columns] of the tensor `name` (see the module docstring for the rules)."""
    rows, columns = shape

    def normal(std: float) -> torch.Tensor:
        return torch.randn(rows, columns, generator=generator, device=device).mul_(std)

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.rand(rows, columns, generator=generator, device=device).mul_(high - low).add_(low)

    if name.endswith("A_log"):
        return uniform(1.0, 16.0).log_()
    if name.endswith("dt_bias"):
        step = uniform(math.log(1e-3), math.log(0.1)).exp_()
        return step + torch.log(-torch.expm1(-step))  # softplus^-1
    if name.endswith("linear_attn.norm.weight"):
        return normal(0.05).add_(1.0)
    if name.endswith("norm.weight") or name.endswith("norm_embedding.weight") or name.endswith("norm_hidden.weight"):
        return normal(0.05)
    if name.endswith("embed_tokens.weight"):
        return normal(0.02)
    fan_in = columns
    if name == "lm_head.weight":
        return normal(2.0 / math.sqrt(fan_in))
    if name.endswith("conv1d.weight"):
        return normal(1.0 / math.sqrt(fan_in))
    std = 1.0 / math.sqrt(fan_in)
    if name.endswith(OUTPUT_PROJECTIONS):
        std /= math.sqrt(2 * layers)
    return normal(std)


class SyntheticSource(TensorSource):
    """The checkpoint of a text config, generated block by block in bf16 on `device`."""

    def __init__(self, config: dict[str, Any], seed: int = 0, device: str = "cpu"):
        self.config = config
        self.seed = seed
        self.device = torch.device(device)
        self._shapes = checkpoint_shapes(config)

    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> str:
        return "BF16"

    def _block(self, name: str, index: int, rows: int, columns: int) -> torch.Tensor:
        key = hashlib.sha256(f"{self.seed}:{name}:{index}".encode()).digest()
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
        block = _draw(name, (rows, columns), self.config["num_hidden_layers"], generator, self.device)
        return block.to(torch.bfloat16)

    def read_rows(self, name: str, lead: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        shape = self._shapes[name]
        rows_per_lead, columns = matrix_rows(shape, len(lead))
        # rows of the whole tensor viewed as a matrix: leading indices flatten row-major
        base = 0
        for dim, index in zip(shape[: len(lead)], lead, strict=True):
            base = base * dim + index
        first, last = base * rows_per_lead + start, base * rows_per_lead + stop
        block_rows = max(1, BLOCK_ELEMENTS // columns)
        pieces = []
        for block in range(first // block_rows, (last - 1) // block_rows + 1):
            total_rows = math.prod(shape) // columns
            begin = block * block_rows
            rows = min(block_rows, total_rows - begin)
            data = self._block(name, block, rows, columns)
            pieces.append(data[max(first, begin) - begin : min(last, begin + rows) - begin])
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def synth_resources(config: dict[str, Any]) -> dict[str, dict[str, bytes]]:
    """Frontend files: the real Qwen3.5 vocabulary for real-vocabulary presets, else the byte tokenizer."""
    from ninfer.frontend.vocab import byte_tokenizer_files, generation_config_json, qwen_tokenizer_files

    vocab = config["vocab_size"]
    files = qwen_tokenizer_files() if vocab >= QWEN_VOCAB else byte_tokenizer_files(vocab)
    eos, pad = config["eos_token_id"], config["pad_token_id"]
    files["generation_config.json"] = generation_config_json([eos, pad], pad)
    return {"text": files}


def synth_artifact(preset: str, recipe: str, out: Path, *, seed: int = 0, device: str = "cpu",
                   artifact_id: bytes | None = None, part_cap: int = DEFAULT_PART_CAP,
                   quiet: bool = False, layers: int | None = None) -> dict[str, Any]:
    """Build the preset's artifact; `layers` keeps only its first N decoder layers (a slice at the real widths, for
    tests and quick measurements)."""
    if preset not in PRESETS:
        raise ConversionError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    config = PRESETS[preset]
    if layers is not None:
        if not 1 <= layers <= config["num_hidden_layers"]:
            raise ConversionError(f"--layers must lie in 1..{config['num_hidden_layers']} for {preset}")
        config = {**config, "num_hidden_layers": layers, "layer_types": config["layer_types"][:layers]}
    source = SyntheticSource(config, seed, str(parse_device(device)))
    plan = plan_qwen3_5(config, source)
    provenance = {"synthetic": {"preset": preset, "seed": seed}}
    return build_artifact(plan, source, synth_resources(config), recipe, out, name=f"{preset}-synth",
                          artifact_id=artifact_id, part_cap=part_cap, device=device, provenance=provenance,
                          quiet=quiet)
