"""Codecs on CUDA (run on the GPU machine with `pytest -m gpu`): the encoder gives the same bytes as on the CPU
(so an artifact quantized on a GPU is the artifact quantized on a CPU) and the decoder the same values."""

from __future__ import annotations

import pytest
import torch

from ninfer.quant import codec_for, registered_formats

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPES = [(1, 1), (3, 63), (17, 129), (256, 5120), (1024, 2048), (2048, 512)]


@pytest.mark.parametrize("fmt", registered_formats())
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_encode_and_decode_equal_cpu(fmt, shape):
    codec = codec_for(fmt)
    generator = torch.Generator().manual_seed(hash((fmt, shape)) & 0xFFFF)
    if fmt == "i32":
        source = torch.randint(-(2**31), 2**31 - 1, shape, generator=generator, dtype=torch.int32)
    else:
        source = torch.randn(shape, generator=generator) * torch.logspace(-6, 2, shape[-1])  # wide dynamic range
    cpu = codec.encode(source)
    gpu = codec.encode(source.cuda())
    assert torch.equal(cpu, gpu.cpu()), f"{fmt} {shape}: the CUDA encoder differs from the CPU encoder"
    decoded_cpu = codec.decode(cpu, shape)
    decoded_gpu = codec.decode(cpu.cuda(), shape)
    assert decoded_gpu.device.type == "cuda"
    assert torch.equal(decoded_cpu, decoded_gpu.cpu())
