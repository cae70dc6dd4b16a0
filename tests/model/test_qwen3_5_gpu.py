"""The reference model on CUDA (run on the GPU machine with `pytest -m gpu`): same logits and the same greedy
tokens as on the CPU."""

from __future__ import annotations

import pytest
import torch

from ninfer.engine import LLM
from ninfer.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FP32_LOGITS_ATOL = 2e-4


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_cuda_logits_and_greedy_tokens_equal_cpu(tmp_path, preset):
    from ninfer.convert.synth import synth_artifact

    path = tmp_path / f"{preset}.ninfer"
    synth_artifact(preset, "q8", path, quiet=True)
    cpu, cuda = LLM(path, dtype=torch.float32), LLM(path, device="cuda", dtype=torch.float32)
    ids = torch.randint(0, 289, (150,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = cpu.model.prefill(ids, cpu.model.new_state(150), all_logits=True)
        logits = cuda.model.prefill(ids.cuda(), cuda.model.new_state(150), all_logits=True)
    torch.testing.assert_close(logits.cpu(), expected, atol=FP32_LOGITS_ATOL, rtol=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    assert cuda.generate("Hello", greedy).token_ids == cpu.generate("Hello", greedy).token_ids


def test_bf16_on_cuda_generates():
    llm = LLM(device="cuda")  # the embedded demo model, bf16 by default on CUDA
    assert llm.dtype == torch.bfloat16
    completion = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert len(completion.token_ids) == 16
