"""ninfer: a PyTorch + Triton inference engine for Qwen3.5-family models from `.ninfer` artifacts."""

__version__ = "0.1.0"
