"""The oracle of the fast path's integer GEMV: the reference model whose products with groupwise matrices see the
int8 image of their input (`activation_quant`), as the fast path's decode and verify steps (and its head) do.

Inside `int8_activations(reference, path)`, `x @ W.T` and `F.linear(x, W)` with W (or a slice of it, an MoE
expert) decoded from a groupwise object, for x of at most MAX_GEMV_TOKENS rows, multiply `dequantize(quantize(x))`
instead of x; every other product is untouched. Use it around the reference's decode steps, and with `head_only`
around a prefill (the fast path's prefill keeps x as it is except in the head)."""

from __future__ import annotations

import contextlib

import torch

from ninfer.artifact.reader import Artifact
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

