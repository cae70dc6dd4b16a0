"""The oracle of the fast path's decode steps: the reference model whose products with groupwise matrices see the
int8 image of their input (`activation_quant`), as the fast path's integer GEMV does in decode and verify steps.

Inside `int8_activations(reference, path)`, `x @ W.T` and `F.linear(x, W)` with W (or a slice of it, an MoE
expert) decoded from a groupwise object multiply `dequantize(quantize(x))` instead of x; every other product is
untouched. Use it around
the reference's decode steps only (prefill on the fast path keeps x as it is)."""

from __future__ import annotations

import contextlib

import torch

from ninfer.artifact.reader import Artifact
from ninfer.kernels.activation_quant import dequantize_activations, quantize_activations_reference
from ninfer.model.qwen3_5 import Qwen35Model
from ninfer.quant import codec_for
from ninfer.quant.groupwise import GroupwiseCodec


def int8_image(x: torch.Tensor) -> torch.Tensor:
    """x `[T, K]` or `[K]` as the integer GEMV sees it."""
    rows = x.reshape(-1, x.shape[-1])
    return dequantize_activations(quantize_activations_reference(rows))[:, : x.shape[-1]].to(x.dtype).view(x.shape)


@contextlib.contextmanager
def int8_activations(reference: Qwen35Model, path: str):
    """The oracle context for `reference`, loaded from the artifact at `path`."""
    with Artifact.open(path) as artifact:
        groupwise = {obj.id.removeprefix("text/") for obj in artifact.objects
                     if obj.kind == "tensor" and isinstance(codec_for(obj.format), GroupwiseCodec)}
    storages = {weight.untyped_storage().data_ptr() for name, weight in reference.weights.items() if name in groupwise}
    matmul, linear = torch.Tensor.__matmul__, torch.nn.functional.linear

    def image(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        grouped = x.dim() <= 2 and weight.dim() == 2 and weight.untyped_storage().data_ptr() in storages
        return int8_image(x) if grouped else x

    torch.Tensor.__matmul__ = lambda x, other: matmul(image(x, other), other)
    torch.nn.functional.linear = lambda x, weight, bias=None: linear(image(x, weight), weight, bias)
    try:
        yield
    finally:
        torch.Tensor.__matmul__, torch.nn.functional.linear = matmul, linear
