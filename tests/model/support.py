"""The oracle of the fast path's integer GEMV: the reference model whose products with groupwise matrices see the
int8 image of their input (`activation_quant`), as the fast path's decode and verify steps (and its head) do.

Inside `int8_activations(reference, path)`, `x @ W.T` and `F.linear(x, W)` with W (or a slice of it, an MoE
expert) decoded from a groupwise object, for x of at most MAX_GEMV_TOKENS rows, multiply `dequantize(quantize(x))`
instead of x; every other product is untouched. Use it around the reference's decode steps, and with `head_only`
around a prefill (the fast path's prefill keeps x as it is except in the head).

`small_artifact` writes the small random-weight models the fast path's CPU tests run under the interpreter."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ninfer.artifact.reader import Artifact
from ninfer.config import CacheConfig
from ninfer.engine.load import load_packed
from ninfer.engine.runner import GraphRunner
from ninfer.kernels.activation_quant import dequantize_activations, quantize_activations_reference
from ninfer.kernels.quant_linear import MAX_GEMV_TOKENS
from ninfer.model.qwen3_5 import Qwen35Model
from ninfer.quant import codec_for
from ninfer.quant.groupwise import GroupwiseCodec


def int8_image(x: torch.Tensor) -> torch.Tensor:
    """x `[T, K]` or `[K]` as the integer GEMV sees it."""
    rows = x.reshape(-1, x.shape[-1])
    return dequantize_activations(quantize_activations_reference(rows))[:, : x.shape[-1]].to(x.dtype).view(x.shape)


@contextlib.contextmanager
def int8_activations(reference: Qwen35Model, path: str, head_only: bool = False):
    """The oracle context for `reference`, loaded from the artifact at `path`: around its decode steps; with
    `head_only`, around a prefill (whose head, reading at most MAX_GEMV_TOKENS rows, takes the integer GEMV too)."""
    with Artifact.open(path) as artifact:
        groupwise = {obj.id.removeprefix("text/") for obj in artifact.objects
                     if obj.kind == "tensor" and isinstance(codec_for(obj.format), GroupwiseCodec)}
    names = [name for name, weight in reference.weights.items() if not head_only or weight is reference.head]
    storages = {reference.weights[name].untyped_storage().data_ptr() for name in names if name in groupwise}
    matmul, linear = torch.Tensor.__matmul__, torch.nn.functional.linear

    def image(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else 1
        grouped = x.dim() <= 2 and rows <= MAX_GEMV_TOKENS and weight.dim() == 2 \
            and weight.untyped_storage().data_ptr() in storages
        return int8_image(x) if grouped else x

    torch.Tensor.__matmul__ = lambda x, other: matmul(image(x, other), other)
    torch.nn.functional.linear = lambda x, weight, bias=None: linear(image(x, weight), weight, bias)
    try:
        yield
    finally:
        torch.Tensor.__matmul__, torch.nn.functional.linear = matmul, linear


def small_artifact(path, recipe: str = "q8", moe: bool = False) -> str:
    """A random-weight artifact at widths the fast path takes (head_dim 64; K of 256 and 512, so a test that lowers
    the batch GEMV's K tile to 256 lanes sends every matrix there) and that the Triton interpreter runs in about 3 s a
    decode step: 4 layers alternating GDN and attention (each kind twice, so a pool indexed by the wrong layer
    shows), vocabulary 1,024. Written at `path`; returns it."""
    from ninfer.convert import synth

    widths = dict(experts=8, top_k=2, expert_width=64, shared_width=64) if moe else dict(intermediate=512)
    config = synth._text_config(layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, k_heads=2, v_heads=4,
                                k_dim=64, v_dim=64, vocab=1024, tied=False, **widths)
    config.update(full_attention_interval=2, layer_types=["linear_attention", "full_attention"] * 2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(synth.PRESETS, "test-small", config)
        synth.synth_artifact("test-small", recipe, path, quiet=True)
    return str(path)


def packed_model(artifact: Artifact, device: str | torch.device, *, dtype: torch.dtype = torch.bfloat16,
                 max_sequences: int = 8, max_context: int = 32768, kv_capacity: int | None = None,
                 kv_dtype: str = "bf16", state_dtype: str = "fp32", prefill_chunk: int = 4096, graphs: bool = True,
                 max_verify_tokens: int = 0, int8_activations: bool = True) -> GraphRunner:
    """The packed model behind its graph runner on any device (the CPU under the Triton interpreter included)."""
    cache = CacheConfig(kv_dtype=kv_dtype, state_dtype=state_dtype, kv_capacity=kv_capacity, sequences=max_sequences,
                        max_context=max_context, prefill_chunk=prefill_chunk)
    model = load_packed(artifact, cache, max_context, torch.device(device), dtype, graphs=graphs,
                        max_verify_tokens=max_verify_tokens, int8_activations=int8_activations)
    allocate = model.new_state

    def tracked(capacity: int):
        state = allocate(capacity)
        _LIVE.append((model, state))
        return state

    model.new_state = tracked
    return model


_LIVE: list = []  # (model, state) of every state the tests' packed models allocated


def free_test_states() -> None:
    """Free the states a test left allocated (models are shared between the tests of a module)."""
    while _LIVE:
        model, state = _LIVE.pop()
        if not state.freed:
            model.free_state(state)
