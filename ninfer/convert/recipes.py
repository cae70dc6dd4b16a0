"""Recipes: which stored format each object gets, by the object's role.

Roles name what a tensor is in the model (`attention.query_key`, `mlp.down`, `norm`, ...); the converter's
plan assigns them. Small or precision-critical tensors (norms, the GDN convolution, decay parameters,
the a/b projections, the MoE router, vision biases and position table) stay in a plain format in every
recipe; the recipes differ in how they store the large matrices.

`q4` follows upstream NInfer's Qwen3.6-27B mix: q4 for the matrices that feed gated or normalised paths
(query/key, gate/up), q5 for the rest of the projections, q6 for the token embedding, output head and
vision patch embedding, and q8 for the MTP head and the vision merger.
"""

from __future__ import annotations

from ninfer.errors import ConversionError

RECIPES = ("bf16", "fp32", "fp8", "q8", "q4")

PLAIN_ROLES = {"norm", "gdn.conv", "gdn.a_b", "moe.router", "vision.bias", "vision.norm",
               "vision.position_embedding"}
DECAY_ROLES = {"gdn.decay"}  # A_log and dt_bias: fp32 always, as the reference computes the decay in fp32
MATRIX_ROLES = {
    "embedding", "head", "attention.query_key", "attention.gate_value", "attention.output",
    "gdn.query_key", "gdn.value_z", "gdn.output", "mlp.gate_up", "mlp.down", "moe.gate_up", "moe.down",
    "moe.shared_gate_up", "moe.shared_down", "mtp.input_projection", "vision.patch_embedding",
    "vision.qkv", "vision.output", "vision.fc1", "vision.fc2", "vision.merger",
}
ROLES = PLAIN_ROLES | DECAY_ROLES | MATRIX_ROLES

Q4_MIX = {
    "q4_g64_fp16": {"attention.query_key", "gdn.query_key", "mlp.gate_up", "moe.gate_up", "moe.shared_gate_up",
                    "vision.qkv", "vision.fc1"},
    "q5_g64_fp16": {"attention.gate_value", "attention.output", "gdn.value_z", "gdn.output", "mlp.down",
                    "moe.down", "moe.shared_down", "vision.output", "vision.fc2"},
    "q6_g64_fp16": {"embedding", "head", "vision.patch_embedding"},
    "q8_g32_fp16": {"mtp.input_projection", "vision.merger"},
}
WHOLE_RECIPE_FORMAT = {"bf16": "bf16", "fp32": "fp32", "fp8": "fp8_e4m3fn_row_bf16", "q8": "q8_g32_fp16"}


def check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ConversionError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")


def format_for(recipe: str, role: str, component: str) -> str:
    """The stored format of an object with this role in this component under `recipe`."""
    check_recipe(recipe)
    if role not in ROLES:
        raise ValueError(f"no recipe rule for role {role!r}")
    if role in DECAY_ROLES:
        return "fp32"
    if role in PLAIN_ROLES:
        return "fp32" if recipe == "fp32" else "bf16"
    if recipe != "q4":
        return WHOLE_RECIPE_FORMAT[recipe]
    if component == "mtp":  # upstream keeps the whole MTP head at 8 bits: drafts must stay accurate
        return "q8_g32_fp16"
    for fmt, roles in Q4_MIX.items():
        if role in roles:
            return fmt
    raise AssertionError(f"q4 recipe misses role {role!r}")
