#!/usr/bin/env bash
# On the GPU machine: the fast path's GPU tests, then `ninfer bench` on synthetic presets.
# Usage: bash scripts/device/fast.sh [tests | tests=FILE,FILE | profile=PRESET | PRESET:RECIPE:BENCH-FLAGS ...]
#   e.g. bash scripts/device/fast.sh tests "qwen3.8-27b:q4:-p 512 -n 64 -b 1,8"
# Each bench job's output also goes to $OUT/bench-N-PRESET-RECIPE.log (N: the job's place in the arguments).
# Wheels in .whl (fla-core etc.) are installed to /tmp/site first when present (`common.sh`).
set -uo pipefail
source scripts/device/common.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=".${SITE:+:$SITE}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
git log --oneline -1 2>/dev/null
index=0
for job in "$@"; do
  index=$((index + 1))
  case "$job" in
    tests) files="tests/test_fast_runner_gpu.py tests/test_fast_runner.py tests/test_paged_attention_gpu.py
                  tests/test_paged_attention.py tests/test_gdn_decode_gpu.py tests/test_gdn_decode.py
                  tests/test_quant_linear_gpu.py tests/test_quant_linear.py tests/test_fp8_linear.py tests/test_fused.py
                  tests/test_dense_linear.py tests/test_stripe_linear_gpu.py tests/test_stripe_linear.py
                  tests/test_model_gpu.py tests/test_engine_gpu.py" ;;
    tests=*) files="${job#tests=}"; files="${files//,/ }" ;;
    profile=*) python3 scripts/device/profile_step.py "${job#profile=}" 2>&1 | tee "$OUT/profile-${job#profile=}.log"
               continue ;;
    *) files="" ;;
  esac
  if [ -n "$files" ]; then  # GPU-marked tests plus the kernel tests that pick CUDA by themselves
    # shellcheck disable=SC2086
    python3 -m pytest -q -rP -m "gpu or not gpu" $files 2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|FAILED|Error" \
      | head -40
    continue
  fi
  IFS=: read -r preset recipe flags <<<"$job"
  path=$(artifact "$preset" "$recipe")
  # shellcheck disable=SC2086
  python3 -m ninfer bench "$path" --device cuda $flags 2>&1 | tee "$OUT/bench-$index-$preset-$recipe.log" | grep -v "^loading"
done
