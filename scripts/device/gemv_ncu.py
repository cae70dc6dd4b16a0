"""One GEMV shape called repeatedly (every call on a different copy of the matrix, so L2 never holds it), for
`ncu` to profile a few launches: `ncu --clock-control none -k regex:_gemv --launch-skip 10 --launch-count 2
--section SpeedOfLight --section WarpStateStats ... python3 scripts/device/gemv_ncu.py N K FMT [TOKENS]`."""

import itertools
import sys

import torch
from device_timing import rotating_copies

from ninfer.kernels.quant_linear import quant_linear_gemv
from ninfer.quant import codec_for

n, k, fmt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 1
data = codec_for(fmt).encode(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
copies = itertools.cycle(rotating_copies(data, 15))
x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
for _ in range(16):
    quant_linear_gemv(x, next(copies), (n, k), fmt, out_dtype=torch.bfloat16)
torch.cuda.synchronize()
