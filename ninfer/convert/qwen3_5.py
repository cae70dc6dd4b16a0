"""The conversion plan of Qwen3.5-family checkpoints: which source rows make each artifact object.

Accepted architectures: Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM,
Qwen3_5MoeForConditionalGeneration; tensor prefixes `model.language_model.` (official layout) or `model.`
(transformers' save_pretrained layout); MoE experts fused (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]) or one tensor per expert; tied or untied embeddings; optional `mtp.*` and
`model.visual.*`. Object ids and row orders are the artifact's contract with the runtime
(docs/artifact-format.md, "Qwen3.5 objects"):

    attention/query_key   [nh*hd + kvh*hd, H]  query rows of q_proj (per head: its first hd rows), then k_proj
    attention/gate_value  [nh*hd + kvh*hd, H]  gate rows of q_proj (per head: its second hd rows), then v_proj
    gdn/query_key         [2*Hk*Dk, H]         in_proj_qkv rows [q | k]
    gdn/value_z           [2*Hv*Dv, H]         in_proj_qkv v rows, then in_proj_z
    gdn/a_b_projection    [2*Hv, H]            in_proj_a, then in_proj_b
    gdn/convolution       [conv_dim, K]        conv1d.weight without its singleton dim
    mlp/gate_up           [2I, H]              gate_proj, then up_proj
    moe/router_shared_gate [E+1, H]            router rows, then shared_expert_gate
    moe/routed_gate_up    [E*2I, H]            expert e: rows [e*2I, e*2I+I) gate, then I rows up
    moe/routed_down       [E*H, I]             expert e: rows [e*H, (e+1)*H)
Norm weights are stored as in the checkpoint (zero-centred: the runtime computes x̂·(1+w); the GDN gated
norm's weight is plain). Every source tensor lands in exactly one object, or the plan is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ninfer.convert.source import TensorSource, matrix_rows
from ninfer.errors import ConversionError
from ninfer.model.config import ModelConfigError, TextConfig

ARCHITECTURES = {  # architecture -> mixture of experts?
    "Qwen3_5ForCausalLM": False,
    "Qwen3_5ForConditionalGeneration": False,
    "Qwen3_5MoeForCausalLM": True,
    "Qwen3_5MoeForConditionalGeneration": True,
}
VISION_ROLES = (  # (substring of the source name, role), first match wins
    ("patch_embed.proj.weight", "vision.patch_embedding"),
    ("pos_embed.weight", "vision.position_embedding"),
    ("merger.linear_fc", "vision.merger"),
    ("attn.qkv.weight", "vision.qkv"),
    ("attn.proj.weight", "vision.output"),
    ("mlp.linear_fc1.weight", "vision.fc1"),
    ("mlp.linear_fc2.weight", "vision.fc2"),
)


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of source tensor `tensor` after indexing its leading dims with `lead`."""

    tensor: str
    start: int
    stop: int
    lead: tuple[int, ...] = ()

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ObjectPlan:
    id: str
    shape: tuple[int, ...]
    role: str
    pieces: tuple[Piece, ...]

    @property
    def component(self) -> str:
        return self.id.split("/", 1)[0]

    @property
    def sources(self) -> list[str]:
        return list(dict.fromkeys(p.tensor for p in self.pieces))


@dataclass
class ModelPlan:
    architecture: str
    layout: str  # "official" or "text"
    moe: bool
    components: dict[str, dict[str, Any]]
    objects: list[ObjectPlan] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)  # source tensor -> object id it duplicates


def _require(config: dict[str, Any], key: str, where: str) -> Any:
    if key not in config:
        raise ConversionError(f"config.json lacks {where}{key}")
    return config[key]


def resolve_layer_types(cfg: dict[str, Any]) -> list[str]:
    """Explicit `layer_types` wins; otherwise every `full_attention_interval`-th layer (default 4) is attention."""
    count = int(_require(cfg, "num_hidden_layers", "text config "))
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(count)]
    if len(types) != count or any(t not in ("full_attention", "linear_attention") for t in types):
        raise ConversionError(f"config.json: layer_types must list {count} entries of full_attention / "
                              "linear_attention")
    return list(types)


class _Planner:
    def __init__(self, source: TensorSource, dims: TextConfig, moe: bool):
        self.source = source
        self.dims = dims
        self.moe = moe
        self.names = set(source.names())
        self.used: set[str] = set()
        self.objects: list[ObjectPlan] = []

    def tensor(self, name: str, shape: tuple[int, ...]) -> str:
        if name not in self.names:
            raise ConversionError(f"source tensor {name!r} is missing")
        actual = self.source.shape(name)
        if actual != shape:
            raise ConversionError(f"source tensor {name!r} has shape {list(actual)}, the config implies "
                                  f"{list(shape)}")
        if name in self.used:
            raise ConversionError(f"source tensor {name!r} would be stored twice")
        self.used.add(name)
        return name

    def whole(self, name: str, shape: tuple[int, ...], lead: tuple[int, ...] = ()) -> Piece:
        rows, _ = matrix_rows(shape, len(lead))
        return Piece(name, 0, rows, lead)

    def vector(self, object_id: str, role: str, name: str, size: int) -> None:
        self.tensor(name, (size,))
        self.objects.append(ObjectPlan(object_id, (size,), role, (Piece(name, 0, 1),)))

    def matrix(self, object_id: str, role: str, parts: list[tuple[str, tuple[int, ...]]]) -> None:
        """An object made of whole source matrices stacked by rows."""
        pieces = [self.whole(self.tensor(name, shape), shape) for name, shape in parts]
        self.objects.append(ObjectPlan(object_id, (sum(p.rows for p in pieces), parts[0][1][-1]), role,
                                       tuple(pieces)))

    # -- layers -----------------------------------------------------------------------------------------------

    def attention(self, src: str, dst: str) -> None:
        d = self.dims
        q_name = self.tensor(f"{src}q_proj.weight", (2 * d.heads * d.head_dim, d.hidden))
        k_name = self.tensor(f"{src}k_proj.weight", (d.kv_heads * d.head_dim, d.hidden))
        v_name = self.tensor(f"{src}v_proj.weight", (d.kv_heads * d.head_dim, d.hidden))
        hd = d.head_dim
        rows = (d.heads + d.kv_heads) * hd
        # q_proj is per head [query (hd rows) | gate (hd rows)]: a per-head split, not two flat halves
        query = [Piece(q_name, 2 * hd * j, 2 * hd * j + hd) for j in range(d.heads)]
        gate = [Piece(q_name, 2 * hd * j + hd, 2 * hd * (j + 1)) for j in range(d.heads)]
        kv_rows = d.kv_heads * hd
        self.objects.append(ObjectPlan(f"{dst}attention/query_key", (rows, d.hidden), "attention.query_key",
                                       (*query, Piece(k_name, 0, kv_rows))))
        self.objects.append(ObjectPlan(f"{dst}attention/gate_value", (rows, d.hidden), "attention.gate_value",
                                       (*gate, Piece(v_name, 0, kv_rows))))
        self.matrix(f"{dst}attention/output", "attention.output", [(f"{src}o_proj.weight",
                                                                     (d.hidden, d.heads * hd))])
        self.vector(f"{dst}attention/query_norm", "norm", f"{src}q_norm.weight", hd)
        self.vector(f"{dst}attention/key_norm", "norm", f"{src}k_norm.weight", hd)

    def gated_deltanet(self, src: str, dst: str) -> None:
        d = self.dims
        key_rows, value_rows = d.k_heads * d.k_dim, d.v_heads * d.v_dim
        conv_dim = 2 * key_rows + value_rows
        qkv = self.tensor(f"{src}in_proj_qkv.weight", (conv_dim, d.hidden))
        z = self.tensor(f"{src}in_proj_z.weight", (value_rows, d.hidden))
        self.objects.append(ObjectPlan(f"{dst}gdn/query_key", (2 * key_rows, d.hidden), "gdn.query_key",
                                       (Piece(qkv, 0, 2 * key_rows),)))
        self.objects.append(ObjectPlan(f"{dst}gdn/value_z", (2 * value_rows, d.hidden), "gdn.value_z",
                                       (Piece(qkv, 2 * key_rows, conv_dim), Piece(z, 0, value_rows))))
        self.matrix(f"{dst}gdn/a_b_projection", "gdn.a_b", [(f"{src}in_proj_a.weight", (d.v_heads, d.hidden)),
                                                             (f"{src}in_proj_b.weight", (d.v_heads, d.hidden))])
        conv = self.tensor(f"{src}conv1d.weight", (conv_dim, 1, d.conv_kernel))
        self.objects.append(ObjectPlan(f"{dst}gdn/convolution", (conv_dim, d.conv_kernel), "gdn.conv",
                                       (Piece(conv, 0, conv_dim),)))
        self.vector(f"{dst}gdn/a_log", "gdn.decay", f"{src}A_log", d.v_heads)
        self.vector(f"{dst}gdn/dt_bias", "gdn.decay", f"{src}dt_bias", d.v_heads)
        self.vector(f"{dst}gdn/norm", "norm", f"{src}norm.weight", d.v_dim)
        self.matrix(f"{dst}gdn/output", "gdn.output", [(f"{src}out_proj.weight", (d.hidden, value_rows))])

    def dense_mlp(self, src: str, dst: str) -> None:
        d = self.dims
        self.matrix(f"{dst}mlp/gate_up", "mlp.gate_up", [(f"{src}gate_proj.weight", (d.intermediate, d.hidden)),
                                                         (f"{src}up_proj.weight", (d.intermediate, d.hidden))])
        self.matrix(f"{dst}mlp/down", "mlp.down", [(f"{src}down_proj.weight", (d.hidden, d.intermediate))])

    def moe_mlp(self, src: str, dst: str) -> None:
        d = self.dims
        e, width, h = d.experts, d.expert_width, d.hidden
        self.matrix(f"{dst}moe/router_shared_gate", "moe.router", [(f"{src}gate.weight", (e, h)),
                                                                   (f"{src}shared_expert_gate.weight", (1, h))])
        fused = f"{src}experts.gate_up_proj"
        if fused in self.names:
            gate_up = self.tensor(fused, (e, 2 * width, h))
            down = self.tensor(f"{src}experts.down_proj", (e, h, width))
            gate_up_pieces = [Piece(gate_up, 0, 2 * width, (x,)) for x in range(e)]
            down_pieces = [Piece(down, 0, h, (x,)) for x in range(e)]
        else:
            gate_up_pieces, down_pieces = [], []
            for x in range(e):
                prefix = f"{src}experts.{x}."
                gate_up_pieces.append(Piece(self.tensor(f"{prefix}gate_proj.weight", (width, h)), 0, width))
                gate_up_pieces.append(Piece(self.tensor(f"{prefix}up_proj.weight", (width, h)), 0, width))
                down_pieces.append(Piece(self.tensor(f"{prefix}down_proj.weight", (h, width)), 0, h))
        self.objects.append(ObjectPlan(f"{dst}moe/routed_gate_up", (e * 2 * width, h), "moe.gate_up",
                                       tuple(gate_up_pieces)))
        self.objects.append(ObjectPlan(f"{dst}moe/routed_down", (e * h, width), "moe.down", tuple(down_pieces)))
        s = d.shared_width
        self.matrix(f"{dst}moe/shared_gate_up", "moe.shared_gate_up",
                    [(f"{src}shared_expert.gate_proj.weight", (s, h)), (f"{src}shared_expert.up_proj.weight", (s, h))])
        self.matrix(f"{dst}moe/shared_down", "moe.shared_down", [(f"{src}shared_expert.down_proj.weight", (h, s))])

    def decoder_layer(self, src: str, dst: str, layer_type: str) -> None:
        h = self.dims.hidden
        self.vector(f"{dst}input_norm", "norm", f"{src}input_layernorm.weight", h)
        if layer_type == "full_attention":
            self.attention(f"{src}self_attn.", dst)
        else:
            self.gated_deltanet(f"{src}linear_attn.", dst)
        self.vector(f"{dst}post_attention_norm", "norm", f"{src}post_attention_layernorm.weight", h)
        if self.moe:
            self.moe_mlp(f"{src}mlp.", dst)
        else:
            self.dense_mlp(f"{src}mlp.", dst)

    def vision(self, names: list[str]) -> None:
        for name in sorted(names, key=_natural_key):
            shape = self.source.shape(name)
            object_id = "vision/" + name.removeprefix("model.visual.").replace(".", "/")
            if name.endswith(".bias"):
                role = "vision.bias"
            elif "norm" in name.rsplit(".", 2)[-2]:
                role = "vision.norm"
            else:
                role = next((r for key, r in VISION_ROLES if key in name), "")
            if not role:
                continue  # left unconsumed: reported as a tensor no rule takes
            self.tensor(name, shape)
            if len(shape) == 1:
                self.objects.append(ObjectPlan(object_id, shape, role, (Piece(name, 0, 1),)))
            else:  # a Conv3d patch embedding [E, C, T, P, P] is stored as the matrix [E, C*T*P*P]
                rows, columns = matrix_rows(shape, 0)
                self.objects.append(ObjectPlan(object_id, (rows, columns), role, (Piece(name, 0, rows),)))


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def plan_qwen3_5(config: dict[str, Any], source: TensorSource) -> ModelPlan:
    """The full object plan of a Qwen3.5 checkpoint, or ConversionError naming what does not fit."""
    architectures = config.get("architectures") or []
    architecture = architectures[0] if architectures else None
    if architecture not in ARCHITECTURES:
        raise ConversionError(f"unknown architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    moe = ARCHITECTURES[architecture]
    text_cfg = config.get("text_config", config)
    where = "text_config." if "text_config" in config else ""
    layer_types = resolve_layer_types(text_cfg)
    try:
        dims = TextConfig.from_dict({**text_cfg, "layer_types": layer_types})
    except ModelConfigError as exc:
        raise ConversionError(f"config.json ({where.rstrip('.') or 'the text config'}): {exc}") from None
    if dims.moe != moe:
        raise ConversionError(f"config.json: {architecture} {'needs' if moe else 'must not have'} num_experts")
    names = source.names()
    official = any(n.startswith("model.language_model.") for n in names)
    prefix = "model.language_model." if official else "model."
    planner = _Planner(source, dims, moe)

    h, v = dims.hidden, dims.vocab
    embed = planner.tensor(f"{prefix}embed_tokens.weight", (v, h))
    planner.objects.append(ObjectPlan("text/token_embedding", (v, h), "embedding", (Piece(embed, 0, v),)))
    for i, layer_type in enumerate(layer_types):
        planner.decoder_layer(f"{prefix}layers.{i}.", f"text/layers/{i}/", layer_type)
    planner.vector("text/final_norm", "norm", f"{prefix}norm.weight", h)

    tied = bool(text_cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    aliases = {}
    if "lm_head.weight" not in planner.names:
        tied = True  # save_pretrained omits a tied head
    elif tied:
        head = planner.tensor("lm_head.weight", (v, h))
        if not torch.equal(source.read_rows(head, (), 0, v), source.read_rows(embed, (), 0, v)):
            raise ConversionError("config.json ties the embeddings, but lm_head.weight differs from "
                                  f"{embed}; untie them in the config or drop lm_head.weight")
        aliases[head] = "text/token_embedding"
    else:
        head = planner.tensor("lm_head.weight", (v, h))
        planner.objects.append(ObjectPlan("text/output_head", (v, h), "head", (Piece(head, 0, v),)))

    text_config = dict(text_cfg)
    text_config.update(architectures=["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
                       model_type="qwen3_5_moe_text" if moe else "qwen3_5_text", layer_types=layer_types,
                       tie_word_embeddings=tied)
    components: dict[str, dict[str, Any]] = {"text": {"config": text_config}}

    mtp_names = [n for n in names if n.startswith("mtp.")]
    if mtp_names:
        layers = int(text_cfg.get("mtp_num_hidden_layers", 1))
        planner.matrix("mtp/input_projection", "mtp.input_projection", [("mtp.fc.weight", (h, 2 * h))])
        planner.vector("mtp/embedding_norm", "norm", "mtp.pre_fc_norm_embedding.weight", h)
        planner.vector("mtp/hidden_norm", "norm", "mtp.pre_fc_norm_hidden.weight", h)
        for j in range(layers):
            planner.decoder_layer(f"mtp.layers.{j}.", f"mtp/layers/{j}/", "full_attention")
        planner.vector("mtp/final_norm", "norm", "mtp.norm.weight", h)
        components["mtp"] = {"config": {
            "num_hidden_layers": layers,
            "layer_types": ["full_attention"] * layers,
            "use_dedicated_embeddings": bool(text_cfg.get("mtp_use_dedicated_embeddings", False)),
            "input_order": ["embedding", "hidden"],
        }}

    vision_names = [n for n in names if n.startswith("model.visual.")]
    if vision_names:
        if "vision_config" not in config:
            raise ConversionError("the checkpoint has model.visual.* tensors but config.json has no vision_config")
        planner.vision(vision_names)
        vision_config = dict(config["vision_config"])
        for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            if key in config:
                vision_config[key] = config[key]
        components["vision"] = {"config": vision_config}

    unused = sorted(set(names) - planner.used - set(aliases), key=_natural_key)
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise ConversionError(f"source tensor {unused[0]!r}{more} is not consumed by any rule of the "
                              f"{architecture} plan")
    return ModelPlan(architecture, "official" if official else "text", moe, components, planner.objects, aliases)
