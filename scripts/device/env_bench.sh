#!/usr/bin/env bash
# On the GPU machine: `ninfer bench` of this tree under several environment settings, the runs interleaved.
# Usage: bash scripts/device/env_bench.sh ROUNDS PRESET:RECIPE:BENCH-FLAGS "NAME VAR=VALUE ..." ...
#   e.g. bash scripts/device/env_bench.sh 2 "qwen3.8-27b:q4:-p 128 -n 24 -b 1,8" "shipped" \
#          "prefetch8 NINFER_L2_PREFETCH_MIB=8" "batch-route NINFER_STRIPES=0"
#   Each round runs every setting once, in the order given; a line per run (`bench_line.py`), logs in $OUT.
set -uo pipefail
rounds=$1; job=$2; shift 2
source scripts/device/common.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=".${SITE:+:$SITE}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
IFS=: read -r preset recipe flags <<<"$job"
path=$(artifact "$preset" "$recipe")
for round in $(seq "$rounds"); do
  for setting in "$@"; do
    read -r name assignments <<<"$setting"
    log="$OUT/env-$preset-$name-$round.log"
    # shellcheck disable=SC2086
    env $assignments python3 -m ninfer bench "$path" --device cuda $flags --json >"$log.json" 2>"$log"
    python3 scripts/device/bench_line.py "$name" "$log.json"
  done
done
