#!/usr/bin/env bash
# On the GPU machine: the GPU tests, then `ninfer bench` on synthetic presets.
# Usage: bash scripts/device/fast.sh [tests | tests=PATH,PATH | PRESET:RECIPE:BENCH-FLAGS ...]
#   tests: every test marked `gpu` (`python3 -m pytest -q -m gpu tests`, WORKERS processes, default 8: the tests
#   share the GPU); tests=PATHS: the `gpu`-marked tests under those paths only.
#   PRESET:RECIPE:BENCH-FLAGS: `ninfer bench` of a synthetic artifact (made once per machine by `common.sh`).
#   e.g. bash scripts/device/fast.sh tests "qwen3.8-27b:q4:-p 128 -n 24 -b 1,8"
# Each job's output also goes to $OUT (tests-N.log, bench-N-PRESET-RECIPE.log; N: the job's place in the arguments).
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
    tests) paths="tests" ;;
    tests=*) paths="${job#tests=}"; paths="${paths//,/ }" ;;
    *) paths="" ;;
  esac
  if [ -n "$paths" ]; then
    # shellcheck disable=SC2086
    python3 -m pytest -q -n "${WORKERS:-8}" -m gpu $paths 2>&1 | tee "$OUT/tests-$index.log" \
      | grep -E "passed|failed|FAILED|Error" | head -40
    continue
  fi
  IFS=: read -r preset recipe flags <<<"$job"
  path=$(artifact "$preset" "$recipe")
  # shellcheck disable=SC2086
  python3 -m ninfer bench "$path" --device cuda $flags 2>&1 | tee "$OUT/bench-$index-$preset-$recipe.log" | grep -v "^loading"
done
