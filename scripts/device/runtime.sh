#!/usr/bin/env bash
# On the GPU machine: the runtime's GPU tests, and `ninfer run` greedy tokens on CUDA against the CPU.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pytest -q -m gpu tests/test_model_gpu.py tests/test_quant_gpu.py 2>&1 | grep -E "passed|failed|FAILED|Error"
args=(run --prompt "Hello, world" --greedy --max-new 32 --print-token-ids --no-thinking)
cpu=$(python3 -m ninfer "${args[@]}" --device cpu 2>/dev/null | tail -1)
for dtype in fp32 bf16; do
  cuda=$(python3 -m ninfer "${args[@]}" --device cuda --dtype $dtype 2>"$OUT/run-cuda-$dtype.err" | tail -1)
  tail -1 "$OUT/run-cuda-$dtype.err"
  echo "cpu fp32 ids:   $cpu"
  echo "cuda $dtype ids: $cuda"
  [ "$cpu" = "$cuda" ] && echo "ninfer run --dtype $dtype: CUDA greedy tokens equal the CPU's" \
    || echo "ninfer run --dtype $dtype: tokens differ from the CPU's"
done
