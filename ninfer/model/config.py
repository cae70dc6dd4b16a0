"""The Qwen3.5 text model's dimensions, read from an artifact's `text` component config (HF field names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ninfer.errors import NinferError

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


class ModelConfigError(NinferError):
    """The artifact's config lacks a field the model needs or holds an unsupported value."""


@dataclass(frozen=True)
class TextConfig:
    hidden: int
    vocab: int
    layer_types: tuple[str, ...]
    heads: int
    kv_heads: int
    head_dim: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    rms_eps: float
    rotary_dim: int
    rope_theta: float
    mrope_section: tuple[int, ...] | None
    max_positions: int
    tied: bool
    moe: bool
    intermediate: int = 0
    experts: int = 0
    top_k: int = 0
    expert_width: int = 0
    shared_width: int = 0

    @property
    def layers(self) -> int:
        return len(self.layer_types)

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> TextConfig:
        def need(key: str) -> Any:
            if key not in cfg:
                raise ModelConfigError(f"the text config lacks {key!r}")
            return cfg[key]

        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10_000.0)))
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        head_dim = int(need("head_dim"))
        section = rope.get("mrope_section")
        moe = "num_experts" in cfg
        layer_types = tuple(need("layer_types"))
        if any(t not in (FULL_ATTENTION, LINEAR_ATTENTION) for t in layer_types):
            raise ModelConfigError(f"unsupported layer types {sorted(set(layer_types))}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"hidden_act {act!r} is not supported (Qwen3.5 uses silu)")
        config = cls(
            hidden=int(need("hidden_size")), vocab=int(need("vocab_size")), layer_types=layer_types,
            heads=int(need("num_attention_heads")), kv_heads=int(need("num_key_value_heads")), head_dim=head_dim,
            k_heads=int(need("linear_num_key_heads")), v_heads=int(need("linear_num_value_heads")),
            k_dim=int(need("linear_key_head_dim")), v_dim=int(need("linear_value_head_dim")),
            conv_kernel=int(need("linear_conv_kernel_dim")), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rotary_dim=int(head_dim * partial), rope_theta=theta,
            mrope_section=tuple(section) if section else None,
            max_positions=int(cfg.get("max_position_embeddings", 262_144)),
            tied=bool(cfg.get("tie_word_embeddings", False)), moe=moe,
            intermediate=0 if moe else int(need("intermediate_size")),
            experts=int(cfg.get("num_experts", 0)), top_k=int(cfg.get("num_experts_per_tok", 0)),
            expert_width=int(cfg.get("moe_intermediate_size", 0)),
            shared_width=int(cfg.get("shared_expert_intermediate_size", 0)),
        )
        if config.v_heads % config.k_heads:
            raise ModelConfigError(f"linear_num_value_heads {config.v_heads} is not a multiple of "
                                   f"linear_num_key_heads {config.k_heads}")
        if config.heads % config.kv_heads:
            raise ModelConfigError(f"num_attention_heads {config.heads} is not a multiple of "
                                   f"num_key_value_heads {config.kv_heads}")
        return config
