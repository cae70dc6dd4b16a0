"""ninfer: a PyTorch + Triton inference engine for Qwen3.5-family models from `.ninfer` artifacts.

    import ninfer
    llm = ninfer.LLM()                      # the embedded demo model; or LLM("model.ninfer", device="cuda")
    print(llm.generate("Hello", ninfer.SamplingParams(temperature=0)).text)
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # lazy: `ninfer inspect` and friends should not pay for the runtime's imports
    if name == "LLM":
        from ninfer.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from ninfer.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'ninfer' has no attribute {name!r}")
