"""Test-session settings. Without a GPU, Triton kernels run in Triton's interpreter; the switch must be set before
anything imports triton (transformers and torch may do so early), hence here."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
